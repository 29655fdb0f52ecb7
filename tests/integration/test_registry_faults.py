"""kiln.registry when things go wrong, against a real ``mlflow server`` that these tests kill.

The server here is this module's own (``fault_server``), not the session's: tests SIGKILL it at an
exact point of a promotion or a registration (a hook on the client's writes) and start it again on
the same port with the same SQLite backend store and artifact folder, as an operator would after
a crash. Backoff waits are recorded instead of slept (``registry.mlflow_io._sleep``), so nothing here
depends on timing; mlflow's own per-request retries are switched off so that kiln's retry loop is
the one under test.

Also here, the outcomes a reviewer or the gate can produce without any fault: approval rejected,
approval timed out, no champion yet (first model), promotion re-run after success.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kiln import registry
from kiln.errors import ConfigError, PolicyError, RegistryError
from kiln.runs import RUN_KEY_TAG
from kiln.stack.mlflow_server import MlflowServer, free_port, kill_server, restart_server, start_server, stop_server

from test_registry_mlflow import approve, make_candidate, production_policy, versions  # tests/integration is on sys.path

pytestmark = pytest.mark.slow

RETRIES = 2
BACKOFF_S = 0.5
PROMOTION_TAGS = ("promotion_run_key", "approver", "approved_at", "previous_version", "source_version",
                  "decision", "decision_reasons", "decision_champion_bits_per_byte")


class FaultServer:
    """This module's server, with the crash and the restart a test needs."""

    def __init__(self, handle: MlflowServer) -> None:
        self.handle = handle
        self.sleeps: list[float] = []
        """The backoff waits kiln asked for, in order (recorded, not slept)."""
        self.on_sleep: Callable[[], None] | None = None
        """Called at each backoff wait (e.g. to bring the server back during one)."""

    @property
    def url(self) -> str:
        return self.handle.url

    def kill(self) -> None:
        kill_server(self.handle)

    def restart(self) -> None:
        self.handle = restart_server(self.handle)

    def ensure_up(self) -> None:
        if self.handle.poll() is not None:
            self.restart()


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    home = tmp_path_factory.mktemp("mlflow-faults")
    for attempt in range(3):
        try:
            server = FaultServer(start_server(home, free_port()))
            break
        except ConfigError:  # another process took the free port between probe and bind
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        stop_server(server.handle)


@pytest.fixture
def fault(fault_server: FaultServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultServer]:
    """Point kiln (and mlflow's fluent API) at the fault server; record backoff waits in ``.sleeps``."""
    import mlflow

    fault_server.ensure_up()  # a failed earlier test may have left it down
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fault_server.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    monkeypatch.setenv("KILN_REGISTRY_RETRIES", str(RETRIES))
    monkeypatch.setenv("KILN_REGISTRY_BACKOFF_S", str(BACKOFF_S))
    fault_server.sleeps, fault_server.on_sleep = [], None

    def record_sleep(seconds: float) -> None:
        fault_server.sleeps.append(seconds)
        if fault_server.on_sleep is not None:
            fault_server.on_sleep()

    monkeypatch.setattr(registry.mlflow_io, "_sleep", record_sleep)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(fault_server.url)
    try:
        yield fault_server
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(previous)


@pytest.fixture
def client(fault: FaultServer):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=fault.url)


def _aliases(client, model: str) -> dict[str, str]:
    return dict(client.get_registered_model(model).aliases)


def _register(policy, cand, key: str) -> dict[str, Any]:
    return registry.register_candidate(policy=policy, run_key=key, **cand.kwargs())


def _promote(policy, ref: dict[str, Any], cand, key: str, approver: str = "alice"):
    """The run's review (``approver`` answered Approve) and its promote task."""
    decision = registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
    approve(policy, ref, key, approver)
    return registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)


def _with_champion(tmp_path, policy, unique_name: str):
    """Version 1 of the target model holds ``champion`` (candidate a, 3.0 bits/byte)."""
    a = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_production/a-{unique_name}"
    _promote(policy, _register(policy, a, key), a, key)


# ------------------------------------------------------------------------------------ server faults


