"""``kiln reproduce``: re-derive a registered version from its signed provenance statement, or refuse.

    reproduce("kiln-stdlib-lm", "champion", by="alias", policy="production")   # a Reproduction (a value)

In order, stopping at the first that does not hold:

1. the version verifies for ``policy`` (``kiln.registry.verify``: signatures, every file's bytes, tags);
   an unverified version is refused, nothing is derived from a statement nobody can stand behind;
2. the statement records what every step needs (``missing_records``); what it lacks is named, never
   guessed;
3. the installed ``kiln`` and ``kiln_trainer`` code (and a user trainer's package) is the recorded code,
   by digest; otherwise refused, unless ``allow_code_drift``, which reports the drift and goes on;
4. from the statement alone plus the DVC remote, in a fresh work directory that shares nothing with
   the stack's caches, each step re-derived and its digest compared with the recorded one:

   ``snapshot``           the snapshot restored by its id from the DVC remote into a fresh DVC cache,
                          every file checked against the id's md5 listing;
   ``validate``           the recorded contract's suite digest, then every shard validated, the data
                          gate's snapshot rules, the quarantine report's sha256;
   ``tokenize``           the recorded resolved recipe written back as a recipe file (its sha256 against
                          the signed checkpoint manifest's), the recipe's tokenizer built afresh and
                          every shard packed: the tokenizer's and the token manifest's sha256;
   ``training-manifest``  the training manifest naming those tokens: its sha256;
   ``train``              that recipe, seed, world size and strategy, trained with kiln's local launcher
                          (real torchrun, one agent per rank): the weights' sha256.

   The first comparison that differs ends it, naming the step, the input and both digests.

The quarantine report and the training manifest name the files they list by absolute path. The
re-derived ones name the work directory's; before hashing, those are written as the run's (the
recorded snapshot path and token manifest location), so the digests compare content, not where it lay.

The verdict (``reproduced``, ``differs``, ``refused``) is recorded on the version as ``kiln.reproduction.*``
tags and as a signed attestation (``kiln.provenance.attestation``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.errors import ConfigError, ContractError, DataGateError, ProvenanceError, RegistryError, SnapshotError
from kiln.runs import TRAINING_MANIFEST
from kiln.util.fs import atomic_write_text, load_json

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion

Verdict = Literal["reproduced", "differs", "refused"]
STEPS = ("snapshot", "validate", "tokenize", "training-manifest", "train")
REPRODUCE_DAG_ID = "kiln_reproduce"
"""The dag id part of a reproduction's run key (its MLflow run, its torchrun rendezvous)."""
OUTCOME_FILE = "reproduction.json"
"""The outcome (``Reproduction.to_json``) in the work directory."""
REPORT_MAX_BYTES = 512 << 20
"""The largest quarantine report read back (every shard of a large snapshot, with its reasons)."""


# ------------------------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class Comparison:
    """One digest a step re-derived, against the one the statement records."""

    step: str
    input: str
    recorded: str
    derived: str

    @property
    def same(self) -> bool:
        return self.recorded == self.derived

    def __str__(self) -> str:
        if self.same:
            return f"{self.step}: {self.input}: {self.recorded} (the same)"
        return f"{self.step}: {self.input} differs: recorded {self.recorded}, re-derived {self.derived}"

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "input": self.input, "recorded": self.recorded, "derived": self.derived,
                "same": self.same}


