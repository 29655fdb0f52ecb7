"""The MLflow server killed during registration or promotion, then restarted (``mlflow``).

A real ``mlflow server`` (``kiln.stack.mlflow_server``: SQLite backend, local artifacts) and a real tiny
checkpoint exported with ``kiln_trainer.export``. Each trial registers a candidate and promotes it
under a production-like policy (candidate model → copy into the target model → tags → ``previous``
→ ``champion`` last), sometimes over an existing champion. The server is SIGKILLed at a seeded
registry write (just before or just after it is sent) of the registration or of the promotion; it
is then started again on the same port and store, and the operation re-run as an Airflow retry
would — twice, the second time after success. Counted: versions per run key in the candidate and
the target model (duplicates, goal 0), MLflow runs per run key, and half-promoted models (goal 0):
an alias on a version whose promotion tags are incomplete, at any point a reader could look —
right after the crash and after the re-runs.

The kill point is found with a counting wrapper around the client kiln.registry uses
(``registry.mlflow_io._client``) and around ``mlflow.register_model``: the product has no hook of its own for
this, and the wrapper changes nothing but when the server dies.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kiln.runs import CHECKPOINTS_SUBDIR, RUN_KEY_TAG, experiment_name, run_key_filter
from kiln.settings import restore_environ
from kiln_devtools.chaos.core import Context, Family, TrialResult, outcome_line, total, trial_rng
from kiln_devtools.chaos.fixtures import SNAPSHOT_ID, clean_manifest, run_trainer

WRITES = frozenset({
    "set_model_version_tag", "set_registered_model_alias", "copy_model_version", "create_model_version",
    "delete_registered_model_alias", "delete_model_version", "update_model_version", "create_registered_model",
    "set_tag", "log_metric", "log_dict", "log_text", "log_artifact", "create_run", "set_terminated", "update_run",
    "create_experiment", "register_model",
})
PROMOTION_TAGS = ("promotion_run_key", "approver", "approved_at", "previous_version", "source_version", "decision")


class _Counting:
    """The registry's client, with ``hook(name)`` called around every write (``before``/``after``)."""

    def __init__(self, inner: Any, hook: Callable[[str, str], None]) -> None:
        self._inner, self._hook = inner, hook

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in WRITES:
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            self._hook(name, "before")
            result = attr(*args, **kwargs)
            self._hook(name, "after")
            return result

        return write


class KillPoint:
    """Counts writes; at write ``at`` (1-based), ``when`` = before|after it, calls ``kill`` once."""

    def __init__(self, at: int | None, when: str, kill: Callable[[], None]) -> None:
        self.at, self.when, self.kill = at, when, kill
        self.writes: list[str] = []
        self.fired: str | None = None

    def __call__(self, name: str, moment: str) -> None:
        if moment == "before":
            self.writes.append(name)
        if self.fired is None and self.at is not None and len(self.writes) == self.at and moment == self.when:
            self.fired = f"{moment} write {self.at} ({name})"
            self.kill()


@contextmanager
def injected(point: KillPoint) -> Iterator[None]:
    import mlflow

    from kiln import registry

    real_client, real_register = registry.mlflow_io._client, mlflow.register_model

    def register_model(*args: Any, **kwargs: Any) -> Any:
        point("register_model", "before")
        result = real_register(*args, **kwargs)
        point("register_model", "after")
        return result

    def counting_client() -> Any:  # a stand-in for the MlflowClient: it counts the writes, then passes them on
        return _Counting(real_client(), point)

    registry.mlflow_io._client = counting_client
    mlflow.register_model = register_model
    try:
        yield
    finally:
        registry.mlflow_io._client = real_client
        mlflow.register_model = real_register


START_LIMIT_S = 300.0
"""A safety net for a loaded 2-core machine (the server's own default, 90 s, ran out at load 25)."""


class _Server:
    def __init__(self, home: Path) -> None:
        from kiln.stack.mlflow_server import start_server
        from kiln.util.net import free_port

        self.handle = start_server(home, free_port(), timeout_s=START_LIMIT_S)

    def kill(self) -> None:
        from kiln.stack.mlflow_server import kill_server

        kill_server(self.handle)

    def ensure_up(self) -> None:
        from kiln.stack.mlflow_server import restart_server

        if self.handle.poll() is not None:
            self.handle = restart_server(self.handle, timeout_s=START_LIMIT_S)


