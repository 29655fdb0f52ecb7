"""Dataset snapshots with DVC: immutable ids, a remote, and restore from the remote alone.

A snapshot is ``dvc add`` of a corpus directory inside kiln's DVC workspace followed by
``dvc push``. Its id is DVC's directory hash (``<md5>.dir``), so the same bytes always give the same
id and pushing them again uploads nothing. Every snapshot is also recorded as a JSON SnapshotRef
(with the full ``.dvc`` text) under ``<workspace>/.kiln-snapshots/``, which is what ``list``/``show``
read and what ``restore`` needs: with the ``.dvc`` text and the remote, the bytes come back on a
machine with an empty cache.

One writer at a time: every operation on the workspace holds an exclusive ``flock`` on
``<workspace>/.kiln.lock`` (DVC's own lock fails after ~3 s instead of waiting).

Validation and training never read the workspace (a later ``corpus build`` may change it); they read
``checkout_snapshot(id).path``: an immutable, hash-verified copy under ``<home>/snapshots/<md5>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kiln import settings as kiln_settings
from kiln.errors import SnapshotError
from kiln.fsutil import atomic_write_text
from kiln.refs import SnapshotRef

SNAPSHOT_ID = re.compile(r"^[0-9a-f]{32}\.dir$")
_REMOTE = "kiln"


def _env() -> None:
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    # DVC's library logger prints progress notes ("Initialized DVC repository.") on stdout, which
    # is where kiln's commands print their JSON references. Warnings and errors still show.
    # (Importing dvc.repo configures that logger, so quieten it after the import.)
    import dvc.repo  # noqa: F401

    logging.getLogger("dvc").setLevel(logging.WARNING)


@contextlib.contextmanager
def workspace_lock(workspace: Path) -> Iterator[None]:
    """Exclusive lock over the DVC workspace, waiting (not failing) for another writer."""
    workspace.mkdir(parents=True, exist_ok=True)
    with open(workspace / ".kiln.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _configure_repo(root: Path, s: kiln_settings.Settings) -> None:
    """Point a DVC repo at kiln's shared cache and the configured remote (idempotent)."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        with repo.config.edit() as conf:
            conf["core"]["remote"] = _REMOTE
            conf["core"]["analytics"] = False
            conf["cache"]["dir"] = str(s.dvc_cache)
            remote = conf["remote"].setdefault(_REMOTE, {})
            remote["url"] = s.dvc_remote
            if s.dvc_remote_endpoint:
                remote["endpointurl"] = s.dvc_remote_endpoint
    finally:
        repo.close()


def ensure_workspace(s: kiln_settings.Settings | None = None) -> Path:
    """Create kiln's DVC workspace (no git) with its cache and remote; safe to call every time."""
    _env()
    s = s or kiln_settings.load()
    root = s.dvc_repo
    with workspace_lock(root):
        if not (root / ".dvc").is_dir():
            from dvc.repo import Repo

            try:
                Repo.init(str(root), no_scm=True).close()
            except Exception as exc:  # dvc raises many unrelated types here
                raise SnapshotError(f"cannot initialise DVC workspace at {root}: {exc}") from exc
        _configure_repo(root, s)
        if not s.dvc_remote.startswith(("s3://", "http://", "https://")):
            Path(s.dvc_remote).mkdir(parents=True, exist_ok=True)
    return root


def _records_dir(s: kiln_settings.Settings) -> Path:
    return s.dvc_repo / ".kiln-snapshots"


def _record(ref: SnapshotRef, s: kiln_settings.Settings) -> None:
    path = _records_dir(s) / f"{ref.id.removesuffix('.dir')}.json"
    atomic_write_text(path, json.dumps(ref.to_json(), indent=2, sort_keys=True) + "\n")


