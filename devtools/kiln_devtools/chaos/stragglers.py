"""An injected straggler (``straggler``): flagged on the slow rank; clean runs never flagged.

Even trials run a 2-node local job of the ``tiny`` recipe with the trainer's slow-rank switch
(``KILN_FAULT_SLOW_RANK`` / ``KILN_FAULT_SLOW_S`` / ``KILN_FAULT_SLOW_FROM_STEP``: the rank sleeps
inside every step's compute from that step on) on a seeded rank, delay and start step; odd trials
run the same job clean. The trainer's own detector (per-rank compute time gathered every
``stragglers.every_steps`` steps, flag after ``stragglers.windows`` slow windows) writes a
``{"event": "straggler", "rank": r}`` record to ``metrics.jsonl``: detected = a flag on the injected
rank; a false flag = any flag in a clean run, or on another rank.

If the trainer in this checkout has no slow-rank switch yet, every trial is ``pending`` (with that
reason) rather than faked.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from kiln.runs import METRICS_JSONL
from kiln.shipped import CHECKOUT
from kiln_devtools.chaos.core import Context, Family, TrialResult, outcome_line, trial_rng
from kiln_devtools.chaos.fixtures import clean_manifest, pinned_recipe

SWITCH = "KILN_FAULT_SLOW_RANK"
STEPS = 60
OVERRIDES = (f"train.steps={STEPS}", "checkpoint.every_steps=30", "train.log_every=10", "optim.warmup_steps=5",
             "stragglers.every_steps=5", "stragglers.windows=3", "stragglers.factor=1.5")


def missing_switch() -> str:
    """Why the trial cannot run in this checkout ('' when it can)."""
    faults_py = CHECKOUT / "training" / "kiln_trainer" / "faults.py"
    config_py = CHECKOUT / "training" / "kiln_trainer" / "config.py"
    if not faults_py.is_file() or SWITCH not in faults_py.read_text():
        return f"the trainer has no slow-rank fault switch ({SWITCH}) in {faults_py.relative_to(CHECKOUT)} yet"
    if "class StragglerConfig" not in config_py.read_text():
        return "the trainer's recipe has no [stragglers] section yet"
    return ""


def plan_straggler(seed: int, index: int) -> dict[str, Any]:
    rng = trial_rng(seed, "straggler", index)
    return {"injected": index % 2 == 0, "rank": rng.randrange(2), "seconds": rng.choice((0.1, 0.2, 0.3)),
            "from_step": rng.randint(1, 15)}


def straggler_events(run_dir: Path) -> list[dict[str, Any]]:
    events = []
    try:
        lines = (run_dir / METRICS_JSONL).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "straggler":
            events.append(record)
    return events


def straggler_trial(ctx: Context, index: int, manifest: Path) -> TrialResult:
    from kiln.launchers import LaunchSpec, launch_local

    plan = plan_straggler(ctx.seed, index)
    env = {"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": ""}
    if plan["injected"]:
        env.update({SWITCH: str(plan["rank"]), "KILN_FAULT_SLOW_S": str(plan["seconds"]),
                    "KILN_FAULT_SLOW_FROM_STEP": str(plan["from_step"])})
        fault = f"rank {plan['rank']} sleeps {plan['seconds']} s per step from step {plan['from_step']}"
    else:
        fault = "none (clean run)"
    run_dir = ctx.work / f"straggler-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=pinned_recipe(manifest),
                      run_key=f"chaos-straggler-{index}", nodes=2, nproc_per_node=1, overrides=OVERRIDES, env=env)
    lines: list[str] = []
    result = launch_local(spec, log=lines.append)
    flags = straggler_events(run_dir)
    flagged = sorted({int(e.get("rank", -1)) for e in flags})
    facts: dict[str, Any] = {"injected": plan["injected"], "flagged_ranks": flagged, "completed": result.completed}
    losses = []
    if plan["injected"]:
        facts["detected"] = plan["rank"] in flagged
        facts["false_flags"] = len([r for r in flagged if r != plan["rank"]])
        if not facts["detected"]:
            losses.append(f"the slow rank {plan['rank']} was not flagged (flags: {flagged})")
    else:
        facts["false_flags"] = len(flagged)
    if facts["false_flags"]:
        losses.append(f"false straggler flag(s) on rank(s) {[r for r in flagged if not plan['injected'] or r != plan['rank']]}")
    if not result.completed:
        losses.append("the job did not complete")
    return TrialResult(family="straggler", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                       fault=fault, facts=facts, losses=losses)


def run_straggler(ctx: Context, indices: list[int]) -> list[TrialResult]:
    why = missing_switch()
    if why:
        return [TrialResult(family="straggler", index=i, seed=ctx.seed, outcome="pending",
                            fault=str(plan_straggler(ctx.seed, i)), detail=why) for i in indices]
    manifest = clean_manifest(ctx.work / "straggler-corpus")
    results = []
    for index in indices:
        started = time.monotonic()
        try:
            result = straggler_trial(ctx, index, manifest)
        except Exception as exc:
            result = TrialResult(family="straggler", index=index, seed=ctx.seed, outcome="error",
                                 fault=str(plan_straggler(ctx.seed, index)), detail=f"{type(exc).__name__}: {exc}")
        result.seconds = round(time.monotonic() - started, 1)
        results.append(result)
        ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault}  flagged {result.facts.get('flagged_ranks')}"
                f"  ({result.seconds:.0f}s)")
        if result.outcome == "recovered":
            shutil.rmtree(ctx.work / f"straggler-{index}", ignore_errors=True)
    return results


def summarize_straggler(results: list[TrialResult]) -> list[str]:
    pending = [r for r in results if r.outcome == "pending"]
    if pending:
        return [outcome_line(results), f"pending: {pending[0].detail}"]
    injected = [r for r in results if r.facts.get("injected")]
    clean = [r for r in results if r.facts.get("injected") is False]
    detected = sum(bool(r.facts.get("detected")) for r in injected)
    return [
        outcome_line(results),
        f"injected stragglers detected: {detected}/{len(injected)}"
        + (f" ({100 * detected / len(injected):.0f}%, goal 100%)" if injected else " (none injected in this run)"),
        f"false flags: {sum(int(r.facts.get('false_flags', 0)) for r in clean)} in {len(clean)} clean run(s) (goal 0), "
        f"{sum(int(r.facts.get('false_flags', 0)) for r in injected)} on a healthy rank of an injected run",
    ]


STRAGGLER = Family(name="straggler", title="An injected straggler (one slow rank)",
                   goals="detected 100%; false flags on clean runs 0", default_trials=4, run=run_straggler,
                   summarize=summarize_straggler)
