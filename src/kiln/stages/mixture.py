"""A run of a data mixture (``kiln.data.mixtures``) through the data stages: every source pinned,
validated against its own contract and gated by its own threshold; the run's training manifest lists
them (format 2), and the tokenize stages pack each with the run's one tokenizer (``tokenize``).

    snapshot (each source) ─► shard_plan (batches of one source each) ─► validate_shards (mapped)
        ─► data_gate (each source by its contract and threshold) ─► tokenizer ─► tokenize ─► tokens

The same DAG runs a mixture and a single corpus: the ``snapshot`` XCom is a ``PinnedMixture``
instead of a ``PinnedSnapshot``, a plan entry names its source (``"<source>:<shard>"``), and the data
gate's answer lists its sources (``DataGateResult.sources``). Which contract, weight and threshold a
source has is never an XCom's word: each task takes them from the mixture the run names, as
``run_policy`` takes a single corpus' contract from the run's params and the corpus' own record.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kiln import runs
from kiln.data.mixtures import Mixture, load_mixture
from kiln.errors import ConfigError, DataGateError, ManifestError, RunMismatchError, SnapshotMismatchError
from kiln.policy import Policy
from kiln.refs import (
    DataGateResult,
    PinnedMixture,
    PinnedSnapshot,
    PinnedSource,
    QuarantinedShard,
    ShardReport,
    SourceGate,
    TrainingManifest,
)
from kiln.runs import run_dir
from kiln.stages.records import differing_fields, mlflow_run_of, recorded_snapshot
from kiln.util.fs import atomic_write_text

MIXTURE_PARAM = "mixture"
"""The run parameter naming a mixture under ``training/mixtures/`` (sandbox form); None: one corpus."""
SOURCES_SUBDIR = "sources"
"""A mixture run's per-source records in its run directory: ``sources/<name>/`` (quarantine report)."""
PLAN_SEPARATOR = ":"
"""A mixture's shard plan entry: ``<source>:<shard path relative to its snapshot>``."""
MIXTURE_REPORT_KIND = "kiln.MixtureQuarantineReport"


def run_mixture(policy: Policy, params: dict[str, Any]) -> Mixture | None:
    """The mixture a run trains: the policy's own (production's reviewed ``[mixture]``), else its
    ``mixture`` parameter's; None for a run of one corpus. ``MixtureError`` naming the file and field
    for one that cannot be trained; a pinned policy (production) takes no mixture from its run's
    parameters."""
    name = params.get(MIXTURE_PARAM)
    if name and policy.pinned_inputs:
        raise ConfigError(f"{policy.name} runs take no {MIXTURE_PARAM!r} parameter: their inputs are pinned")
    if policy.mixture is not None:
        return policy.mixture
    return load_mixture(str(name)) if name else None


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSource:
    """A source as a run's tasks judge it: declared (name, weight, threshold), resolved (contract) and
    pinned (snapshot)."""

    name: str
    weight: float
    contract: str
    max_quarantine_share: float
    snapshot: PinnedSnapshot
    limits: dict[str, int] = field(default_factory=dict)
    """Its caps as its training manifest entry carries them (``Mixture.resolved_limits``; empty: it recycles)."""

    def policy(self, policy: Policy) -> Policy:
        """``policy`` as this source's validation sees it: its contract."""
        return replace(policy, contract=self.contract, max_quarantine_share=self.max_quarantine_share)


def _label(mixture: Mixture, name: str) -> str:
    index = next(i for i, s in enumerate(mixture.sources) if s.name == name)
    return f"mixture {mixture.name!r} sources[{index}] ({name!r})"