def test_server_down_mid_promotion_retries_then_a_rerun_completes_once(
    tmp_path, fault, client, unique_name, logged_models, recording_client, monkeypatch
):
    policy = production_policy(unique_name)
    target = policy.target_model
    _with_champion(tmp_path, policy, unique_name)
    b = make_candidate(tmp_path, "b", 2.9)
    key_b = f"kiln_production/b-{unique_name}"
    ref_b = _register(policy, b, key_b)
    decision_b = registry.decide(b.eval_report, registry.champion_report(policy), policy.gate)
    approve(policy, ref_b, key_b, "bob")

    # Crash the server right after the copy and the second promotion tag reached it.
    log: list[tuple] = []
    tags_written = []

    def crash_after_second_tag(name: str, args: tuple[str, ...]) -> None:
        if name == "set_model_version_tag":
            tags_written.append(args)
            if len(tags_written) == 2:
                fault.kill()

    real_client = registry.mlflow_io._client
    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: recording_client(real_client(), log, after=crash_after_second_tag))

    with pytest.raises(RegistryError) as err:
        registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)

    assert err.value.retryable and f"after {RETRIES + 1} attempt(s)" in str(err.value)
    assert registry.is_transient(err.value.__cause__)
    assert fault.sleeps == [BACKOFF_S, 2 * BACKOFF_S], "bounded exponential backoff"
    # (the log records each write as it is sent: the third tag was sent to a dead server)
    assert [w[0] for w in log] == ["copy_model_version"] + ["set_model_version_tag"] * 3

    fault.restart()  # same port, same backend store
    assert _aliases(client, target) == {"champion": "1"}, "no alias moved by the failed promotion"
    assert len(versions(client, target)) == 2  # the copy made before the crash, half-tagged
    half_tagged = client.get_model_version(target, "2").tags
    assert registry.TAGS["approver"] in half_tagged and registry.TAGS["approved_at"] not in half_tagged

    # Re-run (the Airflow retry): at the moment `champion` moves, the version's tags are complete.
    log.clear()
    tags_at_alias_move: dict[str, dict[str, str]] = {}

    def snapshot_tags(name: str, args: tuple[str, ...]) -> None:
        if name == "set_registered_model_alias":
            tags_at_alias_move[args[1]] = dict(real_client().get_model_version(target, args[2]).tags)

    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: recording_client(real_client(), log, before=snapshot_tags))
    record = registry.promote(policy=policy, candidate_version=ref_b["version"], decision=decision_b, run_key=key_b)

    assert (record.version, record.previous_version, record.approver) == ("2", "1", "bob")
    assert len(versions(client, target)) == 2, "the re-run reused the copy: no duplicate version"
    assert "copy_model_version" not in [w[0] for w in log]
    assert log[-1] == ("set_registered_model_alias", target, "champion", "2")
    at_move = tags_at_alias_move["champion"]
    assert all(registry.TAGS[t] in at_move for t in PROMOTION_TAGS)
    assert at_move[registry.TAGS["approver"]] == "bob" and at_move[RUN_KEY_TAG] == key_b
    assert _aliases(client, target) == {"champion": "2", "previous": "1"}


def _crash_once(monkeypatch, fault: FaultServer, *, after_create: bool) -> None:
    """Kill the server once, at ``mlflow.register_model``: before the version exists, or right after."""
    import mlflow

    real_register = mlflow.register_model
    crashed = []

    def register_with_crash(*args, **kwargs):
        if crashed:
            return real_register(*args, **kwargs)
        crashed.append(True)
        if not after_create:
            fault.kill()  # the model is logged into the run; no version exists yet
            return real_register(*args, **kwargs)
        mv = real_register(*args, **kwargs)
        fault.kill()  # the version exists; its description and the run's end are not written yet
        return mv

    monkeypatch.setattr(mlflow, "register_model", register_with_crash)


