"""Stragglers end to end on the local backend: 2 torchrun agents ("nodes") x 1 CPU worker, for real.

``KILN_FAULT_SLOW_RANK=1`` makes rank 1 sleep in every step's compute from step 11 on. The trainer
gathers every rank's compute time per step every 5 steps; rank 0 must flag rank 1 within 20 steps of
the slowdown (metrics.jsonl event, ``straggler_rank`` in metrics.prom, log line, MLflow tags) and the
launcher must log the policy action (alert). A clean run must raise no flag. Both runs also report
per-rank step times and a scaling efficiency in (0, 1].

The test recipe uses factor 3 (the default is 1.5): a shared 2-core host under load makes one rank
2x slower than the other for a window now and then; the injected fault is ~5-25x.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.launchers import LaunchSpec, launch_local
from kiln.launchers.stragglers import StragglerPolicy, detect, rank_step_times_from_metrics

from training_manifests import stdlib_manifest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "training" / "recipes" / "tiny.toml"
SLOW_FROM = 11
OVERRIDES = ("train.steps=30", "checkpoint.every_steps=30", "train.log_every=10", "optim.warmup_steps=5",
             "stragglers.every_steps=5", "stragglers.factor=3.0", "stragglers.windows=3")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stdlib_manifest(tmp_path_factory.mktemp("corpus"), max_chars=200_000)


def _run(run_dir: Path, manifest: Path, env: dict[str, str]) -> tuple[list[dict], str]:
    spec = LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=TINY, run_key=f"straggler-{run_dir.parent.name}",
                      nodes=2, nproc_per_node=1, overrides=OVERRIDES,
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", **env})
    lines: list[str] = []
    result = launch_local(spec, log=lines.append)
    assert result.completed and result.step == 30
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, "\n".join(lines)


def _windows(records: list[dict]) -> list[dict]:
    return [r for r in records if "rank_step_times" in r]


def test_a_slow_rank_is_flagged_within_20_steps_with_metric_log_tag_and_action(manifest, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("stragglers", artifact_location=str(tmp_path / "a"))).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    run_dir = tmp_path / "slow" / "run"
    records, log_text = _run(run_dir, manifest, {"KILN_FAULT_SLOW_RANK": "1", "KILN_FAULT_SLOW_S": "0.5",
                                                 "KILN_FAULT_SLOW_FROM_STEP": str(SLOW_FROM)})
    flags = [r for r in records if r.get("event") == "straggler"]
    assert flags, log_text[-3000:]
    first = flags[0]
    assert first["rank"] == 1 and first["node"] in ("node0", "node1")
    assert SLOW_FROM <= first["step"] < SLOW_FROM + 20, first
    assert not [f for f in flags if f["rank"] == 0], "the healthy rank waits at the all-reduce; it is not slow"
    windows = _windows(records)
    assert [w["step"] for w in windows] == [5, 10, 15, 20, 25, 30]
    assert all(len(w["rank_step_times"]) == 2 for w in windows)
    late = [w for w in windows if w["step"] >= first["step"]]
    assert late and all(w["straggler_rank"] == 1 for w in late)
    assert all(w["straggler_rank"] == -1 for w in windows if w["step"] <= SLOW_FROM)
    # Slow compute on rank 1 makes rank 0 wait: efficiency drops well below 1 once the fault is on.
    assert all(0 < w["scaling_efficiency"] <= 1.0 for w in windows)
    assert max(w["scaling_efficiency"] for w in late) < 0.5
    # The same windows give the same verdict offline (the orchestration side's detector).
    offline = detect(list(rank_step_times_from_metrics(run_dir / "metrics.jsonl")), StragglerPolicy(factor=3.0, windows=3))
    assert [(f.rank, f.step) for f in offline][:1] == [(1, first["step"])]
    prom = (run_dir / "metrics.prom").read_text()
    assert "kiln_train_straggler_rank{" in prom and prom.count("kiln_train_rank_step_times{") == 2
    assert 'rank="1"' in prom and "kiln_train_scaling_efficiency{" in prom
    straggler_line = next(line for line in prom.splitlines() if line.startswith("kiln_train_straggler_rank{"))
    assert straggler_line.endswith(" 1.0")
    assert f"straggler: rank 1 on node {first['node']} at step {first['step']}" in log_text
    assert "[launcher] straggler: rank 1" in log_text and "policy action: alert" in log_text
    tags = client.get_run(run_id).data.tags
    assert tags["kiln.straggler_rank"] == "1" and "rank 1" in tags["kiln.straggler"]
    history = client.get_metric_history(run_id, "straggler_rank")
    assert [m.value for m in history][-1] == 1.0


def test_a_clean_run_raises_no_flag(manifest, tmp_path):
    run_dir = tmp_path / "clean" / "run"
    records, log_text = _run(run_dir, manifest, {})
    assert not [r for r in records if r.get("event") == "straggler"], log_text[-3000:]
    windows = _windows(records)
    assert len(windows) == 6 and all(w["straggler_rank"] == -1 for w in windows)
    assert all(0 < w["scaling_efficiency"] <= 1.0 for w in windows)
    assert "straggler: rank" not in log_text
    prom = (run_dir / "metrics.prom").read_text()
    assert next(line for line in prom.splitlines() if line.startswith("kiln_train_straggler_rank{")).endswith(" -1.0")
