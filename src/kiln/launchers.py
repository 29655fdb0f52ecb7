"""Launch the trainer as one gang of torchrun agents and hand back its TrainResult.

``local`` (embedded default): N torchrun agents on this machine form one N-node job over c10d
rendezvous on 127.0.0.1 — the same shape as N real nodes, so restarts and rendezvous behave as they
would on a cluster. Each agent runs in its own process group so that cancelling kills every worker.

Launch lines (what this module runs, for node ``i`` of ``N``)::

    torchrun --nnodes=N --nproc-per-node=P --node-rank=i --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=RUN --max-restarts=R \\
        -m kiln_trainer.train --manifest M.json --recipe R.toml --run-dir DIR
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError, LaunchError
from kiln.refs import TrainResult


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchSpec:
    """One training job: what to run, on how many nodes, and where it writes."""

    run_dir: Path
    manifest: Path
    recipe: Path
    run_key: str
    """Stable id of the job (DAG id + run id): the rendezvous id and the MLflow run key."""
    nodes: int = 1
    nproc_per_node: int = 1
    max_restarts: int = 0
    overrides: tuple[str, ...] = ()
    """``section.key=value`` recipe overrides (run params win over the recipe)."""
    max_steps: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ConfigError(f"nodes must be within [1, 64], got {self.nodes}")
        if not 1 <= self.nproc_per_node <= 64:
            raise ConfigError(f"nproc_per_node must be within [1, 64], got {self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be >= 1, got {self.max_steps}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agent_argv(spec: LaunchSpec, node_rank: int, port: int) -> list[str]:
    rdzv_id = re.sub(r"[^A-Za-z0-9_-]", "_", spec.run_key)[-64:]
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={spec.nodes}", f"--nproc-per-node={spec.nproc_per_node}", f"--node-rank={node_rank}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        f"--max-restarts={spec.max_restarts}", "--monitor-interval=1",
        "-m", "kiln_trainer.train",
        "--manifest", str(spec.manifest), "--recipe", str(spec.recipe), "--run-dir", str(spec.run_dir),
    ]
    for item in spec.overrides:
        argv += ["--set", item]
    if spec.max_steps is not None:
        argv += ["--max-steps", str(spec.max_steps)]
    return argv


def launch_local(spec: LaunchSpec, *, log: Callable[[str], None] = print) -> TrainResult:
    """Run the job to completion; stream every agent's output through ``log``; return its result."""
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cores = os.cpu_count() or 1
    threads = max(1, cores // (spec.nodes * spec.nproc_per_node))
    env = {
        **os.environ,
        **spec.env,
        "OMP_NUM_THREADS": str(threads),
        "KILN_TORCH_THREADS": str(threads),  # agents share this host: split the cores, never oversubscribe
        # Whole-group restarts on one host succeed reliably only without the shared TCP store
        # (FIELD-NOTES: 2/7 with it, 6/6 without).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen[str]] = []
    tails: list[deque[str]] = []
    pumps = []
    try:
        for node in range(spec.nodes):
            proc = subprocess.Popen(
                agent_argv(spec, node, port), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, text=True, start_new_session=True, cwd=spec.run_dir,
            )
            procs.append(proc)
            tail: deque[str] = deque(maxlen=40)
            tails.append(tail)
            pump = threading.Thread(target=_pump, args=(proc, f"[node {node}] ", tail, log), daemon=True)
            pump.start()
            pumps.append(pump)
        codes = _wait_all(procs)
    except BaseException:
        cancel(procs)
        raise
    for pump in pumps:
        pump.join(timeout=5)
    if any(codes):
        detail = "\n".join(f"node {i} exit {c}: " + " | ".join(list(t)[-8:]) for i, (c, t) in enumerate(zip(codes, tails)) if c)
        raise LaunchError(f"training job {spec.run_key} failed (restarts exhausted or fatal error):\n{detail}")
    return read_result(spec.run_dir)


def _pump(proc: subprocess.Popen[str], prefix: str, tail: deque[str], log: Callable[[str], None]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        log(prefix + line)


def _wait_all(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Wait for every agent; if one fails while others hang on rendezvous, stop the rest after a grace."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes]  # type: ignore[arg-type]
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 60:
            cancel(procs)
        time.sleep(0.2)


def cancel(procs: list[subprocess.Popen[str]]) -> None:
    """End every agent's whole process group (agents and their workers)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def read_result(run_dir: Path) -> TrainResult:
    path = Path(run_dir) / "result.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LaunchError(f"training finished without a readable {path}: {exc}") from exc
    return TrainResult.from_json(data)
