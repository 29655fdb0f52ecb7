"""``kiln.util.fs``'s readers of someone else's files and its directory swap: ``open_regular_file``
opens a regular file only, never through a link unless asked, within a size bound;
``lies_inside`` resolves links; ``exchange_paths`` swaps two folders in one step."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kiln.util.fs import exchange_paths, lies_inside, open_regular_file


def test_open_regular_file_reads_a_regular_file_and_follows_a_link_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello")
    (tmp_path / "link").symlink_to(tmp_path / "a.txt")
    with open_regular_file(tmp_path / "a.txt", max_bytes=5) as fh:
        assert fh.read() == b"hello"
    with open_regular_file(tmp_path / "link", follow_link=True) as fh:
        assert fh.read() == b"hello"
    with pytest.raises(OSError, match="is a symlink") as info:
        open_regular_file(tmp_path / "link")
    assert info.value.errno == errno.ELOOP and info.value.filename == str(tmp_path / "link")


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too large"])
def test_open_regular_file_refuses_what_is_not_a_bounded_regular_file(tmp_path: Path, kind: str) -> None:
    path = {"fifo": tmp_path / "pipe", "device": Path("/dev/zero"), "directory": tmp_path,
            "too large": tmp_path / "big"}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # opened without blocking: the test would hang otherwise
    if kind == "too large":
        path.write_bytes(b"x" * 11)
    expected = {"fifo": "is a FIFO, not a regular file", "device": "is a character device, not a regular file",
                "directory": "directory", "too large": "is 11 bytes, more than the 10 bytes allowed"}[kind]
    with pytest.raises(OSError, match=expected):
        open_regular_file(path, max_bytes=10)


def test_lies_inside_sees_through_links_and_other_spellings(tmp_path: Path) -> None:
    (tmp_path / "ck" / "step").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(tmp_path / "ck")
    assert lies_inside(tmp_path / "ck" / "step" / "new.json", tmp_path / "ck")
    assert lies_inside(tmp_path / "alias" / "step" / "new.json", tmp_path / "ck")
    assert lies_inside(tmp_path / "ck" / ".." / "ck" / "x", tmp_path / "ck")
    assert not lies_inside(tmp_path / "ck-other" / "x", tmp_path / "ck")
    assert not lies_inside(tmp_path / "x", tmp_path / "ck")


def test_exchange_paths_swaps_two_folders_and_names_both_when_it_cannot(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "A").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "B").write_text("b")
    exchange_paths(tmp_path / "a", tmp_path / "b")
    assert os.listdir(tmp_path / "a") == ["B"] and os.listdir(tmp_path / "b") == ["A"]
    with pytest.raises(OSError) as info:
        exchange_paths(tmp_path / "a", tmp_path / "missing")
    assert info.value.errno == errno.ENOENT and info.value.filename2 == str(tmp_path / "missing")
