"""kiln's trainer on a format-2 TrainingManifest, in process on one rank: it trains on the mixture,
reports each source in result.json and metrics.jsonl, records the mixture's identity in every
checkpoint; a manifest of one source trains bitwise as the format-1 manifest of the same tokens; a
source whose packed tokens are not what the manifest says is refused before step 1 (exit 2). The
2-rank run and its bitwise resume are ``tests/integration/test_mixture_torchrun.py``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from kiln.refs import TrainingManifest
from kiln_trainer import train as train_module
from kiln_trainer.checkpoint_manifest import verify_checkpoint
from kiln_trainer.config import load_recipe
from kiln_trainer.data import pack_run_tokens
from kiln_trainer.packed import load_token_manifest
from kiln_trainer.training_manifest import load_training_manifest

from trainer_fixtures import SHORT, TINY, canonical_json, read_result, stdlib_sources, write_shard, write_training_manifest

pytestmark = pytest.mark.slow

STEPS = ("train.steps=8", "checkpoint.every_steps=4", "train.log_every=4")


def packed_source(root: Path, name: str, docs: list[tuple[str, str]], *, weight: float = 1.0,
                  recipe: Path = TINY) -> dict[str, Any]:
    """A format-2 source entry for ``docs``: two training shards and an eval shard under
    ``root/name``, packed with ``recipe``'s tokenizer and block size."""
    folder = root / name
    folder.mkdir(parents=True)
    shards = [write_shard(folder / f"train-{i}.parquet", docs[i::2]) for i in range(2)]
    eval_shards = [write_shard(folder / "eval.parquet", docs[:2])]
    snapshot_id = hashlib.md5(name.encode()).hexdigest() + ".dir"
    single = write_training_manifest(folder / "single.json", shards, eval_shards, corpus=name, snapshot_id=snapshot_id,
                                     contract=f"{name}@1")
    ref = pack_run_tokens(load_training_manifest(single), load_recipe(recipe), run_dir=folder / "packed")
    tokens = load_token_manifest(ref.manifest)
    return {"name": name, "weight": weight, "corpus": name, "snapshot_id": snapshot_id, "contract": f"{name}@1",
            "shards": shards, "eval_shards": eval_shards, "quarantined": [],
            "tokens": {"manifest": ref.manifest, "sha256": ref.sha256, "tokenizer_sha256": tokens.tokenizer["sha256"],
                       "block_size": tokens.block_size}}


def write_mixture(path: Path, sources: list[dict[str, Any]]) -> Path:
    """The format-2 TrainingManifest of ``sources``, as kiln's writer (``build_mixture``) writes it."""
    return TrainingManifest.build_mixture(sources).write(path)


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KILN_TORCH_THREADS", "1")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("mixture")
    return [packed_source(root, "code", stdlib_sources(120_000), weight=0.75),
            packed_source(root, "prose", stdlib_sources(40_000, skip=120), weight=0.25)]


def _main(manifest: Path, run_dir: Path, *overrides: str) -> int:
    args = ["--manifest", str(manifest), "--recipe", str(TINY), "--run-dir", str(run_dir)]
    for o in (*SHORT, *STEPS, *overrides):
        args += ["--set", o]
    return train_module.main(args)


@pytest.mark.usefixtures("in_process")
def test_a_mixture_trains_and_reports_each_source(sources: list[dict], tmp_path: Path) -> None:
    manifest = write_mixture(tmp_path / "mixture.json", sources)
    read = load_training_manifest(manifest)
    run_dir = tmp_path / "run"
    assert _main(manifest, run_dir) == 0
    result = read_result(run_dir)
    assert result["completed"] and result["token_manifest_sha256"] == read.tokens_sha256
    assert result["snapshot_id"] == read.snapshot_id == ",".join(f"{s['name']}={s['snapshot_id']}" for s in sources)
    report = result["mixture"]
    assert [r["name"] for r in report] == ["code", "prose"] and [r["weight"] for r in report] == [0.75, 0.25]
    assert sum(r["drawn"] for r in report) == 8 * 16 and [r["drawn"] for r in report] == [96, 32]  # exact shares
    assert [r["share"] for r in report] == [0.75, 0.25] and [r["tokens"] for r in report] == [96 * 64, 32 * 64]
    assert [r["token_manifest_sha256"] for r in report] == [s["tokens"]["sha256"] for s in sources]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "mixture_share_code" in r]
    assert [r["step"] for r in logged] == [4, 8]
    assert logged[-1]["mixture_drawn_prose"] == 32 and logged[-1]["mixture_epoch_code"] == 0
    checkpoint = verify_checkpoint(Path(result["checkpoint"]))
    assert checkpoint["token_manifest_sha256"] == read.tokens_sha256
    assert "mixture_share_code" in (run_dir / "metrics.prom").read_text().replace("kiln_train_", "")


