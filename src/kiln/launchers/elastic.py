"""Elastic shrink: what a job does after losing a node, and the record of every shrink of a run.

A lost node is replaced when a replacement is there; when none joins within the spec's
``replacement_timeout_s`` the job goes on with the nodes left, never below ``min_nodes``
(``LaunchSpec``). The global batch stays: each rank accumulates more micro-batches, and the
trainer records the resume at the smaller world size (its ``world_size_change`` event).

Who does it: the local supervisor (``kiln.launchers.local``: survivors re-rendezvous through
torchrun's ``--nnodes=MIN:MAX``) and the Slurm launcher's next submission after ``NODE_FAIL``
(``kiln.launchers.slurm``: resubmitted on the nodes Slurm has up). Both record each shrink here,
in ``RUN/.launch/elastic.json`` (a JSON list, rewritten whole), which outlives the job and its
resubmissions: the train stage turns it into an MLflow tag and metric, the outcome stage into words,
and ``JobStatus.shrinks`` carries it to whoever polls.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kiln.errors import LaunchError
from kiln.runs import ELASTIC_RECORD, LAUNCH_SUBDIR
from kiln.util.fs import atomic_write_text, parse_own_json

AfterLoss = Literal["replace", "shrink", "fail"]


def after_node_loss(*, nodes_left: int, min_nodes: int, replacement: bool) -> AfterLoss:
    """What a job that just lost a node does: ``replace`` it when a replacement is there, else
    ``shrink`` to the ``nodes_left`` when that is at least ``min_nodes``, else ``fail``."""
    if replacement:
        return "replace"
    if nodes_left >= min_nodes:
        return "shrink"
    return "fail"


@dataclass(frozen=True, kw_only=True, slots=True)
class Shrink:
    """One elastic shrink: a job that lost a node went on with fewer."""

    backend: str
    job_id: str
    """The job that went on smaller (Slurm: the resubmitted job)."""
    lost: str
    """What was lost, in words: ``node 0 (agent killed by signal 9)``, ``job 41 (NODE_FAIL)``."""
    from_nodes: int
    to_nodes: int
    timeout_s: int
    """The replacement timeout that ran out."""
    no_replacement: str
    """Why nothing replaced it: ``no spare node slot left (spare_nodes=0)``, ``1 node of partition kiln up``."""
    time: float

    def in_words(self) -> str:
        return (f"{self.lost} lost, no replacement within {self.timeout_s} s ({self.no_replacement}): "
                f"shrunk {self.from_nodes} -> {self.to_nodes} node(s)")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "reason": self.in_words()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Shrink:
        return cls(backend=str(d["backend"]), job_id=str(d["job_id"]), lost=str(d["lost"]),
                   from_nodes=int(d["from_nodes"]), to_nodes=int(d["to_nodes"]), timeout_s=int(d["timeout_s"]),
                   no_replacement=str(d["no_replacement"]), time=float(d["time"]))


def elastic_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LAUNCH_SUBDIR / ELASTIC_RECORD


def recorded_shrinks(run_dir: str | Path) -> list[Shrink]:
    """Every shrink recorded for ``run_dir``, oldest first ([] when none). A record that is not
    kiln's list of shrinks is a ``LaunchError`` naming the file, never read as "no shrink"."""
    path = elastic_record_path(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise LaunchError(f"elastic record {path} is unreadable: {exc}") from exc
    try:
        items = parse_own_json(text, str(path))
        if not isinstance(items, list):
            raise TypeError(f"a {type(items).__name__}, not a list")
        return [Shrink.from_json(item) for item in items]
    except (ValueError, TypeError, KeyError) as exc:
        raise LaunchError(f"elastic record {path} is not a list of shrinks ({exc!r}); fix or delete it") from exc


def record_shrink(run_dir: str | Path, shrink: Shrink) -> list[Shrink]:
    """Add ``shrink`` to the run's record (rewritten whole: a reader sees the old list or the new)."""
    shrinks = [*recorded_shrinks(run_dir), shrink]
    elastic_record_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(elastic_record_path(run_dir), json.dumps([s.to_json() for s in shrinks], indent=1) + "\n")
    return shrinks


def shrinks_in_words(shrinks: list[Shrink]) -> str:
    """``elastic shrink: node 0 (...) lost, ...: shrunk 2 -> 1 node(s)`` (several joined by ``; ``), or ""."""
    if not shrinks:
        return ""
    return "elastic shrink: " + "; ".join(s.in_words() for s in shrinks)


def shrinks_for_status(run_dir: str | Path) -> tuple[str, ...]:
    """The run's shrinks in words for a ``JobStatus``; a bad record is named there rather than
    failing the poll (the train stage, reading it for MLflow, fails on it)."""
    try:
        return tuple(s.in_words() for s in recorded_shrinks(run_dir))
    except LaunchError as exc:
        return (str(exc),)
