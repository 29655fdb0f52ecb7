"""Dataset snapshots with DVC: immutable ids, a remote, and restore from the remote alone.

A snapshot is ``dvc add`` of a corpus directory inside kiln's DVC workspace followed by
``dvc push``. Its id is DVC's directory hash (``<md5>.dir``), so the same bytes always give the same
id and pushing them again uploads nothing. Every snapshot is also recorded as a JSON SnapshotRef
(with the full ``.dvc`` text) under ``<workspace>/.kiln-snapshots/``, which is what ``list``/``show``
read and what ``restore`` needs: with the ``.dvc`` text and the remote, the bytes come back on a
machine with an empty cache.

The remote is configured in one place (``kiln.settings``: ``KILN_DVC_REMOTE`` — a local directory or
``s3://bucket/prefix`` — and ``KILN_DVC_REMOTE_ENDPOINT``). Credentials never pass through kiln:
DVC's S3 client (boto) reads the standard ``AWS_*`` environment / AWS config files, or DVC's global
config outside the workspace; a remote URL with credentials in it is refused.

Nothing partial is ever recorded. The corpus is checked before DVC sees it (regular files only, all
readable, no symlinks, not empty); the workspace's previous ``.dvc`` text is journalled before
``dvc add`` and put back if the add or the push fails (or, after a crash, by the next writer), and
the SnapshotRef record is written only after the push succeeded. So a ``.dvc`` file or record in the
workspace always names data that is on the remote.

Incremental: DVC's state db (``Settings.dvc_site_cache``) maps ``(inode, mtime, size)`` to md5, so a
re-snapshot after one shard changed reads and hashes only that shard, and pushes only its object and
the new ``.dir`` listing.

One writer at a time: every operation on the workspace holds an exclusive ``flock`` on
``<workspace>/.kiln.lock`` (DVC's own lock fails after ~3 s instead of waiting); this holds across
threads and processes (two Airflow task processes).

Validation and training never read the workspace (a later ``corpus build`` may change it); they read
``checkout_snapshot(id).path``: an immutable, hash-verified copy under ``<home>/snapshots/<md5>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kiln import settings as kiln_settings
from kiln.errors import ManifestError, SnapshotError
from kiln.refs import SnapshotRef
from kiln.util.fs import atomic_write_text, exclusive_lock, load_json, os_error_text, parse_json, unusable_target_reason

SNAPSHOT_ID = re.compile(r"^[0-9a-f]{32}\.dir$")
_REMOTE = "kiln"
_PENDING = ".kiln-pending.json"
"""Journal of the one in-flight create: the ``.dvc`` file it may rewrite and that file's previous text."""

log = logging.getLogger("kiln.snapshot")


def _env() -> None:
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    # DVC's library logger prints progress notes ("Initialized DVC repository.") on stdout, which
    # is where kiln's commands print their JSON references. Warnings and errors still show.
    # (Importing dvc.repo configures that logger, so quieten it after the import.)
    import dvc.repo  # noqa: F401

    logging.getLogger("dvc").setLevel(logging.WARNING)


def workspace_lock(workspace: Path) -> contextlib.AbstractContextManager[None]:
    """Exclusive lock over the DVC workspace, waiting (not failing) for another writer."""
    return exclusive_lock(workspace / ".kiln.lock")


def _remote_section(s: kiln_settings.Settings) -> dict[str, str]:
    """The DVC remote config kiln writes: URL and endpoint only, never credentials."""
    url = s.dvc_remote
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/]*@", url):
        raise SnapshotError(
            "KILN_DVC_REMOTE must not carry credentials (user:secret@...); DVC reads them from the "
            "AWS_* environment, AWS config files or DVC's global config"
        )
    section = {"url": url}
    if s.dvc_remote_endpoint:
        section["endpointurl"] = s.dvc_remote_endpoint
    return section


WORKSPACE_LINKS = "hardlink,copy"
"""How ``dvc add`` puts workspace files into the cache: a hardlink (no second copy of the corpus on
disk and none of the time to write it; DVC links only when ``hardlink`` comes first, and then
still prefers a reflink where the filesystem has them), else a copy (cache on another filesystem).
DVC makes linked files read-only; a shard that is nevertheless rewritten in place (root
ignores the mode) changes the cache object too — never the remote, which always gets its own copy
(``dvc push`` copies), and ``restore_snapshot`` evicts such an object and fetches it again."""
RESTORE_LINKS = "reflink,copy"
"""Restored snapshots never share an inode with the cache: readers get bytes nobody else writes."""