def mixture_snapshot_stage(policy: Policy, mixture: Mixture, expected_ids: list[str] | None = None) -> PinnedMixture:
    """Every source of ``mixture`` snapshotted with DVC and pinned, in declared order: the run's set of
    snapshot ids. Each source's contract is resolved here too, so a corpus that is not there or a
    contract that does not fit its corpus stops the run in its first task, naming the source."""
    from kiln.stages.snapshot import pin_corpus

    pinned: list[PinnedSource] = []
    for source in mixture.sources:
        try:
            snap = pin_corpus(source.corpus)
            _resolve_contract(policy, source.contract, snap)
        except ConfigError as exc:
            raise type(exc)(f"{_label(mixture, source.name)}: {exc}") from exc
        pinned.append(PinnedSource(name=source.name, weight=source.weight, snapshot=snap))
    result = PinnedMixture.of(mixture.name, pinned)
    if expected_ids and not {s.snapshot.id for s in pinned} & set(expected_ids):
        raise SnapshotMismatchError(f"run was triggered for corpus snapshot(s) {', '.join(expected_ids)}, but mixture "
                                    f"{mixture.name!r} pinned {result.id}: none of them")
    return result


def _resolve_contract(policy: Policy, declared: str | None, snapshot: PinnedSnapshot) -> str:
    """A source's contract: the declared one, else its corpus' own (``run_contract``, from kiln's pinned copy)."""
    from kiln.data.contracts import load_contract
    from kiln.data.corpora import read_metadata, run_contract

    metadata = read_metadata(recorded_snapshot(snapshot.id).path)
    contract = run_contract(declared, metadata, policy.contract, corpus=snapshot.corpus)
    load_contract(contract)
    return contract


def run_sources(policy: Policy, params: dict[str, Any], pinned: PinnedMixture,
                only: str | None = None) -> list[RunSource]:
    """The run's sources as its tasks judge them: declared by the mixture the run names, pinned by
    the ``snapshot`` XCom, which must be of exactly those sources and corpora (``RunMismatchError``
    naming the field otherwise). ``only``: just that source (a validation batch's), whose contract alone
    is then resolved."""
    mixture = run_mixture(policy, params)
    if mixture is None or mixture.name != pinned.mixture:
        raise RunMismatchError(f"the snapshot task's XCom pinned mixture {pinned.mixture!r}, but the run names "
                               f"{None if mixture is None else mixture.name!r} (an XCom is only a reference; refusing)")
    declared = [(s.name, s.corpus) for s in mixture.sources]
    said = [(s.name, s.snapshot.corpus) for s in pinned.sources]
    if declared != said:
        raise RunMismatchError(f"the snapshot task's XCom pinned sources {said} of mixture {mixture.name!r}, which "
                               f"declares {declared} (an XCom is only a reference; refusing)")
    out = []
    for declared_source, pinned_source in zip(mixture.sources, pinned.sources, strict=True):
        if only is not None and declared_source.name != only:
            continue
        try:
            contract = _resolve_contract(policy, declared_source.contract, pinned_source.snapshot)
        except ConfigError as exc:
            raise type(exc)(f"{_label(mixture, declared_source.name)}: {exc}") from exc
        share = declared_source.max_quarantine_share
        out.append(RunSource(name=declared_source.name, weight=declared_source.weight, contract=contract,
                             max_quarantine_share=policy.max_quarantine_share if share is None else share,
                             snapshot=pinned_source.snapshot, limits=mixture.resolved_limits(declared_source)))
    return out


def mixture_shard_batches(policy: Policy, pinned: PinnedMixture) -> list[list[str]]:
    """Every source's shards cut into validation batches as one corpus' are, a batch never spanning two
    sources (each is checked against its own contract); an entry is ``<source>:<shard>``."""
    from kiln.stages.validation import shard_batches

    return [[f"{source.name}{PLAN_SEPARATOR}{shard}" for shard in batch]
            for source in pinned.sources for batch in shard_batches(policy, source.snapshot)]


