"""rank 0's metrics files: ``metrics.prom`` (the heartbeat) is written atomically by a thread of its
own, so the training loop never waits for an fsync, and ``drain``/``close`` leave the latest record on
disk; ``metrics.jsonl`` is written on the caller's thread. The whole session (``finish`` drains before
``result.json``) is held by test_sdk."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kiln_trainer import metrics
from kiln_trainer.metrics import JsonlSink, LatestFileWriter, MetricsHub, PrometheusTextfileSink


class GatedWrites:
    """``atomic_write_bytes`` as the writer thread calls it, held until ``open`` is set: the real
    write then happens; records which thread wrote and what."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.open = threading.Event()
        self.started = threading.Event()
        self.threads: list[int] = []
        self.written: list[bytes] = []

    def __call__(self, path: Path, data: bytes, **kwargs: Any) -> Path:
        self.threads.append(threading.get_ident())
        self.started.set()
        assert self.open.wait(30), "the test never let the write through"
        self.written.append(data)
        return self.real(path, data, **kwargs)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> GatedWrites:
    gate = GatedWrites(metrics.atomic_write_bytes)
    monkeypatch.setattr(metrics, "atomic_write_bytes", gate)
    return gate


def _step(text: str) -> int:
    return int(next(line for line in text.splitlines() if line.startswith("kiln_train_step{")).rsplit(" ", 1)[1])


def test_log_returns_while_the_write_waits_and_the_latest_record_wins(tmp_path: Path, gated: GatedWrites) -> None:
    sink = PrometheusTextfileSink(tmp_path / "metrics.prom", {"run_dir": "/r"})
    sink.log(10, {"loss": 3.0})
    assert gated.started.wait(30)
    # The first write is stuck in the disk; the loop goes on logging (with a write on the loop's
    # thread, the first log would still be waiting here).
    for step in range(11, 40):
        sink.log(step, {"loss": 3.0 - step / 100})
    assert not (tmp_path / "metrics.prom").exists()
    assert set(gated.threads) == {sink.writer._thread.ident} and threading.get_ident() not in gated.threads
    gated.open.set()
    sink.drain()
    text = (tmp_path / "metrics.prom").read_text()
    assert _step(text) == 39 and f'kiln_train_loss{{run_dir="/r"}} {3.0 - 39 / 100!r}' in text
    # Records logged during a write replace each other: the step 10 write, then the latest one.
    assert sink.writer.writes == 2 and [_step(d.decode()) for d in gated.written] == [10, 39]
    sink.close()
    assert not sink.writer._thread.is_alive()


def test_close_writes_what_is_waiting_and_stops_the_thread(tmp_path: Path) -> None:
    sink = PrometheusTextfileSink(tmp_path / "metrics.prom", {})
    for step in range(1, 200):
        sink.log(step, {"loss": 1.0, "rank_step_times": [0.1, 0.2]})
    sink.close()
    text = (tmp_path / "metrics.prom").read_text()
    assert _step(text) == 199 and 'kiln_train_rank_step_times{rank="1"} 0.2' in text
    assert not sink.writer._thread.is_alive() and not list(tmp_path.glob(".metrics.prom.*"))
    with pytest.raises(ValueError, match="closed"):
        sink.log(200, {"loss": 1.0})


def test_a_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    """A reader polling the file while the writer rewrites it sees whole files only, each with its
    step line and one line per metric (the file grows as new metrics appear)."""
    path = tmp_path / "metrics.prom"
    sink = PrometheusTextfileSink(path, {"run_dir": str(tmp_path)})
    stop = threading.Event()
    seen: list[str] = []

    def read() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError):
                seen.append(path.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for step in range(1, 400):
            sink.log(step, {f"m{step % 50}": float(step)})
        sink.drain()
        # on a loaded host the writes can all land before the reader is first scheduled: let it read once
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        reader.join()
        sink.close()
    assert seen
    for text in seen:
        lines = text.splitlines()
        assert text.endswith("\n") and lines[0].startswith("kiln_train_step{")
        assert len(lines) == 1 + min(_step(text), 50)  # the step line and every metric seen by then


def test_a_failed_write_is_raised_on_the_callers_thread(tmp_path: Path) -> None:
    """A write that fails (here the run dir is a file: no directory can hold the temporary file)
    fails the loop at its next call, naming the path, as a write on the loop's thread did."""
    (tmp_path / "run").write_text("not a directory")
    sink = PrometheusTextfileSink(tmp_path / "run" / "metrics.prom", {})
    sink.log(1, {"loss": 1.0})  # handed over: the failure is not known yet
    with pytest.raises(OSError, match="run"):
        sink.drain()
    sink.drain()  # raised once
    sink.log(2, {"loss": 1.0})
    with pytest.raises(OSError):
        sink.close()
    assert not sink.writer._thread.is_alive()


def test_the_hub_drains_the_textfile_and_writes_jsonl_on_the_callers_thread(tmp_path: Path, gated: GatedWrites) -> None:
    jsonl, prom = tmp_path / "metrics.jsonl", tmp_path / "metrics.prom"
    hub = MetricsHub([JsonlSink(jsonl), PrometheusTextfileSink(prom, {})])
    hub.log(5, {"loss": 2.0})
    hub.log(5, {"event": "straggler", "rank": 1})
    # metrics.jsonl: every record is in the file when log returns (the straggler watch follows it)
    assert [json.loads(line)["step"] for line in jsonl.read_text().splitlines()] == [5, 5]
    assert not prom.exists()
    done = threading.Event()

    def drain() -> None:
        hub.drain()
        done.set()

    drainer = threading.Thread(target=drain)
    drainer.start()
    assert not done.wait(0.2)  # drain waits for the write held at the gate
    gated.open.set()
    drainer.join()
    assert done.is_set() and _step(prom.read_text()) == 5
    hub.close()


def test_an_unclosed_writer_is_drained_at_interpreter_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "metrics.prom"
    code = (
        "import time\nfrom pathlib import Path\nfrom kiln_trainer import metrics\n"
        "real = metrics.atomic_write_bytes\n"
        "def slow(path, data, **kw):\n    time.sleep(0.5)\n    return real(path, data, **kw)\n"
        "metrics.atomic_write_bytes = slow\n"
        f"w = metrics.LatestFileWriter(Path({str(path)!r}))\nw.submit(b'last\\n')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert path.read_text() == "last\n"


def test_writer_submit_after_close_is_refused(tmp_path: Path) -> None:
    writer = LatestFileWriter(tmp_path / "f")
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.submit(b"x")
