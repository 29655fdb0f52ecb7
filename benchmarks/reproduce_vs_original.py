"""What ``kiln reproduce`` costs next to the run that made the version it re-derives.

The original run is the pipeline's stages as the DAG runs them, called one after the other in one
process of their own (``kiln.stages``: snapshot, validate, data gate, tokenizer, tokenize, tokens, train
with kiln's local launcher and real torchrun, evaluate, register with signing), on a fresh kiln home,
DVC remote and MLflow server (``mlflow server``, SQLite and local artifacts, as on the embedded stack),
over a corpus of ``KILN_BENCH_REPRO_SHARDS`` (4) shards of the sample corpus, one of them poisoned so
that the data gate quarantines it, and the tiny recipe for ``KILN_BENCH_REPRO_STEPS`` (200) steps on
one rank. What the DAG adds between tasks (Airflow's scheduling, a process per task, each paying its
imports) is not in it: the baseline is the stages' own work, the least an original run takes.

Measured in the same round, right after it: ``kiln reproduce MODEL/VERSION --json`` of the version just
registered, in a process of its own as a user runs it (verify the downloaded version, plan, compare
the code, then re-derive in a fresh work directory: snapshot restored from the DVC remote into its own
cache, validate, data gate, tokenizer and tokens, training manifest, train, evaluate, the Hugging Face
folder; the verdict signed and recorded). Its steps are timed from its log lines as they come.

Prints ``ratio = reproduce wall time / original run wall time`` (median over ``KILN_BENCH_REPRO_REPEATS``
(3) rounds, each a fresh kiln home with its own original run and reproduction), the time of each step
on both sides, and the load (``uptime``) before and after. Wall time on a shared machine follows the
load; ``cpu_ratio`` is the same ratio of CPU seconds (user and system, each side's process and its
children: the ranks, the evaluation), which other work moves much less. Uses its own folder under /tmp, deleted
afterwards. Every reproduction must come out ``reproduced`` (else there is no figure).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

CORPUS = "bench-repro"
REPRO_STEPS = ("verify", "snapshot", "validate", "tokenize", "training-manifest", "train", "evaluate", "hf-folder")
"""The reproduction's phases, each timed from its first log line to the next phase's ("verify": from the
start, which includes reading the version and downloading it)."""


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have ended, theirs included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _corpus(home: Path, shards: int) -> None:
    """The sample corpus the original run reads, in ``home``'s corpus root (before it, untimed)."""
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus

    os.environ["KILN_HOME"] = str(home)
    build_corpus(kiln_settings.load().corpus_root / CORPUS, shards=shards, seed=2, poison=["secret"],
                 max_bytes=65_536 * shards)


def _original(home: Path, url: str, steps: int) -> tuple[dict[str, float], str, str]:
    """The pipeline's stages on a fresh kiln home: their times, the registered model's name and version."""
    import mlflow

    from kiln import stages
    from kiln.policy import SANDBOX

    name = f"sandbox.bench-repro-{uuid.uuid4().hex[:8]}"
    policy = dataclasses.replace(SANDBOX, candidate_model=name, target_model=name, writable_models=(name,))
    key = f"kiln_sandbox/manual__bench_repro_{uuid.uuid4().hex[:8]}"
    params = {"recipe": "tiny.toml", "max_steps": steps}
    os.environ["KILN_HOME"] = str(home)
    mlflow.set_tracking_uri(url)
    times: dict[str, float] = {}

    def timed(stage: str, call: Any) -> Any:
        start = time.perf_counter()
        out = call()
        times[stage] = times.get(stage, 0.0) + time.perf_counter() - start
        return out

    snap = timed("snapshot", lambda: stages.snapshot_stage(policy, CORPUS))
    batches = timed("validate", lambda: [stages.validate_stage(policy, snap, batch, key)
                                         for batch in stages.shard_batches(policy, snap)])
    data = timed("data gate", lambda: stages.data_gate_stage(policy, snap, batches, key))
    tokenizer = timed("tokenizer", lambda: stages.tokenizer_stage(policy, data, params, key))
    timed("tokenize", lambda: [stages.tokenize_stage(policy, data, tokenizer, parts, params, key)
                               for parts in stages.token_parts(policy, data)])
    data = timed("tokens", lambda: stages.tokens_stage(policy, data, tokenizer, params, key))
    train = timed("train", lambda: stages.train_stage(policy, snap, data, params, key, log_line=lambda _line: None))
    evaluation = timed("evaluate", lambda: stages.evaluate_stage(train, data, key))
    candidate = timed("register", lambda: stages.register_stage(policy, snap, data, train, evaluation, key,
                                                                lineage={}))
    return times, name, str(candidate.version)


def _reproduce(home: Path, url: str, model: str, version: str) -> tuple[dict[str, float], float, str]:
    """``kiln reproduce MODEL/VERSION --json`` in a process of its own, as a user runs it: its phases' times
    (from its log lines, as they come), its wall time and its verdict."""
    import json

    env = {**os.environ, "KILN_HOME": str(home), "MLFLOW_TRACKING_URI": url}
    argv = [sys.executable, "-m", "kiln.cli", "reproduce", f"{model}/{version}", "--policy", "sandbox",
            "--workdir", str(home / "reproduction"), "--json"]
    marks: list[tuple[float, str]] = []
    last = 0.0
    start = time.perf_counter()
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stderr is not None and proc.stdout is not None
        marks.append((start, "verify"))
        for line in proc.stderr:  # the outcome is on stdout, read once stderr closes
            if not line.startswith("[reproduce] "):
                continue
            last = time.perf_counter()
            phase = line.removeprefix("[reproduce] ").split(":", 1)[0]
            if phase in REPRO_STEPS and phase not in {p for _, p in marks}:
                marks.append((last, phase))
        out = proc.stdout.read()
    end = time.perf_counter()
    outcome = json.loads(out) if out.strip() else {"verdict": f"no outcome (exit {proc.returncode})", "reason": ""}
    # each phase from its first line to the next one's; the last to its last line; then the verdict is signed,
    # logged to MLflow and tagged on the version, with no line of its own, and the process exits
    phases = {phase: (marks[i + 1][0] if i + 1 < len(marks) else last) - at for i, (at, phase) in enumerate(marks)}
    phases["record the verdict, exit"] = end - last
    verdict = outcome["verdict"] if not outcome.get("reason") else f"{outcome['verdict']}: {outcome['reason']}"
    return phases, end - start, verdict


