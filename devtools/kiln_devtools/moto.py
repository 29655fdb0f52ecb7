"""A local ``moto_server``: the S3 stand-in of the tests, the chaos suite and the benchmarks (real
HTTP on 127.0.0.1, the same boto3 calls as against S3)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from kiln.util.net import free_port


class MotoServer:
    """Started on a free port, answering (``/moto-api/``) when the constructor returns; ``stop()``
    ends it. Its output goes to ``log_path``, whose tail a start that fails reports."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        with open(log_path, "wb") as log_file:  # the server writes to its own copy of the descriptor
            self.proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1",
                                          "-p", str(self.port)], stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        import requests

        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(f"{self.url}/moto-api/", timeout=1)
                return
            except requests.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start: {log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