def test_server_killed_during_registration_then_a_rerun_makes_exactly_one_version(
    tmp_path, fault, client, unique_name, logged_models, monkeypatch
):
    policy = production_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_production/{unique_name}"
    _crash_once(monkeypatch, fault, after_create=True)

    with pytest.raises(RegistryError) as err:
        _register(policy, cand, key)
    assert err.value.retryable and fault.sleeps == [BACKOFF_S, 2 * BACKOFF_S]

    fault.restart()
    (half_done,) = versions(client, policy.candidate_model)
    assert not half_done.description  # created, never described

    ref = _register(policy, cand, key)
    again = _register(policy, cand, key)

    assert len(versions(client, policy.candidate_model)) == 1, "exactly one version for the run key"
    assert ref["version"] == again["version"] == "1" and ref["created"] is again["created"] is False
    assert len(logged_models) == 1, "the model logged before the crash is reused"
    mv = client.get_model_version(policy.candidate_model, "1")
    assert mv.tags[RUN_KEY_TAG] == key and "Gate: **promote**" in mv.description
    assert client.get_run(ref["run_id"]).info.status == "FINISHED"


def test_backoff_outlasts_a_short_outage_during_registration(
    tmp_path, fault, client, unique_name, logged_models, monkeypatch
):
    policy = production_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    _crash_once(monkeypatch, fault, after_create=False)
    fault.on_sleep = fault.restart  # the server is back by the end of the first backoff wait

    ref = _register(policy, cand, f"kiln_production/{unique_name}")

    assert fault.sleeps == [BACKOFF_S] and ref["created"] is True
    assert len(versions(client, policy.candidate_model)) == 1
    assert len(logged_models) == 1, "the retry reused the model logged before the outage"
    assert "Gate: **promote**" in client.get_model_version(policy.candidate_model, ref["version"]).description
    assert client.get_run(ref["run_id"]).info.status == "FINISHED"


def test_duplicate_version_left_by_a_retried_create_is_removed(tmp_path, fault, client, unique_name, logged_models):
    import mlflow

    policy = production_policy(unique_name)
    cand = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_production/{unique_name}"
    ref = _register(policy, cand, key)
    # What mlflow's own retry of a POST whose response was lost leaves behind: the same create twice.
    first = client.get_model_version(policy.candidate_model, ref["version"])
    mlflow.register_model(first.source, policy.candidate_model, tags=first.tags)
    assert len(versions(client, policy.candidate_model)) == 2

    again = _register(policy, cand, key)

    assert again["version"] == ref["version"] and again["created"] is False
    assert [mv.version for mv in versions(client, policy.candidate_model)] == [ref["version"]]


# --------------------------------------------------------------------------------- review outcomes


@pytest.mark.parametrize("outcome", ["rejected", "timed out"])
def test_a_review_that_does_not_approve_tags_the_candidate_and_moves_no_alias(
    tmp_path, fault, client, unique_name, logged_models, writes, outcome
):
    policy = production_policy(unique_name)
    _with_champion(tmp_path, policy, unique_name)
    b = make_candidate(tmp_path, "b", 2.9)
    ref = _register(policy, b, f"kiln_production/b-{unique_name}")
    assert ref["decision"]["action"] == "promote"  # the gate said yes; the person did not
    if outcome == "rejected":
        reviewer, at = "carol", "2026-11-29T18:00:00+00:00"
    else:
        # The DAG's ApprovalOperator waits policy.approval_timeout_s; then nobody has answered.
        assert policy.approval_timeout_s == 24 * 3600
        requested = dt.datetime(2026, 11, 28, 18, 0, tzinfo=dt.UTC)
        reviewer = ",".join(policy.reviewers)
        at = (requested + dt.timedelta(seconds=policy.approval_timeout_s)).isoformat()
    writes.clear()
    key = f"kiln_production/b-{unique_name}"

    registry.record_review(policy=policy, candidate_version=ref["version"], run_key=key, outcome=outcome,
                           reviewer=reviewer, at=at)

    assert writes and {(w[0], w[1]) for w in writes} == {("set_model_version_tag", policy.candidate_model)}
    tags = client.get_model_version(policy.candidate_model, ref["version"]).tags
    assert (tags["kiln.review"], tags["kiln.review.by"], tags["kiln.review.at"]) == (outcome, reviewer, at)
    assert _aliases(client, policy.target_model) == {"champion": "1"}
    assert len(versions(client, policy.target_model)) == 1, "nothing copied into the production model"
    writes.clear()
    registry.record_review(policy=policy, candidate_version=ref["version"], run_key=key, outcome=outcome,
                           reviewer=reviewer, at=at)
    assert writes == [], "recording the same review again writes nothing"
    with pytest.raises(PolicyError, match=f"the review recorded in this run says '{outcome}'"):
        registry.promote(policy=policy, candidate_version=ref["version"], run_key=key,
                         decision=registry.decide(b.eval_report, registry.champion_report(policy), policy.gate))
    assert writes == [] and len(versions(client, policy.target_model)) == 1