def _original_in_a_process(home: Path, url: str, steps: int) -> tuple[dict[str, float], str, str]:
    """``_original`` in a process of its own (its imports paid once, as the reproduction's are)."""
    import json

    proc = subprocess.run([sys.executable, __file__, "--original", str(home), url, str(steps)],
                          env={**os.environ, "KILN_HOME": str(home), "MLFLOW_TRACKING_URI": url},
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the original run failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    times, model, version = json.loads(proc.stdout.strip().splitlines()[-1])
    return times, model, version


def main() -> dict[str, Any]:
    from kiln.stack.mlflow_server import free_port, start_server, stop_server

    shards = int(os.environ.get("KILN_BENCH_REPRO_SHARDS", "4"))
    steps = int(os.environ.get("KILN_BENCH_REPRO_STEPS", "200"))
    repeats = int(os.environ.get("KILN_BENCH_REPRO_REPEATS", "3"))
    uptime_before = _uptime()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-bench-repro-", dir="/tmp"))
    saved = {k: os.environ.get(k) for k in ("KILN_HOME", "MLFLOW_TRACKING_URI")}
    for var in ("KILN_DVC_REMOTE", "KILN_DVC_REMOTE_ENDPOINT", "KILN_TOKENS_REMOTE", "KILN_CONTRACTS_DIR"):
        os.environ.pop(var, None)
    server = start_server(scratch / "mlflow", free_port())
    rounds: list[dict[str, Any]] = []
    try:
        os.environ["MLFLOW_TRACKING_URI"] = server.url
        for i in range(repeats):
            home = scratch / f"round-{i}" / "kiln"
            _corpus(home, shards)
            cpu = _children_cpu_s()
            original, model, version = _original_in_a_process(home, server.url, steps)
            original_cpu, cpu = _children_cpu_s() - cpu, _children_cpu_s()
            original_s = sum(original.values())  # snapshot to register, one stage after the other
            phases, reproduce_s, verdict = _reproduce(home, server.url, model, version)
            reproduce_cpu = _children_cpu_s() - cpu
            if verdict != "reproduced":
                raise SystemExit(f"round {i}: the reproduction did not reproduce ({verdict}): no figure to report")
            rounds.append({"original": original, "original_s": original_s, "phases": phases,
                           "reproduce_s": reproduce_s, "original_cpu_s": original_cpu, "reproduce_cpu_s": reproduce_cpu})
    finally:
        stop_server(server)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(scratch, ignore_errors=True)

    ratios = sorted(r["reproduce_s"] / r["original_s"] for r in rounds)
    cpu_ratios = sorted(r["reproduce_cpu_s"] / r["original_cpu_s"] for r in rounds)

    def row(side: str, key: str) -> dict[str, Any]:
        values = [r[side].get(key, 0.0) for r in rounds]
        return {"median s": round(statistics.median(values), 2), "rounds s": ", ".join(f"{v:.2f}" for v in values)}

    stages = list(rounds[0]["original"])
    return {
        "name": "kiln reproduce vs the original run",
        "baseline": (f"the original run of the version reproduced, measured in the same round right before it: the "
                     f"pipeline's stages in one process (snapshot to register, no Airflow between them) on "
                     f"{shards} sample-corpus shards (1 quarantined), the tiny recipe for {steps} steps on 1 rank; "
                     f"median of {repeats} rounds, each a fresh kiln home, DVC remote and registered version"),
        "ratio": round(statistics.median(ratios), 2),
        "ratios": [round(r, 2) for r in ratios],
        "original_run_s": [round(r["original_s"], 1) for r in rounds],
        "reproduce_s": [round(r["reproduce_s"], 1) for r in rounds],
        "cpu_ratio": round(statistics.median(cpu_ratios), 2),
        "cpu_ratios": [round(r, 2) for r in cpu_ratios],
        "original_cpu_s": [round(r["original_cpu_s"], 1) for r in rounds],
        "reproduce_cpu_s": [round(r["reproduce_cpu_s"], 1) for r in rounds],
        "uptime before": uptime_before,
        "uptime after": _uptime(),
        "original run, by stage": {stage: row("original", stage) for stage in stages},
        "reproduction, by step": {phase: row("phases", phase) for phase in (*REPRO_STEPS, "record the verdict, exit")},
    }


if __name__ == "__main__":
    import json

    if sys.argv[1:2] == ["--original"]:  # one original run, in this process: its times, the model and version
        import contextlib

        home_arg, url_arg, steps_arg = sys.argv[2:5]
        with contextlib.redirect_stdout(sys.stderr):  # MLflow prints run links; stdout is the answer
            answer = _original(Path(home_arg), url_arg, int(steps_arg))
        print(json.dumps(answer))
    else:
        print(json.dumps(main(), indent=2))