def _configure_repo(root: Path, s: kiln_settings.Settings, links: str = WORKSPACE_LINKS) -> None:
    """Point a DVC repo at kiln's shared cache and the configured remote (idempotent)."""
    from dvc.repo import Repo

    wanted = _remote_section(s)
    repo = Repo(str(root))
    try:
        current = repo.config.load_one("repo")
        if (
            current.get("core", {}).get("remote") == _REMOTE
            and current.get("cache", {}).get("dir") == str(s.dvc_cache)
            and current.get("core", {}).get("site_cache_dir") == str(s.dvc_site_cache)
            and dict(current.get("remote", {}).get(_REMOTE, {})) == wanted
            and str(current.get("core", {}).get("checksum_jobs")) == str(s.dvc_hash_jobs)
            and current.get("cache", {}).get("type") == links
        ):
            return  # unchanged: do not rewrite the config on every snapshot
        with repo.config.edit() as conf:
            conf["core"]["remote"] = _REMOTE
            conf["core"]["analytics"] = False
            conf["core"]["site_cache_dir"] = str(s.dvc_site_cache)
            conf["core"]["checksum_jobs"] = s.dvc_hash_jobs
            conf["cache"]["dir"] = str(s.dvc_cache)
            conf["cache"]["type"] = links
            conf["remote"][_REMOTE] = dict(wanted)  # replaced whole: a dropped endpoint goes too
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
        if "://" not in s.dvc_remote:
            try:
                Path(s.dvc_remote).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SnapshotError(f"local DVC remote {s.dvc_remote} is not usable: {exc.strerror or exc}") from exc
    return root


def _records_dir(s: kiln_settings.Settings) -> Path:
    return s.dvc_repo / ".kiln-snapshots"


def _record(ref: SnapshotRef, s: kiln_settings.Settings) -> None:
    path = _records_dir(s) / f"{ref.id.removesuffix('.dir')}.json"
    atomic_write_text(path, json.dumps(ref.to_json(), indent=2, sort_keys=True) + "\n")


def check_corpus(corpus: Path) -> tuple[int, int]:
    """Refuse a corpus DVC would snapshot wrongly or hang on; returns ``(files, bytes)``.

    Only directories and readable regular files: a symlink could pull in bytes from outside the
    corpus (or dangle), a FIFO would block ``dvc add`` forever, and an unreadable file would fail
    half-way through. Opening each file (no read, so cheap and atime-neutral) is the readability
    test that also holds for root, for whom permission bits say nothing.
    """
    if not corpus.exists():
        raise SnapshotError(f"corpus directory {corpus} does not exist")
    if not corpus.is_dir():
        raise SnapshotError(f"corpus path {corpus} is not a directory")
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(corpus, onerror=_walk_error):
        for name in sorted(dirnames) + sorted(filenames):
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(path)
                resolved = path.resolve()
                if not resolved.exists():
                    raise SnapshotError(f"{path} is a dangling symlink (-> {target}); a snapshot holds regular files only")
                if resolved != corpus and corpus not in resolved.parents:
                    raise SnapshotError(f"{path} is a symlink pointing outside the corpus (-> {resolved})")
                raise SnapshotError(f"{path} is a symlink (-> {target}); a snapshot holds regular files only")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise SnapshotError(f"{path} is a {_kind(st.st_mode)}, not a regular file; a snapshot holds regular files only")
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW))
            except OSError as exc:
                raise SnapshotError(f"cannot read {path}: {exc.strerror or exc}") from exc
            files += 1
            size += st.st_size
    if files == 0:
        raise SnapshotError(f"corpus directory {corpus} is empty: nothing to snapshot")
    return files, size


def _walk_error(exc: OSError) -> None:
    raise SnapshotError(f"cannot list {exc.filename}: {exc.strerror or exc}") from exc


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _begin(root: Path, dvc_file: Path) -> None:
    """Journal ``dvc_file``'s current text before DVC may rewrite it."""
    previous = dvc_file.read_text() if dvc_file.is_file() else None
    atomic_write_text(root / _PENDING, json.dumps({"dvc_file": str(dvc_file), "previous": previous}))


