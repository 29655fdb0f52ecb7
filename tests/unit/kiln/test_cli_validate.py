"""``kiln validate`` on bad inputs and bad outputs: a FIFO, a link or stray files among the shards;
report and manifest targets that cannot be written, or are one file. Each gets one clear
``kiln validate: error:`` line and its exit code, and nothing written that claims something false."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.data import validation
from kiln.refs import TrainingManifest, sha256_file


@pytest.fixture
def corpus(clean_corpus: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the clean corpus (8 shards + eval) that a test may spoil."""
    return Path(shutil.copytree(clean_corpus["out"], tmp_path / "corpus"))


def _argv(corpus: Path, report: Path | str, manifest: Path | str | None = None) -> list[str]:
    argv = ["validate", str(corpus), "--contract", "stdlib-py@1", "--report", str(report)]
    return argv + (["--manifest-out", str(manifest)] if manifest is not None else [])


def _returns_within(call: Callable[[], int], fifo: Path, seconds: float = 60) -> int:
    """``call()``, failing the test if it blocks on ``fifo`` (a writer that closes at once then
    releases the blocked reader, so the thread ends with the test)."""
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(code=call()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(seconds)
        pytest.fail(f"kiln validate still blocked on {fifo} after {seconds} s")
    assert "code" in box, "kiln validate raised (see the thread's traceback above)"
    return box["code"]


def _no_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any validation fail the test: the refusal must come before any shard is read."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("validation ran although an output could not be written")

    monkeypatch.setattr(validation, "validate_directory", refuse)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kiln validate: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".probe")))


# -- bad inputs among the shards ---------------------------------------------------------------------


def test_a_fifo_among_the_shards_is_quarantined_by_name_not_waited_on(kiln_cli, corpus: Path, tmp_path: Path, capsys) -> None:
    fifo = corpus / "train" / "shard-00008.parquet"
    os.mkfifo(fifo)
    code = _returns_within(lambda: kiln_cli(_argv(corpus, tmp_path / "r.json", tmp_path / "m.json")), fifo)
    captured = capsys.readouterr()
    assert code == 0  # 1 of 9 quarantined: within the sandbox threshold
    summary = json.loads(captured.out)
    assert summary["quarantined"] == [str(fifo)]
    assert f"quarantined {fifo.name}: readable_parquet" in captured.err and "is a FIFO, not a regular file" in captured.err
    (entry,) = [r for r in json.loads((tmp_path / "r.json").read_text())["reports"] if r["verdict"] != "healthy"]
    assert entry["path"] == str(fifo) and "FIFO" in entry["reasons"][0]["error"]
    assert str(fifo) not in [s["path"] for s in TrainingManifest.read(tmp_path / "m.json").shards]
    assert fifo.is_fifo()


def test_a_shard_linked_to_a_file_outside_the_corpus_stays_out_of_the_manifest(kiln_cli, corpus: Path, tmp_path: Path,
                                                                               capsys) -> None:
    link = corpus / "train" / "shard-00005.parquet"
    outside = Path(shutil.move(link, tmp_path / "outside.parquet"))
    link.symlink_to(outside)
    assert kiln_cli(_argv(corpus, tmp_path / "r.json", tmp_path / "m.json")) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["quarantined"] == [str(link)]
    assert "symlink" in captured.err
    manifest = TrainingManifest.read(tmp_path / "m.json")
    assert len(manifest.shards) == 7 and manifest.quarantined == [str(link)]
    assert {s["sha256"] for s in manifest.shards}.isdisjoint({sha256_file(outside)})


