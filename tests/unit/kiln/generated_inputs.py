"""What the generated-input suites share (test_ingest_generated.py, test_records_generated.py): a
sandbox with a secret outside it, inputs written from a plain description (bytes names, links,
FIFOs), one run of ``kiln.cli.main`` and the checks every generated input must pass.

For every input, whatever it holds:

* nothing escapes ``kiln.cli.main`` but its exit status (no traceback), the status is one the
  command documents for it, and a failure prints exactly one ``kiln <command>: error:`` line;
* nothing is written outside the command's outputs, nothing that was there changes, and a command
  that failed (exit 1 or 2) leaves no output behind;
* nothing read outside the input shows up in what the command wrote or printed (the secret file
  beside the sandbox, an environment variable);
* it ends within ``SECONDS_PER_INPUT`` of wall time and grows the process' peak memory by at most
  ``MEMORY_PER_INPUT``: bounds, not benchmarks (a hang or a bomb is orders of magnitude past them).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, settings

from kiln.cli import main

EXAMPLES = int(os.environ.get("KILN_GENERATED_EXAMPLES", "25"))
RANDOM = os.environ.get("KILN_GENERATED_RANDOM") == "1"  # exploratory runs: new examples each time
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])

SECONDS_PER_INPUT = 20.0
MEMORY_PER_INPUT = 1 << 30
"""Growth of the process' peak resident memory one input may cause (bytes)."""
HARD_STOP_SECONDS = 120
"""A run still going after this is interrupted (SIGALRM), so that a hang fails its example instead of CI."""

SECRET = "kiln-generated-secret-6a1f0c"
"""In a file beside the sandbox and in the environment: an input that links to either must not carry it in."""


@dataclass(frozen=True)
class Entry:
    """One thing to create under the sandbox: ``kind`` file | dir | link | fifo; ``path`` relative, bytes
    (a name need not be UTF-8); ``data`` a file's bytes or a link's target."""

    kind: str
    path: bytes
    data: bytes = b""


@dataclass(frozen=True)
class Case:
    """A generated input and the command line that reads it."""

    entries: tuple[Entry, ...]
    argv: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    """Paths (relative to the sandbox) the command may write; everything else must stay as it was."""
    statuses: frozenset[int] = frozenset({0, 2})
    note: str = ""
    must_say: str = ""
    """For a case kept for a bug it found: what its error line must hold."""
    must_print: tuple[str, ...] = ()
    """What its stdout must hold (a listing that must still show the good records)."""
    after: frozenset[int] = frozenset({0, 1, 2, 3})
    """In a sequence of cases on one input: run only when the case before ended in one of these."""


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float
    memory: int
    new: list[str] = field(default_factory=list)


def materialize(root: Path, entries: tuple[Entry, ...]) -> None:
    base = os.fsencode(root)
    for entry in entries:
        path = os.path.join(base, entry.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.lexists(path):
            continue  # a name drawn twice: the first one stays
        if entry.kind == "file":
            with open(path, "wb") as f:
                f.write(entry.data)
        elif entry.kind == "dir":
            os.makedirs(path, exist_ok=True)
        elif entry.kind == "link":
            os.symlink(entry.data, path)
        elif entry.kind == "fifo":
            os.mkfifo(path)
        else:
            raise AssertionError(entry.kind)


def tree(root: Path) -> dict[str, str]:
    """Every regular file under ``root`` (links not followed) with its sha256; names as bytes' repr."""
    found: dict[str, str] = {}
    base = os.fsencode(root)
    for dirpath, _dirnames, filenames in os.walk(base):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                with open(path, "rb") as f:
                    found[os.fsdecode(os.path.relpath(path, base))] = hashlib.sha256(f.read()).hexdigest()
    return found


def wipe(root: Path) -> None:
    import shutil

    for entry in os.scandir(os.fsencode(root)):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


class _Stopped(BaseException):
    """Raised by the SIGALRM safety net; a BaseException so that no ``except Exception`` swallows it."""


def _alarm(signum: int, frame: object) -> None:
    raise _Stopped(f"still running after {HARD_STOP_SECONDS} s")


def _peak_rss() -> int:
    """This process' peak resident memory in bytes (VmHWM)."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) * 1024


def _reset_peak_rss() -> int:
    """Reset the peak to the memory resident now (Linux: "5" to /proc/self/clear_refs), so that one
    input's growth is measured, not hidden under an earlier test's peak; the resident memory now."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return _peak_rss()


def run_cli(argv: list[str]) -> tuple[int, str, str, float, int]:
    out, err = io.StringIO(), io.StringIO()
    peak = _reset_peak_rss()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HARD_STOP_SECONDS)
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse: a usage error (2)
                code = exc.code if isinstance(exc.code, int) else 1
            except (Exception, BaseException) as exc:  # a traceback that escaped (a Rust panic is a BaseException)
                if isinstance(exc, (_Stopped, KeyboardInterrupt)):
                    raise
                import traceback

                traceback.print_exc()
                code = -1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    seconds = time.monotonic() - started
    grown = _peak_rss() - peak
    return code, out.getvalue(), err.getvalue(), seconds, grown