@dataclass(frozen=True, slots=True)
class Reproduction:
    """The outcome of reproducing ``model`` version ``version`` (a value: a difference is not a fault).

    ``reason``: why it was refused, or the first comparison that differs, in words ("" when reproduced).
    ``comparisons``: every digest compared, in order (the last one differs when the verdict is ``differs``).
    ``code_drift``: the recorded code against the installed one, one line each (empty: none).
    ``notes``: what differs from the recorded run without stopping it (torch, Python, the DVC remote)."""

    model: str
    version: str
    policy: str
    verdict: Verdict
    reason: str = ""
    comparisons: tuple[Comparison, ...] = ()
    code_drift: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    workdir: str = ""
    started_on: str = ""
    finished_on: str = ""
    attestation_uri: str = ""
    attestation_sha256: str = ""

    @property
    def stopped_at(self) -> Comparison | None:
        """The comparison that differs (None: none did)."""
        return next((c for c in self.comparisons if not c.same), None)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "policy": self.policy, "verdict": self.verdict,
                "reason": self.reason, "comparisons": [c.to_json() for c in self.comparisons],
                "code_drift": list(self.code_drift), "notes": list(self.notes), "workdir": self.workdir,
                "started_on": self.started_on, "finished_on": self.finished_on,
                "attestation_uri": self.attestation_uri, "attestation_sha256": self.attestation_sha256}

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    def in_words(self) -> list[str]:
        head = {"reproduced": "reproduced: every step gave the recorded digest, the weights the same sha256",
                "differs": f"does not reproduce: {self.reason}",
                "refused": f"refused: {self.reason}"}[self.verdict]
        lines = [f"{self.model} version {self.version} (policy {self.policy}): {head}"]
        lines += [f"  code drift: {line}" for line in self.code_drift]
        lines += [f"  {c}" for c in self.comparisons]
        lines += [f"  note: {line}" for line in self.notes]
        if self.workdir:
            lines.append(f"  re-derived in {self.workdir}")
        if self.attestation_uri:
            lines.append(f"  signed attestation {self.attestation_uri} (sha256 {self.attestation_sha256})")
        return lines


@dataclass(frozen=True, kw_only=True, slots=True)
class ReproductionPlan:
    """What the signed statement (and the signed checkpoint manifest beside it) says each step needs."""

    snapshot_id: str
    corpus: str
    snapshot_remote: str
    snapshot_path: str
    contract: str
    contract_suite_sha256: str
    max_quarantine_share: float
    quarantine_report_sha256: str
    tokenizer_kind: str
    tokenizer_sha256: str
    token_manifest_sha256: str
    token_manifest_uri: str
    training_manifest_sha256: str
    recipe: Mapping[str, Any]
    recipe_sha256: str
    """From the signed checkpoint manifest ("" when the artifact holds none: then only the weights decide)."""
    seed: int
    world_size: int
    strategy: str
    steps: int
    code_sha256: str
    trainer_spec: str
    trainer_sha256: str
    weights_sha256: str
    environment: Mapping[str, str]
    """torch, Python and platform of the recorded run."""


def missing_records(statement: Mapping[str, Any]) -> list[str]:
    """What a reproduction needs that the statement does not record, in words (empty: nothing)."""
    try:
        build = statement["predicate"]["buildDefinition"]
        internal, external = build["internalParameters"], build["externalParameters"]
        deps = {d["name"].split(":", 1)[0]: d for d in build["resolvedDependencies"]}
    except (KeyError, TypeError) as exc:
        raise ProvenanceError(f"provenance statement: malformed predicate ({exc!r})") from exc
    missing = []
    snapshot = deps.get("snapshot", {})
    if not snapshot.get("annotations", {}).get("dvc_id"):
        missing.append("the snapshot id")
    if not snapshot.get("annotations", {}).get("path"):
        missing.append("the snapshot path the run read (the root of every shard path the quarantine report and "
                       "the training manifest name)")
    if not deps.get("contract", {}).get("digest", {}).get("sha256"):
        missing.append("the contract suite's sha256")
    if not deps.get("quarantine-report", {}).get("digest", {}).get("sha256"):
        missing.append("the quarantine report's sha256")
    if internal.get("max_quarantine_share") is None:
        missing.append("the data gate's max_quarantine_share (the quarantine report records it)")
    if not deps.get("tokenizer", {}).get("digest", {}).get("sha256"):
        missing.append("the tokenizer's sha256")
    tokens = deps.get("token-manifest", {})
    if not tokens.get("digest", {}).get("sha256"):
        missing.append("the token manifest (a run of the byte stream before the tokenize stage records none)")
    elif not tokens.get("uri"):
        missing.append("the token manifest's location (the training manifest names it)")
    if not deps.get("training-manifest", {}).get("digest", {}).get("sha256"):
        missing.append("the training manifest's sha256")
    if not isinstance(external.get("recipe"), dict) or not external.get("recipe"):
        missing.append("the resolved recipe")
    tokenizer = (external.get("recipe") or {}).get("tokenizer") or {}
    if tokenizer.get("kind") == "file" and not Path(str(tokenizer.get("path", ""))).is_absolute():
        missing.append(f"where the recipe's tokenizer file {tokenizer.get('path')!r} lay (a path relative to a recipe "
                       "file the statement does not name)")
    if not deps.get("code", {}).get("digest", {}).get("sha256"):
        missing.append("kiln's code digest")
    if not _weights(statement):
        missing.append("the weights' sha256 (the evaluation report byproduct)")
    return missing


