"""``slurm`` backend: ``sbatch -N<nodes>``, one ``srun`` task per node running a torchrun agent.

The batch script (``render_sbatch``) runs on the job's first node: it picks the rendezvous endpoint
there (the first node's NodeAddr, a free port) and starts ``srun --kill-on-bad-exit=1 torchrun ...``
on every node, so the N agents meet over c10d, torchrun restarts the group after a worker failure
(``--max-restarts``) and a node whose agent gives up takes the whole step down instead of leaving
the others waiting on rendezvous.

Nodes a straggler action excluded (``resubmit_excluding``) are kept in
``RUN/.launch/slurm-excluded-nodes.json``: every later submission of that run dir (a retried task,
the next resubmission) leaves them out too.

Elastic shrink (``min_nodes`` < ``nodes``): the submission after a job ended ``NODE_FAIL`` (the
task's retry) asks ``sinfo`` which nodes of the partition are up. All ``nodes`` there: the job goes
in whole. Fewer: it waits up to ``replacement_timeout_s`` for them to come back, then submits on the
nodes up (never fewer than ``min_nodes``: else ``LaunchError`` naming it), says so in the new job's
log (``[launcher] elastic shrink: ...``) and records it (``kiln.launchers.elastic``). The trainer
resumes from the last committed checkpoint at the smaller world size, with the same global batch.

State comes from ``squeue`` while the job is known to the controller's queue, then
``scontrol show job`` (kept ``MinJobAge`` seconds), then ``sacct`` where accounting is on. Partition
and QoS come from the policy (production may preempt sandbox); ``scancel`` cancels. The batch log is
``RUN/.launch/slurm-<jobid>.log`` (``srun --label``: each line starts with its node's task id).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from kiln.errors import ConfigError, LaunchError
from kiln.launchers.base import (
    JobHandle,
    JobStatus,
    LaunchSpec,
    check_recipe,
    clear_launch_state,
    fatal_markers,
    fatal_reason,
    result_for,
    tail_text,
    torchrun_argv,
)
from kiln.launchers.elastic import Shrink, record_shrink, recorded_shrinks, shrinks_for_status
from kiln.refs import TrainResult
from kiln.runs import LAUNCH_SPEC, LAUNCH_SUBDIR, SLURM_EXCLUDED_NODES, SLURM_JOB_ID, SLURM_SCRIPT, slurm_log
from kiln.util.fs import read_own_json

_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"}
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")
_UP = {"idle", "alloc", "mix", "comp", "plnd"}
"""sinfo's short node states of a node that takes jobs (a suffix such as ``*``, not responding, or
``~``, powered off, means it does not); down, drain, drng, fail, maint, ... do not either."""
_NOTE_MARK = "# kiln: note"
"""Ends the script's echo lines that tell the job log what the launcher did (an elastic shrink): two
scripts that differ only there are the same job."""


_FREE_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


def render_sbatch(spec: LaunchSpec, *, partition: str | None = None, qos: str | None = None,
                  python: str = sys.executable, time_limit: str | None = None, rdzv_port: int | None = None,
                  exclude: tuple[str, ...] = (), requeue: bool = False, notes: tuple[str, ...] = ()) -> str:
    """The batch script for ``spec``: one torchrun agent per node (``srun``), c10d on the first node.
    ``notes``: lines the job's log starts with (``[launcher] <note>``)."""
    for label, value in (("partition", partition), ("qos", qos)):
        if value is not None and not _NAME_OK.fullmatch(value):
            raise ConfigError(f"slurm {label} must be a plain Slurm name, got {value!r}")
    launch_dir = spec.launch_dir
    directives = [
        f"--job-name=kiln-{spec.rdzv_id}"[:80],
        f"--nodes={spec.nodes}",
        "--ntasks-per-node=1",
        f"--output={launch_dir}/slurm-%j.log",
        f"--chdir={spec.run_dir}",
        "--requeue" if requeue else "--no-requeue",
    ]
    if requeue:  # a requeued job keeps its id: append, so the lost attempt's log stays readable
        directives.append("--open-mode=append")
    if partition:
        directives.append(f"--partition={partition}")
    if qos:
        directives.append(f"--qos={qos}")
    if time_limit:
        directives.append(f"--time={time_limit}")
    if exclude:
        directives.append(f"--exclude={','.join(exclude)}")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", **spec.env}
    # Every argument quoted except the endpoint, which the batch shell expands once for all nodes.
    agent_line = " ".join(
        '--rdzv-endpoint="${KILN_RDZV_ENDPOINT}"' if arg.startswith("--rdzv-endpoint=") else shlex.quote(arg)
        for arg in torchrun_argv(spec, "ENDPOINT", python=python)
    )
    port = str(rdzv_port) if rdzv_port else f"$({shlex.quote(python)} -c {shlex.quote(_FREE_PORT)})"
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), "", "set -euo pipefail"]
    lines += [f"echo {shlex.quote(f'[launcher] {note}')}  {_NOTE_MARK}" for note in notes]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    lines += [
        "# c10d rendezvous on the job's first node (this script runs there).",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'head_addr=$(scontrol show node "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' | head -n 1)',
        f'export KILN_RDZV_ENDPOINT="${{head_addr:-$head_node}}:{port}"',
        'echo "[launcher] job $SLURM_JOB_ID on $SLURM_JOB_NODELIST; rendezvous $KILN_RDZV_ENDPOINT"',
        f"srun --kill-on-bad-exit=1 --label --nodes={spec.nodes} --ntasks={spec.nodes} --ntasks-per-node=1 \\",
        f"    {agent_line}",
        "",
    ]
    return "\n".join(lines)