def test_stray_entries_of_train_are_named_in_the_report_summary_and_stderr(kiln_cli, corpus: Path, tmp_path: Path,
                                                                          capsys) -> None:
    (corpus / "train" / "notes.md").write_text("which shards were re-crawled")
    (corpus / "train" / "late").mkdir()
    (corpus / "train" / "late" / "shard-00008.parquet").write_bytes((corpus / "train" / "shard-00000.parquet").read_bytes())
    assert kiln_cli(_argv(corpus, tmp_path / "r.json")) == 0
    captured = capsys.readouterr()
    stray = [str(corpus / "train" / "late"), str(corpus / "train" / "notes.md")]
    assert json.loads(captured.out)["skipped"] == stray
    skipped = [line.split(":")[0] for line in captured.err.splitlines() if line.startswith("skipped ")]
    assert skipped == [f"skipped {p}" for p in stray]
    report = json.loads((tmp_path / "r.json").read_text())
    assert [e["path"] for e in report["skipped"]] == stray and report["shards"] == 8


def test_a_train_folder_without_shards_names_what_it_holds(kiln_cli, tmp_path: Path, capsys) -> None:
    (tmp_path / "c" / "train").mkdir(parents=True)
    (tmp_path / "c" / "train" / "data.csv").write_text("a,b\n")
    assert kiln_cli(_argv(tmp_path / "c", tmp_path / "r.json")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "no training shards" in line and "train/ holds only data.csv" in line and not (tmp_path / "r.json").exists()


# -- the report and the manifest are one file --------------------------------------------------------


def _same_file_spellings(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    (tmp_path / "out").mkdir()
    yield "identical", tmp_path / "out" / "x.json", tmp_path / "out" / "x.json"
    yield "dot-dot", tmp_path / "out" / "x.json", tmp_path / "out" / ".." / "out" / "x.json"
    (tmp_path / "out" / "link.json").symlink_to(tmp_path / "out" / "x.json")
    yield "symlink to the file", tmp_path / "out" / "link.json", tmp_path / "out" / "x.json"
    (tmp_path / "via").symlink_to(tmp_path / "out")
    yield "symlinked folder", tmp_path / "via" / "x.json", tmp_path / "out" / "x.json"


@pytest.mark.parametrize("spelling", ["identical", "dot-dot", "symlink to the file", "symlinked folder", "hard link"])
def test_report_and_manifest_in_one_file_is_refused_before_any_work(
    spelling: str, kiln_cli, clean_corpus, tmp_path: Path, capsys, monkeypatch
) -> None:
    if spelling == "hard link":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x.json").write_text("kept\n")
        os.link(tmp_path / "out" / "x.json", tmp_path / "out" / "y.json")
        report, manifest = tmp_path / "out" / "x.json", tmp_path / "out" / "y.json"
    else:
        report, manifest = next((r, m) for name, r, m in _same_file_spellings(tmp_path) if name == spelling)
    _no_validation(monkeypatch)
    assert kiln_cli(_argv(Path(clean_corpus["out"]), report, manifest)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "same file" in line and str(report) in line and str(manifest) in line
    if spelling == "hard link":
        assert (tmp_path / "out" / "x.json").read_text() == "kept\n"
    else:
        assert not (tmp_path / "out" / "x.json").exists()


def test_report_and_manifest_in_one_file_once_overwrote_the_report(kiln_cli, clean_corpus, tmp_path: Path, capsys) -> None:
    """Without the monkeypatched validation: the real command refuses too, and writes nothing."""
    same = tmp_path / "x.json"
    assert kiln_cli(_argv(Path(clean_corpus["out"]), same, same)) == 2
    assert "same file" in _one_error_line(capsys.readouterr().err) and not same.exists()


# -- outputs that cannot be written: refused before the work, by name ----------------------------------


def _bad_target(case: str, tmp_path: Path) -> Path:
    if case == "missing folder":
        return tmp_path / "nowhere" / "r.json"
    if case == "file as folder":
        (tmp_path / "plain").write_text("a file")
        return tmp_path / "plain" / "r.json"
    if case == "directory as report":
        (tmp_path / "adir").mkdir()
        return tmp_path / "adir"
    if case == "FIFO as report":
        os.mkfifo(tmp_path / "pipe")
        return tmp_path / "pipe"
    if case == "device as report":  # like /dev/full, but a node of the test's own
        try:
            os.mknod(tmp_path / "full", 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        except PermissionError:
            pytest.skip("mknod is not permitted here")
        return tmp_path / "full"
    if case == "NUL byte":
        return tmp_path / "r\0.json"
    raise AssertionError(case)


BAD_TARGETS = {
    "missing folder": "No such file or directory",
    "file as folder": "Not a directory",
    "directory as report": "Is a directory",
    "FIFO as report": "is a FIFO, not a regular file",
    "device as report": "is a character device, not a regular file",
    "NUL byte": "a path cannot contain a NUL byte",
}


@pytest.mark.parametrize("flag", ["--report", "--manifest-out"])
@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_an_unwritable_output_is_a_usage_error_before_any_work(
    case: str, flag: str, kiln_cli, clean_corpus, tmp_path: Path, capsys, monkeypatch
) -> None:
    bad = _bad_target(case, tmp_path)
    before = {p.name: p.lstat().st_mode for p in tmp_path.iterdir()}
    report, manifest = (bad, tmp_path / "m.json") if flag == "--report" else (tmp_path / "r.json", bad)
    _no_validation(monkeypatch)
    assert kiln_cli(_argv(Path(clean_corpus["out"]), report, manifest)) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot write {flag} {bad}" in line and BAD_TARGETS[case] in line
    assert {p.name: p.lstat().st_mode for p in tmp_path.iterdir()} == before  # nothing created, no node replaced
    assert not (tmp_path / "nowhere").exists()


def test_an_output_inside_the_corpus_is_refused(kiln_cli, corpus: Path, capsys, monkeypatch) -> None:
    shard = corpus / "train" / "shard-00000.parquet"
    data = shard.read_bytes()
    _no_validation(monkeypatch)
    assert kiln_cli(_argv(corpus, corpus / "r.json", shard)) == 2
    assert "inside the corpus" in _one_error_line(capsys.readouterr().err)
    assert shard.read_bytes() == data and not (corpus / "r.json").exists()


@contextlib.contextmanager
def _tmpfs(mountpoint: Path, options: str) -> Iterator[Path]:
    """A small tmpfs of its own (tests run as root here and in CI), unmounted afterwards."""
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mountpoint)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def _fill(folder: Path) -> None:
    """Write zeros until the filesystem is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):  # ENOSPC: full
            while os.write(fd, b"\0" * 512):
                pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("flag", ["--report", "--manifest-out"])
def test_a_read_only_output_folder_is_a_usage_error_before_any_work(flag: str, kiln_cli, clean_corpus, tmp_path: Path,
                                                                    capsys, monkeypatch) -> None:
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        report, manifest = (ro / "r.json", tmp_path / "m.json") if flag == "--report" else (tmp_path / "r.json", ro / "m.json")
        _no_validation(monkeypatch)
        assert kiln_cli(_argv(Path(clean_corpus["out"]), report, manifest)) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"cannot write {flag} {ro}/" in line and "Read-only file system" in line
        assert list(ro.iterdir()) == [] and not (tmp_path / "r.json").exists()


def test_a_disk_that_fills_under_the_report_is_a_fault_that_keeps_the_old_report(kiln_cli, clean_corpus, tmp_path: Path,
                                                                                  capsys) -> None:
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        (small / "r.json").write_text("the previous report\n")
        _fill(small)
        assert kiln_cli(_argv(Path(clean_corpus["out"]), small / "r.json", tmp_path / "m.json")) == 1
        line = _one_error_line(capsys.readouterr().err)
        assert f"cannot write --report {small / 'r.json'}" in line and "No space left on device" in line
        assert (small / "r.json").read_text() == "the previous report\n" and _leftovers(small) == []
        assert not (tmp_path / "m.json").exists()  # no manifest next to a report that failed


def test_a_disk_that_fills_under_the_manifest_is_a_fault_and_leaves_no_partial_manifest(
    kiln_cli, clean_corpus, tmp_path: Path, capsys
) -> None:
    with _tmpfs(tmp_path / "small", "size=64k") as small:
        _fill(small)
        assert kiln_cli(_argv(Path(clean_corpus["out"]), tmp_path / "r.json", small / "m.json")) == 1
        line = _one_error_line(capsys.readouterr().err)
        assert f"cannot write --manifest-out {small / 'm.json'}" in line and "No space left on device" in line
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
        assert json.loads((tmp_path / "r.json").read_text())["gate"] == "pass"  # the report is true: the gate passed


# -- hard-wrapped prose: the hint -------------------------------------------------------------------


def test_hard_wrapped_prose_dropped_for_its_layout_gets_a_hint_naming_the_contract_that_fits(kiln_cli, tmp_path: Path,
                                                                                             capsys) -> None:
    """The Python reference's topics as they ship (hard-wrapped), imported as text files: web-text@1
    drops most of them, mostly by its line rules, and says so (prose-wrapped@1's verdicts on the same text:
    tests/unit/kiln/data/test_prose_wrapped.py)."""
    from kiln.data.prose import pydoc_topics

    src = tmp_path / "topics"
    src.mkdir()
    for name, text in list(pydoc_topics())[40:]:
        (src / (name.split("/", 1)[1] + ".txt")).write_text(text, encoding="utf-8")
    corpus = tmp_path / "wrapped"
    assert kiln_cli(["corpus", "import", str(src), "--name", "wrapped", "--format", "text", "--root", str(tmp_path),
                     "--eval-fraction", "0.05"]) == 0
    capsys.readouterr()
    kiln_cli(["validate", str(corpus), "--contract", "web-text@1", "--report", str(tmp_path / "web.json")])
    captured = capsys.readouterr()
    hints = [line for line in captured.err.splitlines() if line.startswith("hint: ")]
    assert len(hints) == 1 and "--contract prose-wrapped@1" in hints[0], captured.err
    assert json.loads(captured.out)["hint"] == hints[0].removeprefix("hint: ")
    assert json.loads((tmp_path / "web.json").read_text())["hint"] == hints[0].removeprefix("hint: ")


def test_a_code_corpus_is_judged_by_its_file_paths_and_lines(kiln_cli, tmp_path: Path, capsys) -> None:
    """A tree of files imported as a source-code corpus: the extension rule reads each row's source
    path through validation, the line rules its text; the standard library's files pass."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    src = tmp_path / "tree"
    (src / "lib").mkdir(parents=True)
    for name in ("bisect.py", "colorsys.py", "heapq.py", "keyword.py", "shlex.py", "textwrap.py", "fnmatch.py",
                 "glob.py", "sched.py", "stat.py", "string.py", "this.py", "timeit.py", "uu.py"):
        (src / "lib" / name).write_text((stdlib / name).read_text(encoding="utf-8"), encoding="utf-8")
    for k in range(4):  # texts of this test's own, two of which the split (seed 5) holds out whatever the stdlib
        (src / "lib" / f"helper_{k}.py").write_text(f'"""Helper number {k}."""\n\n\ndef helper_{k}(x: int) -> int:\n'
                                                    f'    """Return x plus {k}."""\n    return x + {k}\n')
    (src / "notes.txt").write_text("Remember to water the plants on Monday and Thursday.\n")  # both kept in train
    (src / "app.min.js").write_text("var a=1;" * 300 + "\n")                                    # by seed 5
    assert kiln_cli(["corpus", "import", str(src), "--name", "repo", "--format", "text", "--kind", "source-code",
                     "--root", str(tmp_path), "--eval-fraction", "0.3", "--seed", "5"]) == 0
    capsys.readouterr()
    report_path = tmp_path / "r.json"
    assert kiln_cli(["validate", str(tmp_path / "repo"), "--contract", "source-code@1", "--report", str(report_path)]) == 0
    dropped = json.loads(capsys.readouterr().out)["documents_dropped"]
    report = json.loads(report_path.read_text())["dropped"]["all_shards"]["details"]
    # keyword.py says "Automatically generated" in its header; the others are hand-written code.
    assert report.get("extension") == {"extension_not_allowed": 1} and report.get("code_lines") == {"max_line_length": 1}
    assert dropped["documents"] <= 6 and dropped["of_documents"] >= 12  # the two above, keyword.py, near copies
