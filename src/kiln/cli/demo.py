"""``kiln demo``: build the sample corpus, start the stack, run the production DAG end to end."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the production DAG end to end on the embedded stack (what `make demo` runs)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.stack.demo import run_demo

    return run_demo()
