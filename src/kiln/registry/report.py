"""The reviewer's report: loss curve (PNG or SVG), metrics against the champion, markdown, HTML, description."""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.refs import (
    Decision,
    EvalReport,
    TrainResult,
)
from kiln.runs import METRICS_JSONL, RUN_KEY_TAG

if TYPE_CHECKING:
    from mlflow import MlflowClient

from kiln.registry.tags import LOSS_METRIC, REPORT_DIR, TAGS
from kiln.util.fs import parse_own_json
from kiln_trainer.contract import ROLLBACK_EVENT

# ----------------------------------------------------------------------------- evaluation report


@dataclass(frozen=True, kw_only=True, slots=True)
class LossCurve:
    """The training loss per step, as a reviewer should read it (last value logged for each step)."""

    points: list[tuple[int, float]]
    """``(step, loss)`` sorted by step; a resumed run's re-logged steps keep their latest value."""
    source: str
    """Where the points came from, for the report ("MLflow metric `loss` of run …", a file path, "none")."""
    rollbacks: list[int]
    """Steps where the trainer's loss guard rolled back (drawn as markers)."""


def read_loss_jsonl(path: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` from the trainer's ``metrics.jsonl``; events, non-finite and torn lines skipped."""
    by_step: dict[int, float] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = parse_own_json(line, "a report line")
        except ValueError:
            continue  # a line torn by a crash mid-write; the rest of the file is still good
        if not isinstance(record, dict) or record.get("event"):
            continue
        step, loss = record.get("step"), record.get(LOSS_METRIC)
        if isinstance(step, int) and isinstance(loss, int | float) and not isinstance(loss, bool) and math.isfinite(loss):
            by_step[step] = float(loss)  # later lines (after a resume) replace earlier ones
    return sorted(by_step.items())


def loss_curve(client: MlflowClient, run_id: str, train: TrainResult) -> LossCurve:
    """The training run's ``loss`` history from MLflow, else the trainer's ``RUN_DIR/metrics.jsonl``."""
    rollbacks = sorted({int(e["at_step"]) for e in train.events
                        if e.get("kind") == ROLLBACK_EVENT and isinstance(e.get("at_step"), int)})
    by_step: dict[int, float] = {}
    if train.mlflow_run_id:
        for metric in sorted(client.get_metric_history(run_id, LOSS_METRIC), key=lambda m: (m.timestamp, m.step)):
            if math.isfinite(metric.value):
                by_step[int(metric.step)] = float(metric.value)
    if by_step:
        return LossCurve(points=sorted(by_step.items()), source=f"MLflow metric `{LOSS_METRIC}` of run {run_id}",
                         rollbacks=rollbacks)
    jsonl = Path(train.run_dir) / METRICS_JSONL
    points = read_loss_jsonl(jsonl) if train.run_dir else []
    return LossCurve(points=points, source=str(jsonl) if points else "none (no loss was logged)", rollbacks=rollbacks)


def loss_curve_png(curve: LossCurve, references: dict[str, float]) -> bytes | None:
    """The curve as a PNG (matplotlib, headless), with ``references`` as horizontal lines; None
    when matplotlib is not installed or there is nothing to draw."""
    if not curve.points:
        return None
    try:
        from matplotlib.figure import Figure  # the OO API: no pyplot global state, no display needed
    except ImportError:
        return None
    import io

    steps, losses = zip(*curve.points, strict=True)
    fig = Figure(figsize=(7.5, 3.6), dpi=100, layout="tight")
    ax = fig.add_subplot()
    ax.plot(steps, losses, color="tab:blue", linewidth=1.4, marker="o" if len(steps) <= 30 else None,
            markersize=3, label=f"training {LOSS_METRIC}")
    for (label, value), color in zip(references.items(), ("tab:green", "tab:orange"), strict=False):
        ax.axhline(value, color=color, linestyle=":", linewidth=1.2, label=label)
    for i, step in enumerate(curve.rollbacks):
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="guard rollback" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def loss_curve_svg(curve: LossCurve, references: dict[str, float], width: int = 720, height: int = 320) -> str:
    """The curve as a standalone SVG (no dependency): polyline, axis extremes, reference lines."""
    left, right, top, bottom = 64, 16, 28, 40
    if not curve.points:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60">'
                f'<text x="8" y="30" font-family="sans-serif" font-size="13">no training loss logged</text></svg>')
    steps = [s for s, _ in curve.points]
    values = [v for _, v in curve.points] + list(references.values())
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5

    def x(step: float) -> float:
        return left + (step - x0) / (x1 - x0) * (width - left - right)

    def y(value: float) -> float:
        return top + (y1 - value) / (y1 - y0) * (height - top - bottom)

    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in curve.points)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="13">Training loss</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
        f'fill="none" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y1:.3f}</text>',
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{y0:.3f}</text>',
        f'<text x="{left}" y="{height - bottom + 14}" text-anchor="middle">{x0}</text>',
        f'<text x="{width - right}" y="{height - bottom + 14}" text-anchor="middle">{x1}</text>',
        f'<text x="{width / 2:.0f}" y="{height - 8}" text-anchor="middle">step</text>',
    ]
    for (label, value), color in zip(references.items(), ("#2ca02c", "#ff7f0e"), strict=False):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                     f'stroke="{color}" stroke-dasharray="2,3"/>')
        parts.append(f'<text x="{width - right - 4}" y="{y(value) - 3:.1f}" text-anchor="end" fill="{color}">'
                     f"{html.escape(label)} {value:.3f}</text>")
    for step in curve.rollbacks:
        parts.append(f'<line x1="{x(step):.1f}" x2="{x(step):.1f}" y1="{top}" y2="{height - bottom}" '
                     f'stroke="#d62728" stroke-dasharray="5,3"/>')
    parts.append(f'<polyline points="{line}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "\n".join(parts)


def _metric_rows(eval_report: EvalReport, champion: EvalReport | None) -> list[tuple[str, str, str, str]]:
    """(metric, candidate, champion, change) — change is candidate minus champion."""
    rows = []
    for label, attr in (("bits per byte", "bits_per_byte"), ("loss", "loss"), ("tokens", "tokens"), ("split", "split")):
        cand = getattr(eval_report, attr)
        champ = getattr(champion, attr) if champion else None
        if isinstance(cand, float):
            text = f"{cand:.4f}"
            champ_text = "—" if champ is None else f"{champ:.4f}"
            change = f"{cand - champ:+.4f}" if isinstance(champ, float) and math.isfinite(cand - champ) else "—"
        else:
            text, champ_text, change = str(cand), "—" if champ is None else str(champ), "—"
        rows.append((label, text, champ_text, change))
    return rows


def _champion_title(tags: dict[str, str]) -> str:
    version = tags.get(TAGS["decision_champion_version"], "")
    return f"champion (v{version})" if version else "champion (none: first model)"


def report_markdown(eval_report: EvalReport, champion: EvalReport | None, decision: Decision,
                    tags: dict[str, str], curve: LossCurve, plot_name: str | None) -> str:
    table = "\n".join(f"| {' | '.join(row)} |" for row in _metric_rows(eval_report, champion))
    lineage = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(tags.items()) if k != TAGS["dvc"])
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    plot = (f"![training loss]({plot_name})\n\nSource: {curve.source}; {len(curve.points)} steps"
            + (f"; guard rollbacks at steps {curve.rollbacks}" if curve.rollbacks else "")) if plot_name else (
        f"No loss curve: {curve.source}.")
    return (
        f"# Evaluation report — {tags[RUN_KEY_TAG]}\n\n"
        f"## Candidate vs {_champion_title(tags)}\n\n| metric | candidate | champion | change |\n|---|---|---|---|\n"
        f"{table}\n\n"
        f"## Gate decision: {decision.action}\n\n{reasons}\n\n"
        f"## Training loss\n\n{plot}\n\n"
        f"## Lineage\n\n| tag | value |\n|---|---|\n{lineage}\n\n"
        f"## DVC snapshot\n\n```yaml\n{tags[TAGS['dvc']]}\n```\n"
    )


def report_html(eval_report: EvalReport, champion: EvalReport | None, decision: Decision,
                tags: dict[str, str], curve: LossCurve, png: bytes | None, svg: str | None) -> str:
    """A self-contained page (the plot inlined), so the MLflow UI's artifact view shows it whole."""
    e = html.escape
    rows = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
                     for row in _metric_rows(eval_report, champion))
    reasons = "\n".join(f'<li class="{"fail" if " FAILED: " in r else "pass"}">{e(r)}</li>' for r in decision.reasons)
    lineage = "\n".join(f"<tr><td><code>{e(k)}</code></td><td><code>{e(v)}</code></td></tr>"
                        for k, v in sorted(tags.items()) if k != TAGS["dvc"])
    if png:
        plot = f'<img alt="training loss" src="data:image/png;base64,{base64.b64encode(png).decode()}"/>'
    elif svg:
        plot = svg
    else:
        plot = ""
    note = (f"Source: {e(curve.source)}; {len(curve.points)} steps"
            + (f"; guard rollbacks at steps {e(str(curve.rollbacks))}" if curve.rollbacks else "")
            if curve.points else f"No loss curve: {e(curve.source)}.")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Evaluation report — {e(tags[RUN_KEY_TAG])}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:60em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}.fail{{color:#b00}}.pass{{color:#070}}
code{{font-size:90%}}</style></head><body>
<h1>Evaluation report — {e(tags[RUN_KEY_TAG])}</h1>
<h2>Gate decision: {e(decision.action)}</h2>
<ul>{reasons}</ul>
<h2>Candidate vs {e(_champion_title(tags))}</h2>
<table><tr><th>metric</th><th>candidate</th><th>champion</th><th>change</th></tr>
{rows}</table>
<h2>Training loss</h2>
{plot}
<p>{note}</p>
<h2>Lineage</h2>
<table>{lineage}</table>
<h2>DVC snapshot</h2>
<pre>{e(tags[TAGS["dvc"]])}</pre>
</body></html>
"""


def _description(tags: dict[str, str], decision: Decision, run_id: str, experiment_id: str = "") -> str:
    """The version's description, from its tags and run alone (so a retry rebuilds exactly the same text).
    With the run's ``experiment_id`` it links the datasheet's page in MLflow's UI."""
    champion_bpb = tags.get(TAGS["decision_champion_bits_per_byte"], "")
    bpb = float(tags[TAGS["eval_bits_per_byte"]])
    if champion_bpb:
        champ = f"{float(champion_bpb):.4f} ({_champion_title(tags)}; change {bpb - float(champion_bpb):+.4f})"
    else:
        champ = _champion_title(tags).removeprefix("champion ")
    reasons = "\n".join(f"- {r}" for r in decision.reasons)
    return (
        f"kiln candidate from Airflow run `{tags[RUN_KEY_TAG]}` (policy `{tags[TAGS['policy']]}`), "
        f"MLflow run `{run_id}`.\n\n"
        f"Gate: **{decision.action}**\n\n{reasons}\n\n"
        f"| | value |\n|---|---|\n"
        f"| eval bits/byte | {bpb:.4f} |\n"
        f"| champion bits/byte | {champ} |\n"
        f"| eval loss / tokens | {float(tags[TAGS['eval_loss']]):.4f} / {tags[TAGS['eval_tokens']]} "
        f"(split `{tags[TAGS['eval_split']]}`) |\n"
        f"| training | step {tags[TAGS['train_steps']]}, completed {tags[TAGS['train_completed']]}"
        f"{'; ' + tags[TAGS['train_stop']].replace('|', '/') if tags.get(TAGS['train_stop']) else ''} |\n"
        f"| snapshot | `{tags[TAGS['snapshot_id']]}` ({tags[TAGS['corpus']]}) |\n"
        f"| contract | `{tags[TAGS['contract']]}` (quarantined shards: {tags[TAGS['quarantined_shards']]}) |\n"
        f"| recipe sha256 | `{tags[TAGS['recipe_sha256']]}` |\n"
        f"| weights sha256 | `{tags[TAGS['weights_sha256']]}` |\n"
        f"| git | `{tags[TAGS['git_sha']]}` |\n\n"
        f"{_sources_table(tags)}"
        f"Evaluation report (loss curve, metrics against the champion, full lineage): artifacts of run "
        f"`{run_id}`, `{REPORT_DIR}/report.html` (also `report.md`, `eval_report.json`, `decision.json`).\n\n"
        f"{_datasheet_line(run_id, experiment_id)}"
        f"{_reproduction_part(tags)}"
    )


REPRODUCTION_HEADING = "Reproduction (`kiln reproduce`, the latest verdict):"
"""Where the version page's reproduction section starts: the last part of the description, replaced whole
by each later verdict (``with_reproduction``)."""


def reproduction_section(tags: dict[str, str]) -> str:
    """The version's latest reproduction verdict in words, from its ``kiln.reproduction.*`` tags (what
    ``kiln.provenance.attestation.record_verdict`` sets); "" when it has none."""
    verdict = tags.get(TAGS["reproduction_verdict"], "")
    if not verdict:
        return ""
    size = tags.get(TAGS["reproduction_world_size"], "")
    compared = tags.get(TAGS["reproduction_weights_compared"], "")
    how = ""
    if size:
        how = f" at world size {size}"
        if compared == "tolerance":
            how += (f", the weights within a bound ({tags.get(TAGS['reproduction_tolerance'], '?')}; largest absolute "
                    f"difference {tags.get(TAGS['reproduction_max_abs_diff'], '?')})")
        elif compared == "bitwise":
            how += ", the weights compared bit for bit"
    attestation = tags.get(TAGS["reproduction_attestation"], "")
    signed = (f"Signed attestation `{attestation}` (sha256 `{tags.get(TAGS['reproduction_attestation_sha256'], '')}`)."
              if attestation else "No signed attestation (the version has no provenance statement to name).")
    detail = tags.get(TAGS["reproduction_detail"], "").replace("\n", " ")
    return (f"{REPRODUCTION_HEADING} **{verdict}**{how}, {tags.get(TAGS['reproduction_at'], '?')}: {detail}\n\n"
            f"{signed}\n")


def _reproduction_part(tags: dict[str, str]) -> str:
    section = reproduction_section(tags)
    return f"\n\n{section}" if section else ""


def with_reproduction(description: str, tags: dict[str, str]) -> str:
    """``description`` with its reproduction section (``REPRODUCTION_HEADING`` to the end) replaced by the one
    ``tags`` give (or removed, when they give none)."""
    head = description.split(f"\n\n{REPRODUCTION_HEADING}", 1)[0]
    return head + _reproduction_part(tags)


def _sources_table(tags: dict[str, str]) -> str:
    """A mixture's sources as the version page shows them (``kiln.registry.register.source_tags``);
    "" for a run of one corpus."""
    from kiln.registry.register import MIXTURE_SOURCES_TAG, SOURCE_EVAL_FACT, SOURCE_TAG_PREFIX

    names = [n for n in tags.get(MIXTURE_SOURCES_TAG, "").split(",") if n]
    if not names:
        return ""
    rows = []
    for name in names:
        fact = {k: tags.get(f"{SOURCE_TAG_PREFIX}{name}.{k}", "") for k in
                ("corpus", "snapshot_id", "contract", "weight", "share", "tokens", SOURCE_EVAL_FACT)}
        share = f"{float(fact['share']):.1%}" if fact["share"] else "-"
        scored = f"{float(fact[SOURCE_EVAL_FACT]):.4f}" if fact[SOURCE_EVAL_FACT] else "-"
        rows.append(f"| {name} | {fact['corpus']} | `{fact['snapshot_id']}` | `{fact['contract']}` | {fact['weight']} "
                    f"| {share} | {fact['tokens']} | {scored} |")
    return ("Data mixture (each source under its own contract; share: of the samples trained; held-out bits/byte: "
            "the source's own, of which the version's is the weighted mean):\n\n"
            "| source | corpus | snapshot | contract | weight | share | tokens seen | held-out bits/byte |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n")


def _datasheet_line(run_id: str, experiment_id: str) -> str:
    from kiln.provenance.datasheet import DATASHEET_DIR, DATASHEET_HTML, DATASHEET_MARKDOWN

    html_path = f"{DATASHEET_DIR}/{DATASHEET_HTML}"
    shown = (f"[`{html_path}`](#/experiments/{experiment_id}/runs/{run_id}/artifacts/{html_path})" if experiment_id
             else f"`{html_path}`")
    return (f"Datasheet (where the training data came from, how it was cleaned, how the model was trained and "
            f"evaluated; generated from the signed provenance statement): artifacts of run `{run_id}`, {shown} "
            f"(also `{DATASHEET_MARKDOWN}`).")


