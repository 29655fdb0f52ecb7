"""What a datasheet reads beside the signed statement, and where it is published.

    local_sources(statement, ...) -> DatasheetSources       the files the statement names, on this machine
    publish_datasheet(client, run_id, statement, sources)   datasheet/{datasheet.md,datasheet.html,sources/...}
                                                            logged to the version's MLflow run
    run_sources(run_id, statement, ...) -> DatasheetSources the copies publish_datasheet logged, else local_sources,
                                                            and the approval attestation the version's tags name

The datasheet is logged to the *run*, never into the model directory: that directory is the signed
artifact (``model.sig`` covers every file of it), and a file added there would make the version fail
verification. MLflow keeps a run's artifacts apart from its logged models' (``<run>/artifacts/`` vs
``models/<model id>/artifacts/``), and the version's description links to the run's copy.
``datasheet/sources/`` keeps the exact bytes the logged datasheet read (the quarantine report, the
contract suite, ``corpus.json``) so that ``kiln datasheet`` can make it again elsewhere; each is used
only as ``build_datasheet`` allows (the first two only with the digest the statement signed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.data.corpora import METADATA_FILE
from kiln.errors import ContractError, ProvenanceError
from kiln.provenance.datasheet import (
    DATASHEET_DIR,
    DATASHEET_HTML,
    DATASHEET_MARKDOWN,
    SOURCES_DIR,
    DatasheetSources,
    render,
)
from kiln.runs import QUARANTINE_JSON
from kiln_trainer.contract import canonical_json

if TYPE_CHECKING:
    from mlflow import MlflowClient

QUARANTINE_REPORT_FILE = QUARANTINE_JSON
CONTRACT_SUITE_FILE = "contract-suite.json"
CORPUS_METADATA_FILE = METADATA_FILE
"""The names under ``datasheet/sources/``: the run's and the corpus' own."""
MAX_SOURCE_BYTES = 256 << 20
"""A quarantine report lists every shard of a snapshot; larger than this is not read."""


def _dependency(statement: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    try:
        deps = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
        return next((d for d in deps if str(d.get("name", "")).split(":", 1)[0] == kind), {})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ProvenanceError(f"provenance statement: malformed resolvedDependencies ({exc!r})") from exc


def _read(path: Path | str | None, what: str) -> bytes | None:
    """The bytes of a regular file (not through a link), or None when it is not there or unreadable:
    a missing source is said so in the datasheet, not a fault of registration."""
    from kiln.util.fs import read_bounded

    if not path:
        return None
    try:
        return read_bounded(path, what, ProvenanceError, max_bytes=MAX_SOURCE_BYTES, follow_link=False)
    except ProvenanceError:
        return None


def _contract_suite(statement: Mapping[str, Any]) -> dict[str, Any] | None:
    """The installed contract's suite of the ``name@version`` the statement names (None: not installed)."""
    from kiln.data.contracts import load_contract

    ref = str(_dependency(statement, "contract").get("name", "")).removeprefix("contract:")
    if not ref:
        return None
    try:
        return load_contract(ref).suite
    except (ContractError, OSError):
        return None


def local_sources(statement: Mapping[str, Any], *, quarantine_report: Path | str | None = None,
                  snapshot_dir: Path | str | None = None, model_version: str = "",
                  approval_tags: Mapping[str, str] | None = None) -> DatasheetSources:
    """The sources on this machine: the quarantine report at ``quarantine_report`` (default: where the
    statement says it was), the installed contract's suite, and ``corpus.json`` of ``snapshot_dir``
    (default: the snapshot copy the statement says the run read)."""
    report = quarantine_report or _dependency(statement, "quarantine-report").get("uri")
    snapshot = snapshot_dir or (_dependency(statement, "snapshot").get("annotations") or {}).get("path")
    return DatasheetSources(
        model_version=model_version,
        quarantine_report=_read(report, "the quarantine report"),
        contract_suite=_contract_suite(statement),
        corpus_metadata=_read(Path(snapshot) / CORPUS_METADATA_FILE, "corpus.json") if snapshot else None,
        approval_tags=dict(approval_tags or {}))