def same_job(script: str, other: str) -> bool:
    """Whether two batch scripts run the same job (they may differ in what they tell the log)."""
    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.endswith(_NOTE_MARK)]

    return body(script) == body(other)


def _run(argv: list[str], env: dict[str, str] | None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # ``env`` adds to this process's environment (e.g. only SLURM_CONF from a trigger's kwargs).
    try:
        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **env} if env else None,
                              timeout=timeout)
    except FileNotFoundError as exc:
        raise LaunchError(f"{argv[0]} not found: is this a Slurm submit host? ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"{' '.join(argv[:3])} did not answer in {timeout:.0f} s") from exc


class SlurmLauncher:
    """The ``slurm`` backend. ``env`` reaches the cluster (e.g. ``SLURM_CONF``): it is added to the
    environment of the Slurm tools only; the job's own environment is the spec's."""

    name = "slurm"

    def __init__(self, *, partition: str | None = None, qos: str | None = None, time_limit: str | None = None,
                 python: str = sys.executable, rdzv_port: int | None = None, exclude: tuple[str, ...] = (),
                 requeue: bool = False, env: dict[str, str] | None = None) -> None:
        self.partition, self.qos, self.time_limit = partition, qos, time_limit
        self.python, self.rdzv_port, self.exclude, self.requeue = python, rdzv_port, tuple(exclude), requeue
        self.env = env

    def render(self, spec: LaunchSpec, notes: tuple[str, ...] = ()) -> str:
        """The batch script: this launcher's ``exclude`` plus the nodes the run dir excluded before."""
        exclude = tuple(dict.fromkeys((*self.exclude, *excluded_nodes(spec.run_dir))))
        return render_sbatch(spec, partition=self.partition, qos=self.qos, python=self.python,
                             time_limit=self.time_limit, rdzv_port=self.rdzv_port, exclude=exclude,
                             requeue=self.requeue, notes=notes)

    def submit(self, spec: LaunchSpec) -> JobHandle:
        """Submit the job, or re-attach to this run dir's job if it is still queued or running the
        same script (a retried task must not put a second gang on the same checkpoints). After a
        ``NODE_FAIL``, a spec that may shrink goes in on the nodes up (see the module docstring)."""
        check_recipe(spec)  # before sbatch: a bad recipe is a usage error, not a FATAL job on every node
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            previous = (spec.launch_dir / SLURM_JOB_ID).read_text().strip()
            previous_script = (spec.launch_dir / SLURM_SCRIPT).read_text()
        except OSError:
            previous = ""
        shrink = None
        if previous:
            handle = JobHandle(backend=self.name, job_id=previous, run_dir=str(spec.run_dir))
            state, _, _ = self._slurm_state(previous)
            if state in _PENDING or state in _RUNNING:
                if same_job(previous_script, self.render(_as_it_ran(spec))):
                    return handle
                self.cancel(handle)
            elif state == "NODE_FAIL" and spec.least_nodes < spec.nodes:
                recorded_shrinks(spec.run_dir)  # a record that cannot take the shrink fails before sbatch
                spec, shrink = self._size_after_node_loss(spec, previous)
        rendered = self.render(spec, notes=(shrink.in_words(),) if shrink else ())
        folder = clear_launch_state(spec)
        (folder / LAUNCH_SPEC).write_text(json.dumps(spec.to_json(), indent=2, sort_keys=True))
        script = folder / SLURM_SCRIPT
        script.write_text(rendered)
        out = _run(["sbatch", "--parsable", str(script)], self.env)
        if out.returncode != 0:
            raise LaunchError(f"sbatch refused {script}: {out.stderr.strip() or out.stdout.strip()}")
        job_id = out.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise LaunchError(f"sbatch answered {out.stdout!r}, not a job id")
        (folder / SLURM_JOB_ID).write_text(job_id)
        if shrink is not None:
            record_shrink(spec.run_dir, replace(shrink, job_id=job_id))
        return JobHandle(backend=self.name, job_id=job_id, run_dir=str(spec.run_dir))

    def nodes_up(self, run_dir: str | Path) -> list[str]:
        """The nodes of this launcher's partition that take jobs (idle, allocated, mixed, completing;
        not down, drained, failing or unresponsive), less those it or the run dir excludes."""
        out = _run(["sinfo", "-h", "-N", "-o", "%N %t", *([f"--partition={self.partition}"] if self.partition else [])],
                   self.env)
        if out.returncode != 0:
            raise LaunchError(f"sinfo failed: {out.stderr.strip() or out.stdout.strip()}")
        excluded = {*self.exclude, *excluded_nodes(run_dir)}
        return sorted({parts[0] for parts in (line.split() for line in out.stdout.splitlines())
                       if len(parts) == 2 and parts[1] in _UP and parts[0] not in excluded})

    def _size_after_node_loss(self, spec: LaunchSpec, lost_job: str,
                              poll_s: float = 1.0) -> tuple[LaunchSpec, Shrink | None]:
        """``spec`` whole when its nodes are up (at once, or within ``replacement_timeout_s``), else
        on the nodes up with the shrink to record; ``LaunchError`` below ``min_nodes``."""
        deadline = time.monotonic() + spec.replacement_timeout_s
        while len(up := self.nodes_up(spec.run_dir)) < spec.nodes and time.monotonic() < deadline:
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
        if len(up) >= spec.nodes:
            return spec, None
        where = f"partition {self.partition}" if self.partition else "the cluster"
        no_replacement = f"{len(up)} node(s) of {where} up: {','.join(up) or 'none'}"
        if len(up) < spec.least_nodes:
            raise LaunchError(
                f"slurm job {lost_job} ended NODE_FAIL and after replacement_timeout_s={spec.replacement_timeout_s} s "
                f"only {no_replacement}, fewer than min_nodes={spec.least_nodes}: not resubmitting")
        shrink = Shrink(backend=self.name, job_id="", lost=f"a node of slurm job {lost_job} (NODE_FAIL)",
                        from_nodes=spec.nodes, to_nodes=len(up), timeout_s=spec.replacement_timeout_s,
                        no_replacement=no_replacement, time=time.time())
        return replace(spec, nodes=len(up)), shrink

    def _slurm_state(self, job_id: str) -> tuple[str, str, str]:
        """(Slurm state, exit code "a:b", reason) from squeue, then scontrol, then sacct."""
        q = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], self.env)
        if q.returncode == 0 and q.stdout.strip():
            state, _, reason = q.stdout.strip().splitlines()[0].partition("|")
            return state, "", reason
        s = _run(["scontrol", "-o", "show", "job", job_id], self.env)
        if s.returncode == 0 and "JobState=" in s.stdout:
            fields = dict(re.findall(r"(\w+)=(\S*)", s.stdout))
            return fields.get("JobState", "UNKNOWN"), fields.get("ExitCode", ""), fields.get("Reason", "")
        if shutil.which("sacct"):
            a = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,Reason"], self.env)
            if a.returncode == 0 and a.stdout.strip():
                state, exit_code, reason = (a.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
                return state.split()[0], exit_code, reason
        return "UNKNOWN", "", f"job {job_id} is unknown to squeue, scontrol and sacct"

    def poll(self, handle: JobHandle) -> JobStatus:
        state, exit_code, reason = self._slurm_state(handle.job_id)
        markers = fatal_markers(handle.run_dir)
        if markers:
            if state in _PENDING or state in _RUNNING:
                self.cancel(handle)  # a fatal fault: torchrun's restarts would only repeat it
            return JobStatus(state="FATAL", reason=fatal_reason(markers))
        shrinks = shrinks_for_status(handle.run_dir)
        if state in _PENDING:
            return JobStatus(state="PENDING", reason=reason, shrinks=shrinks)
        if state in _RUNNING:
            return JobStatus(state="RUNNING", shrinks=shrinks)
        if state == "COMPLETED":
            return JobStatus(state="SUCCEEDED", shrinks=shrinks)
        detail = (f"Slurm state {state}" + (f", exit {exit_code}" if exit_code else "")
                  + (f", reason {reason}" if reason and reason != "None" else ""))
        if state.startswith("CANCELLED"):
            return JobStatus(state="CANCELLED", reason=detail, shrinks=shrinks)
        return JobStatus(state="FAILED", reason=detail, shrinks=shrinks)

    def cancel(self, handle: JobHandle) -> None:
        out = _run(["scancel", "--full", handle.job_id], self.env)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise LaunchError(f"scancel {handle.job_id} failed: {out.stderr.strip()}")

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        path = Path(handle.run_dir) / LAUNCH_SUBDIR / slurm_log(handle.job_id)
        try:
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            return "", offset
        cut = data.rfind(b"\n") + 1
        return data[:cut].decode("utf-8", errors="replace"), offset + cut

    def result(self, handle: JobHandle) -> TrainResult:
        status = self.poll(handle)
        text, _ = self.logs(handle, 0)
        return result_for(status, handle, tail_text(text) if status.state != "SUCCEEDED" else "")


def _as_it_ran(spec: LaunchSpec) -> LaunchSpec:
    """``spec`` at the node count its run dir's last submission ran it with (smaller after an elastic
    shrink), so that a retry re-attaches to the shrunk job instead of cancelling it."""
    try:
        nodes = int(read_own_json(spec.launch_dir / LAUNCH_SPEC)["nodes"])
    except (OSError, ValueError, KeyError, TypeError):
        return spec
    return replace(spec, nodes=nodes) if spec.least_nodes <= nodes < spec.nodes else spec


def excluded_nodes(run_dir: str | Path) -> tuple[str, ...]:
    """Nodes a straggler action excluded for this run dir (``resubmit_excluding``), oldest first."""
    path = Path(run_dir) / LAUNCH_SUBDIR / SLURM_EXCLUDED_NODES
    try:
        nodes = read_own_json(path)
    except FileNotFoundError:
        return ()
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path} is unreadable ({exc}); fix or delete it to resubmit") from exc
    if not isinstance(nodes, list) or not all(isinstance(n, str) and _NAME_OK.fullmatch(n) for n in nodes):
        raise LaunchError(f"{path} must be a JSON list of Slurm node names, got {nodes!r}")
    return tuple(nodes)


