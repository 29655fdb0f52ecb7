"""``make demo``: one production run end to end on the embedded stack, as a user would drive it.

1. build the sample corpus (stdlib source, a few poisoned shards) into the DVC workspace;
2. start Airflow + MLflow (idempotent);
3. trigger the production DAG through the Airflow REST API;
4. answer its approval through the HITL REST endpoint the UI uses, as the *demo reviewer*
   (``demo-reviewer``, an explicitly named demo identity);
5. wait with a progress line per stage and print the summary, checked against MLflow.

``make demo CORPUS=NAME`` (``kiln demo --corpus NAME``) runs the same pipeline on another corpus:
the sandbox DAG, as a person would from its form — production trains only on the corpus of its
reviewed ``config/production.toml``. ``NAME`` is a corpus under the corpus root (``kiln corpus
list``), or ``prose``, which the demo first builds (``kiln corpus build-text``) and imports (``kiln
corpus import``): natural-language text found on the machine. Its shards are validated with the
contract its ``corpus.json`` names: ``web-text`` where this kiln ships it, else ``stdlib-py``, said so.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from kiln import settings as kiln_settings
from kiln.errors import DemoError, KilnError
from kiln.policy import PRODUCTION, SANDBOX
from kiln.stack.airflow_client import AirflowClient

DEMO_REVIEWER = "demo-reviewer"
DEMO_POISON = ("secret", "truncated")
"""Two of eight shards poisoned: within production's 25% quarantine threshold, so the run proceeds."""
PROSE_CORPUS = "prose"
"""The corpus ``kiln demo --corpus prose`` builds from natural-language text on the machine."""
PROSE_SHARD_BYTES = 128 * 1024
"""≈ 700 kB of prose in about five training shards: a demo corpus, not a production shard size."""

TERMINAL = {"success", "failed", "skipped", "upstream_failed", "removed"}


def say(msg: str) -> None:
    print(msg, flush=True)


def follow_run(
    client: AirflowClient, dag_id: str, run_id: str, *, timeout: float = 1200.0,
    on_awaiting_input: Callable[[dict[str, Any]], None] | None = None, progress: Callable[[str], None] = say,
    settle_s: float = 5.0,
) -> dict[str, Any]:
    """Poll a DAG run until it ends; one progress line per task state change; returns the final run.

    ``on_awaiting_input`` is called once per task try that waits for a human, but only after it has
    waited ``settle_s`` seconds: Airflow 3.3 marks a HITL task up_for_retry when the answer lands
    before the scheduler has processed the task's own "paused" event (an answer within ~1 s, which
    only a script can give), and then asks again.
    """
    seen: dict[tuple[str, int], str] = {}
    waiting_since: dict[tuple[str, int, int], float] = {}
    answered: set[tuple[str, int, int]] = set()
    started = time.monotonic()
    while True:
        for ti in sorted(client.task_instances(dag_id, run_id), key=lambda t: (t.get("start_date") or "~", t["task_id"])):
            ident = (ti["task_id"], ti.get("map_index", -1))
            state = ti.get("state") or "none"
            mapped_unrendered = ident[1] >= 0 and not ti.get("rendered_map_index")
            if seen.get(ident) != state and not mapped_unrendered:
                seen[ident] = state
                if state not in ("none", "scheduled", "queued"):
                    label = ti["task_id"] + (f"[{ti['rendered_map_index']}]" if ident[1] >= 0 else "")
                    took = f" ({ti['duration']:.1f}s)" if ti.get("duration") and state in TERMINAL else ""
                    progress(f"  {time.monotonic() - started:6.0f}s  {label:<44} {state}{took}")
            attempt = (*ident, int(ti.get("try_number") or 0))
            if state in ("awaiting_input", "deferred") and on_awaiting_input and attempt not in answered:
                since = waiting_since.setdefault(attempt, time.monotonic())
                if time.monotonic() - since >= settle_s:
                    answered.add(attempt)
                    on_awaiting_input(ti)
        run = client.get_run(dag_id, run_id)
        if run["state"] in ("success", "failed"):
            return run
        if time.monotonic() - started > timeout:
            raise DemoError(f"run {dag_id}/{run_id} still {run['state']} after {timeout:.0f}s")
        time.sleep(2)


