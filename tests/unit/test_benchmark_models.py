"""The arithmetic behind the benchmark figures docs/ quotes (no timing here: benchmarks are never
pass/fail tests): the checkpoint-interval model and the rendering of result tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):  # benchmarks/ is not a package: load its files under names of their own
    spec = importlib.util.spec_from_file_location(f"kiln_benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_checkpointing = _load("checkpoint_sync_vs_async")
fleet_model, FLEET = _checkpointing.fleet_model, _checkpointing.FLEET
render = _load("run").render


def test_fleet_model_is_young_daly_with_the_stores_floor_for_async_saves():
    fleet = {**FLEET, "params": 1e9, "gpus": 100, "gpu_mtbf_h": 100 * 50, "store_write_GBps": 1.0,
             "host_copy_GBps": 1.0}
    model = fleet_model(10.0, fleet)  # 10 GB per checkpoint, job MTBF 50 h
    mtbf_s = 50 * 3600
    sync, asyn = model["sync"], model["async"]
    assert sync["stall per save (s)"] == pytest.approx(10.0)  # 10 GB at 1 GB/s, in the loop
    assert sync["best interval (min)"] == pytest.approx(round((2 * 10.0 * mtbf_s) ** 0.5 / 60, 1))
    assert asyn["stall per save (s)"] == pytest.approx(0.1)  # the host copy of one GPU's shard
    assert asyn["best interval (min)"] == pytest.approx(round((2 * 0.1 * mtbf_s) ** 0.5 / 60, 1))
    assert asyn["RPO worst (min)"] > asyn["best interval (min)"]  # plus the write in flight
    # A store too slow for the async optimum sets the interval: one checkpoint per write time.
    slow = fleet_model(10.0, {**fleet, "store_write_GBps": 0.01})["async"]
    assert slow["best interval (min)"] == pytest.approx(round(1000.0 / 60, 1))
    assert slow["written (TB/day)"] == pytest.approx(round(10e9 * 86400 / 1000.0 / 1e12, 1))


def test_render_turns_a_dict_of_rows_into_one_table():
    doc = render({"x": {"name": "N", "baseline": "b", "when": "w", "machine": "m", "ratio": 0.5,
                        "rows": {"sync": {"a": 1, "b": 2}, "async": {"a": 3}}, "plain": {"k": "v"}}})
    assert "| | a | b |\n|---|---|---|\n| sync | 1 | 2 |\n| async | 3 |  |" in doc
    assert "| item | value |\n|---|---|\n| k | v |" in doc and "| ratio | 0.5 |" in doc


def test_gpu_check_without_a_gpu_says_so_and_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: this checks the refusal where there is none")
    assert _load("gpu_check").main([]) == 2
    assert "no CUDA device is visible here" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_check_plumbing_runs_end_to_end_on_cpu(tmp_path, capsys):
    """--cpu-dry-run: the check's own steps (two invocations, a sharded resume, the figures) on a tiny
    CPU model, so the script works before a GPU ever runs it; the figures themselves mean nothing here."""
    gpu_check = _load("gpu_check")
    assert gpu_check.main(["--cpu-dry-run", "--steps", "20", "--out", str(tmp_path / "never.json")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint_format: 3 (fsdp, world size 1)" in out
    assert "final checkpoint verified and consolidated: True" in out
    assert "resumed_from_step: 10" in out
    assert not (tmp_path / "never.json").exists()  # a dry run records no figures