@dataclasses.dataclass
class _Candidate:
    kwargs: dict[str, Any]
    bits_per_byte: float


def _candidate(step_dir: Path, manifest_path: Path, bits_per_byte: float) -> _Candidate:
    import math

    from kiln.refs import EvalReport, SnapshotRef, TrainingManifest, TrainResult
    from kiln_trainer.checkpoint_manifest import manifest_sha256, verify_checkpoint

    v = verify_checkpoint(step_dir)
    train = TrainResult(run_dir=str(step_dir.parents[1]), checkpoint=str(step_dir),
                        checkpoint_manifest_sha256=manifest_sha256(step_dir), weights_sha256=v["weights_sha256"],
                        step=v["step"], metrics={"final_loss": 2.0}, world_size=v["world_size"], total_steps=v["step"],
                        completed=True, recipe_sha256=v["recipe_sha256"], snapshot_id=v["snapshot_id"],
                        training_manifest_sha256=v["training_manifest_sha256"])
    report = EvalReport(checkpoint=str(step_dir), weights_sha256=v["weights_sha256"], split="eval",
                        bits_per_byte=bits_per_byte, loss=bits_per_byte * math.log(2), tokens=4096)
    snapshot = SnapshotRef(id=SNAPSHOT_ID, corpus="stdlib-py", files=3, bytes=1, dvc="", remote="", path="")
    return _Candidate(kwargs={"train": train, "eval_report": report, "snapshot": snapshot,
                              "manifest": TrainingManifest.read(manifest_path)}, bits_per_byte=bits_per_byte)


def _policy(name: str) -> Any:
    from kiln.policy import PRODUCTION

    return dataclasses.replace(PRODUCTION, candidate_model=f"{name}.candidates", target_model=name,
                               writable_models=(f"{name}.candidates", name))


def _register(policy: Any, cand: _Candidate, key: str) -> dict[str, Any]:
    from kiln import registry

    return registry.register_candidate(policy=policy, run_key=key, **cand.kwargs)


def _approve(policy: Any, version: str, key: str) -> None:
    """What the run's approval task records when a reviewer approves (a task apart from promote)."""
    from kiln import registry

    registry.record_review(policy=policy, candidate_version=version, run_key=key, outcome="approved",
                           reviewer=policy.reviewers[-1], at=registry.utc_now())


def _promote(policy: Any, version: str, cand: _Candidate, key: str) -> Any:
    from kiln import registry

    decision = registry.decide(cand.kwargs["eval_report"], registry.champion_report(policy), policy.gate)
    return registry.promote(policy=policy, candidate_version=version, decision=decision, run_key=key)


def _versions(client: Any, model: str, key: str) -> list[Any]:

    try:
        found = client.search_model_versions(f"name = '{model}'")
    except Exception:  # the model does not exist (yet)
        return []
    return [mv for mv in found if mv.tags.get(RUN_KEY_TAG) == key]


def half_promoted(client: Any, policy: Any) -> list[str]:
    """Aliases of the target model that point at a version without its complete promotion tags."""
    from kiln import registry

    try:
        aliases = dict(client.get_registered_model(policy.target_model).aliases)
    except Exception:
        return []
    problems = []
    for alias, version in aliases.items():
        tags = client.get_model_version(policy.target_model, version).tags
        missing = [t for t in PROMOTION_TAGS if registry.TAGS[t] not in tags]
        if missing:
            problems.append(f"alias {alias!r} on version {version} lacks {missing}")
    return problems


def plan_mlflow(seed: int, index: int, counts: dict[str, int]) -> dict[str, Any]:
    rng = trial_rng(seed, "mlflow", index)
    phase = ("register", "promote")[index % 2]
    champion = rng.random() < 0.5
    limit = counts[f"{phase}_{'champion' if champion else 'first'}"]
    return {"phase": phase, "champion": champion, "at": rng.randint(1, limit), "when": rng.choice(("before", "after")),
            "of": limit}


