"""The promotion gate: a pure decision (metrics in, ``Decision`` out, no I/O)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kiln.policy import GatePolicy
from kiln.refs import (
    Decision,
    EvalReport,
)

if TYPE_CHECKING:
    pass

from kiln.registry.tags import EVAL_SPLIT

# --------------------------------------------------------------------------------------- the gate


def decide(candidate: EvalReport, champion: EvalReport | None, gate: GatePolicy) -> Decision:
    """Promote or hold, with one reason per check (passed or failed), in a fixed order.

    Checks: sanity (evaluated on the held-out ``eval`` split, finite metrics, some tokens seen),
    the absolute ceiling ``gate.max_bits_per_byte``, and no regression against the champion by more
    than ``gate.max_regression`` bits per byte. No champion (first model) passes the last check.
    Pure: no I/O, same inputs → same Decision.
    """
    reasons: list[str] = []
    held = False

    def check(ok: bool, name: str, detail: str) -> None:
        nonlocal held
        held = held or not ok
        reasons.append(f"{name} {'passed' if ok else 'FAILED'}: {detail}")

    bpb = candidate.bits_per_byte
    check(candidate.split == EVAL_SPLIT, "sanity.split",
          f"evaluated on split {candidate.split!r} (required {EVAL_SPLIT!r})")
    finite = all(math.isfinite(v) for v in (candidate.bits_per_byte, candidate.loss))
    check(finite, "sanity.finite",
          f"bits_per_byte={candidate.bits_per_byte!r} loss={candidate.loss!r} must be finite")
    check(candidate.tokens > 0, "sanity.tokens", f"{candidate.tokens} evaluation tokens (required > 0)")
    bpb_finite = math.isfinite(bpb)
    check(bpb_finite and bpb <= gate.max_bits_per_byte, "threshold",
          f"bits_per_byte {bpb:.4f} vs maximum {gate.max_bits_per_byte:.4f}")

    champion_bpb: float | None = None
    if champion is None:
        check(True, "regression", "no champion yet: this is the first model")
    elif champion.split != EVAL_SPLIT or not math.isfinite(champion.bits_per_byte):
        # A broken champion record must not block every future candidate; say so and compare nothing.
        check(True, "regression",
              f"champion record unusable (split {champion.split!r}, bits_per_byte "
              f"{champion.bits_per_byte!r}); not compared")
    else:
        champion_bpb = champion.bits_per_byte
        delta = bpb - champion_bpb
        check(bpb_finite and delta <= gate.max_regression, "regression",
              f"bits_per_byte {bpb:.4f} vs champion {champion_bpb:.4f} (change {delta:+.4f}, "
              f"tolerance +{gate.max_regression:.4f})")

    return Decision(
        action="hold" if held else "promote",
        reasons=reasons,
        candidate_bits_per_byte=bpb,
        champion_bits_per_byte=champion_bpb,
    )


