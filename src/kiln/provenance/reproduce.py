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
                          (real torchrun, one agent per rank): the weights' sha256;
   ``evaluate``           kiln's evaluation of those weights on the re-derived eval shards, as the evaluate
                          stage runs it: each field of ``EVAL_COMPARED`` against the signed evaluation
                          report, bit for bit (``EVAL_NOT_COMPARED``: what is not, and why);
   ``hf-folder``          the checkpoint's Hugging Face folder written by the export registration ran
                          (``write_model_folder``): each file's sha256 against the statement's subject.

   The first comparison that differs ends it, naming the step, the input and both digests.

At another world size (``world_size=N``, not the recorded one) bitwise equality cannot hold: the gradient
reduction sums in another order. Every step before training is the same and must still give the same
digests (none of them depends on the world size); the global batch stays the recorded one, split another
way (the recipe's ``data.global_batch_size`` must divide by ``N x data.micro_batch_size``, else
``ConfigError`` naming both numbers, before anything is derived). ``train`` then checks the data order
(every global batch the ranks read is the one the seed and the step give: ``SampleOrder``, the same at
every world size) and, instead of the weights' sha256, the largest absolute difference between the
re-derived weights and the registered version's, each side's Hugging Face folder (the registered one as
it was uploaded, the re-derived checkpoint exported through the same ``write_model_folder``), against a
bound (``tolerance``, default ``DEFAULT_TOLERANCE``): ``reproduced`` within it, ``differs`` beyond it,
naming the tensor, the element and both values.

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
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kiln.errors import ConfigError, ContractError, DataGateError, ProvenanceError, SnapshotError
from kiln.provenance.statement import artifact_files
from kiln.runs import TRAINING_MANIFEST
from kiln.util.fs import atomic_write_text, load_json, parse_own_json

if TYPE_CHECKING:

    from kiln.refs import TrainResult

Verdict = Literal["reproduced", "differs", "refused"]
STEPS = ("snapshot", "validate", "tokenize", "training-manifest", "train", "evaluate", "hf-folder")
EVAL_COMPARED = ("weights_sha256", "step", "snapshot_id", "training_manifest_sha256", "split", "windows", "tokens",
                 "loss", "bits_per_byte")
"""The fields of the signed evaluation report the ``evaluate`` step compares, each bit for bit: which weights,
at which step, on which data and split (the training manifest as the run named it), and what evaluation
computed (windows, tokens, loss, bits per byte; a float compared by its shortest round-trip text, which is
one string for one float). kiln's evaluation is deterministic on the CPU (float32, fixed windows). A mixture's
report also has ``sources`` (each source's own score, which the headline figures weigh): compared whole, as
JSON, whose floats are their shortest round-trip texts."""
EVAL_NOT_COMPARED = {
    "checkpoint": "a path: the run's checkpoint directory there, the work directory's here",
    "checkpoint_manifest_sha256": "the checkpoint manifest records when its step was sealed (created_at), so it "
                                  "differs at every training; its weights, recipe and data hashes are compared",
}
"""The fields of the signed evaluation report that are not compared, and why."""
REPRODUCE_DAG_ID = "kiln_reproduce"
"""The dag id part of a reproduction's run key (its MLflow run, its torchrun rendezvous)."""
OUTCOME_FILE = "reproduction.json"
"""The outcome (``Reproduction.to_json``) in the work directory."""
EXPORT_DIR = "train-export/hf_model"
"""Where, in the work directory's ``derived/``, the re-derived checkpoint's Hugging Face folder is written."""
REPORT_MAX_BYTES = 512 << 20
"""The largest quarantine report read back (every shard of a large snapshot, with its reasons)."""
DEFAULT_TOLERANCE = 1e-3
"""The default bound on the largest absolute weight difference at another world size than the recorded
one. Measured (docs/provenance.md, "At another world size"): the tiny recipe trained on 1 rank and
re-derived on 2 (CPU, gloo) differs by at most 1.4e-6 after 24 steps (ddp and fsdp), 4.6e-6 after its
whole 400 steps with ddp and 8.1e-5 with fsdp (weights up to 0.44); the bound is 12x the largest. Longer
or larger runs drift further apart (training carries a rounding difference on): state the bound with
``tolerance`` for them."""


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


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsDifference:
    """The re-derived weights against the registered version's, at another world size than the recorded one:
    the largest absolute difference of any value, where it is, and the bound it is held to.

    ``problem``: the two sets of tensors are not comparable (a tensor missing on one side, another shape or
    dtype), in words; then the weights are not within any bound. ``index`` is the element's position in
    ``tensor`` (empty when every value is the same); ``registered`` and ``derived`` are its two values and
    ``tensor_max_abs`` the registered tensor's largest magnitude, for scale."""

    world_size: int
    recorded_world_size: int
    tolerance: float
    max_abs_diff: float = 0.0
    tensor: str = ""
    index: tuple[int, ...] = ()
    registered: float = 0.0
    derived: float = 0.0
    tensor_max_abs: float = 0.0
    tensors: int = 0
    values: int = 0
    problem: str = ""
    derived_weights_sha256: str = ""
    """The re-derived checkpoint's weights sha256 (what the attestation names as its subject)."""

    @property
    def within(self) -> bool:
        return not self.problem and self.max_abs_diff <= self.tolerance

    def _where(self) -> str:
        return (f"{self.tensor}[{', '.join(map(str, self.index))}]: registered {self.registered:.9g}, re-derived "
                f"{self.derived:.9g} (the tensor's largest magnitude {self.tensor_max_abs:.3g})")

    def __str__(self) -> str:
        head = f"train: weights at world size {self.world_size} (the version was trained at {self.recorded_world_size})"
        if self.problem:
            return f"{head} cannot be compared with the registered weights: {self.problem}"
        if not self.tensor:
            return (f"{head}: every one of {self.values} values in {self.tensors} tensors is the registered one "
                    f"(largest absolute difference 0, bound {self.tolerance:g})")
        if self.within:
            return (f"{head}: largest absolute difference {self.max_abs_diff:.3g}, within the bound {self.tolerance:g} "
                    f"({self.tensors} tensors, {self.values} values), in {self._where()}")
        return (f"{head}: largest absolute difference {self.max_abs_diff:.3g} exceeds the bound {self.tolerance:g}, "
                f"in {self._where()}")

    def to_json(self) -> dict[str, Any]:
        finite = math.isfinite(self.max_abs_diff)
        return {"world_size": self.world_size, "recorded_world_size": self.recorded_world_size,
                "tolerance": self.tolerance, "max_abs_diff": self.max_abs_diff if finite else str(self.max_abs_diff),
                "tensor": self.tensor, "index": list(self.index), "registered": _json_float(self.registered),
                "derived": _json_float(self.derived), "tensor_max_abs": _json_float(self.tensor_max_abs),
                "tensors": self.tensors, "values": self.values, "problem": self.problem, "within": self.within,
                "derived_weights_sha256": self.derived_weights_sha256}


