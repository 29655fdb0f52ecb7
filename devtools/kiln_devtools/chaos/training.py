"""Training faults: SIGKILLs of workers and whole nodes (``kill``), damaged checkpoints (``corrupt``).

``kill`` — a 2-node local job (``kiln.launchers.local``: two torchrun agents × 1 worker) of the
``tiny`` recipe, killed once per trial at a seeded step: a worker or a whole node's agent, at a step
or while an asynchronous checkpoint write is in flight (``KILN_CKPT_WRITE_DELAY_S`` widens the gap
between the state files and the manifest, the trainer's own fault-injection switch). Trials
alternate the parallel strategy in blocks of the four kill modes (indices 0-3 ddp, 4-7 fsdp, ...):
ddp (rank 0 writes the whole state) and fsdp (every rank writes its own DCP shards, so a kill
mid-save can land in any rank's write). Each trial is checked against one uninterrupted reference
run of the same spec and strategy: the job must succeed after a
whole-group restart, end with the reference ``weights_sha256``, and every checkpoint directory that
holds a manifest must verify (a torn write must never look committed). Steps lost = the step the
kill landed on minus the step the group resumed from; the bound is the checkpoint interval, plus
one interval when the kill lands during the write of the next checkpoint.

``corrupt`` — one committed checkpoint of a finished single-process run is truncated or has one bit
flipped (file, offset and bit seeded). Resume must pass over it (the trainer resumes from the
previous committed step, never from the damaged one) and ``kiln.registry.register_candidate`` must
refuse it (``ManifestError``) before any request reaches MLflow.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.launchers.local import agent_pids, worker_pid
from kiln.runs import CHECKPOINTS_SUBDIR, METRICS_JSONL, RESULT_FILE
from kiln.settings import restore_environ
from kiln_devtools.chaos.core import Context, Family, TrialResult, count, outcome_line, total, trial_rng
from kiln_devtools.chaos.fixtures import SNAPSHOT_ID, clean_manifest, pinned_recipe, run_trainer

STEPS = 80
EVERY = 10
KILL_OVERRIDES = (f"train.steps={STEPS}", f"checkpoint.every_steps={EVERY}", "checkpoint.keep_last=100",
                  "train.log_every=1", "optim.warmup_steps=10")
"""keep_last=100 keeps every checkpoint of the run, so each one is checked after the trial, and
log_every=1 lets the harness see each step (metrics.jsonl) to kill at an exact one."""
WRITE_DELAY_S = "0.8"
KILL_MODES = ("worker", "node", "worker_mid_save", "node_mid_save")
STRATEGIES = ("ddp", "fsdp")
JOB_LIMIT_S = 900.0
"""A safety net against a hung job, not a timing assertion."""


# ----------------------------------------------------------------------------------------- helpers


def _spec(run_dir: Path, manifest: Path, *, strategy: str = "ddp", env: dict[str, str] | None = None):
    from kiln.launchers import LaunchSpec

    return LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=pinned_recipe(manifest),
                      run_key=f"chaos-{run_dir.name}", nodes=2, nproc_per_node=1, max_restarts=2,
                      overrides=(*KILL_OVERRIDES, f"parallel.strategy={strategy}"),
                      # Same threads in every run: bit-identity depends on it.
                      env={"KILN_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": "",
                           **(env or {})})


def _wait_for(predicate: Callable[[], bool], limit_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def last_logged_step(run_dir: Path) -> int:
    """The newest step in rank 0's ``metrics.jsonl`` (0 before the first)."""
    try:
        with open(run_dir / METRICS_JSONL, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record.get("step"), int) and "loss" in record:
            return record["step"]
    return 0






def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    from kiln_trainer.checkpoint_manifest import checkpoint_dirs

    return checkpoint_dirs(run_dir)


def _torn_step(run_dir: Path, at_least: int) -> int | None:
    """The step of a checkpoint (>= ``at_least``) with state files on disk and no manifest yet."""
    for step, step_dir in _step_dirs(run_dir):
        if step >= at_least and not (step_dir / "manifest.json").exists():
            try:
                if any(step_dir.iterdir()):
                    return step
            except OSError:
                continue
    return None


def _torn_write_in_flight(run_dir: Path, at_least: int) -> bool:
    return _torn_step(run_dir, at_least) is not None