def build_demo_corpus() -> dict[str, Any]:
    from kiln.data.corpus import build_corpus

    s = kiln_settings.load()
    return build_corpus(s.corpus_root / PRODUCTION.corpus, shards=8, seed=0, poison=DEMO_POISON)


def build_prose_corpus() -> dict[str, Any]:
    """The prose sample (``kiln.data.prose``) imported as corpus ``prose``: the same machine gives the
    same bytes, so a second demo re-imports it unchanged (and DVC snapshots nothing new)."""
    from kiln.data.corpora import corpus_root, default_contract
    from kiln.data.corpus_import import ImportConfig, import_corpus
    from kiln.data.prose import build_prose
    from kiln.errors import ConfigError

    s = kiln_settings.load()
    source = s.home / "sources" / "prose.jsonl"
    built = build_prose(source)
    try:
        contract = default_contract("natural-language")
        note = ""
    except ConfigError:
        contract = PRODUCTION.contract
        note = f"the contract made for natural language is not shipped with this kiln: made for {contract} instead"
    out = corpus_root() / PROSE_CORPUS
    summary = import_corpus(source, out, ImportConfig(name=PROSE_CORPUS, format="jsonl", id_field="id",
                                                      shard_bytes=PROSE_SHARD_BYTES, eval_fraction=0.1,
                                                      kind="natural-language", contract=contract),
                            replace=out.exists())
    return {**summary, "by_source": built["by_source"], "note": note}


def demo_corpus(name: str) -> dict[str, Any]:
    """The corpus a ``--corpus`` demo runs on: ``prose`` built and imported, else one already under the
    corpus root (``DemoError`` naming how to make it when it is not)."""
    from kiln.data.corpora import corpus_root, read_metadata

    if name == PROSE_CORPUS:
        return build_prose_corpus()
    path = corpus_root() / name
    if not (path / "train").is_dir():
        raise DemoError(f"corpus {name!r} not found at {path}: import it first (`kiln corpus import SRC --name {name} "
                        f"--format jsonl|parquet|text`), or run `make demo CORPUS={PROSE_CORPUS}`")
    meta = read_metadata(path)
    return {"name": name, "out": str(path), "kind": meta.kind if meta else "?", "contract": meta.contract if meta else "?",
            "note": "" if meta else "no corpus.json: validated with the policy's contract"}


def demo_mixture(name: str) -> dict[str, Any]:
    """The corpora a ``--mixture`` demo trains: each source's corpus, the sample (``stdlib-py``) and
    ``prose`` built when missing, any other already under the corpus root (``DemoError`` naming the
    source otherwise). A mixture that cannot be read is refused naming the file and field."""
    from kiln.data.corpora import corpus_root
    from kiln.data.mixtures import load_mixture

    mixture = load_mixture(name)
    prepared = {}
    for source in mixture.sources:
        path = corpus_root() / source.corpus
        if source.corpus == PROSE_CORPUS:
            built = build_prose_corpus()
            prepared[source.name] = f"{source.corpus}: {built['train']['documents']} documents found on this machine"
        elif (path / "train").is_dir():
            prepared[source.name] = f"{source.corpus}: already under the corpus root"
        elif source.corpus == PRODUCTION.corpus:
            built = build_demo_corpus()
            prepared[source.name] = f"{source.corpus}: the stdlib sample, {len(built.get('poisoned') or {})} shards poisoned"
        else:
            raise DemoError(f"mixture {name!r} source {source.name!r}: corpus {source.corpus!r} not found at {path}; "
                            f"import it first (`kiln corpus import SRC --name {source.corpus} --format ...`)")
    return {"mixture": mixture, "prepared": prepared}


