"""kiln's provenance statement for a model artifact: an in-toto Statement v1 whose predicate is SLSA
Provenance v1 (https://slsa.dev/provenance/v1).

The statement's ``subject`` is every file of the artifact directory (its path relative to the
directory, ``/``-separated, sorted) with its sha256, except the two signature files kiln writes beside
them (``model.sig`` and ``provenance.dsse.json``, ``SIGNATURE_FILES``). The predicate says how the
files were made, from what, by whom::

    buildDefinition.buildType             BUILD_TYPE
    buildDefinition.externalParameters    the resolved recipe, seed, world size, strategy, steps
    buildDefinition.internalParameters    the policy, the Airflow DAG id and run id, the launcher and its nodes
    buildDefinition.resolvedDependencies  one ResourceDescriptor ({"name", "uri", "digest"}) per input:
                                          snapshot, contract, quarantine report, training manifest,
                                          tokenizer, token manifest, kiln's code, the trainer, torch,
                                          Python, platform
    runDetails.builder                    {"id": "urn:kiln:builder:<policy>", "version": {"kiln": ...}}
    runDetails.metadata                   invocationId (the run key), startedOn, finishedOn
    runDetails.byproducts                 checkpoint manifest, evaluation report, gate decision, approval

``statement_bytes`` is the canonical JSON of it (sorted keys, no spaces, UTF-8: the one kiln hashes
manifests with), so the same inputs and the same files give the same bytes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, ProvenanceError
from kiln_trainer.contract import canonical_json

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:kiln:build-type:train-and-register:v1"
"""What the build is: a training run of kiln's pipeline (snapshot, contract, tokenize, torchrun
training, evaluation, gate) whose committed checkpoint is registered as a model."""
MODEL_SIGNATURE_FILE = "model.sig"
"""model-signing's Sigstore bundle over every file of the directory but itself."""
PROVENANCE_FILE = "provenance.dsse.json"
"""kiln's statement as one DSSE envelope (JSON), signed with the policy's key."""
SIGNATURE_FILES = (MODEL_SIGNATURE_FILE, PROVENANCE_FILE)
"""Files of an artifact directory that are not subjects of its statement (they sign them)."""
CODE_SUFFIXES = frozenset({".py", ".json", ".md", ".toml"})
"""What counts as kiln's code in ``code_sha256``: its modules and the package data a wheel ships
(pyproject's ``package-data``: contracts, recipes, config, DAG and plugin files), never bytecode."""

