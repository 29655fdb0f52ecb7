"""Services behind a pid file: a dead leader's leftovers are ended by ``end_recorded``, and only
processes of the stack (its KILN_HOME as working directory or in the environment: a pgid is a pid,
and pids are reused)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kiln.util.procs import end_recorded, group_members, record_start, recorded_pid

# A leader that starts a child in its own group; the child ignores SIGTERM (as an orphaned
# LocalExecutor worker does) and reports its pid.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def _leader(home: str, *, cwd: str | None = None, env: bool = True) -> tuple[subprocess.Popen, int]:
    environ = {k: v for k, v in os.environ.items() if k != "KILN_HOME"}
    proc = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env={**environ, "KILN_HOME": home} if env else environ)
    return proc, int(proc.stdout.readline())


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10  # safety net, not a timing assertion
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_dead_leaders_orphans_are_recorded_at_restart_and_ended_by_down(tmp_path):
    marker = tmp_path
    pidfile = tmp_path / "scheduler.pid"
    # The old group is known by its working directory only, as Airflow's executor workers are
    # (setproctitle writes over their /proc/<pid>/environ); the new one by its environment.
    old, orphan = _leader(str(tmp_path), cwd=str(tmp_path), env=False)
    record_start(pidfile, old.pid, marker)
    os.kill(old.pid, signal.SIGKILL)  # the scheduler alone is killed; its worker lives on
    old.wait()
    assert group_members(old.pid, marker) == [orphan]
    new, new_child = _leader(str(tmp_path))
    try:
        record_start(pidfile, new.pid, marker)  # what `stack up` does when it restarts the service
        assert pidfile.with_suffix(".stale").read_text().split() == [str(old.pid)]
        assert not _gone(orphan), "a restart must not kill the old group: its task may still finish"
        assert end_recorded(pidfile, 1.0, marker)
        assert _gone(orphan) and _gone(new_child)
        new.wait(timeout=10)
        assert not pidfile.exists() and not pidfile.with_suffix(".stale").exists()
    finally:
        for pid in (orphan, new_child, new.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_reused_group_id_without_the_marker_is_left_alone(tmp_path):
    other, other_child = _leader(str(tmp_path / "someone-else"))
    try:
        pidfile = tmp_path / "scheduler.pid"
        pidfile.with_suffix(".stale").write_text(f"{other.pid}\n")
        os.kill(other.pid, signal.SIGKILL)
        other.wait()
        assert not end_recorded(pidfile, 5.0, tmp_path)
        assert Path(f"/proc/{other_child}").exists()
    finally:
        os.kill(other_child, signal.SIGKILL)


def test_a_live_leader_that_is_not_the_stacks_is_left_alone(tmp_path):
    # The recorded service died long ago and its pid now leads someone else's process group.
    other, other_child = _leader(str(tmp_path / "someone-else"), cwd=str(tmp_path.parent))
    try:
        pidfile = tmp_path / "scheduler.pid"
        pidfile.write_text(f"{other.pid}\n")
        assert not end_recorded(pidfile, 5.0, tmp_path)
        assert other.poll() is None and Path(f"/proc/{other_child}").exists()
        assert not pidfile.exists()
    finally:
        for pid in (other_child, other.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        other.wait()


def test_recorded_pid_is_the_live_service_or_none(tmp_path):
    pidfile = tmp_path / "svc.pid"
    assert recorded_pid(pidfile) is None  # never started
    pidfile.write_text("not a pid\n")
    assert recorded_pid(pidfile) is None  # a torn write reads as "not running", not a crash
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        record_start(pidfile, proc.pid, tmp_path)
        assert recorded_pid(pidfile) == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert recorded_pid(pidfile) is None
