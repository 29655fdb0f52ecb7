"""The user journey in a real browser (headless Chromium) against the real e2e stack.

1. A sandbox user logs in on the Airflow UI, fills the trigger form of the sandbox DAG (recipe,
   step budget, seed, corpus, run id), submits it and watches the run appear and succeed.
2. A production run is started through REST (pinned inputs, as its schedule would); the reviewer
   opens Required Actions, reads the approval request and clicks Approve on the run's HITL page; the
   run continues to promotion. Then the MLflow UI's model version page of the new champion shows the
   lineage tags, and the source run's artifacts show the evaluation report and the version's
   datasheet (made from its signed provenance statement).

Every step leaves a screenshot in ``test-artifacts/browser/<test>/`` (printed; ignored by git);
a failure leaves ``failure.png`` + ``failure.html`` there. State is confirmed through REST too: the
browser proves what a person sees, REST proves it is what happened.
"""

from __future__ import annotations

import time
import uuid

import pytest

from .browser import (
    Browser,
    airflow_login,
    artifact_dir,
    chromium_unavailable,
    fill,
    mlflow_open_artifact,
    mlflow_select_artifact,
    mlflow_show_lineage,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(chromium_unavailable() is not None, reason=f"no headless browser: {chromium_unavailable()}"),
]

RUN_DONE = ("success", "failed")


def _end_if_running(admin, dag_id: str, run_id: str) -> None:
    """A run a failed test left behind must not hold the DAG's slots for the tests after it."""
    from kiln.errors import AirflowAPIError

    try:
        if admin.get_run(dag_id, run_id)["state"] not in RUN_DONE:
            admin.request("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed"})
    except AirflowAPIError:
        pass  # never triggered, or already gone


def _wait_run_badge(b: Browser, state: str, timeout: float) -> None:
    """Wait until the run page's header shows ``state`` (the UI refreshes an active run by itself)."""
    b.css_with_text("[data-testid=header-card] [data-testid=state-badge]", state, timeout=timeout)


def _task_row_state(b: Browser, task_id: str) -> str:
    """The State cell of ``task_id`` in the run page's task instance table."""
    from selenium.webdriver.common.by import By

    for row in b.driver.find_elements(By.CSS_SELECTOR, "[data-testid=table-list] tbody tr"):
        name = row.find_elements(By.CSS_SELECTOR, "[data-testid=table-cell-task_display_name]")
        if name and name[0].text.strip() == task_id:
            return row.find_element(By.CSS_SELECTOR, "[data-testid=table-cell-state]").text.strip()
    return ""