_HEX64 = re.compile(r"[0-9a-f]{64}")


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerIdentity:
    """The trainer that made the weights, as the checkpoint records it (``kiln_trainer.contract.entrypoint
    .trainer_record``): its entry point, the distribution that provides it and that distribution's version,
    and the sha256 of the source of the package the entry point lives in, in this process
    (``package_sha256(trainer_package(spec))``; "" when unknown)."""

    spec: str
    distribution: str
    version: str
    sha256: str = ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProvenanceInputs:
    """Everything the statement says besides the artifact's own files. The register stage fills it from
    what it holds (``from_registration``); every digest is lowercase hex sha256 unless said otherwise."""

    # internalParameters: who ran it, where
    policy: str
    dag_id: str
    run_id: str
    launcher: str
    """The launcher backend (``local``, ``slurm``, ``kubernetes``)."""
    nodes: tuple[str, ...]
    """The nodes the job ran on (host names), in rank order where known."""
    # externalParameters: what was asked for
    recipe: Mapping[str, Any]
    """The resolved recipe (every default filled in), as the checkpoint records it."""
    seed: int
    world_size: int
    strategy: str
    steps: int
    """The step the weights are at (what a re-derivation trains to)."""
    # resolvedDependencies: what it read, each by digest
    snapshot_id: str
    """DVC's directory hash of the corpus snapshot, ``<md5>.dir``."""
    corpus: str
    snapshot_remote: str
    snapshot_path: str = ""
    """Where the run read the snapshot (kiln's pinned copy): the root of the shard paths the quarantine
    report and the training manifest name, which ``kiln reproduce`` needs to compare its own ("": not
    recorded)."""
    max_quarantine_share: float | None = None
    """The data gate's threshold as the quarantine report records it (None: not recorded); the report's
    bytes, so its digest, depend on it."""
    contract: str
    """``name@version`` of the data contract."""
    contract_suite_sha256: str
    """"" when the data gate did not record it (the statement then says it is not recorded)."""
    quarantine_report_sha256: str
    """"" when there is no quarantine report (likewise)."""
    quarantine_report_uri: str
    training_manifest_sha256: str
    training_manifest_uri: str
    tokenizer_kind: str
    tokenizer_sha256: str
    """"" for a checkpoint of the byte stream before tokenizers, which records none."""
    token_manifest_sha256: str = ""
    """"" for a run trained on the byte stream before tokenize stages (then no dependency is listed)."""
    token_manifest_uri: str = ""
    git_commit: str = ""
    """kiln's checkout commit when known ("" or ``unknown`` otherwise)."""
    code_sha256: str
    """``code_sha256()`` of the installed ``kiln`` and ``kiln_trainer``."""
    trainer: TrainerIdentity
    torch_version: str
    python_version: str
    platform: str
    # runDetails
    run_key: str
    started_on: str
    finished_on: str
    """RFC 3339 times in UTC; "" when not recorded (the statement leaves them out and lists them as unrecorded)."""
    checkpoint_manifest_sha256: str
    eval_report: Mapping[str, Any]
    decision: Mapping[str, Any]
    approval: Mapping[str, Any] | None = None
    """The approval record, once there is one (a statement made at registration has none)."""
    kiln_version: str = ""
    sources: tuple[Mapping[str, Any], ...] = ()
    """A mixture's sources, in declared order (empty: a run of one corpus), each as ``source_lineage``
    makes it: name, weight, corpus, snapshot (id, remote, path), contract and its suite's sha256, its
    quarantine report's sha256 and path, its gate, its packed tokens, and what training drew of it (tokens
    seen, realized share). The single-valued fields above then answer for all of them, as the mixture's
    training manifest does (``snapshot_id`` = ``"code=<id>,docs=<id>"``; the quarantine report is the
    index of the sources' reports)."""

    def __post_init__(self) -> None:
        from kiln.policy import POLICIES

        if self.policy not in POLICIES:
            raise ConfigError(f"provenance: policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("dag_id", "run_id", "launcher", "strategy", "snapshot_id", "corpus", "contract",
                     "tokenizer_kind", "torch_version", "python_version", "platform", "run_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"provenance: {name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("training_manifest_sha256", "code_sha256", "checkpoint_manifest_sha256"):
            _check_hex(name, getattr(self, name))
        # "": not recorded (by the data gate; by a checkpoint of the byte stream before tokenizers)
        for name in ("contract_suite_sha256", "quarantine_report_sha256", "tokenizer_sha256"):
            if getattr(self, name) != "":
                _check_hex(name, getattr(self, name))
        if self.token_manifest_sha256:
            _check_hex("token_manifest_sha256", self.token_manifest_sha256)
        if self.trainer.sha256:
            _check_hex("trainer.sha256", self.trainer.sha256)
        for name in ("seed", "world_size", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name != "seed" else 0):
                raise ConfigError(f"provenance: {name} must be an integer >= {1 if name != 'seed' else 0}, got {value!r}")
        for name in ("started_on", "finished_on"):
            if getattr(self, name) == "":  # not recorded: the statement says so
                continue
            try:
                when = dt.datetime.fromisoformat(getattr(self, name).replace("Z", "+00:00"))
            except ValueError:
                when = None
            if when is None or when.tzinfo is None:
                raise ConfigError(f"provenance: {name} must be an RFC 3339 time with its offset, got {getattr(self, name)!r}")
        from kiln.runs import split_run_key

        if split_run_key(self.run_key) != (self.dag_id, self.run_id):
            raise ConfigError(f"provenance: run_key {self.run_key!r} is not dag_id/run_id "
                              f"({self.dag_id!r}/{self.run_id!r})")
        if not self.snapshot_id.endswith(".dir"):
            raise ConfigError(f"provenance: snapshot_id must be DVC's '<md5>.dir', got {self.snapshot_id!r}")
        share = self.max_quarantine_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1):
            raise ConfigError(f"provenance: max_quarantine_share must be a number in [0, 1] or None, got {share!r}")
        if not isinstance(self.nodes, tuple) or not all(isinstance(n, str) and n for n in self.nodes):
            raise ConfigError(f"provenance: nodes must be a tuple of host names, got {self.nodes!r}")
        for i, source in enumerate(self.sources):
            missing = [k for k in SOURCE_LINEAGE_KEYS if k not in source]
            if missing or not str(source.get("snapshot_id", "")).endswith(".dir"):
                raise ConfigError(f"provenance: sources[{i}] lacks {missing or 'a DVC snapshot id'}: {dict(source)!r:.200}")


SOURCE_LINEAGE_KEYS = ("name", "weight", "corpus", "snapshot_id", "snapshot_remote", "contract",
                       "contract_suite_sha256", "quarantine_report_sha256", "token_manifest_sha256", "tokens", "share")
"""What the statement records of each source of a mixture (``ProvenanceInputs.sources``)."""
SOURCE_CAP_KEYS = ("max_epochs", "max_tokens")
"""A source's caps, recorded with it when its training manifest entry has them (``Mixture.resolved_limits``):
what rebuilding the training manifest needs besides the data (``kiln reproduce``)."""


def _check_hex(name: str, value: object) -> None:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise ConfigError(f"provenance: {name} must be a lowercase hex sha256, got {value!r}")


# ------------------------------------------------------------------------------ digests of what is installed


def _tree_files(root: Path, suffixes: frozenset[str] | None) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every regular file under ``root``, sorted, following the links
    a checkout's ``kiln/_shipped`` folders are; ``__pycache__`` skipped."""
    found = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = Path(folder) / name
            if suffixes is not None and path.suffix not in suffixes:
                continue
            found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def _digest_files(entries: list[tuple[str, Path]]) -> str:
    """sha256 over each file's relative path and bytes, in order, each length-prefixed (so no two
    different trees share a byte stream)."""
    digest = hashlib.sha256()
    for rel, path in entries:
        name = rel.encode("utf-8")
        data = path.read_bytes()
        digest.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _package_files(top_level: str) -> list[tuple[str, Path]]:
    """``("<package>/<relative path>", path)`` of an importable top-level package's ``.py`` and package data
    files (``CODE_SUFFIXES``), found without importing it (an editable install included: its RECORD lists
    a finder, not the source); empty when it is not importable."""
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [(f"{top_level}/{rel}", path) for location in spec.submodule_search_locations
                for rel, path in _tree_files(Path(location), CODE_SUFFIXES)]
    if spec.origin and spec.origin.endswith(".py"):
        return [(f"{top_level}.py", Path(spec.origin))]
    return []


def code_sha256() -> str:
    """The digest of the installed ``kiln`` and ``kiln_trainer`` source: every ``.py`` file and package data
    file (``CODE_SUFFIXES``) of each package, as ``<package>/<relative path>``, sorted; no ``__pycache__``."""
    return _digest_files(sorted(_package_files("kiln") + _package_files("kiln_trainer")))


def package_sha256(top_level: str) -> str:
    """sha256 of an importable top-level package's source, as ``code_sha256`` takes it; "" when it is not
    importable."""
    entries = _package_files(top_level)
    return _digest_files(sorted(entries)) if entries else ""


def trainer_package(spec: str) -> str:
    """The top-level package a trainer's entry point lives in: ``kiln_trainer`` for kiln's own (``kiln``),
    ``my_lm`` for ``my_lm.train:main``."""
    return "kiln_trainer" if spec in ("", "kiln") else spec.split(":", 1)[0].split(".", 1)[0]


def environment() -> dict[str, str]:
    """torch, Python and the platform of this process: ``{"torch_version", "python_version", "platform"}``."""
    return {"torch_version": importlib.metadata.version("torch"), "python_version": platform.python_version(),
            "platform": f"{sys.platform}-{platform.machine()} ({platform.platform()})"}


# ------------------------------------------------------------------------------ the artifact's files


def artifact_files(artifact_dir: str | Path) -> dict[str, str]:
    """``relative path -> sha256`` of every file of the artifact directory but ``SIGNATURE_FILES`` at its top.

    ``ProvenanceError`` for a directory that is missing, or that holds a symbolic link or anything but
    regular files and folders (a signature over a link would say nothing about what it points to)."""
    root = Path(artifact_dir)
    if not root.is_dir():
        raise ProvenanceError(f"{root}: not a directory")
    files: dict[str, str] = {}
    for folder, dirs, names in os.walk(root):
        for name in sorted(dirs + names):
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            rel = path.relative_to(root).as_posix()
            if stat.S_ISLNK(mode):
                raise ProvenanceError(f"{root}: {rel} is a symbolic link; a signed artifact holds regular files only")
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise ProvenanceError(f"{root}: {rel} is not a regular file")
            if rel in SIGNATURE_FILES:
                continue
            with open(path, "rb") as fh:
                files[rel] = hashlib.file_digest(fh, "sha256").hexdigest()
    return dict(sorted(files.items()))


# ------------------------------------------------------------------------------ the statement


def _descriptor(name: str, digest: Mapping[str, str], uri: str = "", /, **annotations: Any) -> dict[str, Any]:
    """An in-toto ResourceDescriptor (empty ``uri`` and ``annotations`` left out)."""
    out: dict[str, Any] = {"name": name, "digest": dict(digest)}
    if uri:
        out["uri"] = uri
    if annotations:
        out["annotations"] = annotations
    return out


def _json_digest(value: Mapping[str, Any]) -> dict[str, str]:
    return {"sha256": hashlib.sha256(canonical_json(value)).hexdigest()}


def build_statement(artifact_dir: str | Path, inputs: ProvenanceInputs) -> dict[str, Any]:
    """The in-toto statement (a JSON-safe dict) of ``artifact_dir``'s files made from ``inputs``."""
    files = artifact_files(artifact_dir)
    if not files:
        raise ProvenanceError(f"{artifact_dir}: holds no file to sign")
    i = inputs
    if i.sources:  # the set of snapshots, then each source by its own digests
        snapshot = _descriptor(f"snapshot:{i.corpus}", _json_digest({"snapshots": [[src["name"], src["snapshot_id"]]
                                                                                   for src in i.sources]}),
                               dvc_id=i.snapshot_id, sources=[src["name"] for src in i.sources])
    else:
        snapshot = _descriptor(f"snapshot:{i.corpus}", {"md5": i.snapshot_id.removesuffix(".dir")}, i.snapshot_remote,
                               dvc_id=i.snapshot_id, **({"path": i.snapshot_path} if i.snapshot_path else {}))
    dependencies = [
        snapshot,
        *(_source_descriptor(src) for src in i.sources),
        _descriptor(f"contract:{i.contract}", _known_digest(i.contract_suite_sha256),
                    **({} if i.contract_suite_sha256 else {"recorded": False})),
        _descriptor("quarantine-report", _known_digest(i.quarantine_report_sha256), i.quarantine_report_uri,
                    **({} if i.quarantine_report_sha256 else {"recorded": False})),
        _descriptor("training-manifest", {"sha256": i.training_manifest_sha256}, i.training_manifest_uri),
        _descriptor(f"tokenizer:{i.tokenizer_kind}", _known_digest(i.tokenizer_sha256),
                    **({} if i.tokenizer_sha256 else {"recorded": False})),
    ]
    if i.token_manifest_sha256:
        dependencies.append(_descriptor("token-manifest", {"sha256": i.token_manifest_sha256}, i.token_manifest_uri))
    code_digest = {"sha256": i.code_sha256}
    if i.git_commit and i.git_commit != "unknown":
        code_digest["gitCommit"] = i.git_commit
    dependencies += [
        _descriptor("code:kiln", code_digest, packages=["kiln", "kiln_trainer"]),
        _descriptor(f"trainer:{i.trainer.spec}", {"sha256": i.trainer.sha256} if i.trainer.sha256 else {},
                    distribution=i.trainer.distribution, version=i.trainer.version),
        _descriptor("torch", {}, version=i.torch_version),
        _descriptor("python", {}, version=i.python_version),
        _descriptor("platform", {}, description=i.platform),
    ]
    unrecorded = _unrecorded(i)
    byproducts = [
        _descriptor("checkpoint-manifest", {"sha256": i.checkpoint_manifest_sha256}),
        _descriptor("evaluation-report", _json_digest(i.eval_report), content=dict(i.eval_report)),
        _descriptor("gate-decision", _json_digest(i.decision), content=dict(i.decision)),
    ]
    if i.approval is not None:
        byproducts.append(_descriptor("approval", _json_digest(i.approval), content=dict(i.approval)))
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": rel, "digest": {"sha256": sha}} for rel, sha in files.items()],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"recipe": dict(i.recipe), "seed": i.seed, "world_size": i.world_size,
                                       "strategy": i.strategy, "steps": i.steps},
                "internalParameters": {"policy": i.policy, "dag_id": i.dag_id, "run_id": i.run_id,
                                       "launcher": i.launcher, "nodes": list(i.nodes),
                                       **({} if i.max_quarantine_share is None
                                          else {"max_quarantine_share": i.max_quarantine_share}),
                                       **({"unrecorded": unrecorded} if unrecorded else {})},
                "resolvedDependencies": dependencies,
            },
            "runDetails": {
                "builder": {"id": f"urn:kiln:builder:{i.policy}", "version": {"kiln": i.kiln_version or _kiln_version()}},
                "metadata": {"invocationId": i.run_key, **({"startedOn": i.started_on} if i.started_on else {}),
                             **({"finishedOn": i.finished_on} if i.finished_on else {})},
                "byproducts": byproducts,
            },
        },
    }


