"""Asynchronous against synchronous checkpointing: what the training loop waits for, per save.

    .venv/bin/python benchmarks/run.py checkpoint_sync_vs_async

The same kiln_trainer run (``small`` recipe, one process, CPU, one torch thread; the manifest and
run helper of ``trainer_loop``) saves every ``KILN_BENCH_EVERY`` steps (default 10) with
``checkpoint.async_save = false`` (the baseline: the loop writes, fsyncs and commits each checkpoint
before its next step) and with ``async_save = true`` (kiln's default: the loop only copies the state
to host memory; one background thread writes and commits it while training goes on). Repeats
alternate the two. Figures are medians over the repeats.

- **ratio**: the async loop's blocking seconds per save over the sync loop's.
- **bytes per checkpoint**: the committed step directory on disk (weights, optimizer, scheduler,
  trainer state, RNG of every rank, manifest).
- **by interval** (a table): what an interval of N steps costs at this machine's measured step time,
  stall per save and checkpoint size: the fraction of training time stalled, the recovery point
  (steps a crash can lose: N with sync; with async up to N plus the steps a save is in flight, since
  a crash during the write of step s falls back to s - N) and the bytes written per hour of
  training. docs/checkpointing.md turns these into GPU-hours and dollars for a real fleet.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# The fleet the model below extrapolates to. ASSUMPTIONS, not measurements: put your fleet's in.
FLEET = {
    "params": 7e9,
    "gpus": 512,
    # GPU-hours between job-killing faults, per GPU: the Llama 3 report's 419 unexpected
    # interruptions in 54 days on 16,384 GPUs come to ~50,700.
    "gpu_mtbf_h": 50_000,
    "store_write_GBps": 10.0,  # aggregate bandwidth to the checkpoint store: what a sync save waits for
    "host_copy_GBps": 10.0,  # device -> host per GPU: what an async save waits for, state sharded over the GPUs
    "gpu_hour_usd": 2.0,
    "usd_per_TB_written": 0.08,  # object store: $0.005 per 1,000 PUTs of 64 MiB parts (ingress itself is free)
    "usd_per_TB_month": 23.0,  # object store retention
    "keep_last": 3,
}


def fleet_model(bytes_per_param: float, fleet: dict[str, float] = FLEET) -> dict[str, dict[str, Any]]:
    """Young-Daly for the fleet: a save stalls the loop C seconds, a fault comes every M seconds
    (the job's MTBF: the per-GPU MTBF over the GPUs), so an interval of tau seconds wastes about
    C/tau (saving) + tau/(2M) (the work since the last commit, half an interval on average) of the
    GPU time, least at tau* = sqrt(2 C M). An async save cannot come faster than the store takes it:
    tau >= size / store bandwidth (the writer takes one save at a time; a faster interval blocks)."""
    size = fleet["params"] * bytes_per_param
    mtbf_s = fleet["gpu_mtbf_h"] * 3600 / fleet["gpus"]
    write_s = size / (fleet["store_write_GBps"] * 1e9)
    stall = {"sync": write_s, "async": size / fleet["gpus"] / (fleet["host_copy_GBps"] * 1e9)}
    out: dict[str, dict[str, Any]] = {}
    for mode, c in stall.items():
        tau = max((2 * c * mtbf_s) ** 0.5, write_s if mode == "async" else 0.0)
        waste = c / tau + tau / (2 * mtbf_s)
        tb_per_day = size * 86400 / tau / 1e12
        out[mode] = {
            "stall per save (s)": round(c, 3),
            "best interval (min)": round(tau / 60, 1),
            "RPO worst (min)": round((tau + (write_s if mode == "async" else 0.0)) / 60, 1),
            "GPU time wasted": f"{waste:.3%}",
            "GPU cost wasted ($/day)": round(waste * fleet["gpus"] * 24 * fleet["gpu_hour_usd"], 1),
            "written (TB/day)": round(tb_per_day, 1),
            "write cost ($/day)": round(tb_per_day * fleet["usd_per_TB_written"], 2),
            "retention ($/month)": round(fleet["keep_last"] * size / 1e12 * fleet["usd_per_TB_month"], 1),
        }
    return out


def _checkpoint_bytes(run_dir: Path) -> int:
    """Size of the newest committed checkpoint directory."""
    steps = sorted((run_dir / "checkpoints").glob("step-*/manifest.json"))
    if not steps:
        raise RuntimeError(f"no committed checkpoint under {run_dir}")
    return sum(p.stat().st_size for p in steps[-1].parent.rglob("*") if p.is_file())


def main() -> dict[str, Any]:
    threads = int(os.environ.get("KILN_BENCH_THREADS", "1"))
    steps = int(os.environ.get("KILN_BENCH_STEPS", "60"))
    every = int(os.environ.get("KILN_BENCH_EVERY", "10"))
    repeats = int(os.environ.get("KILN_BENCH_REPEATS", "3"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        os.environ.pop(name, None)
    os.environ["KILN_TORCH_THREADS"] = str(threads)

    import torch

    sys.path.insert(0, str(HERE))
    from kiln_trainer.config import load_recipe
    from kiln_trainer.model import build_model

    from trainer_loop import _build_manifest, _kiln_run

    torch.set_num_threads(threads)
    model = build_model(load_recipe(HERE.parent / "training" / "recipes" / "small.toml").model)
    params = sum(p.numel() for p in model.parameters())
    common = [f"train.steps={steps}", "train.log_every=10", "optim.warmup_steps=10", "train.device=cpu",
              "train.dtype=float32", f"checkpoint.every_steps={every}"]
    saves = steps // every + (0 if steps % every == 0 else 1)  # periodic saves; the last step is one of them or the final save
    t_start = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    sizes: list[int] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-ckpt-") as tmp:
        root = Path(tmp)
        manifest = _build_manifest(root)
        _kiln_run(manifest, root / "warm", [*common[1:], "train.steps=10"])  # warm kernels and allocator, unmeasured
        for rep in range(repeats):
            order = ("sync", "async") if rep % 2 == 0 else ("async", "sync")
            for mode in order:
                run_dir = root / f"{mode}-{rep}"
                async_save = f"checkpoint.async_save={str(mode == 'async').lower()}"
                runs[mode].append(_kiln_run(manifest, run_dir, [*common, async_save]))
                sizes.append(_checkpoint_bytes(run_dir))
                print(".", end="", flush=True)
        print(flush=True)

    med = statistics.median
    per_save = {mode: med(r["blocking_s"] for r in rs) / saves for mode, rs in runs.items()}
    # Step time without checkpoint stalls, from the sync runs (their loop time minus what they blocked).
    step_s = med((r["loop_s"] - r["blocking_s"]) / steps for r in runs["sync"])
    size = med(sizes)
    by_interval: dict[str, dict[str, Any]] = {}
    for n in (10, 50, 100, 200, 500):
        # A save's write takes the sync stall; the async one is in flight that long after the copy.
        in_flight_steps = per_save["sync"] / step_s
        by_interval[f"every {n} steps"] = {
            "sync stall": f"{per_save['sync'] / (n * step_s + per_save['sync']):.2%}",
            "async stall": f"{per_save['async'] / (n * step_s + per_save['async']):.2%}",
            "sync RPO (steps)": n,
            "async RPO (steps, worst)": round(n + in_flight_steps, 1),
            "written per training hour (MB)": round(size * 3600 / (n * step_s) / 1e6, 1),
        }
    return {
        "name": "Checkpointing: asynchronous vs synchronous saves",
        "baseline": (
            f"synchronous saves (checkpoint.async_save = false: write, fsync and commit before the next step) "
            f"of the same run ('small' recipe, {steps} steps, a save every {every}, {threads} torch thread(s), "
            f"CPU); ratio = async blocking seconds per save / sync blocking seconds per save, medians of "
            f"{repeats} alternated repeats"
        ),
        "ratio": round(per_save["async"] / per_save["sync"], 4),
        "ratio_goal": "<= 0.25 (the loop waits for a host copy, not for the disk)",
        "sync_blocking_ms_per_save": round(1000 * per_save["sync"], 2),
        "async_blocking_ms_per_save": round(1000 * per_save["async"], 2),
        "step_ms": round(1000 * step_s, 2),
        "bytes_per_checkpoint": int(size),
        "write_MB_per_s (sync, incl. fsync)": round(size / per_save["sync"] / 1e6, 1),
        "by interval (this machine)": by_interval,
        "model_params": params,
        "bytes_per_param": round(size / params, 2),
        "fleet model (assumed 7B params, 512 GPUs: docs/checkpointing.md)": fleet_model(size / params),
        "seconds": {
            "sync_loop_wall_s": [round(r["loop_s"], 3) for r in runs["sync"]],
            "async_loop_wall_s": [round(r["loop_s"], 3) for r in runs["async"]],
            "sync_blocking_s": [round(r["blocking_s"], 4) for r in runs["sync"]],
            "async_blocking_s": [round(r["blocking_s"], 4) for r in runs["async"]],
            "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
