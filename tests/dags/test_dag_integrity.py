"""DAG integrity: the DagBag loads cleanly, DAG files stay light, every task carries its policy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.airflow.dagfactory import end_orphaned_job
from kiln.policy import POLICIES

REPO = Path(__file__).resolve().parents[2]
DAGS = REPO / "dags"
HEAVY = ("torch", "great_expectations", "mlflow", "dvc", "pandas")


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS), known_pools={p.pool for p in POLICIES.values()} | {"default_pool"})


def test_dagbag_has_no_import_errors(dagbag):
    from kiln.provenance.reproduce import REPRODUCE_DAG_ID

    assert dagbag.import_errors == {}
    watches = {p.champion_watch_dag_id for p in POLICIES.values() if p.champion_watch_dag_id}
    assert set(dagbag.dag_ids) == {p.dag_id for p in POLICIES.values()} | watches | {REPRODUCE_DAG_ID}


def test_dag_files_import_no_heavy_library():
    """Parse-time cost: importing every DAG file pulls in none of the heavy libraries."""
    code = (
        "import importlib.util, sys, pathlib\n"
        f"for f in sorted(pathlib.Path({str(DAGS)!r}).glob('*.py')):\n"
        "    spec = importlib.util.spec_from_file_location(f.stem, f); m = importlib.util.module_from_spec(spec)\n"
        "    spec.loader.exec_module(m)\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"DAG files imported heavy libraries at parse time: {out.stdout.strip()}"


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=lambda p: p.name)
def test_every_task_has_owner_retries_and_its_policy_pool(dagbag, policy):
    dag = dagbag.dags[policy.dag_id]
    assert set(policy.tags) <= set(dag.tags)
    assert dag.doc_md and policy.name in dag.doc_md
    for t in dag.tasks:
        assert t.owner == policy.owner, t.task_id
        assert t.pool == policy.pool, t.task_id
        assert t.priority_weight == policy.priority_weight, t.task_id
        if t.task_id != "approval":  # a human answer is not retried
            assert t.retries == policy.retries, t.task_id
    # A failed run never leaves its training job behind (a task killed before its trigger ran).
    assert dag.on_failure_callback is end_orphaned_job


def test_no_task_splits_its_result_into_one_xcom_per_key(dagbag):
    """A ``-> dict`` annotation would make ``@task`` push every key as an XCom of its own, next to
    ``return_value``: rows nobody reads, and copies of values (checkpoint paths, run ids) to keep."""
    for dag_id in (*(p.dag_id for p in POLICIES.values()), "kiln_champion_watch", "kiln_reproduce"):
        for t in dagbag.dags[dag_id].tasks:
            assert getattr(t, "multiple_outputs", False) is False, f"{dag_id}.{t.task_id}"


def test_production_is_pinned_gated_and_one_at_a_time(dagbag):
    prod = dagbag.dags["kiln_production"]
    assert prod.max_active_runs == 1
    assert type(prod.timetable).__name__ == "AssetOrTimeSchedule", "scheduled AND corpus-asset triggered"
    assert prod.timetable.timetable.expression == "0 3 * * 1"
    assert "approval" in prod.task_ids
    assert prod.get_task("promote").upstream_task_ids >= {"approval"}
    assert set(prod.params.keys()) == {"reason"}, "production must not accept recipe/corpus/step overrides"
    run_types = {str(t.value if hasattr(t, "value") else t) for t in prod.allowed_run_types}
    assert run_types == {"manual", "scheduled", "asset_triggered"}


def test_no_task_takes_an_approval_from_an_xcom_or_a_task_state(dagbag):
    """Any Airflow user with the role "user" may mark a task success or write an XCom in any DAG:
    promote and rollback depend on their review task for ordering only, and read the approval from
    the registry, where only the review task itself records it (issue 16)."""
    from kiln.airflow.dagfactory import ReviewOperator
    from kiln.policy import PRODUCTION

    for dag_id, review_id, acting_id in (("kiln_production", "approval", "promote"),
                                         (PRODUCTION.champion_watch_dag_id, "rollback_approval", "rollback")):
        dag = dagbag.dags[dag_id]
        review, acting = dag.get_task(review_id), dag.get_task(acting_id)
        assert isinstance(review, ReviewOperator) and review.policy.name == PRODUCTION.name
        assert review_id in acting.upstream_task_ids
        inputs = repr((acting.op_args, acting.op_kwargs))
        assert review_id not in inputs, f"{dag_id}.{acting_id} takes {review_id}'s output as an input: {inputs}"
    assert dagbag.dags["kiln_production"].get_task("approval").review_of == "promotion"
    assert dagbag.dags[PRODUCTION.champion_watch_dag_id].get_task("rollback_approval").review_of == "rollback"


def test_a_task_reads_its_upstream_xcoms_as_refs_and_a_malformed_one_fails_it_without_retry(dagbag):
    """The DAG factory is where an XCom becomes a typed ref (``kiln.refs``) and a stage's ref an XCom."""
    from airflow.sdk.exceptions import AirflowFailException

    from kiln.refs import Decision, RegisteredCandidate

    gate = dagbag.dags["kiln_sandbox"].get_task("model_gate").python_callable
    decision = Decision(action="promote", reasons=["threshold: ok"], candidate_bits_per_byte=3.1)
    candidate = RegisteredCandidate(model_name="sandbox.kiln-stdlib-lm", version="3", decision=decision)
    assert gate(candidate.to_json()) == decision.to_json()
    held = RegisteredCandidate(model_name="sandbox.kiln-stdlib-lm", version="3",
                               decision=Decision(action="hold", reasons=["FAILED"], candidate_bits_per_byte=9.1))
    assert gate(held.to_json()) is False
    with pytest.raises(AirflowFailException, match="ManifestError: RegisteredCandidate: .*'decision'"):
        gate({"model_name": "sandbox.kiln-stdlib-lm", "version": "3"})
    evaluate = dagbag.dags["kiln_sandbox"].get_task("evaluate").python_callable
    with pytest.raises(AirflowFailException, match="ManifestError: TrainResult: expected a JSON object, got str"):
        evaluate("/elsewhere/step-00000020", {})