@pytest.mark.usefixtures("in_process")
def test_a_mixture_of_one_source_trains_bitwise_as_the_format_1_manifest_of_its_tokens(
    sources: list[dict], tmp_path: Path,
) -> None:
    code = sources[0]
    body = {"snapshot_id": code["snapshot_id"], "corpus": code["corpus"], "contract": code["contract"],
            "shards": code["shards"], "eval_shards": code["eval_shards"], "quarantined": [],
            "tokens": {"manifest": code["tokens"]["manifest"], "sha256": code["tokens"]["sha256"]}}
    old = tmp_path / "format-1.json"
    old.write_text(json.dumps({"kind": "kiln.TrainingManifest", **body,
                               "sha256": hashlib.sha256(canonical_json(body)).hexdigest()}))
    new = write_mixture(tmp_path / "format-2.json", [code])
    assert _main(old, tmp_path / "old") == 0 and _main(new, tmp_path / "new") == 0
    before, after = read_result(tmp_path / "old"), read_result(tmp_path / "new")
    assert after["weights_sha256"] == before["weights_sha256"]
    assert after["token_manifest_sha256"] == before["token_manifest_sha256"] == code["tokens"]["sha256"]
    assert "mixture" not in after and "mixture" not in before


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [({"tokenizer_sha256": "0" * 64}, "TokenizerMismatchError", "source 'code': its token manifest"),
     ({"block_size": 32}, "BlockSizeMismatchError", "source 'code': its token manifest")],
    ids=["tokenizer", "block-size"],
)
def test_a_source_whose_tokens_are_not_what_the_manifest_says_is_refused_before_step_1(
    sources: list[dict], tmp_path: Path, caplog: pytest.LogCaptureFixture, change: dict, error: str, message: str,
) -> None:
    """Every source declares the same (wrong) value, so the manifest itself is consistent: the trainer
    finds the difference when it opens the first source's token manifest."""
    wrong = [{**s, "tokens": {**s["tokens"], **change}} for s in sources]
    manifest = write_mixture(tmp_path / "m.json", wrong)
    run_dir = tmp_path / "run"
    assert _main(manifest, run_dir) == 2
    assert error in caplog.text and message in caplog.text, caplog.text[-2000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "result.json").exists()


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("count", [1, 2], ids=["one-source", "two-sources"])
def test_a_mixture_whose_sources_name_no_packed_tokens_is_refused_before_step_1(
    sources: list[dict], tmp_path: Path, caplog: pytest.LogCaptureFixture, count: int,
) -> None:
    """A data gate's manifest (no source packed yet) reads, but the trainer packs no mixture itself:
    exit 2 before step 1, naming the sources (even one, which it would otherwise pack as format 1)."""
    unpacked = [{k: v for k, v in s.items() if k != "tokens"} for s in sources[:count]]
    manifest = write_mixture(tmp_path / "m.json", unpacked)
    run_dir = tmp_path / "run"
    assert _main(manifest, run_dir) == 2
    names = ", ".join(s["name"] for s in unpacked)
    assert f"source(s) {names} name no packed tokens" in caplog.text, caplog.text[-2000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "result.json").exists()


@pytest.mark.usefixtures("in_process")
def test_a_capped_source_stops_the_run_with_a_committed_checkpoint_and_a_resume_trains_no_further(
    sources: list[dict], tmp_path: Path
) -> None:
    """prose's token budget (16 samples of 64 tokens, and a few tokens more) allows its draws of
    global batches 0-3 (4 a batch); batch 4 would draw past it: the run stops after step 4 of 8,
    commits a checkpoint there (checkpoints every 3 steps: the stop's own), and says why in result.json.
    Run again on the same run directory, it resumes at step 4 and trains nothing more."""
    capped = [sources[0], {**sources[1], "max_tokens": 16 * 64 + 10}]
    manifest = write_mixture(tmp_path / "capped.json", capped)
    run_dir = tmp_path / "run"
    assert _main(manifest, run_dir, "checkpoint.every_steps=3") == 0
    result = read_result(run_dir)
    assert result["step"] == 4 and result["total_steps"] == 8 and result["completed"]
    assert result["stop"] == {"reason": "mixture_cap", "source": "prose", "limit": "max_tokens = 1034", "draws": 16,
                              "loader_step": 4, "step": 4}
    assert [r["drawn"] for r in result["mixture"]] == [48, 16] and [r["share"] for r in result["mixture"]] == [0.75, 0.25]
    checkpoint = verify_checkpoint(Path(result["checkpoint"]))
    assert checkpoint["step"] == 4 and checkpoint["weights_sha256"] == result["weights_sha256"]
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 4

    assert _main(manifest, run_dir, "checkpoint.every_steps=3") == 0
    again = read_result(run_dir)
    assert again["step"] == 4 and again["weights_sha256"] == result["weights_sha256"] and again["stop"] == result["stop"]
    assert again["checkpoint"] == result["checkpoint"]
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 4

    # Without the cap the same sources train all 8 steps (the stop is the cap's, not the data's).
    free = _main(write_mixture(tmp_path / "free.json", sources), tmp_path / "free", "checkpoint.every_steps=3")
    assert free == 0 and read_result(tmp_path / "free")["step"] == 8 and "stop" not in read_result(tmp_path / "free")


@pytest.mark.usefixtures("in_process")
def test_a_batch_the_guard_skips_counts_against_the_cap(
    sources: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skipped global batch still drew its samples: with prose capped at 48 draws (global batches
    0-11) and batch 9 skipped after a loss spike at step 10, the run ends after step 11, not 12."""
    monkeypatch.setenv("KILN_FAULT_SPIKE_AT_STEP", "10")
    capped = [sources[0], {**sources[1], "max_tokens": 48 * 64 + 10}]
    run_dir = tmp_path / "run"
    assert _main(write_mixture(tmp_path / "capped.json", capped), run_dir, "train.steps=16", "checkpoint.every_steps=3",
                 "guard.spike_factor=3.0", "guard.max_rollbacks=1") == 0
    result = read_result(run_dir)
    [event] = result["events"]
    assert event["kind"] == "rollback" and event["skipped_batch"] == 9
    assert result["step"] == 11 and result["completed"] and result["stop"]["loader_step"] == 12
    assert result["stop"]["step"] == 11 and result["stop"]["source"] == "prose"
    prose = result["mixture"][1]
    assert prose["drawn"] == 48 and prose["trained_samples"] == 44  # batch 9's 4 prose samples drawn, not trained