def committed_problems(run_dir: Path) -> tuple[int, int, list[str]]:
    """(directories with a manifest, uncommitted leftovers, what is wrong with the committed ones)."""
    from kiln_trainer.checkpoint_manifest import verify_checkpoint
    from kiln_trainer.errors import CheckpointError

    committed, leftovers, problems = 0, 0, []
    for _, step_dir in _step_dirs(run_dir):
        if not (step_dir / "manifest.json").exists():
            leftovers += 1
            continue
        committed += 1
        try:
            verify_checkpoint(step_dir)
        except CheckpointError as exc:
            problems.append(str(exc))
    return committed, leftovers, problems


_RESUMED = re.compile(r"resumed from \S+ \(step (\d+)\)")


def resumed_steps(log_text: str) -> list[int]:
    return [int(m.group(1)) for m in _RESUMED.finditer(log_text)]


def _follow(launcher: Any, handle: Any, lines: list[str]) -> Any:
    """Poll to the end (streaming the job log into ``lines``); cancel after JOB_LIMIT_S."""
    offset, deadline = 0, time.monotonic() + JOB_LIMIT_S
    while True:
        status = launcher.poll(handle)
        text, offset = launcher.logs(handle, offset)
        lines.extend(text.splitlines())
        if status.done:
            text, offset = launcher.logs(handle, offset)
            lines.extend(text.splitlines())
            return status
        if time.monotonic() > deadline:
            launcher.cancel(handle)
            return launcher.poll(handle)
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------- kill


def _reference(ctx: Context, manifest: Path, strategy: str) -> str:
    from kiln.launchers import launch_local

    started = time.monotonic()
    result = launch_local(_spec(ctx.work / f"kill-reference-{strategy}", manifest, strategy=strategy),
                          log=lambda _line: None)
    if not (result.completed and result.step == STEPS):
        raise RuntimeError(f"the uninterrupted {strategy} reference run did not complete: {result}")
    ctx.log(f"  kill: {strategy} reference run {result.weights_sha256[:16]} in {time.monotonic() - started:.0f}s")
    return result.weights_sha256