def run_demo(corpus: str | None = None, mixture: str | None = None) -> int:
    from kiln.stack import embedded

    t0 = time.monotonic()
    s = kiln_settings.load()
    if corpus is not None and mixture is not None:
        raise DemoError("a demo runs one corpus (--corpus) or one mixture (--mixture), not both")
    if mixture is not None:
        return _run_mixture_demo(mixture, t0, s)
    if corpus is not None:
        return _run_sandbox_demo(corpus, t0, s)
    say("[1/5] building the sample corpus (Python stdlib sources, 2 poisoned shards)")
    built = build_demo_corpus()
    for shard, kind in sorted((built.get("poisoned") or {}).items()):
        say(f"      poisoned on purpose: {shard} <- {kind}")
    say("[2/5] starting the embedded stack (Airflow + MLflow under .kiln/)")
    embedded.up(quiet=True)
    t_stack = time.monotonic()
    pw = embedded.passwords(s)
    operator = AirflowClient(s.airflow_url, "admin", pw["admin"])
    reviewer = AirflowClient(s.airflow_url, DEMO_REVIEWER, pw[DEMO_REVIEWER])
    dag_id = PRODUCTION.dag_id
    operator.wait_for_dag(dag_id)
    operator.unpause(dag_id)
    run = operator.trigger(dag_id, conf={"reason": "make demo"})
    run_id = run["dag_run_id"]
    say(f"[3/5] triggered {dag_id} run {run_id} through the Airflow REST API; following it:")

    def approve(ti: dict[str, Any]) -> None:
        if ti["task_id"] != "approval":
            return
        reviewer.answer_hitl(dag_id, run_id, "approval", ["Approve"])
        say(f"[4/5] approval answered 'Approve' through the HITL REST endpoint as the DEMO REVIEWER "
            f"'{DEMO_REVIEWER}' (a named demo identity standing in for a human reviewer)")

    final = follow_run(operator, dag_id, run_id, on_awaiting_input=approve)
    summary = _summarise_run(operator, dag_id, run_id, final, t0=t0, t_stack=t_stack, s=s)
    from kiln.runs import run_key
    from kiln.stages import write_summary

    write_summary(run_key(dag_id, run_id), summary)
    return 0


def _run_sandbox_demo(name: str, t0: float, s: kiln_settings.Settings) -> int:
    """The ``--corpus`` demo: the sandbox DAG on corpus ``name``, triggered as its form would."""
    say(f"[1/5] preparing corpus {name!r}")
    corpus = demo_corpus(name)
    say(f"      {corpus['out']}: {corpus.get('kind')} text, contract {corpus.get('contract')}"
        + (f", {corpus['train']['documents']} training and {corpus['eval']['documents']} held-out documents from "
           f"{', '.join(f'{k} ({v})' for k, v in sorted(corpus['by_source'].items()))}" if "by_source" in corpus else ""))
    if corpus.get("note"):
        say(f"      note: {corpus['note']}")
    return _sandbox_run(sandbox_conf(name), f"corpus {name!r} (contract: the one its corpus.json names)", t0, s)


def _run_mixture_demo(name: str, t0: float, s: kiln_settings.Settings) -> int:
    """The ``--mixture`` demo: the sandbox DAG on a data mixture (``training/mixtures/NAME.toml``), as its
    form would trigger it."""
    say(f"[1/5] preparing the corpora of mixture {name!r}")
    prepared = demo_mixture(name)
    for source in prepared["mixture"].sources:
        say(f"      {source.name} (weight {source.weight:g}, contract {source.contract or 'its corpus.json'}): "
            f"{prepared['prepared'][source.name]}")
    return _sandbox_run(mixture_conf(name), f"mixture {name!r} (each source under its own contract)", t0, s)


