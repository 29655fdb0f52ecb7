"""Node loss on 2 local nodes: crash -> first resumed step, and effective training time under kills.

    .venv/bin/python benchmarks/run.py node_loss_recovery

Real processes throughout: the local launcher's supervisor, 2 agents ("nodes") x 1 CPU worker, the
``tiny`` recipe, one torch thread per rank, a checkpoint every 20 steps.

- **crash -> first resumed step**: one job; after each of ``KILN_BENCH_KILLS`` committed checkpoints
  a worker is SIGKILLed (alternating nodes) and the time from the kill to the end of the first
  resumed step is read from the trainer's ``startup`` event (``first_step_unix``, written by rank 0
  after its first step of each invocation). The event also splits the new worker's share: process
  start, imports, rendezvous/init, data, model, resume, first step; the rest (agent noticing the
  death, stopping the survivors, re-rendezvous) is ``agent_s``. Baseline: the same job and kills on
  plain torchrun agents (``KILN_LOCAL_AGENT=torchrun``: a new interpreter per worker, 1 s monitor),
  i.e. the local backend before its agents forked preloaded workers; ratio = fast / baseline
  (medians). Goal: <= 10 s.
- **effective training time**: the same job (``KILN_BENCH_EFFECTIVE_STEPS`` steps, default 14000: about
  five minutes here, so about five kills) run uninterrupted and with a worker SIGKILLed every
  ``KILN_BENCH_KILL_EVERY_S`` (60) seconds, ``KILN_BENCH_EFFECTIVE_PAIRS`` (1) pairs in alternating
  order (U K, then K U, ...). Headline: median uninterrupted wall / median wall with kills (submit to
  result.json; goal >= 0.90). It only means something on a quiet machine: the load average of each
  run is recorded beside it, and a run with kills that finishes faster than its uninterrupted twin is
  flagged (the load moved more than the kills cost: the figure of 2026-11-29, 0.91 at load 17, was
  such a run). Cross-check, measured inside each run with kills: ``1 - lost / wall``, lost = per
  kill the time since the newest committed checkpoint (those steps are redone) + crash -> first
  resumed step. Every run must end with the same ``weights_sha256``. ``KILN_BENCH_STRATEGY``
  (ddp) picks the parallel strategy of these jobs.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.launchers.local import agent_pids, worker_pid

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "training" / "recipes" / "tiny.toml"
CKPT_EVERY = 20


def _spec(run_dir: Path, manifest: Path, steps: int, *, baseline: bool = False, max_restarts: int = 8) -> Any:
    from kiln.launchers import LaunchSpec

    env = {"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if baseline:
        env["KILN_LOCAL_AGENT"] = "torchrun"
    strategy = os.environ.get("KILN_BENCH_STRATEGY", "ddp")
    return LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=TINY, run_key=f"bench-{run_dir.parent.name}",
                      nodes=2, nproc_per_node=1, max_restarts=max_restarts, env=env,
                      overrides=(f"train.steps={steps}", f"checkpoint.every_steps={CKPT_EVERY}",
                                 "checkpoint.keep_last=2", "train.log_every=50", "optim.warmup_steps=10",
                                 f"parallel.strategy={strategy}"))






def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*/manifest.json"))


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == kind:
            out.append(record)
    return out


def _wait(predicate, limit_s: float = 600.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark gave up waiting")
        time.sleep(0.02)


def _kill_worker(run_dir: Path, node: str) -> float:
    def found() -> bool:
        pid = worker_pid(agent_pids(run_dir).get(node, -1))
        return pid is not None

    _wait(found)
    pid = worker_pid(agent_pids(run_dir)[node])
    assert pid is not None
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


def recovery_trial(root: Path, manifest: Path, kills: int, *, baseline: bool) -> list[dict[str, Any]]:
    """One job, ``kills`` worker SIGKILLs, each after a fresh committed checkpoint past the last resume."""
    from kiln.launchers import LocalLauncher, wait

    run_dir = root / ("baseline" if baseline else "fast") / "run"
    steps = CKPT_EVERY * (2 * kills + 3)
    launcher = LocalLauncher()
    handle = launcher.submit(_spec(run_dir, manifest, steps, baseline=baseline))
    out = []
    for i in range(kills):
        target = CKPT_EVERY * (2 * i + 1)
        _wait(lambda target=target: len(agent_pids(run_dir)) == 2 and bool(_committed(run_dir))
              and max(_committed(run_dir)) >= target)
        t_kill = _kill_worker(run_dir, str(i % 2))
        _wait(lambda i=i: len(_events(run_dir, "startup")) >= i + 2)
        event = _events(run_dir, "startup")[i + 1]
        phases = {k: v for k, v in event["phases_s"].items() if v is not None}
        worker_s = event["first_step_unix"] - event["process_start_unix"]
        total = event["first_step_unix"] - t_kill
        out.append({"crash_to_first_step_s": total, "agent_s": total - worker_s, "worker_s": worker_s, **phases})
        print("k" if not baseline else "b", end="", flush=True)
    status = wait(launcher, handle, log=lambda _line: None, poll_s=0.5)
    assert status.state == "SUCCEEDED", status
    return out


def effective_time(root: Path, manifest: Path, steps: int, every_s: float, pairs: int) -> dict[str, Any]:
    from kiln.launchers import LocalLauncher, wait

    def timed(name: str, kill_every: float | None) -> dict[str, Any]:
        run_dir = root / name / "run"
        launcher = LocalLauncher()
        load0 = os.getloadavg()[0]
        t0 = time.time()
        handle = launcher.submit(_spec(run_dir, manifest, steps, max_restarts=50))
        kills = 0
        commits: list[tuple[float, float]] = []  # (kill time, commit time of the newest checkpoint then)
        next_kill = t0 + kill_every if kill_every else None
        while not launcher.poll(handle).done:
            if next_kill is not None and time.time() >= next_kill:
                # No waiting here: between restarts (or after the last step) there may be no worker;
                # then try again on the next pass.
                pid = worker_pid(agent_pids(run_dir).get(str(kills % 2), -1))
                newest = _committed(run_dir)
                if pid is not None and newest:
                    try:
                        committed_at = (run_dir / "checkpoints" / f"step-{newest[-1]:08d}" / "manifest.json").stat().st_mtime
                        os.kill(pid, signal.SIGKILL)
                        commits.append((time.time(), committed_at))
                        kills += 1
                        next_kill = time.time() + kill_every
                    except (ProcessLookupError, FileNotFoundError):
                        pass
            time.sleep(0.1)
        wall = time.time() - t0
        status = wait(launcher, handle, log=lambda _line: None)
        assert status.state == "SUCCEEDED", status
        result = json.loads((run_dir / "result.json").read_text())
        # Lost to each kill, measured inside this run: the steps computed since the newest commit
        # (redone) + crash -> first resumed step.
        resumed = [e["first_step_unix"] for e in _events(run_dir, "startup")[1:]]
        lost = sum(first - committed for (_kill, committed), first in zip(commits, resumed, strict=False))
        print("e", end="", flush=True)
        return {"wall_s": wall, "sha": result["weights_sha256"], "kills": kills, "lost_s": lost,
                "load_1m": f"{load0:.1f} -> {os.getloadavg()[0]:.1f}"}

    clean: list[dict[str, Any]] = []
    faulty: list[dict[str, Any]] = []
    for pair in range(pairs):
        order = ("uninterrupted", "killed") if pair % 2 == 0 else ("killed", "uninterrupted")
        for kind in order:
            run = timed(f"{kind}-{pair}", every_s if kind == "killed" else None)
            (faulty if kind == "killed" else clean).append(run)
    med = statistics.median
    return {
        "effective": med(r["wall_s"] for r in clean) / med(r["wall_s"] for r in faulty),
        "effective_in_run": med(1 - r["lost_s"] / r["wall_s"] for r in faulty),
        "same_weights": len({r["sha"] for r in clean + faulty}) == 1,
        "faster_with_kills": any(f["wall_s"] < c["wall_s"] for c, f in zip(clean, faulty, strict=True)),
        "runs": {**{f"uninterrupted {i}": {"wall_s": round(r["wall_s"], 1), "load_1m": r["load_1m"]}
                    for i, r in enumerate(clean)},
                 **{f"with kills {i}": {"wall_s": round(r["wall_s"], 1), "kills": r["kills"],
                                        "lost_s (redone steps + recovery)": round(r["lost_s"], 1),
                                        "load_1m": r["load_1m"]} for i, r in enumerate(faulty)}},
    }


def main() -> dict[str, Any]:
    kills = int(os.environ.get("KILN_BENCH_KILLS", "3"))
    steps = int(os.environ.get("KILN_BENCH_EFFECTIVE_STEPS", "14000"))
    every_s = float(os.environ.get("KILN_BENCH_KILL_EVERY_S", "60"))
    pairs = int(os.environ.get("KILN_BENCH_EFFECTIVE_PAIRS", "1"))
    sys.path.insert(0, str(REPO / "tests" / "integration"))
    from training_manifests import stdlib_manifest

    load = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-nodeloss-") as tmp:
        root = Path(tmp)
        manifest = stdlib_manifest(root, max_chars=300_000)
        fast = recovery_trial(root / "r", manifest, kills, baseline=False)
        base = recovery_trial(root / "r", manifest, kills, baseline=True)
        eff = effective_time(root / "e", manifest, steps, every_s, pairs)
    print(flush=True)
    med = statistics.median
    fast_s = med(t["crash_to_first_step_s"] for t in fast)
    base_s = med(t["crash_to_first_step_s"] for t in base)

    def phases(trials: list[dict[str, Any]]) -> dict[str, float]:
        keys = [k for k in trials[0] if k != "crash_to_first_step_s"]
        return {k: round(med(t[k] for t in trials if k in t), 2) for k in keys}

    return {
        "name": "Node loss on 2 local nodes: crash -> first resumed step, effective training time",
        "baseline": (
            f"crash -> first resumed step on plain torchrun agents (a new interpreter per worker, 1 s monitor "
            f"interval), same job and kills, measured in the same run; ratio = fast agents / baseline, medians "
            f"of {kills} worker SIGKILLs each (tiny recipe, 2 nodes x 1 CPU worker, checkpoint every {CKPT_EVERY})"
        ),
        "ratio": round(fast_s / base_s, 3),
        "crash_to_first_resumed_step_s": round(fast_s, 2),
        "crash_to_first_resumed_step_goal": "<= 10 s",
        "baseline_crash_to_first_resumed_step_s": round(base_s, 2),
        "effective_training_time": round(eff["effective"], 4),
        "effective_training_time_is": (f"uninterrupted wall / wall with a worker SIGKILLed every {every_s:.0f} s, "
                                       f"{steps} steps, medians of {pairs} alternated pair(s)"),
        "effective_training_time_goal": ">= 0.90",
        "effective_training_time_in_run (1 - lost / wall)": round(eff["effective_in_run"], 4),
        "effective_run_with_kills_finished_faster": eff["faster_with_kills"],
        "effective_same_weights_sha256": eff["same_weights"],
        "strategy": os.environ.get("KILN_BENCH_STRATEGY", "ddp"),
        "load_avg_at_start": " ".join(f"{x:.1f}" for x in load),
        "fast_phases_median_s": phases(fast),
        "baseline_phases_median_s": phases(base),
        "trials_s": {
            "fast": [round(t["crash_to_first_step_s"], 2) for t in fast],
            "baseline": [round(t["crash_to_first_step_s"], 2) for t in base],
        },
        "effective runs": eff["runs"],
        "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
