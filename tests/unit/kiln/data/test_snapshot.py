"""DVC snapshots against a real local remote: stable ids, restore from the remote alone, clear errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from kiln import settings as kiln_settings
from kiln.data import snapshot
from kiln.errors import ConfigError, SnapshotError


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


def test_restore_refuses_bytes_that_do_not_match_the_id(home):
    """A corrupted object on the remote: DVC's pull does not re-hash it, kiln's check does."""
    corpus = _corpus()
    ref = snapshot.create_snapshot(corpus)
    shard = (corpus / "train" / "shard-00002.parquet").read_bytes()
    md5 = hashlib.md5(shard).hexdigest()
    obj = Path(ref.remote) / "files" / "md5" / md5[:2] / md5[2:]
    obj.chmod(0o644)
    obj.write_bytes(b"bit rot" + shard[7:])
    shutil.rmtree(kiln_settings.load().dvc_cache)
    with pytest.raises(SnapshotError, match=r"do not match its hashes \(1 file\(s\): train/shard-00002.parquet: md5 differs\)"):
        snapshot.restore_snapshot(ref.id, home / "restored")
    assert not (home / "restored").exists()


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
    missing = subprocess.run([sys.executable, "-m", "kiln.cli", "snapshot", "restore", "f" * 32 + ".dir",
                              "--to", str(home / "r")], capture_output=True, text=True, env=env)
    assert missing.returncode == 1 and "unknown snapshot id" in missing.stderr


# ------------------------------------------------------------------------------------ incremental
def test_resnapshot_after_one_shard_changed_reads_and_hashes_only_that_shard(home, monkeypatch):
    """Two observables: the kernel's atime (a file DVC did not read keeps the atime we set) and the
    calls to DVC's file hasher. relatime updates atime on a read when atime <= mtime, so every
    atime is set to 0 (mtimes kept: DVC's state db keys on inode, mtime and size)."""
    import dvc_data.hashfile.hash as dvc_hash

    corpus = _corpus()
    first = snapshot.create_snapshot(corpus)
    changed = corpus / "train" / "shard-00001.parquet"
    changed.write_bytes(b"a new version of one shard")
    files = sorted(p for p in corpus.rglob("*") if p.is_file())
    for p in files:
        os.utime(p, ns=(0, p.stat().st_mtime_ns))
    hashed: list[str] = []
    real_md5 = dvc_hash.file_md5

    def counting_md5(fname, *args, **kwargs):
        hashed.append(str(fname))
        return real_md5(fname, *args, **kwargs)

    monkeypatch.setattr(dvc_hash, "file_md5", counting_md5)
    second = snapshot.create_snapshot(corpus)

    assert second.id != first.id
    read = [p.name for p in files if p.stat().st_atime_ns != 0]
    assert read == [changed.name], f"files read by the re-snapshot: {read}"
    assert [h for h in hashed if not h.startswith("memory://")] == [str(changed)]  # memory:// = .dir listing


# ------------------------------------------------------------------------------------- bad input
def _assert_nothing_recorded(corpus: Path) -> None:
    s = kiln_settings.load()
    assert not corpus.with_name(corpus.name + ".dvc").exists(), "a .dvc file claims a snapshot"
    assert not list((s.dvc_repo / ".kiln-snapshots").glob("*.json")), "a record claims a snapshot"
    assert not (s.dvc_repo / ".kiln-pending.json").exists()


def test_missing_directory_is_a_clear_error(home):
    missing = kiln_settings.load().corpus_root / "nope"
    with pytest.raises(SnapshotError, match=r"corpus directory .*nope does not exist"):
        snapshot.create_snapshot(missing)
    _assert_nothing_recorded(missing)


def test_empty_directory_is_a_clear_error(home):
    empty = kiln_settings.load().corpus_root / "empty"
    (empty / "train").mkdir(parents=True)  # only an empty sub-directory: still nothing to snapshot
    with pytest.raises(SnapshotError, match=r"empty: nothing to snapshot"):
        snapshot.create_snapshot(empty)
    _assert_nothing_recorded(empty)


def test_symlink_pointing_outside_the_corpus_is_refused(home, tmp_path):
    corpus = _corpus()
    secret = tmp_path / "outside.txt"
    secret.write_text("not corpus data")
    (corpus / "train" / "sneaky.parquet").symlink_to(secret)
    with pytest.raises(SnapshotError, match=r"sneaky.parquet is a symlink pointing outside the corpus"):
        snapshot.create_snapshot(corpus)
    _assert_nothing_recorded(corpus)


def test_unreadable_entries_are_refused(home, monkeypatch):
    """Tests run as root, for whom ``chmod 000`` does not stop a read, so an unreadable file is made
    three other ways: a dangling symlink (open fails), a FIFO (DVC would block on it forever) and
    an ``open`` that fails with EACCES as it would for a non-root worker."""
    import errno

    corpus = _corpus()
    dangling = corpus / "train" / "gone.parquet"
    dangling.symlink_to(corpus / "train" / "deleted-meanwhile.parquet")
    with pytest.raises(SnapshotError, match=r"gone.parquet is a dangling symlink"):
        snapshot.create_snapshot(corpus)
    dangling.unlink()

    fifo = corpus / "train" / "pipe.parquet"
    os.mkfifo(fifo)
    with pytest.raises(SnapshotError, match=r"pipe.parquet is a FIFO, not a regular file"):
        snapshot.create_snapshot(corpus)
    fifo.unlink()

    locked = corpus / "eval" / "eval-00000.parquet"
    real_open = os.open

    def open_denied(path, flags, *args, **kwargs):
        if Path(path) == locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(snapshot.os, "open", open_denied)
    with pytest.raises(SnapshotError, match=r"cannot read .*eval-00000.parquet: Permission denied"):
        snapshot.create_snapshot(corpus)
    _assert_nothing_recorded(corpus)


def test_unusable_local_remote_records_nothing(home, monkeypatch, tmp_path):
    blocker = tmp_path / "remote-is-a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KILN_DVC_REMOTE", str(blocker / "dvc"))
    corpus = _corpus()
    with pytest.raises(SnapshotError, match=r"local DVC remote .*remote-is-a-file/dvc is not usable"):
        snapshot.create_snapshot(corpus)
    _assert_nothing_recorded(corpus)


