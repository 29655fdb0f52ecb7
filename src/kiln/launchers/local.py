"""``local`` backend: N torchrun agents on this machine form one N-node job, kept alive by a supervisor.

``submit`` starts a detached supervisor process (``kiln.launchers.local.supervise(RUN/.launch/spec.json)``
in its own session) and returns; everything else finds it again through ``RUN/.launch/``:
``job.log`` (every agent's output, prefixed ``[node i]``), ``status.json`` (state, reason, agent pids,
replaced nodes, nodes in the gang, nodes lost for good) and ``supervisor.pid``. So the job outlives
the submitting process, and a deferrable trigger or a retried task can poll, stream and cancel it.

The supervisor plays the cluster scheduler of a real multi-node job:

* it hosts the c10d rendezvous store in a process of its own (agents use ``is_host=false``), so the
  rendezvous survives the loss of any node, including the first;
* each agent (node) runs in its own process group, so a node is lost or cancelled as a whole;
* a worker that dies is torchrun's business: its agent restarts the whole group (``--max-restarts``)
  and every rank resumes from the newest committed checkpoint;
* an agent that dies (a lost node) is the supervisor's: it kills what is left of that node (orphaned
  workers), starts a replacement agent, and the surviving agents re-rendezvous with it — up to
  ``max_restarts`` replacements, and only while a spare node slot is left (``spare_nodes``; None:
  always one, as a scheduler that brings the node back);
* elastic shrink (``min_nodes`` < ``nodes``): with no replacement, the survivors go on without the
  lost node. Agents run ``--nnodes=MIN:MAX`` with ``last_call_timeout = replacement_timeout_s``: the
  survivors' next rendezvous round waits that long for a replacement, then completes with the nodes
  there, and the trainer resumes from the last committed checkpoint at the smaller world size (same
  global batch). The shrink is logged (``[launcher] ... elastic shrink 2 -> 1 node(s)``), counted
  in ``status.json`` (``nodes``, ``lost``) and recorded in ``RUN/.launch/elastic.json``
  (``kiln.launchers.elastic``). Fewer nodes left than ``min_nodes``: the job FAILED, naming it;
* an agent that exits non-zero on its own has spent torchrun's restarts: the job FAILED;
* a fatal marker (a rank exited 2) ends the job at once: FATAL, not restarted, not retried;
* a straggler the trainer flags (``metrics.jsonl``) is logged as ``[launcher] straggler: ... ->
  policy action: alert``: on one host there is no other node to move a rank to.

Agents run ``kiln.launchers.worker --agent`` (torchrun's agent, forking workers from a preloaded
trainer, a 0.2 s monitor interval and a 0.1 s rendezvous poll): a crashed worker's group is back
at its first resumed step in a few seconds (``benchmarks/node_loss_recovery.py``).

Launch lines (what the supervisor runs, for each of the N nodes)::

    python -m kiln.launchers.worker --agent --nnodes=N --nproc-per-node=P --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=RUN --max-restarts=R --monitor-interval=0.2 \\
        --rdzv-conf=is_host=false -m kiln.launchers.worker --manifest M.json --recipe R.toml --run-dir DIR

and with ``min_nodes`` < ``nodes``: ``--nnodes=MIN:N ... --rdzv-conf=is_host=false,last_call_timeout=T``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from kiln.errors import LaunchError
from kiln.launchers.base import (
    FATAL_LINE,
    WORKER_MODULE,
    JobHandle,
    JobStatus,
    LaunchSpec,
    check_manifest,
    check_recipe,
    clear_launch_state,
    fatal_markers,
    fatal_reason,
    result_for,
    tail_text,
    torchrun_argv,
    wait,
)
from kiln.launchers.elastic import Shrink, after_node_loss, record_shrink, shrinks_for_status
from kiln.launchers.stragglers import StragglerPolicy, StragglerWatch
from kiln.refs import TrainResult
from kiln.runs import (
    LAUNCH_LOG,
    LAUNCH_PREVIOUS_LOG,
    LAUNCH_SPEC,
    LAUNCH_STATUS,
    LAUNCH_SUBDIR,
    METRICS_JSONL,
    RESULT_FILE,
    SUPERVISOR_PID,
)
from kiln.util.fs import os_error_text, parse_own_json, read_own_json
from kiln.util.net import free_port
from kiln_trainer.contract import NODE_NAME_ENV, THREADS_ENV

_STORE_CODE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False,
                 multi_tenant=True, timeout=timedelta(seconds=60))
print("rendezvous store ready on port", sys.argv[1], flush=True)
while True:
    time.sleep(3600)
"""


