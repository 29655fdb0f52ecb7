"""The quarantine report, as JSON and a self-contained HTML page, and its publication to MLflow.

The file and artifact names are ``kiln.runs``' (the run directory's owner), not this module's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.data.contracts import Contract
from kiln.data.layout import layout_hint
from kiln.data.validation.data_gate import quarantined_share
from kiln.data.validation.dropped import HARD_WRAPPED_LAYOUT
from kiln.data.validation.reasons import redact
from kiln.data.validation.shards import SkippedEntry
from kiln.data.validation.suite import _as_contract
from kiln.errors import RegistryError
from kiln.refs import ShardReport
from kiln.runs import QUARANTINE_ARTIFACT_DIR, QUARANTINE_HTML, QUARANTINE_JSON
from kiln.util.fs import atomic_write_text


def quarantine_report(
    reports: Sequence[ShardReport],
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
    skipped: Sequence[SkippedEntry] | None = None,
) -> dict[str, Any]:
    """The JSON report: every shard with verdict and reasons, quarantined ones listed first-class.

    Given ``skipped`` (``skipped_train_entries``), the report also names what was not validated."""
    ordered = sorted(reports, key=lambda r: r.path)
    share = quarantined_share(ordered)
    body: dict[str, Any] = {
        "kind": "kiln.QuarantineReport",
        "contract": sorted({r.contract for r in ordered}),
        "shards": len(ordered),
        "healthy": sum(r.verdict == "healthy" for r in ordered),
        "quarantined": [r.path for r in ordered if r.verdict != "healthy"],
        "quarantined_share": round(share, 6),
        "reports": [r.to_json() for r in ordered],
    }
    if snapshot_id is not None:
        body["snapshot_id"] = snapshot_id
    if max_quarantine_share is not None:
        body["max_quarantine_share"] = max_quarantine_share
        body["gate"] = "pass" if ordered and share <= max_quarantine_share and body["healthy"] else "fail"
    if isinstance(contract, Contract):
        body["contract_sha256"] = contract.sha256
    if skipped is not None:
        body["skipped"] = [e.to_json() for e in sorted(skipped, key=lambda e: e.path)]
    if any(r.dropped is not None for r in ordered):
        body["dropped"] = dropped_summary(ordered)
        hint = layout_hint(body["dropped"]["all_shards"], body["contract"])
        if hint:  # absent otherwise: the other reports keep their bytes
            body["hint"] = hint
    return body


def dropped_summary(reports: Sequence[ShardReport]) -> dict[str, Any]:
    """Documents the contract dropped, by rule: in all shards, and in the healthy ones (what actually
    leaves training besides the quarantined shards)."""

    def tally(chosen: Sequence[ShardReport]) -> dict[str, Any]:
        by_rule: dict[str, int] = {}
        details: dict[str, dict[str, int]] = {}
        for r in chosen:
            for rule, entry in ((r.dropped or {}).get("rules") or {}).items():
                by_rule[rule] = by_rule.get(rule, 0) + int(entry.get("count", 0))
                for detail, count in (entry.get("details") or {}).items():
                    details.setdefault(rule, {})[detail] = details.get(rule, {}).get(detail, 0) + int(count)
        documents = sum(len((r.dropped or {}).get("rows") or []) for r in chosen)
        rows = sum(r.rows for r in chosen)
        body = {"documents": documents, "of_documents": rows, "share": round(documents / rows, 6) if rows else 0.0,
                "by_rule": dict(sorted(by_rule.items())),
                "details": {k: dict(sorted(v.items())) for k, v in sorted(details.items())}}
        layout = sum(int((r.dropped or {}).get(HARD_WRAPPED_LAYOUT, 0)) for r in chosen)
        if layout:
            body[HARD_WRAPPED_LAYOUT] = layout
        return body

    judged = [r for r in reports if r.dropped is not None]
    return {"all_shards": tally(judged), "healthy_shards": tally([r for r in judged if r.verdict == "healthy"])}


def write_quarantine_report(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
    skipped: Sequence[SkippedEntry] | None = None,
) -> Path:
    """Write ``quarantine_report(...)`` atomically; same reports → same bytes (no timestamps)."""
    body = quarantine_report(
        reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract, skipped=skipped
    )
    return atomic_write_text(path, quarantine_report_text(body))


def quarantine_report_text(body: dict[str, Any]) -> str:
    """The text of a quarantine report file (what its recorded sha256 is of)."""
    return json.dumps(body, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


_HTML_STYLE = (
    "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}"
    "td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
    "tr.quarantined td:nth-child(2){color:#b00;font-weight:bold}tr.healthy td:nth-child(2){color:#070}"
    "code{font-size:90%}ul{margin:0;padding-left:1.2em}"
)


def _html_reason(reason: dict[str, Any], patterns: Sequence[str]) -> str:
    from html import escape

    def shown(value: Any) -> str:  # reports may come from JSON of unknown age: redact again
        return escape(redact(str(value), patterns))

    parts = [f"<code>{escape(str(reason.get('expectation')))}</code>"]
    if reason.get("column"):
        parts.append(f" on <code>{escape(str(reason['column']))}</code>")
    if "unexpected_count" in reason:
        parts.append(f" — {reason['unexpected_count']} unexpected")
    parts.extend(f"<br><code>{shown(sample)}</code>" for sample in reason.get("sample", []))
    if reason.get("error"):
        parts.append(f"<br><code>{shown(reason['error'])}</code>")
    return "<li>" + "".join(parts) + "</li>"


def _html_dropped_cell(report: dict[str, Any], patterns: Sequence[str]) -> str:
    from html import escape

    dropped = report.get("dropped")
    if not dropped:
        return "<td>-</td>"
    rows = len(dropped.get("rows") or [])
    items = []
    for rule, entry in (dropped.get("rules") or {}).items():
        details = ", ".join(f"{escape(str(k))} {v}" for k, v in sorted((entry.get("details") or {}).items()))
        samples = "".join(f"<br><code>{escape(redact(str(s), patterns))}</code>" for s in entry.get("sample") or [])
        items.append(f"<li><code>{escape(rule)}</code> — {entry.get('count', 0)} ({details}){samples}</li>")
    return f"<td>{rows} of {report['rows']} ({float(dropped.get('share', 0)):.1%})<ul>{''.join(items)}</ul></td>"


def _html_dropped_summary(summary: dict[str, Any]) -> str:
    from html import escape

    everywhere, healthy = summary["all_shards"], summary["healthy_shards"]
    rules = sorted(set(everywhere["by_rule"]) | set(healthy["by_rule"]))
    rows = "".join(
        f"<tr><td><code>{escape(rule)}</code></td><td>{healthy['by_rule'].get(rule, 0)}</td>"
        f"<td>{everywhere['by_rule'].get(rule, 0)}</td><td>"
        + escape(", ".join(f"{k} {v}" for k, v in everywhere["details"].get(rule, {}).items())) + "</td></tr>"
        for rule in rules
    )
    return (
        f"<h2>Documents dropped: {healthy['documents']} of {healthy['of_documents']} in healthy shards "
        f"({healthy['share']:.1%}); {everywhere['documents']} in all judged shards</h2>"
        "<p>A dropped document stays in its shard file; the TrainingManifest lists its row (<code>drop_rows</code>) "
        "and the tokenize stage leaves it out.</p>"
        "<table><tr><th>rule</th><th>dropped in healthy shards</th><th>dropped in all shards</th><th>details</th></tr>"
        + rows + "</table>"
    )


def _html_contract(contract: Contract) -> str:
    from html import escape

    rules = []
    for i, exp in enumerate(contract.suite["expectations"]):
        kwargs = {k: v for k, v in exp["kwargs"].items() if k != "regex_list"}
        if "regex_list" in exp["kwargs"]:
            kwargs["regex_list"] = f"{len(exp['kwargs']['regex_list'])} patterns"
        rules.append(
            f"<tr><td>{i}</td><td><code>{escape(str((exp.get('meta') or {}).get('kiln_rule', '')))}</code></td>"
            f"<td><code>{escape(exp['type'])}</code></td><td><code>{escape(json.dumps(kwargs, sort_keys=True))}</code></td>"
            f"<td>{escape(str(exp.get('description', '')))}</td></tr>"
        )
    document_rules = "".join(
        f"<tr><td><code>{escape(str(rule.get('rule')))}</code></td><td><code>{escape(str(rule.get('kind')))}</code></td>"
        f"<td><code>{escape(json.dumps(rule.get('params', {}), sort_keys=True))}</code></td>"
        f"<td>{escape(str(rule.get('description', '')))}</td></tr>"
        for rule in contract.document_rules
    )
    near = contract.near_duplicates
    if near is not None:
        settings = {k: v for k, v in near.items() if k not in ("description", "source")}
        document_rules += (f"<tr><td><code>near_duplicate</code></td><td><code>{escape(str(near.get('kind')))}</code></td>"
                           f"<td><code>{escape(json.dumps(settings, sort_keys=True))}</code></td>"
                           f"<td>{escape(str(near.get('description', '')))}</td></tr>")
    documents = (
        f"<h3>Document rules (a failing document is dropped; a shard dropping over {contract.max_dropped_share:.0%} "
        "of its documents is quarantined)</h3>"
        "<table><tr><th>rule</th><th>kind</th><th>parameters</th><th>why</th></tr>" + document_rules + "</table>"
        if document_rules else ""
    )
    return (
        f"<h2>Contract <code>{escape(contract.ref)}</code></h2><p>sha256 <code>{contract.sha256}</code> · "
        f"<code>{escape(str(contract.path))}</code></p>"
        "<table><tr><th>#</th><th>rule</th><th>expectation</th><th>arguments</th><th>why</th></tr>"
        + "".join(rules)
        + "</table>"
        + documents
    )


def _html_skipped(skipped: Sequence[dict[str, str]]) -> str:
    from html import escape

    if not skipped:
        return ""
    rows = "".join(f"<tr class='skipped'><td>{escape(e['path'])}</td><td>{escape(e['reason'])}</td></tr>" for e in skipped)
    return (
        f"<h2>Not validated: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} of train/ that are not shards</h2>"
        "<table><tr><th>path</th><th>why</th></tr>" + rows + "</table>"
    )


def render_quarantine_html(
    reports: Sequence[ShardReport],
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
    skipped: Sequence[SkippedEntry] | None = None,
) -> str:
    """A self-contained HTML page of the quarantine report (for the Airflow task link / MLflow).

    Every shard (path, verdict, rows, sha256, reasons with redacted samples), the snapshot id, the
    gate outcome, what was skipped (given ``skipped``) and, given a ``Contract``, the rules it was
    checked against. Deterministic.
    """
    from html import escape

    body = quarantine_report(
        reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract, skipped=skipped
    )
    loaded = contract if isinstance(contract, Contract) else None
    patterns = loaded.secret_patterns if loaded is not None else ()
    paths = [r["path"] for r in body["reports"]]
    root = os.path.commonpath(paths) if len(paths) > 1 else (os.path.dirname(paths[0]) if paths else "")
    rows = []
    with_drops = "dropped" in body
    for r in sorted(body["reports"], key=lambda r: (r["verdict"] == "healthy", r["path"])):  # on-call reads the top
        name = os.path.relpath(r["path"], root) if root else r["path"]
        reasons = "".join(_html_reason(reason, patterns) for reason in r["reasons"])
        rows.append(
            f"<tr class='{escape(r['verdict'])}'><td title='{escape(r['path'])}'>{escape(name)}</td>"
            f"<td>{escape(r['verdict'])}</td>"
            f"<td>{r['rows']}</td><td><code title='{escape(r['sha256'])}'>{escape(r['sha256'][:12])}</code></td>"
            f"<td><ul>{reasons}</ul></td>" + (_html_dropped_cell(r, patterns) if with_drops else "") + "</tr>"
        )
    gate_line = (
        f"<p>Data gate: <b>{escape(body['gate'])}</b> (max quarantined share {body['max_quarantine_share']:.1%})</p>"
        if "gate" in body
        else ""
    )
    contract_refs = sorted({*body["contract"], *([loaded.ref] if loaded else ([contract] if isinstance(contract, str) else []))})
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kiln quarantine report</title><style>{_HTML_STYLE}</style>"
        "</head><body>"
        f"<h1>Quarantine report</h1><p>Snapshot: <code>{escape(str(body.get('snapshot_id', '-')))}</code> · "
        f"contract: <code>{escape(', '.join(contract_refs))}</code> · {body['healthy']}/{body['shards']} shards healthy · "
        f"quarantined share {body['quarantined_share']:.1%}</p>{gate_line}"
        + (f"<p><b>Hint:</b> {escape(body['hint'])}</p>" if body.get("hint") else "")
        + f"<p>Shards under <code>{escape(root or '-')}</code>; a quarantined shard's bytes stay in the snapshot.</p>"
        "<table><tr><th>shard</th><th>verdict</th><th>rows</th><th>sha256</th><th>reasons</th>"
        + ("<th>documents dropped</th>" if with_drops else "") + "</tr>"
        + "".join(rows)
        + "</table>"
        + (_html_dropped_summary(body["dropped"]) if with_drops else "")
        + _html_skipped(body.get("skipped", []))
        + (_html_contract(loaded) if loaded is not None else "")
        + "</body></html>\n"
    )


def write_quarantine_html(
    reports: Sequence[ShardReport],
    path: str | Path,
    *,
    snapshot_id: str | None = None,
    max_quarantine_share: float | None = None,
    contract: Contract | str | None = None,
    skipped: Sequence[SkippedEntry] | None = None,
) -> Path:
    html = render_quarantine_html(
        reports, snapshot_id=snapshot_id, max_quarantine_share=max_quarantine_share, contract=contract, skipped=skipped
    )
    return atomic_write_text(path, html)


def publish_quarantine_report(
    reports: Sequence[ShardReport],
    out_dir: str | Path,
    *,
    snapshot_id: str,
    contract: Contract | str,
    max_quarantine_share: float,
    mlflow_run_id: str | None = None,
    skipped: Sequence[SkippedEntry] | None = None,
    artifact_path: str = QUARANTINE_ARTIFACT_DIR,
) -> dict[str, str]:
    """Write the JSON report and the HTML page to ``out_dir``; log both to an MLflow run if given.

    Returns ``{"json": path, "html": path}`` plus ``"json_uri"`` / ``"html_uri"`` (artifact URIs
    under ``artifact_path`` of the run: ``quarantine/``, a mixture's ``quarantine/<source>/``) when
    ``mlflow_run_id`` is given; the tracking URI comes from
    the environment (``MLFLOW_TRACKING_URI``). Idempotent: the same reports rewrite the same bytes
    and re-log the same artifact paths. An MLflow failure is a ``RegistryError`` (retryable).
    """
    contract = _as_contract(contract)
    out = Path(out_dir)
    options: dict[str, Any] = {"snapshot_id": snapshot_id, "max_quarantine_share": max_quarantine_share, "contract": contract}
    json_path = write_quarantine_report(reports, out / QUARANTINE_JSON, skipped=skipped, **options)
    html_path = write_quarantine_html(reports, out / QUARANTINE_HTML, skipped=skipped, **options)
    published = {"json": str(json_path), "html": str(html_path)}
    if mlflow_run_id:
        published |= log_report_files(mlflow_run_id, json_path, html_path, artifact_path=artifact_path)
    return published


def log_report_files(mlflow_run_id: str, json_path: Path, html_path: Path, *,
                     artifact_path: str = QUARANTINE_ARTIFACT_DIR) -> dict[str, str]:
    """Log a report's JSON and HTML to an MLflow run under ``artifact_path``; their artifact URIs
    (``{"json_uri", "html_uri"}``). The tracking URI is kiln's settings'; an MLflow failure is a
    ``RegistryError`` (retryable). A mixture's quarantine index is logged the same way."""
    from mlflow import MlflowClient

    from kiln.settings import load

    try:
        # Explicit URI: mlflow's process-global one may have been set by other code in this process.
        client = MlflowClient(tracking_uri=load().mlflow_uri)
        for path in (json_path, html_path):
            client.log_artifact(mlflow_run_id, str(path), artifact_path=artifact_path)
        base = client.get_run(mlflow_run_id).info.artifact_uri.rstrip("/")
    except Exception as exc:  # MlflowException, connection errors, artifact store errors
        raise RegistryError(f"cannot log the quarantine report to MLflow run {mlflow_run_id}: {exc}") from exc
    return {"json_uri": f"{base}/{artifact_path}/{json_path.name}", "html_uri": f"{base}/{artifact_path}/{html_path.name}"}
