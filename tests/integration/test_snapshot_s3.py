"""DVC snapshots on an S3 remote: a local ``moto_server`` stands in for S3 (same boto3/DVC code path).

The server runs on a free 127.0.0.1 port for this module and is killed after it. Credentials reach
DVC only through the standard ``AWS_*`` environment; the secret-scan test proves none of them lands
in the workspace, the SnapshotRef, the records or the logs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import pytest

from kiln import settings as kiln_settings
from kiln.data import snapshot
from kiln.errors import SnapshotError
from kiln.stack.mlflow_server import free_port

pytestmark = pytest.mark.slow

BUCKET = "kiln-snapshots"
ACCESS_KEY_ID = "AKIAKILNTESTONLY0001"


@pytest.fixture()
def s3_home(tmp_path, monkeypatch, moto_endpoint) -> dict[str, str]:
    """A fresh KILN_HOME whose remote is ``s3://<bucket>/<unique prefix>`` on the moto server."""
    import boto3

    secret = f"kiln-test-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var, raising=False)
    prefix = f"snapshots-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("KILN_DVC_REMOTE", f"s3://{BUCKET}/{prefix}")
    monkeypatch.setenv("KILN_DVC_REMOTE_ENDPOINT", moto_endpoint)
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    if BUCKET not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=BUCKET)
    return {"secret": secret, "prefix": prefix, "endpoint": moto_endpoint}


def _objects(endpoint: str, prefix: str) -> dict[str, str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return {o["Key"]: str(o["LastModified"]) for page in pages for o in page.get("Contents", [])}


def _corpus(name: str = "demo") -> Path:
    root = kiln_settings.load().corpus_root / name
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "eval").mkdir(exist_ok=True)
    for i in range(3):
        (root / "train" / f"shard-{i:05d}.parquet").write_bytes(f"s3 shard {i} ".encode() * 2000)
    (root / "eval" / "eval-00000.parquet").write_bytes(b"eval" * 100)
    return root


def _tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_create_push_to_s3_wipe_cache_restore_verified(s3_home):
    corpus = _corpus()
    ref = snapshot.create_snapshot(corpus)
    assert ref.remote == f"s3://{BUCKET}/{s3_home['prefix']}"
    objects = _objects(s3_home["endpoint"], s3_home["prefix"])
    md5 = ref.id.removesuffix(".dir")
    assert f"{s3_home['prefix']}/files/md5/{md5[:2]}/{md5[2:]}.dir" in objects
    assert len(objects) == 1 + ref.files  # the .dir listing and one object per file

    assert snapshot.create_snapshot(corpus).id == ref.id
    assert _objects(s3_home["endpoint"], s3_home["prefix"]) == objects, "re-snapshot uploaded something"

    shutil.rmtree(kiln_settings.load().dvc_cache)  # a machine that has only the remote
    restored = snapshot.restore_snapshot(ref.id, Path(os.environ["KILN_HOME"]) / "restored")
    assert _tree_hashes(restored) == _tree_hashes(corpus)


def test_credentials_land_nowhere(s3_home, caplog, capsys):
    """Through the CLI, as an operator runs it: create, list, show, restore; then scan every file
    under KILN_HOME (DVC workspace config, .dvc text, records, state db, cache), the SnapshotRef
    JSON, captured logs (DEBUG, boto included) and stdout/stderr for the secret and the key id."""
    from kiln.cli import main

    caplog.set_level(logging.DEBUG)
    corpus = _corpus()
    assert main(["snapshot", "create", str(corpus)]) == 0
    ref = json.loads(capsys.readouterr().out)
    assert main(["snapshot", "list"]) == 0
    assert main(["snapshot", "show", ref["id"]]) == 0
    shutil.rmtree(kiln_settings.load().dvc_cache)
    assert main(["snapshot", "restore", ref["id"], "--to", str(Path(os.environ["KILN_HOME"]) / "r")]) == 0
    out, err = capsys.readouterr()

    home = Path(os.environ["KILN_HOME"])
    workspace_config = [home / "dvc-repo" / ".dvc" / "config"]
    assert workspace_config[0].is_file() and f"endpointurl = {s3_home['endpoint']}" in workspace_config[0].read_text()
    scanned = {str(p): p.read_bytes() for p in home.rglob("*") if p.is_file()}
    assert any(p.endswith(".kiln-snapshots/" + ref["id"].removesuffix(".dir") + ".json") for p in scanned)
    scanned["SnapshotRef"] = json.dumps(ref).encode()
    scanned["stdout+stderr"] = (out + err).encode()
    info_logs = [r for r in caplog.records if r.levelno >= logging.INFO]
    scanned["logs at INFO and above"] = "\n".join(r.getMessage() for r in info_logs).encode()
    for needle in (s3_home["secret"], ACCESS_KEY_ID):
        leaks = [where for where, data in scanned.items() if needle.encode() in data]
        assert not leaks, f"{needle[:8]}... found in {leaks}"
    # botocore's own DEBUG lines show the signed Authorization header, which names the key id (never
    # the secret): the secret must be absent even there.
    debug_logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "Authorization" in debug_logs, "boto's DEBUG requests were not captured: the scan would prove nothing"
    assert s3_home["secret"] not in debug_logs
    assert any(r.name == "kiln.snapshot" for r in info_logs)


def test_unreachable_endpoint_keeps_only_what_is_on_the_remote(s3_home, monkeypatch):
    corpus = _corpus()
    good = snapshot.create_snapshot(corpus)
    (corpus / "train" / "shard-00001.parquet").write_bytes(b"this version never reaches the remote")
    monkeypatch.setenv("KILN_DVC_REMOTE_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nobody listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail in ~1 s instead of botocore's retries
    with pytest.raises(SnapshotError, match=r"failed at dvc push to s3://.*nothing was recorded: .*Could not connect"):
        snapshot.create_snapshot(corpus)
    assert corpus.with_name("demo.dvc").read_text() == good.dvc
    assert [r.id for r in snapshot.list_snapshots()] == [good.id]
    assert not (kiln_settings.load().dvc_repo / ".kiln-pending.json").exists()


def test_unreachable_endpoint_first_snapshot_leaves_no_dvc_file(s3_home, monkeypatch):
    monkeypatch.setenv("KILN_DVC_REMOTE_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    corpus = _corpus()
    with pytest.raises(SnapshotError, match="nothing was recorded"):
        snapshot.create_snapshot(corpus)
    assert not corpus.with_name("demo.dvc").exists()
    assert snapshot.list_snapshots() == []