def test_sandbox_is_manual_with_a_bounded_form(dagbag):
    sandbox = dagbag.dags["kiln_sandbox"]
    assert type(sandbox.timetable).__name__ == "NullTimetable", "sandbox runs start only by hand"
    assert {str(getattr(t, "value", t)) for t in sandbox.allowed_run_types} == {"manual"}
    assert "approval" not in sandbox.task_ids
    params = sandbox.params
    assert params.get_param("nodes").schema["maximum"] == 2
    assert "tiny.toml" in params.get_param("recipe").schema["enum"]


@pytest.mark.parametrize(
    "name,value",
    [("nodes", 9), ("nodes", 0), ("recipe", "../../etc/passwd.toml"), ("max_steps", 10**6), ("corpus", "Bad Name!")],
)
def test_sandbox_form_rejects_bad_input(dagbag, name, value):
    from airflow.sdk.exceptions import ParamValidationError

    param = dagbag.dags["kiln_sandbox"].params.get_param(name)
    with pytest.raises(ParamValidationError, match=re.escape(repr(value) if isinstance(value, str) else str(value))):
        param.resolve(value)


def test_sandbox_form_accepts_its_defaults(dagbag):
    resolved = dagbag.dags["kiln_sandbox"].params.validate()
    assert resolved["recipe"] == "tiny.toml" and resolved["nodes"] == 1


