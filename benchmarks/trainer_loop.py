"""kiln_trainer's loop against a bare nanoGPT-style loop, plus its checkpoint and data-loader costs.

    .venv/bin/python benchmarks/run.py trainer_loop

One process, CPU, the same torch thread count for every loop (``KILN_BENCH_THREADS``, default 1:
this host's cores are shared, and one thread per rank is how the tests and the demo train).
Model, optimizer, schedule, clipping, tokenizer and batch geometry come from the ``small`` recipe
(the demo) for both loops; the bare loop is ``benchmarks/_bare_loop.py``. Repeats alternate the three loops so
that drift of a shared machine hits each alike; figures are medians over the repeats. The overhead
ratio compares CPU seconds of the loop thread: with one torch thread every kernel (backward
included, on CPU) runs on that thread, and unlike wall time it does not count the time other
users' processes held the core. The wall-time ratio is reported beside it.

CPU time on a shared virtual machine still drifts: the same bare loop's repeats have differed by
up to 25% within one run (``bare_repeat_spread``), more than the 3% goal. So ``ratio`` is the
median of each repeat's own kiln / bare ratio (its two runs, adjacent in time, see the same host),
and two cross-checks are printed beside it: ``ratio_of_medians`` (median kiln run over median bare
run, this benchmark's figure until 2026-12-07) and ``ratio_step_median`` (the median step's CPU of
each side, every step of every repeat pooled: robust to a slow stretch, blind to work done only
every 10th step, which on the loop thread is the interval log line).

- **overhead**: kiln_trainer with no periodic checkpoint (``checkpoint.every_steps`` past the end)
  over the bare loop. The trainer always commits its final step; that one save's blocking copy is
  left out of the ratio and shown beside it. Everything else the trainer does per step is in:
  the guard's loss sync, the token loader (global-batch order, memory-mapped reads, its prefetch
  thread), metrics.jsonl / metrics.prom every 10 steps. The trainer packs the corpus before its
  loop (not timed, as the bare loop's tokenizing is not).
- **checkpoint blocking**: with ``checkpoint.every_steps = 10`` (async writer), the seconds the loop
  waited for saves (state copy, plus any wait for the previous save) over the loop's wall time.
  The background writer still needs CPU of its own (``ckpt_writer_cpu_frac``, its CPU seconds over
  the loop's), which on a host without a spare core slows training although nothing blocks.
- **data-loader wait**: the trainer's own ``data_wait_frac`` (time waiting for the loader's next
  batch over step time) from its metrics.jsonl, averaged over the no-checkpoint runs (issue 18's
  goal: <= 1% with the ``small`` recipe). The loader reads ahead in a thread of its own, whose CPU
  is outside the loop thread's figure: ``loader_thread_cpu_frac`` is it over the loop's (the
  process's CPU seconds minus the loop thread's, in the runs without periodic checkpoints).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "training" / "recipes" / "small.toml"
CKPT_EVERY = 10


def _build_manifest(root: Path, limit_bytes: int = 600_000) -> Path:
    """A TrainingManifest (kiln wire format) over stdlib sources in 3 parquet shards + 1 eval shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append((path.name, text))
        total += len(text.encode())
        if total >= limit_bytes:
            break

    def shard(name: str, part: list[tuple[str, str]]) -> dict[str, Any]:
        target = root / name
        pq.write_table(pa.table({"doc_id": [n for n, _ in part], "text": [t for _, t in part],
                                 "source": ["stdlib"] * len(part)}), target)
        return {"path": str(target), "sha256": hashlib.sha256(target.read_bytes()).hexdigest(), "rows": len(part)}

    body = {
        "snapshot_id": "0" * 32 + ".dir", "corpus": "stdlib-py", "contract": "stdlib-py@1",
        "shards": [shard(f"train-{i:05d}.parquet", docs[:-4][i::3]) for i in range(3)],
        "eval_shards": [shard("eval-00000.parquet", docs[-4:])], "quarantined": [],
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    manifest = root / "manifest.json"
    manifest.write_text(json.dumps({"kind": "kiln.TrainingManifest", **body,
                                    "sha256": hashlib.sha256(canonical).hexdigest()}))
    return manifest


def _kiln_run(manifest: Path, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    from kiln_trainer import sdk
    from kiln_trainer.train import train

    class LoopClock(sdk.StepHook):
        """The loop's start (wall, loop-thread CPU, process CPU), taken after the resume."""

        def on_start(self, session: sdk.Session) -> None:
            self.t0, self.cpu0, self.proc0 = time.perf_counter(), time.thread_time(), time.process_time()
            self.step_ends: list[float] = []

        def on_step_end(self, session: sdk.Session, stats: sdk.StepStats) -> None:
            self.step_ends.append(time.thread_time())  # the last hook: the whole step is behind it

    clock = LoopClock()
    args = argparse.Namespace(manifest=manifest, recipe=RECIPE, run_dir=run_dir, overrides=overrides, max_steps=None,
                              sample_log=False)
    session = sdk.start(args, hooks=[*sdk.default_hooks(), clock])
    try:
        train(session)
        loop_s = time.perf_counter() - clock.t0
        cpu_s, proc_s = time.thread_time() - clock.cpu0, time.process_time() - clock.proc0
        blocking_s = session.checkpoints.blocking_s
        session.finish()
    finally:
        session.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fracs = [r["data_wait_frac"] for r in records if "data_wait_frac" in r]
    step_cpu_s = [b - a for a, b in zip([clock.cpu0, *clock.step_ends[:-1]], clock.step_ends, strict=True)]
    return {"loop_s": loop_s, "blocking_s": blocking_s, "data_wait_frac": statistics.fmean(fracs),
            "cpu_s": cpu_s, "process_cpu_s": proc_s, "step_cpu_s": step_cpu_s}


def main() -> dict[str, Any]:
    threads = int(os.environ.get("KILN_BENCH_THREADS", "1"))
    steps = int(os.environ.get("KILN_BENCH_STEPS", "60"))
    repeats = int(os.environ.get("KILN_BENCH_REPEATS", "5"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        os.environ.pop(name, None)
    os.environ["KILN_TORCH_THREADS"] = str(threads)  # what kiln_trainer.train.set_threads obeys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import numpy as np

    from kiln_trainer.config import load_recipe
    from kiln_trainer.packed import iter_training_texts
    from kiln_trainer.tokenizer import build_tokenizer
    from kiln_trainer.training_manifest import load_training_manifest

    from _bare_loop import bare_train

    torch.set_num_threads(threads)
    common = [f"train.steps={steps}", "train.log_every=10", "optim.warmup_steps=10", "train.device=cpu",
              "train.dtype=float32"]
    no_ckpt = [*common, f"checkpoint.every_steps={steps + 1}"]
    with_ckpt = [*common, f"checkpoint.every_steps={CKPT_EVERY}"]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        root = Path(tmp)
        manifest = _build_manifest(root)
        recipe = load_recipe(RECIPE, no_ckpt)
        texts = list(iter_training_texts(load_training_manifest(manifest).shards))
        stream = np.asarray(build_tokenizer(recipe.tokenizer).encode_documents(texts))
        bare_train(recipe, stream, 5)  # warm the allocator and kernels once, outside every figure
        bare: list[dict[str, float]] = []
        kiln: list[dict[str, float]] = []
        ckpt: list[dict[str, float]] = []
        for rep in range(repeats):
            jobs = [
                lambda: bare.append(bare_train(recipe, stream, steps)),
                lambda rep=rep: kiln.append(_kiln_run(manifest, root / f"kiln-{rep}", no_ckpt)),
                lambda rep=rep: ckpt.append(_kiln_run(manifest, root / f"ckpt-{rep}", with_ckpt)),
            ]
            for job in jobs[rep % 3 :] + jobs[: rep % 3]:  # rotate the order between repeats
                job()
                print(".", end="", flush=True)
        print(flush=True)

    med = statistics.median
    paired = [k["cpu_s"] / b["cpu_s"] for b, k in zip(bare, kiln, strict=True)]  # each repeat's two runs, side by side in time
    bare_steps = [t for b in bare for t in b["step_cpu_s"]]
    kiln_steps = [t for k in kiln for t in k["step_cpu_s"]]
    bare_cpu = med(b["cpu_s"] for b in bare)
    kiln_cpu = med(k["cpu_s"] for k in kiln)
    bare_s = med(b["loop_s"] for b in bare)
    kiln_s = med(k["loop_s"] - k["blocking_s"] for k in kiln)
    ckpt_cpu = med(c["cpu_s"] for c in ckpt)
    # Other threads' CPU: the loader's prefetch thread in every kiln run (plus the writer of the one
    # final save), the checkpoint writer on top of it in the checkpointing runs.
    loader_cpu = med(k["process_cpu_s"] - k["cpu_s"] for k in kiln)
    writer_cpu = med(c["process_cpu_s"] - c["cpu_s"] for c in ckpt) - loader_cpu
    return {
        "name": "Trainer loop: overhead, checkpoint blocking, data-loader wait",
        "baseline": (
            f"bare nanoGPT-style loop (benchmarks/_bare_loop.py) on the same model ('small' recipe), token stream "
            f"and {steps} steps, {threads} torch thread(s), no checkpoints in either (kiln_trainer's one "
            f"end-of-run save is excluded and shown apart); loop-thread CPU seconds (with one torch "
            f"thread all compute runs there); ratio = the median over {repeats} alternated repeats of each "
            f"repeat's kiln / bare loop-thread CPU, ratio_of_medians = median kiln over median bare, "
            f"ratio_step_median = the median step's loop-thread CPU, kiln over bare ({steps} x {repeats} steps "
            f"a side), ratio_wall = wall seconds, medians; bare_repeat_spread = (slowest - fastest) / median "
            f"of the bare loop's own repeats, the same work: this host's noise"
        ),
        "ratio": round(med(paired), 4),
        "ratio_of_medians": round(kiln_cpu / bare_cpu, 4),
        "ratio_step_median": round(med(kiln_steps) / med(bare_steps), 4),
        "ratio_wall": round(kiln_s / bare_s, 4),
        "ratio_goal": "<= 1.03",
        "bare_repeat_spread": round((max(b["cpu_s"] for b in bare) - min(b["cpu_s"] for b in bare)) / bare_cpu, 4),
        "checkpoint_blocking_frac": round(med(c["blocking_s"] / c["loop_s"] for c in ckpt), 5),
        "checkpoint_blocking_goal": f"<= 0.01 (checkpoint every {CKPT_EVERY} steps, async)",
        "data_wait_frac": round(med(k["data_wait_frac"] for k in kiln), 5),
        "data_wait_goal": "<= 0.01",
        "ckpt_loop_cpu_overhead": round(ckpt_cpu / kiln_cpu - 1, 4),
        "ckpt_writer_cpu_frac": round(writer_cpu / ckpt_cpu, 4),
        "loader_thread_cpu_frac": round(loader_cpu / kiln_cpu, 4),
        "seconds": {
            "bare_loop_cpu_s": round(bare_cpu, 3),
            "kiln_loop_cpu_s": round(kiln_cpu, 3),
            "bare_loop_wall_s": round(bare_s, 3),
            "kiln_loop_wall_s (final save excluded)": round(kiln_s, 3),
            "kiln_final_save_blocking_s": round(med(k["blocking_s"] for k in kiln), 4),
            f"kiln_ckpt_every_{CKPT_EVERY}_loop_wall_s": round(med(c["loop_s"] for c in ckpt), 3),
            f"kiln_ckpt_every_{CKPT_EVERY}_blocking_s": round(med(c["blocking_s"] for c in ckpt), 4),
            f"kiln_ckpt_every_{CKPT_EVERY}_loop_cpu_s": round(ckpt_cpu, 3),
            "ckpt_writer_thread_cpu_s": round(writer_cpu, 3),
            "loader_thread_cpu_s": round(loader_cpu, 3),
            "bare_step_cpu_ms": round(1000 * bare_cpu / steps, 2),
            "benchmark_wall_s": round(time.perf_counter() - t_start, 1),
        },
        "runs": {
            "paired_ratios": [round(r, 4) for r in paired],
            "bare_cpu_s": [round(b["cpu_s"], 3) for b in bare],
            "kiln_cpu_s": [round(k["cpu_s"], 3) for k in kiln],
            "bare_wall_s": [round(b["loop_s"], 3) for b in bare],
            "kiln_wall_s": [round(k["loop_s"], 3) for k in kiln],
            "kiln_ckpt_wall_s": [round(c["loop_s"], 3) for c in ckpt],
            "steps x repeats": f"{steps} x {repeats}",
            "threads": threads,
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
