"""``kiln conformance``: kiln's guarantees, run against the trainer a recipe names (``kiln.conformance``)::

    kiln conformance --recipe my_lm.toml --manifest M.json --work-dir /tmp/kit \\
        [--set section.key=value ...] [--only a,b,c,d,e] [--steps 6] [--every-steps 2] [--report report.json]

(``python -m kiln.conformance`` is the same command.) Each verdict is a line on stderr, ``(a) PASS``
or ``(a) FAIL ... : why``; stdout gets the report JSON. Exit 0 when every guarantee asked for holds,
1 when one does not, 2 for a bad argument (before any run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kiln.cli.args import positive_int, refuse_unusable_target


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("conformance", help="run kiln's guarantees against the trainer a recipe names")
    c.add_argument("--recipe", required=True, type=Path, help="recipe TOML naming the trainer (its `trainer` key)")
    c.add_argument("--manifest", required=True, type=Path,
                   help="a TrainingManifest kiln issued (e.g. a run's RUN/training_manifest.json)")
    c.add_argument("--work-dir", required=True, type=Path, help="an empty or new folder for the kit's runs")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe field for every run, e.g. a smaller model (repeatable)")
    c.add_argument("--only", default="a,b,c,d,e", metavar="LETTERS",
                   help="the guarantees to run, comma-separated: a (bitwise resume after SIGKILL mid-save), "
                        "b (resume at another world size), c (straggler flagged), d (bad manifest refused), "
                        "e (elastic shrink after a node is lost mid-training)")
    c.add_argument("--steps", type=positive_int, default=6, help="steps of every run (default 6)")
    c.add_argument("--every-steps", type=positive_int, default=2, help="checkpoint interval (default 2)")
    c.add_argument("--weights-atol", type=_nonnegative_float, default=1e-5,
                   help="(b), (e) largest |difference| of a final weight after the world size changed "
                        "(default 1e-5)")
    c.add_argument("--loss-rtol", type=_nonnegative_float, default=1e-5,
                   help="(b), (e) relative difference of the final loss allowed (default 1e-5)")
    c.add_argument("--report", type=Path, default=None, help="also write the report JSON here")
    c.set_defaults(func=_conformance)


def _conformance(args: argparse.Namespace) -> int:
    from kiln.cli.train import refuse_output_inside_corpora
    from kiln.conformance import KitSpec, run_kit
    from kiln.errors import ConfigError
    from kiln.util.fs import atomic_write_bytes

    if not args.recipe.is_file():
        raise ConfigError(f"--recipe {args.recipe}: no such file")
    if not args.manifest.is_file():
        raise ConfigError(f"--manifest {args.manifest}: no such file")
    refuse_unusable_target("--work-dir", args.work_dir, directory=True)
    refuse_output_inside_corpora("--work-dir", args.work_dir.resolve(), args.manifest.resolve())
    if args.report is not None:
        refuse_unusable_target("--report", args.report, directory=False)
    kit = KitSpec(recipe=args.recipe.resolve(), manifest=args.manifest.resolve(), work_dir=args.work_dir.resolve(),
                  overrides=tuple(args.overrides), steps=args.steps, every_steps=args.every_steps,
                  weights_atol=args.weights_atol, loss_rtol=args.loss_rtol,
                  guarantees=tuple(g.strip() for g in args.only.split(",") if g.strip()))
    report = run_kit(kit, log=lambda line: print(line, file=sys.stderr, flush=True))
    text = json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n"
    if args.report is not None:
        atomic_write_bytes(args.report, text.encode("utf-8"))
    print(text, end="")
    return 0 if report.passed else 1