def _source_descriptor(source: Mapping[str, Any]) -> dict[str, Any]:
    """One source of a mixture: its DVC snapshot by digest, with its contract, quarantine report, packed
    tokens, caps and what training drew of it."""
    annotations = {k: source[k] for k in SOURCE_LINEAGE_KEYS if k not in ("name", "snapshot_remote")}
    annotations["dvc_id"] = annotations.pop("snapshot_id")
    for key in ("snapshot_path", "max_quarantine_share", "quarantine_report_uri", "token_manifest_uri", *SOURCE_CAP_KEYS):
        if source.get(key) not in (None, ""):
            annotations[key] = source[key]
    return _descriptor(f"source:{source['name']}", {"md5": str(source["snapshot_id"]).removesuffix(".dir")},
                       str(source["snapshot_remote"]), **annotations)


def _known_digest(sha256: str) -> dict[str, str]:
    return {"sha256": sha256} if sha256 else {}


def _unrecorded(i: ProvenanceInputs) -> list[str]:
    """What the stages did not record, by name: said so rather than guessed."""
    return [name for name, missing in (
        ("contract_suite_sha256", not i.contract_suite_sha256), ("quarantine_report", not i.quarantine_report_sha256),
        ("tokenizer_sha256", not i.tokenizer_sha256),
        ("nodes", not i.nodes), ("startedOn", not i.started_on), ("finishedOn", not i.finished_on)) if missing]


