"""``kiln reproduce MODEL@ALIAS|MODEL/VERSION``: re-derive a registered version from its signed statement, or refuse.

::

    kiln reproduce kiln-stdlib-lm@champion                         # verify for production, then re-derive
    kiln reproduce kiln-stdlib-lm.candidates/7 --policy sandbox
    kiln reproduce kiln-stdlib-lm/3 --allow-code-drift             # report the code drift and go on
    kiln reproduce kiln-stdlib-lm/3 --workdir /scratch/r3 --json
    kiln reproduce kiln-stdlib-lm/3 --world-size 2 [--tolerance 1e-2]   # at another world size: within a bound

First verifies the version for the policy (as ``kiln verify``) and refuses one that does not verify;
then, from the signed statement alone plus the DVC remote, restores the snapshot, validates it against
the recorded contract, tokenizes, rebuilds the training manifest and trains with the recorded recipe,
seed, world size and strategy (kiln's local launcher), then evaluates the weights and exports their
Hugging Face folder as registration did, comparing each step's digest (the evaluation report field by
field, the folder file by file) with the recorded one (``kiln.provenance.reproduce``). The first that
differs stops it. Refused: a version that does not verify, a statement that lacks what a step needs
(named), or installed code other than the recorded code (unless ``--allow-code-drift``). The verdict
is recorded on the version (``kiln.reproduction.*`` tags) with a signed attestation (``--no-record``:
neither).

``--world-size N`` trains at ``N`` ranks instead of the recorded number. The steps before training must
still give the recorded digests; the weights cannot be bit-identical (the gradients sum in another
order), so the largest absolute difference from the registered weights is held to ``--tolerance``
(default ``kiln.provenance.reproduce.DEFAULT_TOLERANCE``): ``reproduced`` within tolerance at world size
``N``, or ``differs`` naming the tensor and both values. The global batch stays the recorded one; an
``N`` it cannot be split to (``data.global_batch_size`` not a multiple of ``N x data.micro_batch_size``)
is refused before anything is derived (exit 2).

Exit 0 reproduced, 1 differs or refused (the reason on stderr), 2 usage (a world size the recorded
global batch cannot be split to included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Literal

from kiln.cli.args import refuse_unusable_target
from kiln.errors import ConfigError
from kiln.provenance.reproduce import DEFAULT_TOLERANCE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reproduce",
        help="re-derive a registered version from its signed provenance statement (same sha256) or refuse",
        description="Verify a registered version, then re-derive it step by step from its signed provenance "
        "statement and the DVC remote (snapshot, contract, tokens, training manifest, training, evaluation, the "
        "Hugging Face folder) and compare "
        "each digest with the recorded one; the first that differs stops it.",
    )
    p.add_argument("ref", metavar="MODEL@ALIAS|MODEL/VERSION", help="a registered version")
    p.add_argument("--policy", choices=("production", "sandbox"),
                   help="whose trusted keys to verify the version with (default: the policy that owns the model, "
                        "else production)")
    p.add_argument("--allow-code-drift", action="store_true",
                   help="go on when the installed kiln code is not the recorded code (the drift is reported)")
    p.add_argument("--workdir", type=Path, metavar="DIR",
                   help="where to re-derive (absent or empty; default KILN_HOME/reproductions/...); kept")
    p.add_argument("--world-size", type=_positive_int, metavar="N",
                   help="re-derive at N ranks instead of the recorded world size: the weights are then held to the "
                        "registered ones within --tolerance, not by sha256 (N must split the recorded global batch)")
    p.add_argument("--tolerance", type=_bound, metavar="X",
                   help="with --world-size: the largest absolute weight difference that still reproduces (default "
                        f"{DEFAULT_TOLERANCE:g}, measured: docs/provenance.md)")
    p.add_argument("--no-record", action="store_true", help="do not tag the version nor sign an attestation")
    p.add_argument("--json", action="store_true", help="print the outcome as JSON")
    p.set_defaults(func=handler)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} ranks: must be >= 1")
    return value


def _bound(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number >= 0")
    return value


def resolve_request(ref: str, policy: str | None, *, world_size: int | None,
                    tolerance: float | None) -> tuple[str, Literal["alias", "version"], str, str]:
    """What ``kiln reproduce REF [--policy P] [--world-size N [--tolerance X]]`` asks for, checked before the
    registry is asked (the command and the ``kiln_reproduce`` DAG's first task): ``(model, "alias" or
    "version", name, policy)``, the policy defaulting to the one that owns the model, else production.
    ``ConfigError`` naming what is wrong: a reference that is neither form, a tolerance without a world size;
    ``PolicyError`` for an unknown policy."""
    from kiln.cli.verify import parse_version_ref
    from kiln.policy import get_policy, owning_policy

    model, kind, name = parse_version_ref(ref)
    if tolerance is not None and world_size is None:
        raise ConfigError("--tolerance bounds the weights' difference at another world size: give --world-size N "
                          "(at the recorded world size the weights' sha256 is compared)")
    if policy is not None:
        get_policy(policy)
    owner = owning_policy(model)
    return model, "alias" if kind == "alias" else "version", name, policy or (
        owner.name if owner is not None else "production")


def handler(args: argparse.Namespace) -> int:
    from kiln.provenance.reproduce import reproduce

    model, by, name, policy = resolve_request(args.ref, args.policy, world_size=args.world_size,
                                              tolerance=args.tolerance)
    if args.workdir is not None:
        refuse_unusable_target("--workdir", args.workdir, directory=True)
    outcome = reproduce(model, name, by=by, policy=policy,
                        allow_code_drift=args.allow_code_drift, workdir=args.workdir, record=not args.no_record,
                        world_size=args.world_size, tolerance=args.tolerance,
                        log=lambda line: print(f"[reproduce] {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(outcome.to_json(), indent=2, sort_keys=True))
    else:
        print("\n".join(outcome.in_words()))
    if outcome.verdict != "reproduced":
        print(f"kiln reproduce: error: {outcome.model} version {outcome.version} {outcome.verdict}: {outcome.reason}",
              file=sys.stderr)
        return 1
    return 0
