"""Scaling efficiency 1 -> 2 ranks here, the all-reduce cost behind it, and the 512-GPU model.

    .venv/bin/python benchmarks/run.py scaling

1. **Measured**: the ``small`` recipe on CPU (gloo, one torch thread per rank, 2 local ranks under
   ``torchrun --standalone``), 1 rank then 2 ranks, same per-rank batch (weak scaling: the global
   batch is ``nproc x data.micro_batch_size``, one micro-batch per rank per step). Baseline =
   the 1-rank run's tokens/s, measured in the same run; ratio = scaling efficiency
   ``tokens/s(2) / (2 x tokens/s(1))``. Beside it the trainer's own in-run ``scaling_efficiency``
   (typical rank's compute per step / step wall time, median over the windows; docs/scaling.md).
2. **All-reduce cost here**: gloo all-reduce of 4 KiB..16 MiB float32 between the 2 ranks, fitted to
   the alpha-beta model ``t(S) = alpha + S / B`` (least squares), and the model's prediction of the
   2-rank efficiency from the measured compute time and the gradient bytes.
3. **512-GPU model** (docs/scaling.md): gpt2-small's parameter count from the recipe, with the
   stated H100/H200-class assumptions, flat ring vs hierarchical all-reduce, bucketing + overlap.

The machine is shared: load is recorded; rerun when it is quiet for cleaner figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SMALL = REPO / "training" / "recipes" / "small.toml"
GPT2 = REPO / "training" / "recipes" / "gpt2-small.toml"

# --------------------------------------------------------------------------- the model (docs/scaling.md)
# Assumptions for an H100/H200 SXM cluster: 8 GPUs per node on NVSwitch, one 400 Gb/s NDR NIC per GPU
# in a rail-optimised fat tree. Bandwidths are NCCL "bus bandwidth" figures one can expect, not peaks.
GPUS_PER_NODE = 8
INTRA_BW = 360e9  # bytes/s per GPU over NVLink/NVSwitch (all-reduce bus bandwidth)
INTER_BW = 45e9  # bytes/s per GPU over its own NIC (400 Gb/s = 50 GB/s, ~90% achieved)
INTRA_ALPHA = 5e-6  # seconds per ring step inside a node
INTER_ALPHA = 15e-6  # seconds per ring step between nodes (NIC + switch hops)
PEAK_BF16 = 989e12  # dense bf16 FLOP/s per GPU
MFU = 0.40  # achieved model FLOPs utilisation of the step's compute on one GPU
GRAD_BYTES_PER_PARAM = 4  # DDP all-reduces fp32 gradients (2 with a bf16 compression hook)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one cannot overlap with backward
BACKWARD_SHARE = 2 / 3  # backward is ~2/3 of a step's FLOPs


def ring_allreduce_s(nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring all-reduce: 2(n-1) steps, each moving nbytes/n over the slowest link."""
    return 0.0 if n <= 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def hierarchical_allreduce_s(nbytes: float, gpus: int) -> float:
    """Reduce-scatter in the node (NVLink), all-reduce of each 1/8 shard across nodes (every GPU on
    its own NIC rail, in parallel), all-gather in the node. Topology-aware placement is what makes
    the middle step run on all 8 rails at once and keeps each ring on one rail of the fat tree."""
    g = min(gpus, GPUS_PER_NODE)
    nodes = max(1, gpus // GPUS_PER_NODE)
    intra = ring_allreduce_s(nbytes, g, INTRA_BW, INTRA_ALPHA)  # = reduce-scatter + all-gather
    inter = ring_allreduce_s(nbytes / g, nodes, INTER_BW, INTER_ALPHA)
    return intra + inter


def flat_allreduce_s(nbytes: float, gpus: int) -> float:
    """One ring over every GPU, placed without regard to topology: every step crosses a NIC."""
    bw = INTER_BW if gpus > GPUS_PER_NODE else INTRA_BW
    alpha = INTER_ALPHA if gpus > GPUS_PER_NODE else INTRA_ALPHA
    return ring_allreduce_s(nbytes, gpus, bw, alpha)


def efficiency(params: int, flops_per_token: float, tokens_per_gpu: int, accum: int, gpus: int,
               allreduce_s: float) -> dict[str, float]:
    """Weak-scaling efficiency of one optimizer step: compute / (compute + exposed all-reduce).

    The all-reduce runs once per step, during the last micro-batch's backward (bucketing + overlap):
    everything but the last bucket can hide behind that backward."""
    compute = tokens_per_gpu * flops_per_token / (PEAK_BF16 * MFU)
    backward_last = BACKWARD_SHARE * compute / accum
    nbytes = params * GRAD_BYTES_PER_PARAM
    tail = allreduce_s * min(1.0, BUCKET_BYTES / nbytes)  # the last bucket's share: never overlapped
    exposed = max(tail, allreduce_s - backward_last) if gpus > 1 else 0.0
    return {"compute_ms": 1e3 * compute, "allreduce_ms": 1e3 * allreduce_s, "exposed_ms": 1e3 * exposed,
            "efficiency": compute / (compute + exposed)}


def model_table(params: int, flops_per_token: float, block: int) -> dict[str, str]:
    """Rows for docs: efficiency at 512 GPUs (and below) for a few per-GPU batches, both placements."""
    rows: dict[str, str] = {}
    nbytes = params * GRAD_BYTES_PER_PARAM
    for tokens, accum, label in ((16 * block * 4, 4, "64 seqs/GPU/step (recipe: 16 x 4 accum)"),
                                 (16 * block, 1, "16 seqs/GPU/step"),
                                 (4 * block, 1, "4 seqs/GPU/step"),
                                 (block, 1, "1 seq/GPU/step (0.5M global batch at 512)")):
        for gpus in (8, 64, 512):
            hier = efficiency(params, flops_per_token, tokens, accum, gpus, hierarchical_allreduce_s(nbytes, gpus))
            flat = efficiency(params, flops_per_token, tokens, accum, gpus, flat_allreduce_s(nbytes, gpus))
            rows[f"{label}, {gpus} GPUs"] = (
                f"hierarchical {hier['efficiency']:.3f} (compute {hier['compute_ms']:.1f} ms, all-reduce "
                f"{hier['allreduce_ms']:.1f} ms, exposed {hier['exposed_ms']:.1f} ms); flat ring {flat['efficiency']:.3f} "
                f"(all-reduce {flat['allreduce_ms']:.1f} ms)"
            )
    return rows


# --------------------------------------------------------------------------- measurements here
def _probe() -> None:
    """Under torchrun (2 ranks): time gloo all-reduces of several sizes; rank 0 writes the medians."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {}
    for shift in range(10, 23, 2):  # 4 KiB .. 16 MiB of float32
        t = torch.ones(1 << shift)
        for _ in range(3):
            dist.all_reduce(t)
        times = []
        for _ in range(9):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out[str(t.numel() * 4)] = statistics.median(times)
    if dist.get_rank() == 0:
        Path(os.environ["KILN_PROBE_OUT"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def _fit(samples: dict[str, float]) -> tuple[float, float]:
    """alpha = the median time of the small messages (<= 64 KiB, latency-bound); seconds per byte =
    the slope between the two largest (bandwidth-bound). A least-squares line over all sizes is
    dominated by the large ones and can give a negative alpha."""
    points = sorted((int(k), v) for k, v in samples.items())
    alpha = statistics.median(v for k, v in points if k <= 64 * 1024)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return alpha, max(0.0, (y1 - y0) / (x1 - x0))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(KILN_TORCH_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _train(nproc: int, manifest: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    from kiln_trainer.config import load_recipe

    per_rank = load_recipe(SMALL).data.micro_batch_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "kiln_trainer.train", "--manifest", str(manifest), "--recipe", str(SMALL), "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", f"checkpoint.every_steps={steps + 1}", "--set", "train.log_every=10",
           "--set", "optim.warmup_steps=10", "--set", "train.device=cpu",
           "--set", f"data.global_batch_size={nproc * per_rank}"]
    subprocess.run(cmd, check=True, env=_env(), cwd=REPO, capture_output=True, timeout=1800)
    result = json.loads((run_dir / "result.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "rank_step_times" in r][1:]  # the first window holds warm-up
    return {
        "tokens_per_s": result["metrics"]["tokens_per_s"],
        "compute_s": statistics.median(statistics.median(w["rank_step_times"]) for w in windows),
        "in_run_efficiency": statistics.median(w["scaling_efficiency"] for w in windows) if nproc > 1 else None,
    }


def main() -> dict[str, Any]:
    steps = int(os.environ.get("KILN_BENCH_STEPS", "80"))
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from kiln_trainer.config import load_recipe
    from kiln_trainer.model import GPT

    from training_manifests import stdlib_manifest

    load = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-scaling-") as tmp:
        root = Path(tmp)
        manifest = stdlib_manifest(root, max_chars=300_000)
        probe_out = root / "probe.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(Path(__file__).resolve()), "--probe"], check=True, cwd=REPO, capture_output=True,
                       env={**_env(), "KILN_PROBE_OUT": str(probe_out)}, timeout=600)
        samples = json.loads(probe_out.read_text())
        one = _train(1, manifest, root / "one", steps)
        two = _train(2, manifest, root / "two", steps)
    alpha, per_byte = _fit(samples)
    small = GPT(load_recipe(SMALL).model)
    grad_bytes = small.num_parameters() * 4
    predicted_ar = alpha + per_byte * grad_bytes
    predicted = one["compute_s"] / (one["compute_s"] + predicted_ar)
    measured = two["tokens_per_s"] / (2 * one["tokens_per_s"])

    gpt2 = load_recipe(GPT2)
    big = GPT(gpt2.model)
    params, fpt = big.num_parameters(), big.flops_per_token()
    block = gpt2.model.block_size
    nbytes = params * GRAD_BYTES_PER_PARAM
    at512 = efficiency(params, fpt, 16 * block * 4, 4, 512, hierarchical_allreduce_s(nbytes, 512))
    return {
        "name": "Scaling efficiency: 1 -> 2 ranks here, all-reduce cost, 512-GPU model",
        "baseline": (
            f"1-rank tokens/s of the 'small' recipe on CPU (gloo, 1 torch thread per rank, {steps} steps, same "
            f"per-rank batch), measured in the same run; ratio = tokens/s(2 ranks) / (2 x tokens/s(1 rank))"
        ),
        "ratio": round(measured, 3),
        "trainer_in_run_scaling_efficiency_2_ranks": round(two["in_run_efficiency"], 3),
        "model_predicted_2_ranks": round(predicted, 3),
        "load_avg_at_start": " ".join(f"{x:.1f}" for x in load),
        "gpt2_small_params": params,
        "gpt2_small_512_gpus_recipe_batch_hierarchical": round(at512["efficiency"], 3),
        "bar": ">= 0.82 at 512 GPUs with topology-aware placement",
        "measured_here": {
            "tokens_per_s_1_rank": round(one["tokens_per_s"], 1),
            "tokens_per_s_2_ranks": round(two["tokens_per_s"], 1),
            "compute_per_step_1_rank_ms": round(1e3 * one["compute_s"], 2),
            "compute_per_step_2_ranks_ms (median rank)": round(1e3 * two["compute_s"], 2),
            "small_params": small.num_parameters(),
            "gloo_loopback_alpha_us": round(1e6 * alpha, 1),
            "gloo_loopback_bandwidth_GBps": round(1 / per_byte / 1e9, 3) if per_byte > 0 else "inf",
            "allreduce_small_grads_predicted_ms": round(1e3 * predicted_ar, 2),
            "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        },
        "allreduce_samples_ms": {f"{int(k) // 1024} KiB": round(1e3 * v, 3) for k, v in samples.items()},
        "model_512": model_table(params, fpt, block),
    }


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        _probe()
    else:
        print(json.dumps(main(), indent=2))