def create_snapshot(corpus_dir: str | Path, *, push: bool = True) -> SnapshotRef:
    """``dvc add`` + ``dvc push`` a corpus directory that lives inside the DVC workspace."""
    _env()
    s = kiln_settings.load()
    root = ensure_workspace(s)
    corpus = Path(corpus_dir).resolve()
    if not corpus.is_dir():
        raise SnapshotError(f"corpus directory {corpus} does not exist")
    if root.resolve() not in corpus.parents:
        raise SnapshotError(f"corpus directory {corpus} is not inside the DVC workspace {root}")
    from dvc.repo import Repo

    with workspace_lock(root):
        repo = Repo(str(root))
        try:
            stages = repo.add(str(corpus))
            out = stages[0].outs[0]
            snap_id = out.hash_info.value
            meta = out.meta
            if push:
                repo.push(targets=[str(corpus)], remote=_REMOTE)
        except SnapshotError:
            raise
        except Exception as exc:
            raise SnapshotError(f"DVC snapshot of {corpus} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            repo.close()
        dvc_text = corpus.with_name(corpus.name + ".dvc").read_text()
    ref = SnapshotRef(
        id=snap_id,
        corpus=corpus.name,
        files=int(meta.nfiles or 0),
        bytes=int(meta.size or 0),
        dvc=dvc_text,
        remote=_public_remote(s.dvc_remote),
        path=str(corpus),
    )
    _record(ref, s)
    return ref


def _public_remote(url: str) -> str:
    """The remote URL as it may appear in lineage: never with embedded credentials."""
    return re.sub(r"//[^/@]+@", "//", url)


def list_snapshots() -> list[SnapshotRef]:
    s = kiln_settings.load()
    records = sorted(_records_dir(s).glob("*.json"), key=lambda p: p.stat().st_mtime)
    return [SnapshotRef.from_json(json.loads(p.read_text())) for p in records]


def show_snapshot(snapshot_id: str) -> SnapshotRef:
    if not SNAPSHOT_ID.match(snapshot_id):
        raise SnapshotError(f"{snapshot_id!r} is not a snapshot id (expected <32 hex md5>.dir)")
    s = kiln_settings.load()
    path = _records_dir(s) / f"{snapshot_id.removesuffix('.dir')}.json"
    if not path.is_file():
        raise SnapshotError(f"unknown snapshot id {snapshot_id} (see `kiln snapshot list`)")
    return SnapshotRef.from_json(json.loads(path.read_text()))


def restore_snapshot(ref_or_id: SnapshotRef | str, dest: str | Path) -> Path:
    """Restore exactly a snapshot's bytes into ``dest`` from the cache or, if missing, the remote.

    Works from the ``.dvc`` text alone: a scratch DVC repo with that file is pulled, DVC verifies
    every file's md5 against the ``.dir`` listing, and the result is moved into place only when
    complete, so ``dest`` is never half-written.
    """
    _env()
    ref = ref_or_id if isinstance(ref_or_id, SnapshotRef) else show_snapshot(ref_or_id)
    s = kiln_settings.load()
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise SnapshotError(f"restore target {dest} exists and is not empty")
    dest.parent.mkdir(parents=True, exist_ok=True)
    from dvc.repo import Repo

    scratch = Path(tempfile.mkdtemp(prefix=".restore-", dir=dest.parent))
    try:
        Repo.init(str(scratch), no_scm=True).close()
        _configure_repo(scratch, s)
        dvc_file = scratch / "data.dvc"
        dvc_file.write_text(_rename_out(ref.dvc, "data"))
        repo = Repo(str(scratch))
        try:
            repo.pull(targets=[str(dvc_file)], remote=_REMOTE)
        except Exception as exc:
            raise SnapshotError(f"cannot restore snapshot {ref.id}: {type(exc).__name__}: {exc}") from exc
        finally:
            repo.close()
        restored = scratch / "data"
        if not restored.is_dir():
            raise SnapshotError(f"DVC restored nothing for snapshot {ref.id}")
        if dest.exists():
            dest.rmdir()
        os.replace(restored, dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _rename_out(dvc_text: str, new_path: str) -> str:
    """Point the single ``outs`` entry of a ``.dvc`` file at ``new_path``."""
    return re.sub(r"(?m)^(\s*-?\s*path:\s*).*$", rf"\g<1>{new_path}", dvc_text, count=1)


def checkout_snapshot(snapshot_id: str) -> SnapshotRef:
    """An immutable local copy of a snapshot under ``<home>/snapshots/<md5>``; ``.path`` points there.

    Restored once (verified by DVC); later calls reuse it. Readers use this, never the workspace.
    """
    ref = show_snapshot(snapshot_id)
    s = kiln_settings.load()
    dest = s.home / "snapshots" / snapshot_id.removesuffix(".dir")
    marker = dest.with_name(dest.name + ".complete")
    if not marker.is_file():
        if dest.exists():
            shutil.rmtree(dest)
        restore_snapshot(ref, dest)
        marker.write_text(snapshot_id + "\n")
    return SnapshotRef(**{**ref.to_json(), "path": str(dest)})
