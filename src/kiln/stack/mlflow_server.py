"""Start and stop the embedded stack's MLflow tracking server (SQLite + local artifacts).

Used by the stack scripts (``make up`` / ``make down``) and by the integration-test fixture::

    handle = start_server(Path(".kiln/mlflow"), 5000)   # blocks until /health answers
    ...
    stop_server(handle)        # or kill_server(handle): SIGKILL, as a crash would
    handle = restart_server(handle)   # same port, same backend store and artifacts

or from a shell, detached, with a pid file under HOME so that ``stop`` ends exactly that server::

    python -m kiln.stack.mlflow_server start --home .kiln/mlflow --port 5000
    python -m kiln.stack.mlflow_server stop --home .kiln/mlflow

The server binds 127.0.0.1 only, runs one worker (this is a 2-core machine; the default of 8
workers plus the job runner costs ~2.5 GB) and has job execution switched off. Its output goes to
``HOME/mlflow.log``; a server that does not become healthy fails with the tail of that log.
Importing this module is cheap: it never imports mlflow (the server is a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kiln.errors import ConfigError, KilnError, RegistryError
from kiln.util.net import free_port  # noqa: F401 - re-exported for the stack and tests
from kiln.util.procs import end_process_group

HOST = "127.0.0.1"
LOG_NAME = "mlflow.log"
PID_NAME = "mlflow.pid"


@dataclass(kw_only=True, slots=True)
class MlflowServer:
    """A running ``mlflow server`` this process started (Popen-like: ``pid``, ``poll``, ``wait``)."""

    process: subprocess.Popen[bytes]
    url: str
    """Tracking URI clients use, e.g. ``http://127.0.0.1:5000``."""
    home: Path
    log_path: Path
    port: int
    backend_uri: str = ""
    """Where runs and the registry live; a restart with the same one finds everything again."""
    artifacts: str = ""
    workers: int = 1
    extra_args: tuple[str, ...] = ()
    """Further ``mlflow server`` arguments (e.g. ``mlflow_auth.SERVER_ARGS``), kept for a restart."""
    extra_env: dict[str, str] = field(default_factory=dict, repr=False)
    """Further server environment (e.g. ``mlflow_auth.server_env``: holds secrets, hence no repr)."""
    _log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)


def port_in_use(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0




def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _mlflow_executable() -> list[str]:
    # The console script next to this interpreter, so the server runs the venv's pinned mlflow
    # even when the caller's PATH points elsewhere.
    script = Path(sys.executable).parent / "mlflow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mlflow"]