def _weights(statement: Mapping[str, Any]) -> str:
    for byproduct in statement["predicate"]["runDetails"].get("byproducts", []):
        if byproduct.get("name") == "evaluation-report":
            return str((byproduct.get("annotations", {}).get("content") or {}).get("weights_sha256") or "")
    return ""


def plan_from_statement(statement: Mapping[str, Any], model_dir: Path | None = None) -> ReproductionPlan:
    """The plan a verified statement makes (``model_dir``: its verified artifact directory, whose signed
    checkpoint manifest gives the recipe's sha256). ``ProvenanceError`` naming everything it lacks."""
    from kiln.registry.verify import SIGNED_CHECKPOINT_MANIFEST

    missing = missing_records(statement)
    if missing:
        raise ProvenanceError("the signed statement does not record what reproducing needs: " + "; ".join(missing))
    build = statement["predicate"]["buildDefinition"]
    internal, external = build["internalParameters"], build["externalParameters"]
    deps = {d["name"].split(":", 1)[0]: d for d in build["resolvedDependencies"]}
    recipe = dict(external["recipe"])
    recipe_sha256 = ""
    if model_dir is not None and (model_dir / SIGNED_CHECKPOINT_MANIFEST).is_file():
        signed = load_json(model_dir / SIGNED_CHECKPOINT_MANIFEST, "the signed checkpoint manifest", ProvenanceError,
                           follow_link=False)
        recipe_sha256 = str(signed.get("recipe_sha256") or "") if isinstance(signed, dict) else ""
    train = recipe.get("train") or {}
    parallel = recipe.get("parallel") or {}
    for name, stated, in_recipe in (("seed", external["seed"], train.get("seed")),
                                    ("strategy", external["strategy"], parallel.get("strategy", "ddp"))):
        if stated != in_recipe:
            raise ProvenanceError(f"the signed statement's {name} {stated!r} is not its recipe's {in_recipe!r}")
    trainer = deps.get("trainer", {})
    return ReproductionPlan(
        snapshot_id=deps["snapshot"]["annotations"]["dvc_id"], corpus=deps["snapshot"]["name"].split(":", 1)[1],
        snapshot_remote=str(deps["snapshot"].get("uri", "")), snapshot_path=deps["snapshot"]["annotations"]["path"],
        contract=deps["contract"]["name"].split(":", 1)[1], contract_suite_sha256=deps["contract"]["digest"]["sha256"],
        max_quarantine_share=float(internal["max_quarantine_share"]),
        quarantine_report_sha256=deps["quarantine-report"]["digest"]["sha256"],
        tokenizer_kind=deps["tokenizer"]["name"].split(":", 1)[1], tokenizer_sha256=deps["tokenizer"]["digest"]["sha256"],
        token_manifest_sha256=deps["token-manifest"]["digest"]["sha256"], token_manifest_uri=deps["token-manifest"]["uri"],
        training_manifest_sha256=deps["training-manifest"]["digest"]["sha256"],
        recipe=recipe, recipe_sha256=recipe_sha256, seed=int(external["seed"]), world_size=int(external["world_size"]),
        strategy=str(external["strategy"]), steps=int(external["steps"]),
        code_sha256=deps["code"]["digest"]["sha256"], trainer_spec=str(trainer.get("name", "trainer:kiln")).split(":", 1)[1],
        trainer_sha256=str(trainer.get("digest", {}).get("sha256", "")), weights_sha256=_weights(statement),
        environment={"torch": deps["torch"]["annotations"]["version"], "python": deps["python"]["annotations"]["version"],
                     "platform": deps["platform"]["annotations"]["description"]},
    )


def code_drift(plan: ReproductionPlan) -> list[str]:
    """The installed code against the recorded, one line per difference: ``kiln``/``kiln_trainer``, and a user
    trainer's package when the recorded run used one and recorded its digest (empty: no drift)."""
    from kiln.provenance.statement import code_sha256, package_sha256, trainer_package

    drift = []
    installed = code_sha256()
    if installed != plan.code_sha256:
        drift.append(f"kiln and kiln_trainer: recorded code sha256 {plan.code_sha256}, installed {installed}")
    if plan.trainer_spec not in ("", "kiln") and plan.trainer_sha256:
        package = trainer_package(plan.trainer_spec)
        here = package_sha256(package) or "not installed"
        if here != plan.trainer_sha256:
            drift.append(f"trainer package {package}: recorded sha256 {plan.trainer_sha256}, installed {here}")
    return drift