def _sandbox_run(conf: dict[str, Any], what: str, t0: float, s: kiln_settings.Settings) -> int:
    """Steps 2-5 of a sandbox demo: the stack started, the run triggered with ``conf`` as the form
    would, followed, and summarised."""
    from kiln.stack import embedded

    say("[2/5] starting the embedded stack (Airflow + MLflow under .kiln/)")
    embedded.up(quiet=True)
    t_stack = time.monotonic()
    operator = AirflowClient(s.airflow_url, "admin", embedded.passwords(s)["admin"])
    dag_id = SANDBOX.dag_id
    operator.wait_for_dag(dag_id)
    operator.unpause(dag_id)
    run_id = operator.trigger(dag_id, conf=conf)["dag_run_id"]
    say(f"[3/5] triggered {dag_id} run {run_id} on {what}; following it:")
    say("[4/5] the sandbox asks no review: a candidate the gate passes moves the sandbox alias")
    final = follow_run(operator, dag_id, run_id)
    _summarise_run(operator, dag_id, run_id, final, t0=t0, t_stack=t_stack, s=s)
    return 0


def mixture_conf(mixture: str) -> dict[str, Any]:
    """The sandbox run a ``--mixture`` demo triggers: the form's defaults, that mixture, no run-wide contract."""
    from kiln.data.corpora import RUN_CORPUS_CONTRACT

    return {"mixture": mixture, "contract": RUN_CORPUS_CONTRACT}


def _summarise_run(operator: AirflowClient, dag_id: str, run_id: str, final: dict[str, Any], *, t0: float,
                   t_stack: float, s: kiln_settings.Settings) -> dict[str, Any]:
    """A followed demo run's end: the failed tasks' logs and ``DemoError``, or its printed summary
    with the setup and run times."""
    t_run = time.monotonic()
    if final["state"] != "success":
        for ti in [ti for ti in operator.task_instances(dag_id, run_id) if ti.get("state") == "failed"]:
            say(f"--- log of failed task {ti['task_id']} ---")
            say(operator.task_log(dag_id, run_id, ti["task_id"], ti.get("try_number") or 1, ti.get("map_index", -1))[-3000:])
        raise DemoError(f"run {run_id} ended {final['state']}")
    summary = collect_summary(operator, dag_id, run_id)
    summary["timings_s"] = {
        "setup": round(t_stack - t0, 1), "run": round(t_run - t_stack, 1), "total": round(time.monotonic() - t0, 1)
    }
    print_summary(summary, s)
    return summary


def sandbox_conf(corpus: str) -> dict[str, Any]:
    """The sandbox run a ``--corpus`` demo triggers: the form's defaults, that corpus, its own contract."""
    from kiln.data.corpora import RUN_CORPUS_CONTRACT

    return {"corpus": corpus, "contract": RUN_CORPUS_CONTRACT}


