"""A real Slurm cluster on localhost, for tests: munged + slurmctld + ``slurmd -N node1|node2|...``.

    cluster = start_cluster(Path("/tmp/slurm"))     # writes slurm.conf, starts the daemons, waits for idle nodes
    cluster = start_cluster(root, nodes=3)          # a spare node (straggler exclusion: 2-node job, 3 nodes)
    env = cluster.env                               # SLURM_CONF=... for sbatch/squeue/scancel
    lose_node(cluster, "node1")                     # a node dies whole: its jobs end NODE_FAIL, it stays DOWN
    stop_cluster(cluster)

Everything except munge lives under the given directory (config, state, spool, logs, pid files), so
two clusters never share state and ``rm -rf`` resets one. All "nodes" are this host: each slurmd has
its own ``Port=`` and ``NodeHostname=localhost`` (checked with Slurm 22.05 here). munged is machine-wide: it is
started as the ``munge`` user (with ``/run/munge``) only when no munged answers, and left running.

Needs Debian's ``slurm-wlm`` and ``munge`` (``scripts/system/slurm.sh``) and root (slurmd runs jobs
as their submitting user). ``slurm_unavailable()`` says why a cluster cannot start here, or None.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError

NODES = ("node1", "node2")
"""The default cluster's nodes; ``start_cluster(nodes=N)`` names them node1..nodeN."""
PARTITION = "kiln"
_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged", "munge")


