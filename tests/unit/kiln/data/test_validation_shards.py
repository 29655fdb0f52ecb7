"""``kiln.data.validation.shards``: unreadable shards, and paths that are not regular files (quarantined unopened)."""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import shutil
import socket
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kiln.data import validation
from kiln.data.corpus import parquet_bytes
from kiln.data.validation import (
    READABLE_RULE,
    build_training_manifest,
    cross_shard_duplicates,
    load_eval_doc_hashes,
    validate_directory,
    validate_shard,
)
from kiln.errors import ContractError

from shard_fixtures import validated_one_by_one, write_file

# -- unreadable shards never raise -------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda d: write_file(d / "zero.parquet", b""),
        lambda d: write_file(d / "garbage.parquet", b"PAR1" + bytes(range(256)) * 8 + b"PAR1"),
        lambda d: write_file(d / "csv.parquet", b"doc_id,text,source\na,b,c\n"),
        lambda d: write_file(
            d / "trunc.parquet",
            parquet_bytes(pa.table({"doc_id": ["a"] * 50, "text": ["x" * 40] * 50, "source": ["s"] * 50}))[:-9],
        ),
        lambda d: d / "does-not-exist.parquet",
        lambda d: d,  # a directory
    ],
    ids=["zero-bytes", "garbage-with-magic", "csv", "footer-cut", "missing", "directory"],
)
def test_unreadable_shards_are_quarantined_not_raised(make, tmp_path: Path, stdlib_contract) -> None:
    report = validate_shard(make(tmp_path), stdlib_contract)
    assert report.verdict == "quarantined"
    assert [r["expectation"] for r in report.reasons] == [READABLE_RULE]
    assert report.reasons[0]["error"]


@pytest.mark.parametrize(
    "table, rules",
    [
        (pa.table({"doc_id": ["a", "b"], "text": [["x" * 20], ["y" * 20]], "source": ["s", "s"]}),
         {"expect_column_values_to_be_of_type"}),
        (pa.table({"doc_id": ["a"], "text": [b"x" * 20], "source": ["s"]}), {"expect_column_values_to_be_of_type"}),
        (pa.table({"other": [1, 2]}), {"expect_table_columns_to_match_set"}),
        (pa.table({c: pa.array([], pa.string()) for c in ("doc_id", "text", "source")}),
         {"expect_table_row_count_to_be_between"}),
    ],
    ids=["text-is-a-list", "text-is-binary", "no-expected-columns", "zero-rows"],
)
def test_unexpected_schemas_are_quarantined_with_schema_reasons(table, rules, tmp_path: Path, stdlib_contract) -> None:
    report = validate_shard(write_file(tmp_path / "odd.parquet", parquet_bytes(table)), stdlib_contract)
    assert report.verdict == "quarantined"
    assert {r["expectation"] for r in report.reasons} == rules, report.reasons


# -- shard paths that are not regular files: quarantined unopened, never blocking ------------------


def _copy_corpus(clean_corpus: dict[str, Any], dest: Path) -> Path:
    shutil.copytree(clean_corpus["out"], dest)
    return dest


