"""kiln's conformance kit: kiln's guarantees, run against the trainer a recipe names.

Point it at a recipe whose ``trainer`` is your entry point (``docs/trainer-contract.md``) and a
TrainingManifest (any run's ``RUN/training_manifest.json``)::

    python -m kiln.conformance --recipe my_lm.toml --manifest M.json --work-dir /tmp/kit \\
        [--set section.key=value ...] [--only a,b,c,d,e]

(``kiln conformance`` is the same command.) It runs the trainer as kiln runs it, under torchrun with
kiln's worker on every rank (``kiln.conformance.runs``), and checks (``kiln.conformance.checks``):

(a) a SIGKILL of a rank mid-save, then the group's restart, ends with bitwise the weights of an
    uninterrupted run at the same world size;
(b) a resume at another world size (2 -> 1 ranks) trains on the same global sample sequence and
    ends within ``weights_atol`` of every weight and ``loss_rtol`` of the final loss;
(c) a straggler (a rank slowed by kiln's fault injection) is flagged;
(d) a TrainingManifest edited after it was issued is refused before step 1: exit 2 with kiln's
    fatal marker naming it;
(e) a node lost mid-training (its agent and worker SIGKILLed, nothing to replace it): kiln's
    launcher shrinks the job onto the nodes left, which resume from the newest committed
    checkpoint (at most a checkpoint interval of steps lost), record the change and complete on the
    reference's global batches within ``weights_atol`` and ``loss_rtol``.

Runs, each in its folder under the work dir: ``reference`` (uninterrupted, 2 one-rank nodes, its
last rank slowed for (c): sleeping changes no weight, so it is also the reference of (a), (b) and
(e)), ``kill-mid-save`` (a), ``world-size-1`` (b: a copy of the reference's first checkpoint,
resumed on one rank), ``bad-manifest`` (d) and ``node-loss`` (e: the elastic launch of kiln's local
launcher, ``min_nodes`` one fewer than the nodes, no spare node). The kit sets ``train.steps``,
``checkpoint.*`` and ``stragglers.*`` itself; ``--set`` shrinks the rest (a smaller model, a shorter
BPE training) and must leave those alone. A trainer on kiln's SDK honours the switches the kit uses (the sample log,
the save delay, the slow rank); a trainer of its own must honour them too (the contract names them).

Exit 0 when the trainer keeps every guarantee asked for, 1 naming each one it broke and why, 2 for
a bad argument. ``run_kit`` is the same from Python (tests/integration/test_conformance.py).
Nothing here imports Airflow: it runs wherever kiln's worker runs (the trainer image included).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.conformance.checks import (
    GUARANTEES,
    Check,
    KillRecord,
    NodeLossRecord,
    RunOutcome,
    judge_bad_manifest,
    judge_kill_resume,
    judge_node_loss,
    judge_straggler,
    judge_world_size_resume,
)
from kiln.conformance.runs import Runner, edited_manifest, resumable_copy, slow_rank_env, write_delay_env
from kiln.errors import ConfigError, ManifestError
from kiln_trainer.contract import RecipeError

__all__ = ["GUARANTEES", "KIT_KEYS", "Check", "KitReport", "KitSpec", "run_kit"]

KIT_KEYS = ("train.steps", "checkpoint.every_steps", "checkpoint.keep_last", "stragglers.every_steps",
            "stragglers.windows", "stragglers.factor")
"""The recipe keys the kit sets itself (its ``--set`` may not)."""
STRAGGLER_WINDOWS = 2
STRAGGLER_FACTOR = 3.0
"""A window a step, flagged after 2 windows above 3x the other ranks' median: the slowed rank's
sleep is 5-30x a tiny model's step, and a busy 2-core host's noise stays under 3x."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KitSpec:
    """What the kit runs: the trainer a recipe names, on a TrainingManifest, and how hard."""

    recipe: Path
    """A recipe TOML naming the trainer (``trainer = "my_lm.train:main"`` or ``kiln``)."""
    manifest: Path
    """A TrainingManifest kiln issued (the data every run trains on)."""
    work_dir: Path
    """Where the runs go, one folder each; must not hold a previous kit's runs."""
    overrides: tuple[str, ...] = ()
    """``section.key=value`` on top of the recipe, for every run (not ``KIT_KEYS``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """More environment for every rank (e.g. ``PYTHONPATH`` reaching your package)."""
    steps: int = 6
    """Steps of every run."""
    every_steps: int = 2
    """Checkpoint interval: (a) kills during the save of step ``2 * every_steps`` and must resume from
    step ``every_steps``; (b) resumes the reference's step-``every_steps`` checkpoint."""
    world_size: int = 2
    """Ranks of the reference, one per node (>= 2: a straggler needs peers)."""
    resume_world_size: int = 1
    """Ranks (b) resumes on."""
    weights_atol: float = 1e-5
    """(b), (e): the largest |difference| of any final weight allowed after the change of world size
    (the gradient reduction order changes; kiln's trainers measure under 3e-7 here, docs/checkpointing.md)."""
    loss_rtol: float = 1e-5
    """(b), (e): the final loss's relative difference allowed."""
    slow_s: float = 0.5
    """(c): seconds the last rank of the reference sleeps in every step (a tiny model's step is
    10-50 ms here: well over the factor of 3 even when a busy host slows the other ranks)."""
    write_delay_s: float = 1.5
    """(a): seconds rank 0 waits before sealing each checkpoint, the window the kill lands in."""
    guarantees: tuple[str, ...] = tuple(GUARANTEES)
    """The letters to run (``GUARANTEES``)."""
    timeout_s: float = 600.0
    """A run still going after this long is cancelled (and its check fails)."""

    def __post_init__(self) -> None:
        unknown = [g for g in self.guarantees if g not in GUARANTEES]
        if unknown or not self.guarantees:
            raise ConfigError(f"guarantees must be some of {sorted(GUARANTEES)}, got {list(self.guarantees)}")
        if self.every_steps < 1 or self.steps < 2 * self.every_steps:
            raise ConfigError(f"steps ({self.steps}) must be at least 2 x every_steps ({self.every_steps}), every_steps >= 1: "
                              "(a) kills the save of step 2 x every_steps")
        if self.world_size < 2:
            raise ConfigError(f"world_size must be >= 2 (a straggler needs peers, a resume another world), got {self.world_size}")
        if not 1 <= self.resume_world_size != self.world_size:
            raise ConfigError(f"resume_world_size must be >= 1 and differ from world_size {self.world_size}, "
                              f"got {self.resume_world_size}")
        if not (self.weights_atol >= 0 and self.loss_rtol >= 0 and self.slow_s > 0 and self.write_delay_s > 0
                and self.timeout_s > 0):
            raise ConfigError("weights_atol and loss_rtol must be >= 0, slow_s, write_delay_s and timeout_s > 0")
        owned = [o for o in self.overrides if o.split("=", 1)[0].strip() in KIT_KEYS]
        if owned:
            raise ConfigError(f"the kit sets {', '.join(KIT_KEYS)} itself; drop {owned} (steps and every_steps are "
                              "the kit's own settings)")

    @property
    def replacement_timeout_s(self) -> int:
        """(e): how long the nodes left wait for a replacement that never comes. One survivor: torch's
        shortest last call (1 s); several: long enough that one slow to restart is not left behind
        (a group that formed without it would grow back at once, docs/launchers.md)."""
        return 1 if self.world_size == 2 else 5

    @property
    def run_overrides(self) -> tuple[str, ...]:
        return (*self.overrides, f"train.steps={self.steps}", f"checkpoint.every_steps={self.every_steps}",
                f"checkpoint.keep_last={self.steps // self.every_steps + 1}", "stragglers.every_steps=1",
                f"stragglers.windows={STRAGGLER_WINDOWS}", f"stragglers.factor={STRAGGLER_FACTOR}")

    def runner(self) -> Runner:
        return Runner(recipe=self.recipe, manifest=self.manifest, work_dir=self.work_dir,
                      overrides=self.run_overrides, env=self.env, timeout_s=self.timeout_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class KitReport:
    """The kit's verdicts on one trainer, with where each run went and how long it took."""

    trainer: str
    recipe: str
    manifest: str
    work_dir: str
    checks: tuple[Check, ...]
    runs: dict[str, dict[str, Any]]
    """Per run: ``run_dir``, ``state``, ``seconds``."""
    seconds: float

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def check(self, guarantee: str) -> Check:
        return next(c for c in self.checks if c.guarantee == guarantee)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "kiln.ConformanceReport", "passed": self.passed, "trainer": self.trainer, "recipe": self.recipe,
                "manifest": self.manifest, "work_dir": self.work_dir, "checks": [c.to_json() for c in self.checks],
                "runs": self.runs, "seconds": self.seconds}


