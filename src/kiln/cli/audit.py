"""``kiln audit MODEL``: who approved, promoted and rolled back what, when, and under which config;
and whether each version's tags still agree with its signed provenance statement.

::

    kiln audit kiln-stdlib-lm                 # a table, oldest first, then each version's provenance
    kiln audit kiln-stdlib-lm --json          # the same as one JSON list
    kiln audit kiln-stdlib-lm --require-signed   # an unsigned version fails the audit too

Read from the versions' audit tags (``kiln.audit.*``, written by ``kiln.registry.promote``,
``rollback`` and ``record_review``); for the production model the reviews of its candidate model
are included, so rejected and timed-out reviews show too, and so are the changes of the reviewed
production config (``config/production.toml``) between its candidates (event ``config``).

Then every version it read (the candidate model's too) is verified with the trusted keys of the
policy that owns MODEL (``--policy`` for a model no policy owns), as ``kiln verify`` does: its whole
model directory downloaded, both signatures and every file's bytes checked, and its lineage tags
and logged model compared with the signed statement (``kiln.registry.verify.check_version``). Each
version is reported as ``agrees``, ``disagrees`` (each tag with the value on the version and the
signed one), ``unsigned`` (registered before kiln signed versions: reported, not an error) or
``does-not-verify`` (what failed). ``--json`` appends one ``{"event": "provenance", ...}`` entry per
version after the events, with the same fields.

The same check covers the signed attestations each version names (docs/provenance.md): its approval,
signed at promotion, and its latest rollback to it. Each promotion and rollback event says whether
the attestation that records it ``verifies`` (with the approver, how approved, the decision and the
time as signed; a rollback's actor, time, from which version and why), ``fails`` (what is wrong),
is ``missing`` (a policy that requires approval, and the version names none), or is ``unchecked``
(why); ``--json`` puts it in the event's ``attestation`` entry, and each provenance entry lists its
version's ``attestations``.

Exit status: 0 when every signed version agrees and every attestation named verifies; 1 when any
version disagrees or does not verify or an attestation fails (after printing the whole report; one
``kiln audit: error:`` line names those versions), and with ``--require-signed`` also when any is
unsigned or misses an attestation its policy requires. Read-only: any MLflow identity with READ may run it;
it needs the owning policy's trusted public keys (``KILN_HOME/keys/<policy>/trusted/``).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.registry.verify import VersionCheck


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit",
        help="print the history of reviews, promotions and rollbacks of a registered model",
        description="Print every recorded review (who, when, decision, comment), promotion and rollback "
        "(who, when, which version, from -> to, why) of MODEL, oldest first.",
    )
    p.add_argument("model", metavar="MODEL", help="registered model, e.g. kiln-stdlib-lm")
    p.add_argument("--policy", choices=("sandbox", "production"), default=None,
                   help="policy owning MODEL (default: the one that may write it)")
    p.add_argument("--json", action="store_true", help="print the events and each version's provenance as JSON")
    p.add_argument("--require-signed", action="store_true",
                   help="fail (exit 1) on an unsigned version too, not only on one that disagrees")
    p.set_defaults(func=handler)


def _policy_for(model: str, name: str | None):  # -> Policy | None
    from kiln.policy import get_policy, owning_policy

    if name:
        return get_policy(name)
    return owning_policy(model)


def _attestation_text(event: dict) -> str:
    """What a promotion or rollback row says of the attestation that records it ("" for other events)."""
    a = event.get("attestation")
    if not a:
        return ""
    status = a.get("status")
    if status == "verifies" and a.get("kind") == "approval":
        return (f"; approval signed: {a.get('approver')} ({a.get('approval')}) at {a.get('approved_at')}, "
                f"decision {a.get('decision')}")
    if status == "verifies":
        return f"; rollback signed: {a.get('actor')} at {a.get('rolled_back_at')}"
    if status in ("fails", "missing"):
        return f"; {str(status).upper()}: {a.get('problem')}"
    return f"; {a.get('kind')} unchecked: {a.get('problem')}"


def _detail(event: dict) -> str:
    return _what(event) + _attestation_text(event)


def _what(event: dict) -> str:
    kind = event["event"]
    if kind == "config":
        return (f"production config: {event.get('changes', '')} (sha256 {str(event.get('from_sha256'))[:12]} -> "
                f"{str(event.get('to_sha256'))[:12]}, first used by this version)")
    if kind == "review":
        text = f"review: {event.get('decision', '?')}"
        return text + (f" — {event['comment']}" if event.get("comment") else "")
    move = f"{event.get('from_version') or '-'} -> {event.get('to_version') or event.get('version')}"
    if kind == "promotion":
        return f"champion {move} (run {event.get('run_key', '?')})"
    return f"champion {move}: {event.get('reason', '')}"


def format_table(events: list[dict]) -> str:
    if not events:
        return "no reviews, promotions or rollbacks recorded"
    rows = [("WHEN (UTC)", "EVENT", "MODEL/VERSION", "WHO", "WHAT")]
    rows += [(e.get("at", ""), e["event"], f"{e.get('model', '')}/{e.get('version', '')}", e.get("actor", ""),
              _detail(e)) for e in events]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4] for r in rows)


def provenance_entries(checks: list[VersionCheck]) -> list[dict]:
    """One ``provenance`` entry per checked version, as ``--json`` prints them."""
    return [{"event": "provenance", **c.to_json()} for c in checks]


def format_provenance(checks: list[VersionCheck], policy: str) -> str:
    lines = [f"PROVENANCE (each version's tags against its signed statement, keys of policy {policy})"]
    if not checks:
        lines.append("  no versions")
    for c in checks:
        where = f"{c.model}/{c.version}"
        if c.status == "disagrees":
            lines.append(f"  {where}  DISAGREES with its signed statement:")
            lines += [f"      {m}" for m in c.mismatches]
        elif c.status == "does-not-verify":
            lines.append(f"  {where}  DOES NOT VERIFY: {c.problem}")
        elif c.status == "unsigned":
            lines.append(f"  {where}  unsigned: registered before kiln signed versions (or both signature files "
                         "removed); its tags are unchecked, and promote and kiln export refuse it")
        else:
            lines.append(f"  {where}  agrees (signatures, files, tags, logged model)")
        for a in c.attestations:
            lines.append(f"      {a.kind} attestation {a.status.upper() if a.status != 'verifies' else 'verifies'}"
                         + ("" if a.status == "verifies" else f": {a}"))
    return "\n".join(lines)


def _failures(check: VersionCheck, require_signed: bool) -> list[str]:
    """Why ``check`` makes the audit exit non-zero (empty: it does not)."""
    bad = {"disagrees", "does-not-verify"} | ({"unsigned"} if require_signed else set())
    why = [check.status] if check.status in bad else []
    return why + [f"{a.kind} attestation {a.status}" for a in check.attestations
                  if a.status == "fails" or (a.status == "missing" and require_signed)]


def failed_versions(checks: list[VersionCheck], *, require_signed: bool) -> list[VersionCheck]:
    """The checks that make the audit exit non-zero."""
    return [c for c in checks if _failures(c, require_signed)]


def handler(args: argparse.Namespace) -> int:
    from kiln import registry
    from kiln.errors import ConfigError, ProvenanceError

    policy = _policy_for(args.model, args.policy)
    if policy is None and args.require_signed:
        raise ConfigError(f"--require-signed: no policy owns {args.model}; give --policy production|sandbox "
                          "(whose keys its versions must be signed with)")
    from kiln.registry.audit import attested_events

    events = registry.audit_history(args.model, policy)
    checks = registry.provenance_checks(args.model, policy) if policy is not None else []
    events = attested_events(events, checks)
    unchecked = (f"provenance not checked: no policy owns {args.model} (give --policy production|sandbox: "
                 "whose keys its versions must be signed with)")
    if args.json:
        entries = provenance_entries(checks) if policy is not None else [
            {"event": "provenance", "model": args.model, "status": "unchecked", "problem": unchecked}]
        print(json.dumps(events + entries, indent=2))
    else:
        print(format_table(events))
        print()
        print(format_provenance(checks, policy.name) if policy is not None else unchecked)
    failed = failed_versions(checks, require_signed=args.require_signed)
    listed = {(c.model, c.version) for c in failed}
    earlier = [e for e in events if (e.get("attestation") or {}).get("status") == "fails"
               and (e["model"], e["version"]) not in listed]
    if failed or earlier:
        raise ProvenanceError(
            f"{len(failed) + len({(e['model'], e['version']) for e in earlier})} version(s) failed the provenance "
            "audit: " + ", ".join(
                [f"{c.model}/{c.version} ({', '.join(_failures(c, args.require_signed))})" for c in failed]
                + [f"{e['model']}/{e['version']} ({e['attestation']['kind']} attestation of {e['at']} fails)"
                   for e in earlier]))
    return 0