def test_champion_watch_is_scheduled_reviewed_and_runs_in_the_production_pool(dagbag):
    from kiln.policy import PRODUCTION

    watch = dagbag.dags[PRODUCTION.champion_watch_dag_id]
    assert watch.timetable.expression == PRODUCTION.champion_watch_cron and watch.max_active_runs == 1
    assert {str(getattr(t, "value", t)) for t in watch.allowed_run_types} == {"manual", "scheduled"}
    for t in watch.tasks:
        assert (t.owner, t.pool, t.priority_weight) == (PRODUCTION.owner, PRODUCTION.pool, PRODUCTION.priority_weight), t.task_id
    review = watch.get_task("rollback_approval")
    assert [u["id"] for u in review.assigned_users] == list(PRODUCTION.reviewers)
    assert review.defaults == ["Reject"], "a review nobody answers must not roll back"
    assert watch.get_task("rollback").upstream_task_ids >= {"rollback_approval"}
    assert watch.get_task("watch_outcome").trigger_rule == "none_failed"


def test_a_deployment_with_nothing_on_the_clock_has_no_cron_timetable_but_keeps_both_dags():
    """``schedule = ""`` and ``champion_watch_schedule = ""`` (kiln's end-to-end deployment): production
    runs by hand and on corpus announcements only, and the champion watch exists, by hand only."""
    from kiln.airflow.dagfactory import build_champion_watch_dag, build_dag
    from kiln.policy import build_production_policy, load_production_config

    policy = build_production_policy(load_production_config(Path(__file__).parents[1] / "e2e" / "production.toml"))
    prod, watch = build_dag(policy), build_champion_watch_dag(policy)
    assert type(prod.timetable).__name__ == "AssetTriggeredTimetable", "corpus announcements only"
    assert {str(getattr(t, "value", t)) for t in prod.allowed_run_types} == {"manual", "asset_triggered"}
    assert type(watch.timetable).__name__ == "NullTimetable" and watch.dag_id == "kiln_champion_watch"
    assert {str(getattr(t, "value", t)) for t in watch.allowed_run_types} == {"manual"}


def test_a_production_mixture_runs_on_any_source_s_announcement(tmp_path):
    """A ``[mixture]`` production config: the DAG is scheduled on its cron or on an announcement of ANY
    source's corpus (``AssetAny``; a list would wait for all of them), also as the scheduler reads it
    back serialized."""
    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable

    from kiln.airflow.dagfactory import build_dag, corpus_asset
    from kiln.policy import build_production_policy, load_production_config

    config = tmp_path / "production.toml"
    config.write_text('model = "acme-lm"\n[mixture]\n' + "".join(
        f'[[mixture.sources]]\nname = "{n}"\ncorpus = "{c}"\ncontract = "{k}"\nweight = 0.5\n'
        for n, c, k in (("code", "stdlib-py", "stdlib-py@1"), ("prose", "prose", "prose-wrapped@1"))))
    prod = build_dag(build_production_policy(load_production_config(config)))
    for timetable in (prod.timetable, decode_timetable(encode_timetable(prod.timetable))):
        assert type(timetable).__name__ == "AssetOrTimeSchedule"
        condition = timetable.asset_condition
        assert type(condition).__name__.removeprefix("Serialized") == "AssetAny"
        assert [a.uri for a in condition.objects] == [corpus_asset("stdlib-py").uri, corpus_asset("prose").uri]
    assert "mixture" not in prod.params  # production's inputs are its reviewed config's


def test_linked_tasks_carry_their_extra_links(dagbag):
    from kiln.links import LINK_NAMES, TASK_LINKS

    for policy in POLICIES.values():
        dag = dagbag.dags[policy.dag_id]
        for task_id, kinds in TASK_LINKS.items():
            names = [link.name for link in dag.get_task(task_id).operator_extra_links]
            assert names == [LINK_NAMES[k] for k in kinds], (policy.name, task_id)
        assert not dag.get_task("snapshot").operator_extra_links