def batch_source(sources: list[str], entries: list[str]) -> tuple[str, list[str]]:
    """The source (of the names ``sources``) a batch of plan entries is of, and its shards;
    ``RunMismatchError`` for a batch that names no source of the run, or two."""
    names = {entry.partition(PLAN_SEPARATOR)[0] for entry in entries}
    if len(names) != 1 or not all(PLAN_SEPARATOR in e for e in entries) or next(iter(names)) not in sources:
        raise RunMismatchError(f"a validation batch must be shards of one source of the run "
                               f"({', '.join(sources)}), as '<source>:<shard>'; got {entries[:3]}")
    return names.pop(), [entry.partition(PLAN_SEPARATOR)[2] for entry in entries]


def mixture_validate_stage(policy: Policy, params: dict[str, Any], pinned: PinnedMixture, entries: list[str],
                           key: str) -> list[ShardReport]:
    """One batch of one source's shards checked against that source's contract (``validate_stage``)."""
    from kiln.stages.validation import validate_stage

    name, shards = batch_source([s.name for s in pinned.sources], entries)
    [source] = run_sources(policy, params, pinned, only=name)  # the XCom checked whole, one contract resolved
    return validate_stage(source.policy(policy), source.snapshot, shards, key, source=source.name)


def mixture_data_gate_stage(policy: Policy, params: dict[str, Any], pinned: PinnedMixture,
                            batches: list[list[ShardReport]], key: str) -> DataGateResult:
    """Each source gated by its own contract and threshold (``gate_snapshot``), its quarantine report
    under ``sources/<name>/`` of the run (and ``quarantine/<name>/`` of its MLflow run); the index of
    them; and the run's training manifest, format 2, listing every source with its weight.

    Every source's report is written before any gate is judged; a source that breaches its gate
    stops the run, naming it (``DataGateError``, no retry), as does a source with no healthy shard."""
    from kiln.data.contracts import load_contract
    from kiln.data.validation import train_shards
    from kiln.stages.validation import (
        _pinned_training_manifest,
        _short_reasons,
        _signatures_dir,
        check_reports,
        gate_snapshot,
    )

    sources = run_sources(policy, params, pinned)
    said = [r for batch in batches for r in batch]
    out = run_dir(key)
    previous = _pinned_training_manifest(out / runs.TRAINING_MANIFEST)
    if previous is not None and previous.snapshot_id != pinned.id:
        raise RunMismatchError(f"run {key} already pinned training manifest {out / runs.TRAINING_MANIFEST} of "
                               f"snapshots {previous.snapshot_id}; this try's are {pinned.id}: a run trains on one "
                               "set of snapshots, trigger a new run for the new bytes")
    mlflow_run_id = mlflow_run_of(policy, key, {"kiln.snapshot_id": pinned.id, "kiln.policy": policy.name,
                                                "kiln.mixture": pinned.mixture})
    entries: list[dict[str, Any]] = []
    gates: list[SourceGate] = []
    breaches: list[str] = []
    quarantined_all: list[QuarantinedShard] = []
    validated = 0
    for source in sources:
        root = Path(recorded_snapshot(source.snapshot.id).path)
        expected = {str(p) for p in train_shards(root)}
        mine = [r for r in said if r.path in expected]
        reports = check_reports(key, source.snapshot.id, source.contract, expected, mine, what=f"source {source.name!r}")
        folder = out / SOURCES_SUBDIR / source.name
        try:
            gated = gate_snapshot(load_contract(source.contract), root, source.snapshot.id, source.snapshot.corpus,
                                  reports, folder, signatures_dir=_signatures_dir(key, source.name),
                                  max_quarantine_share=source.max_quarantine_share, mlflow_run_id=mlflow_run_id,
                                  artifact_path=f"{runs.QUARANTINE_ARTIFACT_DIR}/{source.name}")
        except DataGateError as exc:
            breaches.append(f"source {source.name!r} (corpus {source.snapshot.corpus}, contract {source.contract}): {exc}")
            continue
        quarantined = [r for r in gated.reports if r.verdict == "quarantined"]
        validated += len(gated.reports)
        published = gated.published
        manifest = gated.manifest
        if not manifest.shards:
            breaches.append(f"source {source.name!r} (corpus {source.snapshot.corpus}): no healthy shard to train on")
            continue
        names = [QuarantinedShard(path=Path(r.path).name, reasons=_short_reasons(r)) for r in quarantined]
        quarantined_all += [QuarantinedShard(path=f"{source.name}/{q.path}", reasons=q.reasons) for q in names]
        gates.append(SourceGate(
            name=source.name, weight=source.weight, corpus=source.snapshot.corpus, snapshot_id=source.snapshot.id,
            contract=source.contract, healthy=len(manifest.shards), quarantined=names,
            quarantine_rate=round(len(quarantined) / len(gated.reports), 4) if gated.reports else 1.0,
            max_quarantine_share=source.max_quarantine_share, report=published["json"], report_html=published["html"],
            report_html_uri=published.get("html_uri", ""),
        ))
        entries.append({"name": source.name, "weight": source.weight, "corpus": source.snapshot.corpus,
                        "snapshot_id": source.snapshot.id, "contract": source.contract, "shards": manifest.shards,
                        "eval_shards": manifest.eval_shards, "quarantined": manifest.quarantined, **source.limits})
    if breaches:
        raise DataGateError(f"mixture {pinned.mixture!r}: " + "; ".join(breaches))
    try:
        manifest = TrainingManifest.build_mixture(entries)
    except ManifestError as exc:
        raise ManifestError(f"mixture {pinned.mixture!r}: {exc}") from exc
    as_gated = previous.without_tokens() if previous is not None else None
    if as_gated is not None and as_gated.sha256 != manifest.sha256:
        differs = differing_fields(as_gated.to_json(), manifest.to_json(), skip=frozenset({"sha256"}))
        raise RunMismatchError(f"run {key} already pinned training manifest {as_gated.sha256[:16]}… of the same "
                               f"snapshots; this try built {manifest.sha256[:16]}… (differs in {', '.join(differs)}): "
                               "not replacing it")
    manifest_path = out / runs.TRAINING_MANIFEST
    if as_gated is None or as_gated is previous:
        manifest.write(manifest_path)
    index = _publish_index(pinned, gates, out, mlflow_run_id)
    return DataGateResult(
        manifest=str(manifest_path), manifest_sha256=manifest.sha256, healthy=len(manifest.shards),
        quarantined=quarantined_all, quarantine_rate=round(len(quarantined_all) / validated, 4) if validated else 1.0,
        report=index["json"], report_html=index["html"], report_html_uri=index.get("html_uri", ""),
        mlflow_run_id=mlflow_run_id, contract=manifest.contract, sources=gates,
    )