def _rollback(root: Path) -> None:
    """Put back the ``.dvc`` text journalled by an unfinished create (failed, or crashed)."""
    journal = root / _PENDING
    if not journal.is_file():
        return
    entry = load_json(journal, "snapshot journal", SnapshotError, max_bytes=MAX_RECORD_BYTES)
    dvc_file = Path(entry["dvc_file"])
    if entry["previous"] is None:
        dvc_file.unlink(missing_ok=True)
    else:
        atomic_write_text(dvc_file, entry["previous"])
    journal.unlink()


def _commit(root: Path) -> None:
    (root / _PENDING).unlink(missing_ok=True)


CORPUS_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def create_snapshot(corpus_dir: str | Path, *, push: bool = True, name: str | None = None) -> SnapshotRef:
    """``dvc add`` + ``dvc push`` a corpus directory that lives inside the DVC workspace.

    ``name`` is the corpus name lineage and the corpus Asset use (default: the directory's name).
    With ``push=False`` it only computes the id (the objects land in the local cache): nothing is
    recorded, the workspace's ``.dvc`` file is left as it was and ``remote`` is ``""``.
    Raises SnapshotError naming the problem; on any failure nothing is recorded.
    """
    _env()
    s = kiln_settings.load()
    root = s.dvc_repo
    corpus = Path(corpus_dir).absolute()
    corpus_name = name or corpus.resolve().name
    if not CORPUS_NAME.fullmatch(corpus_name):
        raise SnapshotError(f"corpus name {corpus_name!r} is not valid ([a-z0-9][a-z0-9_.-]*, at most 64 characters)")
    if root.resolve() not in corpus.resolve().parents:
        raise SnapshotError(f"corpus directory {corpus} is not inside the DVC workspace {root}")
    check_corpus(corpus)  # fail before anything is created; checked again under the lock
    corpus = corpus.resolve()
    ensure_workspace(s)
    dvc_file = corpus.with_name(corpus.name + ".dvc")
    from dvc.repo import Repo

    with workspace_lock(root):
        _rollback(root)  # a create that crashed between add and push
        files, size = check_corpus(corpus)
        _begin(root, dvc_file)
        step = "dvc add"
        try:
            repo = Repo(str(root))
            try:
                stages = repo.add(str(corpus))
                out = stages[0].outs[0]
                snap_id, meta = out.hash_info.value, out.meta
                if push:
                    step = f"dvc push to {_public_remote(s.dvc_remote)}"
                    with _no_upload_leftovers(s):
                        repo.push(targets=[str(corpus)], remote=_REMOTE)
            finally:
                repo.close()
            dvc_text = dvc_file.read_text()
            ref = SnapshotRef(
                id=snap_id,
                corpus=corpus_name,
                files=int(meta.nfiles or files),
                bytes=int(meta.size or size),
                dvc=dvc_text,
                remote=_public_remote(s.dvc_remote) if push else "",
                path=str(corpus),
            )
            if push:
                _record(ref, s)
                _commit(root)
            else:
                _rollback(root)
        except BaseException as exc:  # also a task killed mid-push (SIGTERM -> exception)
            _rollback(root)
            if isinstance(exc, SnapshotError) or not isinstance(exc, Exception):
                raise
            raise SnapshotError(
                f"DVC snapshot of {corpus} failed at {step}; nothing was recorded: {type(exc).__name__}: {exc}"
            ) from exc
    log.info("snapshot %s of %s: %d files, %d bytes%s", ref.id, corpus, ref.files, ref.bytes,
             f", pushed to {ref.remote}" if push else " (not pushed, not recorded)")
    return ref


UPLOAD_LEFTOVER_AGE_S = 600.0
"""A ``.tmp`` upload on a local remote untouched for this long belongs to no running push."""


def _upload_leftovers(remote: Path) -> dict[Path, float]:
    """DVC's partial uploads on a local directory remote (``files/md5/xx/.<token>.tmp``: it copies
    each object to a temporary name and renames it; a push that fails or is killed leaves the temporary)
    with their modification times."""
    found = {}
    for path in (remote / "files").glob("*/*/.*.tmp"):
        with contextlib.suppress(OSError):
            found[path] = path.stat().st_mtime
    return found