def environment_notes(plan: ReproductionPlan) -> list[str]:
    """What of torch, Python and the platform differs from the recorded run (bitwise equality may not hold)."""
    from kiln.provenance.statement import environment

    here = environment()
    pairs = (("torch", here["torch_version"]), ("python", here["python_version"]), ("platform", here["platform"]))
    return [f"{name} here is {value!r}, the recorded run's {plan.environment[name]!r}"
            for name, value in pairs if value != plan.environment[name]]


# ------------------------------------------------------------------------------------------- helpers


def relocated(value: Any, moves: Mapping[str, str]) -> Any:
    """``value`` (JSON) with every occurrence of each key of ``moves`` in its strings replaced by its value."""
    if isinstance(value, str):
        for old, new in moves.items():
            value = value.replace(old, new)
        return value
    if isinstance(value, list):
        return [relocated(v, moves) for v in value]
    if isinstance(value, dict):
        return {relocated(k, moves): relocated(v, moves) for k, v in value.items()}
    return value


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's escapes are TOML's; TOML also wants DEL escaped, and never a surrogate escape (ensure_ascii=False).
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v, where)}" for k, v in value.items()
                               if v is not None) + "}"
    raise ProvenanceError(f"the recorded recipe's {where} is a {type(value).__name__}, which TOML cannot hold")


def recipe_toml(recipe: Mapping[str, Any]) -> str:
    """A resolved recipe (``{section: {key: value}}``, a top-level ``trainer`` spec) as a recipe file. A
    ``None`` value is left out (TOML has none: the field's default is None); ``reproduce`` checks that the
    file resolves to the recorded recipe's sha256 before training on it."""
    top = [f"{_toml_key(k)} = {_toml_value(v, k)}" for k, v in recipe.items() if not isinstance(v, dict)]
    tables = []
    for section, table in recipe.items():
        if isinstance(table, dict):
            tables.append(f"\n[{_toml_key(section)}]")
            tables += [f"{_toml_key(k)} = {_toml_value(v, f'{section}.{k}')}" for k, v in table.items() if v is not None]
    return "\n".join(["# the resolved recipe a signed provenance statement records (kiln reproduce)", *top, *tables]) + "\n"


def _dvc_text(snapshot_id: str) -> str:
    """A ``.dvc`` file of the snapshot: its id is all DVC needs to pull it (the ``.dir`` listing is on the remote)."""
    return f"outs:\n- md5: {snapshot_id}\n  hash: md5\n  path: data\n"


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------- the steps


