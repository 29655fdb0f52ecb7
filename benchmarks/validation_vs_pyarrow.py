"""Shard validation (kiln.validation, Great Expectations) versus a plain pyarrow read of the same shards.

Issue 4's Measure: validation reuses one GE context per process and validates the shards in batches
the way the DAG's mapped task does (``kiln.pipeline.validate_stage`` → ``validate_shards`` over
``policy.validation_batch_shards`` shards); the baseline reads every shard with
``pyarrow.parquet.read_table`` in the same process, same page cache. Reported: shards/s of both at
N shards, their ratio (goal ≤ 2.0×), the one-off import + GE context cost (kept out of the ratio,
a worker pays it once), and the ratio at other batch sizes to show where the time goes.

Shards are small (``DOCS_PER_SHARD`` documents cut from the stdlib sample corpus, doc ids made
unique per shard), written under a temporary directory that is deleted afterwards.

    cd /work/main && .venv/bin/python benchmarks/run.py validation_vs_pyarrow
    KILN_BENCH_SHARDS=200 .venv/bin/python benchmarks/validation_vs_pyarrow.py   # quicker look
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHARDS = int(os.environ.get("KILN_BENCH_SHARDS", "1000"))
DOCS_PER_SHARD = int(os.environ.get("KILN_BENCH_DOCS_PER_SHARD", "16"))
DAG_BATCH = 4
"""Shards per mapped validation task (``Policy.validation_batch_shards`` of the sandbox policy)."""
OTHER_BATCHES = (1, 32, 250)
SINGLE_SHARD_SAMPLE = 100
"""Batch size 1 (one GE run per shard) is timed on this many shards only: it is the slow reference."""


def _write_shards(out: Path, shards: int, docs_per_shard: int) -> tuple[list[Path], Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.corpus import COMPRESSION, build_corpus

    summary = build_corpus(out / "source", shards=1)
    source = pq.read_table(Path(summary["out"]) / summary["train"][0])
    rows = source.num_rows
    paths = []
    (out / "train").mkdir()
    for i in range(shards):
        picks = [(i * docs_per_shard + k) % rows for k in range(docs_per_shard)]
        part = source.take(pa.array(picks))
        ids = [f"{d}@{i}" for d in part.column("doc_id").to_pylist()]
        part = part.set_column(part.schema.get_field_index("doc_id"), "doc_id", pa.array(ids, pa.string()))
        path = out / "train" / f"shard-{i:05d}.parquet"
        pq.write_table(part, path, compression=COMPRESSION)
        paths.append(path)
    return paths, Path(summary["out"])


def _rate(seconds: float, shards: int) -> float:
    return round(shards / seconds, 1) if seconds > 0 else float("inf")


def main() -> dict[str, Any]:
    import pyarrow.parquet as pq

    started = time.perf_counter()
    import kiln.validation as validation
    from kiln.contracts import load_contract

    validation._great_expectations()  # import great_expectations + the one ephemeral context
    import_s = time.perf_counter() - started

    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-validation-"))
    try:
        paths, corpus = _write_shards(tmp, SHARDS, DOCS_PER_SHARD)
        contract = load_contract("stdlib-py@1")
        eval_hashes = validation.load_eval_doc_hashes(corpus)
        total_bytes = sum(p.stat().st_size for p in paths)

        # Warm the page cache and both code paths once, so neither side pays first-touch costs.
        for p in paths:
            pq.read_table(p)
        validation.validate_shards(paths[:DAG_BATCH], contract, eval_hashes)

        t = time.perf_counter()
        rows = sum(pq.read_table(p).num_rows for p in paths)
        read_s = time.perf_counter() - t

        def timed(batch: int, subset: list[Path]) -> tuple[float, list[Any]]:
            t = time.perf_counter()
            reports = []
            for i in range(0, len(subset), batch):
                reports.extend(validation.validate_shards(subset[i : i + batch], contract, eval_hashes))
            return time.perf_counter() - t, reports

        validate_s, reports = timed(DAG_BATCH, paths)
        quarantined = sum(r.verdict != "healthy" for r in reports)
        by_batch: dict[str, str] = {}
        for batch in OTHER_BATCHES:
            subset = paths[:SINGLE_SHARD_SAMPLE] if batch == 1 else paths
            seconds, _ = timed(batch, subset)
            per_read = read_s / len(paths) * len(subset)
            by_batch[f"batch of {batch}"] = (
                f"{_rate(seconds, len(subset))} shards/s, {seconds / per_read:.1f}× the read"
                + (f" (first {len(subset)} shards)" if len(subset) != len(paths) else "")
            )
        by_batch[f"batch of {DAG_BATCH} (DAG)"] = f"{_rate(validate_s, len(paths))} shards/s, {validate_s / read_s:.1f}× the read"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    return {
        "name": "Shard validation vs a plain pyarrow read",
        "baseline": f"pyarrow.parquet.read_table of the same {len(paths)} shards, same process, warm page cache",
        "ratio": round(validate_s / read_s, 2),
        "goal": "≤ 2.0",
        "shards": len(paths),
        "documents_per_shard": DOCS_PER_SHARD,
        "rows": rows,
        "mib": round(total_bytes / 2**20, 1),
        "batch_shards": DAG_BATCH,
        "validation_shards_per_s": _rate(validate_s, len(paths)),
        "pyarrow_read_shards_per_s": _rate(read_s, len(paths)),
        "validation_s": round(validate_s, 2),
        "pyarrow_read_s": round(read_s, 3),
        "import_and_ge_context_s": round(import_s, 2),
        "import_s_per_shard_if_each_task_is_a_fresh_process": round(import_s / DAG_BATCH, 2),
        "quarantined": quarantined,
        "by_batch_size": by_batch,
        "why": (
            "GE costs ~0.05-0.2 s per run whatever the rows (graph building per expectation); a batch of "
            f"{DAG_BATCH} small shards cannot amortise it against a ~1 ms read. Larger batches do, until the "
            "per-row work (UTF-8 decode, control-char share, eval hashes, 8 secret regexes) dominates."
        ),
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2, ensure_ascii=False), file=sys.stdout)