@contextlib.contextmanager
def _no_upload_leftovers(s: kiln_settings.Settings) -> Iterator[None]:
    """Around a push to a local directory remote: remove the partial uploads of pushes killed long
    ago, and those of this push if it fails. They are never read as objects (DVC only ever looks up
    an object by its final name, which a rename gives it whole), only space lost; removing one
    that a concurrent push is still writing makes that push fail and retry, never an object wrong.
    S3 has no such leftovers: an object appears whole or not at all."""
    if "://" in s.dvc_remote:
        yield
        return
    remote = Path(s.dvc_remote)
    before = _upload_leftovers(remote)
    cutoff = time.time() - UPLOAD_LEFTOVER_AGE_S
    for path, mtime in before.items():
        if mtime < cutoff:
            path.unlink(missing_ok=True)
    try:
        yield
    except BaseException:
        for path in _upload_leftovers(remote).keys() - before.keys():
            path.unlink(missing_ok=True)
        raise


def _public_remote(url: str) -> str:
    """The remote URL as it may appear in lineage: never with embedded credentials."""
    return re.sub(r"//[^/@]+@", "//", url)


MAX_RECORD_BYTES = 16 << 20
"""A snapshot record holds one ``.dvc`` text and a few names: kilobytes, never this many bytes."""


