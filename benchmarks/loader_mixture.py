"""The mixture loader: throughput drawing from 3 sources against 1, and peak RSS as the sources' shards grow
(issue 32, item 7: goals >= 0.95x, and flat).

    .venv/bin/python benchmarks/run.py loader_mixture

Data: real text (the standard library's modules, its packages' modules, and the .md/.rst/.txt files of
this repository's docs and of the installed packages), tokenized with the byte tokenizer and packed by
kiln's packer (``pack_corpus``: the tokenize stage's writer) into ``BLOCK``-token samples under a
temporary directory.

**Throughput.** Three sources (code, library, prose; weights 0.7 / 0.2 / 0.1, sizes in proportion), each
packed on its own, and the same three texts as the three parts of one packed corpus: the parts' shards
are byte for byte the sources' shards, so the one-source baseline reads the same shards and the same
samples, only as one source. In one process, ``TokenLoader`` over the one corpus and ``TokenLoader``
over the three sources (``LoaderSource``) each hand out ``STEPS`` global batches of ``GLOBAL`` samples
as rank 0 of 1 (64 samples a step: what one rank of 8 reads of the gpt2-small recipe's 512; micro-batches
of ``MICRO``), read-ahead thread and all, alternated over ``REPEATS`` repeats (the order flipped every
repeat); every shard is scanned and in the page cache before the first timed repeat. Throughput is
samples handed out per second; the ratio is the three sources' over the one's, from the process's CPU
seconds (both threads: steadier than wall time on a shared machine) and, beside it, wall seconds;
medians over the repeats. Two corpus sizes (``SAMPLES``): the draw's cost follows how full each
permutation's domain is, and the two sizes are the one-source side's best and worst case. The draw
alone (``SampleOrder.ids`` against ``Mixture.draw`` of the same positions) and the shard mappings a
step makes are measured apart. The ratio of record is the lower of the two.

**Peak RSS.** Three sources of ``RSS_SHARDS`` shards each (tiny shards of ``RSS_SHARD_SAMPLES`` samples:
the data grows with the shards); for each, a fresh process opens them (``PackedTokens`` each, one
mixed ``TokenLoader``), reads ``RSS_STEPS`` steps as rank 0 of ``RSS_WORLD`` and reports its peak RSS
(``VmHWM``). The ratio is the largest peak over the smallest's.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BLOCK = 1024
GLOBAL, MICRO = 64, 8
WEIGHTS = {"code": 0.7, "library": 0.2, "prose": 0.1}
SHARD_BYTES = 256 << 10
SAMPLES = (4000, 4600)
"""Samples of the one corpus (and of the three sources together), in two sizes: 4000 fill 98% of the
one corpus' Feistel domain (4**6) while the sources' 2800, 800 and 400 fill 68%, 78% and 39% of theirs,
and 4600 fill 28% of 4**7 against 79%, 90% and 45%. The permutation walks until its value falls inside
``[0, n)``, so the first size was the one-source side's best case for the draw, the second its worst (both
sides now permute in kept blocks of 4096 ids, the one corpus since 0893383: neither walks per step)."""
STEPS = int(os.environ.get("KILN_BENCH_MIX_STEPS", "300"))
REPEATS = int(os.environ.get("KILN_BENCH_MIX_REPEATS", "15"))  # a repeat is half a second: 5 left the median to two outliers

RSS_SHARDS = (8, 64, 512)
RSS_SHARD_SAMPLES = 4
RSS_WORLD = 2
RSS_STEPS = int(os.environ.get("KILN_BENCH_MIX_RSS_STEPS", "150"))

_RSS_CHILD = """
import json, sys, time
from kiln_trainer.loader import LoaderSource, TokenLoader
from kiln_trainer.packed import PackedTokens, load_token_manifest
names, weights = {names!r}, {weights!r}
sources = [LoaderSource(n, w, PackedTokens(load_token_manifest(d))) for n, w, d in zip(names, weights, sys.argv[1:])]
loader = TokenLoader(sources, global_batch_size={G}, micro_batch_size={b}, rank=0, world_size={W}, seed=1)
t = time.perf_counter()
checksum = 0
for _ in range({steps}):
    checksum += int(sum(int(mb[:, 0].sum()) for mb in loader.next_step().micro_batches))
