"""``kiln promote`` / ``kiln rollback``: the operator's hands on the registry.

::

    kiln promote kiln-stdlib-lm.candidates 7 --policy production --approver alice
    kiln rollback kiln-stdlib-lm --policy production --actor alice --reason "INC-42: bad answers"

``promote`` runs the same gate as the DAG (``kiln.registry.decide`` of the version's evaluation
against the current champion) and refuses a candidate the gate holds (exit 3); there is no
override. Both are idempotent: running one twice changes nothing the second time, and one
interrupted half-way (MLflow down) completes when run again. An unreachable MLflow server is
retried with backoff (``KILN_REGISTRY_RETRIES``, ``KILN_REGISTRY_BACKOFF_S``,
``KILN_REGISTRY_BACKOFF_MAX_S``; see ``kiln.registry``). The ``PromotionRecord`` is printed as
JSON on stdout, the gate's reasons on stderr.

``promote`` is the one way to promote without a run's recorded review: a named person's explicit,
fresh approval (now, by ``--approver``), audited as manual (``kiln.promotion.approval = manual``,
and in ``kiln audit MODEL``). It acts with the caller's MLflow identity, so in a stack with MLflow
permissions only someone holding the production identity can run it for production. It may move
``champion`` back to a version that was rolled back, which an Airflow re-run of the old promote task
may not. ``rollback`` records who, when and why as version tags and an audit event.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

GATE_SAID_NO = 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "promote",
        help="promote a registered model version to the policy's alias (gate + named approver)",
        description="Copy VERSION of MODEL into the policy's target model (when MODEL is the candidate "
        "model), tag it with the approver and the gate's reasons, and move the policy's alias to it last.",
    )
    p.add_argument("model", metavar="MODEL", help="registered model holding VERSION (candidate or target model)")
    p.add_argument("version", metavar="VERSION", help="model version number")
    p.add_argument("--policy", default="production", choices=("sandbox", "production"))
    p.add_argument("--approver", required=True,
                   help="who approves this promotion, by hand (written to the version's tags and audited as manual)")
    p.set_defaults(func=handler, registry_action="promote")

    r = sub.add_parser(
        "rollback",
        help="move the policy's alias back to the version holding alias 'previous' (audited)",
        description="Give the policy's alias (e.g. champion) back to the version holding 'previous', with "
        "audit tags naming the actor. Running it twice changes nothing the second time.",
    )
    r.add_argument("model", metavar="MODEL", help="registered model whose alias moves (the policy's target model)")
    r.add_argument("--policy", default="production", choices=("sandbox", "production"))
    r.add_argument("--actor", required=True, help="who rolls back (written to the audit tags)")
    r.add_argument("--reason", required=True, help="why (written to the audit tags, e.g. an incident id)")
    r.set_defaults(func=handler, registry_action="rollback")


def handler(args: argparse.Namespace) -> int:
    from kiln import registry
    from kiln.errors import PolicyError
    from kiln.policy import get_policy

    policy = get_policy(args.policy)
    if args.registry_action == "rollback":
        record = registry.rollback(args.model, policy, args.actor, reason=args.reason)
        print(json.dumps(record.to_json(), indent=2))
        return 0

    # Check the name before any request: a sandbox operator never reaches the production model.
    policy.check_model_write(args.model)
    if args.model == policy.target_model and args.model != policy.candidate_model:
        # Re-promoting a version already in the target model (e.g. rolling forward): no copy.
        policy = dataclasses.replace(policy, candidate_model=policy.target_model)
    elif args.model != policy.candidate_model:
        raise PolicyError(
            f"policy {policy.name!r} promotes from {policy.candidate_model!r} or {policy.target_model!r}, "
            f"not {args.model!r}"
        )
    candidate = registry.version_report(args.model, args.version)
    decision = registry.decide(candidate, registry.champion_report(policy), policy.gate)
    for reason in decision.reasons:
        print(f"gate: {reason}", file=sys.stderr)
    if decision.action != "promote":
        print(f"kiln promote: the gate holds {args.model} version {args.version}; not promoted", file=sys.stderr)
        return GATE_SAID_NO
    record = registry.promote(
        policy=policy, candidate_version=str(args.version), decision=decision,
        run_key=f"cli/promote-{args.model}-{args.version}", manual_approver=args.approver,
    )
    print(f"kiln promote: promoted by hand, approved by {record.approver} (audited as a manual approval)",
          file=sys.stderr)
    print(json.dumps(record.to_json(), indent=2))
    return 0
