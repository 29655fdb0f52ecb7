"""What every chaos trial family shares: seeded trial plans, results, the tally, the machine facts.

A trial is named ``family:index`` and draws every random choice from its own generator,
``trial_rng(seed, family, index)``, so one failing trial replays alone with the same choices:
``make chaos SEED=<seed> TRIAL=<family>:<index>``. Faults are triggered by observed state (a step
logged, a checkpoint half written, the n-th registry write), never by elapsed time, so a replay
puts the fault at the same point of the same work — up to the step or two a busy machine lets a
worker run on between the trigger and the kill (the report records where each kill landed).

Outcomes are values (``TrialResult``): ``recovered`` (the fault was met as promised), ``lost``
(something the product promises to keep was lost: the ``losses`` say what), ``error`` (the harness
itself failed: neither a pass nor a loss, the detail says why) and ``pending`` (the trial cannot run
yet; the detail says why).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import random
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kiln.errors import ConfigError

Outcome = Literal["recovered", "lost", "error", "pending"]


def trial_rng(seed: int, family: str, index: int) -> random.Random:
    """The generator of one trial: independent of every other trial and of the trial count."""
    return random.Random(f"kiln-chaos:{seed}:{family}:{index}")


@dataclass(kw_only=True, slots=True)
class TrialResult:
    family: str
    index: int
    seed: int
    outcome: Outcome
    fault: str
    """What was injected, where (e.g. ``SIGKILL worker of node 1 at step 47``)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """Measured facts the family's tally adds up (e.g. ``steps_lost``, ``duplicate_versions``)."""
    losses: list[str] = field(default_factory=list)
    """What was lost or broken, one line each (empty when recovered)."""
    detail: str = ""
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.family}:{self.index}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """What a family gets from the runner."""

    seed: int
    work: Path
    """A throwaway folder of this run (never the repository's ``.kiln``)."""
    log: Callable[[str], None] = print


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One kind of fault: ``run(ctx, indices)`` yields one TrialResult per index.

    Families set up what their trials share (a reference run, a server) once per call, so
    ``run`` takes the indices to run rather than one trial at a time.
    """

    name: str
    title: str
    goals: str
    """The promise, as the issue states it (printed with the tally)."""
    default_trials: int
    run: Callable[[Context, list[int]], list[TrialResult]]
    summarize: Callable[[list[TrialResult]], list[str]]
    """Lines of figures for the report (recovered, lost, per-family measures)."""


def parse_only(spec: str, known: list[str]) -> list[str]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"unknown chaos famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; known: {', '.join(known)}")
    return names


def parse_trial(spec: str, known: list[str]) -> tuple[str, int]:
    """``family:index`` → (family, index), naming what is wrong otherwise."""
    family, sep, index = spec.partition(":")
    if not sep or not index.isdigit():
        raise ConfigError(f"trial must be FAMILY:INDEX (e.g. kill:3), got {spec!r}")
    parse_only(family, known)
    return family, int(index)


def machine_facts() -> dict[str, Any]:
    """Date, host, cores and load: figures mean little without the machine they came from."""
    load1, load5, load15 = os.getloadavg()
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(terse=True),
        "cpus": os.cpu_count() or 0,
        "memory_gib": round(mem_kb / 2**20, 1),
        "load": [round(load1, 2), round(load5, 2), round(load15, 2)],
        "python": platform.python_version(),
    }


def count(results: list[TrialResult], outcome: Outcome) -> int:
    return sum(r.outcome == outcome for r in results)


def outcome_line(results: list[TrialResult]) -> str:
    parts = [f"{len(results)} trial(s)", f"{count(results, 'recovered')} recovered", f"{count(results, 'lost')} lost"]
    for extra in ("error", "pending"):
        if count(results, extra):
            parts.append(f"{count(results, extra)} {extra}")
    return ", ".join(parts)


def total(results: list[TrialResult], fact: str) -> int:
    return sum(int(r.facts.get(fact, 0) or 0) for r in results)