def test_failed_push_puts_the_previous_dvc_file_back(home, monkeypatch):
    """The push fails after ``dvc add`` rewrote the .dvc file: the file must go back to the snapshot
    that is on the remote. (The real unreachable S3 endpoint is in tests/integration.)"""
    from dvc.repo import Repo

    corpus = _corpus()
    good = snapshot.create_snapshot(corpus)
    (corpus / "train" / "shard-00000.parquet").write_bytes(b"never pushed")

    def push_fails(self, *args, **kwargs):
        raise OSError("remote went away")

    monkeypatch.setattr(Repo, "push", push_fails)
    with pytest.raises(SnapshotError, match=r"failed at dvc push to .*nothing was recorded: OSError: remote went away"):
        snapshot.create_snapshot(corpus)
    assert corpus.with_name("demo.dvc").read_text() == good.dvc
    assert [r.id for r in snapshot.list_snapshots()] == [good.id]
    assert not (kiln_settings.load().dvc_repo / ".kiln-pending.json").exists()


def test_a_create_that_crashed_mid_push_is_undone_by_the_next_writer(home):
    import json

    corpus = _corpus()
    good = snapshot.create_snapshot(corpus)
    workspace, dvc_file = kiln_settings.load().dvc_repo, corpus.with_name("demo.dvc")
    # What SIGKILL between add and push leaves behind: the journal and a rewritten .dvc file.
    (workspace / ".kiln-pending.json").write_text(json.dumps({"dvc_file": str(dvc_file), "previous": good.dvc}))
    dvc_file.write_text(good.dvc.replace(good.id, "0" * 32 + ".dir"))
    (corpus / "train" / "shard-00000.parquet").write_bytes(b"changed after the crash")
    snapshot.create_snapshot(corpus, push=False)  # the next writer, whatever it does
    assert dvc_file.read_text() == good.dvc
    assert not (workspace / ".kiln-pending.json").exists()


def test_hash_only_create_records_nothing(home):
    corpus = _corpus()
    ref = snapshot.create_snapshot(corpus, push=False)
    assert snapshot.SNAPSHOT_ID.match(ref.id) and ref.remote == ""
    _assert_nothing_recorded(corpus)
    assert not list(Path(kiln_settings.load().dvc_remote).rglob("*.dir"))
    assert snapshot.create_snapshot(corpus).id == ref.id


def test_credentials_in_the_remote_url_are_refused(home, monkeypatch):
    monkeypatch.setenv("KILN_DVC_REMOTE", "s3://AKIAEXAMPLE:hunter2@bucket/prefix")
    corpus = _corpus()
    with pytest.raises(SnapshotError, match="must not carry credentials") as info:
        snapshot.create_snapshot(corpus)
    assert "hunter2" not in str(info.value)


# ------------------------------------------------------------------------------------ concurrency
_TASK_PROCESS = """
import json, sys
from kiln.data.snapshot import checkout_snapshot, create_snapshot
refs = [checkout_snapshot(create_snapshot(path).id).to_json() for path in sys.argv[1:]]
print(json.dumps(refs))
"""