def _returns_within(call: Callable[[], Any], fifos: Sequence[Path] = (), seconds: float = 60) -> Any:
    """``call()``'s result, failing the test if it blocks: then each FIFO gets a writer that closes at
    once, so the blocked reader sees end-of-file and the thread ends with the test."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(seconds)
        pytest.fail(f"still running after {seconds} s: blocked on {[str(f) for f in fifos] or 'something'}")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _make_special(kind: str, path: Path) -> Path:
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))  # the node stays after close
        sock.close()
    else:  # a node like /dev/null (reading it gives b""): a device, whatever its bytes
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod is not permitted here")
    return path


@pytest.mark.parametrize("kind", ["FIFO", "socket", "character device"])
def test_a_special_file_among_the_shards_is_quarantined_unopened(kind: str, clean_corpus, stdlib_contract,
                                                                 tmp_path: Path) -> None:
    special = _make_special(kind, tmp_path / "special.parquet")
    good = clean_corpus["train"][:2]
    paths = [good[0], special, good[1]]
    reports = _returns_within(lambda: validation.validate_shards(paths, stdlib_contract), fifos=[special])
    assert [r.verdict for r in reports] == ["healthy", "quarantined", "healthy"]
    (reason,) = reports[1].reasons
    assert reason["expectation"] == READABLE_RULE
    assert str(special) in reason["error"] and f"is a {kind}, not a regular file" in reason["error"]
    assert reports == _returns_within(lambda: validated_one_by_one(paths, stdlib_contract, frozenset()), fifos=[special])


def test_the_dag_validation_task_quarantines_a_fifo_and_a_link_without_blocking(clean_corpus, home, tmp_path: Path) -> None:
    """``stages.validate_stage`` is what every mapped validation task runs: no poisoned path may hang it,
    even one that appears in the pinned copy of a snapshot after it was pinned."""
    from kiln import settings as kiln_settings
    from kiln import stages
    from kiln.policy import SANDBOX

    _copy_corpus(clean_corpus, kiln_settings.load().corpus_root / "scratch-corpus")
    snapshot = stages.snapshot_stage(SANDBOX, "scratch-corpus")
    root = Path(snapshot.path)
    (root / "train").chmod(0o755)
    outside = shutil.copy(root / "train" / "shard-00001.parquet", tmp_path / "outside.parquet")
    (root / "train" / "shard-00001.parquet").unlink()
    (root / "train" / "shard-00001.parquet").symlink_to(outside)
    fifo = root / "train" / "shard-00009.parquet"
    os.mkfifo(fifo)
    shards = sorted(f"train/{p.name}" for p in (root / "train").iterdir())
    reports = _returns_within(lambda: stages.validate_stage(SANDBOX, snapshot, shards, "kiln_sandbox/manual__fifo"),
                               fifos=[fifo])
    verdicts = {Path(r.path).name: r.verdict for r in reports}
    assert {n for n, v in verdicts.items() if v != "healthy"} == {"shard-00001.parquet", "shard-00009.parquet"}
    errors = {Path(r.path).name: r.reasons[0]["error"] for r in reports if r.verdict != "healthy"}
    assert "symlink" in errors["shard-00001.parquet"] and "FIFO" in errors["shard-00009.parquet"]


@pytest.mark.parametrize("where", ["outside the corpus", "inside the corpus", "dangling"])
def test_a_symlinked_shard_is_quarantined_and_never_enters_the_manifest(where: str, clean_corpus, stdlib_contract,
                                                                        tmp_path: Path) -> None:
    root = _copy_corpus(clean_corpus, tmp_path / "corpus")
    link = root / "train" / "shard-00003.parquet"
    target = {"outside the corpus": tmp_path / "elsewhere.parquet", "inside the corpus": root / "store.parquet",
              "dangling": tmp_path / "gone.parquet"}[where]
    if where == "dangling":
        link.unlink()
    else:
        shutil.move(link, target)  # the bytes of a healthy shard: only the link is wrong
    link.symlink_to(target)
    reports = validate_directory(root, stdlib_contract)
    by_name = {Path(r.path).name: r for r in reports}
    assert by_name["shard-00003.parquet"].verdict == "quarantined"
    (reason,) = by_name["shard-00003.parquet"].reasons
    assert reason["expectation"] == READABLE_RULE and "symlink" in reason["error"] and str(target) in reason["error"]
    assert all(r.verdict == "healthy" for name, r in by_name.items() if name != "shard-00003.parquet")
    manifest = build_training_manifest("x.dir", "stdlib-py", stdlib_contract, reports)
    assert str(link) not in [s["path"] for s in manifest.shards] and str(link) in manifest.quarantined


def test_shards_under_a_symlinked_train_folder_are_quarantined(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    root = _copy_corpus(clean_corpus, tmp_path / "corpus")
    shutil.move(root / "train", tmp_path / "foreign-train")
    (root / "train").symlink_to(tmp_path / "foreign-train")
    reports = validate_directory(root, stdlib_contract)
    assert len(reports) == 8 and all(r.verdict == "quarantined" for r in reports)
    assert all("symlink" in r.reasons[0]["error"] and "outside the corpus" in r.reasons[0]["error"] for r in reports)


def test_a_corpus_reached_through_a_symlink_is_still_validated(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    """Only links *below* the corpus are refused: the path a user gives may itself be a link."""
    (tmp_path / "link").symlink_to(clean_corpus["out"])
    assert all(r.verdict == "healthy" for r in validate_directory(tmp_path / "link", stdlib_contract))


@pytest.mark.parametrize("kind", ["FIFO", "symlink"])
def test_an_eval_split_file_that_is_not_regular_is_a_named_fault(kind: str, clean_corpus, tmp_path: Path) -> None:
    root = _copy_corpus(clean_corpus, tmp_path / "corpus")
    path = root / "eval" / "eval-00001.parquet"
    if kind == "FIFO":
        os.mkfifo(path)
    else:
        path.symlink_to(shutil.copy(root / "eval" / "eval-00000.parquet", tmp_path / "outside.parquet"))
    with pytest.raises(ContractError, match=re.escape(str(path)) + f".*{kind}"):
        _returns_within(lambda: load_eval_doc_hashes(root), fifos=[path] if kind == "FIFO" else [])


def test_a_shard_swapped_for_a_fifo_after_validation_does_not_block_the_cross_shard_rule(
    clean_corpus, stdlib_contract, tmp_path: Path
) -> None:
    root = _copy_corpus(clean_corpus, tmp_path / "corpus")
    reports = validate_directory(root, stdlib_contract)
    swapped = root / "train" / "shard-00002.parquet"
    swapped.unlink()
    os.mkfifo(swapped)
    rechecked = _returns_within(lambda: cross_shard_duplicates(reports), fifos=[swapped])
    (bad,) = [r for r in rechecked if r.verdict != "healthy"]
    assert bad.path == str(swapped) and "FIFO" in bad.reasons[0]["error"]


def test_entries_of_train_that_are_not_shards_are_named_in_both_reports(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    root = _copy_corpus(clean_corpus, tmp_path / "corpus")
    (root / "train" / "README.txt").write_text("notes")
    (root / "train" / "shard-00008.parquet.bak").write_bytes((root / "train" / "shard-00000.parquet").read_bytes())
    (root / "train" / "more").mkdir()
    os.mkfifo(root / "train" / "pipe")
    skipped = _returns_within(lambda: validation.skipped_train_entries(root), fifos=[root / "train" / "pipe"])
    assert [Path(e.path).name for e in skipped] == ["README.txt", "more", "pipe", "shard-00008.parquet.bak"]
    kinds = {Path(e.path).name: e.reason for e in skipped}
    assert kinds["more"].startswith("a directory") and kinds["pipe"].startswith("a FIFO")
    assert all("not validated" in e.reason for e in skipped)
    assert validation.skipped_train_entries(clean_corpus["out"]) == []
    reports = validate_directory(root, stdlib_contract)
    assert len(reports) == 8  # the skipped entries are no shards
    body = validation.quarantine_report(reports, skipped=skipped)
    assert body["skipped"] == [e.to_json() for e in skipped]
    page = validation.render_quarantine_html(reports, skipped=skipped)
    assert all(html.escape(e.path) in page for e in skipped) and "Not validated: 4 entries" in page
    assert "skipped" not in validation.quarantine_report(reports)  # callers that list no entries: unchanged
    published = validation.publish_quarantine_report(
        reports, tmp_path / "out", snapshot_id="x.dir", contract=stdlib_contract, max_quarantine_share=0.5, skipped=skipped
    )
    assert json.loads(Path(published["json"]).read_text())["skipped"] == body["skipped"]
    assert "README.txt" in Path(published["html"]).read_text()


def test_a_shard_path_outside_the_given_root_is_refused(clean_corpus, stdlib_contract, tmp_path: Path) -> None:
    (report,) = validation.validate_shards([clean_corpus["train"][0]], stdlib_contract, root=tmp_path)
    assert report.verdict == "quarantined" and f"is not inside the corpus {tmp_path}" in report.reasons[0]["error"]