def plan_kill(seed: int, index: int) -> dict[str, Any]:
    rng = trial_rng(seed, "kill", index)
    mode = KILL_MODES[index % len(KILL_MODES)]  # every mode equally often, with each strategy; the rest is drawn
    strategy = STRATEGIES[(index // len(KILL_MODES)) % len(STRATEGIES)]
    return {"mode": mode, "strategy": strategy, "node": rng.randrange(2),
            "step": rng.randint(EVERY + 1, STEPS - EVERY - 5)}


def kill_trial(ctx: Context, index: int, manifest: Path, reference: str) -> TrialResult:
    from kiln.launchers import LocalLauncher

    plan = plan_kill(ctx.seed, index)
    mid_save = plan["mode"].endswith("_mid_save")
    whole_node = plan["mode"].startswith("node")
    target = f"{'node agent' if whole_node else 'worker'} of node {plan['node']}"
    fault = (f"[{plan['strategy']}] SIGKILL {target} at step >= {plan['step']}"
             + (" during an async checkpoint write" if mid_save else ""))
    run_dir = ctx.work / f"kill-{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = _spec(run_dir, manifest, strategy=plan["strategy"],
                 env={"KILN_CKPT_WRITE_DELAY_S": WRITE_DELAY_S} if mid_save else None)
    launcher = LocalLauncher()
    handle = launcher.submit(spec)
    facts: dict[str, Any] = {"mode": plan["mode"], "strategy": plan["strategy"], "target_step": plan["step"]}
    losses: list[str] = []

    def ready() -> bool:
        if len(agent_pids(run_dir)) < 2:
            return False
        if mid_save:
            return _torn_write_in_flight(run_dir, plan["step"])
        return last_logged_step(run_dir) >= plan["step"]

    if not _wait_for(ready, limit_s=JOB_LIMIT_S) or launcher.poll(handle).done:
        launcher.cancel(handle)
        return TrialResult(family="kill", index=index, seed=ctx.seed, outcome="error", fault=fault, facts=facts,
                           detail=f"the kill point never came (state {launcher.poll(handle).state})")
    agent = agent_pids(run_dir)[str(plan["node"])]
    victim = agent if whole_node else worker_pid(agent)
    if victim is None:
        launcher.cancel(handle)
        return TrialResult(family="kill", index=index, seed=ctx.seed, outcome="error", fault=fault, facts=facts,
                           detail=f"node {plan['node']}'s agent {agent} had no worker at the kill point")
    landed = last_logged_step(run_dir)
    torn_step = _torn_step(run_dir, 0)
    torn = torn_step is not None
    os.kill(victim, signal.SIGKILL)
    lines: list[str] = []
    status = _follow(launcher, handle, lines)
    log_text = "\n".join(lines)
    resumed = resumed_steps(log_text)
    facts.update(killed_at_step=landed, torn_write_at_kill=torn, torn_step=torn_step, state=status.state)
    committed, leftovers, problems = committed_problems(run_dir)
    facts.update(committed_checkpoints=committed, uncommitted_leftovers=leftovers, corrupt_committed=len(problems))
    if problems:
        losses.append(f"{len(problems)} committed checkpoint(s) do not verify: {problems[0]}")
    if status.state != "SUCCEEDED":
        losses.append(f"job ended {status.state}: {status.reason}")
    else:
        result = launcher.result(handle)
        facts["weights_match"] = result.weights_sha256 == reference
        if not result.completed or result.step != STEPS:
            losses.append(f"job reported success at step {result.step}/{STEPS}")
        if result.weights_sha256 != reference:
            losses.append(f"final weights {result.weights_sha256[:16]} differ from the uninterrupted run's {reference[:16]}")
    if resumed:
        facts["resumed_from_step"] = resumed[0]
        facts["steps_lost"] = max(0, landed - resumed[0])
        bound = EVERY * (2 if torn else 1)
        if facts["steps_lost"] > bound + 3:  # +3: steps a busy machine runs between trigger and kill
            losses.append(f"lost {facts['steps_lost']} steps, more than the bound {bound} (+3)")
    elif status.state == "SUCCEEDED":
        losses.append("no 'resumed from' in the job log: the group did not restart from a checkpoint")
    if mid_save and torn:
        fault = (f"[{plan['strategy']}] SIGKILL {target} during the async write of checkpoint step {torn_step} "
                 f"(drawn: the first write from step {plan['step']}); last logged step {landed}")
    else:
        fault = fault.replace(">= ", "") if landed == plan["step"] else f"{fault} (landed at step {landed})"
    return TrialResult(family="kill", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                       fault=fault, facts=facts, losses=losses,
                       detail="" if not losses else "\n".join(lines[-15:]))


def run_kill(ctx: Context, indices: list[int]) -> list[TrialResult]:
    manifest = clean_manifest(ctx.work / "kill-corpus")
    references: dict[str, str] = {}  # per strategy, made when a trial first needs it
    results = []
    for index in indices:
        started = time.monotonic()
        try:
            strategy = plan_kill(ctx.seed, index)["strategy"]
            if strategy not in references:
                references[strategy] = _reference(ctx, manifest, strategy)
            result = kill_trial(ctx, index, manifest, references[strategy])
        except Exception as exc:  # the harness, not the product: recorded, the suite goes on
            result = TrialResult(family="kill", index=index, seed=ctx.seed, outcome="error",
                                 fault=str(plan_kill(ctx.seed, index)), detail=f"{type(exc).__name__}: {exc}")
        result.seconds = round(time.monotonic() - started, 1)
        results.append(result)
        ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault}  lost steps {result.facts.get('steps_lost', '-')}"
                f"  ({result.seconds:.0f}s)")
        shutil.rmtree(ctx.work / f"kill-{index}", ignore_errors=True) if result.outcome == "recovered" else None
    return results


def summarize_kill(results: list[TrialResult]) -> list[str]:
    lost_steps = [r.facts["steps_lost"] for r in results if "steps_lost" in r.facts]
    by_mode = {m: sum(r.facts.get("mode") == m for r in results) for m in KILL_MODES}
    by_strategy = {st: [r for r in results if r.facts.get("strategy") == st] for st in STRATEGIES}
    torn = sum(bool(r.facts.get("torn_write_at_kill")) for r in results)
    lines = [
        outcome_line(results),
        "kills by kind: " + ", ".join(f"{m} {n}" for m, n in by_mode.items())
        + f"; {torn} landed while a checkpoint write was in flight",
        "by strategy: " + ", ".join(
            f"{st} {sum(r.outcome == 'recovered' for r in rs)}/{len(rs)} recovered" for st, rs in by_strategy.items()),
        f"recovered runs (SUCCEEDED after restart): {sum(r.facts.get('state') == 'SUCCEEDED' for r in results)}",
        f"corrupt committed checkpoints: {total(results, 'corrupt_committed')} of "
        f"{total(results, 'committed_checkpoints')} checked (goal 0); torn writes left uncommitted and "
        f"ignored: {total(results, 'uncommitted_leftovers')}",
        f"final weights_sha256 different from the uninterrupted run: "
        f"{sum(r.facts.get('weights_match') is False for r in results)} (goal 0)",
    ]
    if lost_steps:
        lines.append(f"steps lost per crash: mean {sum(lost_steps) / len(lost_steps):.1f}, max {max(lost_steps)}, "
                     f"checkpoint interval {EVERY} steps (bound: {EVERY}, {2 * EVERY} when the kill lands "
                     "during the next checkpoint's write)")
    return lines