def mlflow_trial(ctx: Context, index: int, server: _Server, cand_inputs: tuple[Path, Path],
                 counts: dict[str, int]) -> TrialResult:
    from mlflow import MlflowClient

    from kiln import registry

    plan = plan_mlflow(ctx.seed, index, counts)
    name = f"chaos-{ctx.seed}-{index}"
    policy = _policy(name)
    champ, cand = _candidate(*cand_inputs, 3.0), _candidate(*cand_inputs, 2.5)
    key = f"kiln_production/chaos-{ctx.seed}-{index}"
    client = MlflowClient(tracking_uri=server.handle.url)
    if plan["champion"]:
        champion = _register(policy, champ, f"{key}-champion")
        _approve(policy, champion["version"], f"{key}-champion")
        _promote(policy, champion["version"], champ, f"{key}-champion")
    fault = (f"MLflow server SIGKILLed {plan['when']} registry write {plan['at']}/{plan['of']} of the {plan['phase']}"
             + (" (over a champion)" if plan["champion"] else " (first model)"))
    point = KillPoint(plan["at"], plan["when"], server.kill)
    facts: dict[str, Any] = {"phase": plan["phase"]}
    losses: list[str] = []
    error = ""
    ref: dict[str, Any] | None = None
    try:
        if plan["phase"] == "register":
            with injected(point):
                ref = _register(policy, cand, key)
            ref = None  # (in case the kill came after the last write: re-run below as if it failed)
        else:
            ref = _register(policy, cand, key)
            _approve(policy, ref["version"], key)
            with injected(point):
                _promote(policy, ref["version"], cand, key)
    except Exception as exc:  # what an Airflow task would see: it fails and is retried
        error = f"{type(exc).__name__}: {str(exc)[:200]}"
    facts["crashed"] = point.fired is not None
    facts["failed"] = bool(error)
    if point.fired and not error:
        fault += " — the operation had already sent its last write"
    server.ensure_up()
    client = MlflowClient(tracking_uri=server.handle.url)
    visible = half_promoted(client, policy)
    facts["half_promoted_after_crash"] = len(visible)
    losses += [f"right after the crash: {p}" for p in visible]
    for attempt in (1, 2):  # the Airflow retry, then a re-run after success
        ref = _register(policy, cand, key)
        if attempt == 1 and plan["phase"] == "register":
            _approve(policy, ref["version"], key)  # the approval task, once registration completed
        _promote(policy, ref["version"], cand, key)
    candidates, copies = _versions(client, policy.candidate_model, key), _versions(client, policy.target_model, key)
    facts["duplicate_versions"] = max(0, len(candidates) - 1) + max(0, len(copies) - 1)
    if len(candidates) != 1 or len(copies) != 1:
        losses.append(f"versions for the run key: {len(candidates)} candidate(s), {len(copies)} cop(ies) (want 1 and 1)")
    experiment = client.get_experiment_by_name(experiment_name(policy))
    assert experiment is not None, "the registrations above created it"
    runs = client.search_runs([experiment.experiment_id], filter_string=run_key_filter(key))
    facts["duplicate_runs"] = max(0, len(runs) - 1)
    if len(runs) != 1:
        losses.append(f"{len(runs)} MLflow runs for the run key (want 1)")
    aliases = dict(client.get_registered_model(policy.target_model).aliases)
    if copies and aliases.get(policy.alias) != str(copies[0].version):
        losses.append(f"after the re-runs {policy.alias!r} is on {aliases.get(policy.alias)}, not the copy {copies[0].version}")
    if plan["champion"] and aliases.get(registry.PREVIOUS_ALIAS) != "1":
        losses.append(f"'previous' is on {aliases.get(registry.PREVIOUS_ALIAS)}, not the old champion (1)")
    final = half_promoted(client, policy)
    facts["half_promoted"] = len(visible) + len(final)
    losses += [f"after the re-runs: {p}" for p in final]
    facts["error"] = error
    return TrialResult(family="mlflow", index=index, seed=ctx.seed, outcome="lost" if losses else "recovered",
                       fault=fault, facts=facts, losses=losses)


