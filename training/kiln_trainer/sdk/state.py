"""What a session carries from step to step besides the model, optimizer and RNGs: ``TrainState``
(saved in every checkpoint as ``trainer_state.pt``), and the pure rules around a resume."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

RECENT_WINDOW = 20
"""How many of the latest step losses ``TrainState.recent_losses`` keeps (the guard's spike reference)."""


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Everything the loop needs besides model/optimizer/scheduler/RNG; saved as trainer_state.pt."""

    step: int = 0
    skipped_batches: list[int] = field(default_factory=list)
    """Global batch indices the loss guard skipped (every rank skips them, and so does a resume)."""
    train_tokens: int = 0
    wall_s: float = 0.0
    last_loss: float = float("nan")
    recent_losses: list[float] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def count_step(self, step: int, loss: float, tokens: int, step_s: float) -> None:
        """Step ``step`` was applied with this (rank-averaged) loss."""
        self.step = step
        self.last_loss = loss
        self.recent_losses = (self.recent_losses + [loss])[-RECENT_WINDOW:]
        self.train_tokens += tokens
        self.wall_s += step_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_batches": list(self.skipped_batches),
            "train_tokens": self.train_tokens,
            "wall_s": self.wall_s,
            "last_loss": self.last_loss,
            "recent_losses": list(self.recent_losses),
            "events": [dict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(
            step=int(d["step"]),
            skipped_batches=[int(b) for b in d["skipped_batches"]],
            train_tokens=int(d["train_tokens"]),
            wall_s=float(d["wall_s"]),
            last_loss=float(d["last_loss"]),
            recent_losses=[float(x) for x in d["recent_losses"]],
            events=[dict(e) for e in d["events"]],
        )


def recipe_changes(made: dict[str, Any], asked: dict[str, Any]) -> str:
    """``section.key: <checkpoint's> -> <this run's>`` for every recipe value that differs."""
    keys = sorted({(sec, k) for d in (made, asked) for sec, table in d.items() for k in (table or {})})
    changes = [
        f"{sec}.{k}: {made.get(sec, {}).get(k)!r} -> {asked.get(sec, {}).get(k)!r}"
        for sec, k in keys
        if made.get(sec, {}).get(k) != asked.get(sec, {}).get(k)
    ]
    return "; ".join(changes) or "same values, other encoding"


def rank_rng_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of a rank that a resumed checkpoint's world did not have (a pure function)."""
    digest = hashlib.sha256(f"kiln-rank-rng:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
