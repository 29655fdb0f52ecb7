"""``kiln audit MODEL``: who approved, promoted and rolled back what, when, and under which config.

::

    kiln audit kiln-stdlib-lm                 # a table, oldest first
    kiln audit kiln-stdlib-lm --json          # the same events as a JSON list

Read from the versions' audit tags (``kiln.audit.*``, written by ``kiln.registry.promote``,
``rollback`` and ``record_review``); for the production model the reviews of its candidate model
are included, so rejected and timed-out reviews show too, and so are the changes of the reviewed
production config (``config/production.toml``) between its candidates (event ``config``). Read-only: any MLflow identity with
READ may run it.
"""

from __future__ import annotations

import argparse
import json


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
    p.add_argument("--json", action="store_true", help="print the events as JSON")
    p.set_defaults(func=handler)


def _policy_for(model: str, name: str | None):  # -> Policy | None
    from kiln.policy import POLICIES, get_policy

    if name:
        return get_policy(name)
    return next((p for p in POLICIES.values() if model in p.writable_models), None)


def _detail(event: dict) -> str:
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


def handler(args: argparse.Namespace) -> int:
    from kiln import registry

    events = registry.audit_history(args.model, _policy_for(args.model, args.policy))
    print(json.dumps(events, indent=2) if args.json else format_table(events))
    return 0