def agent_env(spec: LaunchSpec) -> dict[str, str]:
    cores = os.cpu_count() or 1
    threads = str(max(1, cores // (spec.nodes * spec.nproc_per_node)))
    return {
        **os.environ,
        # Agents share this host: split the cores, never oversubscribe. Determinism depends on the
        # thread count, so a spec that pins KILN_TORCH_THREADS (below, spec.env) wins.
        "OMP_NUM_THREADS": threads,
        THREADS_ENV: threads,
        # Whole-group restarts on one host succeed reliably only without the shared TCP store
        # (measured here: 2 of 7 restarts succeeded with it, 6 of 6 without).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        **spec.env,
    }


AGENT_ENV = "KILN_LOCAL_AGENT"
"""``KILN_LOCAL_AGENT=torchrun`` in a spec's env runs plain torchrun agents (a new interpreter per
worker, 1 s monitor interval): the baseline of ``benchmarks/node_loss_recovery.py``, and a way back
should forking workers ever misbehave."""

MONITOR_INTERVAL_S = 0.2
"""How often an agent checks its workers (torchrun's ``--monitor-interval``, default 1 s here): a
crashed worker, or a peer node waiting at the rendezvous, is noticed within this."""


def agent_argv(spec: LaunchSpec, node_rank: int, port: int) -> list[str]:
    """Node ``node_rank``'s agent: c10d rendezvous on the supervisor's store at 127.0.0.1:port.

    torchrun's own arguments, run by ``kiln.launchers.worker --agent`` (torchrun's agent with
    workers forked from a preloaded trainer and a faster rendezvous poll: see that module).
    c10d assigns node ranks at each rendezvous (a replacement agent may get another one), so
    ``node_rank`` names the agent's slot in the supervisor and its log prefix, not a torch rank.
    """
    del node_rank
    if spec.least_nodes < spec.nodes:
        # Elastic: once min_nodes are in a rendezvous round, torch waits last_call_timeout for more,
        # then goes on with those it has: the survivors of a lost node that nobody replaces in time.
        # torch refuses a last call of 0 s: 1 s is the shortest wait it knows.
        last_call = max(1, spec.replacement_timeout_s)
        argv = torchrun_argv(spec, f"127.0.0.1:{port}", nnodes=f"{spec.least_nodes}:{spec.nodes}",
                             rdzv_conf=f"is_host=false,last_call_timeout={last_call}")
    else:
        argv = torchrun_argv(spec, f"127.0.0.1:{port}", rdzv_conf="is_host=false")
    if spec.env.get(AGENT_ENV) == "torchrun":  # plain torchrun: the recovery benchmark's baseline
        return argv
    assert argv[1:3] == ["-m", "torch.distributed.run"], argv[:3]
    argv[1:3] = ["-m", WORKER_MODULE, "--agent"]
    return [f"--monitor-interval={MONITOR_INTERVAL_S}" if a.startswith("--monitor-interval=") else a for a in argv]


NODE_TAG_ENV = "KILN_LAUNCH_NODE"
"""Set on each agent and inherited by its workers: torchrun starts workers in sessions of their own,
so a node's processes are found by this tag, as a cgroup would find them on a real node."""


def kill_tagged(tag: str, sig: int = signal.SIGKILL) -> int:
    """Signal every process of this machine whose environment carries ``KILN_LAUNCH_NODE=tag``."""
    needle = f"{NODE_TAG_ENV}={tag}".encode() + b"\0"
    hit = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                if needle not in fh.read() + b"\0":
                    continue
            os.kill(int(entry.name), sig)
            hit += 1
        except (OSError, ValueError):
            continue
    return hit


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def cancel(procs: list[subprocess.Popen[Any]]) -> None:
    """End every agent's process group: TERM (torchrun then stops its workers), KILL after 10 s.

    Workers live in sessions of their own; the supervisor also kills them by node tag."""
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)  # not reaped yet, so the pid is still this agent's
            proc.wait()


# ---------------------------------------------------------------------------------- status.json
STATUS_RESERVE = 4096
"""status.json is padded to this many bytes, so that on a full disk the final state still fits in
place of the last one: overwriting bytes a file already has needs no free blocks."""


def record_status(folder: Path, body: dict[str, Any]) -> None:
    """Write ``folder/status.json`` whole (tmp + rename); when the disk has no room for the tmp
    file, overwrite the reserved bytes of the old one instead. Raises OSError if both fail."""
    text = json.dumps(body)
    if len(text) >= STATUS_RESERVE:  # a long reason: shorten it, the job log has it all
        over = len(text) - STATUS_RESERVE + 8
        text = json.dumps({**body, "reason": str(body.get("reason", ""))[: -over] + " ..."})
    data = (text.ljust(STATUS_RESERVE - 1) + "\n").encode()
    path, tmp = folder / LAUNCH_STATUS, folder / f"{LAUNCH_STATUS}.tmp"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY)  # no O_TRUNC: truncating would give the blocks away
        try:
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------ supervisor
class _Supervisor:
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.folder = spec.launch_dir
        self.env = agent_env(spec)
        self.lock = threading.Lock()
        self.agents: list[subprocess.Popen[str]] = []
        self.tails: list[deque[str]] = []
        self.replaced = 0
        self.lost: set[int] = set()
        """Nodes lost for good (not replaced): the job went on without them (elastic shrink)."""
        self.stop_signal: int | None = None
        self.store: subprocess.Popen[str] | None = None
        self.port = 0
        self.started = time.time()
        self.fatal_printed: list[dict[str, Any]] = []
        """What ranks printed as they exited 2 (``FATAL_LINE``): the reason, even without a marker file."""
        self.lost_log_lines = 0
        # Stragglers on one host: alert only (no scheduler to move a rank to another node).
        self.stragglers = StragglerWatch(run_dir=spec.run_dir, policy=StragglerPolicy(action="alert"))

    def say(self, line: str) -> None:
        """Append to job.log; a line the disk has no room for is counted and lost, never the job."""
        with self.lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except OSError:
                self.lost_log_lines += 1

    def write_status(self, state: str, reason: str = "") -> None:
        body = {
            "state": state, "reason": reason, "restarts": self.replaced, "rdzv_port": self.port,
            "agents": {str(i): a.pid for i, a in enumerate(self.agents) if i not in self.lost},
            "nodes": len(self.agents) - len(self.lost), "lost": sorted(self.lost), "supervisor": os.getpid(),
            "time": time.time(),
        }
        record_status(self.folder, body)

    def fatal_now(self) -> list[dict[str, Any]]:
        """Ranks that exited 2, from their marker files or, where a full disk left a marker empty
        or absent, from the line they printed."""
        markers = fatal_markers(self.spec.run_dir)
        with self.lock:
            printed = list(self.fatal_printed)
        if not markers:
            return printed
        said = {str(m["rank"]): m["error"] for m in printed}
        return [{**m, "error": m.get("error") or said.get(str(m.get("rank")), "")} for m in markers]

    def start_store(self) -> None:
        for _ in range(3):
            self.port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-c", _STORE_CODE, str(self.port)], stdin=subprocess.DEVNULL,
                env={**self.env, NODE_TAG_ENV: f"{self.spec.rdzv_id}.{os.getpid()}.store"},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            assert proc.stdout is not None
            first = proc.stdout.readline()
            if "ready" in first:
                threading.Thread(target=self._pump, args=(proc.stdout, "[rdzv] ", None), daemon=True).start()
                self.store = proc
                return
            proc.kill()
            proc.wait()
            self.say(f"[launcher] rendezvous store on port {self.port} did not start: {first.strip()}")
        raise LaunchError("could not start the rendezvous store (3 ports tried)")

    def node_tag(self, node: int) -> str:
        return f"{self.spec.rdzv_id}.{os.getpid()}.{node}"

    def kill_node(self, node: int) -> None:
        """The whole node: its agent and every worker it started (orphans included), by tag: the
        agent's pid, already reaped, may belong to another process by now."""
        kill_tagged(self.node_tag(node))

    def start_agent(self, node: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            agent_argv(self.spec, node, self.port),
            env={**self.env, NODE_TAG_ENV: self.node_tag(node), NODE_NAME_ENV: f"node{node}"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True, cwd=self.spec.run_dir,
        )
        tail: deque[str] = deque(maxlen=40)
        assert proc.stdout is not None
        threading.Thread(target=self._pump, args=(proc.stdout, f"[node {node}] ", tail), daemon=True).start()
        if node < len(self.agents):
            self.agents[node], self.tails[node] = proc, tail
        else:
            self.agents.append(proc)
            self.tails.append(tail)
        return proc

    def _pump(self, stream: IO[str], prefix: str, tail: deque[str] | None) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if tail is not None:
                tail.append(line)
            if FATAL_LINE in line:  # "[kiln fatal] rank N: error"
                rank, _, error = line.split(FATAL_LINE, 1)[1].removeprefix("rank ").partition(": ")
                with self.lock:
                    self.fatal_printed.append({"rank": rank, "exit_code": 2, "error": error})
            self.say(prefix + line)

    def end_all(self) -> None:
        cancel(self.agents)
        for node in range(len(self.agents)):
            kill_tagged(self.node_tag(node))

    def finished_training(self) -> bool:
        try:
            return (self.spec.run_dir / RESULT_FILE).stat().st_mtime >= self.started
        except OSError:
            return False

    def node_detail(self, node: int) -> str:
        return " | ".join(list(self.tails[node])[-6:])

    def run(self) -> tuple[str, str]:
        spec = self.spec
        self.start_store()
        for node in range(spec.nodes):
            self.start_agent(node)
        self.write_status("RUNNING")
        elastic = (f"; elastic: min_nodes={spec.least_nodes}, replacement_timeout_s={spec.replacement_timeout_s}, "
                   f"spare_nodes={'unlimited' if spec.spare_nodes is None else spec.spare_nodes}"
                   if spec.least_nodes < spec.nodes else "")
        self.say(f"[launcher] {spec.nodes} agent(s) started; rendezvous 127.0.0.1:{self.port} id {spec.rdzv_id}{elastic}")
        self.stragglers.offset = _size(spec.run_dir / METRICS_JSONL)  # a resubmission: only new flags
        while True:
            for action in self.stragglers.poll():
                self.say(f"[launcher] {action.message}")
            if self.stop_signal is not None:
                self.end_all()
                return "CANCELLED", f"cancelled (signal {self.stop_signal})"
            markers = self.fatal_now()
            if markers:
                self.end_all()
                return "FATAL", fatal_reason(markers)
            codes = {node: a.poll() for node, a in enumerate(self.agents) if node not in self.lost}
            if all(c == 0 for c in codes.values()):
                return "SUCCEEDED", ""
            for node, code in codes.items():
                if code is None or code == 0:
                    continue
                if code < 0:  # killed by a signal: the node is lost, not finished
                    self.kill_node(node)  # its orphaned workers would train on as if nothing happened
                    if self.finished_training():
                        # Lost after the last step: the survivors would wait out torchrun's exit
                        # barrier (300 s) for it; the committed result is all that matters.
                        self.end_all()
                        return "SUCCEEDED", f"node {node} lost after training finished"
                    ended = self.lose_node(node, -code)
                    if ended is not None:
                        self.end_all()
                        return ended
                    continue
                # torchrun gave up on its own: the worker group failed more than max_restarts times.
                time.sleep(0.5)  # let a fatal marker that explains it land first
                markers = self.fatal_now()
                self.end_all()
                if markers:
                    return "FATAL", fatal_reason(markers)
                return "FAILED", (
                    f"node {node}: torchrun exited {code}: the worker group kept failing and torchrun's restarts "
                    f"are spent (max_restarts={spec.max_restarts}); last lines: {self.node_detail(node)}"
                )
            time.sleep(0.2)

    def lose_node(self, node: int, signum: int) -> tuple[str, str] | None:
        """A node whose agent was killed: replace it when a replacement is there (a spare node slot and
        the restart budget), else go on without it when the nodes left are at least ``min_nodes``
        (elastic shrink, recorded), else the job's final ``(state, reason)``."""
        spec = self.spec
        left = len(self.agents) - len(self.lost) - 1
        spare = spec.spare_nodes is None or self.replaced < spec.spare_nodes
        budget = self.replaced < spec.max_restarts
        action = after_node_loss(nodes_left=left, min_nodes=spec.least_nodes, replacement=spare and budget)
        if action == "replace":
            self.replaced += 1
            self.say(f"[launcher] node {node} lost (agent killed by signal {signum}): starting a replacement "
                     f"agent ({self.replaced}/{spec.max_restarts}); the group restarts from the last checkpoint")
            self.start_agent(node)
            self.write_status("RUNNING")
            return None
        if not spare:
            no_replacement = f"no spare node slot left (spare_nodes={spec.spare_nodes}, {self.replaced} used)"
        else:
            no_replacement = (f"the restart budget is spent (max_restarts={spec.max_restarts}, "
                              f"{self.replaced} node(s) replaced)")
        if action == "fail":
            if spec.least_nodes == spec.nodes and not budget:  # no elastic policy: the words of old
                return "FAILED", f"node {node} lost (agent killed by signal {signum}) and {no_replacement}"
            return "FAILED", (f"node {node} lost (agent killed by signal {signum}) and {no_replacement}; the {left} "
                              f"node(s) left are fewer than min_nodes={spec.least_nodes}: not going on smaller")
        self.lost.add(node)
        shrink = Shrink(backend="local", job_id=str(os.getpid()), lost=f"node {node} (agent killed by signal {signum})",
                        from_nodes=left + 1, to_nodes=left, timeout_s=spec.replacement_timeout_s,
                        no_replacement=no_replacement, time=time.time())
        self.say(f"[launcher] node {node} lost (agent killed by signal {signum}) and {no_replacement}: elastic shrink "
                 f"{left + 1} -> {left} node(s) (min_nodes={spec.least_nodes}): the node(s) left wait "
                 f"replacement_timeout_s={spec.replacement_timeout_s} s for a replacement in the rendezvous, then "
                 f"restart without it from the last committed checkpoint")
        try:
            record_shrink(spec.run_dir, shrink)
        except (OSError, LaunchError) as exc:  # the job goes on: the record is what tells, not what runs
            detail = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
            self.say(f"[launcher] the elastic shrink was not recorded: {detail}")
        self.write_status("RUNNING")
        return None

    def close(self) -> None:
        if self.store is not None and self.store.poll() is None:
            self.store.kill()
            self.store.wait()


def supervise(spec_path: str | Path) -> int:
    spec = LaunchSpec.from_json(read_own_json(Path(spec_path)))
    sup = _Supervisor(spec)

    def on_signal(signum: int, _frame: Any) -> None:
        sup.stop_signal = signum

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        state, reason = sup.run()
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the final status below must still be written
            sup.end_all()
        detail = os_error_text(exc) if isinstance(exc, OSError) else str(exc)
        state, reason = "FAILED", f"launcher error: {type(exc).__name__}: {detail}"
    finally:
        sup.close()
    if sup.lost_log_lines:
        lost = f"{sup.lost_log_lines} line(s) of the job log were lost: no room in {sup.folder}"
        reason = f"{reason} ({lost})" if reason else lost
    try:
        sup.write_status(state, reason)
    except OSError as exc:  # readers see a dead supervisor behind a RUNNING status: FAILED
        sup.say(f"[launcher] job {state}, but its status could not be recorded: {os_error_text(exc)}")
        return 1
    sup.say(f"[launcher] job {state}" + (f": {reason}" if reason else ""))
    return 0 if state == "SUCCEEDED" else 1


# ------------------------------------------------------------------------------------- interface
_SUPERVISORS: dict[int, subprocess.Popen[bytes]] = {}
"""The supervisors this process started: kept, so that their exit status is ours to read (and not
reaped unseen by ``subprocess``'s clean-up of a dropped Popen) and a dead one's reason says how it ended."""


def _alive(pid: int) -> bool:
    proc = _SUPERVISORS.get(pid)
    if proc is not None:
        # Our own child: its exit status is the whole truth (its pid cannot be reused before we reap
        # it). The /proc reading below is for a supervisor another process started; applied to our
        # own it once called a live, just-started supervisor dead ("died without a final status"
        # with no exit status: seen in CI and in a clean run, never reproduced on demand).
        return proc.poll() is None
    try:  # our child started some other way: reap it too
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    deadline = time.monotonic() + _EXEC_GRACE_S
    while True:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            return False
        if cmdline or state in ("Z", "X") or time.monotonic() >= deadline:
            return state not in ("Z", "X") and b"kiln.launchers.local" in cmdline
        time.sleep(0.02)  # in the middle of its execve: read again


_EXEC_GRACE_S = 2.0
"""How long ``_alive`` reads an empty command line again before it takes it as an answer. A process
in the middle of ``execve`` has its new memory but not yet its argument list (Linux sets
``arg_start``/``arg_end`` in the ELF loader after ``begin_new_exec``, which is also when a ``vfork``
parent such as ``subprocess.Popen`` goes on), so for that moment ``/proc/PID/cmdline`` reads empty.
On a loaded machine a poll right after a supervisor started landed there and called it dead ("died
without a final status"). A pid that stays empty is a kernel thread's, or none of ours."""


def _how_it_ended(pid: int) -> str:
    """`` (killed by SIGKILL)`` / `` (exit status 1)`` for a supervisor this process started, else ``""``."""
    proc = _SUPERVISORS.get(pid)
    code = None if proc is None else proc.poll()
    if code is None:
        return ""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f" (killed by {signal.Signals(-code).name})"
        return f" (killed by signal {-code})"
    return f" (exit status {code})"


def _read_status(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        return read_own_json(Path(run_dir) / LAUNCH_SUBDIR / LAUNCH_STATUS)
    except (OSError, ValueError):
        return None


def _full_disk_note(run_dir: str | Path) -> str:
    """`` (the file system of RUN has no space left)`` when that is likely why a supervisor died, else ``""``."""
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return ""
    if st.f_bavail * st.f_frsize < STATUS_RESERVE:
        return f" (the file system of {run_dir} has no space left)"
    return ""


def _log_tail(run_dir: str | Path, size: int = 4096) -> str:
    """The whole lines among the last ``size`` bytes of the job log ("" if there is none)."""
    try:
        with open(Path(run_dir) / LAUNCH_SUBDIR / LAUNCH_LOG, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            data = fh.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace").partition("\n")[2] if len(data) == size else data.decode(
        "utf-8", errors="replace")


def agent_pids(run_dir: str | Path) -> dict[str, int]:
    """Node index -> pid of its running agent, from the job's ``status.json`` ({} before they start)."""
    status = _read_status(run_dir) or {}
    agents = status.get("agents")
    return dict(agents) if isinstance(agents, dict) else {}


def worker_pid(agent_pid: int) -> int | None:
    """The trainer worker an agent forked (its child running ``kiln.launchers.worker``), if any:
    what fault injection kills to lose one worker rather than a whole node."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            if b"kiln.launchers.worker" in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return None


class LocalLauncher:
    """The ``local`` backend (see the module docstring)."""

    name = "local"

    def submit(self, spec: LaunchSpec) -> JobHandle:
        """Start the job, or re-attach to this run dir's job if it is still running the same spec.

        The supervisor outlives the process that submitted it; a retried Airflow task that submits
        again must not start a second gang writing the same checkpoints.
        """
        running = self.find_running(spec.run_dir)
        if running is not None:
            try:
                asked = parse_own_json(json.dumps(spec.to_json()), "the launch spec")  # tuples as JSON lists
                same = read_own_json(spec.launch_dir / LAUNCH_SPEC) == asked
            except (OSError, ValueError):
                same = False
            if same:
                return running
        check_recipe(spec)  # before anything starts (or a running job is cancelled for it)
        check_manifest(spec)
        if running is not None:
            self.cancel(running)
        try:
            return self._start_supervisor(spec)
        except OSError as exc:  # a full or read-only run dir: nothing was started
            raise LaunchError(f"cannot start the job in {spec.run_dir}: {os_error_text(exc)}") from exc

    def _start_supervisor(self, spec: LaunchSpec) -> JobHandle:
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        folder = clear_launch_state(spec)
        spec_path = folder / LAUNCH_SPEC
        spec_path.write_text(json.dumps(spec.to_json(), indent=1))
        log_path = folder / LAUNCH_LOG
        if log_path.exists():  # one log per attempt: a retry streams only its own lines
            os.replace(log_path, folder / LAUNCH_PREVIOUS_LOG)
        with open(log_path, "w") as log_file:
            log_file.write(f"[launcher] submit {spec.run_key} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            log_file.flush()
            proc = subprocess.Popen(
                [sys.executable, "-c", "import sys; from kiln.launchers.local import supervise; "
                 "sys.exit(supervise(sys.argv[1]))", str(spec_path)], stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=spec.run_dir,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            (folder / SUPERVISOR_PID).write_text(str(proc.pid))
        except OSError:  # nobody could find this supervisor again: it must not run
            _kill_group(proc.pid)
            proc.wait()
            raise
        _SUPERVISORS[proc.pid] = proc
        return JobHandle(backend=self.name, job_id=str(proc.pid), run_dir=str(spec.run_dir))

    def find_running(self, run_dir: Path) -> JobHandle | None:
        """The live supervisor of ``run_dir``, if any."""
        try:
            pid = int((Path(run_dir) / LAUNCH_SUBDIR / SUPERVISOR_PID).read_text())
        except (OSError, ValueError):
            return None
        status = _read_status(run_dir)
        if _alive(pid) and (status is None or status.get("state") == "RUNNING"):
            return JobHandle(backend=self.name, job_id=str(pid), run_dir=str(run_dir))
        return None

    def poll(self, handle: JobHandle) -> JobStatus:
        shrinks = shrinks_for_status(handle.run_dir)
        status = _read_status(handle.run_dir)
        if status and status["state"] != "RUNNING":
            return JobStatus(state=status["state"], reason=status.get("reason", ""), restarts=status.get("restarts", 0),
                             shrinks=shrinks)
        if _alive(int(handle.job_id)):
            return JobStatus(state="RUNNING" if status else "PENDING", restarts=(status or {}).get("restarts", 0),
                             shrinks=shrinks)
        status = _read_status(handle.run_dir)  # it may have finished between the two reads
        if status and status["state"] != "RUNNING":
            return JobStatus(state=status["state"], reason=status.get("reason", ""), restarts=status.get("restarts", 0),
                             shrinks=shrinks)
        pid = int(handle.job_id)
        last = " | ".join(_log_tail(handle.run_dir).splitlines()[-5:])
        reason = (f"launcher supervisor {pid} died without a final status{_how_it_ended(pid)}"
                  f"{_full_disk_note(handle.run_dir)}" + (f"; last lines of its log: {last}" if last else ""))
        self._end_leftovers(handle, "FAILED", reason)  # its agents must not train on unsupervised
        return JobStatus(state="FAILED", reason=reason, restarts=(status or {}).get("restarts", 0), shrinks=shrinks)

    def cancel(self, handle: JobHandle) -> None:
        pid = int(handle.job_id)
        if _alive(pid):
            _kill_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        self._end_leftovers(handle, "CANCELLED", "cancelled")

    def _end_leftovers(self, handle: JobHandle, state: str, reason: str) -> None:
        """Kill whatever a gone supervisor left (every node's processes, then its own group) and
        record ``state`` unless the supervisor recorded a final one."""
        # By tag only: a dead supervisor's or agent's pid may already belong to someone else.
        pid = int(handle.job_id)
        try:
            spec = LaunchSpec.from_json(read_own_json(Path(handle.run_dir) / LAUNCH_SUBDIR / LAUNCH_SPEC))
            for node in [*range(spec.nodes), "store"]:
                kill_tagged(f"{spec.rdzv_id}.{pid}.{node}")
        except (OSError, ValueError, KeyError, TypeError):
            pass
        status = _read_status(handle.run_dir)
        if not status or status["state"] == "RUNNING":
            folder = Path(handle.run_dir) / LAUNCH_SUBDIR
            try:
                folder.mkdir(parents=True, exist_ok=True)
                record_status(folder, {"state": state, "reason": reason, "restarts": (status or {}).get("restarts", 0)})
            except OSError:
                pass  # unrecorded: every reader still sees a dead supervisor behind it, and says so

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        path = Path(handle.run_dir) / LAUNCH_SUBDIR / LAUNCH_LOG
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return "", offset
        cut = data.rfind(b"\n") + 1  # whole lines only; the rest comes with the next call
        return data[:cut].decode("utf-8", errors="replace"), offset + cut

    def result(self, handle: JobHandle) -> TrainResult:
        status = self.poll(handle)
        text, _ = self.logs(handle, 0)
        return result_for(status, handle, tail_text(text) if status.state != "SUCCEEDED" else "")


def launch_local(spec: LaunchSpec, *, log: Callable[[str], None] = print) -> TrainResult:
    """Run the job to completion on this machine; stream every agent's output through ``log``."""
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    status = wait(launcher, handle, log=log, poll_s=0.5)
    return result_for(status, handle)  # no log tail in the error: every line went through ``log``

