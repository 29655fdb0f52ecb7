"""Ending the process groups kiln starts (servers, daemons, torchrun agents) — one mechanism."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time


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