def collect_summary(client: AirflowClient, dag_id: str, run_id: str) -> dict[str, Any]:
    """What the run produced, read back through Airflow's API (each task's XCom as the ref it carries)
    and checked against MLflow's registry."""
    import mlflow

    from kiln.refs import (
        DataGateResult,
        PinnedMixture,
        PromotionRecord,
        RegisteredCandidate,
        RunOutcome,
        TrainResult,
        pinned_input,
    )

    s = kiln_settings.load()
    snap = pinned_input(client.xcom(dag_id, run_id, "snapshot"))
    files = sum(src.snapshot.files for src in snap.sources) if isinstance(snap, PinnedMixture) else snap.files
    data = DataGateResult.from_json(client.xcom(dag_id, run_id, "data_gate"))
    tokenized = DataGateResult.from_json(client.xcom(dag_id, run_id, "tokens"))
    train = TrainResult.from_json(client.xcom(dag_id, run_id, "train"))
    candidate = RegisteredCandidate.from_json(client.xcom(dag_id, run_id, "register_candidate"))
    promotion = PromotionRecord.from_json(client.xcom(dag_id, run_id, "promote"))
    outcome = RunOutcome.from_json(client.xcom(dag_id, run_id, "outcome"))
    registry = mlflow.MlflowClient(tracking_uri=s.mlflow_uri, registry_uri=s.mlflow_uri)
    champion = registry.get_model_version_by_alias(promotion.registered_model, promotion.alias)
    return {
        "dag_id": dag_id,
        "run_id": run_id,
        "corpus": snap.corpus,
        "contract": data.contract,
        "snapshot_id": snap.id,
        "snapshot_files": files,
        "sources": [{"name": g.name, "weight": g.weight, "contract": g.contract, "healthy": g.healthy,
                     "quarantined": len(g.quarantined)} for g in data.sources or []],
        "quarantined": [q.to_json() for q in data.quarantined],
        "healthy_shards": data.healthy,
        "tokens": tokenized.tokens.to_json() if tokenized.tokens is not None else None,
        "final_loss": train.metrics.get("final_loss"),
        "tokens_per_s": train.metrics.get("tokens_per_s"),
        "weights_sha256": train.weights_sha256,
        "candidate": candidate.to_json(),
        "promotion": promotion.to_json(),
        "outcome": outcome.message,
        "champion_version": champion.version,
        "champion_snapshot_tag": champion.tags.get("kiln.snapshot_id"),
        "champion_tokenizer_tag": champion.tags.get("kiln.tokenizer_sha256"),
        "task_durations_s": {
            (ti["task_id"] + (f"[{ti['map_index']}]" if ti.get("map_index", -1) >= 0 else "")): ti.get("duration")
            for ti in client.task_instances(dag_id, run_id)
        },
    }


def print_summary(summary: dict[str, Any], s: kiln_settings.Settings) -> None:
    promo = summary["promotion"]
    say("[5/5] done. Summary")
    say(f"  snapshot id        : {summary['snapshot_id']}  ({summary['snapshot_files']} files, DVC)")
    say(f"  corpus / contract  : {summary['corpus']} / {summary['contract']}")
    say(f"  healthy shards     : {summary['healthy_shards']}")
    for src in summary.get("sources") or []:
        say(f"    source {src['name']:<12}: weight {src['weight']:g}, {src['contract']}, {src['healthy']} healthy, "
            f"{src['quarantined']} quarantined")
    say(f"  quarantined shards : {len(summary['quarantined'])}")
    for q in summary["quarantined"]:
        say(f"    - {q['path']}: {'; '.join(q['reasons'])[:160]}")
    tokens = summary["tokens"]
    if tokens:
        say(f"  tokenizer          : {tokens['tokenizer_kind']}, {tokens['vocab_size']} ids, sha256 "
            f"{tokens['tokenizer_sha256'][:16]}…  ({tokens['samples']} packed samples of {tokens['block_size'] + 1} tokens)")
    say(f"  final loss         : {summary['final_loss']:.4f}   tokens/s: {summary['tokens_per_s']:.0f}")
    say(f"  model version      : {promo['registered_model']} version {promo['version']}  alias '{promo['alias']}'"
        f"  (approved by {promo['approver']})")
    say(f"  MLflow tag kiln.snapshot_id on the champion: {summary['champion_snapshot_tag']}")
    say(f"  MLflow tag kiln.tokenizer_sha256 on the champion: {summary['champion_tokenizer_tag']}")
    say(f"  outcome            : {summary['outcome']}")
    timings = summary["timings_s"]
    say(f"  wall time          : {timings['total']:.0f}s (setup {timings['setup']:.0f}s, run {timings['run']:.0f}s)")
    say(f"  Airflow UI         : {s.airflow_url}/dags/{summary['dag_id']}/runs/{summary['run_id']}")
    say(f"  MLflow UI          : {s.mlflow_uri}/#/models/{promo['registered_model']}/versions/{promo['version']}")
    say("  logins             : `make up` prints them; the stack keeps running — `make down` stops it")


def main(corpus: str | None = None, mixture: str | None = None) -> int:
    try:
        return run_demo(corpus, mixture)
    except KilnError as exc:
        print(f"kiln demo: error: {exc}", file=sys.stderr)
        return 1