loader.close()
elapsed = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({{"hwm_kib": int(status["VmHWM"].split()[0]), "anon_kib": int(status["RssAnon"].split()[0]),
                  "s_per_step": elapsed / {steps}, "checksum": checksum,
                  "shards": [len(s.tokens.manifest.shards) for s in sources],
                  "samples": [s.tokens.num_samples for s in sources]}}))
"""


def _files(kind: str) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if kind == "code":
        return sorted(stdlib.glob("*.py"))
    if kind == "library":
        return sorted(stdlib.glob("*/*.py"))
    site = Path(sysconfig.get_paths()["purelib"])
    return sorted(p for root in (REPO / "docs", site) for p in root.rglob("*")
                  if p.suffix in (".md", ".rst", ".txt") and p.is_file())


def _texts(kind: str, tokens: int) -> Iterator[str]:
    """Documents of ``kind`` (cycled if they run short) holding exactly ``tokens`` byte-tokenizer ids,
    EOS included; the last one is cut (at a character: up to 3 ids fewer)."""
    left = tokens
    for path in itertools.cycle(_files(kind)):
        text = path.read_text(encoding="utf-8", errors="replace")
        size = len(text.encode("utf-8")) + 1
        if not text or not text.strip():
            continue
        if size >= left:
            yield text.encode("utf-8")[: left - 1].decode("utf-8", errors="ignore")
            return
        left -= size
        yield text


def _pack(root: Path, snapshot_id: str, parts: list[list[str]], shard_bytes: int) -> Path:
    from kiln_trainer.packed import pack_corpus
    from kiln_trainer.tokenizer import ByteTokenizer

    manifest = pack_corpus(root, snapshot_id=snapshot_id, tokenizer=ByteTokenizer(), block_size=BLOCK, parts=parts,
                           shard_bytes=shard_bytes)
    return Path(manifest.path)


def _timed(loader: Any, steps: int) -> tuple[float, float]:
    """Wall and process CPU seconds to hand out ``steps`` global batches (the loader's thread included)."""
    t, cpu = time.perf_counter(), time.process_time()
    checksum = 0
    with loader:
        for _ in range(steps):
            checksum += sum(int(mb[:, 0].sum()) for mb in loader.next_step().micro_batches)
    return time.perf_counter() - t, time.process_time() - cpu


ONE, MIXED = "1 source", "3 sources"


def _mappings(loader: Any, steps: int) -> float:
    """Shard mappings per step: the distinct (source, shard) pairs a step's reads touch (one open each)."""
    import numpy as np

    from kiln_trainer.loader import rank_positions

    total = 0
    for step in range(steps):
        positions = rank_positions(step * GLOBAL, global_batch_size=GLOBAL, rank=0, world_size=1)
        if loader.mixture is None:
            total += np.unique(np.searchsorted(loader.tokens.offsets, loader.order.ids(positions), "right")).size
            continue
        drawn = loader.mixture.draw(positions)
        for j, source in enumerate(loader.sources):
            total += np.unique(np.searchsorted(source.tokens.offsets, drawn.samples[drawn.sources == j], "right")).size
    return total / steps


def _domain(n: int) -> int:
    """The domain ``n`` samples' Feistel permutation walks in (a power of 4; ``sample_order.py``)."""
    from kiln_trainer.sample_order import FeistelPermutation

    return 1 << 2 * FeistelPermutation(n, (0, 0, 0, 0)).half_bits


def throughput(tmp: Path, samples: int) -> dict[str, Any]:
    """One corpus of ``samples`` samples against the same samples as three sources sized by their weights."""
    import numpy as np

    from kiln_trainer.loader import LoaderSource, TokenLoader, rank_positions
    from kiln_trainer.packed import PackedTokens, load_token_manifest

    total = sum(WEIGHTS.values())
    counts = {name: round(samples * w / total) for name, w in WEIGHTS.items()}
    # n samples need n*BLOCK + 1 ids (samples share their boundary id); half a sample more is dropped as
    # the tail, and it absorbs the cut of the last document.
    texts = {name: list(_texts(name, n * BLOCK + 1 + BLOCK // 2)) for name, n in counts.items()}
    one = PackedTokens(load_token_manifest(_pack(tmp / "one", "bench-one.dir", list(texts.values()), SHARD_BYTES)))
    packed = {name: PackedTokens(load_token_manifest(_pack(tmp / name, f"bench-{name}.dir", [texts[name]], SHARD_BYTES)))
              for name in WEIGHTS}
    same = [e.sha256 for e in one.manifest.shards] == [e.sha256 for p in packed.values() for e in p.manifest.shards]
    if not same or [p.num_samples for p in packed.values()] != list(counts.values()):
        raise RuntimeError("the one-source corpus' shards are not the three sources' shards: the comparison is off")
    for each in (one, *packed.values()):
        each.read(np.arange(each.num_samples))  # every shard scanned once and in the page cache
    inputs: dict[str, Any] = {ONE: one, MIXED: [LoaderSource(name, w, packed[name]) for name, w in WEIGHTS.items()]}

    def make(kind: str) -> Any:
        return TokenLoader(inputs[kind], global_batch_size=GLOBAL, micro_batch_size=MICRO, rank=0, world_size=1, seed=1)

    for kind in inputs:
        _timed(make(kind), 20)  # warm the code paths, outside every figure
    runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in inputs}
    for rep in range(REPEATS):
        for kind in ((ONE, MIXED) if rep % 2 == 0 else (MIXED, ONE)):
            runs[kind].append(_timed(make(kind), STEPS))
            print(".", end="", flush=True)

    # The draw alone (positions -> sample ids, as the loader's thread computes them per step), and
    # how many shard mappings a step's reads make.
    draw: dict[str, float] = {}
    mappings: dict[str, float] = {}
    for kind in inputs:
        loader = make(kind)
        cpu = time.process_time()
        for step in range(STEPS):
            positions = rank_positions(step * GLOBAL, global_batch_size=GLOBAL, rank=0, world_size=1)
            (loader.order.ids(positions) if loader.mixture is None else loader.mixture.draw(positions))
        draw[kind] = (time.process_time() - cpu) / STEPS
        mappings[kind] = _mappings(loader, STEPS)
        loader.close()

    read = STEPS * GLOBAL
    med = statistics.median
    cpu_rate = {k: read / med(c for _, c in v) for k, v in runs.items()}
    wall_rate = {k: read / med(w for w, _ in v) for k, v in runs.items()}
    sizes = {ONE: [("one corpus", one.num_samples, len(one.manifest.shards))],
             MIXED: [(name, p.num_samples, len(p.manifest.shards)) for name, p in packed.items()]}
    return {
        "ratio": round(cpu_rate[MIXED] / cpu_rate[ONE], 3),
        "ratio_wall": round(wall_rate[MIXED] / wall_rate[ONE], 3),
        "ratio_per_repeat": ", ".join(f"{a[1] / b[1]:.3f}" for a, b in zip(runs[ONE], runs[MIXED], strict=True)),
        "rows": {
            kind: {"samples (shards) / Feistel domain": ", ".join(f"{name} {n} ({k}) / {_domain(n)}"
                                                                 for name, n, k in sizes[kind]),
                   "samples/s (CPU)": round(cpu_rate[kind]), "samples/s (wall)": round(wall_rate[kind]),
                   "CPU ms/step": round(1000 * med(c for _, c in runs[kind]) / STEPS, 3),
                   "draw alone, CPU ms/step": round(1000 * draw[kind], 3),
                   "shard mappings/step": round(mappings[kind], 1),
                   "CPU s per repeat": ", ".join(f"{c:.3f}" for _, c in runs[kind]),
                   "wall s per repeat": ", ".join(f"{w:.3f}" for w, _ in runs[kind])}
            for kind in runs
        },
    }


def rss(tmp: Path) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    code = _RSS_CHILD.format(names=list(WEIGHTS), weights=list(WEIGHTS.values()), G=GLOBAL, b=MICRO, W=RSS_WORLD,
                             steps=RSS_STEPS)
    for shards in RSS_SHARDS:
        root = tmp / f"rss-{shards}"
        tokens = shards * RSS_SHARD_SAMPLES * BLOCK + 1 + BLOCK // 2  # as in throughput: exactly that many samples
        dirs = [_pack(root, f"bench-{name}-{shards}.dir", [list(_texts(name, tokens))],
                      RSS_SHARD_SAMPLES * (BLOCK + 1) * 2) for name in WEIGHTS]
        done = subprocess.run([sys.executable, "-c", code, *map(str, dirs)], check=True, capture_output=True, text=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        rows[f"3 x {shards} shards"] = {
            "shards per source": "/".join(map(str, got["shards"])),
            "samples per source": "/".join(map(str, got["samples"])),
            "packed MiB (all sources)": round(sum(f.stat().st_size for d in dirs for f in d.glob("*.bin")) / 2**20, 1),
            "loader peak RSS (MiB)": round(got["hwm_kib"] / 1024, 1),
            "anonymous RSS at end (MiB)": round(got["anon_kib"] / 1024, 1),
            "ms/step": round(1000 * got["s_per_step"], 2),
        }
        shutil.rmtree(root)
    peaks = [r["loader peak RSS (MiB)"] for r in rows.values()]
    anon = [r["anonymous RSS at end (MiB)"] for r in rows.values()]
    extra_shards = len(WEIGHTS) * (RSS_SHARDS[-1] - RSS_SHARDS[0])
    return {"rss_ratio": round(max(peaks) / min(peaks), 3), "by_shards": rows,
            "anon_kib_per_shard": round((anon[-1] - anon[0]) * 1024 / extra_shards, 2)}


def _uptime() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (load 1/5/15 min)"


def main() -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = _uptime()
    tmp = Path(tempfile.mkdtemp(prefix="kiln-bench-mix-"))
    try:
        speed = {}
        for samples in SAMPLES:
            speed[samples] = throughput(tmp / f"speed-{samples}", samples)
            shutil.rmtree(tmp / f"speed-{samples}")
        print(flush=True)
        memory = rss(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    worst = min(SAMPLES, key=lambda n: speed[n]["ratio"])
    weights = ", ".join(f"{k} {v}" for k, v in WEIGHTS.items())
    return {
        "name": "Mixture loader: 3 sources against 1, and peak RSS as the sources' shards grow",
        "baseline": (
            f"TokenLoader over one packed corpus made of the same shards and samples as the three sources (the "
            f"three texts as its three parts), same process, {STEPS} global batches of {GLOBAL} x {BLOCK + 1} tokens "
            f"as rank 0 of 1 (micro-batch {MICRO}), seed 1, one global shuffle; ratio = samples/s with the three "
            f"sources (weights {weights}, sizes in proportion) / samples/s with the one, process CPU seconds (loader "
            f"thread included), medians of {REPEATS} alternated repeats; the lower of two corpus sizes "
            f"({' and '.join(map(str, SAMPLES))} samples)"
        ),
        "ratio": speed[worst]["ratio"],
        "ratio_goal": ">= 0.95",
        **{f"ratio at {n} samples": f"{speed[n]['ratio']} (CPU), {speed[n]['ratio_wall']} (wall); "
                                    f"per repeat (CPU) {speed[n]['ratio_per_repeat']}" for n in SAMPLES},
        "rss_ratio": memory["rss_ratio"],
        "rss_ratio_means": (f"largest peak RSS / smallest over 3 sources x {', '.join(map(str, RSS_SHARDS))} shards of "
                            f"{RSS_SHARD_SAMPLES} samples each (a fresh process each: rank 0 of {RSS_WORLD}, global "
                            f"batch {GLOBAL}, {RSS_STEPS} steps)"),
        "rss_goal": "<= 1.10 (flat)",
        "anonymous RSS per shard (KiB)": memory["anon_kib_per_shard"],
        "anonymous RSS per shard means": (f"(anonymous RSS at the end with 3 x {RSS_SHARDS[-1]} shards - with 3 x "
                                          f"{RSS_SHARDS[0]}) / the shards added: what the loader holds per shard"),
        "why": WHY,
        "uptime_at_start": load_start,
        "uptime_at_end": _uptime(),
        "nproc": os.cpu_count(),
        "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        **{f"throughput at {n} samples": speed[n]["rows"] for n in SAMPLES},
        "peak RSS by shards per source": memory["by_shards"],
    }


WHY = (
    "The loader's thread reads read_steps = 8 steps a wake-up (since 0893383): the 8 steps' positions drawn in one "
    "call, then each shard they touch read once (one open and a preadv per run of consecutive rows, "
    "packed.read_rows, since 0fec07f; an np.memmap per shard and call before): the reads are most of a step's CPU "
    "and both sides make about as many ('shard mappings/step': the shards one step's positions touch). Timed "
    "without the thread (TokenLoader._read_block, 37 blocks of 8 steps, 12 alternated repeats, thread CPU, 2 AMD "
    "EPYC cores, 2026-12-07), a step cost 620 and 628 us (best; medians 692 and 711) at 4000 samples for the one "
    "corpus and the three sources, 696 and 720 (medians 786 and 859) at 4600: the spread of the per-repeat ratios "
    "(about 0.85-1.05) is the thread's scheduling on a 2-core host. Both sides' orders are block lookups: the "
    "mixture permutes each source's epoch in blocks of 4096 consecutive draws (Mixture._block), each once, kept, "
    "after its split (a pair of divisions per tree level), and since 0893383 the one corpus' SampleOrder keeps "
    "blocks of 4096 ids of its epoch too (before, it walked every step: 0.11 ms a step at 4000 samples, which fill "
    "98% of its domain, 0.66 at 4600, which fill 28%, and the mixture was 1.37x the one corpus there). A block "
    "of a small domain (2**k <= 16384: all three sources here, and the one corpus) computes the rounds over the "
    "whole domain once and walks by table lookups (since ccd318b): the small sources start a new epoch, a new "
    "block, every few steps, which the mixture's draw of 8 steps paid ~0.1 ms a step for before. 'draw alone' is "
    "a call per step (a loader makes one per 8 steps: 7 and 30 us a step at 4000 samples, 44 and 29 at 4600, "
    "measured as above). The three sources are read in one call over their concatenated id space "
    "(ConcatenatedTokens: the mixture's global ids). Memory: nothing per sample is held beyond the kept blocks (3 "
    "per source, 32 KiB each); per shard only its token manifest entry (path, sha256, counts: about 0.3 KiB as "
    "Python objects, by tracemalloc), its offset and whether it was scanned, so the peak is the interpreter, numpy "
    "and at most prefetch_steps - 1 + read_steps steps read ahead; the anonymous RSS per shard is that entry plus "
    "the JSON parse's and the allocator's slack. At the packer's default 128 MiB shards a thousand shards per "
    "source would add about a MiB"
)


if __name__ == "__main__":
    print(json.dumps(main(), indent=2, ensure_ascii=False))
