"""Sharded (fsdp, DCP) against replicated (ddp) checkpoints: bytes each rank writes, what the loop
waits for, and how fast a job resumes at another world size.

    .venv/bin/python benchmarks/run.py sharded_checkpoints

Real processes: ``torchrun --standalone --nproc-per-node=2`` running ``kiln_trainer.train`` on the
``small`` recipe (the demo's model), one torch thread per rank, CPU and gloo, a checkpoint every
``KILN_BENCH_EVERY`` (10) steps, ``KILN_BENCH_STEPS`` (60) steps. Repeats alternate ddp and fsdp.

- **ratio** (bytes written per rank per checkpoint): the most any fsdp rank writes into one
  checkpoint (its ``__R_0.distcp``; rank 0 also DCP's ``.metadata``, the scheduler, trainer state,
  RNG and tokenizer files and the manifest) over what ddp's rank 0 writes (the whole step
  directory; the other ddp rank writes nothing). Expected about 1/W.
- **checkpoint blocking**: seconds the loop was blocked saving over the loop's wall time, per
  strategy (rank 0's ``checkpoint_blocking_s`` over ``wall_s``; goal <= 1% when saving every 10 steps).
- **resume at another world size**: from the same fsdp checkpoint (2 ranks, step ``steps / 2``), the
  time from process start to the first resumed step (the trainer's ``startup`` event) on 1 rank
  (DCP reshards 2 -> 1) over the same on 2 ranks (same size).
- **crash -> first resumed step, shrunk against replaced**: a 2-node fsdp job on the local launcher
  (``tiny`` recipe), node 0 (agent and worker) SIGKILLed after the step-20 checkpoint; with a spare
  node slot the launcher starts a replacement and the job resumes on 2 ranks, without one
  (``min_nodes=1``, ``replacement_timeout_s`` ``KILN_BENCH_SHRINK_TIMEOUT_S``, default 5) the survivor
  resumes alone, resharding. From the kill to the first resumed step, per case; the shrunk one
  includes the replacement timeout and torch noticing the lost node's silence (its heartbeats).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RECIPE = REPO / "training" / "recipes" / "small.toml"


def _env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    return env | {"KILN_TORCH_THREADS": str(threads), "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}


def _train(world: int, manifest: Path, run_dir: Path, overrides: list[str], threads: int,
           max_steps: int | None = None) -> None:
    argv = ["-m", "kiln_trainer.train", "--manifest", str(manifest), "--recipe", str(RECIPE), "--run-dir", str(run_dir)]
    for item in overrides:
        argv += ["--set", item]
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc-per-node={world}"]
    proc = subprocess.run([*launcher, *argv], capture_output=True, text=True, env=_env(threads), cwd=REPO,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"training ({world} ranks, {overrides}) exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def _bytes_by_rank(step_dir: Path, world: int, strategy: str) -> list[int]:
    """Bytes each rank wrote into one committed checkpoint directory."""
    sizes = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.is_file()}
    if strategy == "ddp":
        return [sum(sizes.values())] + [0] * (world - 1)  # rank 0 writes everything
    by_rank = [sum(n for name, n in sizes.items() if name.startswith(f"__{r}_") and name.endswith(".distcp"))
               for r in range(world)]
    by_rank[0] += sum(n for name, n in sizes.items() if not name.endswith(".distcp"))
    return by_rank


def _newest(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step-*/manifest.json"))[-1].parent


def _startup_s(run_dir: Path) -> float:
    """process start -> first step of the last invocation (the trainer's ``startup`` event)."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return float([e for e in events if e.get("event") == "startup"][-1]["process_to_first_step_s"])


def _crash_to_first_step(root: Path, manifest: Path, *, shrink: bool, timeout_s: int) -> float:
    """Kill node 0 of a 2-node fsdp job after its step-20 checkpoint; seconds to the first resumed step."""
    import signal

    from kiln.launchers import LaunchSpec, LocalLauncher, wait
    from kiln.launchers.local import agent_pids, worker_pid

    run_dir = root / ("shrunk" if shrink else "replaced") / "run"
    elastic: dict[str, Any] = {"min_nodes": 1, "spare_nodes": 0, "replacement_timeout_s": timeout_s} if shrink else {}
    spec = LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=REPO / "training" / "recipes" / "tiny.toml",
                      run_key=f"bench-{run_dir.parent.name}", nodes=2, nproc_per_node=1, max_restarts=2,
                      overrides=("train.steps=60", "checkpoint.every_steps=10", "train.log_every=10",
                                 "optim.warmup_steps=10", "data.micro_batch_size=4", "parallel.strategy=fsdp"),
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}, **elastic)
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    deadline = time.monotonic() + 600
    while not (len(agent_pids(run_dir)) == 2 and (run_dir / "checkpoints" / "step-00000020" / "manifest.json").exists()):
        if time.monotonic() > deadline:
            raise TimeoutError("no step-20 checkpoint")
        time.sleep(0.02)
    agent = agent_pids(run_dir)["0"]
    worker = worker_pid(agent)
    t_kill = time.time()
    for pid in (agent, worker):
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    status = wait(launcher, handle, log=lambda _line: None, poll_s=0.2)
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"the {'shrunk' if shrink else 'replaced'} job ended {status.state}: {status.reason}")
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = [e["first_step_unix"] for e in events if e.get("event") == "startup" and e["first_step_unix"] > t_kill]
    return first[0] - t_kill


