"""``slurm`` backend: ``sbatch -N<nodes>``, one ``srun`` task per node running a torchrun agent.

The batch script (``render_sbatch``) runs on the job's first node: it picks the rendezvous endpoint
there (the first node's NodeAddr, a free port) and starts ``srun --kill-on-bad-exit=1 torchrun ...``
on every node, so the N agents meet over c10d, torchrun restarts the group after a worker failure
(``--max-restarts``) and a node whose agent gives up takes the whole step down instead of leaving
the others waiting on rendezvous.

Nodes a straggler action excluded (``resubmit_excluding``) are kept in
``RUN/.launch/slurm-excluded-nodes.json``: every later submission of that run dir (a retried task,
the next resubmission) leaves them out too.

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
from kiln.refs import TrainResult
from kiln.runs import LAUNCH_SPEC, LAUNCH_SUBDIR, SLURM_EXCLUDED_NODES, SLURM_JOB_ID, SLURM_SCRIPT, slurm_log

_PENDING = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SUSPENDED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "RESIZING"}
_NAME_OK = re.compile(r"^[A-Za-z0-9_.-]+$")


_FREE_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


def render_sbatch(spec: LaunchSpec, *, partition: str | None = None, qos: str | None = None,
                  python: str = sys.executable, time_limit: str | None = None, rdzv_port: int | None = None,
                  exclude: tuple[str, ...] = (), requeue: bool = False) -> str:
    """The batch script for ``spec``: one torchrun agent per node (``srun``), c10d on the first node."""
    for label, value in (("partition", partition), ("qos", qos)):
        if value is not None and not _NAME_OK.match(value):
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

    def render(self, spec: LaunchSpec) -> str:
        """The batch script: this launcher's ``exclude`` plus the nodes the run dir excluded before."""
        exclude = tuple(dict.fromkeys((*self.exclude, *excluded_nodes(spec.run_dir))))
        return render_sbatch(spec, partition=self.partition, qos=self.qos, python=self.python,
                             time_limit=self.time_limit, rdzv_port=self.rdzv_port, exclude=exclude,
                             requeue=self.requeue)

    def submit(self, spec: LaunchSpec) -> JobHandle:
        """Submit the job, or re-attach to this run dir's job if it is still queued or running the
        same script (a retried task must not put a second gang on the same checkpoints)."""
        check_recipe(spec)  # before sbatch: a bad recipe is a usage error, not a FATAL job on every node
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        rendered = self.render(spec)
        try:
            previous = (spec.launch_dir / SLURM_JOB_ID).read_text().strip()
            previous_script = (spec.launch_dir / SLURM_SCRIPT).read_text()
        except OSError:
            previous = ""
        if previous:
            handle = JobHandle(backend=self.name, job_id=previous, run_dir=str(spec.run_dir))
            state, _, _ = self._slurm_state(previous)
            if state in _PENDING or state in _RUNNING:
                if previous_script == rendered:
                    return handle
                self.cancel(handle)
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
        return JobHandle(backend=self.name, job_id=job_id, run_dir=str(spec.run_dir))

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
        if state in _PENDING:
            return JobStatus(state="PENDING", reason=reason)
        if state in _RUNNING:
            return JobStatus(state="RUNNING")
        if state == "COMPLETED":
            return JobStatus(state="SUCCEEDED")
        detail = (f"Slurm state {state}" + (f", exit {exit_code}" if exit_code else "")
                  + (f", reason {reason}" if reason and reason != "None" else ""))
        if state.startswith("CANCELLED"):
            return JobStatus(state="CANCELLED", reason=detail)
        return JobStatus(state="FAILED", reason=detail)

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


def excluded_nodes(run_dir: str | Path) -> tuple[str, ...]:
    """Nodes a straggler action excluded for this run dir (``resubmit_excluding``), oldest first."""
    path = Path(run_dir) / LAUNCH_SUBDIR / SLURM_EXCLUDED_NODES
    try:
        nodes = json.loads(path.read_text())
    except FileNotFoundError:
        return ()
    except (OSError, ValueError) as exc:
        raise LaunchError(f"{path} is unreadable ({exc}); fix or delete it to resubmit") from exc
    if not isinstance(nodes, list) or not all(isinstance(n, str) and _NAME_OK.match(n) for n in nodes):
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
    if not _NAME_OK.match(node):
        raise ConfigError(f"slurm node name must be a plain Slurm name, got {node!r}")
    try:
        spec = LaunchSpec.from_json(json.loads((Path(handle.run_dir) / LAUNCH_SUBDIR / LAUNCH_SPEC).read_text()))
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
