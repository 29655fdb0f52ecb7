"""``kiln snapshot create|restore|list|show``: immutable DVC snapshots of a corpus directory.

``create --announce`` tells Airflow about the new bytes once they are on the remote: it posts an
event of the corpus Asset (``kiln.airflow.dagfactory.corpus_asset``) with ``extra={"snapshot_id": ...}``
through the REST API (``POST /api/v2/assets/events``), which starts the production DAG; that run
then refuses to train on any other bytes than the announced id.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.errors import ConfigError, KilnError

if TYPE_CHECKING:
    from kiln.stack.airflow_client import AirflowClient

AIRFLOW_USER_ENV = "KILN_AIRFLOW_USER"
AIRFLOW_PASSWORD_ENV = "KILN_AIRFLOW_PASSWORD"
DEFAULT_ANNOUNCER = "admin"
"""Embedded-stack user that announces (posting asset events needs Airflow's ``op`` role or above)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshot", help="DVC snapshots: create, restore, list, show")
    ssub = p.add_subparsers(dest="snapshot_command", metavar="ACTION", required=True)
    c = ssub.add_parser("create", help="dvc add + push a corpus dir; prints a JSON SnapshotRef")
    c.add_argument("corpus_dir", help="corpus directory inside the DVC workspace (see `kiln corpus build`)")
    c.add_argument("--name", help="corpus name for lineage and the corpus Asset (default: the directory's name)")
    push = c.add_mutually_exclusive_group()
    push.add_argument("--no-push", action="store_true",
                      help="only compute the id: nothing is pushed or recorded, the workspace is left as it was")
    push.add_argument("--announce", action="store_true",
                      help=f"after the push, post the corpus Asset event (extra.snapshot_id) to Airflow; login from "
                           f"${AIRFLOW_USER_ENV}/${AIRFLOW_PASSWORD_ENV}, else the embedded stack's {DEFAULT_ANNOUNCER!r}")
    c.set_defaults(func=_create)
    r = ssub.add_parser("restore", help="restore a snapshot's exact bytes into an empty directory")
    r.add_argument("snapshot_id", metavar="ID", help="<md5>.dir")
    r.add_argument("--to", required=True, dest="dest", help="target directory (must be empty or absent)")
    r.set_defaults(func=_restore)
    ls = ssub.add_parser("list", help="list recorded snapshots")
    ls.set_defaults(func=_list)
    sh = ssub.add_parser("show", help="print one snapshot's JSON SnapshotRef")
    sh.add_argument("snapshot_id", metavar="ID")
    sh.set_defaults(func=_show)


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def _create(args: argparse.Namespace) -> int:
    from kiln.data.snapshot import create_snapshot

    ref = create_snapshot(args.corpus_dir, push=not args.no_push, name=args.name).to_json()
    if not args.announce:
        _print(ref)
        return 0
    try:
        announced = announce_snapshot(airflow_client(), ref)
    except KilnError as exc:
        _print(ref)  # the snapshot itself exists and is on the remote
        raise KilnError(
            f"snapshot {ref['id']} was created and pushed, but announcing it failed: {exc} "
            "(re-running `kiln snapshot create --announce` gives the same id and uploads nothing)"
        ) from exc
    _print({**ref, "announced": announced})
    return 0


# ------------------------------------------------------------------------------------- announcing
def airflow_client() -> AirflowClient:
    """A REST client for the configured Airflow: login from the environment or the embedded stack."""
    from kiln import settings as kiln_settings
    from kiln.stack import embedded
    from kiln.stack.airflow_client import AirflowClient

    s = kiln_settings.load()
    user = os.environ.get(AIRFLOW_USER_ENV) or DEFAULT_ANNOUNCER
    password = os.environ.get(AIRFLOW_PASSWORD_ENV)
    if not password:
        if not (embedded.airflow_home(s) / "passwords.json").is_file():
            raise ConfigError(
                f"no Airflow login: set {AIRFLOW_USER_ENV} and {AIRFLOW_PASSWORD_ENV}, "
                "or start the embedded stack (`kiln stack up`)"
            )
        password = embedded.passwords(s).get(user)
        if not password:
            raise ConfigError(f"the embedded stack has no Airflow user {user!r}; set {AIRFLOW_PASSWORD_ENV}")
    return AirflowClient(s.airflow_url, user, password)


def asset_event_body(asset_id: int, ref: dict[str, Any]) -> dict[str, Any]:
    """Body of ``POST /api/v2/assets/events`` announcing a snapshot (the consumer reads ``extra.snapshot_id``)."""
    return {"asset_id": int(asset_id), "extra": {"snapshot_id": ref["id"], "corpus": ref["corpus"]}}


def find_asset_id(client: AirflowClient, name: str, uri: str) -> int:
    """Airflow's id of the asset with exactly this name and uri (``name_pattern`` is a substring search)."""
    from kiln.errors import AirflowAPIError

    found = client.request("GET", "/assets", params={"name_pattern": name, "limit": 100})
    # Airflow normalises the uri (``kiln-corpus://x`` is stored as ``kiln-corpus://x/``).
    matches = [a for a in found.get("assets", [])
               if a.get("name") == name and str(a.get("uri", "")).rstrip("/") == uri.rstrip("/")]
    if not matches:
        raise AirflowAPIError(
            f"Airflow knows no asset {name!r} ({uri}); it exists once a DAG that uses it (the production "
            "DAG, scheduled on it) has been parsed"
        )
    return int(matches[0]["id"])


def announce_snapshot(client: AirflowClient, ref: dict[str, Any]) -> dict[str, Any]:
    """Post the corpus Asset event for a pushed snapshot; returns what was announced."""
    from kiln.airflow.dagfactory import corpus_asset

    asset = corpus_asset(ref["corpus"])
    asset_id = find_asset_id(client, asset.name, asset.uri)
    event = client.request("POST", "/assets/events", json=asset_event_body(asset_id, ref), ok=(200, 201)) or {}
    return {"asset": asset.name, "uri": asset.uri, "asset_id": asset_id, "event_id": event.get("id"),
            "timestamp": event.get("timestamp")}


# --------------------------------------------------------------------------------- other actions
def _restore(args: argparse.Namespace) -> int:
    from kiln.data.snapshot import restore_snapshot, restore_target_problem

    problem = restore_target_problem(Path(args.dest).resolve())
    if problem:  # the user's argument, found before any download: a usage error
        raise ConfigError(f"--to {args.dest}: {problem}")
    _print({"id": args.snapshot_id, "restored_to": str(restore_snapshot(args.snapshot_id, args.dest))})
    return 0


def _list(args: argparse.Namespace) -> int:
    from kiln.data.snapshot import snapshot_records

    refs, skipped = snapshot_records()
    for ref in refs:
        print(f"{ref.id}  {ref.corpus:<16} files={ref.files:<5} bytes={ref.bytes}")
    for line in skipped:  # one corrupt record hides none of the others
        print(f"kiln snapshot list: skipped {line}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    from kiln.data.snapshot import show_snapshot

    _print(show_snapshot(args.snapshot_id).to_json())
    return 0