KILL = Family(name="kill", title="SIGKILL of a training worker or a whole node's agent",
              goals="recovered; corrupt committed checkpoints 0; final weights differ from the uninterrupted run 0",
              default_trials=20, run=run_kill, summarize=summarize_kill)


# ---------------------------------------------------------------------------------------- corrupt

CORRUPT_BASE = ("train.steps=40", "checkpoint.every_steps=10", "checkpoint.keep_last=10", "train.log_every=10",
                "optim.warmup_steps=5")


def plan_corrupt(seed: int, index: int, files: list[str], sizes: dict[str, int]) -> dict[str, Any]:
    rng = trial_rng(seed, "corrupt", index)
    name = rng.choice(files)
    if index % 2 == 0:
        return {"kind": "truncate", "file": name, "length": rng.randrange(sizes[name])}
    return {"kind": "bitflip", "file": name, "offset": rng.randrange(sizes[name]), "bit": rng.randrange(8)}


def _damage(path: Path, plan: dict[str, Any]) -> None:
    data = bytearray(path.read_bytes())
    if plan["kind"] == "truncate":
        data = data[: plan["length"]]
    else:
        data[plan["offset"]] ^= 1 << plan["bit"]
    path.write_bytes(bytes(data))


def _manifest_fields_changed(before: bytes, after: bytes) -> list[str]:
    try:
        old, new = json.loads(before), json.loads(after)
    except ValueError:
        return []
    if not isinstance(new, dict):
        return []
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _register_refused(step_dir: Path, original: dict[str, Any], manifest_path: Path) -> tuple[bool, str]:
    """``register_candidate`` with refs made from the checkpoint *before* the damage."""
    from kiln import registry
    from kiln.errors import KilnError, ManifestError
    from kiln.policy import SANDBOX
    from kiln.refs import EvalReport, SnapshotRef, TrainingManifest, TrainResult

    train = TrainResult(run_dir=str(step_dir.parents[1]), checkpoint=str(step_dir),
                        checkpoint_manifest_sha256=original["manifest_sha256"], weights_sha256=original["weights_sha256"],
                        step=original["step"], metrics={}, world_size=1, total_steps=original["step"], completed=True,
                        recipe_sha256=original["recipe_sha256"], snapshot_id=SNAPSHOT_ID,
                        training_manifest_sha256=original["training_manifest_sha256"])
    report = EvalReport(checkpoint=str(step_dir), weights_sha256=original["weights_sha256"], split="eval",
                        bits_per_byte=3.0, loss=2.0, tokens=1024)
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=3, bytes=1, dvc="", remote="", path="")
    try:
        registry.register_candidate(policy=SANDBOX, train=train, eval_report=report, snapshot=snapshot,
                                    manifest=TrainingManifest.read(manifest_path), run_key="kiln_chaos/corrupt")
    except ManifestError as exc:
        return True, str(exc)
    except KilnError as exc:  # it got past the checkpoint check and tried the (absent) server
        return False, f"not refused by the checkpoint check; failed later: {type(exc).__name__}: {exc}"
    return False, "registered"


