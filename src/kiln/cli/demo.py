"""``kiln demo``: build the sample corpus, start the stack, run the production DAG end to end;
``kiln demo --corpus NAME``: the sandbox DAG on another corpus (``prose``: built from text on the machine);
``kiln demo --mixture NAME``: the sandbox DAG on a data mixture (``training/mixtures/NAME.toml``)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the production DAG end to end on the embedded stack (what `make demo` runs)")
    p.add_argument("--corpus", default=None, metavar="NAME",
                   help="run the sandbox DAG on this corpus instead (one under the corpus root, or 'prose': "
                        "natural-language text found on this machine, built and imported first); "
                        "what `make demo CORPUS=NAME` runs")
    p.add_argument("--mixture", default=None, metavar="NAME",
                   help="run the sandbox DAG on a data mixture (training/mixtures/NAME.toml, e.g. code-and-prose: "
                        "its corpora built first where kiln can build them); what `make demo MIX=NAME` runs")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.stack.demo import run_demo

    return run_demo(args.corpus, args.mixture)
