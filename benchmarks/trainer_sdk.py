"""kiln's trainer on the SDK (``kiln_trainer.train`` over ``kiln_trainer.sdk``) against the trainer
before the rewrite (its ``Run`` class, ``train.py`` of commit ``BASELINE_COMMIT``, imported from
``git show`` into a temporary module).

    .venv/bin/python benchmarks/run.py trainer_sdk

One process, CPU, one torch thread (``KILN_BENCH_THREADS``), the ``small`` recipe, the same packed
tokens, batches and seed for both (the same weights come out: checked), no periodic checkpoint (the
one end-of-run save is outside the timed loop in both). Repeats alternate the two trainers so that
drift of a shared machine hits each alike; figures are medians. The ratio compares CPU seconds of
the loop thread (with one torch thread every kernel runs there, and CPU time does not count other
users' processes); the wall-time ratio is reported beside it. Goal: <= 1.01.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "training" / "recipes" / "small.toml"
BASELINE_COMMIT = "fdc178e"
"""The last commit whose ``train.py`` is the ``Run`` class (it runs on today's modules)."""


def _baseline_module(tmp: Path) -> ModuleType:
    source = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:training/kiln_trainer/train.py"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    path = tmp / "kiln_train_before_sdk.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kiln_train_before_sdk", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    return module


def _args(manifest: Path, run_dir: Path, overrides: list[str], max_steps: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(manifest=manifest, recipe=RECIPE, run_dir=run_dir, overrides=overrides,
                              max_steps=max_steps, sample_log=False)


def _before_run(module: ModuleType, args: argparse.Namespace) -> dict[str, Any]:
    run = module.Run(args)
    try:
        run.resume_or_start()
        cpu0 = time.thread_time()
        summary = run.train()
        cpu_s = time.thread_time() - cpu0
        result = run.finish(summary)
    finally:
        run.close()
    return {"loop_s": summary["loop_s"], "cpu_s": cpu_s, "weights": result["weights_sha256"]}


def _sdk_run(args: argparse.Namespace) -> dict[str, Any]:
    from kiln_trainer import sdk
    from kiln_trainer.train import train

    class LoopClock(sdk.StepHook):
        """The loop's start, taken after the resume (where the ``Run`` baseline starts its clock)."""

        def on_start(self, session: sdk.Session) -> None:
            self.t0, self.cpu0 = time.perf_counter(), time.thread_time()

    clock = LoopClock()
    session = sdk.start(args, hooks=[*sdk.default_hooks(), clock])
    try:
        train(session)
        loop_s, cpu_s = time.perf_counter() - clock.t0, time.thread_time() - clock.cpu0
        result = session.finish()
    finally:
        session.close()
    assert result is not None
    return {"loop_s": loop_s, "cpu_s": cpu_s, "weights": result["weights_sha256"]}


def main() -> dict[str, Any]:
    threads = int(os.environ.get("KILN_BENCH_THREADS", "1"))
    steps = int(os.environ.get("KILN_BENCH_STEPS", "30"))
    repeats = int(os.environ.get("KILN_BENCH_REPEATS", "3"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        os.environ.pop(name, None)
    os.environ["KILN_TORCH_THREADS"] = str(threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer_loop import _build_manifest

    overrides = [f"train.steps={steps}", "train.log_every=10", "optim.warmup_steps=10", "train.device=cpu",
                 "train.dtype=float32", f"checkpoint.every_steps={steps + 1}"]
    t_start = time.perf_counter()
    before: list[dict[str, Any]] = []
    after: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        root = Path(tmp)
        manifest = _build_manifest(root)
        module = _baseline_module(root)
        _sdk_run(_args(manifest, root / "warm", overrides, max_steps=3))  # warm the allocator and kernels once
        for rep in range(repeats):
            jobs = [lambda rep=rep: before.append(_before_run(module, _args(manifest, root / f"before-{rep}", overrides))),
                    lambda rep=rep: after.append(_sdk_run(_args(manifest, root / f"sdk-{rep}", overrides)))]
            for job in jobs[rep % 2:] + jobs[: rep % 2]:
                job()
                print(".", end="", flush=True)
        print(flush=True)
    same_weights = len({r["weights"] for r in before + after}) == 1
    med = statistics.median
    before_cpu, after_cpu = med(r["cpu_s"] for r in before), med(r["cpu_s"] for r in after)
    before_wall, after_wall = med(r["loop_s"] for r in before), med(r["loop_s"] for r in after)
    return {
        "name": "kiln's trainer on the SDK vs before the rewrite",
        "baseline": (
            f"kiln_trainer.train of commit {BASELINE_COMMIT} (the Run class), same 'small' recipe, packed tokens, "
            f"batches and seed, {steps} steps, {threads} torch thread(s), no periodic checkpoint; ratio = loop-thread "
            f"CPU seconds of the SDK trainer over the baseline's, ratio_wall = wall seconds, medians of {repeats} "
            "alternated repeats"
        ),
        "ratio": round(after_cpu / before_cpu, 4),
        "ratio_wall": round(after_wall / before_wall, 4),
        "ratio_goal": "<= 1.01",
        "same_weights": same_weights,
        "seconds": {
            "before_loop_cpu_s": round(before_cpu, 3),
            "sdk_loop_cpu_s": round(after_cpu, 3),
            "before_loop_wall_s": round(before_wall, 3),
            "sdk_loop_wall_s": round(after_wall, 3),
            "before_step_cpu_ms": round(1000 * before_cpu / steps, 2),
            "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        },
        "runs": {
            "before_cpu_s": [round(r["cpu_s"], 3) for r in before],
            "sdk_cpu_s": [round(r["cpu_s"], 3) for r in after],
            "steps x repeats": f"{steps} x {repeats}",
            "threads": threads,
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