def _kiln_version() -> str:
    from kiln import __version__

    return __version__


def statement_bytes(statement: Mapping[str, Any]) -> bytes:
    """The canonical bytes of a statement: what the DSSE envelope carries and signs."""
    try:
        return canonical_json(statement)
    except ValueError as exc:  # NaN or infinity have no JSON spelling that every reader takes
        raise ProvenanceError(f"provenance statement is not canonical JSON: {exc}") from exc


def subjects(statement: Mapping[str, Any]) -> dict[str, str]:
    """``name -> sha256`` of a statement's subjects (``ProvenanceError`` when the shape is not kiln's)."""
    try:
        return {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    except (KeyError, TypeError) as exc:
        raise ProvenanceError(f"provenance statement: malformed subject list ({exc!r})") from exc


def from_registration(
    *, policy: str, run_key: str, train: Any, eval_report: Any, snapshot: Any, manifest: Any,
    verified: Mapping[str, Any], decision: Any, contract_suite_sha256: str, quarantine_report: str | Path | None,
    launcher: str, nodes: tuple[str, ...], started_on: str, finished_on: str, git_commit: str = "",
    training_manifest_uri: str = "", approval: Mapping[str, Any] | None = None,
    sources: tuple[Mapping[str, Any], ...] = (),
) -> ProvenanceInputs:
    """``ProvenanceInputs`` from what the register stage holds: its refs (``TrainResult``, ``EvalReport``,
    ``SnapshotRef``, ``TrainingManifest``, ``Decision``), the checkpoint manifest ``verify_checkpoint``
    returned (``verified``: the resolved recipe, tokenizer, token manifest and trainer records), and what
    the stages before it know (the contract suite's sha256, the quarantine report's path, the launcher and
    nodes, the run's start and end). This process's code, torch, Python and platform are filled in here."""
    from kiln.refs import sha256_file
    from kiln.runs import split_run_key

    dag_id, run_id = split_run_key(run_key)
    recipe = verified.get("recipe") or {}
    record = verified.get("trainer") or {}
    trainer_spec = str(record.get("spec") or "kiln")
    tokenizer = verified.get("tokenizer") or {}
    tokens = manifest.tokens or {}
    return ProvenanceInputs(
        policy=policy, dag_id=dag_id, run_id=run_id, launcher=launcher, nodes=tuple(nodes),
        recipe=recipe, seed=int(recipe.get("train", {}).get("seed", 0)),
        world_size=int(verified.get("world_size") or train.world_size),
        strategy=str(verified.get("strategy") or recipe.get("parallel", {}).get("strategy", "ddp")),
        steps=int(train.step),
        snapshot_id=snapshot.id, corpus=snapshot.corpus, snapshot_remote=snapshot.remote,
        snapshot_path=str(getattr(snapshot, "path", "") or ""),
        max_quarantine_share=_recorded_threshold(Path(quarantine_report)) if quarantine_report else None,
        contract=manifest.contract, contract_suite_sha256=contract_suite_sha256,
        quarantine_report_sha256=sha256_file(Path(quarantine_report)) if quarantine_report else "",
        quarantine_report_uri=str(quarantine_report or ""),
        training_manifest_sha256=manifest.sha256, training_manifest_uri=training_manifest_uri,
        tokenizer_kind=str(tokenizer.get("kind") or "byte"), tokenizer_sha256=str(verified.get("tokenizer_sha256", "")),
        token_manifest_sha256=str(verified.get("token_manifest_sha256") or manifest.tokens_sha256() or ""),
        token_manifest_uri=str(tokens.get("manifest") or ""),
        git_commit=git_commit, code_sha256=code_sha256(),
        trainer=TrainerIdentity(spec=trainer_spec, distribution=str(record.get("distribution") or ""),
                                version=str(record.get("version") or ""),
                                sha256=package_sha256(trainer_package(trainer_spec))),
        **environment(),
        run_key=run_key, started_on=started_on, finished_on=finished_on,
        checkpoint_manifest_sha256=train.checkpoint_manifest_sha256,
        eval_report=eval_report.to_json(), decision=decision.to_json(), approval=approval, sources=tuple(sources),
    )


def _recorded_threshold(report: Path) -> float | None:
    """The data gate's ``max_quarantine_share`` as the quarantine report records it (None: it does not)."""
    from kiln.util.fs import load_json

    body = load_json(report, "the quarantine report", ProvenanceError, follow_link=False)
    share = body.get("max_quarantine_share") if isinstance(body, dict) else None
    return float(share) if isinstance(share, int | float) and not isinstance(share, bool) else None


def describe(statement: Mapping[str, Any]) -> list[str]:
    """The lineage a statement records, in words, one line each (what ``kiln verify`` prints)."""
    try:
        predicate = statement["predicate"]
        build, run = predicate["buildDefinition"], predicate["runDetails"]
        ext, internal = build["externalParameters"], build["internalParameters"]
        deps = {d["name"].split(":", 1)[0]: d for d in build["resolvedDependencies"]}
        meta = run["metadata"]
    except (KeyError, TypeError) as exc:
        raise ProvenanceError(f"provenance statement: malformed predicate ({exc!r})") from exc

    def dep(kind: str) -> str:
        d = deps.get(kind)
        if d is None:
            return "none"
        digest = ", ".join(f"{k} {v}" for k, v in sorted(d["digest"].items()))
        return f"{d['name']} ({digest})" if digest else d["name"]

    lines = [
        f"{len(statement['subject'])} files, each matching its signed sha256",
        f"built by {run['builder']['id']} (kiln {run['builder'].get('version', {}).get('kiln', '?')}) "
        f"for policy {internal['policy']}: DAG {internal['dag_id']}, run {internal['run_id']}",
        f"ran {meta.get('startedOn', 'start not recorded')} .. {meta.get('finishedOn', 'end not recorded')} "
        f"on launcher {internal['launcher']}, "
        f"nodes {', '.join(internal['nodes']) or 'not recorded'}",
        f"trained {ext['steps']} steps, seed {ext['seed']}, world size {ext['world_size']}, strategy {ext['strategy']}",
        f"from snapshot {dep('snapshot')}",
        f"checked by {dep('contract')}; quarantine report "
        f"{deps['quarantine-report']['digest'].get('sha256', 'not recorded')}",
        f"training manifest sha256 {deps['training-manifest']['digest']['sha256']}; "
        f"tokenizer {dep('tokenizer')}; token manifest {dep('token-manifest')}",
        f"code {dep('code')}; trainer {dep('trainer')} {deps['trainer']['annotations'].get('distribution', '')} "
        f"{deps['trainer']['annotations'].get('version', '')}".rstrip(),
        f"torch {deps['torch']['annotations']['version']}, Python {deps['python']['annotations']['version']}, "
        f"{deps['platform']['annotations']['description']}",
    ]
    if internal.get("unrecorded"):
        lines.append(f"not recorded by the stages before registration: {', '.join(internal['unrecorded'])}")
    for byproduct in run.get("byproducts", []):
        content = byproduct.get("annotations", {}).get("content")
        if byproduct["name"] == "gate-decision" and isinstance(content, dict):
            lines.append(f"gate decision: {content.get('action')} ({'; '.join(content.get('reasons', []))})")
        elif byproduct["name"] == "evaluation-report" and isinstance(content, dict):
            lines.append(f"evaluation: {content.get('bits_per_byte')} bits per byte on split {content.get('split')}")
        elif byproduct["name"] == "approval" and isinstance(content, dict):
            lines.append(f"approved: {content}")
    if not any(b["name"] == "approval" for b in run.get("byproducts", [])):
        lines.append("approval: none recorded in the statement")
    return lines
