"""Tokenize throughput: kiln's tokenizer and packer versus ``tokenizers``' own ``encode_batch``.

Issue 18's goal: the tokenize path runs at >= 0.8x the speed of the library's ``encode_batch`` on
the same texts. A byte-level BPE (``VOCAB`` ids) is trained once on the stdlib's source; then, in
alternating rounds, the same texts go through

- baseline: ``tokenizers.Tokenizer.encode_batch(texts)`` (what a user of the library writes);
- ``HFTokenizer.encode_batch`` (kiln's interface: ids as lists);
- ``pack_part`` (the whole stage: encode in batches, join with EOS, cut into samples, write and
  fsync uint16 shards, commit the part record).

Ratios are the baseline's best time over each side's best time (> 1 is faster than the baseline).
``encode_batch_fast`` (the library's call without character offsets, which kiln uses) is a second,
stricter baseline; the byte tokenizer's ``encode_documents`` throughput is reported beside them.

    .venv/bin/python benchmarks/run.py tokenize_vs_encode_batch
    KILN_BENCH_TOKENIZE_MB=2 .venv/bin/python benchmarks/tokenize_vs_encode_batch.py   # quicker look
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEGABYTES = float(os.environ.get("KILN_BENCH_TOKENIZE_MB", "8"))
ROUNDS = int(os.environ.get("KILN_BENCH_ROUNDS", "3"))
VOCAB = 8192
BLOCK = 256


def _texts(limit_bytes: int) -> list[str]:
    out, total = [], 0
    root = Path(sysconfig.get_paths()["stdlib"])
    while total < limit_bytes:  # the stdlib is ~30 MB of .py: cycle through it for bigger runs
        for path in sorted(root.rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            out.append(text)
            total += len(text.encode("utf-8"))
            if total >= limit_bytes:
                break
    return out


def _best(work: Callable[[], Any], rounds: list[float]) -> None:
    t = time.perf_counter()
    work()
    rounds.append(time.perf_counter() - t)


def main() -> dict[str, Any]:
    from tokenizers import Tokenizer

    from kiln_trainer.packed import pack_part
    from kiln_trainer.tokenizer import ByteTokenizer, train_bpe

    texts = _texts(int(MEGABYTES * 2**20))
    mib = sum(len(t.encode("utf-8")) for t in texts) / 2**20
    t = time.perf_counter()
    bpe = train_bpe(texts, vocab_size=VOCAB)
    train_s = time.perf_counter() - t
    library = Tokenizer.from_str(bpe.to_bytes().decode("utf-8"))
    byte = ByteTokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-tokenize-"))
    sides = ("baseline", "encode_batch_fast", "encode_batch", "pack_part", "byte encode_documents")
    times: dict[str, list[float]] = {side: [] for side in sides}
    tokens = 0
    try:
        library.encode_batch(texts[:50])  # warm the thread pool
        for i in range(ROUNDS):
            _best(lambda: library.encode_batch(texts), times["baseline"])
            _best(lambda: library.encode_batch_fast(texts), times["encode_batch_fast"])
            _best(lambda: bpe.encode_batch(texts), times["encode_batch"])
            out = tmp / f"round-{i}"
            _best(lambda out=out: pack_part(texts, bpe, out, part=0, block_size=BLOCK), times["pack_part"])
            _best(lambda: byte.encode_documents(texts), times["byte encode_documents"])
        record = json.loads((tmp / "round-0" / "part-00000.json").read_text())
        tokens = record["tokens"] + record["dropped_tokens"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    return {
        "name": "Tokenize: kiln's tokenizer and packer vs tokenizers' encode_batch",
        "baseline": f"tokenizers {__import__('tokenizers').__version__} Tokenizer.encode_batch of the same {len(texts)} texts "
        f"({mib:.1f} MiB of stdlib source), byte-level BPE of {VOCAB} ids, best of {ROUNDS} alternating rounds",
        "ratio": round(best["baseline"] / best["pack_part"], 2),
        "ratio_means": "baseline time / pack_part time: the whole tokenize stage (encode, pack, write, fsync) vs encode alone",
        "goal": ">= 0.8",
        "ratio_encode_batch": round(best["baseline"] / best["encode_batch"], 2),
        "ratio_vs_encode_batch_fast": round(best["encode_batch_fast"] / best["pack_part"], 2),
        "ratio_vs_encode_batch_fast_means": "tokenizers' encode_batch_fast (no offsets, what kiln calls) time / pack_part time",
        "mib": round(mib, 1),
        "tokens": tokens,
        "bytes_per_token": round(mib * 2**20 / tokens, 2) if tokens else None,
        "bpe_train_s": round(train_s, 2),
        "MiB_per_s": {k: round(mib / v, 2) for k, v in best.items()},
        "rounds_s": {k: ", ".join(f"{x:.3f}" for x in v) for k, v in times.items()},
        "threads": os.environ.get("RAYON_NUM_THREADS", f"rayon default ({os.cpu_count()} cores)"),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
    print(json.dumps(main(), indent=2, ensure_ascii=False))