def server_command(home: Path, port: int, backend_uri: str, artifacts: str, workers: int) -> list[str]:
    return [
        *_mlflow_executable(),
        "server",
        "--host", HOST,
        "--port", str(port),
        "--backend-store-uri", backend_uri,
        "--artifacts-destination", artifacts,
        "--serve-artifacts",
        "--workers", str(workers),
    ]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:  # loopback only
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_server(
    home: Path,
    port: int,
    backend_uri: str | None = None,
    artifacts: str | None = None,
    *,
    workers: int = 1,
    timeout_s: float = 90.0,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> MlflowServer:
    """Start ``mlflow server`` on ``127.0.0.1:port`` and return once ``/health`` answers.

    ``backend_uri`` defaults to ``sqlite:///HOME/mlflow.db``, ``artifacts`` to ``HOME/artifacts``.
    Raises ``ConfigError`` when the port is already taken (a stray server would answer our health
    check and hide the failure) and ``RegistryError`` with the log tail when the server exits or
    stays unhealthy past ``timeout_s``.

    ``extra_args`` go after the standard arguments and ``extra_env`` over the inherited
    environment; for basic-auth: ``extra_args=mlflow_auth.SERVER_ARGS,
    extra_env=mlflow_auth.server_env(home, admin_password)``. Both stay on the handle (the env
    out of its repr) so that ``restart_server`` starts the same server again.
    """
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    if port_in_use(port):
        raise ConfigError(f"MLflow port {port} on {HOST} is already in use; stop that process or pick another port")
    backend_uri = backend_uri or f"sqlite:///{home / 'mlflow.db'}"
    artifacts = artifacts or str(home / "artifacts")
    if "://" not in artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
    log_path = home / LOG_NAME
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "PYTHONUNBUFFERED": "1"}
    # A client-side tracking URI or identity in the caller's environment means nothing to the server.
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        env.pop(key, None)
    extra_env = dict(extra_env or {})
    env.update(extra_env)
    log_file = open(log_path, "ab")  # noqa: SIM115 (owned by the handle, closed in stop_server)
    process = subprocess.Popen(
        [*server_command(home, port, backend_uri, artifacts, workers), *extra_args],
        cwd=home,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        # Own process group: stop_server ends the server and its uvicorn/gunicorn workers together,
        # and a Ctrl-C in the caller's terminal does not reach it.
        start_new_session=True,
    )
    handle = MlflowServer(process=process, url=f"http://{HOST}:{port}", home=home, log_path=log_path,
                          port=port, backend_uri=backend_uri, artifacts=artifacts, workers=workers,
                          extra_args=tuple(extra_args), extra_env=extra_env, _log_file=log_file)
    (home / PID_NAME).write_text(f"{process.pid}\n")
    deadline = time.monotonic() + timeout_s
    while not _healthy(handle.url):
        if process.poll() is not None:
            stop_server(handle)
            raise RegistryError(
                f"mlflow server exited with code {process.returncode} before becoming healthy; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            stop_server(handle)
            raise RegistryError(
                f"mlflow server on {handle.url} not healthy after {timeout_s:.0f}s; "
                f"log {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.25)
    return handle


def _end_group(pid: int, timeout_s: float, reap: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM the process group led by ``pid``; SIGKILL whatever is left after ``timeout_s``."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    if pgid != pid:  # not the group leader we started: end only the process itself
        os.kill(pid, signal.SIGTERM)
        return
    end_process_group(pgid, timeout_s, reap=reap)


def stop_server(handle: MlflowServer, timeout_s: float = 10.0) -> None:
    """Stop the server and its workers (SIGTERM to its process group, SIGKILL after ``timeout_s``)."""
    if handle.process.poll() is None:
        _end_group(handle.process.pid, timeout_s, reap=handle.process)
    try:
        handle.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        handle.process.kill()
        handle.process.wait()
    if handle._log_file is not None:
        handle._log_file.close()
    pid_file = handle.home / PID_NAME
    if pid_file.exists() and pid_file.read_text().strip() == str(handle.process.pid):
        pid_file.unlink()


def kill_server(handle: MlflowServer, timeout_s: float = 10.0) -> None:
    """SIGKILL the server and its workers at once, as a crash would (no graceful shutdown).

    Waits until the port is free, so that ``restart_server`` can bind it again.
    """
    if handle.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.process.pid, signal.SIGKILL)
    stop_server(handle, timeout_s)
    deadline = time.monotonic() + timeout_s
    while port_in_use(handle.port) and time.monotonic() < deadline:
        time.sleep(0.1)


def restart_server(handle: MlflowServer, timeout_s: float = 90.0) -> MlflowServer:
    """Start a stopped (or killed) server again: same home, port, backend store and artifacts."""
    if handle.process.poll() is None:
        raise ConfigError(f"mlflow server pid {handle.pid} on {handle.url} is still running; stop it first")
    return start_server(handle.home, handle.port, handle.backend_uri or None, handle.artifacts or None,
                        workers=handle.workers, timeout_s=timeout_s, extra_args=handle.extra_args,
                        extra_env=handle.extra_env)


def _is_our_mlflow(pid: int) -> bool:
    # Guard against pid reuse: only a process whose command line is an mlflow server qualifies.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(part.endswith(b"mlflow") for part in cmdline) and b"server" in cmdline


def stop_from_pidfile(home: Path, timeout_s: float = 10.0) -> bool:
    """Stop the server a detached ``start`` left in ``HOME/mlflow.pid``; False when none runs."""
    pid_file = Path(home) / PID_NAME
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    running = _is_our_mlflow(pid)
    if running:
        _end_group(pid, timeout_s)
    pid_file.unlink(missing_ok=True)
    return running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.stack.mlflow_server", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a detached server and wait until it is healthy")
    start.add_argument("--home", type=Path, required=True)
    start.add_argument("--port", type=int, required=True)
    start.add_argument("--backend-uri", default=None)
    start.add_argument("--artifacts", default=None)
    start.add_argument("--workers", type=int, default=1)
    start.add_argument("--timeout", type=float, default=90.0)
    stop = sub.add_parser("stop", help="stop the server recorded in HOME/mlflow.pid")
    stop.add_argument("--home", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "start":
        try:
            handle = start_server(args.home, args.port, args.backend_uri, args.artifacts,
                                  workers=args.workers, timeout_s=args.timeout)
        except KilnError as exc:
            print(f"mlflow server: error: {exc}", file=sys.stderr)
            return 1
        print(f"mlflow server pid {handle.pid} on {handle.url} (log {handle.log_path})")
        return 0
    stopped = stop_from_pidfile(args.home)
    print("mlflow server stopped" if stopped else "no mlflow server running")
    return 0


if __name__ == "__main__":
    sys.exit(main())