def check_inputs(kit: KitSpec) -> str:
    """Before any run: the recipe (with the kit's overrides) and its trainer resolve, the manifest
    is one the launchers accept, the work dir holds no earlier kit run. Returns the trainer's spec;
    ``ConfigError`` naming what is wrong."""
    from kiln.launchers.base import check_manifest, check_recipe
    from kiln_trainer.contract.entrypoint import read_recipe_trainer

    spec = kit.runner().spec("reference", nodes=kit.world_size)
    check_recipe(spec)
    try:
        check_manifest(spec)
    except ManifestError as exc:
        raise ConfigError(f"--manifest {exc}") from exc
    taken = [p.name for p in (kit.work_dir.iterdir() if kit.work_dir.is_dir() else ()) if not p.name.startswith(".")]
    if taken:
        raise ConfigError(f"work dir {kit.work_dir} is not empty ({sorted(taken)[:4]}): the kit's runs would resume "
                          "from what is there; give it an empty or new folder")
    try:
        return read_recipe_trainer(kit.recipe, kit.run_overrides).train
    except RecipeError as exc:
        raise ConfigError(str(exc)) from exc


def run_kit(kit: KitSpec, *, log: Callable[[str], None] = print) -> KitReport:
    """Run the guarantees ``kit.guarantees`` against the recipe's trainer; every verdict is in the
    report (a broken guarantee is a failed ``Check``, not an exception). ``ConfigError`` before any
    run for a bad input.

    The reference runs alone (its straggler windows time the ranks); the runs of (a), (b), (d) and
    (e) then run side by side: none of them is timed, and each checks bits or states that do not
    depend on the machine's load (one thread a rank), so they share the cores rather than wait in
    turn ((e)'s run spends 16 s waiting for torch's rendezvous to drop the lost node)."""
    started = time.monotonic()
    trainer = check_inputs(kit)
    kit.work_dir.mkdir(parents=True, exist_ok=True)
    runner = kit.runner()
    wanted = set(kit.guarantees)
    outcomes: dict[str, RunOutcome] = {}

    def ran(name: str, outcome: RunOutcome) -> RunOutcome:
        outcomes[name] = outcome
        log(f"[conformance] {name}: {outcome.state} in {outcome.seconds:.1f} s ({outcome.run_dir})")
        return outcome

    world, every = kit.world_size, kit.every_steps
    reference = RunOutcome(run_dir=kit.work_dir / "reference", state="NOT RUN")
    if wanted & {"a", "b", "c", "e"}:
        slow = slow_rank_env(world - 1, kit.slow_s, 1) if "c" in wanted else {}
        reference = ran("reference", runner.launch(runner.spec("reference", nodes=world, env=slow)))

    def kill_mid_save() -> Check:
        kill = KillRecord(save_step=2 * every, torn=False, committed_step=None, node=0, pid=None)
        killed = RunOutcome(run_dir=kit.work_dir / "kill-mid-save", state="NOT RUN")
        if reference.succeeded:
            spec = runner.spec("kill-mid-save", nodes=world, env=write_delay_env(kit.write_delay_s), max_restarts=1)
            killed, kill = runner.launch_and_kill_mid_save(spec, committed_step=every, save_step=2 * every)
            ran("kill-mid-save", killed)
        return judge_kill_resume(reference, killed, kill)

    def resume_at_another_world_size() -> Check:
        name = f"world-size-{kit.resume_world_size}"
        resumed = RunOutcome(run_dir=kit.work_dir / name, state="NOT RUN")
        if reference.succeeded:
            resumable_copy(reference.run_dir, kit.work_dir / name, every)
            resumed = ran(name, runner.launch(runner.spec(name, nodes=kit.resume_world_size)))
        return judge_world_size_resume(reference, resumed, steps=kit.steps, at_step=every, from_world=world,
                                       to_world=kit.resume_world_size, weights_atol=kit.weights_atol,
                                       loss_rtol=kit.loss_rtol)

    def refuse_bad_manifest() -> Check:
        edited = edited_manifest(kit.manifest, kit.work_dir / "edited-manifest.json")
        bad = ran("bad-manifest", runner.torchrun(runner.spec("bad-manifest", nodes=1, manifest=edited)))
        return judge_bad_manifest(bad, manifest=edited)

    def lose_a_node() -> Check:
        loss = NodeLossRecord(node=0, agent_pid=None, worker_pid=None, committed_step=None)
        shrunk = RunOutcome(run_dir=kit.work_dir / "node-loss", state="NOT RUN")
        if reference.succeeded:
            # Nothing replaces the lost node (spare_nodes=0) and one node fewer may go on; the last
            # rank sleeps from the step after the first checkpoint, so the job is still training
            # when the kill lands (and the rank is gone once the job shrinks: the survivors run at
            # full speed). One group restart: the survivors' re-rendezvous.
            spec = runner.spec("node-loss", nodes=world, env=slow_rank_env(world - 1, kit.slow_s, every + 1),
                               max_restarts=1, min_nodes=world - 1, spare_nodes=0,
                               replacement_timeout_s=kit.replacement_timeout_s)
            shrunk, loss = runner.launch_and_lose_node(spec, committed_step=every)
            ran("node-loss", shrunk)
        return judge_node_loss(reference, shrunk, loss, steps=kit.steps, every_steps=every, from_world=world,
                               to_world=world - 1, weights_atol=kit.weights_atol, loss_rtol=kit.loss_rtol)

    plan: dict[str, Callable[[], Check]] = {"a": kill_mid_save, "b": resume_at_another_world_size,
                                            "d": refuse_bad_manifest, "e": lose_a_node}
    with ThreadPoolExecutor(max_workers=len(plan)) as pool:
        futures = {letter: pool.submit(job) for letter, job in plan.items() if letter in wanted}
        checks = [future.result() for future in futures.values()]
    if "c" in wanted:
        checks.append(judge_straggler(reference, slow_rank=world - 1, slow_from_step=1))
    checks.sort(key=lambda c: c.guarantee)
    for check in checks:
        log(f"[conformance] {check.line()}")
    return KitReport(trainer=trainer, recipe=str(kit.recipe), manifest=str(kit.manifest), work_dir=str(kit.work_dir),
                     checks=tuple(checks), seconds=time.monotonic() - started,
                     runs={name: {"run_dir": str(o.run_dir), "state": o.state, "seconds": round(o.seconds, 2)}
                           for name, o in outcomes.items()})