def rederive(plan: ReproductionPlan, workdir: Path, *, run_key: str,
             log: Callable[[str], None] = lambda _line: None) -> tuple[list[Comparison], list[str]]:
    """Re-derive ``plan`` step by step in ``workdir`` (fresh: nothing of the stack's caches is read) and
    compare each digest, stopping at the first that differs. Returns the comparisons and notes."""
    from kiln import settings as kiln_settings
    from kiln.data.contracts import load_contract
    from kiln.data.snapshot import _public_remote, restore_snapshot
    from kiln.data.validation import load_eval_doc_hashes, train_shards, validate_shards
    from kiln.data.validation.report import quarantine_report_text
    from kiln.refs import ShardReport, SnapshotRef, TrainingManifest
    from kiln.runs import QUARANTINE_JSON
    from kiln.stages.inputs import load_run_recipe
    from kiln.stages.tokenize import pack_afresh
    from kiln.stages.validation import gate_snapshot

    out: list[Comparison] = []
    notes: list[str] = []

    def compare(step: str, what: str, recorded: str, derived: str) -> bool:
        out.append(Comparison(step, what, recorded, derived))
        log(str(out[-1]))
        return out[-1].same

    stack = kiln_settings.load()
    remote = _public_remote(stack.dvc_remote)
    if plan.snapshot_remote and plan.snapshot_remote != remote:
        notes.append(f"the snapshot was pushed to {plan.snapshot_remote}; restored from this stack's remote {remote}")
    # snapshot: by id, from the remote, into a DVC cache of its own (the stack's cache is not trusted here)
    root = (workdir / "snapshot").resolve()
    ref = SnapshotRef(id=plan.snapshot_id, corpus=plan.corpus, files=0, bytes=0, dvc=_dvc_text(plan.snapshot_id),
                      remote=remote, path="")
    log(f"snapshot: restoring {plan.snapshot_id} from {remote}")
    try:
        restore_snapshot(ref, root, settings=dataclasses.replace(stack, home=workdir.resolve()))
    except SnapshotError as exc:
        compare("snapshot", f"snapshot {plan.snapshot_id} from the DVC remote {remote}",
                plan.snapshot_id, f"bytes that do not restore to it: {exc}")
        return out, notes
    compare("snapshot", f"snapshot {plan.snapshot_id} from the DVC remote {remote}", plan.snapshot_id, plan.snapshot_id)
    moves = {str(root): plan.snapshot_path}

    # validate: the recorded contract, every shard, the data gate's rules, the quarantine report
    try:
        contract = load_contract(plan.contract)
        suite = contract.sha256
    except ContractError as exc:
        contract, suite = None, f"none: {exc}"
    if not compare("validate", f"contract {plan.contract} (its suite's sha256)", plan.contract_suite_sha256, suite):
        return out, notes
    assert contract is not None
    shards = [p.relative_to(root).as_posix() for p in train_shards(root)]
    signatures = workdir / "validation" / "signatures"
    log(f"validate: {len(shards)} shard(s) against {plan.contract}")
    validated = validate_shards([root / s for s in shards], contract, load_eval_doc_hashes(root), signatures_dir=signatures)
    # as the data gate reads them: from the validation tasks' JSON records
    reports = [ShardReport.from_json(r.to_json()) for r in validated]
    gate_dir = workdir / "data-gate"
    try:
        gated = gate_snapshot(contract, root, plan.snapshot_id, plan.corpus, reports, gate_dir, signatures_dir=signatures,
                              max_quarantine_share=plan.max_quarantine_share, mlflow_run_id=None)
    except DataGateError as exc:
        gated = None
        notes.append(f"the re-derived data gate failed: {exc}")
    report = load_json(gate_dir / QUARANTINE_JSON, "the re-derived quarantine report", ProvenanceError,
                       max_bytes=REPORT_MAX_BYTES)
    derived = _sha256_text(quarantine_report_text(relocated(report, moves)))
    if not compare("validate", "quarantine report", plan.quarantine_report_sha256, derived) or gated is None:
        return out, notes

    # tokenize: the recorded recipe written back (the same sha256, or nothing is derived from it), the
    # recipe's tokenizer built afresh, every shard packed
    recipe_path = workdir / "recipe.toml"
    atomic_write_text(recipe_path, recipe_toml(plan.recipe))
    try:
        recipe = load_run_recipe(recipe_path, [])
    except ConfigError as exc:
        raise ProvenanceError(f"the signed statement's recipe does not resolve here: {exc}") from exc
    if plan.recipe_sha256:
        if not compare("tokenize", "resolved recipe", plan.recipe_sha256, recipe.sha256):
            return out, notes
    else:
        notes.append("the artifact holds no signed checkpoint manifest: the recipe's sha256 was not compared")
    log(f"tokenize: {plan.tokenizer_kind} tokenizer, {len(gated.manifest.shards)} shard(s)")
    manifest, packed = pack_afresh(gated.manifest, recipe, recipe_path, workdir)
    if not compare("tokenize", f"tokenizer ({plan.tokenizer_kind})", plan.tokenizer_sha256, packed.tokenizer_sha256):
        return out, notes
    if not compare("tokenize", "token manifest", plan.token_manifest_sha256, packed.token_manifest_sha256):
        return out, notes

    # training-manifest: the one the trainer reads, in the run's paths
    manifest_path = workdir / TRAINING_MANIFEST
    manifest.write(manifest_path)
    moves[packed.token_manifest] = plan.token_manifest_uri
    as_recorded = TrainingManifest.from_json(relocated(manifest.to_json(), moves)).content_hash()
    if not compare("training-manifest", "training manifest", plan.training_manifest_sha256, as_recorded):
        return out, notes

    # train: the recorded recipe, seed, world size and strategy with kiln's local launcher
    weights = _train(plan, recipe, recipe_path, manifest_path, workdir / "train", run_key, log)
    compare("train", f"weights ({plan.steps} steps, seed {plan.seed}, world size {plan.world_size}, {plan.strategy})",
            plan.weights_sha256, weights)
    return out, notes


