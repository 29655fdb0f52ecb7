"""DVC snapshots against a real local remote: stable ids, restore from the remote alone, clear errors."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import pytest

from kiln import settings as kiln_settings
from kiln import snapshot
from kiln.errors import SnapshotError


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.delenv("KILN_DVC_REMOTE", raising=False)
    return tmp_path / "kiln"


def _corpus(name: str = "demo", payload: bytes = b"") -> Path:
    root = kiln_settings.load().corpus_root / name
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(exist_ok=True)
    for i in range(3):
        (root / "train" / f"shard-{i:05d}.parquet").write_bytes(f"shard {i} ".encode() * 1000 + payload)
    (root / "eval" / "eval-00000.parquet").write_bytes(b"eval" * 100)
    return root


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_content_same_id_and_restore_from_remote_only(home):
    corpus = _corpus()
    first = snapshot.create_snapshot(corpus)
    assert snapshot.SNAPSHOT_ID.match(first.id)
    assert first.files == 4 and first.bytes > 0 and "md5: " + first.id in first.dvc
    remote_files = sorted(p for p in Path(first.remote).rglob("*") if p.is_file())
    again = snapshot.create_snapshot(corpus)
    assert again.id == first.id
    assert sorted(p for p in Path(first.remote).rglob("*") if p.is_file()) == remote_files, "re-push uploaded something"

    shutil.rmtree(kiln_settings.load().dvc_cache)  # a machine that has only the remote
    restored = snapshot.restore_snapshot(first.id, home / "restored")
    assert _tree_hashes(restored) == _tree_hashes(corpus)


def test_changed_shard_gives_a_new_id_and_the_old_one_still_restores(home):
    corpus = _corpus()
    old = snapshot.create_snapshot(corpus)
    (corpus / "train" / "shard-00001.parquet").write_bytes(b"changed")
    new = snapshot.create_snapshot(corpus)
    assert new.id != old.id
    old_copy = snapshot.checkout_snapshot(old.id)
    assert (Path(old_copy.path) / "train" / "shard-00001.parquet").read_bytes() != b"changed"
    assert [r.id for r in snapshot.list_snapshots()] == [old.id, new.id]


def test_unknown_or_malformed_id_is_a_clear_error(home):
    snapshot.ensure_workspace()
    with pytest.raises(SnapshotError, match="unknown snapshot id"):
        snapshot.show_snapshot("0" * 32 + ".dir")
    with pytest.raises(SnapshotError, match="is not a snapshot id"):
        snapshot.restore_snapshot("latest", home / "x")


def test_restore_never_overwrites_a_non_empty_directory(home, tmp_path):
    ref = snapshot.create_snapshot(_corpus())
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(SnapshotError, match="not empty"):
        snapshot.restore_snapshot(ref.id, target)
    assert (target / "keep.txt").read_text() == "precious"


def test_corpus_outside_the_workspace_is_refused(home, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(SnapshotError, match="not inside the DVC workspace"):
        snapshot.create_snapshot(outside)


def test_two_concurrent_snapshots_do_not_corrupt_each_other(home):
    a, b = _corpus("alpha", b"A"), _corpus("beta", b"B")
    snapshot.ensure_workspace()
    results: dict[str, object] = {}

    def run(path: Path) -> None:
        try:
            results[path.name] = snapshot.create_snapshot(path)
        except Exception as exc:  # recorded, asserted below
            results[path.name] = exc

    threads = [threading.Thread(target=run, args=(p,)) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert results["alpha"].id != results["beta"].id
    for name, corpus in (("alpha", a), ("beta", b)):
        restored = snapshot.restore_snapshot(results[name].id, home / f"r-{name}")
        assert _tree_hashes(restored) == _tree_hashes(corpus)


def test_cli_prints_only_json_on_stdout_and_unknown_id_fails_clearly(home):
    import json
    import subprocess
    import sys

    corpus = _corpus()
    env = {**__import__("os").environ, "KILN_HOME": str(home)}
    created = subprocess.run([sys.executable, "-m", "kiln.cli", "snapshot", "create", str(corpus)],
                             capture_output=True, text=True, env=env, check=True)
    ref = json.loads(created.stdout)
    shown = subprocess.run([sys.executable, "-m", "kiln.cli", "snapshot", "show", ref["id"]],
                           capture_output=True, text=True, env=env, check=True)
    assert json.loads(shown.stdout)["dvc"] == ref["dvc"]
    missing = subprocess.run([sys.executable, "-m", "kiln.cli", "snapshot", "restore", "f" * 32 + ".dir", "--to", str(home / "r")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "unknown snapshot id" in missing.stderr