def test_sandbox_trigger_form(stack, admin, login):
    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import SANDBOX
    from kiln.stack import embedded as kiln_stack

    corpus = "browser-corpus"  # its own corpus, so this test shares no data with the other e2e tests
    build_corpus(kiln_settings.load().corpus_root / corpus, shards=4, seed=7, poison=("garbage_bytes",))
    admin.wait_for_dag(SANDBOX.dag_id)
    admin.unpause(SANDBOX.dag_id)
    run_id = f"browser_form_{uuid.uuid4().hex[:8]}"
    base = stack["airflow"]
    folder = artifact_dir("test_sandbox_trigger_form")
    print(f"browser screenshots: {folder}")
    try:
        with Browser(folder) as b:
            airflow_login(b, base, "sandbox-user", kiln_stack.passwords()["sandbox-user"])
            b.get(f"{base}/dags/{SANDBOX.dag_id}")
            b.css("[data-testid=trigger-dag-button]").click()
            form = b.css("[role=dialog][id^='dialog:']")
            b.css_with_text("[role=dialog][id^='dialog:']", "Run Parameters")
            b.step("trigger-form")

            # Recipe is a searchable select: clear the default, type, pick the option (the cleared
            # field must really be empty first, or picking would prove nothing).
            from selenium.webdriver.common.keys import Keys

            recipe = b.css("input[role=combobox][aria-required=true]", within=form)
            chosen = "input[name=element_recipe]"  # the select's hidden form value (gone while empty)
            recipe.click()
            recipe.send_keys(Keys.BACKSPACE)
            b.wait(lambda d: not b.value(chosen, within=form), "the recipe select to clear")
            recipe.send_keys("tiny.t")  # "tiny" alone also offers tiny-bpe.toml, first in the list
            b.css_with_text("[role=option], [id*='-option-']", "tiny.toml")
            recipe.send_keys(Keys.ENTER)
            b.wait(lambda d: b.value(chosen, within=form) == "tiny.toml", "tiny.toml to be selected")
            fill(b.css("input[name=element_max_steps]", within=form), 20)
            fill(b.css("input[name=element_seed]", within=form), 7)
            fill(b.css("input[name=element_corpus]", within=form), corpus)
            b.css_with_text("button", "Advanced Options", within=form).click()
            fill(b.css("input[name=dagRunId]", within=form), run_id)
            b.css_with_text("[role=dialog][id^='dialog:']", f'"corpus": "{corpus}"')  # the form's JSON preview
            b.step("form-filled")
            b.css("[data-testid=trigger-dag-submit]", within=form).click()

            b.url_contains(f"/runs/{run_id}")
            b.css_with_text("[data-testid=header-card]", run_id)
            b.step("run-appeared")
            run = admin.get_run(SANDBOX.dag_id, run_id)
            # strategy, mixture and contract left empty: the recipe's strategy, the corpus (no mixture), its own contract.
            assert run["conf"] == {"recipe": "tiny.toml", "nodes": 1, "max_steps": 20, "seed": 7, "corpus": corpus,
                                   "strategy": None, "mixture": None, "contract": None}, run["conf"]
            assert run["triggering_user_name"] == "sandbox-user"

            _wait_run_badge(b, "Success", timeout=780)
            b.wait(lambda d: _task_row_state(b, "promote") == "Success", "the promote task to show Success")
            b.step("run-succeeded")
        assert admin.get_run(SANDBOX.dag_id, run_id)["state"] == "success"
        promotion = admin.xcom(SANDBOX.dag_id, run_id, "promote")
        assert promotion["registered_model"] == SANDBOX.target_model
    finally:
        _end_if_running(admin, SANDBOX.dag_id, run_id)


def _wait_for_review(admin, dag_id: str, run_id: str, timeout: float, settle_s: float = 5.0) -> None:
    """Wait (REST) until the approval task has awaited a human for ``settle_s`` (an answer within a
    second of the request makes Airflow 3.3 ask again: docs/operations.md); fail early, with the
    task states, if the run ends first."""
    deadline = time.monotonic() + timeout
    waiting_since: float | None = None
    while True:
        states = {ti["task_id"]: ti["state"] for ti in admin.task_instances(dag_id, run_id)}
        if states.get("approval") == "awaiting_input":
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since >= settle_s:
                return
        run_state = admin.get_run(dag_id, run_id)["state"]
        assert run_state not in RUN_DONE, f"run {run_id} ended {run_state} before asking for review: {states}"
        assert time.monotonic() < deadline, f"no review requested within {timeout:.0f}s: {states}"
        time.sleep(2)


