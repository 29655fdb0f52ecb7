"""GPU check in one command: NCCL + bf16 + fsdp on the ``gpt2-small`` recipe, with MFU against the
device's stated peak, tokens/s and checkpoint blocking.

    make gpu-check                      # = .venv/bin/python benchmarks/gpu_check.py
    .venv/bin/python benchmarks/gpu_check.py --gpus 8 --steps 40

On a CUDA machine: ``torchrun --standalone --nproc-per-node=<GPUs>`` runs ``kiln_trainer.train`` on
``training/recipes/gpt2-small.toml`` (GPT-2 small shape, bf16 mixed precision through FSDP2's
policy, ``torch.compile`` per block, NCCL, 0.5M tokens per step) over the Python standard library's
sources (packed by the trainer, no download), in two invocations: the first stops at half the
steps, the second resumes from its sharded checkpoint (a DCP load over NCCL) and finishes. Every
``checkpoint_every`` steps each rank writes its shards asynchronously.

Printed, and written to ``benchmarks/results/gpu_check.json`` (so ``docs/benchmarks.md`` shows it):
the device, GPU count, NCCL version, MFU (model FLOPs over the device's stated dense bf16 peak,
``kiln_trainer.timing.PEAK_BF16_FLOPS``; ``KILN_PEAK_FLOPS`` overrides), tokens/s, the loop's
checkpoint blocking (seconds blocked / wall time, and per save), the final checkpoint verified and
consolidated, the resume step. Each invocation's first log interval (compilation, warm-up) is left
out of every figure.

Without a CUDA device it says so and exits 2. ``--cpu-dry-run`` runs the same steps on CPU with a
tiny model (gloo, float32) to check the plumbing, not the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPE = REPO / "training" / "recipes" / "gpt2-small.toml"
DRY_RUN = ("train.device=cpu", "train.dtype=float32", "train.compile=false", "model.n_layer=2", "model.n_head=2",
           "model.n_embd=64", "model.block_size=64", "data.global_batch_size=16", "data.micro_batch_size=4")
"""--cpu-dry-run: the gpt2-small recipe shrunk to seconds on a CPU (plumbing only)."""


def _env(threads: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env |= {"KILN_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    return env


def _train(gpus: int, manifest: Path, run_dir: Path, overrides: list[str], max_steps: int | None,
           threads: int | None) -> str:
    argv = ["-m", "kiln_trainer.train", "--manifest", str(manifest), "--recipe", str(RECIPE), "--run-dir", str(run_dir)]
    for item in overrides:
        argv += ["--set", item]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads), cwd=REPO, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"gpu-check: training exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc.stderr


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(run_dir: Path, *, gpus: int, every: int, device: dict[str, Any]) -> dict[str, Any]:
    """The figures of a finished check run (``run_dir`` holds both invocations' metrics)."""
    sys.path.insert(0, str(REPO / "training"))
    from kiln_trainer.checkpoint import load_model_weights, weights_sha256
    from kiln_trainer.checkpoint_manifest import verify_checkpoint

    records = _records(run_dir)
    starts = [e for e in records if e.get("event") == "startup"]
    intervals = [r for r in records if "tokens_per_s" in r]
    # Each invocation's first interval holds its compilation and warm-up: left out.
    firsts = {min((r["step"] for r in intervals if r["step"] >= e["first_step"]), default=-1) for e in starts}
    steady = [r for r in intervals if r["step"] not in firsts] or intervals
    previous = {r["step"]: p["step"] for p, r in zip([{"step": 0}, *intervals], intervals, strict=False)}
    steady_wall = sum(r["step_time"] * (r["step"] - previous[r["step"]]) for r in steady)
    steady_blocked = sum(r["ckpt_block_s"] for r in steady)
    result = json.loads((run_dir / "result.json").read_text())
    manifest = verify_checkpoint(result["checkpoint"])
    _, weights = load_model_weights(result["checkpoint"])
    mfus = [r["mfu"] for r in steady if "mfu" in r]
    saves = sum(1 for r in steady for s in range(previous[r["step"]] + 1, r["step"] + 1) if s % every == 0)
    return {
        "name": "GPU check: NCCL + bf16 + fsdp on gpt2-small",
        "baseline": f"the device's stated dense bf16 peak ({device['peak_flops']:.3g} FLOP/s per GPU)"
        if device.get("peak_flops") else "no stated peak known for this device (set KILN_PEAK_FLOPS)",
        "ratio": round(statistics.median(mfus), 4) if mfus else None,
        "ratio_is": "MFU: model FLOPs per second over the GPUs' stated peak (median of the steady intervals)",
        "device": device["name"],
        "gpus": gpus,
        "nccl": device["nccl"],
        "bf16": device["bf16"],
        "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
        "step_ms": round(1000 * statistics.median(r["step_time"] for r in steady), 1),
        "checkpoint blocking / wall time": f"{steady_blocked / steady_wall:.3%}" if steady_wall else None,
        "checkpoint_blocking_ms_per_save": round(1000 * steady_blocked / saves, 1) if saves else None,
        "checkpoint_format": f"{manifest['format']} ({manifest['strategy']}, world size {manifest['world_size']})",
        "final checkpoint verified and consolidated": weights_sha256(weights) == manifest["weights_sha256"],
        "resumed_from_step": starts[-1].get("resumed_from_step") if len(starts) > 1 else None,
        "final_loss": result["metrics"]["final_loss"],
        "steps": result["metrics"]["steps"],
    }


def device_facts(dry_run: bool) -> dict[str, Any]:
    import torch

    if dry_run:
        return {"name": "CPU (dry run: plumbing only)", "nccl": "n/a (gloo)", "bf16": False, "peak_flops": None}
    from kiln_trainer.timing import peak_flops

    dev = torch.device("cuda", 0)
    return {"name": torch.cuda.get_device_name(dev), "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "bf16": torch.cuda.is_bf16_supported(), "peak_flops": peak_flops(dev)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all (default 40)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny model on CPU: check the plumbing only")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO / "training"))
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible here; run it on a GPU machine (or --cpu-dry-run to check the "
              "plumbing)", file=sys.stderr)
        return 2
    gpus = args.gpus or (1 if args.cpu_dry_run else torch.cuda.device_count())
    device = device_facts(args.cpu_dry_run)
    overrides = [f"train.steps={args.steps}", f"checkpoint.every_steps={args.checkpoint_every}", "checkpoint.keep_last=2",
                 "train.log_every=5", "optim.warmup_steps=5", "parallel.strategy=fsdp",
                 # The check's corpus is 3 local shards: one shuffle over all of them.
                 "data.window_shards=0",
                 *(DRY_RUN if args.cpu_dry_run else ())]
    sys.path.insert(0, str(HERE))
    from trainer_loop import _build_manifest

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-check-") as tmp:
        root = Path(tmp)
        manifest = _build_manifest(root, limit_bytes=2_000_000 if args.cpu_dry_run else 40_000_000)
        threads = 1 if args.cpu_dry_run else None
        _train(gpus, manifest, root / "run", overrides, args.steps // 2, threads)  # stops at half the steps
        _train(gpus, manifest, root / "run", overrides, None, threads)  # resumes from the sharded checkpoint
        figures = summarize(root / "run", gpus=gpus, every=args.checkpoint_every, device=device)
    figures["check_wall_s"] = round(time.perf_counter() - started, 1)
    figures["when"] = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    from run import machine

    figures["machine"] = f"{device['name']} x {gpus}; host {machine()}"
    for key, value in figures.items():
        print(f"{key:>50}: {value}")
    if not args.cpu_dry_run:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
