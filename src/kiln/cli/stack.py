"""``kiln stack up|down|status``: the embedded stack (Airflow + MLflow) in the background."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="start/stop the embedded Airflow + MLflow stack under KILN_HOME")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for health (up)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln import stack

    if args.action == "up":
        stack.up(timeout=args.timeout)
    elif args.action == "down":
        stopped = stack.down()
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    else:
        print(json.dumps(stack.status(), indent=2))
    return 0
