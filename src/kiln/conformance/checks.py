"""The kit's verdicts: each guarantee judged from the run directories the kit's runs left.

Pure reads of what a run wrote (``result.json``, ``metrics.jsonl``, the sample log, the committed
checkpoints, kiln's fatal markers, the launcher's elastic record, the job log): each ``judge_*``
returns a ``Check`` that names its guarantee and, when it fails, why, in a sentence a trainer's
author can act on. Nothing here starts a process (``kiln.conformance.runs`` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import LaunchError, RunReadError
from kiln.launchers.base import fatal_markers
from kiln.launchers.elastic import recorded_shrinks
from kiln.runs import METRICS_JSONL, RESULT_FILE
from kiln.util.fs import parse_own_json, read_own_json
from kiln_trainer.contract import (
    EXIT_FATAL,
    MANIFEST_NAME,
    METRICS_EVENT_KEY,
    SAMPLE_LOG_SUBDIR,
    STRAGGLER_EVENT,
    WORLD_SIZE_CHANGE_EVENT,
    CheckpointError,
)
from kiln_trainer.contract.checkpoint_manifest import checkpoint_dirs, verify_checkpoint

GUARANTEES: dict[str, str] = {
    "a": "a SIGKILL of a rank mid-save, then resume, gives bitwise the weights of an uninterrupted run",
    "b": "a resume at another world size continues the same global sample sequence and ends within tolerance",
    "c": "a straggler (a rank slowed by kiln's fault injection) is flagged",
    "d": "a bad training manifest is refused before step 1 (exit 2, kiln's fatal marker)",
    "e": "a node lost mid-training: the job shrinks onto the nodes left, resumes from the last committed checkpoint "
         "and completes",
}
"""Each guarantee the kit runs, by its letter (issue 30's list), in words."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    """One guarantee's verdict."""

    guarantee: str
    """Its letter, a key of ``GUARANTEES``."""
    passed: bool
    reason: str
    """Why it failed; when it passed, what the kit saw."""
    facts: dict[str, Any] = field(default_factory=dict)
    """What the verdict rests on (steps, digests, ranks, differences): JSON-safe."""

    @property
    def title(self) -> str:
        return GUARANTEES[self.guarantee]

    def line(self) -> str:
        return f"({self.guarantee}) {'PASS' if self.passed else 'FAIL'} {self.title}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"guarantee": self.guarantee, "title": self.title, "passed": self.passed, "reason": self.reason,
                "facts": self.facts}


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """How one of the kit's runs ended."""

    run_dir: Path
    state: str
    """The launcher's end state (``SUCCEEDED``, ``FAILED``, ``FATAL``, ``CANCELLED``), or ``EXITED <code>``
    for a run the kit started with torchrun directly."""
    reason: str = ""
    log: str = ""
    """The job's log (every rank's output)."""
    seconds: float = 0.0

    @property
    def succeeded(self) -> bool:
        return self.state == "SUCCEEDED"

    def failure(self, what: str) -> str:
        tail = " | ".join(line for line in self.log.splitlines()[-6:] if line.strip())
        return f"the {what} ended {self.state}" + (f": {self.reason}" if self.reason else "") + (
            f" (last log lines: {tail})" if tail else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class KillRecord:
    """Where the kill of run (a) landed."""

    save_step: int
    """The step whose save the kill was aimed at."""
    torn: bool
    """The save's step directory held files and no sealed manifest when the kill landed."""
    committed_step: int | None
    """The newest committed checkpoint when the kill landed: where the restart must resume."""
    node: int
    """The node whose worker was killed."""
    pid: int | None
    """The killed worker (None: the kill point never came)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeLossRecord:
    """Where the node loss of run (e) landed."""

    node: int
    """The node whose agent and worker were SIGKILLed."""
    agent_pid: int | None
    """The killed agent (None: the kill point never came)."""
    worker_pid: int | None
    committed_step: int | None
    """The newest committed checkpoint when the node was lost: the earliest step the survivors may resume at."""


# -- reading a run ----------------------------------------------------------------------------------


def read_result(run_dir: Path) -> dict[str, Any]:
    try:
        return read_own_json(run_dir / RESULT_FILE)
    except (OSError, ValueError) as exc:
        raise RunReadError(f"{run_dir / RESULT_FILE} cannot be read: {exc}") from exc


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records, in order (none when the run wrote none)."""
    path = run_dir / METRICS_JSONL
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise RunReadError(f"{path} cannot be read: {exc}") from exc
    try:
        return [parse_own_json(line, str(path)) for line in lines if line.strip()]
    except ValueError as exc:
        raise RunReadError(f"{path} holds a line that is not JSON: {exc}") from exc


def sample_log(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each rank's sample-log lines in the order written (``RUN/sample-log/rank-NNNNN.jsonl``: the
    step, the rank, the world size and the global sample ids the rank consumed)."""
    folder = run_dir / SAMPLE_LOG_SUBDIR
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("rank-*.jsonl")):
        try:
            lines = [parse_own_json(line, str(path)) for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip()]
        except (OSError, ValueError) as exc:
            raise RunReadError(f"{path} cannot be read: {exc}") from exc
        for line in lines:
            by_rank.setdefault(int(line["rank"]), []).append(line)
    return by_rank


def global_batches(run_dir: Path, steps: int,
                   world_at: Callable[[int], int] | None = None) -> tuple[list[list[int]], list[int]]:
    """Per step 0..steps-1 (the loader's step: training step ``s`` consumes batch ``s - 1``), the
    global batch's sample ids in rank order, and the world size that read it. ``RunReadError``
    naming the step when its parts are missing, doubled, or not each rank's equal share.

    ``world_at(step)``: the world size whose reading of each step counts (a run whose world changed
    read some steps twice, once by the group that was lost); each rank's last line of the step at
    that world size counts (a restart at the same size reads a step again)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for lines in sample_log(run_dir).values():
        if world_at is None:
            for line in lines:
                by_step.setdefault(int(line["step"]), []).append(line)
            continue
        last: dict[tuple[int, int], dict[str, Any]] = {}
        for line in lines:
            step = int(line["step"])
            if int(line["world_size"]) == world_at(step):
                last[(step, int(line["rank"]))] = line
        for (step, _rank), line in last.items():
            by_step.setdefault(step, []).append(line)
    if not by_step:
        raise RunReadError(f"no sample log in {run_dir / SAMPLE_LOG_SUBDIR}: the trainer logged no sample ids "
                           "(KILN_SAMPLE_LOG=1 / --sample-log; the SDK's loader writes them)")
    batches, worlds = [], []
    for step in range(steps):
        parts = sorted(by_step.get(step, []), key=lambda line: int(line["rank"]))
        if not parts:
            at = "" if world_at is None else f" at world size {world_at(step)}"
            raise RunReadError(f"{run_dir}: no rank logged the samples of step {step + 1}{at}")
        world = int(parts[0]["world_size"])
        ranks = [int(p["rank"]) for p in parts]
        if ranks != list(range(world)) or {int(p["world_size"]) for p in parts} != {world}:
            raise RunReadError(f"{run_dir}: step {step + 1} was logged by ranks {ranks} of a world of {world}")
        shares = {len(p["sample_ids"]) for p in parts}
        if len(shares) != 1:
            raise RunReadError(f"{run_dir}: the ranks of step {step + 1} read unequal shares {sorted(shares)}")
        batches.append([int(i) for p in parts for i in p["sample_ids"]])
        worlds.append(world)
    return batches, worlds


def last_step_read(run_dir: Path, world_size: int) -> int | None:
    """The last training step any rank of a ``world_size`` group started (read its batch of), or
    None when no such group logged a step."""
    steps = [int(line["step"]) for lines in sample_log(run_dir).values() for line in lines
             if int(line["world_size"]) == world_size]
    return max(steps) + 1 if steps else None


def committed_worlds(run_dir: Path) -> dict[int, int]:
    """Step -> the world size it was written at, of every checkpoint that verifies."""
    found = {}
    for step, step_dir in checkpoint_dirs(run_dir):
        try:
            found[step] = int(verify_checkpoint(step_dir)["world_size"])
        except (CheckpointError, KeyError, TypeError, ValueError):
            continue
    return found


def restart_point(run_dir: Path) -> int | None:
    """The loader step rank 0 started from again after a restart (its sample log going back), or
    None when it never went back."""
    lines = sample_log(run_dir).get(0, [])
    for before, after in zip(lines, lines[1:], strict=False):
        if int(after["step"]) <= int(before["step"]):
            return int(after["step"])
    return None


def _committed_problems(run_dir: Path) -> list[str]:
    problems = []
    for _step, step_dir in checkpoint_dirs(run_dir):
        if (step_dir / MANIFEST_NAME).exists():
            try:
                verify_checkpoint(step_dir)
            except CheckpointError as exc:
                problems.append(str(exc))
    return problems


def max_weight_difference(checkpoint: Path, reference: Path) -> float:
    """The largest |difference| of any weight between two committed checkpoints, of any strategy
    and world size (``ValueError`` when their parameters differ by name or shape)."""
    from kiln_trainer.checkpoint import load_model_weights  # torch: only when weights are compared

    _, mine = load_model_weights(checkpoint)
    _, theirs = load_model_weights(reference)
    if mine.keys() != theirs.keys():
        raise ValueError(f"parameters differ: {sorted(mine.keys() ^ theirs.keys())[:4]}")
    worst = 0.0
    for name, tensor in theirs.items():
        if mine[name].shape != tensor.shape:
            raise ValueError(f"{name} has shape {tuple(mine[name].shape)}, the reference's {tuple(tensor.shape)}")
        worst = max(worst, float((mine[name].double() - tensor.double()).abs().max()) if tensor.numel() else 0.0)
    return worst


# -- the verdicts ----------------------------------------------------------------------------------


def _final_difference(result: dict[str, Any], ref_result: dict[str, Any], *, weights_atol: float, loss_rtol: float,
                      facts: dict[str, Any], after: str) -> str | None:
    """Compare a run's final weights and loss with the uninterrupted reference's (recorded in ``facts``):
    None when both are within the tolerances, else why not (``after``: what happened to the run)."""
    try:
        worst = max_weight_difference(Path(result["checkpoint"]), Path(ref_result["checkpoint"]))
        loss, ref_loss = float(result["metrics"]["final_loss"]), float(ref_result["metrics"]["final_loss"])
    except (CheckpointError, ValueError, KeyError, TypeError, OSError) as exc:
        return f"cannot compare the final weights and loss: {type(exc).__name__}: {exc}"
    facts.update(max_weight_difference=worst, final_loss=loss, reference_final_loss=ref_loss)
    if not worst <= weights_atol:
        return (f"{after} a final weight differs by {worst:.3g} from the uninterrupted run's, more than the tolerance "
                f"{weights_atol:g}")
    if not (math.isfinite(loss) and abs(loss - ref_loss) <= loss_rtol * abs(ref_loss)):
        return f"the final loss {loss!r} differs from the uninterrupted run's {ref_loss!r} by more than {loss_rtol:g} of it"
    return None


def judge_kill_resume(reference: RunOutcome, killed: RunOutcome, kill: KillRecord) -> Check:
    """(a): the kill landed while the save was in flight, the group restarted from the newest
    committed checkpoint, every committed checkpoint verifies, and the weights are bitwise the
    uninterrupted run's."""
    facts: dict[str, Any] = {"save_step": kill.save_step, "killed_node": kill.node, "committed_at_kill": kill.committed_step}
    who = f"the worker of node {kill.node}"

    def fail(reason: str) -> Check:
        return Check(guarantee="a", passed=False, reason=reason, facts=facts)

    if not reference.succeeded:
        return fail(reference.failure("uninterrupted reference run"))
    if not kill.torn:
        return fail(f"inconclusive: the kill did not land while the save of step {kill.save_step} was in flight "
                    "(its directory held no files yet, or its manifest was already sealed; the SDK's writer "
                    "waits KILN_CKPT_WRITE_DELAY_S before sealing to widen that window)")
    if not killed.succeeded:
        return fail(f"after SIGKILL of {who} during the save of step {kill.save_step}, " + killed.failure("run"))
    try:
        resumed = restart_point(killed.run_dir)
        ref_sha, got_sha = read_result(reference.run_dir)["weights_sha256"], read_result(killed.run_dir)["weights_sha256"]
    except (RunReadError, KeyError) as exc:
        return fail(f"cannot read the runs: {exc}")
    facts.update(resumed_from_step=resumed, weights_sha256=got_sha, reference_weights_sha256=ref_sha)
    if resumed is None:
        return fail(f"after SIGKILL of {who} the group never started again from a checkpoint "
                    "(rank 0's sample log never goes back): torchrun restarts the group, and the entry point "
                    "must resume from the newest committed checkpoint")
    if resumed != kill.committed_step:
        return fail(f"the restart resumed at step {resumed}, not from the newest committed checkpoint "
                    f"(step {kill.committed_step}) that was on disk when {who} was killed")
    problems = _committed_problems(killed.run_dir)
    if problems:
        return fail(f"a checkpoint that looks committed does not verify: {problems[0]}")
    if got_sha != ref_sha:
        return fail(f"resumed from step {resumed} after SIGKILL of {who} during the save of step "
                    f"{kill.save_step}, it ended with weights {got_sha[:16]}, not the uninterrupted run's {ref_sha[:16]}: "
                    "the resume restored less than the whole state (optimizer, scheduler, loader position, RNGs)")
    return Check(guarantee="a", passed=True, facts=facts,
                 reason=f"{who} SIGKILLed during the save of step {kill.save_step}; resumed from step "
                        f"{resumed}; weights {got_sha[:16]} = the uninterrupted run's")


def judge_world_size_resume(
    reference: RunOutcome, resumed: RunOutcome, *, steps: int, at_step: int, from_world: int, to_world: int,
    weights_atol: float, loss_rtol: float,
) -> Check:
    """(b): the run resumed at ``to_world`` ranks from the reference's step-``at_step`` checkpoint
    trained on exactly the reference's global batches, recorded the change, and ended within
    ``weights_atol`` (every weight) and ``loss_rtol`` (the final loss) of the reference."""
    facts: dict[str, Any] = {"at_step": at_step, "from_world_size": from_world, "to_world_size": to_world,
                             "weights_atol": weights_atol, "loss_rtol": loss_rtol}

    def fail(reason: str) -> Check:
        return Check(guarantee="b", passed=False, reason=reason, facts=facts)

    if not reference.succeeded:
        return fail(reference.failure("uninterrupted reference run"))
    if not resumed.succeeded:
        return fail(f"resumed at world size {to_world} from step {at_step}, " + resumed.failure("run"))
    try:
        ref_result, result = read_result(reference.run_dir), read_result(resumed.run_dir)
        ref_batches, _ = global_batches(reference.run_dir, steps)
        batches, worlds = global_batches(resumed.run_dir, steps)
        records = metrics_records(resumed.run_dir)
    except (RunReadError, KeyError, ValueError) as exc:
        return fail(f"cannot read the runs: {exc}")
    if result.get("world_size") != to_world or result.get("step") != steps:
        return fail(f"the resumed run reports world size {result.get('world_size')} at step {result.get('step')}, "
                    f"not {to_world} at step {steps}")
    if worlds[at_step:] != [to_world] * (steps - at_step):
        return fail(f"the steps after {at_step} were read by world sizes {worlds[at_step:]}, not {to_world}")
    for step, (mine, theirs) in enumerate(zip(batches, ref_batches, strict=True), start=1):
        if mine != theirs:
            return fail(f"step {step} trained on other samples at world size {worlds[step - 1]} than the uninterrupted "
                        f"run: {mine[:6]}... vs {theirs[:6]}...; the global order must not depend on the world size")
    changes = [r for r in records if r.get(METRICS_EVENT_KEY) == WORLD_SIZE_CHANGE_EVENT
               and r.get("to_world_size") == to_world]
    if not changes or changes[-1].get("from_world_size") != from_world or changes[-1].get("at_step") != at_step:
        return fail(f"no {WORLD_SIZE_CHANGE_EVENT} event ({from_world} -> {to_world} ranks at step {at_step}) in "
                    f"{METRICS_JSONL}: a resume at another world size must be recorded")
    why = _final_difference(result, ref_result, weights_atol=weights_atol, loss_rtol=loss_rtol, facts=facts,
                            after=f"after resuming at world size {to_world}")
    if why is not None:
        return fail(why)
    return Check(guarantee="b", passed=True, facts=facts,
                 reason=f"{from_world} -> {to_world} ranks at step {at_step}: the same {steps} global batches, "
                        f"max |dw| {facts['max_weight_difference']:.2g} <= {weights_atol:g}, final loss within "
                        f"{loss_rtol:g}")


def judge_straggler(reference: RunOutcome, *, slow_rank: int, slow_from_step: int) -> Check:
    """(c): rank ``slow_rank``, slowed from ``slow_from_step`` on, is flagged by a ``straggler``
    event in ``metrics.jsonl`` (no other rank is), and kiln's launcher acted on it."""
    facts: dict[str, Any] = {"slow_rank": slow_rank, "slow_from_step": slow_from_step}

    def fail(reason: str) -> Check:
        return Check(guarantee="c", passed=False, reason=reason, facts=facts)

    if not reference.succeeded:
        return fail(reference.failure("run with the slowed rank"))
    try:
        records = metrics_records(reference.run_dir)
    except RunReadError as exc:
        return fail(f"cannot read the run: {exc}")
    flags = [r for r in records if r.get(METRICS_EVENT_KEY) == STRAGGLER_EVENT]
    windows = [r.get("rank_step_times") for r in records if "rank_step_times" in r]
    facts.update(flags=[{"rank": f.get("rank"), "step": f.get("step")} for f in flags], windows=len(windows))
    wrong = [f for f in flags if f.get("rank") != slow_rank]
    if wrong:
        return fail(f"rank {wrong[0].get('rank')} was flagged at step {wrong[0].get('step')}, but only rank {slow_rank} "
                    "was slowed: a rank that waits for a slow peer inside a collective is not slow itself")
    if not flags:
        seen = f"; its windows' per-rank compute seconds were {windows[-3:]}" if windows else (
            "; it recorded no straggler windows (rank_step_times) at all")
        return fail(f"rank {slow_rank} slept in every step from step {slow_from_step} on and was never flagged "
                    f"(no {STRAGGLER_EVENT!r} event in {METRICS_JSONL}){seen}")
    if f"[launcher] straggler: rank {slow_rank}" not in reference.log:
        return fail(f"rank {slow_rank} was flagged in {METRICS_JSONL}, but kiln's launcher never acted on it")
    first = flags[0]
    facts.update(flagged_at_step=first.get("step"), ratio=first.get("ratio"))
    return Check(guarantee="c", passed=True, facts=facts,
                 reason=f"rank {slow_rank} flagged at step {first.get('step')} ({float(first.get('ratio') or 0):.1f}x "
                        "the others' compute), and the launcher acted on it")


def judge_bad_manifest(outcome: RunOutcome, *, manifest: Path, rank: int = 0) -> Check:
    """(d): the trainer, handed a TrainingManifest edited after it was issued, exited 2 before
    training a step; kiln's worker left the fatal marker naming why."""
    facts: dict[str, Any] = {"manifest": str(manifest), "state": outcome.state}

    def fail(reason: str) -> Check:
        return Check(guarantee="d", passed=False, reason=reason, facts=facts)

    markers = fatal_markers(outcome.run_dir)
    facts["markers"] = markers
    trained = [str(d.relative_to(outcome.run_dir)) for _, d in checkpoint_dirs(outcome.run_dir)]
    try:
        steps = [r.get("step") for r in metrics_records(outcome.run_dir) if "loss" in r]
        samples = sum(len(lines) for lines in sample_log(outcome.run_dir).values())
    except RunReadError as exc:
        return fail(f"cannot read the run: {exc}")
    if outcome.state == "EXITED 0":
        return fail(f"the trainer trained on a manifest whose content hash does not match ({manifest}) and exited 0")
    if trained or steps or samples or (outcome.run_dir / RESULT_FILE).exists():
        return fail(f"the trainer got past step 1 on a manifest whose content hash does not match: "
                    f"checkpoints {trained}, logged steps {steps[:3]}, {samples} sample-log lines")
    mine = [m for m in markers if str(m.get("rank")) == str(rank)]
    if not mine or mine[0].get("exit_code") != EXIT_FATAL:
        return fail(f"rank {rank} did not exit {EXIT_FATAL} (no fatal marker from kiln's worker; the run ended "
                    f"{outcome.state}): a manifest that fails its hash is a fault a retry repeats, so torchrun would "
                    "restart it and Airflow retry it")
    error = str(mine[0].get("error") or "")
    if "manifest" not in error.lower():
        return fail(f"rank {rank} exited {EXIT_FATAL}, but the fatal marker's reason ({error!r}) does not name the "
                    "manifest: log the fault at ERROR under the trainer's package or kiln_trainer before exiting")
    return Check(guarantee="d", passed=True, facts=facts,
                 reason=f"exit {EXIT_FATAL} before step 1, fatal marker: {error[:160]}")



def judge_node_loss(
    reference: RunOutcome, shrunk: RunOutcome, loss: NodeLossRecord, *, steps: int, every_steps: int,
    from_world: int, to_world: int, weights_atol: float, loss_rtol: float,
) -> Check:
    """(e): after node ``loss.node`` (agent and worker) was SIGKILLed mid-training with no node to
    replace it, kiln's launcher shrank the job (its record), and the trainer resumed on the
    ``to_world`` ranks left from the newest checkpoint the lost group committed, losing at most a
    checkpoint interval of steps (two when the lost group had trained past a checkpoint step whose
    save was still in flight: asynchronous saving), recorded the change in
    ``result.json``, trained on the reference's global batches and completed within ``weights_atol``
    and ``loss_rtol`` of the uninterrupted reference, its last checkpoint written at ``to_world``."""
    facts: dict[str, Any] = {"lost_node": loss.node, "committed_at_loss": loss.committed_step,
                             "from_world_size": from_world,
                             "to_world_size": to_world, "every_steps": every_steps, "weights_atol": weights_atol,
                             "loss_rtol": loss_rtol}
    who = f"node {loss.node} (its agent and worker)"

    def fail(reason: str) -> Check:
        return Check(guarantee="e", passed=False, reason=reason, facts=facts)

    if not reference.succeeded:
        return fail(reference.failure("uninterrupted reference run"))
    if loss.agent_pid is None:
        return fail(f"inconclusive: {who} was never killed: the kill waits for every node's agent and worker and "
                    f"a committed checkpoint of step {every_steps} before training ends; "
                    + (shrunk.failure("run") if not shrunk.succeeded else "the run ended first"))
    if not shrunk.succeeded:
        return fail(f"after {who} was SIGKILLed with step {loss.committed_step} committed and no node to replace it, "
                    + shrunk.failure("run"))
    try:
        shrinks = recorded_shrinks(shrunk.run_dir)
    except LaunchError as exc:
        return fail(f"cannot read the launcher's elastic record: {exc}")
    facts["shrinks"] = [s.in_words() for s in shrinks]
    if not shrinks:
        if "after training finished" in shrunk.reason:
            return fail(f"inconclusive: {who} was lost after training had finished ({shrunk.reason}); the kit slows a "
                        "rank (KILN_FAULT_SLOW_RANK) from the step after the first checkpoint to keep the job "
                        "training while it kills")
        return fail(f"kiln's launcher recorded no elastic shrink after losing {who} (its log: "
                    f"{shrunk.failure('run')})")
    if [(s.from_nodes, s.to_nodes) for s in shrinks] != [(from_world, to_world)]:
        return fail(f"kiln's launcher recorded the shrinks {facts['shrinks']}, not one of {from_world} -> {to_world} "
                    "node(s)")
    try:
        result, ref_result = read_result(shrunk.run_dir), read_result(reference.run_dir)
        events = result.get("events")
        changes = [e for e in (events if isinstance(events, list) else [])
                   if isinstance(e, dict) and e.get("kind") == WORLD_SIZE_CHANGE_EVENT]
        worlds_written = committed_worlds(shrunk.run_dir)
        started = last_step_read(shrunk.run_dir, from_world)
    except (RunReadError, KeyError, TypeError, ValueError) as exc:
        return fail(f"cannot read the run: {exc}")
    facts.update(world_size=result.get("world_size"), step=result.get("step"), completed=result.get("completed"),
                 checkpoints={str(k): v for k, v in sorted(worlds_written.items())})
    if not (result.get("completed") is True and result.get("step") == steps and result.get("world_size") == to_world):
        return fail(f"after the shrink the result reports completed={result.get('completed')} at step "
                    f"{result.get('step')} on world size {result.get('world_size')}, not a completed {steps} steps on "
                    f"{to_world}")
    if not changes or changes[-1].get("from_world_size") != from_world or changes[-1].get("to_world_size") != to_world:
        return fail(f"result.json's events hold no {WORLD_SIZE_CHANGE_EVENT} from {from_world} to {to_world} ranks "
                    f"({changes}): the resume on the ranks left must be recorded")
    at_step = changes[-1].get("at_step")
    before = [step for step, world in worlds_written.items() if world == from_world]
    newest = max(before, default=None)
    lost: int | None = None
    in_flight: list[int] = []
    if isinstance(at_step, int) and started is not None:
        lost = started - at_step
        # Checkpoint steps the lost group trained past (it had started a later step) that never
        # committed: their saves were in flight when it went, which asynchronous saving allows.
        in_flight = [step for step in range(at_step + 1, started) if step % every_steps == 0]
    bound = every_steps * (2 if in_flight else 1)
    facts.update(resumed_at_step=at_step, newest_committed_before_shrink=newest, last_step_started=started,
                 steps_lost=lost, saves_in_flight=in_flight, steps_lost_bound=bound)
    if not isinstance(at_step, int) or at_step != newest or (loss.committed_step or 0) > at_step:
        return fail(f"the ranks left resumed at step {at_step}, not from the newest checkpoint the lost group "
                    f"committed (step {newest}; step {loss.committed_step} was committed when {who} was lost)")
    if lost is None or not 0 <= lost <= bound:
        return fail(f"the lost group had started step {started} and the ranks left resumed at step {at_step}: "
                    f"{lost} steps lost, more than a checkpoint interval of {every_steps} allows ({bound}, with the "
                    f"saves of steps {in_flight} in flight)")
    final = max(worlds_written, default=None)
    if final != steps or worlds_written[final] != to_world:
        return fail(f"the last committed checkpoint is step {final} written at world size "
                    f"{worlds_written.get(final) if final is not None else None}, not step {steps} at {to_world}")
    problems = _committed_problems(shrunk.run_dir)
    if problems:
        return fail(f"a checkpoint that looks committed does not verify: {problems[0]}")
    try:
        ref_batches, _ = global_batches(reference.run_dir, steps)
        batches, _ = global_batches(shrunk.run_dir, steps,
                                    world_at=lambda step: from_world if step < at_step else to_world)
    except (RunReadError, KeyError, ValueError) as exc:
        return fail(f"cannot read the sample log: {exc}")
    for step, (mine, theirs) in enumerate(zip(batches, ref_batches, strict=True), start=1):
        if mine != theirs:
            return fail(f"step {step} trained on other samples than the uninterrupted run: {mine[:6]}... vs "
                        f"{theirs[:6]}...; after the shrink the ranks left must go on with the same global batches")
    why = _final_difference(result, ref_result, weights_atol=weights_atol, loss_rtol=loss_rtol, facts=facts,
                            after="after the shrink")
    if why is not None:
        return fail(why)
    worst = facts["max_weight_difference"]
    return Check(guarantee="e", passed=True, facts=facts,
                 reason=f"{who} SIGKILLed at step {started}; the launcher shrank {from_world} -> {to_world} node(s); "
                        f"resumed at world size {to_world} from step {at_step} ({lost} step(s) lost, bound {bound}); "
                        f"completed {steps} steps on the same global batches, max |dw| {worst:.2g} <= {weights_atol:g}")


__all__ = ["GUARANTEES", "Check", "KillRecord", "NodeLossRecord", "RunOutcome", "RunReadError", "committed_worlds",
           "global_batches", "judge_bad_manifest", "judge_kill_resume", "judge_node_loss", "judge_straggler",
           "judge_world_size_resume", "last_step_read", "max_weight_difference", "metrics_records", "read_result",
           "restart_point", "sample_log"]