def test_production_approval_and_mlflow_lineage(stack, admin, login):
    """About 2 min on 2 cores: a full production run (the test deployment's pinned 60-step staging recipe on two agents)
    waits for the review the browser gives."""
    import mlflow
    from selenium.webdriver.common.by import By

    from kiln import settings as kiln_settings
    from kiln.data.corpus import build_corpus
    from kiln.policy import PRODUCTION
    from kiln.stack import embedded as kiln_stack

    # The registered corpus, built exactly as test_production_dag builds it (same bytes, same snapshot).
    build_corpus(kiln_settings.load().corpus_root / PRODUCTION.corpus, shards=8, seed=11, poison=("null_text", "zero_bytes"))
    admin.wait_for_dag(PRODUCTION.dag_id)
    admin.unpause(PRODUCTION.dag_id)
    run_id = f"browser_review_{uuid.uuid4().hex[:8]}"
    admin.trigger(PRODUCTION.dag_id, conf={"reason": "browser test"}, run_id=run_id)
    base, mlflow_url = stack["airflow"], stack["mlflow"]
    folder = artifact_dir("test_production_approval_and_mlflow_lineage")
    print(f"browser screenshots: {folder}")
    try:
        _wait_for_review(admin, PRODUCTION.dag_id, run_id, timeout=780)
        with Browser(folder) as b:
            # --- the reviewer answers on the run's Required Actions page
            airflow_login(b, base, "reviewer", kiln_stack.passwords()["reviewer"])
            b.get(f"{base}/required_actions")
            cell = b.css(f"[data-testid=table-cell-run_id] a[href$='/runs/{run_id}']")
            row = cell.find_element(By.XPATH, "./ancestor::tr")
            assert "Approval Required" in row.text and PRODUCTION.target_model in row.text, row.text
            b.step("required-actions")
            row.find_element(By.CSS_SELECTOR, "[data-testid=table-cell-subject] a").click()
            b.url_contains(f"/runs/{run_id}/tasks/approval/required_actions")
            approve = b.css("[data-testid=hitl-option-Approve]")
            b.page_text(f"to {PRODUCTION.target_model}@{PRODUCTION.alias}?")  # the request names what moves
            b.step("review-request")
            approve.click()
            b.page_text("from reviewer")  # "Response received at … from reviewer"
            b.step("approved")

            # --- the run continues to promotion
            b.get(f"{base}/dags/{PRODUCTION.dag_id}/runs/{run_id}")
            _wait_run_badge(b, "Success", timeout=600)
            b.wait(lambda d: _task_row_state(b, "promote") == "Success", "the promote task to show Success")
            b.step("run-promoted")

            detail = admin.hitl_detail(PRODUCTION.dag_id, run_id, "approval")
            assert detail["chosen_options"] == ["Approve"] and detail["responded_by_user"]["name"] == "reviewer"
            client = mlflow.MlflowClient(tracking_uri=mlflow_url, registry_uri=mlflow_url)
            champion = client.get_model_version_by_alias(PRODUCTION.target_model, PRODUCTION.alias)
            assert champion.tags["kiln.airflow.run_id"] == run_id
            assert champion.tags["kiln.promotion.approver"] == "reviewer"

            # --- MLflow UI: the champion's model version page shows its lineage, as the registry has it
            lineage = ("kiln.airflow.dag_id", "kiln.airflow.run_id", "kiln.snapshot_id", "kiln.training_manifest_sha256",
                       "kiln.weights_sha256", "kiln.contract", "kiln.quarantined_shards", "kiln.promotion.approver")
            mlflow_show_lineage(b, mlflow_url, PRODUCTION.target_model, champion.version,
                                {tag: champion.tags[tag] for tag in lineage})
            b.page_text(f"@ {PRODUCTION.alias}")
            b.step("model-version-lineage")

            # --- and the source run's artifacts hold the evaluation report a reviewer reads
            b.driver.switch_to.frame(mlflow_open_artifact(b, champion.run_id, "evaluation/report.html"))
            b.css_with_text("h1", f"Evaluation report — {PRODUCTION.dag_id}/{run_id}")
            b.driver.switch_to.default_content()
            b.step("evaluation-report")

            # --- and the datasheet made from the version's signed provenance statement, beside it
            b.driver.switch_to.frame(mlflow_select_artifact(b, "datasheet/datasheet.html"))
            b.css_with_text("h1", "Datasheet of")
            b.page_text(run_id)  # the Airflow run that made it
            b.page_text(PRODUCTION.contract)  # how the data was cleaned: the contract it was held to
            b.driver.switch_to.default_content()
            b.step("datasheet")
        assert admin.get_run(PRODUCTION.dag_id, run_id)["state"] == "success"
    finally:
        _end_if_running(admin, PRODUCTION.dag_id, run_id)