def test_two_task_processes_snapshot_the_same_workspace_at_once(home):
    """As two Airflow task processes would: separate interpreters, one workspace, each snapshots and
    pins both corpora (one in each order), so they contend on the same corpus and on different ones."""
    import json
    import subprocess
    import sys

    a, b = _corpus("alpha", b"A"), _corpus("beta", b"B")
    env = {**os.environ, "KILN_HOME": str(home)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _TASK_PROCESS, *map(str, order)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for order in ((a, b), (b, a))
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    first, second = (json.loads(out) for out, _ in outputs)
    ids = {r["corpus"]: r["id"] for r in first}
    assert ids == {r["corpus"]: r["id"] for r in second} and ids["alpha"] != ids["beta"]
    for name, corpus in (("alpha", a), ("beta", b)):
        assert _tree_hashes(Path(snapshot.checkout_snapshot(ids[name]).path)) == _tree_hashes(corpus)
        assert f"md5: {ids[name]}" in corpus.with_name(f"{name}.dvc").read_text()
    assert sorted(r.id for r in snapshot.list_snapshots()) == sorted(ids.values())


# ------------------------------------------------------------------------------------- announcing
class _FakeAirflow:
    """Records requests the way ``AirflowClient.request`` receives them; knows a few assets."""

    def __init__(self, assets: list[dict]):
        self.assets = assets
        self.calls: list[tuple[str, str, dict]] = []

    def request(self, method, path, *, ok=(200,), **kwargs):
        self.calls.append((method, path, {"ok": ok, **kwargs}))
        if (method, path) == ("GET", "/assets"):
            return {"assets": self.assets, "total_entries": len(self.assets)}
        if (method, path) == ("POST", "/assets/events"):
            return {"id": 41, "asset_id": kwargs["json"]["asset_id"], "timestamp": "2026-11-29T18:00:00Z",
                    "extra": {**kwargs["json"]["extra"], "from_rest_api": True}}
        raise AssertionError(f"unexpected request {method} {path}")


def test_announce_posts_the_corpus_asset_event_with_the_snapshot_id():
    from kiln.airflow.dagfactory import corpus_asset
    from kiln.cli.snapshot import announce_snapshot

    asset = corpus_asset("stdlib-py")
    assert (asset.name, asset.uri.rstrip("/")) == ("kiln.corpus.stdlib-py", "kiln-corpus://stdlib-py")
    client = _FakeAirflow([
        {"id": 3, "name": "kiln.corpus.stdlib-py-old", "uri": "kiln-corpus://stdlib-py-old"},  # substring match only
        {"id": 7, "name": asset.name, "uri": asset.uri},
    ])
    ref = {"id": "a" * 32 + ".dir", "corpus": "stdlib-py", "files": 9, "bytes": 1, "dvc": "outs: ...", "remote": "s3://b/p"}
    announced = announce_snapshot(client, ref)

    (m1, p1, kw1), (m2, p2, kw2) = client.calls
    assert (m1, p1, kw1["params"]["name_pattern"]) == ("GET", "/assets", "kiln.corpus.stdlib-py")
    assert (m2, p2) == ("POST", "/assets/events")  # AirflowClient prefixes /api/v2
    assert kw2["json"] == {"asset_id": 7, "extra": {"snapshot_id": ref["id"], "corpus": "stdlib-py"}}
    assert 200 in kw2["ok"] and 201 in kw2["ok"]
    assert announced == {"asset": asset.name, "uri": asset.uri, "asset_id": 7, "event_id": 41,
                         "timestamp": "2026-11-29T18:00:00Z"}


def test_announce_without_the_asset_in_airflow_is_a_clear_error():
    from kiln.cli.snapshot import announce_snapshot
    from kiln.errors import AirflowAPIError

    client = _FakeAirflow([{"id": 3, "name": "kiln.corpus.other", "uri": "kiln-corpus://other"}])
    with pytest.raises(AirflowAPIError, match=r"no asset 'kiln.corpus.stdlib-py' \(kiln-corpus://stdlib-py/?\)"):
        announce_snapshot(client, {"id": "b" * 32 + ".dir", "corpus": "stdlib-py"})
    assert [c[0] for c in client.calls] == ["GET"], "posted an event for an asset Airflow does not know"


def test_cli_announce_after_push_prints_the_ref_and_the_event(home, monkeypatch, capsys):
    import json

    from kiln.cli import main
    from kiln.cli import snapshot as cli_snapshot

    corpus = _corpus("stdlib-py")
    client = _FakeAirflow([{"id": 5, "name": "kiln.corpus.stdlib-py", "uri": "kiln-corpus://stdlib-py"}])
    monkeypatch.setattr(cli_snapshot, "airflow_client", lambda: client)
    assert main(["snapshot", "create", str(corpus), "--announce"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["announced"]["event_id"] == 41
    assert client.calls[-1][2]["json"]["extra"]["snapshot_id"] == printed["id"]
    assert snapshot.show_snapshot(printed["id"]).remote, "announced before the snapshot was recorded as pushed"


def test_cli_announce_failure_keeps_the_snapshot_and_says_so(home, monkeypatch, capsys):
    import json

    from kiln.cli import main
    from kiln.cli import snapshot as cli_snapshot

    corpus = _corpus("stdlib-py")
    monkeypatch.setattr(cli_snapshot, "airflow_client", lambda: _FakeAirflow([]))
    assert main(["snapshot", "create", str(corpus), "--announce"]) == 1
    out, err = capsys.readouterr()
    ref = json.loads(out)
    assert f"snapshot {ref['id']} was created and pushed, but announcing it failed" in err
    assert snapshot.show_snapshot(ref["id"]).id == ref["id"]


def test_cli_announce_and_no_push_exclude_each_other(home, capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit) as info:
        main(["snapshot", "create", "somewhere", "--no-push", "--announce"])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_announce_login_comes_from_the_environment_or_the_stack(home, monkeypatch):
    from kiln.cli.snapshot import airflow_client
    from kiln.errors import ConfigError

    monkeypatch.delenv("KILN_AIRFLOW_USER", raising=False)
    monkeypatch.delenv("KILN_AIRFLOW_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="no Airflow login"):
        airflow_client()
    monkeypatch.setenv("KILN_AIRFLOW_USER", "corpus-bot")
    monkeypatch.setenv("KILN_AIRFLOW_PASSWORD", "pw-from-env")
    client = airflow_client()
    assert client.username == "corpus-bot" and client._password == "pw-from-env"


def test_cache_links_the_workspace_but_the_remote_keeps_its_own_copy(home, caplog):
    """Snapshotting writes the corpus once (to the remote), not twice: the cache object is a hardlink
    of the workspace shard. A shard rewritten in place (root ignores the read-only mode DVC sets)
    changes that cache object too — the old snapshot still restores, healed from the remote copy."""
    corpus = _corpus()
    shard = corpus / "train" / "shard-00001.parquet"
    original = shard.read_bytes()
    ref = snapshot.create_snapshot(corpus)
    md5 = hashlib.md5(original).hexdigest()
    cached = snapshot._cache_object(kiln_settings.load(), md5)
    remote = Path(ref.remote) / "files" / "md5" / md5[:2] / md5[2:]
    assert os.path.samefile(shard, cached), "dvc add copied the shard instead of linking it"
    assert not os.path.samefile(cached, remote), "the remote must hold an independent copy"
    assert shard.stat().st_mode & 0o222 == 0, "DVC leaves linked workspace files read-only"

    with open(shard, "r+b") as fh:  # in place: same inode, so the cache object changes too
        fh.write(b"rewritten in place")
    assert cached.read_bytes() != original
    with caplog.at_level("WARNING", logger="kiln.snapshot"):
        restored = snapshot.restore_snapshot(ref.id, home / "restored")
    assert (restored / "train" / "shard-00001.parquet").read_bytes() == original
    assert "evicting them and fetching again from the remote" in caplog.text
    assert cached.read_bytes() == original, "the evicted object was fetched again"
    assert not os.path.samefile(restored / "train" / "shard-00001.parquet", cached)


def test_hash_jobs_reach_the_workspace_config_and_bad_values_are_refused(home, monkeypatch):
    monkeypatch.setenv("KILN_DVC_HASH_JOBS", "3")
    root = snapshot.ensure_workspace()
    assert "checksum_jobs = 3" in (root / ".dvc" / "config").read_text()
    monkeypatch.setenv("KILN_DVC_HASH_JOBS", "zero")
    with pytest.raises(ConfigError, match="KILN_DVC_HASH_JOBS must be a positive integer, got 'zero'"):
        kiln_settings.load()


# ------------------------------------------------------------------------ partial uploads (.tmp)
def _partial_uploads(remote: Path) -> list[Path]:
    return sorted((remote / "files").glob("*/*/.*.tmp"))


def _random_corpus(total: int) -> Path:
    root = kiln_settings.load().corpus_root / "big"
    (root / "train").mkdir(parents=True, exist_ok=True)
    for i in range(3):
        (root / "train" / f"shard-{i:05d}.parquet").write_bytes(os.urandom(total // 3))
    return root


def test_a_push_that_fails_on_a_full_remote_leaves_no_partial_upload_and_a_later_push_completes(home, tmpfs, monkeypatch):
    """DVC copies each object to ``.<token>.tmp`` beside its final name and renames it; a push
    that fails part-way leaves those temporaries on a local remote. kiln removes its own."""
    import subprocess

    disk = tmpfs("300k")
    remote = disk / "dvc"
    monkeypatch.setenv("KILN_DVC_REMOTE", str(remote))
    corpus = _random_corpus(600_000)
    with pytest.raises(SnapshotError, match="failed at dvc push"):
        snapshot.create_snapshot(corpus)
    assert _partial_uploads(remote) == []
    assert snapshot.list_snapshots() == []
    subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)  # room again
    ref = snapshot.create_snapshot(corpus)
    shutil.rmtree(kiln_settings.load().dvc_cache)  # a machine that has only the remote
    assert _tree_hashes(snapshot.restore_snapshot(ref.id, home / "restored")) == _tree_hashes(corpus)


def test_a_killed_push_s_partial_upload_is_never_read_and_goes_with_a_later_push(home):
    """A push killed mid-copy (SIGKILL: no cleanup runs) leaves the objects it finished, a torn
    ``files/md5/xx/.<token>.tmp`` and no ``.dir`` listing (DVC uploads that last). DVC looks an
    object up only by its final name, so the next push uploads it whole and restore reads that;
    the leftover is removed once no push can still be writing it."""
    s = kiln_settings.load()
    corpus = _corpus()
    ref = snapshot.create_snapshot(corpus, push=False)  # the objects are in the cache only
    listing = json.loads(snapshot._cache_object(s, ref.id.removesuffix(".dir") + ".dir").read_text())
    remote = Path(s.dvc_remote)
    for entry in listing[1:]:  # what the killed push finished
        done = remote / "files" / "md5" / entry["md5"][:2] / entry["md5"][2:]
        done.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(snapshot._cache_object(s, entry["md5"]), done)
    victim = listing[0]["md5"]
    final = remote / "files" / "md5" / victim[:2] / victim[2:]
    final.parent.mkdir(parents=True, exist_ok=True)
    torn = final.with_name(".killedpushtoken00000.tmp")
    torn.write_bytes(snapshot._cache_object(s, victim).read_bytes()[:100])
    os.utime(torn, (0, 0))  # untouched for far longer than any running push
    fresh = final.with_name(".concurrentpush00000.tmp")  # another push, still writing
    fresh.write_bytes(b"in flight")

    again = snapshot.create_snapshot(corpus)
    assert again.id == ref.id
    assert _partial_uploads(remote) == [fresh]  # the stale one is gone, a live one left alone
    assert hashlib.md5(final.read_bytes()).hexdigest() == victim  # whole, under its final name
    shutil.rmtree(s.dvc_cache)  # a machine that has only the remote
    assert _tree_hashes(snapshot.restore_snapshot(ref.id, home / "restored")) == _tree_hashes(corpus)


@pytest.mark.parametrize("bad", [b'{"id": ' + b"[" * 10_000, b"9" * 5000, b"not json", b'{"id": 5}', b"[]",
                                 b'{"id": "0123456789abcdef0123456789abcdef.dir", "corpus": "x", "files": "1", '
                                 b'"bytes": 1, "dvc": "", "remote": "", "path": ""}'])
def test_a_corrupt_snapshot_record_is_skipped_and_named_not_fatal(home, capsys, bad):
    from kiln.cli import main

    good = snapshot.create_snapshot(_corpus())
    records = next(p.parent for p in kiln_settings.load().home.rglob(f"{good.id.removesuffix('.dir')}.json"))
    broken = records / "0123456789abcdef0123456789abcdef.json"
    broken.write_bytes(bad)
    (records / "fedcba9876543210fedcba9876543210.json").symlink_to("/dev/zero")
    refs, skipped = snapshot.snapshot_records()
    assert [r.id for r in refs] == [good.id]
    assert len(skipped) == 2 and all(line.startswith(str(records)) for line in skipped)
    assert any("not a regular file" in line for line in skipped)
    assert main(["snapshot", "list"]) == 0
    out, err = capsys.readouterr()
    assert good.id in out and err.count("kiln snapshot list: skipped ") == 2 and "Traceback" not in err
    with pytest.raises(SnapshotError, match=f"^{broken}: "):
        snapshot.show_snapshot("0123456789abcdef0123456789abcdef.dir")