def publish_datasheet(client: MlflowClient, run_id: str, statement: Mapping[str, Any],
                      sources: DatasheetSources) -> dict[str, str]:
    """Log the datasheet (Markdown and HTML) and the sources it read to ``run_id`` under
    ``datasheet/``; returns ``{"markdown", "html"}`` as ``runs:/`` URIs. Idempotent: the same
    statement and sources log the same bytes at the same paths."""
    markdown, page = render(statement, sources)
    client.log_text(run_id, markdown, f"{DATASHEET_DIR}/{DATASHEET_MARKDOWN}")
    client.log_text(run_id, page, f"{DATASHEET_DIR}/{DATASHEET_HTML}")
    kept = {QUARANTINE_REPORT_FILE: sources.quarantine_report, CORPUS_METADATA_FILE: sources.corpus_metadata,
            CONTRACT_SUITE_FILE: None if sources.contract_suite is None else canonical_json(sources.contract_suite)}
    with tempfile.TemporaryDirectory(prefix="kiln-datasheet-") as tmp:
        for name, data in kept.items():
            if data is not None:
                (Path(tmp) / name).write_bytes(data)
                client.log_artifact(run_id, str(Path(tmp) / name), f"{DATASHEET_DIR}/{SOURCES_DIR}")
    return {"markdown": f"runs:/{run_id}/{DATASHEET_DIR}/{DATASHEET_MARKDOWN}",
            "html": f"runs:/{run_id}/{DATASHEET_DIR}/{DATASHEET_HTML}"}


def run_sources(run_id: str, statement: Mapping[str, Any], *, model_version: str = "",
                approval_tags: Mapping[str, str] | None = None) -> DatasheetSources:
    """The sources registration logged with the run's datasheet, each one it did not log (or a run
    with none) from this machine (``local_sources``)."""
    import mlflow

    from kiln.util.fs import parse_json

    local = local_sources(statement, model_version=model_version, approval_tags=approval_tags)
    approval, problem = approval_of(statement, approval_tags or {})
    local = dataclasses.replace(local, approval=approval, approval_problem=problem)
    if not run_id:
        return local
    with tempfile.TemporaryDirectory(prefix="kiln-datasheet-") as tmp:
        try:
            folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=f"{DATASHEET_DIR}/{SOURCES_DIR}",
                                                              dst_path=tmp))
        except Exception:  # MlflowException or OSError: a run registered before datasheets has no such folder
            return local
        report = _read(folder / QUARANTINE_REPORT_FILE, "the quarantine report")
        corpus = _read(folder / CORPUS_METADATA_FILE, "corpus.json")
        suite_bytes = _read(folder / CONTRACT_SUITE_FILE, "the contract suite")
    suites: list[Mapping[str, Any]] = []
    if suite_bytes is not None:
        try:
            parsed = parse_json(suite_bytes, "the contract suite", ProvenanceError)
            suites += [parsed] if isinstance(parsed, dict) else []
        except ProvenanceError:
            pass
    suites += [local.contract_suite] if local.contract_suite is not None else []
    signed_report = str((_dependency(statement, "quarantine-report").get("digest") or {}).get("sha256", ""))
    signed_suite = str((_dependency(statement, "contract").get("digest") or {}).get("sha256", ""))
    reports = [r for r in (report, local.quarantine_report) if r is not None]
    return DatasheetSources(
        model_version=model_version,
        quarantine_report=_signed_first(reports, signed_report, lambda r: r),
        contract_suite=_signed_first(suites, signed_suite, canonical_json),
        corpus_metadata=corpus if corpus is not None else local.corpus_metadata,
        approval_tags=dict(approval_tags or {}), approval=approval, approval_problem=problem)


def approval_of(statement: Mapping[str, Any], tags: Mapping[str, str]) -> tuple[dict[str, Any] | None, str]:
    """The verified approval attestation the version's ``tags`` name (``kiln.promotion.attestation``), as its
    predicate, or None and why not ("" when the tags name none): it must have the sha256 the tags say and
    verify for ``statement`` (``kiln.provenance.approval.verify_approval``)."""
    import mlflow

    from kiln.provenance.approval import verify_approval
    from kiln.registry.tags import TAGS

    uri = tags.get(TAGS["promotion_attestation"], "")
    if not uri:
        return None, ""
    with tempfile.TemporaryDirectory(prefix="kiln-approval-") as tmp:
        try:
            path = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp))
        except Exception as exc:  # MlflowException or OSError: say so in the datasheet, never fail it
            return None, f"{uri} could not be read ({type(exc).__name__})"
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        if sha != tags.get(TAGS["promotion_attestation_sha256"]):
            return None, (f"{uri} has sha256 {sha}, the version's tag says "
                          f"{tags.get(TAGS['promotion_attestation_sha256'], 'nothing')}")
        try:
            return verify_approval(path, statement), ""
        except ProvenanceError as exc:
            return None, str(exc)


def _signed_first(candidates: list[Any], signed: str, to_bytes: Callable[[Any], bytes]) -> Any:
    """The first candidate whose bytes have the digest the statement signed, else the first one (which
    the datasheet then names as differing), else None."""
    return next((c for c in candidates if hashlib.sha256(to_bytes(c)).hexdigest() == signed),
                candidates[0] if candidates else None)