def test_unknown_review_outcome_is_refused_before_any_request(monkeypatch, unique_name):
    def no_client():
        raise AssertionError("a request was about to be sent")

    monkeypatch.setattr(registry.mlflow_io, "_client", no_client)
    with pytest.raises(ConfigError, match="outcome"):
        registry.record_review(policy=production_policy(unique_name), candidate_version="1", run_key="d/r",
                               outcome="maybe", reviewer="x", at="")


# ----------------------------------------------------------------------------------- gate outcomes


def test_first_model_is_promoted_because_there_is_no_champion(tmp_path, fault, client, unique_name, logged_models):
    policy = production_policy(unique_name)
    assert registry.champion_report(policy) is None
    a = make_candidate(tmp_path, "a", 3.0)
    key = f"kiln_production/{unique_name}"
    ref = _register(policy, a, key)

    decision = registry.decide(a.eval_report, registry.champion_report(policy), policy.gate)
    assert decision.action == "promote" and decision.champion_bits_per_byte is None
    assert "regression passed: no champion yet: this is the first model" in decision.reasons
    assert ref["decision"] == decision.to_json()
    candidate = client.get_model_version(policy.candidate_model, ref["version"])
    assert candidate.tags["kiln.decision.champion_version"] == ""
    assert "none: first model" in candidate.description

    approve(policy, ref, key, "alice")
    record = registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)
    assert (record.version, record.previous_version) == ("1", None)
    assert _aliases(client, policy.target_model) == {"champion": "1"}, "no `previous` for the first model"


def _registry_state(client, policy) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for model in (policy.candidate_model, policy.target_model):
        state[model] = {
            "aliases": _aliases(client, model),
            "versions": {mv.version: (dict(mv.tags), mv.description, mv.last_updated_timestamp)
                         for mv in (client.get_model_version(model, v.version) for v in versions(client, model))},
        }
    return state


def test_promotion_rerun_after_success_changes_nothing(
    tmp_path, fault, client, unique_name, logged_models, writes
):
    policy = production_policy(unique_name)
    _with_champion(tmp_path, policy, unique_name)
    b = make_candidate(tmp_path, "b", 2.9)
    key = f"kiln_production/b-{unique_name}"
    ref = _register(policy, b, key)
    decision = registry.decide(b.eval_report, registry.champion_report(policy), policy.gate)
    approve(policy, ref, key, "bob")
    record = registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)
    before = _registry_state(client, policy)
    writes.clear()

    # The Airflow retry of the promote task and of register_candidate, after both succeeded.
    assert _register(policy, b, key)["version"] == ref["version"]
    again = registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)

    assert again == record and writes == []
    assert _registry_state(client, policy) == before, "no new tag timestamps, no alias churn"
    assert json.loads(before[policy.target_model]["versions"]["2"][0]["kiln.decision.reasons"]) == decision.reasons


