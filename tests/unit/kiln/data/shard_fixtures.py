"""Helpers of the validation tests: a shard's path by poison kind, reports made up without a file, a
batch validated one shard at a time (the reference a stacked batch must equal).

Imported by the tests as ``shard_fixtures`` (pytest puts this directory on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.data.validation import validate_shard
from kiln.refs import ShardReport


def shard_of(summary: dict[str, Any], kind: str) -> str:
    rel = next(rel for rel, k in summary["poisoned"].items() if k == kind)
    return str(Path(summary["out"]) / rel)


def by_path(reports: list[ShardReport]) -> dict[str, ShardReport]:
    return {r.path: r for r in reports}


def fake_report(name: str, verdict: str = "healthy", contract: str = "stdlib-py@1") -> ShardReport:
    return ShardReport(path=f"/c/train/{name}", sha256="0" * 64, rows=10, verdict=verdict, reasons=[], contract=contract)  # type: ignore[arg-type]


def write_file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def validated_one_by_one(paths: list[str] | list[Path], contract, hashes: frozenset[str]) -> list[ShardReport]:
    return [validate_shard(p, contract, hashes) for p in paths]