def main() -> dict[str, Any]:
    threads = int(os.environ.get("KILN_BENCH_THREADS", "1"))
    steps = int(os.environ.get("KILN_BENCH_STEPS", "60"))
    every = int(os.environ.get("KILN_BENCH_EVERY", "10"))
    repeats = int(os.environ.get("KILN_BENCH_REPEATS", "3"))
    world = 2
    sys.path.insert(0, str(HERE))
    from trainer_loop import _build_manifest

    common = [f"train.steps={steps}", f"checkpoint.every_steps={every}", "checkpoint.keep_last=100",
              "train.log_every=10", "optim.warmup_steps=10", "train.device=cpu", "train.dtype=float32"]
    t_start = time.perf_counter()
    written: dict[str, list[list[int]]] = {"ddp": [], "fsdp": []}
    blocking: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    resume: dict[str, list[float]] = {"same world size (2 ranks)": [], "another world size (1 rank)": []}
    weights: dict[str, set[str]] = {"ddp": set(), "fsdp": set()}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-sharded-") as tmp:
        root = Path(tmp)
        manifest = _build_manifest(root)
        _train(world, manifest, root / "warm", [*common, "train.steps=10", "parallel.strategy=fsdp"], threads)
        for rep in range(repeats):
            for strategy in (("ddp", "fsdp") if rep % 2 == 0 else ("fsdp", "ddp")):
                run_dir = root / f"{strategy}-{rep}"
                _train(world, manifest, run_dir, [*common, f"parallel.strategy={strategy}"], threads)
                result = json.loads((run_dir / "result.json").read_text())
                written[strategy] += [_bytes_by_rank(d.parent, world, strategy)
                                      for d in sorted((run_dir / "checkpoints").glob("step-*/manifest.json"))]
                blocking[strategy].append(result["metrics"]["checkpoint_blocking_s"] / result["metrics"]["wall_s"])
                weights[strategy].add(result["weights_sha256"])
                print(".", end="", flush=True)
            # Resume the same fsdp checkpoint on 2 ranks and on 1.
            half = root / f"half-{rep}"
            _train(world, manifest, half, [*common, "parallel.strategy=fsdp"], threads, max_steps=steps // 2)
            for label, ranks in (("same world size (2 ranks)", 2), ("another world size (1 rank)", 1)):
                resumed = root / f"resume-{ranks}-{rep}"
                shutil.copytree(half, resumed)
                _train(ranks, manifest, resumed, [*common, "parallel.strategy=fsdp"], threads,
                       max_steps=steps // 2 + 1)
                resume[label].append(_startup_s(resumed))
            print(".", end="", flush=True)
        shrink_timeout = int(os.environ.get("KILN_BENCH_SHRINK_TIMEOUT_S", "5"))
        crash: dict[str, list[float]] = {"replaced (2 ranks again)": [], "shrunk (1 rank)": []}
        for rep in range(repeats):
            for shrink in ((False, True) if rep % 2 == 0 else (True, False)):
                label = "shrunk (1 rank)" if shrink else "replaced (2 ranks again)"
                crash[label].append(_crash_to_first_step(root / f"crash-{rep}", manifest, shrink=shrink,
                                                         timeout_s=shrink_timeout))
                print("x", end="", flush=True)
        step_dir = _newest(root / "fsdp-0")
        files = sorted(p.name for p in step_dir.iterdir())
    print(flush=True)

    med = statistics.median
    per_rank = {s: [med(w[r] for w in written[s]) for r in range(world)] for s in written}
    ratio = max(per_rank["fsdp"]) / per_rank["ddp"][0]
    same, other = med(resume["same world size (2 ranks)"]), med(resume["another world size (1 rank)"])
    return {
        "name": "Sharded checkpoints (fsdp, DCP) vs replicated (ddp): bytes per rank, blocking, resharding resume",
        "baseline": (
            f"ddp on the same model and run ('small' recipe, {world} ranks x {threads} thread(s), CPU/gloo, {steps} "
            f"steps, a checkpoint every {every}): its rank 0 writes every byte of every checkpoint; ratio = the most "
            f"any fsdp rank writes per checkpoint / ddp rank 0's, medians over {repeats} alternated repeats"
        ),
        "ratio": round(ratio, 3),
        "ratio_goal": f"about 1/{world} = {1 / world:.2f}",
        "bytes per rank per checkpoint": {
            s: {f"rank {r}": int(b) for r, b in enumerate(per_rank[s])} for s in per_rank
        },
        "fsdp checkpoint files": ", ".join(files),
        "checkpoint blocking / wall time": {
            s: {"median": f"{med(v):.3%}", "runs": ", ".join(f"{x:.3%}" for x in v)} for s, v in blocking.items()
        },
        "checkpoint_blocking_goal": "<= 1% of wall time, saving every 10 steps",
        "resume: process start -> first resumed step (s)": {
            k: {"median": round(med(v), 2), "runs": ", ".join(f"{x:.2f}" for x in v)} for k, v in resume.items()
        },
        "resume_other_world_size_vs_same": round(other / same, 3),
        "crash -> first resumed step (s), tiny fsdp job on 2 local nodes": {
            k: {"median": round(med(v), 2), "runs": ", ".join(f"{x:.2f}" for x in v)} for k, v in crash.items()
        },
        "crash_to_first_step_shrunk_vs_replaced": round(med(crash["shrunk (1 rank)"])
                                                        / med(crash["replaced (2 ranks again)"]), 3),
        "shrink_replacement_timeout_s": shrink_timeout,
        "final weights identical across repeats": {s: len(w) == 1 for s, w in weights.items()},
        "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        "load_avg_1m_end": f"{os.getloadavg()[0]:.1f}",
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