def _publish_index(pinned: PinnedMixture, gates: list[SourceGate], out: Path, mlflow_run_id: str) -> dict[str, str]:
    """The index of a mixture's quarantine reports, JSON and HTML, in the run directory and its MLflow
    run: what the data gate task's link opens."""
    shards = sum(g.healthy + len(g.quarantined) for g in gates)
    quarantined = sum(len(g.quarantined) for g in gates)
    body = {"kind": MIXTURE_REPORT_KIND, "mixture": pinned.mixture, "snapshot_id": pinned.id, "shards": shards,
            "quarantined_share": round(quarantined / shards, 6) if shards else 0.0, "gate": "each source's own",
            "sources": [{k: v for k, v in g.to_json().items() if k != "tokens"} for g in gates]}
    json_path = atomic_write_text(out / runs.QUARANTINE_JSON, json.dumps(body, indent=1, sort_keys=True) + "\n")
    rows = "".join(
        f"<tr><td>{html.escape(g.name)}</td><td>{g.weight:g}</td><td>{html.escape(g.corpus)}</td>"
        f"<td><code>{html.escape(g.contract)}</code></td><td>{g.healthy}</td><td>{len(g.quarantined)}</td>"
        f"<td>{g.quarantine_rate:.1%} (gate {g.max_quarantine_share:.0%})</td>"
        f'<td><a href="{html.escape(g.name)}/{html.escape(Path(g.report_html).name)}">report</a></td></tr>'
        + "".join(f"<tr><td></td><td colspan=7>quarantined: <code>{html.escape(q.path)}</code> — "
                  f"{html.escape('; '.join(q.reasons))}</td></tr>" for q in g.quarantined)
        for g in gates)
    page = (f"<!doctype html><meta charset=utf-8><title>Quarantine reports: mixture {html.escape(pinned.mixture)}"
            f"</title><h1>Quarantine reports of mixture <code>{html.escape(pinned.mixture)}</code></h1>"
            f"<p>Snapshots: <code>{html.escape(pinned.id)}</code>. Each source is judged by its own contract and gate.</p>"
            "<table><tr><th>source</th><th>weight</th><th>corpus</th><th>contract</th><th>healthy shards</th>"
            f"<th>quarantined</th><th>quarantined share</th><th></th></tr>{rows}</table>\n")
    html_path = atomic_write_text(out / runs.QUARANTINE_HTML, page)
    published = {"json": str(json_path), "html": str(html_path)}
    if mlflow_run_id:
        from kiln.data.validation.report import log_report_files

        published |= log_report_files(mlflow_run_id, json_path, html_path)
    return published




