"""A mixture under torchrun: ``kiln train`` (the local launcher's torchrun agent, kiln's worker on each
rank), kiln's trainer on 2 ranks (gloo, CPU), the tiny recipe, a format-2 TrainingManifest of two
sources packed as the tokenize stage packs them and written by kiln's writer.

Proved here: the run trains on both sources in their weights' shares (result.json's ``mixture``); a
resume from its mid-run checkpoint (step 4 of 12, every later checkpoint, the result and the later
sample-log lines removed) ends with bitwise the uninterrupted run's weights, after the same global
sample ids at every step, and reports the same per-source counts. The in-process runs (reports,
metrics, refusals, one source as format 1) are ``tests/unit/training/test_train_mixture.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.refs import TrainingManifest
from kiln_trainer.config import load_recipe
from kiln_trainer.data import pack_run_tokens
from kiln_trainer.packed import load_token_manifest
from kiln_trainer.training_manifest import load_training_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
STEPS, RESUME_AT = 12, 4
OVERRIDES = (f"train.steps={STEPS}", "checkpoint.every_steps=4", "checkpoint.keep_last=10", "train.log_every=4",
             "optim.warmup_steps=2", "data.global_batch_size=16", "data.micro_batch_size=8", "parallel.strategy=ddp")


def _docs(skip: int, max_chars: int) -> list[tuple[str, str]]:
    """Stdlib modules in a fixed order, from the ``skip``-th, about ``max_chars`` of text."""
    docs, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[skip:]:
        docs.append((path.name, path.read_text(encoding="utf-8", errors="replace")))
        total += len(docs[-1][1])
        if total > max_chars:
            break
    return docs


def _source(root: Path, name: str, docs: list[tuple[str, str]], weight: float) -> dict[str, Any]:
    """One source: two parquet shards of ``docs``, packed with the tiny recipe's tokenizer as the
    tokenize stage packs them."""
    folder = root / name
    folder.mkdir()
    shards = []
    for i in range(2):
        part = docs[i::2]
        path = folder / f"train-{i}.parquet"
        pq.write_table(pa.table({"doc_id": [n for n, _ in part], "text": [t for _, t in part],
                                 "source": [name] * len(part)}), path)
        shards.append({"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows": len(part)})
    body = {"snapshot_id": hashlib.md5(name.encode()).hexdigest() + ".dir", "corpus": name, "contract": f"{name}@1",
            "shards": shards, "eval_shards": [], "quarantined": []}
    single = TrainingManifest.build(**body).write(folder / "single.json")
    ref = pack_run_tokens(load_training_manifest(single), load_recipe(TINY), run_dir=folder / "packed")
    tokens = load_token_manifest(ref.manifest)
    return {**body, "name": name, "weight": weight,
            "tokens": {"manifest": ref.manifest, "sha256": ref.sha256, "tokenizer_sha256": tokens.tokenizer["sha256"],
                       "block_size": tokens.block_size}}


@pytest.fixture(scope="module")
def mixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    sources = [_source(root, "code", _docs(0, 150_000), 0.7), _source(root, "prose", _docs(100, 60_000), 0.3)]
    return TrainingManifest.build_mixture(sources).write(root / "mixture.json")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    return env | {"PYTHONUNBUFFERED": "1", "KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "KILN_SAMPLE_LOG": "1"}


def _train(manifest: Path, run_dir: Path) -> str:
    """``kiln train`` on 2 ranks: the local launcher's torchrun agent, kiln's worker on every rank."""
    cmd = [sys.executable, "-m", "kiln.cli", "train", "--recipe", str(TINY), "--manifest", str(manifest),
           "--run-dir", str(run_dir), "--nproc-per-node", "2"]
    for item in OVERRIDES:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=_env(), cwd=REPO)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stderr[-5000:]}"
    return proc.stderr


def _global_batches(run_dir: Path) -> dict[int, list[int]]:
    """Per step, the global sample ids of both ranks in rank order (the sample log)."""
    lines = [json.loads(line) for log in sorted((run_dir / "sample-log").glob("rank-*.jsonl"))
             for line in log.read_text().splitlines()]
    steps: dict[int, list[int]] = {}
    for line in sorted(lines, key=lambda x: (x["step"], x["rank"])):
        steps.setdefault(line["step"], []).extend(line["sample_ids"])
    return steps


def test_a_mixture_trains_on_2_ranks_and_resumes_bitwise_from_a_mid_run_checkpoint(mixture: Path, tmp_path: Path):
    reference = tmp_path / "reference"
    _train(mixture, reference)
    result = json.loads((reference / "result.json").read_text())
    assert result["completed"] and result["world_size"] == 2
    manifest = load_training_manifest(mixture)
    assert result["token_manifest_sha256"] == manifest.tokens_sha256
    report = {r["name"]: r for r in result["mixture"]}
    assert sum(r["drawn"] for r in report.values()) == STEPS * 16
    assert abs(report["code"]["share"] - 0.7) <= 1 / (STEPS * 16) and report["prose"]["drawn"] > 0
    batches = _global_batches(reference)
    assert sorted(batches) == list(range(STEPS)) and all(len(ids) == 16 for ids in batches.values())
    code_samples = load_token_manifest(manifest.sources[0].tokens.manifest).samples  # type: ignore[union-attr]
    every = [i for ids in batches.values() for i in ids]
    assert sum(i < code_samples for i in every) == report["code"]["drawn"], "the log's ids say which source"

    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    for step_dir in (resumed / "checkpoints").glob("step-*"):
        if int(step_dir.name.split("-")[1]) > RESUME_AT:
            shutil.rmtree(step_dir)
    (resumed / "result.json").unlink()
    for log in (resumed / "sample-log").glob("*.jsonl"):
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] < RESUME_AT]
        log.write_text("".join(line + "\n" for line in kept))
    _train(mixture, resumed)
    for log in (resumed / "sample-log").glob("*.jsonl"):  # it went on from step 4: no step read twice
        assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(STEPS)), log.name
    again = json.loads((resumed / "result.json").read_text())
    assert again["weights_sha256"] == result["weights_sha256"], "a resume from step 4 ends with the same bits"
    assert _global_batches(resumed) == batches
    assert again["mixture"] == result["mixture"]
