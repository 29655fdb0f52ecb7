"""The process torchrun starts on every rank: the trainer, plus a marker when it exits 2.

    python -m kiln.launchers.worker --manifest M.json --recipe R.toml --run-dir RUN [...]

takes exactly the trainer's arguments and runs ``kiln_trainer.train.main`` in this process (no extra
process, so a SIGKILL of this pid is a SIGKILL of the trainer). torchrun cannot tell a diagnosed
fault (exit 2) from a crash and would restart both; the marker ``RUN/.launch/fatal/rank-N.json`` lets
the launcher end the job at once and fail it without retry.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

FATAL_EXIT = 2


class _LastError(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def _run_dir(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    return None


def write_fatal_marker(run_dir: Path, rank: int, error: str) -> Path:
    folder = run_dir / ".launch" / "fatal"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"rank": rank, "exit_code": FATAL_EXIT, "error": error, "time": time.time()}))
    os.replace(tmp, path)  # readers see the whole marker or none
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from kiln_trainer.train import main as trainer_main  # torch: only in the worker process

    errors = _LastError()
    logging.getLogger("kiln_trainer").addHandler(errors)
    try:
        code = trainer_main(argv)
    except SystemExit as exc:  # argparse: a bad argument is a fault a retry repeats (exit 2 too)
        code = exc.code if isinstance(exc.code, int) else 1
    run_dir = _run_dir(argv)
    if code == FATAL_EXIT and run_dir is not None:
        write_fatal_marker(run_dir, int(os.environ.get("RANK", "0") or 0), errors.message)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # Linger so the launcher (polling every 0.2 s) ends the gang before torchrun's monitor
            # (every 1 s) sees this exit and restarts a run that can only fail the same way.
            time.sleep(3)
    return code


if __name__ == "__main__":
    sys.exit(main())