def test_a_decision_made_against_an_older_champion_is_checked_again(
    tmp_path, fault, client, unique_name, logged_models, writes
):
    """Run b and run c are both decided against champion a; c is promoted first (b waited for its review)."""
    policy = production_policy(unique_name)
    _with_champion(tmp_path, policy, unique_name)  # a: 3.0
    b, b_close, c = (make_candidate(tmp_path, n, bpb) for n, bpb in (("b", 2.9), ("b2", 2.72), ("c", 2.7)))
    refs = {n: _register(policy, cand, f"kiln_production/{n}-{unique_name}")
            for n, cand in (("b", b), ("b2", b_close), ("c", c))}
    stale = {n: registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
             for n, cand in (("b", b), ("b2", b_close))}
    assert stale["b"].champion_bits_per_byte == 3.0
    _promote(policy, refs["c"], c, f"kiln_production/c-{unique_name}")  # champion: c, 2.7
    for n in ("b", "b2"):  # both were approved while c was promoted
        approve(policy, refs[n], f"kiln_production/{n}-{unique_name}", "bob")
    writes.clear()
    with pytest.raises(PolicyError, match="champion changed since the gate decided") as err:
        registry.promote(policy=policy, candidate_version=refs["b"]["version"], decision=stale["b"],
                         run_key=f"kiln_production/b-{unique_name}")
    assert "regression FAILED" in str(err.value) and not err.value.retryable
    assert not [w for w in writes if w[0] == "set_registered_model_alias"]
    assert _aliases(client, policy.target_model) == {"champion": "2", "previous": "1"}
    assert len(versions(client, policy.target_model)) == 2, "a refused candidate is not copied"

    # b2 is within tolerance of the new champion: promoted, tagged with the decision against it.
    record = registry.promote(policy=policy, candidate_version=refs["b2"]["version"], decision=stale["b2"],
                              run_key=f"kiln_production/b2-{unique_name}")
    tags = client.get_model_version(policy.target_model, record.version).tags
    assert float(tags["kiln.decision.champion_bits_per_byte"]) == 2.7
    assert (record.version, record.previous_version) == ("3", "2")


def test_rollback_interrupted_before_the_alias_move_completes_once(
    tmp_path, mlflow_uri, unique_name, logged_models, recording_client, monkeypatch
):
    """The connection drops as the rollback moves the alias (tags and audit event written): the
    retry completes *that* rollback — same time, one audit event — instead of recording a second."""
    from mlflow import MlflowClient

    monkeypatch.setattr(registry.mlflow_io, "_sleep", lambda s: None)
    policy = production_policy(unique_name)
    target = policy.target_model
    for name, bpb in (("a", 3.0), ("b", 2.9)):
        cand = make_candidate(tmp_path, name, bpb)
        key = f"kiln_production/{name}-{unique_name}"
        ref = registry.register_candidate(policy=policy, run_key=key, **cand.kwargs())
        decision = registry.decide(cand.eval_report, registry.champion_report(policy), policy.gate)
        approve(policy, ref, key, "alice")
        registry.promote(policy=policy, candidate_version=ref["version"], decision=decision, run_key=key)

    log: list[tuple] = []
    dropped: list[str] = []

    def drop_first_alias_move(name: str, args: tuple[str, ...]) -> None:
        if name == "set_registered_model_alias" and not dropped:
            dropped.append(args[1])
            raise ConnectionError("connection reset by peer (injected)")

    real_client = registry.mlflow_io._client
    monkeypatch.setattr(registry.mlflow_io, "_client", lambda: recording_client(real_client(), log, before=drop_first_alias_move))
    record = registry.rollback(target, policy, "carol", reason="INC-9")

    assert dropped == ["champion"] and (record.version, record.previous_version) == ("1", "2")
    client = MlflowClient(mlflow_uri)
    assert client.get_model_version_by_alias(target, "champion").version == "1"
    tags = client.get_model_version(target, "1").tags
    assert tags[registry.TAGS["rollback_at"]] == record.at
    assert client.get_model_version(target, "2").tags[registry.TAGS["rolled_back_at"]] == record.at
    rollbacks = [e for e in registry.audit_history(target, policy) if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["at"] == record.at and rollbacks[0]["reason"] == "INC-9"
    on_restored = [w[3] for w in log if w[0] == "set_model_version_tag" and w[2] == "1"]
    # the four rollback tags, the audit event and the signed rollback's two: the retry reuses its attestation
    assert len(on_restored) == len(set(on_restored)) == 7, f"the retry rewrote tags of the restored version: {on_restored}"
