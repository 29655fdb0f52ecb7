"""``kiln snapshot create|restore|list|show``: immutable DVC snapshots of a corpus directory."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("snapshot", help="DVC snapshots: create, restore, list, show")
    ssub = p.add_subparsers(dest="snapshot_command", metavar="ACTION", required=True)
    c = ssub.add_parser("create", help="dvc add + push a corpus dir; prints a JSON SnapshotRef")
    c.add_argument("corpus_dir", help="corpus directory inside the DVC workspace (see `kiln corpus build`)")
    c.add_argument("--no-push", action="store_true", help="do not push to the remote")
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
    from kiln.snapshot import create_snapshot

    _print(create_snapshot(args.corpus_dir, push=not args.no_push).to_json())
    return 0


def _restore(args: argparse.Namespace) -> int:
    from kiln.snapshot import restore_snapshot

    _print({"id": args.snapshot_id, "restored_to": str(restore_snapshot(args.snapshot_id, args.dest))})
    return 0


def _list(args: argparse.Namespace) -> int:
    from kiln.snapshot import list_snapshots

    for ref in list_snapshots():
        print(f"{ref.id}  {ref.corpus:<16} files={ref.files:<5} bytes={ref.bytes}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from kiln.snapshot import show_snapshot

    _print(show_snapshot(args.snapshot_id).to_json())
    return 0
