"""``kiln verify --dir DIR --policy production|sandbox``: check a signed model directory before use.

::

    kiln verify --dir ./champion-model --policy production

Verifies the directory's two signatures with the keys the policy trusts (``KILN_HOME/keys/<policy>/
trusted/``): ``provenance.dsse.json`` (kiln's provenance statement, a DSSE envelope) and ``model.sig``
(model-signing's bundle over every file), and that the statement's files are the directory's, byte
for byte (docs/provenance.md). On success prints the lineage the statement records, in words
(``--json``: the verified statement itself) and exits 0; on any mismatch exits 1 with one
``kiln verify: error:`` line naming what differs (which file changed, is missing or was added,
which signature, which key and policy).

Registry references (``MODEL@ALIAS``, ``MODEL/VERSION``) are not taken yet: this checks a local
directory (a downloaded or exported version's model folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="verify a signed model directory (signatures, provenance statement, every file's bytes) for a policy",
        description="Verify DIR's model.sig and provenance.dsse.json with the policy's trusted keys and that "
        "DIR's files are the ones signed; print the lineage.",
    )
    p.add_argument("--dir", required=True, type=Path, metavar="DIR", help="the model directory to verify")
    p.add_argument("--policy", required=True, choices=("production", "sandbox"), help="whose trusted keys to verify with")
    p.add_argument("--json", action="store_true", help="print the verified in-toto statement instead of words")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from kiln.provenance.statement import describe
    from kiln.provenance.verify import verify_artifact

    verified = verify_artifact(args.dir, args.policy)
    if args.json:
        print(json.dumps(verified.statement, indent=2, sort_keys=True))
        return 0
    print(f"{args.dir}: verified for policy {args.policy} (statement key {verified.statement_key_id}, "
          f"model.sig key {verified.model_sig_key_id})")
    for line in describe(verified.statement):
        print(f"  {line}")
    return 0
