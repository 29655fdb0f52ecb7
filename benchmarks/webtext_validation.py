"""``web-text@1`` shard validation versus a plain pyarrow read of the same shards (issue 20, goal ≤ 3×).

What a mapped validation task runs on a natural-language corpus: ``validate_shards`` over a batch of
the sandbox policy's size, with the contract's Great Expectations suite (stacked into one run), its
document rules (datatrove's Gopher repetition and quality, C4 and FineWeb filters, PII, script) on
every document of each healthy shard, and the MinHash signatures the data gate's near-duplicate pass reads (written to a temporary
folder, as ``validate_stage`` writes them into the run) — against
``pyarrow.parquet.read_table`` of every shard in the same process, same page cache. Each side is
timed in alternating rounds; the ratios use each side's fastest round, wall and CPU. Then the cost
of each part: the GE suite alone (the contract without its document rules and near-duplicates),
the rule set as validation applies it (document by document, first failing rule), each document rule
alone on every document, and the signatures.

Shards hold ``DOCS_PER_SHARD`` documents of English prose found on every machine (the standard
library's ``pydoc_data/topics.py`` and ``/usr/share/common-licenses``, cut into paragraphs as
extracted web text is), cycled with ids unique per shard, written under a temporary directory that
is deleted afterwards.

    .venv/bin/python benchmarks/run.py webtext_validation
    KILN_BENCH_SHARDS=20 .venv/bin/python benchmarks/webtext_validation.py   # quicker look
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "unit" / "kiln" / "data"))  # the tests' prose fixture

SHARDS = int(os.environ.get("KILN_BENCH_SHARDS", "100"))
DOCS_PER_SHARD = int(os.environ.get("KILN_BENCH_DOCS_PER_SHARD", "40"))
ROUNDS = int(os.environ.get("KILN_BENCH_ROUNDS", "3"))


def _timed(work: Callable[[], Any]) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = work()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def _write_shards(out: Path) -> list[Path]:
    from webtext_fixtures import prose_documents, write_corpus

    docs = prose_documents()
    parts = []
    for i in range(SHARDS):
        picks = [docs[(i * DOCS_PER_SHARD + k) % len(docs)] for k in range(DOCS_PER_SHARD)]
        parts.append([(f"{doc_id}@{i}", text, source) for doc_id, text, source in picks])
    return write_corpus(out, parts)


def main() -> dict[str, Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kiln.data.contracts import load_contract
    from kiln.data.doc_rules import build_rule_set
    from kiln.data.near_duplicates import NearDuplicateSettings, signatures
    from kiln.data.validation import validate_shards
    from kiln.data.validation.suite import _great_expectations
    from kiln.policy import SANDBOX

    _great_expectations()
    contract = load_contract("web-text@1")
    expectations_only = dataclasses.replace(
        contract, settings={k: v for k, v in contract.settings.items()
                            if k not in ("document_rules", "near_duplicates", "max_dropped_share")})
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-webtext-"))
    try:
        paths = _write_shards(tmp / "corpus")
        size = SANDBOX.validation_batch_shards
        batches = [paths[i : i + size] for i in range(0, len(paths), size)]
        total_bytes = sum(p.stat().st_size for p in paths)

        def read() -> int:
            return sum(pq.read_table(p).num_rows for p in paths)

        def as_the_dag_does(contract_used: Any = contract) -> list[Any]:
            signatures_dir = Path(tempfile.mkdtemp(dir=tmp))  # fresh: every round computes the signatures
            return [r for batch in batches for r in validate_shards(batch, contract_used, signatures_dir=signatures_dir)]

        rows = read()
        as_the_dag_does()  # warm both paths (imports, rule set, GE suite cache)
        rounds = []
        for _ in range(ROUNDS):
            read_wall, read_cpu, _ = _timed(read)
            val_wall, val_cpu, reports = _timed(as_the_dag_does)
            rounds.append((val_wall / read_wall, val_cpu / read_cpu, read_wall, read_cpu, val_wall, val_cpu))
        read_s, read_cpu_s = min(r[2] for r in rounds), min(r[3] for r in rounds)
        val_s, val_cpu_s = min(r[4] for r in rounds), min(r[5] for r in rounds)
        ge_wall, ge_cpu, _ = _timed(lambda: as_the_dag_does(expectations_only))

        texts = pa.chunked_array([pq.read_table(p, columns=["text"]).column("text") for p in paths]).combine_chunks()
        rule_set = build_rule_set(contract.document_rules)
        every = list(range(len(texts)))
        rules_wall, rules_cpu, _ = _timed(lambda: rule_set.judge(texts))
        per_rule: dict[str, dict[str, Any]] = {}
        for rule in rule_set.rules:
            wall, cpu, failed = _timed(lambda rule=rule: rule.judge(texts, every))
            per_rule[rule.rule] = {"CPU s (every document)": round(cpu, 2), "documents/s": round(len(every) / max(wall, 1e-9)),
                                   "would drop": f"{len(failed) / len(every):.1%}"}
        settings = NearDuplicateSettings.from_contract(contract.near_duplicates or {})
        sig_wall, sig_cpu, _ = _timed(lambda: signatures(texts.to_pylist(), settings))
        dropped = sum(len((r.dropped or {}).get("rows", [])) for r in reports)
        quarantined = sum(r.verdict != "healthy" for r in reports)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    text_mb = texts.nbytes / 1e6
    return {
        "name": "web-text@1 validation vs a plain pyarrow read",
        "baseline": f"pyarrow.parquet.read_table of the same {len(paths)} shards, same process, warm page cache",
        "ratio": round(val_s / read_s, 1),
        "ratio_cpu": round(val_cpu_s / read_cpu_s, 1),
        "goal": "≤ 3.0 (not met; out of reach with the libraries the issue names: see the floor and why)",
        "rounds (wall / CPU ratio per round)": ", ".join(f"{r[0]:.1f} / {r[1]:.1f}" for r in rounds),
        "shards": len(paths),
        "documents_per_shard": DOCS_PER_SHARD,
        "documents": rows,
        "text_mb": round(text_mb, 1),
        "parquet_mib": round(total_bytes / 2**20, 1),
        "batch_shards": size,
        "validation_s": round(val_s, 2),
        "validation_cpu_s": round(val_cpu_s, 2),
        "pyarrow_read_s": round(read_s, 3),
        "validation_documents_per_s": round(rows / val_s),
        "validation_text_mb_per_cpu_s": round(text_mb / val_cpu_s, 2),
        "pyarrow_read_documents_per_s": round(rows / read_s),
        "ge_suite_alone_s (no document rules, no signatures)": round(ge_wall, 2),
        "ge_suite_alone_ratio": round(ge_wall / read_s, 1),
        "document_rules_cpu_s (the rule set, as validation runs it)": round(rules_cpu, 2),
        "signatures_cpu_s": round(sig_cpu, 2),
        "floor with the issue's libraries (GE suite alone + datatrove's rules alone) vs the read": (
            f"{(ge_wall + rules_cpu) / read_s:.1f}x: Great Expectations and datatrove's filters, which the issue "
            "names, cost this much before kiln adds anything (signatures, reports)"),
        "validate_shards workers for 3x a one-core read": (
            f"{math.ceil(val_s / (3 * read_s))} (validation is mapped over batches of shards: its wall time is "
            "divided by the workers the validate_shards tasks get)"),
        "signatures_documents_per_s": round(rows / max(sig_wall, 1e-9)),
        "documents_dropped": dropped,
        "shards_quarantined": quarantined,
        "document_rules (each on every document)": per_rule,
        "before (datatrove's filters as is, per-shingle hashing)": (
            "commit e0fd8d5's benchmark, same machine, 2026-12-06 07:25 UTC, load 0.6 -> 1.7: ratio 96.7 wall / "
            "91.1 CPU (validation 6.12 s wall, 5.73 s CPU; read 0.063 s); CPU s on every document: gopher_repetition "
            "2.10, gopher_quality 0.69, c4_quality 0.58, pii 0.38, fineweb 0.07, signatures 1.41. First measurement "
            "(03:47 UTC, load 3.4 -> 4.1): 104.7 / 83.2"
        ),
        "kiln implementations (tried, taken out)": (
            "A verdict-identical rewrite of datatrove's Gopher repetition, Gopher quality and C4 filters (commits "
            "8f60ba0..d0af211) measured 46.1 wall / 43.4 CPU on this benchmark (rule set 1.54 CPU s; gopher_repetition "
            "0.70, gopher_quality 0.32, c4_quality 0.21). It was taken out: web-text@1 runs the literature's rules as "
            "a maintained library implements them, and the goal stayed out of reach with it."
        ),
        "why": (
            "Reading Parquet is columnar C++: 0.06-0.1 s for these 4.7 MB of text (by machine), so a 3x budget is "
            "about 0.2-0.3 s, some 50 ns per byte or 0.25 us per word: less than one Python call per word. Every "
            "document rule of web-text@1 looks at every word (datatrove's Gopher 2- to 10-gram repetition counts and "
            "per-word quality tests, C4's regex sentence splitting of each kept line), and the near-duplicate "
            "signatures hash every 5-word shingle with SHA-1 (about 690,000 shingles here: the hashing alone is about"
            " 0.25 s). Against the code before (see before), with identical verdicts and signatures: datatrove's "
            "rules applied document by document (one conversion, datatrove's word cache shared by the rules), PII "
            "patterns skipped on documents that cannot match, SHA-1 hashing in one batch per document into "
            "datasketch's update_batch, one MinHash cleared per document, datatrove's diacritics step skipped where "
            "the text is ASCII. The document rules (datatrove's Python, Gopher repetition the largest) and the "
            "signatures set the pace; getting to 3x would take compiled code for the rules and the shingle hashing "
            "(neither datatrove nor datasketch as they are) or fewer rules. Validation is mapped over batches of "
            "shards, so its wall time scales with the workers given to the validate_shards tasks, not with one core."
        ),
        "compiled drop-ins looked for (2026-12-06)": (
            "datatrove-rs (Rust versions of datatrove's FineWeb filters and MinHash stage, described on a stored "
            "PyPI page) is not on PyPI (https://pypi.org/simple/datatrove-rs/ answers 404) and crates.io is out of "
            "this machine's reach; rensa (Rust MinHash, on PyPI) covers only the signatures with another hash "
            "scheme, not the rules that take most of the time."
        ),
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2, ensure_ascii=False))