# ----------------------------------------------------------------------------- the DAG's data tasks
# One corpus or a mixture: the DAG's snapshot, shard_plan, validate_shards and data_gate tasks call
# these, which hand a mixture run to the stages above and a one-corpus run to the stages it always had.


def snapshot_run_stage(policy: Policy, params: dict[str, Any],
                       expected_ids: list[str] | None = None) -> PinnedSnapshot | PinnedMixture:
    """The run's inputs pinned: the mixture its ``mixture`` parameter names, else its corpus."""
    from kiln.stages.inputs import CONTRACT_PARAM, run_policy
    from kiln.stages.snapshot import snapshot_stage

    mixture = run_mixture(policy, params)
    if mixture is None:
        pinned = snapshot_stage(policy, params.get("corpus"), expected_ids)
        run_policy(policy, params, pinned)  # a contract that does not fit: now
        return pinned
    if params.get(CONTRACT_PARAM):
        raise ConfigError(f"run parameter {CONTRACT_PARAM}={params[CONTRACT_PARAM]!r} with mixture {mixture.name!r}: "
                          f"each source of a mixture is validated with its own contract ({mixture.origin}); leave "
                          f"{CONTRACT_PARAM} empty")
    return mixture_snapshot_stage(policy, mixture, expected_ids)


def run_shard_batches(policy: Policy, pinned: PinnedSnapshot | PinnedMixture) -> list[list[str]]:
    from kiln.stages.validation import shard_batches

    return mixture_shard_batches(policy, pinned) if isinstance(pinned, PinnedMixture) else shard_batches(policy, pinned)


def validate_run_stage(policy: Policy, params: dict[str, Any], pinned: PinnedSnapshot | PinnedMixture,
                       shards: list[str], key: str) -> list[ShardReport]:
    from kiln.stages.inputs import run_policy
    from kiln.stages.validation import validate_stage

    if isinstance(pinned, PinnedMixture):
        return mixture_validate_stage(policy, params, pinned, shards, key)
    return validate_stage(run_policy(policy, params, pinned), pinned, shards, key)


def data_gate_run_stage(policy: Policy, params: dict[str, Any], pinned: PinnedSnapshot | PinnedMixture,
                        batches: list[list[ShardReport]], key: str) -> DataGateResult:
    from kiln.stages.inputs import run_policy
    from kiln.stages.validation import data_gate_stage

    if isinstance(pinned, PinnedMixture):
        return mixture_data_gate_stage(policy, params, pinned, batches, key)
    return data_gate_stage(run_policy(policy, params, pinned), pinned, batches, key)