def _calibrate(server: _Server, cand_inputs: tuple[Path, Path], seed: int) -> dict[str, int]:
    """Writes per operation: first model, and over a champion (the kill point is drawn within them)."""
    counts = {}
    policy = _policy(f"chaos-{seed}-calibration")
    for label, bpb in (("first", 3.0), ("champion", 2.5)):
        cand = _candidate(*cand_inputs, bpb)
        key = f"kiln_production/chaos-{seed}-calibration-{label}"
        point = KillPoint(None, "before", server.kill)
        with injected(point):
            ref = _register(policy, cand, key)
        counts[f"register_{label}"] = len(point.writes)
        _approve(policy, ref["version"], key)
        point = KillPoint(None, "before", server.kill)
        with injected(point):
            _promote(policy, ref["version"], cand, key)
        counts[f"promote_{label}"] = len(point.writes)
    return counts


def run_mlflow(ctx: Context, indices: list[int]) -> list[TrialResult]:
    import mlflow

    folder = ctx.work / "mlflow"
    folder.mkdir(parents=True, exist_ok=True)
    manifest = clean_manifest(folder / "corpus")
    trained = run_trainer(manifest, folder / "run", ["train.steps=10", "checkpoint.every_steps=10", "train.log_every=10",
                                                      "optim.warmup_steps=2"])
    if trained.returncode != 0:
        raise RuntimeError(f"the checkpoint run failed (exit {trained.returncode}): {trained.stderr[-2000:]}")
    step_dir = folder / "run" / CHECKPOINTS_SUBDIR / "step-00000010"
    env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "KILN_REGISTRY_RETRIES": "1",
           "KILN_REGISTRY_BACKOFF_S": "0.2"}
    saved = {k: os.environ.get(k) for k in (*env, "MLFLOW_TRACKING_URI")}
    server = _Server(folder / "server")
    previous_uri = mlflow.get_tracking_uri()
    os.environ.update({**env, "MLFLOW_TRACKING_URI": server.handle.url})
    mlflow.set_tracking_uri(server.handle.url)  # the port stays the same across restarts
    results = []
    try:
        counts = _calibrate(server, (step_dir, manifest), ctx.seed)
        ctx.log(f"  mlflow: registry writes per operation {counts}")
        for index in indices:
            started = time.monotonic()
            try:
                result = mlflow_trial(ctx, index, server, (step_dir, manifest), counts)
            except Exception as exc:
                server.ensure_up()
                result = TrialResult(family="mlflow", index=index, seed=ctx.seed, outcome="error",
                                     fault=str(plan_mlflow(ctx.seed, index, counts)),
                                     detail=f"{type(exc).__name__}: {exc}")
            result.seconds = round(time.monotonic() - started, 1)
            results.append(result)
            ctx.log(f"  {result.name:<12} {result.outcome:<9} {result.fault}  ({result.seconds:.0f}s)")
    finally:
        from kiln.stack.mlflow_server import stop_server

        stop_server(server.handle)
        mlflow.set_tracking_uri(previous_uri)
        restore_environ(saved)
    shutil.rmtree(folder / "run", ignore_errors=True)
    return results


def summarize_mlflow(results: list[TrialResult]) -> list[str]:
    phases = {p: sum(r.facts.get("phase") == p for r in results) for p in ("register", "promote")}
    return [
        outcome_line(results),
        f"server killed during registration: {phases['register']}, during promotion: {phases['promote']}; "
        f"operations that failed and were re-run: {sum(bool(r.facts.get('failed')) for r in results)}",
        f"duplicate versions: {total(results, 'duplicate_versions')} (goal 0); duplicate MLflow runs: "
        f"{total(results, 'duplicate_runs')}",
        f"half-promoted models (an alias on a version without its full promotion tags, right after the crash or "
        f"after the re-runs): {total(results, 'half_promoted')} (goal 0)",
    ]


MLFLOW = Family(name="mlflow", title="MLflow server killed during registration or promotion, then restarted",
                goals="duplicate versions 0; half-promoted models 0", default_trials=4, run=run_mlflow,
                summarize=summarize_mlflow)
