"""The arguments kiln hands every rank of an entry point (docs/trainer-contract.md)::

    --manifest M.json --recipe R.toml --run-dir RUN [--set SECTION.KEY=VALUE ...] [--max-steps N] [--sample-log]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kiln_trainer.checkpoint_manifest import SAMPLE_LOG_SUBDIR

SAMPLE_LOG_ENV = "KILN_SAMPLE_LOG"


def argument_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The parser of an entry point's arguments (``prog`` and ``description`` are the entry point's)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--manifest", required=True, type=Path, help="TrainingManifest JSON")
    parser.add_argument("--recipe", required=True, type=Path, help="recipe TOML (training/recipes/*.toml)")
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory (checkpoints, metrics, result)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe field (repeatable)",
    )
    parser.add_argument("--max-steps", type=int, default=None, help="stop this invocation after this step")
    parser.add_argument(
        "--sample-log",
        action="store_true",
        default=os.environ.get(SAMPLE_LOG_ENV, "") not in ("", "0"),
        help=f"log the global sample ids each rank consumes per step under RUN/{SAMPLE_LOG_SUBDIR}/ (or {SAMPLE_LOG_ENV}=1)",
    )
    return parser