def run_corrupt(ctx: Context, indices: list[int]) -> list[TrialResult]:
    from kiln.util.net import free_port
    from kiln_trainer.checkpoint_manifest import CheckpointError, manifest_sha256, verify_checkpoint

    manifest = clean_manifest(ctx.work / "corrupt-corpus")
    base = ctx.work / "corrupt-base"
    # Stopped at step 30 of 40 (--max-steps keeps the recipe, so a resume matches its hash).
    done = run_trainer(manifest, base, list(CORRUPT_BASE), max_steps=30)
    if done.returncode != 0:
        raise RuntimeError(f"the base run failed (exit {done.returncode}): {done.stderr[-2000:]}")
    newest = max(p for p in (base / CHECKPOINTS_SUBDIR).glob("step-*") if (p / "manifest.json").exists())
    verified = verify_checkpoint(newest)
    original = {**verified, "manifest_sha256": manifest_sha256(newest)}
    files = sorted(p.name for p in newest.iterdir())
    sizes = {name: (newest / name).stat().st_size for name in files}
    # Nothing may reach a server: a refusal must come before any request. A dead port proves it.
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "KILN_REGISTRY_RETRIES")}
    os.environ["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{free_port()}"
    os.environ["KILN_REGISTRY_RETRIES"] = "0"
    results = []
    try:
        for index in indices:
            started = time.monotonic()
            plan = plan_corrupt(ctx.seed, index, files, sizes)
            where = f"offset {plan['offset']} bit {plan['bit']}" if plan["kind"] == "bitflip" else f"to {plan['length']} bytes"
            fault = f"{plan['kind']} {newest.name}/{plan['file']} ({sizes[plan['file']]} bytes) {where}"
            run_dir = ctx.work / f"corrupt-{index}"
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(base, run_dir)
            (run_dir / RESULT_FILE).unlink(missing_ok=True)
            victim = run_dir / CHECKPOINTS_SUBDIR / newest.name
            before = (victim / plan["file"]).read_bytes()
            _damage(victim / plan["file"], plan)
            changed = (_manifest_fields_changed(before, (victim / plan["file"]).read_bytes())
                       if plan["file"] == "manifest.json" else [])
            losses: list[str] = []
            facts: dict[str, Any] = {"kind": plan["kind"], "file": plan["file"]}
            try:
                verify_checkpoint(victim)
                facts["verify_refused"] = False
            except CheckpointError:
                facts["verify_refused"] = True
            # Promotion is asked first: the resumed run rewrites this step (the damaged directory
            # is moved aside), after which the step directory holds a whole checkpoint again.
            refused, why = _register_refused(victim, original, manifest)
            facts["register_refused"] = refused
            if not refused:
                losses.append(f"register_candidate did not refuse it: {why}")
            resumed = run_trainer(manifest, run_dir, list(CORRUPT_BASE))
            steps = resumed_steps(resumed.stderr + resumed.stdout)
            facts["resume_exit"] = resumed.returncode
            facts["resume_refused"] = bool(steps) and steps[0] < original["step"]
            if not facts["resume_refused"]:
                why = f"resumed from step {steps[0]}" if steps else f"exit {resumed.returncode}, no resume line"
                losses.append(f"resume did not pass over the damaged checkpoint ({why})"
                              + (f"; changed manifest field(s) {changed}" if changed else ""))
            # Refusing the damaged step is the goal; on reaching that step again the writer moves
            # the damaged directory aside (kept for forensics) and the run goes on to the end.
            facts["moved_aside"] = any(p.name.startswith(newest.name + ".damaged-")
                                       for p in (run_dir / CHECKPOINTS_SUBDIR).iterdir())
            facts["completed"] = resumed.returncode == 0
            if resumed.returncode != 0:
                losses.append(f"the resumed run failed (exit {resumed.returncode}): {resumed.stderr.strip()[-300:]}")
            if changed:
                facts["manifest_fields_changed"] = changed
            result = TrialResult(family="corrupt", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                                 fault=fault, facts=facts, losses=losses, seconds=round(time.monotonic() - started, 1))
            results.append(result)
            ctx.log(f"  {result.name:<12} {result.outcome:<9} {fault}  ({result.seconds:.0f}s)")
            if not losses:
                shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        restore_environ(saved)
    return results


def summarize_corrupt(results: list[TrialResult]) -> list[str]:
    n = len(results) or 1
    resume = sum(bool(r.facts.get("resume_refused")) for r in results)
    register = sum(bool(r.facts.get("register_refused")) for r in results)
    verify = sum(bool(r.facts.get("verify_refused")) for r in results)
    completed = sum(bool(r.facts.get("completed")) for r in results)
    aside = sum(bool(r.facts.get("moved_aside")) for r in results)
    kinds = {k: sum(r.facts.get("kind") == k for r in results) for k in ("truncate", "bitflip")}
    return [
        outcome_line(results),
        f"damage: {kinds['truncate']} truncations, {kinds['bitflip']} bit flips over "
        f"{len({r.facts.get('file') for r in results})} different files",
        f"refused by verify_checkpoint: {verify}/{len(results)}; by resume: {resume}/{len(results)} "
        f"({100 * resume / n:.0f}%, goal 100%); by register_candidate: {register}/{len(results)} "
        f"({100 * register / n:.0f}%, goal 100%)",
        f"resumed runs that finished: {completed}/{len(results)}; damaged directory moved aside (kept for "
        f"forensics) when the run reached its step again: {aside}/{len(results)}",
    ]


CORRUPT = Family(name="corrupt", title="Truncation or a bit flip in a committed checkpoint file",
                 goals="refused by resume 100%; refused by registration (register_candidate) 100%",
                 default_trials=8, run=run_corrupt, summarize=summarize_corrupt)

__all__ = ["CORRUPT", "KILL", "count"]