def resubmit_excluding(launcher: SlurmLauncher, handle: JobHandle, node: str, *, timeout_s: float = 300.0,
                       poll_s: float = 1.0) -> tuple[SlurmLauncher, JobHandle]:
    """Straggler action on Slurm: end the job, then submit it again without ``node`` (``--exclude``).

    The trainer resumes from the run's last committed checkpoint, so the gang loses at most the steps
    since then. The old job must have left the nodes before the new one starts, or two gangs would
    write the same checkpoints: this waits for it (``timeout_s``). Returns the launcher that excludes
    the node (and every node it excluded before) and the new job's handle; poll that one from now on.
    The node is also recorded in ``RUN/.launch/slurm-excluded-nodes.json`` before the new job is
    submitted, so a retried task that submits again keeps it out.
    """
    if not _NAME_OK.fullmatch(node):
        raise ConfigError(f"slurm node name must be a plain Slurm name, got {node!r}")
    try:
        spec = LaunchSpec.from_json(read_own_json(Path(handle.run_dir) / LAUNCH_SUBDIR / LAUNCH_SPEC))
    except (OSError, ValueError) as exc:
        raise LaunchError(f"cannot resubmit slurm job {handle.job_id}: its spec.json is unreadable ({exc})") from exc
    launcher.cancel(handle)
    deadline = time.monotonic() + timeout_s
    while (state := launcher._slurm_state(handle.job_id)[0]) in _PENDING or state in _RUNNING:
        if time.monotonic() > deadline:
            raise LaunchError(f"slurm job {handle.job_id} still {state} {timeout_s:.0f} s after scancel; not resubmitting")
        time.sleep(poll_s)
    recorded = tuple(dict.fromkeys((*excluded_nodes(handle.run_dir), node)))
    path = Path(handle.run_dir) / LAUNCH_SUBDIR / SLURM_EXCLUDED_NODES
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(list(recorded)))
    os.replace(tmp, path)
    excluding = SlurmLauncher(partition=launcher.partition, qos=launcher.qos, time_limit=launcher.time_limit,
                              python=launcher.python, rdzv_port=launcher.rdzv_port, requeue=launcher.requeue,
                              exclude=tuple(dict.fromkeys((*launcher.exclude, *recorded))), env=launcher.env)
    return excluding, excluding.submit(spec)