@pytest.mark.parametrize("dag_id", ["kiln_production", "kiln_champion_watch"])
@pytest.mark.parametrize("minutes_late", [1, 17, 60 * 16])
def test_a_dag_deployed_just_after_its_cron_time_waits_for_the_next_one(dagbag, monkeypatch, dag_id, minutes_late):
    """A stack that comes up (or a DAG unpaused) shortly after the cron time must not start that
    run: Airflow's CronTriggerTimetable treats ``run_immediately=False`` like None (a run that is
    less than a tenth of the period late still starts: 16.8 h for a weekly schedule), so the DAGs
    pass ``timedelta(0)``. Checked on the timetable the scheduler deserializes."""
    from datetime import UTC, datetime, timedelta

    import airflow.timetables.trigger as trigger
    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable
    from airflow.timetables.base import TimeRestriction

    timetable = decode_timetable(encode_timetable(dagbag.dags[dag_id].timetable))
    cron = next(t for t in (getattr(timetable, "timetable", None), timetable) if isinstance(t, trigger.CronTriggerTimetable))
    fire = cron._align_to_prev(trigger.coerce_datetime(datetime(2026, 11, 30, 12, tzinfo=UTC)))
    now = trigger.coerce_datetime(fire + timedelta(minutes=minutes_late))
    monkeypatch.setattr(trigger, "utcnow", lambda: now)
    info = timetable.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=TimeRestriction(earliest=None, latest=None, catchup=False))
    assert info is not None and info.run_after > now, (fire, now, info)


