"""Ending the process groups kiln starts (servers, daemons, torchrun agents) — one mechanism."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _reap(pid: int, proc: subprocess.Popen | None) -> None:
    """Our own child stays a zombie (and its group "alive") until reaped."""
    if proc is not None:
        proc.poll()
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def end_process_group(pgid: int, timeout_s: float, *, reap: subprocess.Popen | None = None) -> None:
    """SIGTERM the process group ``pgid`` (one we started with ``start_new_session``), wait until
    every member is gone, SIGKILL whatever is left after ``timeout_s``.

    The whole group, not only its leader: a scheduler's task processes or a server's workers may
    outlive the leader.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pgid, reap)
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    _reap(pgid, reap)


# ------------------------------------------------------------------- services behind a pid file
def group_members(pgid: int, marker: Path) -> list[int]:
    """Live processes of group ``pgid`` that belong to the stack at ``marker`` (its KILN_HOME): a
    group id is a pid, and pids are reused, so membership alone never marks a process as ours.

    A process belongs when its working directory is at or under ``marker`` (every stack service is
    started there and its children inherit it) or its environment says ``KILN_HOME=<marker>``. The
    working directory is the check that holds for Airflow's executor workers: ``setproctitle``
    ("airflow worker -- LocalExecutor") writes over the memory ``/proc/<pid>/environ`` reads."""
    env_marker = f"KILN_HOME={marker}\0".encode()
    marker = Path(marker).resolve()
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[2]) != pgid:
                continue
            cwd = Path(os.readlink(entry / "cwd"))
            if cwd != marker and marker not in cwd.parents and env_marker not in (entry / "environ").read_bytes():
                continue
        except (OSError, ValueError, IndexError):
            continue
        members.append(int(entry.name))
    return members


def record_start(pidfile: Path, pid: int, marker: Path) -> None:
    """Write a service's new pid. If the previous leader died but left members of its group behind
    (a killed scheduler's LocalExecutor workers: reparented to init, they ignore SIGTERM and may
    still be finishing a task), their group goes to ``<name>.stale`` for ``end_recorded`` to end —
    not now: a task one of them runs may still complete."""
    try:
        old = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        old = 0
    if old and old != pid and group_members(old, marker):
        with open(pidfile.with_suffix(".stale"), "a") as fh:
            fh.write(f"{old}\n")
    pidfile.write_text(f"{pid}\n")


def recorded_pid(pidfile: Path) -> int | None:
    """The service behind ``pidfile`` (``record_start``) if it still runs."""
    try:
        pid = int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pid if pid_alive(pid) else None


def end_recorded(pidfile: Path, timeout_s: float, marker: Path) -> bool:
    """End the service behind ``pidfile``: its process group, and what is left of the groups of
    leaders that died before (``record_start``). True when something was running."""
    stale = pidfile.with_suffix(".stale")
    groups: list[int] = []
    for path in (pidfile, stale):
        try:
            groups += [int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError, IndexError):
            continue
    ended = False
    for pgid in dict.fromkeys(groups):
        members = group_members(pgid, marker)
        if pid_alive(pgid):
            if pgid in members:  # the leader we started, and its group, the gentle way first
                end_process_group(pgid, timeout_s)
                ended = True
            # else the pid was reused by a process of someone else's: leave its group alone
            continue
        for pid in members:  # leaderless: nothing graceful is left to wait for
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                ended = True
    pidfile.unlink(missing_ok=True)
    stale.unlink(missing_ok=True)
    return ended
