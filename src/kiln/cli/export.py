"""``kiln export MODEL@ALIAS --format hf --out DIR``: a registered version as a Hugging Face model folder.

::

    kiln export kiln-stdlib-lm@champion --format hf --out ./champion
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
               AutoModelForCausalLM.from_pretrained('./champion'); AutoTokenizer.from_pretrained('./champion')"

Writes the folder every registered version carries (``config.json``, ``model.safetensors``, the
tokenizer files, ``generation_config.json``; docs/registry.md) from the registry into ``DIR``, which
must be new or empty (exit 2 otherwise, before any request). The version verifies first, with the
trusted keys of the policy that owns MODEL (``--policy`` names one for a model no policy owns, and
may not name another): its whole model directory is downloaded beside ``DIR``, its signatures, every
file's bytes, its tags and logged model are checked against its signed provenance statement
(docs/provenance.md), and a version that is unsigned, does not verify or disagrees is refused
(exit 1, one line naming what differs) with nothing written. The folder then appears whole or not
at all (renamed out of the verified download onto ``DIR``). Prints a JSON reference (model, alias,
version, run, weights sha256, the policy and the keys it verified with, files) on stdout.
Read-only: any MLflow identity with READ may run it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ("hf",)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a registered model version as a Hugging Face model folder (transformers loads it)",
        description="Verify the version holding ALIAS in MODEL against its signed provenance statement, then "
        "write its Hugging Face model folder into DIR (new or empty), atomically.",
    )
    p.add_argument("ref", metavar="MODEL@ALIAS", help="registered model and alias, e.g. kiln-stdlib-lm@champion")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="hf: config.json, model.safetensors, tokenizer files, generation_config.json")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to create (or an empty one)")
    p.add_argument("--policy", choices=("production", "sandbox"),
                   help="whose trusted keys the version must verify with, for a model no policy owns "
                   "(default: the policy that owns MODEL)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.registry.export import export_hf_folder

    ref = export_hf_folder(args.ref, args.out, args.policy)
    print(json.dumps(ref, indent=2))
    return 0