def _json_float(value: float) -> float | str:
    """JSON has no NaN nor infinity: those are written as strings (``float()`` reads them back)."""
    return value if math.isfinite(value) else str(value)


@dataclass(frozen=True, slots=True)
class Reproduction:
    """The outcome of reproducing ``model`` version ``version`` (a value: a difference is not a fault).

    ``reason``: why it was refused, or the first comparison that differs, in words ("" when reproduced).
    ``comparisons``: every digest compared, in order (the last one differs when the verdict is ``differs``).
    ``code_drift``: the recorded code against the installed one, one line each (empty: none).
    ``notes``: what differs from the recorded run without stopping it (torch, Python, the DVC remote).
    ``world_size``: the world size it trains (or would train) at, ``recorded_world_size`` the version's (0:
    refused before the statement was read). ``weights``: at another world size than the recorded one, the
    largest weight difference against its bound (None: the weights' sha256 is compared, or training did not
    run)."""

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
    world_size: int = 0
    recorded_world_size: int = 0
    tolerance: float | None = None
    """The bound on the largest weight difference (None: at the recorded world size, bitwise)."""
    weights: WeightsDifference | None = None

    @property
    def stopped_at(self) -> Comparison | None:
        """The comparison that differs (None: none did)."""
        return next((c for c in self.comparisons if not c.same), None)

    @property
    def weights_compared(self) -> Literal["bitwise", "tolerance"]:
        """How the weights are held to the registered ones: their sha256 (at the recorded world size) or the
        largest absolute difference against ``tolerance`` (at another)."""
        return "bitwise" if self.tolerance is None else "tolerance"

    @property
    def summary(self) -> str:
        """The verdict's reason in one line (what the version's ``kiln.reproduction.detail`` tag says)."""
        if self.reason:
            return self.reason
        if self.weights is not None:
            return f"within tolerance at world size {self.world_size}: {self.weights}"
        return "every step gave the recorded digest"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "policy": self.policy, "verdict": self.verdict,
                "reason": self.reason, "comparisons": [c.to_json() for c in self.comparisons],
                "code_drift": list(self.code_drift), "notes": list(self.notes), "workdir": self.workdir,
                "started_on": self.started_on, "finished_on": self.finished_on,
                "attestation_uri": self.attestation_uri, "attestation_sha256": self.attestation_sha256,
                "world_size": self.world_size, "recorded_world_size": self.recorded_world_size,
                "weights_compared": self.weights_compared, "tolerance": self.tolerance,
                "weights": None if self.weights is None else self.weights.to_json()}

    def write(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    def in_words(self) -> list[str]:
        if self.tolerance is None:
            head = {"reproduced": "reproduced: every step gave the recorded digest, the weights the same sha256, the "
                                  "evaluation the same report bit for bit and the Hugging Face folder the same files",
                    "differs": f"does not reproduce: {self.reason}",
                    "refused": f"refused: {self.reason}"}[self.verdict]
        else:
            at = f"at world size {self.world_size} (the version was trained at {self.recorded_world_size})"
            head = {"reproduced": f"reproduced within tolerance {at}: every step before training gave the recorded "
                                  "digest, every global batch the ranks read is the one the seed and the step give, "
                                  f"and no weight differs from the registered one by more than {self.tolerance:g}",
                    "differs": f"does not reproduce within tolerance {at}: {self.reason}",
                    "refused": f"refused {at}: {self.reason}"}[self.verdict]
        lines = [f"{self.model} version {self.version} (policy {self.policy}): {head}"]
        lines += [f"  code drift: {line}" for line in self.code_drift]
        lines += [f"  {c}" for c in self.comparisons]
        if self.weights is not None:
            lines.append(f"  {self.weights}")
        lines += [f"  note: {line}" for line in self.notes]
        if self.workdir:
            lines.append(f"  re-derived in {self.workdir}")
        if self.attestation_uri:
            lines.append(f"  signed attestation {self.attestation_uri} (sha256 {self.attestation_sha256})")
        return lines


@dataclass(frozen=True, kw_only=True, slots=True)
class SourcePlan:
    """One source of a mixture, as the signed statement's ``source:<name>`` dependency records it."""

    name: str
    weight: float
    corpus: str
    snapshot_id: str
    snapshot_remote: str
    snapshot_path: str
    """Where the run read the snapshot: the root of every shard path its quarantine report and the training
    manifest name."""
    contract: str
    contract_suite_sha256: str
    max_quarantine_share: float
    quarantine_report_sha256: str
    token_manifest_sha256: str
    token_manifest_uri: str
    limits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Its caps as its training manifest entry carried them (``SOURCE_CAP_KEYS``; empty: it recycled)."""


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
    eval_report: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The signed evaluation report (the statement's ``evaluation-report`` byproduct)."""
    hf_files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The registered Hugging Face folder's files (their names inside it) and the sha256 the statement's subjects
    give each."""
    sources: tuple[SourcePlan, ...] = ()
    """A mixture's sources in declared order (empty: a run of one corpus). The single-valued fields then
    answer for all of them as the statement records them: ``snapshot_id`` the set of snapshots, the contract's
    sha256 that of the sources' suites, the quarantine report the index of theirs, ``token_manifest_sha256``
    their token manifests' joined (``TrainingManifest.tokens_sha256``); ``snapshot_path``,
    ``token_manifest_uri`` and ``max_quarantine_share`` are each source's."""


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
    sources = [d for d in build["resolvedDependencies"] if str(d.get("name", "")).startswith("source:")]
    if not snapshot.get("annotations", {}).get("dvc_id"):
        missing.append("the snapshot id")
    if not sources and not snapshot.get("annotations", {}).get("path"):
        missing.append("the snapshot path the run read (the root of every shard path the quarantine report and "
                       "the training manifest name)")
    if not deps.get("contract", {}).get("digest", {}).get("sha256"):
        missing.append("the contract suite's sha256")
    if not deps.get("quarantine-report", {}).get("digest", {}).get("sha256"):
        missing.append("the quarantine report's sha256")
    if not sources and internal.get("max_quarantine_share") is None:
        missing.append("the data gate's max_quarantine_share (the quarantine report records it)")
    if not deps.get("tokenizer", {}).get("digest", {}).get("sha256"):
        missing.append("the tokenizer's sha256")
    tokens = deps.get("token-manifest", {})
    if not tokens.get("digest", {}).get("sha256"):
        missing.append("the token manifest (a run of the byte stream before the tokenize stage records none)")
    elif not sources and not tokens.get("uri"):
        missing.append("the token manifest's location (the training manifest names it)")
    for source in sources:
        said = source.get("annotations") or {}
        lacks = [what for what, there in (
            ("its snapshot id", said.get("dvc_id")), ("its snapshot path", said.get("snapshot_path")),
            ("its contract", said.get("contract")), ("its contract suite's sha256", said.get("contract_suite_sha256")),
            ("its quarantine report's sha256", said.get("quarantine_report_sha256")),
            ("its gate's max_quarantine_share", said.get("max_quarantine_share") is not None),
            ("its token manifest's sha256", said.get("token_manifest_sha256")),
            ("its token manifest's location", said.get("token_manifest_uri")),
            ("its weight", said.get("weight") is not None)) if not there]
        if lacks:
            missing.append(f"{source['name']}: " + ", ".join(lacks))
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
    report = _eval_report(statement)
    absent = [name for name in EVAL_COMPARED if name != "weights_sha256" and report.get(name) in (None, "")]
    if report and absent:
        missing.append(f"the evaluation report's {', '.join(absent)}")
    if not _hf_files(statement):
        missing.append(f"the Hugging Face folder's files (subjects under {_hf_folder()}/)")
    return missing


def _eval_report(statement: Mapping[str, Any]) -> dict[str, Any]:
    """The signed evaluation report (the ``evaluation-report`` byproduct's content; empty: none)."""
    for byproduct in statement["predicate"]["runDetails"].get("byproducts", []):
        if byproduct.get("name") == "evaluation-report":
            content = byproduct.get("annotations", {}).get("content")
            return dict(content) if isinstance(content, dict) else {}
    return {}


def _weights(statement: Mapping[str, Any]) -> str:
    return str(_eval_report(statement).get("weights_sha256") or "")


def _hf_folder() -> str:
    from kiln.registry.export import HF_FOLDER

    return HF_FOLDER


def _hf_files(statement: Mapping[str, Any]) -> dict[str, str]:
    """The statement's subjects inside the Hugging Face folder: their names inside it, and their sha256."""
    from kiln.provenance.statement import subjects

    prefix = _hf_folder() + "/"
    return {name.removeprefix(prefix): sha for name, sha in subjects(statement).items() if name.startswith(prefix)}


def _dependencies(statement: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    try:
        deps = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    except (KeyError, TypeError):
        return []
    return [d for d in deps if isinstance(d, Mapping)] if isinstance(deps, list) else []


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
    sources = tuple(_source_plan(d) for d in build["resolvedDependencies"] if str(d.get("name", "")).startswith("source:"))
    return ReproductionPlan(
        snapshot_id=deps["snapshot"]["annotations"]["dvc_id"], corpus=deps["snapshot"]["name"].split(":", 1)[1],
        snapshot_remote=str(deps["snapshot"].get("uri", "")),
        snapshot_path=str(deps["snapshot"]["annotations"].get("path", "")),
        contract=deps["contract"]["name"].split(":", 1)[1], contract_suite_sha256=deps["contract"]["digest"]["sha256"],
        max_quarantine_share=float(internal.get("max_quarantine_share", math.nan)),
        quarantine_report_sha256=deps["quarantine-report"]["digest"]["sha256"],
        tokenizer_kind=deps["tokenizer"]["name"].split(":", 1)[1], tokenizer_sha256=deps["tokenizer"]["digest"]["sha256"],
        token_manifest_sha256=deps["token-manifest"]["digest"]["sha256"],
        token_manifest_uri=str(deps["token-manifest"].get("uri", "")),
        training_manifest_sha256=deps["training-manifest"]["digest"]["sha256"],
        recipe=recipe, recipe_sha256=recipe_sha256, seed=int(external["seed"]), world_size=int(external["world_size"]),
        strategy=str(external["strategy"]), steps=int(external["steps"]),
        code_sha256=deps["code"]["digest"]["sha256"], trainer_spec=str(trainer.get("name", "trainer:kiln")).split(":", 1)[1],
        trainer_sha256=str(trainer.get("digest", {}).get("sha256", "")), weights_sha256=_weights(statement),
        environment={"torch": deps["torch"]["annotations"]["version"], "python": deps["python"]["annotations"]["version"],
                     "platform": deps["platform"]["annotations"]["description"]},
        eval_report=_eval_report(statement), hf_files=_hf_files(statement), sources=sources,
    )


def _source_plan(dependency: Mapping[str, Any]) -> SourcePlan:
    """A mixture source's ``source:<name>`` dependency (``missing_records`` checked it records every field)."""
    from kiln.provenance.statement import SOURCE_CAP_KEYS

    said = dependency["annotations"]
    return SourcePlan(
        name=dependency["name"].split(":", 1)[1], weight=float(said["weight"]), corpus=str(said["corpus"]),
        snapshot_id=str(said["dvc_id"]), snapshot_remote=str(dependency.get("uri", "")),
        snapshot_path=str(said["snapshot_path"]), contract=str(said["contract"]),
        contract_suite_sha256=str(said["contract_suite_sha256"]), max_quarantine_share=float(said["max_quarantine_share"]),
        quarantine_report_sha256=str(said["quarantine_report_sha256"]),
        token_manifest_sha256=str(said["token_manifest_sha256"]), token_manifest_uri=str(said["token_manifest_uri"]),
        limits={cap: int(said[cap]) for cap in SOURCE_CAP_KEYS if said.get(cap) is not None},
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


# ------------------------------------------------------------------------------- at another world size


def check_world_size(recipe: Mapping[str, Any], world_size: int) -> None:
    """``ConfigError`` naming both numbers unless the recorded (resolved) ``recipe``'s global batch splits
    into whole micro-batches on ``world_size`` ranks: the global batch stays the recorded one, only how it
    is split changes (``accum_steps = global_batch_size / (world_size x micro_batch_size)``)."""
    data = recipe.get("data") or {}
    try:
        global_batch, micro = int(data["global_batch_size"]), int(data["micro_batch_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProvenanceError(f"the recorded recipe's [data] has no usable batch sizes ({exc!r})") from exc
    if world_size < 1:
        raise ConfigError(f"--world-size {world_size}: must be >= 1")
    share = world_size * micro
    if global_batch % share:
        raise ConfigError(
            f"--world-size {world_size} cannot split the recorded global batch: data.global_batch_size = {global_batch} "
            f"does not divide by world size x data.micro_batch_size = {world_size} x {micro} = {share} (the global "
            "batch stays the recorded one and each rank must run a whole number of micro-batches per step; a world "
            f"size N works where {global_batch} divides by N x {micro})")


def load_folder_weights(folder: Path) -> dict[str, Any]:
    """Every tensor of a Hugging Face model folder's safetensors files (``model.safetensors``, or the shards
    of a larger model), by name; ``ProvenanceError`` when it holds none or two files name one tensor.
    safetensors holds plain tensors: reading them runs no code."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ProvenanceError(f"{folder} holds no safetensors weights")
    tensors: dict[str, Any] = {}
    for path in files:
        for name, tensor in load_file(str(path)).items():
            if name in tensors:
                raise ProvenanceError(f"{folder}: tensor {name!r} is in two safetensors files")
            tensors[name] = tensor
    return tensors


def compare_weights(registered: Mapping[str, Any], derived: Mapping[str, Any], *, tolerance: float, world_size: int,
                    recorded_world_size: int) -> WeightsDifference:
    """The largest absolute difference between two sets of tensors of the same names (torch tensors), in
    float64 whatever their dtype: where it is, both values, and whether it is within ``tolerance``. A
    tensor on one side only, or of another shape or dtype, is a ``problem``; a NaN or infinity where the
    other side has another value is an infinite difference."""
    import torch

    bound: dict[str, Any] = {"tolerance": tolerance, "world_size": world_size, "recorded_world_size": recorded_world_size}
    missing, extra = sorted(set(registered) - set(derived)), sorted(set(derived) - set(registered))
    if missing or extra:
        return WeightsDifference(**bound, problem=f"tensors only in the registered weights: {missing[:5]}; only in "
                                                  f"the re-derived: {extra[:5]}")
    worst: WeightsDifference | None = None
    values = 0
    for name in sorted(registered):
        a, b = registered[name].detach().to("cpu"), derived[name].detach().to("cpu")
        if a.shape != b.shape or a.dtype != b.dtype:
            return WeightsDifference(**bound, problem=f"{name} is {a.dtype} {list(a.shape)} registered, {b.dtype} "
                                                      f"{list(b.shape)} re-derived")
        values += a.numel()
        if a.numel() == 0:
            continue
        x, y = a.double(), b.double()
        diff = (x - y).abs()
        same = (x == y) | (x.isnan() & y.isnan())
        diff = torch.where(same, torch.zeros_like(diff), torch.nan_to_num(diff, nan=math.inf, posinf=math.inf))
        flat = int(torch.argmax(diff.reshape(-1)))
        largest = float(diff.reshape(-1)[flat])
        if largest > 0 and (worst is None or largest > worst.max_abs_diff):
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
            worst = WeightsDifference(**bound, max_abs_diff=largest, tensor=name, index=index,
                                      registered=float(x.reshape(-1)[flat]), derived=float(y.reshape(-1)[flat]),
                                      tensor_max_abs=float(torch.nan_to_num(x.abs(), nan=math.inf).max()))
    if worst is None:
        return WeightsDifference(**bound, tensors=len(registered), values=values)
    return dataclasses.replace(worst, tensors=len(registered), values=values)


def shard_samples(token_manifest: Path) -> list[int]:
    """The samples of each packed shard a token manifest lists, in its order (the order ``SampleOrder`` numbers
    samples in)."""
    doc = load_json(token_manifest, "the re-derived token manifest", ProvenanceError)
    try:
        return [int(shard["samples"]) for shard in doc["shards"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ProvenanceError(f"{token_manifest}: its shards do not say how many samples they hold ({exc!r})") from exc


def data_order(run_dir: Path, *, shard_samples: list[int], seed: int, window_shards: int, global_batch_size: int,
               steps: int, world_size: int,
               sources: list[tuple[str, float, list[int]]] | None = None) -> tuple[Comparison, str]:
    """The global batches the ranks of a run at ``world_size`` read (their sample logs, every rank's ids of a
    step in rank order) against the ones the seed and the step give (``SampleOrder`` over the packed shards'
    sample counts: what one rank reads, the same at every world size; for a mixture, ``sources``: each
    source's name, weight and packed shards' sample counts in declared order, the ``Mixture`` draw's global
    ids, ``shard_samples`` then unused), as sha256s of the id lists; and where they first differ, in words
    ("" when they do not)."""
    from kiln_trainer.contract import SAMPLE_LOG_SUBDIR
    from kiln_trainer.mixture import Mixture, MixtureSource
    from kiln_trainer.sample_order import SampleOrder

    if sources:
        mixture = Mixture([MixtureSource(name, weight, samples) for name, weight, samples in sources], seed=seed,
                          window_shards=window_shards)
        expected = [mixture.draw_range(step * global_batch_size, global_batch_size).global_ids.tolist()
                    for step in range(steps)]
    else:
        order = SampleOrder(shard_samples, seed=seed, window_shards=window_shards)
        expected = [order.ids_range(step * global_batch_size, global_batch_size).tolist() for step in range(steps)]
    what = (f"data order ({steps} global batches of {global_batch_size} sample ids, read by {world_size} ranks; "
            f"recorded: the ids seed {seed} and the step give)")
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in sorted((run_dir / SAMPLE_LOG_SUBDIR).glob("rank-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = parse_own_json(line, str(path))
                if int(entry["world_size"]) == world_size:  # a rank's last reading of a step counts
                    by_step.setdefault(int(entry["step"]), {})[int(entry["rank"])] = [int(i) for i in entry["sample_ids"]]
    recorded = _sha256_text(json.dumps(expected, separators=(",", ":")))
    if not by_step:
        return (Comparison("train", what, recorded, "none: the trainer logged no sample ids (KILN_SAMPLE_LOG=1)"),
                "the data order at another world size could not be checked: the trainer wrote no sample log")
    read, first = [], ""
    for step in range(steps):
        ranks = by_step.get(step, {})
        batch = [i for rank in range(world_size) for i in ranks.get(rank, [])]
        read.append(batch)
        if not first and (sorted(ranks) != list(range(world_size)) or batch != expected[step]):
            first = (f"the global batch of step {step + 1} was read by ranks {sorted(ranks)} as ids {batch[:8]}..., "
                     f"seed {seed} and the step give {expected[step][:8]}...")
    return Comparison("train", what, recorded, _sha256_text(json.dumps(read, separators=(",", ":")))), first


# ------------------------------------- after training: the evaluation and the Hugging Face folder


def _eval_value(report: Mapping[str, Any], name: str) -> str:
    """A report field as compared: a float by its shortest round-trip text (one string for one float, so equal
    texts are equal bits), anything else by its JSON; a field the report lacks as such."""
    if name not in report:
        return "none: not in the report"
    value = report[name]
    if isinstance(value, float):
        return repr(value)
    return value if isinstance(value, str) else json.dumps(value)


def compare_eval_report(recorded: Mapping[str, Any], derived: Mapping[str, Any], *,
                        training_manifest: tuple[str, str] = ("", "")) -> list[Comparison]:
    """The re-derived evaluation report against the signed one, field by field (``EVAL_COMPARED``, bit for bit;
    ``EVAL_NOT_COMPARED`` says what is left out and why), as ``evaluate`` comparisons. ``training_manifest``:
    (the sha256 of the training manifest the re-derived evaluation read, the same manifest's sha256 in the run's
    paths): the re-derived report names the work directory's copy, which is the run's once its paths are the
    run's (the ``training-manifest`` step compared that)."""
    here, as_recorded = training_manifest
    derived = dict(derived)
    if here and derived.get("training_manifest_sha256") == here:
        derived["training_manifest_sha256"] = as_recorded
    names = EVAL_COMPARED + (("sources",) if "sources" in recorded or "sources" in derived else ())
    return [Comparison("evaluate", f"evaluation report {name}", _eval_value(recorded, name), _eval_value(derived, name))
            for name in names]


def compare_folder(recorded: Mapping[str, str], derived: Mapping[str, str], *, prefix: str) -> list[Comparison]:
    """Each file of the registered folder (``recorded``: its name inside the folder -> the sha256 the signed
    statement's subject gives) against the re-derived one's (``derived``), as ``hf-folder`` comparisons named
    ``prefix/name``, in name order; a file on one side only differs."""
    return [Comparison("hf-folder", f"{prefix}/{name}", recorded.get(name, "none: not a file of the registered folder"),
                       derived.get(name, "none: the re-derived export did not write it"))
            for name in sorted(set(recorded) | set(derived))]


def evaluate_checkpoint_afresh(checkpoint: str, manifest: Path, out: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """kiln's evaluation of ``checkpoint`` on ``manifest``'s eval shards, as the evaluate stage runs it
    (``python -m kiln_trainer.evaluate`` in a process of its own, so that nothing of this one, its torch
    threads included, changes a float), written to ``out``; the report. ``LaunchError`` when it fails."""
    from kiln.errors import LaunchError
    from kiln.stages.evaluation import run_evaluation

    log(f"evaluate: {checkpoint} on the eval shards of {manifest}")
    proc = run_evaluation(checkpoint, manifest, out)
    if proc.returncode != 0:
        raise LaunchError(f"the re-derived evaluation of {checkpoint} failed (exit {proc.returncode}): "
                          f"{proc.stderr[-1500:]}")
    report = load_json(out, "the re-derived evaluation report", ProvenanceError)
    if not isinstance(report, dict):
        raise ProvenanceError(f"{out}: the re-derived evaluation report is not a JSON object")
    return report


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
             log: Callable[[str], None] = lambda _line: None, world_size: int | None = None,
             tolerance: float = DEFAULT_TOLERANCE, registered_weights: Path | None = None,
             ) -> tuple[list[Comparison], list[str], WeightsDifference | None]:
    """Re-derive ``plan`` step by step in ``workdir`` (fresh: nothing of the stack's caches is read) and
    compare each digest, stopping at the first that differs. Returns the comparisons, the notes and, at a
    ``world_size`` other than the recorded one, the weights' difference from ``registered_weights`` (the
    registered version's Hugging Face folder) against ``tolerance`` (None when training did not run or the
    weights' sha256 was compared). A mixture (``plan.sources``) re-derives each source's snapshot, validation
    and packed tokens, its training manifest (format 2) from them, then trains and compares as one corpus."""
    from kiln import settings as kiln_settings
    from kiln.data.snapshot import _public_remote

    steps = _Steps(plan, workdir, kiln_settings.load(), log)
    stack_remote = _public_remote(steps.stack.dvc_remote)
    data = steps.mixture_data(stack_remote) if plan.sources else steps.corpus_data(stack_remote)
    if data is None:
        return steps.out, steps.notes, None
    recipe, recipe_path, manifest_path, sample_counts = data
    out, notes, compare = steps.out, steps.notes, steps.compare

    # train: the recorded recipe, seed and strategy with kiln's local launcher, at the recorded world size
    # (the weights' sha256) or at another (the data order, then the weights within a bound)
    at = world_size or plan.world_size
    if at == plan.world_size:
        result = _train(plan, recipe, recipe_path, manifest_path, workdir / "train", run_key, log)
        if compare("train", f"weights ({plan.steps} steps, seed {plan.seed}, world size {plan.world_size}, {plan.strategy})",
                   plan.weights_sha256, result.weights_sha256):
            for comparison in after_training(plan, result.checkpoint, manifest_path, workdir, log=log):
                out.append(comparison)
                log(str(comparison))
        return out, notes, None
    if registered_weights is None:
        raise ProvenanceError("a reproduction at another world size needs the registered version's weights folder")
    notes.append(f"at world size {at} the evaluation and the Hugging Face folder are not re-derived: they follow from "
                 "weights that are held to a bound, not to the recorded bits")
    result = _train(plan, recipe, recipe_path, manifest_path, workdir / "train", run_key, log, world_size=at)
    mixture = [(s.name, s.weight, sample_counts[s.name]) for s in plan.sources] or None
    order, first = data_order(workdir / "train", shard_samples=sample_counts.get("", []), sources=mixture,
                              seed=plan.seed, window_shards=recipe.data.window_shards,
                              global_batch_size=recipe.data.global_batch_size, steps=plan.steps, world_size=at)
    if first:
        notes.append(first)
    if not compare("train", order.input, order.recorded, order.derived):
        return out, notes, None
    # the re-derived checkpoint through the export registration ran (kiln's GPT as GPT-2's tensors, or the
    # trainer's own export), so that both sides are the same tensors under the same names
    exported = workdir / EXPORT_DIR
    log(f"train: exporting the re-derived checkpoint {result.checkpoint} to compare with the registered weights")
    export_folder(result.checkpoint, exported)
    weights = compare_weights(load_folder_weights(registered_weights), load_folder_weights(exported),
                              tolerance=tolerance, world_size=at, recorded_world_size=plan.world_size)
    weights = dataclasses.replace(weights, derived_weights_sha256=result.weights_sha256)
    log(str(weights))
    return out, notes, weights


_Data = tuple[Any, Path, Path, dict[str, list[int]]]
"""What the data steps hand training: the recipe (``kiln_trainer.config.Recipe``), its file, the training
manifest the trainer reads, and the packed shards' sample counts (of ``""`` for one corpus, by source name for
a mixture: the data order at another world size)."""


class _Steps:
    """The steps before training, one corpus' or a mixture's, recording each comparison as it is made."""

    def __init__(self, plan: ReproductionPlan, workdir: Path, stack: Any, log: Callable[[str], None]) -> None:
        self.plan, self.workdir, self.stack, self.log = plan, workdir, stack, log
        self.out: list[Comparison] = []
        self.notes: list[str] = []

    def compare(self, step: str, what: str, recorded: str, derived: str) -> bool:
        self.out.append(Comparison(step, what, recorded, derived))
        self.log(str(self.out[-1]))
        return self.out[-1].same

    def snapshot(self, snapshot_id: str, corpus: str, root: Path, remote: str, what: str) -> bool:
        """Restore ``snapshot_id`` by id from the DVC remote into ``root`` (a DVC cache of the work directory's
        own: the stack's cache is not trusted here), every file checked against the id's md5 listing."""
        from kiln.data.snapshot import restore_snapshot
        from kiln.refs import SnapshotRef

        ref = SnapshotRef(id=snapshot_id, corpus=corpus, files=0, bytes=0, dvc=_dvc_text(snapshot_id), remote=remote,
                          path="")
        self.log(f"snapshot: restoring {what}{snapshot_id} from {remote}")
        try:
            restore_snapshot(ref, root, settings=dataclasses.replace(self.stack, home=self.workdir.resolve()))
        except SnapshotError as exc:
            self.compare("snapshot", f"{what}snapshot {snapshot_id} from the DVC remote {remote}", snapshot_id,
                         f"bytes that do not restore to it: {exc}")
            return False
        return self.compare("snapshot", f"{what}snapshot {snapshot_id} from the DVC remote {remote}", snapshot_id,
                            snapshot_id)

    def validate(self, contract_name: str, suite_sha256: str, root: Path, snapshot_id: str, corpus: str,
                 max_quarantine_share: float, report_sha256: str, recorded_root: str, folder: Path,
                 what: str = "") -> tuple[Any, bool]:
        """The recorded contract (its suite's sha256), every shard validated, the data gate's rules, the
        quarantine report's sha256 (its paths the run's): ``(the gate's result, whether every digest held)``."""
        from kiln.data.contracts import load_contract
        from kiln.data.validation import load_eval_doc_hashes, train_shards, validate_shards
        from kiln.data.validation.report import quarantine_report_text
        from kiln.refs import ShardReport
        from kiln.runs import QUARANTINE_JSON
        from kiln.stages.validation import gate_snapshot

        try:
            contract = load_contract(contract_name)
            suite = contract.sha256
        except ContractError as exc:
            contract, suite = None, f"none: {exc}"
        if not self.compare("validate", f"{what}contract {contract_name} (its suite's sha256)", suite_sha256, suite):
            return None, False
        assert contract is not None
        shards = [p.relative_to(root).as_posix() for p in train_shards(root)]
        signatures = folder / "signatures"
        self.log(f"validate: {what}{len(shards)} shard(s) against {contract_name}")
        validated = validate_shards([root / s for s in shards], contract, load_eval_doc_hashes(root),
                                    signatures_dir=signatures)
        # as the data gate reads them: from the validation tasks' JSON records
        reports = [ShardReport.from_json(r.to_json()) for r in validated]
        gate_dir = folder / "data-gate"
        try:
            gated = gate_snapshot(contract, root, snapshot_id, corpus, reports, gate_dir, signatures_dir=signatures,
                                  max_quarantine_share=max_quarantine_share, mlflow_run_id=None)
        except DataGateError as exc:
            gated = None
            self.notes.append(f"the re-derived data gate {what}failed: {exc}")
        report = load_json(gate_dir / QUARANTINE_JSON, "the re-derived quarantine report", ProvenanceError,
                           max_bytes=REPORT_MAX_BYTES)
        derived = _sha256_text(quarantine_report_text(relocated(report, {str(root): recorded_root})))
        held = self.compare("validate", f"{what}quarantine report", report_sha256, derived)
        return gated, held and gated is not None

    def recipe(self) -> tuple[Any, Path] | None:
        """The recorded resolved recipe written back as a recipe file: its sha256 against the signed checkpoint
        manifest's (None: it differs)."""
        from kiln.stages.inputs import load_run_recipe

        recipe_path = self.workdir / "recipe.toml"
        atomic_write_text(recipe_path, recipe_toml(self.plan.recipe))
        try:
            recipe = load_run_recipe(recipe_path, [])
        except ConfigError as exc:
            raise ProvenanceError(f"the signed statement's recipe does not resolve here: {exc}") from exc
        if self.plan.recipe_sha256:
            if not self.compare("tokenize", "resolved recipe", self.plan.recipe_sha256, recipe.sha256):
                return None
        else:
            self.notes.append("the artifact holds no signed checkpoint manifest: the recipe's sha256 was not compared")
        return recipe, recipe_path

    def training_manifest(self, manifest: Any, moves: dict[str, str]) -> Path | None:
        """The training manifest the trainer reads, written in the work directory; its sha256 once its paths
        are the run's (``moves``) against the recorded one (None: it differs)."""
        from kiln.refs import TrainingManifest

        manifest_path = self.workdir / TRAINING_MANIFEST
        manifest.write(manifest_path)
        as_recorded = TrainingManifest.from_json(relocated(manifest.to_json(), moves)).content_hash()
        if not self.compare("training-manifest", "training manifest", self.plan.training_manifest_sha256, as_recorded):
            return None
        return manifest_path

    def corpus_data(self, remote: str) -> _Data | None:
        """One corpus: snapshot, validate, tokenize, training-manifest."""
        from kiln.stages.tokenize import pack_afresh

        plan = self.plan
        if plan.snapshot_remote and plan.snapshot_remote != remote:
            self.notes.append(f"the snapshot was pushed to {plan.snapshot_remote}; restored from this stack's remote "
                              f"{remote}")
        root = (self.workdir / "snapshot").resolve()
        if not self.snapshot(plan.snapshot_id, plan.corpus, root, remote, ""):
            return None
        gated, held = self.validate(plan.contract, plan.contract_suite_sha256, root, plan.snapshot_id, plan.corpus,
                                    plan.max_quarantine_share, plan.quarantine_report_sha256, plan.snapshot_path,
                                    self.workdir / "validation")
        if not held:
            return None
        resolved = self.recipe()
        if resolved is None:
            return None
        recipe, recipe_path = resolved
        self.log(f"tokenize: {plan.tokenizer_kind} tokenizer, {len(gated.manifest.shards)} shard(s)")
        manifest, packed = pack_afresh(gated.manifest, recipe, recipe_path, self.workdir)
        if not self.compare("tokenize", f"tokenizer ({plan.tokenizer_kind})", plan.tokenizer_sha256,
                            packed.tokenizer_sha256):
            return None
        if not self.compare("tokenize", "token manifest", plan.token_manifest_sha256, packed.token_manifest_sha256):
            return None
        moves = {str(root): plan.snapshot_path, packed.token_manifest: plan.token_manifest_uri}
        manifest_path = self.training_manifest(manifest, moves)
        if manifest_path is None:
            return None
        return recipe, recipe_path, manifest_path, {"": shard_samples(Path(packed.token_manifest))}

    def mixture_data(self, remote: str) -> _Data | None:
        """A mixture: each source's snapshot, then each source validated against its own contract and gated by
        its own threshold, the sources' contract suites as the statement joins them; the one tokenizer over
        every source, each source's packed tokens and their joined sha256; the format-2 training manifest.

        Not compared: the index of the sources' quarantine reports (the statement's ``quarantine-report``),
        which names where the run published each (its directory, its MLflow run); each source's own report is
        compared instead."""
        from kiln.refs import TrainingManifest, canonical_json
        from kiln.stages.tokenize import pack_afresh

        plan = self.plan
        roots = {s.name: (self.workdir / "sources" / s.name / "snapshot").resolve() for s in plan.sources}
        for source in plan.sources:
            if source.snapshot_remote and source.snapshot_remote != remote:
                self.notes.append(f"source {source.name}'s snapshot was pushed to {source.snapshot_remote}; restored "
                                  f"from this stack's remote {remote}")
            if not self.snapshot(source.snapshot_id, source.corpus, roots[source.name], remote,
                                 f"source {source.name}: "):
                return None
        entries, suites = [], []
        for source in plan.sources:
            root = roots[source.name]
            gated, held = self.validate(source.contract, source.contract_suite_sha256, root, source.snapshot_id,
                                        source.corpus, source.max_quarantine_share, source.quarantine_report_sha256,
                                        source.snapshot_path, self.workdir / "sources" / source.name / "validation",
                                        what=f"source {source.name}: ")
            if not held:
                return None
            suites.append([source.name, source.contract_suite_sha256])
            gate = gated.manifest
            entries.append({"name": source.name, "weight": source.weight, "corpus": source.corpus,
                            "snapshot_id": source.snapshot_id, "contract": source.contract, "shards": gate.shards,
                            "eval_shards": gate.eval_shards, "quarantined": gate.quarantined, **source.limits})
        joined = hashlib.sha256(canonical_json(suites)).hexdigest()
        if not self.compare("validate", f"contract {plan.contract} (the sources' suites, joined)",
                            plan.contract_suite_sha256, joined):
            return None
        self.notes.append("the index of the sources' quarantine reports names where the run published each (its "
                          "directory and MLflow run) and is not compared; each source's report is")
        resolved = self.recipe()
        if resolved is None:
            return None
        recipe, recipe_path = resolved
        gate_manifest = TrainingManifest.build_mixture(entries)
        self.log(f"tokenize: {plan.tokenizer_kind} tokenizer over {len(entries)} sources, "
                 f"{len(gate_manifest.shards)} shard(s)")
        manifest, packed = pack_afresh(gate_manifest, recipe, recipe_path, self.workdir)
        if not self.compare("tokenize", f"tokenizer ({plan.tokenizer_kind})", plan.tokenizer_sha256,
                            packed.tokenizer_sha256):
            return None
        assert manifest.sources is not None
        moves: dict[str, str] = {}
        counts: dict[str, list[int]] = {}
        for source, packed_source in zip(plan.sources, manifest.sources, strict=True):
            tokens = packed_source["tokens"]
            if not self.compare("tokenize", f"source {source.name}: token manifest", source.token_manifest_sha256,
                                str(tokens["sha256"])):
                return None
            # a source's folder ends in "/", so that a source named as another's prefix is not moved with it
            moves[str(roots[source.name]) + "/"] = source.snapshot_path.rstrip("/") + "/"
            moves[str(tokens["manifest"])] = source.token_manifest_uri
            counts[source.name] = shard_samples(Path(tokens["manifest"]))
        if not self.compare("tokenize", "token manifests of the sources, joined", plan.token_manifest_sha256,
                            packed.token_manifest_sha256):
            return None
        manifest_path = self.training_manifest(manifest, moves)
        if manifest_path is None:
            return None
        return recipe, recipe_path, manifest_path, counts


def after_training(plan: ReproductionPlan, checkpoint: str, manifest: Path, workdir: Path, *,
                   log: Callable[[str], None] = lambda _line: None) -> list[Comparison]:
    """The steps after training, on the re-derived ``checkpoint`` (its weights the recorded ones) and the
    re-derived training ``manifest`` (the recorded one once its paths are the run's: the ``training-manifest``
    step compared that): ``evaluate``, kiln's evaluation on the manifest's eval shards, each field of its
    report against the signed one (``compare_eval_report``); then, when every field is the same, ``hf-folder``:
    the checkpoint's Hugging Face folder written by the export registration ran (``write_model_folder``) into
    ``workdir/EXPORT_DIR``, each file's sha256 against the statement's subject (``compare_folder``). Returns the
    comparisons; the first that differs is the verdict's reason."""
    from kiln_trainer.contract.training_manifest import load_training_manifest

    report = evaluate_checkpoint_afresh(checkpoint, manifest, workdir / "evaluation" / "eval_report.json", log)
    here = load_training_manifest(manifest).sha256  # what the trainer's report names: this copy, in its paths
    compared = compare_eval_report(plan.eval_report, report, training_manifest=(here, plan.training_manifest_sha256))
    if not all(c.same for c in compared):
        return compared
    folder = workdir / EXPORT_DIR
    log(f"hf-folder: exporting {checkpoint} into {folder}")
    export_folder(checkpoint, folder)
    return compared + compare_folder(plan.hf_files, artifact_files(folder), prefix=_hf_folder())


def export_folder(checkpoint: str, folder: Path) -> None:
    """``write_model_folder`` of ``checkpoint`` into ``folder``, with what it prints on stderr: a trainer's own
    ``export`` runs in this process and may print (the worked example prints the folder), and the standard
    output is the outcome's (``kiln reproduce --json``)."""
    import contextlib
    import sys

    from kiln_trainer.export import write_model_folder

    with contextlib.redirect_stdout(sys.stderr):
        write_model_folder(checkpoint, folder)


def _train(plan: ReproductionPlan, recipe: Any, recipe_path: Path, manifest: Path, run_dir: Path, run_key: str,
           log: Callable[[str], None], *, world_size: int | None = None) -> TrainResult:
    """Train as recorded on this machine's local launcher (one torchrun agent per rank), at the recorded world
    size or ``world_size``; at another one every rank logs the sample ids it read (the data order check)."""
    from kiln.launchers import LaunchSpec, launch_local
    from kiln_trainer.contract import MLFLOW_RUN_ID_ENV
    from kiln_trainer.contract.entrypoint import SAMPLE_LOG_ENV

    at = world_size or plan.world_size
    steps = None if plan.steps == recipe.train.steps else plan.steps
    log(f"train: {plan.steps} steps at world size {at} ({plan.strategy}) with the local launcher")
    # no MLflow run to log into: the reproduction's record is its verdict and attestation
    env = {MLFLOW_RUN_ID_ENV: ""} | ({SAMPLE_LOG_ENV: "1"} if at != plan.world_size else {})
    spec = LaunchSpec(run_dir=run_dir, manifest=manifest, recipe=recipe_path, run_key=run_key, nodes=at,
                      nproc_per_node=1, max_steps=steps, env=env)
    return launch_local(spec, log=log)


# ------------------------------------------------------------------------------------------- the whole


def reproduce(model: str, name: str, *, by: Literal["alias", "version"], policy: str,
              allow_code_drift: bool = False, workdir: Path | None = None, record: bool = True,
              world_size: int | None = None, tolerance: float | None = None, run_key: str | None = None,
              log: Callable[[str], None] = lambda _line: None) -> Reproduction:
    """Reproduce ``model`` version ``name`` (``by="version"``) or the version holding alias ``name``,
    verifying it for ``policy`` first (module docstring). ``workdir``: where to re-derive (must not exist
    or be empty; default ``KILN_HOME/reproductions/<model>-v<version>-<time>``), kept for inspection.
    ``record``: the verdict on the version (tags) and a signed attestation. ``world_size``: train at that
    many ranks (None: the recorded world size); at another than the recorded one the weights are held to
    the registered ones within ``tolerance`` (default ``DEFAULT_TOLERANCE``) instead of by sha256.
    ``ConfigError`` for a world size the recorded global batch cannot be split to, or a tolerance without
    one; ``RegistryError`` when the registry cannot be read; a training that cannot run raises its
    ``LaunchError``. ``run_key``: names the reproduction's MLflow run and torchrun rendezvous (default
    ``kiln_reproduce/<model>-v<version>-<time>``; the ``kiln_reproduce`` DAG passes its own run's)."""
    from kiln import settings as kiln_settings
    from kiln.registry import mlflow_io
    from kiln.registry.export import HF_FOLDER
    from kiln.registry.verify import check_model_dir, download_model_dir

    if world_size is not None and (isinstance(world_size, bool) or world_size < 1):
        raise ConfigError(f"--world-size {world_size}: must be a whole number >= 1")
    if tolerance is not None:
        if world_size is None:
            raise ConfigError("--tolerance bounds the weights' difference at another world size: give --world-size N "
                              "(at the recorded world size the weights' sha256 is compared)")
        if not math.isfinite(tolerance) or tolerance < 0:
            raise ConfigError(f"--tolerance {tolerance}: must be a finite number >= 0")
    started = _now()

    mv = mlflow_io._with_retries(f"reading {model} {by} {name}",
                                 lambda: mlflow_io.version_by_ref(mlflow_io._client(), model, by, name))
    version = str(mv.version)
    stamp = started.replace(":", "").replace("-", "")
    where = workdir or kiln_settings.load().home / "reproductions" / f"{_safe(model)}-v{version}-{stamp}"
    if where.exists() and any(where.iterdir()):
        raise ConfigError(f"work directory {where} is not empty: a reproduction re-derives everything afresh")
    where.mkdir(parents=True, exist_ok=True)
    run_key = run_key or f"{REPRODUCE_DAG_ID}/{_safe(model)}-v{version}-{stamp}"
    sizes: dict[str, Any] = {"world_size": world_size or 0}

    def done(verdict: Verdict, reason: str = "", **fields: Any) -> Reproduction:
        outcome = Reproduction(model=mv.name, version=version, policy=policy, verdict=verdict, reason=reason,
                               workdir=str(where), started_on=started, finished_on=_now(), **sizes, **fields)
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
    at = world_size or plan.world_size
    other = at != plan.world_size
    bound = (DEFAULT_TOLERANCE if tolerance is None else tolerance) if other else None
    sizes = {"world_size": at, "recorded_world_size": plan.world_size, "tolerance": bound}
    registered = model_dir / HF_FOLDER
    pre_notes = []
    if other:
        check_world_size(plan.recipe, at)  # a request the recipe cannot serve: nothing derived, nothing recorded
        if not any(registered.glob("*.safetensors")):
            return done("refused", f"the version holds no registered weights to compare with at another world size "
                                   f"({HF_FOLDER}/*.safetensors)")
    elif world_size is not None:
        pre_notes.append(f"world size {at} is the recorded one: the weights are compared bitwise (their sha256)"
                         + (f", the tolerance {tolerance:g} is not used" if tolerance is not None else ""))
    drift = tuple(code_drift(plan))
    if drift and not allow_code_drift:
        return done("refused", "the installed code is not the recorded code (--allow-code-drift goes on and reports "
                               "it): " + "; ".join(drift), code_drift=drift)
    for line in drift:
        log(f"code drift (allowed): {line}")
    comparisons, notes, weights = rederive(plan, where / "derived", run_key=run_key, log=log, world_size=at,
                                           tolerance=bound if bound is not None else DEFAULT_TOLERANCE,
                                           registered_weights=registered if other else None)
    notes = environment_notes(plan) + pre_notes + notes
    fields: dict[str, Any] = {"comparisons": tuple(comparisons), "code_drift": drift, "notes": tuple(notes),
                              "weights": weights}
    first = next((c for c in comparisons if not c.same), None)
    if first is not None:
        return done("differs", str(first), **fields)
    if weights is not None and not weights.within:
        return done("differs", str(weights), **fields)
    return done("reproduced", **fields)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)