def read_snapshot_record(path: Path) -> SnapshotRef:
    """The SnapshotRef recorded at ``path``, or ``SnapshotError`` naming the file and what is wrong
    (unreadable, not bounded JSON, a field missing or of the wrong type, an id that is not its name)."""
    data = load_json(path, "snapshot record", SnapshotError, max_bytes=MAX_RECORD_BYTES)
    try:
        ref = SnapshotRef.from_json(data)
    except ManifestError as exc:
        raise SnapshotError(f"{path}: not a snapshot record: {exc}") from None
    for name, kind in (("id", str), ("corpus", str), ("files", int), ("bytes", int), ("dvc", str), ("remote", str),
                       ("path", str)):
        value = getattr(ref, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise SnapshotError(f"{path}: not a snapshot record: field {name!r} is not a {kind.__name__}")
    if not SNAPSHOT_ID.fullmatch(ref.id) or path.name != f"{ref.id.removesuffix('.dir')}.json":
        raise SnapshotError(f"{path}: not a snapshot record: its id {ref.id!r} is not the one its name says")
    return ref


def snapshot_records() -> tuple[list[SnapshotRef], list[str]]:
    """Every recorded snapshot, oldest first, and one line for each record that could not be read
    (skipped, named: one corrupt record does not hide the others)."""
    s = kiln_settings.load()
    found: list[tuple[float, SnapshotRef]] = []
    skipped: list[str] = []
    for path in sorted(_records_dir(s).glob("*.json")):
        try:
            found.append((path.lstat().st_mtime, read_snapshot_record(path)))
        except FileNotFoundError:
            continue  # removed while listing
        except (SnapshotError, OSError) as exc:
            skipped.append(str(exc) if isinstance(exc, SnapshotError) else f"{path}: {os_error_text(exc)}")
    found.sort(key=lambda pair: pair[0])
    return [ref for _, ref in found], skipped


def list_snapshots() -> list[SnapshotRef]:
    """``snapshot_records``' snapshots; each skipped record is logged as a warning."""
    refs, skipped = snapshot_records()
    for line in skipped:
        log.warning("skipped a snapshot record: %s", line)
    return refs


def show_snapshot(snapshot_id: str) -> SnapshotRef:
    if not SNAPSHOT_ID.fullmatch(snapshot_id):
        raise SnapshotError(f"{snapshot_id!r} is not a snapshot id (expected <32 hex md5>.dir)")
    s = kiln_settings.load()
    path = _records_dir(s) / f"{snapshot_id.removesuffix('.dir')}.json"
    if not path.is_file():
        raise SnapshotError(f"unknown snapshot id {snapshot_id} (see `kiln snapshot list`)")
    return read_snapshot_record(path)


def restore_snapshot(ref_or_id: SnapshotRef | str, dest: str | Path, *,
                     settings: kiln_settings.Settings | None = None) -> Path:
    """Restore exactly a snapshot's bytes into ``dest`` from the cache or, if missing, the remote.

    Works from the ``.dvc`` text alone: a scratch DVC repo with that file is pulled, every file's
    md5 is checked against the snapshot's ``.dir`` listing (DVC itself does not re-hash what it
    downloads or checks out), and the result is moved into place only when complete and verified,
    so ``dest`` is never half-written or wrong. Cache objects that fail the check (bit rot, or a
    hardlinked shard rewritten in place) are evicted and fetched once more from the remote; only
    when the remote's bytes are wrong too does the restore fail.

    ``settings``: the stack's by default; another cache (``Settings.dvc_cache``) makes the restore fetch
    every object from the remote afresh (``kiln reproduce``).
    """
    _env()
    ref = ref_or_id if isinstance(ref_or_id, SnapshotRef) else show_snapshot(ref_or_id)
    s = settings or kiln_settings.load()
    dest = Path(dest).resolve()
    problem = restore_target_problem(dest) or _space_problem(dest.parent, ref.bytes)
    if problem:
        raise SnapshotError(f"cannot restore snapshot {ref.id} into {dest}: {problem}; nothing was restored")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        return _restore_verified(ref, dest, s)
    except OSError as exc:  # a full or read-only disk mid-restore: the scratch copy is already gone
        raise SnapshotError(f"cannot restore snapshot {ref.id} into {dest}: {os_error_text(exc)}; "
                            "nothing was restored") from exc


def restore_target_problem(dest: Path) -> str | None:
    """Why ``dest`` cannot receive a restore (not an empty or absent directory, or no way to write
    the scratch copy beside it and rename it into place), or None."""
    if dest.is_dir() and any(dest.iterdir()):
        return "it exists and is not empty"
    return unusable_target_reason(dest, directory=True) or unusable_target_reason(dest.parent, directory=True)


def _space_problem(where: Path, needed: int) -> str | None:
    """"No space left on device" (and the numbers) when ``where``'s file system has less than
    ``needed`` bytes free (``where`` or its nearest existing ancestor), else None."""
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed:
        return f"No space left on device: {where} has {free} bytes free, the snapshot needs {needed}"
    return None


def _restore_verified(ref: SnapshotRef, dest: Path, s: kiln_settings.Settings) -> Path:
    """Pull into a scratch folder beside ``dest``, verify every file, rename it into place."""
    for attempt in (1, 2):
        scratch = Path(tempfile.mkdtemp(prefix=".restore-", dir=dest.parent))
        try:
            restored = _pull_into(scratch, ref, s, dest)
            problems, bad_objects, differing = _verify_restored(restored, ref.id, s)
            if not problems:
                if dest.exists():
                    dest.rmdir()
                os.replace(restored, dest)
                return dest
            if attempt == 1 and bad_objects:
                log.warning("snapshot %s: %d cache object(s) do not match their hashes (%s); evicting them "
                            "and fetching again from the remote", ref.id, len(bad_objects), "; ".join(problems[:3]))
                _evict(s, bad_objects)
                continue
            raise SnapshotError(
                f"restored bytes of snapshot {ref.id} do not match its hashes ({len(problems)} file(s): "
                f"{'; '.join(problems[:5])}); "
                + "".join(f"{rel}: listed md5 {listed}, restored {got}; " for rel, listed, got in differing[:5])
                + f"the objects on the remote {_public_remote(s.dvc_remote)} are corrupted or missing — the "
                "snapshot cannot be restored from it"
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    raise AssertionError("unreachable")  # pragma: no cover


def _pull_into(scratch: Path, ref: SnapshotRef, s: kiln_settings.Settings, dest: Path) -> Path:
    """``dvc pull`` the snapshot into ``scratch/data`` (beside ``dest``) through a throwaway repo on
    kiln's cache."""
    from dvc.repo import Repo

    site_cache: str | None = None
    try:
        Repo.init(str(scratch), no_scm=True).close()
        _configure_repo(scratch, s, links=RESTORE_LINKS)
        dvc_file = scratch / "data.dvc"
        dvc_file.write_text(_rename_out(ref.dvc, "data"))
        repo = Repo(str(scratch))
        try:
            site_cache = repo.site_cache_dir  # this throwaway repo's index: removed below
            repo.pull(targets=[str(dvc_file)], remote=_REMOTE)
        except Exception as exc:
            # DVC logs a failed copy's cause at debug level only ("Checkout failed ... Is your cache
            # up to date?"): say what it was when the disk is why, and keep it to one line.
            written = sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file())
            cause = (_space_problem(scratch.parent, ref.bytes - written)
                     or f"{type(exc).__name__}: {' '.join(str(exc).split())}")
            raise SnapshotError(f"cannot restore snapshot {ref.id} into {dest}: {cause}; nothing was restored") from exc
        finally:
            repo.close()
    finally:
        if site_cache:
            shutil.rmtree(site_cache, ignore_errors=True)
    restored = scratch / "data"
    if not restored.is_dir():
        raise SnapshotError(f"DVC restored nothing for snapshot {ref.id}")
    return restored


def _cache_object(s: kiln_settings.Settings, md5: str) -> Path:
    return s.dvc_cache / "files" / "md5" / md5[:2] / md5[2:]


def _evict(s: kiln_settings.Settings, md5s: set[str]) -> None:
    """Remove cache objects (only the cache's name: a hardlinked workspace file keeps its bytes)."""
    for md5 in md5s:
        _cache_object(s, md5).unlink(missing_ok=True)


def _verify_restored(tree: Path, snapshot_id: str,
                     s: kiln_settings.Settings) -> tuple[list[str], set[str], list[tuple[str, str, str]]]:
    """Every file under ``tree`` has the md5 the snapshot's ``.dir`` listing names, and no file is
    missing or extra; the listing itself must hash to the id. Returns the problems, the cache
    objects (md5s, listing included) that caused them, and each file whose bytes differ as
    ``(path, listed md5, restored md5)``."""
    md5 = snapshot_id.removesuffix(".dir")
    listing = _cache_object(s, md5 + ".dir")
    try:
        raw = listing.read_bytes()
    except OSError:
        return [f"its .dir listing {listing} is missing after the pull"], {md5 + ".dir"}, []
    got = hashlib.md5(raw, usedforsecurity=False).hexdigest()
    if got != md5:
        return ([f"its .dir listing {listing} is corrupted (md5 differs from the id)"], {md5 + ".dir"},
                [(".dir listing", md5, got)])
    try:
        expected = {entry["relpath"]: entry["md5"] for entry in parse_json(raw, str(listing), SnapshotError)}
    except (TypeError, KeyError):
        return [f"its .dir listing {listing} is not a DVC listing (relpath and md5 of each file)"], {md5 + ".dir"}, []
    except SnapshotError as exc:
        return [str(exc)], {md5 + ".dir"}, []
    found = {p.relative_to(tree).as_posix(): p for p in tree.rglob("*") if not p.is_dir()}
    problems = [f"{rel}: missing" for rel in sorted(expected.keys() - found.keys())]
    problems += [f"{rel}: not in the snapshot" for rel in sorted(found.keys() - expected.keys())]
    bad = {expected[rel] for rel in sorted(expected.keys() - found.keys())}
    differing = []
    for rel in sorted(expected.keys() & found.keys()):
        with open(found[rel], "rb") as fh:
            digest = hashlib.file_digest(fh, "md5").hexdigest()
        if digest != expected[rel]:
            problems.append(f"{rel}: md5 differs")
            bad.add(expected[rel])
            differing.append((rel, expected[rel], digest))
    return problems, bad, differing


def _rename_out(dvc_text: str, new_path: str) -> str:
    """Point the single ``outs`` entry of a ``.dvc`` file at ``new_path``."""
    return re.sub(r"(?m)^(\s*-?\s*path:\s*).*$", rf"\g<1>{new_path}", dvc_text, count=1)


def checkout_snapshot(snapshot_id: str) -> SnapshotRef:
    """An immutable local copy of a snapshot under ``<home>/snapshots/<md5>``; ``.path`` points there.

    Restored once (every file checked against the id's md5 listing); later calls reuse it. Readers
    use this, never the workspace.
    """
    ref = show_snapshot(snapshot_id)
    s = kiln_settings.load()
    dest = s.home / "snapshots" / snapshot_id.removesuffix(".dir")
    marker = dest.with_name(dest.name + ".complete")
    if not marker.is_file():
        # Two runs pinning the same snapshot at once: the second waits, then finds the marker
        # (without the lock it would delete the first one's copy while that run reads it).
        with exclusive_lock(dest.with_name(dest.name + ".lock")):
            if not marker.is_file():
                if dest.exists():
                    shutil.rmtree(dest)
                restore_snapshot(ref, dest)
                atomic_write_text(marker, snapshot_id + "\n")
    return SnapshotRef(**{**ref.to_json(), "path": str(dest)})
