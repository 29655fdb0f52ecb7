"""``kiln stack up|down|status``: the embedded stack (Airflow + MLflow) in the background."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="start/stop the embedded Airflow + MLflow stack under KILN_HOME")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for health (up)")
    p.add_argument("--profile", choices=("embedded", "prodlike"), default="embedded",
                   help="embedded (SQLite, LocalExecutor; default) or prodlike: PostgreSQL, Celery on Redis, "
                        "MLflow on PostgreSQL + S3 (moto) with basic-auth, FAB per-DAG permissions "
                        "(docs/production-stack.md)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.stack import embedded, prodlike

    backend = prodlike if getattr(args, "profile", "embedded") == "prodlike" else embedded  # same up/down/status
    if args.action == "up":
        backend.up(timeout=args.timeout)
    elif args.action == "down":
        stopped = backend.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    else:
        print(json.dumps(backend.status(), indent=2))
    return 0
