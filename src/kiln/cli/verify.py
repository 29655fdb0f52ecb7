"""``kiln verify MODEL@ALIAS|MODEL/VERSION`` or ``kiln verify --dir DIR``: check a signed model before use.

::

    kiln verify kiln-stdlib-lm@champion                      # a registered version, by alias
    kiln verify kiln-stdlib-lm.candidates/7 --policy sandbox # by version, with sandbox's keys
    kiln verify --dir ./champion-model --policy production   # a local model directory

Verifies the model directory's two signatures with the keys the policy trusts (``KILN_HOME/keys/<policy>/
trusted/``): ``provenance.dsse.json`` (kiln's provenance statement, a DSSE envelope) and ``model.sig``
(model-signing's bundle over every file), and that the statement's files are the directory's, byte
for byte (docs/provenance.md). For a registry reference it first downloads the version's whole model
directory, and afterwards compares the version's tags and logged model with the signed statement
(``kiln.registry.verify``): an edited tag, or the files and statement of another version, are named.
On success prints the lineage the statement records, in words (``--json``: the verified statement
itself) and exits 0; on any mismatch exits 1 with one ``kiln verify: error:`` line naming what
differs (which file changed, is missing or was added, which signature, which key and policy, which
tag). ``--policy`` defaults to production for a reference (what a champion must be) and is required
with ``--dir``.

A registered version's signed attestations are checked too (``kiln.registry.verify.attestation_checks``):
the approval ``promote`` signed (``kiln.promotion.attestation``) and the latest rollback to it
(``kiln.rollback.attestation``), each the logged file its ``_sha256`` tag names, signed with a key the
policy trusts, naming this version's statement by its sha256 and this version, and agreeing with the
version's approval (rollback) tags. One that fails, and, under a policy that requires approval, a
promoted or rolled-back-to version that names none, exits 1 naming what is wrong; on success each is
printed (who, how, when, the decision). ``--dir`` has no registry records and checks none. Last, where the
version's latest reproduction verdict is recorded (``kiln.provenance.attestation.verdict_lines``: its
``kiln.reproduction.*`` tags, else its latest run in the sandbox experiment), as recorded, not checked.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify",
        help="verify a registered version or a model directory (signatures, provenance statement, every file's "
        "bytes, the version's tags) for a policy",
        description="Verify a model's model.sig and provenance.dsse.json with the policy's trusted keys, that its "
        "files are the ones signed and, for a registered version, that its tags agree with the statement; "
        "print the lineage.",
    )
    p.add_argument("ref", nargs="?", metavar="MODEL@ALIAS|MODEL/VERSION", help="a registered version")
    p.add_argument("--dir", type=Path, metavar="DIR", help="a local model directory to verify instead")
    p.add_argument("--policy", choices=("production", "sandbox"),
                   help="whose trusted keys to verify with (default for a reference: production)")
    p.add_argument("--json", action="store_true", help="print the verified in-toto statement instead of words")
    p.set_defaults(func=handler)


def parse_version_ref(ref: str) -> tuple[str, str, str]:
    """``MODEL@ALIAS`` -> (model, "alias", alias); ``MODEL/VERSION`` -> (model, "version", version).
    ``ConfigError`` naming the reference otherwise."""
    model, sep, alias = ref.rpartition("@")
    if sep and model and alias and "/" not in alias:
        return model, "alias", alias
    model, sep, version = ref.rpartition("/")
    if sep and model and version.isdigit() and "@" not in model:
        return model, "version", version
    raise ConfigError(f"{ref!r} is neither MODEL@ALIAS (e.g. kiln-stdlib-lm@champion) nor MODEL/VERSION "
                      "(e.g. kiln-stdlib-lm/3)")


def handler(args: argparse.Namespace) -> int:
    from kiln.provenance.statement import describe

    if (args.ref is None) == (args.dir is None):
        raise ConfigError("give either a registered version (MODEL@ALIAS or MODEL/VERSION) or --dir DIR, not both")
    if args.dir is not None:
        from kiln.provenance.verify import verify_artifact

        if args.policy is None:
            raise ConfigError("--dir needs --policy production|sandbox")
        verified = verify_artifact(args.dir, args.policy)
        what, statement = str(args.dir), verified.statement
        keys = verified.statement_key_id, verified.model_sig_key_id
    else:
        model, kind, name = parse_version_ref(args.ref)
        policy = args.policy or "production"
        from kiln.provenance.attestation import verdict_lines
        from kiln.registry import mlflow_io
        from kiln.registry.verify import VerifiedVersion, verify_version

        def attempt() -> tuple[Any, VerifiedVersion, list[str]]:
            client = mlflow_io._client()
            mv = mlflow_io.version_by_ref(client, model, kind, name)
            return mv, verify_version(client, mv, policy), verdict_lines(client, mv)

        mv, version, reproduction = mlflow_io._with_retries(f"verifying {args.ref}", attempt)
        args.policy = policy
        what, statement = f"{mv.name} version {mv.version}", version.statement
        keys = version.statement_key_id, version.model_sig_key_id
    if args.json:
        print(json.dumps(statement, indent=2, sort_keys=True))
        return 0
    print(f"{what}: verified for policy {args.policy} (statement key {keys[0]}, model.sig key {keys[1]})")
    if args.ref is not None:
        print("  its tags and logged model agree with the signed statement")
        for line in [*_attestation_lines(version.attestations), *reproduction]:
            print(f"  {line}")
    for line in describe(statement):
        print(f"  {line}")
    return 0


def _attestation_lines(attestations: tuple[Any, ...]) -> list[str]:
    """Each verified attestation of the version, in words (``verify_version`` refused any other)."""
    if not attestations:
        return ["no signed approval or rollback (none named, none required)"]
    lines = []
    for a in attestations:
        p = a.predicate
        if a.kind == "approval":
            decision = p.get("decision") if isinstance(p.get("decision"), dict) else {}
            lines.append(f"signed approval: {p.get('approver')} ({p.get('approval')}) at {p.get('approvedAt')}, "
                         f"decision {decision.get('action')}, promoted {p.get('candidate')} as {p.get('target')} "
                         f"({p.get('alias')}; before it {p.get('previousVersion') or 'none'}); {a.uri}")
        else:
            lines.append(f"signed rollback: {p.get('actor')} at {p.get('rolledBackAt')} moved {p.get('alias')} back "
                         f"to it from version {p.get('fromVersion') or 'none'}: {p.get('reason')}; {a.uri}")
    return lines