def test_parsing_the_dag_files_reads_no_variable_or_connection():
    """No metadata call on a parse (issue 21): the secrets backends the Task SDK would ask are
    replaced by one that records what it is asked; bad deployment settings (in the environment
    form, which it answers) break nothing at parse time either: the task that reads them fails."""
    code = (
        "import json, os\n"
        "from airflow.sdk.execution_time import supervisor\n"
        "asked = []\n"
        "class Recording:  # and answers variables from the environment form, as Airflow's first backend does\n"
        "    def get_variable(self, key): asked.append(('variable', key)); return os.environ.get('AIRFLOW_VAR_' + key.upper())\n"
        "    def get_connection(self, conn_id): asked.append(('connection', conn_id))\n"
        "    def get_config(self, key): asked.append(('config', key))\n"
        "supervisor.ensure_secrets_backend_loaded = lambda: [Recording()]\n"
        "from airflow.dag_processing.dagbag import DagBag\n"
        f"bag = DagBag(dag_folder={str(DAGS)!r},"
        f" known_pools={sorted({p.pool for p in POLICIES.values()} | {'default_pool'})!r})\n"
        "print(json.dumps({'asked': asked, 'errors': {k: v[-300:] for k, v in bag.import_errors.items()},\n"
        "                  'dags': sorted(bag.dag_ids)}))\n"
    )
    env = {**os.environ, "AIRFLOW_VAR_KILN_SANDBOX_LAUNCHER": '{"launcher": "k8s"}',
           "AIRFLOW_VAR_KILN_PRODUCTION_LAUNCHER": "slurm", "AIRFLOW_VAR_KILN_PRODUCTION_APPROVAL_TIMEOUT_S": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["asked"] == [], f"parsing the DAG files asked for {parsed['asked']}"
    assert parsed["errors"] == {}
    assert parsed["dags"] == ["kiln_champion_watch", "kiln_production", "kiln_reproduce", "kiln_sandbox"]


def test_the_dag_doc_says_which_variables_are_read_at_run_time_and_where_to_see_them(dagbag):
    from kiln.policy import PRODUCTION, SANDBOX

    for dag_id, variables in ((SANDBOX.dag_id, ["kiln_sandbox_launcher"]),
                              (PRODUCTION.dag_id, ["kiln_production_launcher", "kiln_production_approval_timeout_s"]),
                              (PRODUCTION.champion_watch_dag_id, ["kiln_production_approval_timeout_s"])):
        doc = dagbag.dags[dag_id].doc_md
        assert "read at run time" in doc, dag_id
        rows = [line for line in doc.splitlines() if line.startswith("| `kiln_")]
        assert [row.split("`")[1] for row in rows] == variables, (dag_id, rows)
        for row in rows:
            assert f"AIRFLOW_VAR_{row.split('`')[1].upper()}" in row and "log line" in row, row
    assert "`train`" in dagbag.dags[SANDBOX.dag_id].doc_md and "`approval`" in dagbag.dags[PRODUCTION.dag_id].doc_md


def test_dag_code_passes_ruffs_airflow_rules():
    """ruff's AIR rules (with preview's AIR003: ``Variable.get`` outside a task) over everything the
    dag-processor imports; the configuration is pyproject.toml's ``[tool.ruff]``, whose
    ``explicit-preview-rules`` enables a preview rule only where it is named: hence ``AIR003``."""
    ruff = [sys.executable, "-m", "ruff", "check", "--select", "AIR,AIR003"]
    out = subprocess.run([*ruff, "--output-format", "concise", "src/kiln", "dags", "plugins"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # ...and AIR003 is really checked: a DAG file that reads a Variable at parse time fails.
    probe = "from airflow.sdk import DAG, Variable\n\nfoo = Variable.get('foo')\nprint(foo, DAG)\n"
    out = subprocess.run([*ruff, "--output-format", "json", "--stdin-filename", "dags/probe.py", "-"], input=probe,
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 1 and [d["code"] for d in json.loads(out.stdout)] == ["AIR003"], out.stdout + out.stderr


def test_the_sandbox_form_offers_the_imported_corpora_and_the_contracts_that_fit_them(tmp_path, monkeypatch):
    """What the form lists is read when the file is parsed: the corpus root's folders and their
    corpus.json (a broken one is listed, never an import error), and the shipped contracts."""
    from airflow.sdk.exceptions import ParamValidationError

    from kiln.airflow.dagfactory import build_dag
    from kiln.data.corpus_import import ImportConfig, import_corpus
    from kiln.policy import SANDBOX
    from kiln.settings import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} of my own corpus, long enough"}) + "\n" for i in range(40)))
    import_corpus(src, load().corpus_root / "my-docs", ImportConfig(name="my-docs", format="jsonl", kind="python-source",
                                                                   eval_fraction=0.2))
    (load().corpus_root / "broken").mkdir()
    (load().corpus_root / "broken" / "corpus.json").write_text("not json")
    params = build_dag(SANDBOX).params
    corpus, contract = params.get_param("corpus").schema, params.get_param("contract").schema
    assert corpus["examples"] == ["broken", "my-docs", SANDBOX.corpus]
    assert "python-source, contract stdlib-py@1" in corpus["values_display"]["my-docs"]
    assert contract["enum"][0] is None and "stdlib-py@1" in contract["enum"]  # None: the corpus' own
    assert contract["values_display"]["stdlib-py@1"] == "stdlib-py@1 — fits my-docs"
    # Offered, not enforced: a corpus imported after the last parse is typed; the snapshot task checks it.
    assert params.get_param("corpus").resolve("imported-after-the-parse") == "imported-after-the-parse"
    assert params.get_param("contract").resolve("stdlib-py@1") == "stdlib-py@1"
    with pytest.raises(ParamValidationError, match="no-such@9"):
        params.get_param("contract").resolve("no-such@9")


@pytest.mark.parametrize("hostile", ["deep", "digits", "dev-zero", "fifo"])
def test_a_hostile_corpus_record_never_breaks_the_dags_parse(tmp_path, monkeypatch, hostile):
    """One corpus.json built to crash a JSON parser, or to block or exhaust the reader, is listed as
    unreadable; the DAG still parses with the others offered."""
    import os

    from kiln.airflow.dagfactory import build_dag
    from kiln.policy import SANDBOX
    from kiln.settings import load

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    record = load().corpus_root / "hostile" / "corpus.json"
    record.parent.mkdir(parents=True)
    {"deep": lambda: record.write_text("[" * 500_000), "digits": lambda: record.write_text("9" * 10_000),
     "dev-zero": lambda: record.symlink_to("/dev/zero"), "fifo": lambda: os.mkfifo(record)}[hostile]()
    corpus = build_dag(SANDBOX).params.get_param("corpus").schema
    assert "hostile" in corpus["examples"]
    assert corpus["values_display"]["hostile"] == "hostile (unreadable corpus.json)"