def _inside(path: str, outputs: tuple[str, ...]) -> bool:
    return any(path == o or path.startswith(o.rstrip("/") + "/") for o in outputs)


def _written_text(root: Path, paths: list[str]) -> str:
    """What the command wrote, as text: Parquet files by their string columns (their pages are compressed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = []
    for rel in paths:
        path = root / rel
        if rel.endswith(".parquet"):
            try:
                table = pq.read_table(path)
            except (OSError, pa.ArrowException):
                texts.append(path.read_bytes().decode("utf-8", "replace"))
                continue
            for column in table.columns:
                if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                    texts.extend(str(v) for v in column.to_pylist())
        else:
            texts.append(path.read_bytes().decode("utf-8", "replace"))
    return "\n".join(texts)


def check(root: Path, outside: Path, case: Case, outcomes: Counter) -> Outcome:
    """Run ``case`` in ``root`` (its inputs already written) and assert what every input must give."""
    before, before_outside = tree(root), tree(outside)
    code, out, err, seconds, grown = run_cli(list(case.argv))
    outcomes[code] += 1
    if os.environ.get("KILN_GENERATED_SHOW") == "1":  # what each input gave, for reading an exploratory run
        print(f"{code} {seconds:5.2f}s {case.note}: {(err.strip().splitlines() or [''])[-1][:300]}")
    shown = (f"kiln {' '.join(map(repr, case.argv))} -> {code} in {seconds:.1f} s, +{grown >> 20} MiB peak"
             f" ({case.note})\n{err[-3000:]}")
    assert "Traceback" not in out + err and code != -1, shown
    assert code in case.statuses, shown
    if code in (1, 2):  # 3 is a gate's verdict, printed as such
        errors = [line for line in err.splitlines() if ": error:" in line]
        assert len(errors) == 1 and errors[0].startswith(("kiln: error: ", "kiln ")), shown
    assert case.must_say in err, f"{shown}\nexpected: {case.must_say}"
    assert seconds < SECONDS_PER_INPUT, shown
    assert grown < MEMORY_PER_INPUT, shown
    after = tree(root)
    changed = sorted(p for p in before if after.get(p) != before[p] and not _inside(p, case.outputs))
    new = sorted(set(after) - set(before))
    stray = [p for p in new if not _inside(p, case.outputs)]
    assert not changed and not stray, f"{shown}\nchanged or lost: {changed}\nwritten outside the outputs: {stray}"
    assert tree(outside) == before_outside, f"{shown}\nchanged a file outside the sandbox"
    if code in (1, 2):
        assert not new, f"{shown}\na failed command left behind: {new}"
    assert SECRET not in out + err + _written_text(root, new), f"{shown}\nread from outside its input: {SECRET}"
    return Outcome(code, out, err, seconds, grown, new)
