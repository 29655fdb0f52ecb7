"""``kiln datasheet MODEL@ALIAS|MODEL/VERSION [--html]``: a registered version's datasheet, from its verified statement.

::

    kiln datasheet kiln-stdlib-lm@champion                    # Markdown on stdout
    kiln datasheet kiln-stdlib-lm.candidates/7 --html > ds.html

Verifies the version first, as ``kiln verify`` does, with the trusted keys of the policy that owns MODEL
(``--policy`` for a model no policy owns): a version that is unsigned, does not verify or whose tags
disagree with its statement gets no datasheet (exit 1, naming what differs). The datasheet is then made
from the verified statement (``kiln.provenance.datasheet``), with the sources registration logged beside
the run's datasheet (``datasheet/sources/``: the quarantine report and the contract suite, each used
only with the digest the statement signed, and the corpus' ``corpus.json``), and the version's review
and approval tags as they are now (not signed; the datasheet says so).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "datasheet",
        help="print a registered version's datasheet (data provenance and cleaning, training, evaluation, "
        "approval), made from its verified provenance statement",
        description="Verify a registered version for the policy that owns it, then print its datasheet "
        "(Markdown, or a self-contained HTML page with --html) made from the signed provenance statement.",
    )
    p.add_argument("ref", metavar="MODEL@ALIAS|MODEL/VERSION", help="a registered version")
    p.add_argument("--html", action="store_true", help="print the HTML page instead of Markdown")
    p.add_argument("--policy", choices=("production", "sandbox"),
                   help="whose trusted keys the version must verify with, for a model no policy owns "
                   "(default: the policy that owns MODEL)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.cli.verify import parse_version_ref
    from kiln.provenance.datasheet import approval_tags, build_datasheet, datasheet_html, datasheet_markdown
    from kiln.provenance.datasheet_sources import run_sources
    from kiln.registry import mlflow_io
    from kiln.registry.export import verifying_policy
    from kiln.registry.verify import VerifiedVersion, check_version

    model, kind, name = parse_version_ref(args.ref)
    policy = verifying_policy(model, args.policy).name

    def attempt() -> tuple[Any, VerifiedVersion]:
        mv = mlflow_io.version_by_ref(mlflow_io._client(), model, kind, name)
        return mv, check_version(mv, policy).require_verified()

    mv, verified = mlflow_io._with_retries(f"verifying {args.ref}", attempt)
    sources = run_sources(mv.run_id or "", verified.statement, model_version=f"{mv.name}/{mv.version}",
                          approval_tags=approval_tags(dict(mv.tags)))
    sheet = build_datasheet(verified.statement, sources)
    print(datasheet_html(sheet) if args.html else datasheet_markdown(sheet), end="")
    return 0
