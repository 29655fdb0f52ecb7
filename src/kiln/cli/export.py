"""``kiln export MODEL@ALIAS --format hf --out DIR``: a registered version as a Hugging Face model folder.

::

    kiln export kiln-stdlib-lm@champion --format hf --out ./champion
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
               AutoModelForCausalLM.from_pretrained('./champion'); AutoTokenizer.from_pretrained('./champion')"

Writes the folder every registered version carries (``config.json``, ``model.safetensors``, the
tokenizer files, ``generation_config.json``; docs/registry.md) from the registry into ``DIR``, which
must be new or empty (exit 2 otherwise, before any request). The folder appears whole or not at all
(downloaded beside ``DIR``, then renamed onto it). Prints a JSON reference (model, alias, version,
run, weights sha256, files) on stdout. Read-only: any MLflow identity with READ may run it.
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
        description="Download the Hugging Face model folder of the version holding ALIAS in MODEL into DIR "
        "(new or empty), atomically.",
    )
    p.add_argument("ref", metavar="MODEL@ALIAS", help="registered model and alias, e.g. kiln-stdlib-lm@champion")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="hf: config.json, model.safetensors, tokenizer files, generation_config.json")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory to create (or an empty one)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.registry.export import export_hf_folder

    ref = export_hf_folder(args.ref, args.out)
    print(json.dumps(ref, indent=2))
    return 0