def _train(plan: ReproductionPlan, recipe: Any, recipe_path: Path, manifest: Path, run_dir: Path, run_key: str,
           log: Callable[[str], None]) -> str:
    """Train as recorded on this machine's local launcher (one torchrun agent per rank); the weights' sha256."""
    from kiln.launchers import LaunchSpec, launch_local
    from kiln_trainer.contract import MLFLOW_RUN_ID_ENV

    steps = None if plan.steps == recipe.train.steps else plan.steps
    log(f"train: {plan.steps} steps at world size {plan.world_size} ({plan.strategy}) with the local launcher")
    spec = LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=recipe_path, run_key=run_key, nodes=plan.world_size,
                      nproc_per_node=1, max_steps=steps,
                      # no MLflow run to log into: the reproduction's record is its verdict and attestation
                      env={MLFLOW_RUN_ID_ENV: ""})
    result = launch_local(spec, log=log)
    return result.weights_sha256


# ------------------------------------------------------------------------------------------- the whole


def reproduce(model: str, name: str, *, by: Literal["alias", "version"], policy: str,
              allow_code_drift: bool = False, workdir: Path | None = None, record: bool = True,
              log: Callable[[str], None] = lambda _line: None) -> Reproduction:
    """Reproduce ``model`` version ``name`` (``by="version"``) or the version holding alias ``name``,
    verifying it for ``policy`` first (module docstring). ``workdir``: where to re-derive (must not exist
    or be empty; default ``KILN_HOME/reproductions/<model>-v<version>-<time>``), kept for inspection.
    ``record``: the verdict on the version (tags) and a signed attestation. ``RegistryError`` when the
    registry cannot be read; a training that cannot run raises its ``LaunchError``."""
    from kiln import settings as kiln_settings
    from kiln.registry import mlflow_io
    from kiln.registry.verify import check_model_dir, download_model_dir

    started = _now()

    def find() -> ModelVersion:
        client = mlflow_io._client()
        if by == "alias":
            found = mlflow_io._version_by_alias(client, model, name)
            if found is None:
                raise RegistryError(f"{model} has no version with alias {name!r}")
            return found
        return client.get_model_version(model, name)

    mv = mlflow_io._with_retries(f"reading {model} {by} {name}", find)
    version = str(mv.version)
    stamp = started.replace(":", "").replace("-", "")
    where = workdir or kiln_settings.load().home / "reproductions" / f"{_safe(model)}-v{version}-{stamp}"
    if where.exists() and any(where.iterdir()):
        raise ConfigError(f"work directory {where} is not empty: a reproduction re-derives everything afresh")
    where.mkdir(parents=True, exist_ok=True)
    run_key = f"{REPRODUCE_DAG_ID}/{_safe(model)}-v{version}-{stamp}"

    def done(verdict: Verdict, reason: str = "", **fields: Any) -> Reproduction:
        outcome = Reproduction(model=mv.name, version=version, policy=policy, verdict=verdict, reason=reason,
                               workdir=str(where), started_on=started, finished_on=_now(), **fields)
        outcome.write(where / OUTCOME_FILE)  # before the registry is asked to record it: kept if that fails
        if record:
            from kiln.provenance.attestation import record_verdict

            outcome = record_verdict(mv, outcome, model_dir, run_key)
            outcome.write(where / OUTCOME_FILE)
        return outcome

    log(f"verifying {mv.name} version {version} for policy {policy}")
    model_dir = mlflow_io._with_retries(f"downloading {mv.name}/{version}",
                                        lambda: download_model_dir(mv, where / "version"))
    check = check_model_dir(mv, model_dir, policy)
    try:
        verified = check.require_verified()
    except ProvenanceError as exc:
        return done("refused", f"the version does not verify: {exc}")
    try:
        plan = plan_from_statement(verified.statement, model_dir)
    except ProvenanceError as exc:
        return done("refused", str(exc))
    drift = tuple(code_drift(plan))
    if drift and not allow_code_drift:
        return done("refused", "the installed code is not the recorded code (--allow-code-drift goes on and reports "
                               "it): " + "; ".join(drift), code_drift=drift)
    for line in drift:
        log(f"code drift (allowed): {line}")
    comparisons, notes = rederive(plan, where / "derived", run_key=run_key, log=log)
    notes = environment_notes(plan) + notes
    first = next((c for c in comparisons if not c.same), None)
    if first is not None:
        return done("differs", str(first), comparisons=tuple(comparisons), code_drift=drift, notes=tuple(notes))
    return done("reproduced", comparisons=tuple(comparisons), code_drift=drift, notes=tuple(notes))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