@dataclass(kw_only=True, slots=True)
class SlurmCluster:
    root: Path
    conf: Path
    ctld_port: int
    node_ports: dict[str, int]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """Environment for the Slurm client tools (and the launcher) to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}


def slurm_unavailable() -> str | None:
    """Why a local Slurm cluster cannot run on this machine, or None if it can."""
    missing = [b for b in _BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"Slurm/munge binaries missing: {', '.join(missing)} (run `make system-deps`)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user; this process is not root"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (munge package not configured)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _munge_works() -> bool:
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_munged() -> None:
    if _munge_works():
        return
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    for sub in ("/var/lib/munge", "/var/log/munge"):
        if Path(sub).exists():
            shutil.chown(sub, "munge", "munge")
    proc = subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], capture_output=True, text=True)
    deadline = time.monotonic() + 15
    while not _munge_works():
        if time.monotonic() > deadline:
            raise ConfigError(f"munged did not start: {proc.stderr.strip() or proc.stdout.strip()}")
        time.sleep(0.2)


def render_conf(root: Path, ctld_port: int, node_ports: dict[str, int], cpus: int) -> str:
    lines = [
        f"# written by kiln_devtools.slurm_cluster: a {len(node_ports)}-node test cluster on localhost",
        "ClusterName=kiln",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/linear",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=600",
        "Waittime=0",
        "PriorityType=priority/basic",
        "PreemptType=preempt/none",
    ]
    for name, port in node_ports.items():
        lines.append(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(node_ports)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def start_cluster(root: Path, *, nodes: int = len(NODES), ready_timeout_s: float = 60.0) -> SlurmCluster:
    """Start munged (if needed), slurmctld and ``nodes`` slurmd under ``root``; wait until every node is idle."""
    reason = slurm_unavailable()
    if reason:
        raise ConfigError(f"cannot start a Slurm cluster here: {reason}")
    if not 1 <= nodes <= 8:
        raise ConfigError(f"a local test cluster has 1 to 8 nodes, not {nodes}")
    names = [f"node{i}" for i in range(1, nodes + 1)]
    root = Path(root).resolve()
    for sub in ("state", "run", "log", *(f"spool/{n}" for n in names)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    ctld_port, *ports = _free_ports(1 + nodes)
    conf = root / "slurm.conf"
    conf.write_text(render_conf(root, ctld_port, dict(zip(names, ports, strict=True)), os.cpu_count() or 1))
    cluster = SlurmCluster(root=root, conf=conf, ctld_port=ctld_port, node_ports=dict(zip(names, ports, strict=True)))
    ensure_munged()
    env = cluster.env
    try:
        # -D: stay in the foreground so this object owns the processes; -i: ignore state from a
        # previous cluster in the same dir; -c: clear saved jobs.
        cluster.procs["slurmctld"] = _spawn(["slurmctld", "-D", "-i", "-c"], root / "log" / "slurmctld.out", env)
        for name in names:
            cluster.procs[name] = _spawn(["slurmd", "-D", "-N", name], root / "log" / f"slurmd-{name}.out", env)
        _wait_idle(cluster, ready_timeout_s)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def _spawn(argv: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(out, "ab") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def _wait_idle(cluster: SlurmCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                log = cluster.root / "log" / (f"{name}.log" if name == "slurmctld" else f"slurmd-{name}.log")
                tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                raise ConfigError(f"{name} exited {proc.returncode} while starting:\n{tail}")
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=cluster.env)
        last = (out.stdout + out.stderr).strip()
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        if out.returncode == 0 and all(states.get(n, "").startswith("idle") for n in cluster.node_ports):
            return
        time.sleep(0.5)
    raise ConfigError(f"Slurm nodes not idle after {timeout_s:.0f} s: {last}")


def lose_node(cluster: SlurmCluster, name: str) -> list[int]:
    """Node ``name`` dies as a whole, as a machine that loses power: its slurmd and every process a
    job runs there (tasks, and the slurmstepd above them) are stopped, then SIGKILLed, then slurmctld
    is told the node is DOWN (what it concludes itself once ``SlurmdTimeout`` passes without an
    answer). Its jobs end ``NODE_FAIL``; with its slurmd gone it stays down, where
    ``ReturnToService=2`` would bring an answering node straight back. Returns the pids killed.

    A node's processes are found by their environment (``SLURMD_NODENAME``, and this cluster's
    ``SLURM_CONF``, which jobs submitted with ``cluster.env`` carry): every "node" is this host."""
    if name not in cluster.node_ports:
        raise ConfigError(f"no node {name!r} in this cluster ({', '.join(cluster.node_ports)})")
    tags = (f"SLURMD_NODENAME={name}\0".encode(), f"SLURM_CONF={cluster.conf}\0".encode())
    victims: set[int] = set()
    reporters: set[int] = set()  # the daemons that could tell slurmctld how a job ended
    slurmd = cluster.procs.get(name)
    if slurmd is not None and slurmd.poll() is None:
        reporters.add(slurmd.pid)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes() + b"\0"
            if not all(tag in environ for tag in tags):
                continue
            victims.add(int(entry.name))
            parent = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            if Path(f"/proc/{parent}/cmdline").read_bytes().startswith(b"slurmstepd"):
                reporters.add(parent)
        except (OSError, ValueError, IndexError):
            continue
    victims -= reporters
    # Frozen first, the daemons before the job's processes, then killed: a slurmstepd that saw its batch
    # script die before its own SIGKILL arrived could still report "exit 137" (the job would end FAILED,
    # not NODE_FAIL, as it once did in a clean make test run when the kills went out one by one).
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in [*sorted(reporters), *sorted(victims)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    if slurmd is not None:
        slurmd.wait()
    out = subprocess.run(["scontrol", "update", f"NodeName={name}", "State=DOWN", "Reason=kiln-test-node-lost"],
                         capture_output=True, text=True, env=cluster.env)
    if out.returncode != 0:
        raise ConfigError(f"scontrol could not set {name} DOWN: {out.stderr.strip() or out.stdout.strip()}")
    return sorted(victims | reporters)


def stop_cluster(cluster: SlurmCluster) -> None:
    """Stop the slurmd's and slurmctld (munged stays: it is machine-wide). Jobs still running die."""
    subprocess.run(["scancel", "--full", "--quiet", f"--partition={PARTITION}"], capture_output=True,
                   env=cluster.env, timeout=30)
    for name in [*cluster.node_ports, "slurmctld"]:
        proc = cluster.procs.get(name)
        if proc is None or proc.poll() is not None:
            continue
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
