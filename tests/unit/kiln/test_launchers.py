from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kiln.errors import ConfigError, LaunchError
from kiln.launchers import (
    JobHandle,
    JobStatus,
    LaunchPlan,
    LaunchSpec,
    LocalLauncher,
    SlurmLauncher,
    TrainingFaultError,
    agent_argv,
    get_launcher,
    read_result,
    render_sbatch,
)
from kiln.launchers.base import fatal_markers, result_for
from kiln.launchers.local import kill_tagged, record_status
from kiln.launchers.stragglers import StragglerDetector, StragglerPolicy, detect, rank_step_times_from_metrics
from kiln.launchers.worker import write_fatal_marker


def _spec(tmp_path: Path, **kw) -> LaunchSpec:
    return LaunchSpec(run_dir=tmp_path, manifest=tmp_path / "m.json", recipe=tmp_path / "r.toml",
                      run_key="kiln_sandbox/manual__2026", **kw)


def test_agent_argv_forms_one_multi_node_gang(tmp_path):
    spec = _spec(tmp_path, nodes=2, max_restarts=3, overrides=("train.seed=7",), max_steps=20)
    argv = agent_argv(spec, 1, 29400)
    assert "--nnodes=2" in argv and "--max-restarts=3" in argv
    assert "--rdzv-endpoint=127.0.0.1:29400" in argv and "--rdzv-backend=c10d" in argv
    # The supervisor hosts the rendezvous store, so losing any node never loses the rendezvous.
    assert "--rdzv-conf=is_host=false" in argv
    assert any(a.startswith("--rdzv-id=kiln_sandbox_manual__2026") for a in argv)
    assert argv[len(argv) - 1 - argv[::-1].index("-m") + 1] == "kiln.launchers.worker"
    assert argv[-4:] == ["--set", "train.seed=7", "--max-steps", "20"]


@pytest.mark.parametrize("field,value", [("nodes", 0), ("nproc_per_node", 0), ("max_restarts", -1), ("max_steps", 0),
                                         ("min_nodes", 0), ("min_nodes", 3), ("replacement_timeout_s", -1),
                                         ("replacement_timeout_s", 1.5), ("spare_nodes", -1)])
def test_launch_spec_names_the_bad_field(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        _spec(tmp_path, **{"nodes": 2, field: value})


def test_launch_spec_round_trips_through_json(tmp_path):
    spec = _spec(tmp_path, nodes=2, overrides=("a.b=1",), env={"X": "1"})
    again = LaunchSpec.from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec


def test_missing_result_is_a_launch_error(tmp_path):
    with pytest.raises(LaunchError, match="result.json"):
        read_result(tmp_path)


def test_get_launcher_by_name_and_unknown_backend():
    assert isinstance(get_launcher("local"), LocalLauncher)
    assert isinstance(get_launcher("slurm", partition="p", qos="q"), SlurmLauncher)
    with pytest.raises(ConfigError, match="local, slurm, kubernetes|'local', 'slurm', 'kubernetes'"):
        get_launcher("k8s")
    with pytest.raises(ConfigError, match="no options"):
        get_launcher("local", partition="p")


def test_render_sbatch_gangs_one_agent_per_node(tmp_path):
    spec = _spec(tmp_path, nodes=2, max_restarts=2, env={"MLFLOW_RUN_ID": "abc def"})
    script = render_sbatch(spec, partition="prod", qos="high", time_limit="01:00:00", exclude=("node7",))
    assert script.startswith("#!/bin/bash\n")
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--partition=prod", "--qos=high", "--time=01:00:00",
                      "--exclude=node7", "--no-requeue", f"--output={tmp_path}/.launch/slurm-%j.log"):
        assert f"#SBATCH {directive}\n" in script
    assert "--open-mode" not in script
    assert "#SBATCH --open-mode=append\n" in render_sbatch(spec, requeue=True)  # one log across requeues
    assert "export MLFLOW_RUN_ID='abc def'" in script and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    srun = script[script.index("srun "):]
    assert "--kill-on-bad-exit=1" in srun and "--ntasks=2" in srun
    assert '--rdzv-endpoint="${KILN_RDZV_ENDPOINT}"' in srun and "--max-restarts=2" in srun
    assert "kiln.launchers.worker" in srun


def test_render_sbatch_without_partition_or_qos_leaves_them_to_slurm(tmp_path):
    script = render_sbatch(_spec(tmp_path))
    assert "--partition" not in script and "--qos" not in script


def test_render_sbatch_refuses_a_partition_that_is_not_a_name(tmp_path):
    with pytest.raises(ConfigError, match="partition"):
        render_sbatch(_spec(tmp_path), partition="prod; rm -rf /")


def test_worker_fatal_marker_is_read_back(tmp_path):
    assert fatal_markers(tmp_path) == []
    write_fatal_marker(tmp_path, 3, "ResumeMismatchError: world_size 4 != 2")
    (marker,) = fatal_markers(tmp_path)
    assert marker["rank"] == 3 and "ResumeMismatchError" in marker["error"]


def test_worker_marks_exit_2_and_only_exit_2(tmp_path, monkeypatch):
    import kiln_trainer.train as trainer
    from kiln.launchers import worker

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    recipe = Path(__file__).resolve().parents[3] / "training" / "recipes" / "tiny.toml"  # trainer = kiln
    argv = ["--manifest", str(tmp_path / "m.json"), "--recipe", str(recipe), "--run-dir", str(tmp_path)]
    monkeypatch.setattr(trainer, "main", lambda argv: 1)
    assert worker.main(argv) == 1
    assert fatal_markers(tmp_path) == []
    monkeypatch.setattr(trainer, "main", lambda argv: 2)
    monkeypatch.setenv("RANK", "1")
    assert worker.main(argv) == 2
    assert [m["rank"] for m in fatal_markers(tmp_path)] == [1]


def test_the_marker_of_a_trainer_on_the_sdk_names_the_fault_the_sdk_logged(tmp_path, monkeypatch):
    """A user's trainer on kiln's SDK exits 2 through ``sdk.run``, which logs the fault under
    ``kiln_trainer``, not under the user's package: the marker still names it."""
    from kiln.launchers import worker

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    package = tmp_path / "site" / "sdkusertrainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import logging\n\ndef main(argv):\n"
        "    logging.getLogger('kiln_trainer.train').error('TrainingManifestError: m.json: content hash mismatch')\n"
        "    return 2\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    tiny = Path(__file__).resolve().parents[3] / "training" / "recipes" / "tiny.toml"
    recipe = tmp_path / "user.toml"
    recipe.write_text('trainer = "sdkusertrainer.train:main"\n\n' + tiny.read_text())
    argv = ["--manifest", str(tmp_path / "m.json"), "--recipe", str(recipe), "--run-dir", str(tmp_path / "run")]
    assert worker.main(argv) == 2
    (marker,) = fatal_markers(tmp_path / "run")
    assert marker["error"] == "TrainingManifestError: m.json: content hash mismatch"


@pytest.mark.parametrize(
    "state,error,retryable",
    [("FATAL", TrainingFaultError, False), ("FAILED", LaunchError, True), ("CANCELLED", LaunchError, True),
     ("RUNNING", LaunchError, True)],
)
def test_result_for_maps_each_end_state_to_its_error(tmp_path, state, error, retryable):
    handle = JobHandle(backend="local", job_id="1", run_dir=str(tmp_path))
    with pytest.raises(error, match="local job 1") as info:
        result_for(JobStatus(state=state, reason="because"), handle)
    assert type(info.value).retryable is retryable


def test_training_fault_is_a_non_retryable_launch_error():
    assert issubclass(TrainingFaultError, LaunchError) and TrainingFaultError.retryable is False


def test_local_poll_reports_a_dead_supervisor_without_status(tmp_path):
    handle = JobHandle(backend="local", job_id=str(2**22 + 12345), run_dir=str(tmp_path))
    status = LocalLauncher().poll(handle)
    assert status.state == "FAILED" and "died" in status.reason


def test_local_poll_reads_the_final_status(tmp_path):
    (tmp_path / ".launch").mkdir()
    (tmp_path / ".launch" / "status.json").write_text(json.dumps({"state": "FATAL", "reason": "rank 0 exited 2", "restarts": 1}))
    status = LocalLauncher().poll(JobHandle(backend="local", job_id="1", run_dir=str(tmp_path)))
    assert status == JobStatus(state="FATAL", reason="rank 0 exited 2", restarts=1)


def test_kill_tagged_signals_only_tagged_processes(tmp_path):
    import subprocess
    import sys

    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**os.environ, "KILN_LAUNCH_NODE": "unit-test-tag"})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "KILN_LAUNCH_NODE": "unit-test-tag-other"})
    try:
        assert kill_tagged("unit-test-tag") == 1
        assert tagged.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
        tagged.kill()
        tagged.wait()


# ------------------------------------------------------------------------------- stragglers


def test_a_rank_slow_for_k_windows_is_flagged_once():
    policy = StragglerPolicy(factor=1.5, windows=3)
    windows = [(step, [0.10, 0.10, 0.25, 0.11]) for step in (10, 20, 30, 40, 50)]
    flags = detect(windows, policy)
    assert [(f.rank, f.step) for f in flags] == [(2, 30)]
    assert flags[0].ratio == pytest.approx(2.5) and "rank 2 at step 30" in flags[0].message


def test_two_ranks_compare_with_the_other_rank():
    flags = detect([(s, [0.10, 0.16]) for s in (5, 10)], StragglerPolicy(factor=1.5, windows=2))
    assert [f.rank for f in flags] == [1]


def test_clean_run_and_interrupted_streak_raise_no_flag():
    policy = StragglerPolicy(factor=1.5, windows=3)
    assert detect([(s, [0.10, 0.11, 0.12, 0.10]) for s in range(10, 200, 10)], policy) == []
    # slow, slow, recovered, slow, slow: never 3 in a row
    pattern = [[0.1, 0.2], [0.1, 0.2], [0.1, 0.1], [0.1, 0.2], [0.1, 0.2]]
    assert detect(list(zip(range(5), pattern, strict=True)), policy) == []


def test_a_second_slow_streak_flags_again():
    detector = StragglerDetector(policy=StragglerPolicy(factor=1.5, windows=1))
    assert len(detector.observe(1, [0.1, 0.3])) == 1
    assert detector.observe(2, [0.1, 0.1]) == []
    assert len(detector.observe(3, [0.1, 0.3])) == 1


@pytest.mark.parametrize("kw,field", [({"factor": 1.0}, "factor"), ({"windows": 0}, "windows"), ({"action": "reboot"}, "action")])
def test_straggler_policy_names_the_bad_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        StragglerPolicy(**kw)


def test_rank_step_times_are_read_from_metrics_jsonl(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 10, "loss": 3.0}\n{"step": 20, "rank_step_times": [0.1, 0.2]}\n{"step": 30, "rank_')
    assert list(rank_step_times_from_metrics(path)) == [(20, [0.1, 0.2])]


# ------------------------------------------------------------------------ deferrable trigger
def test_trigger_serializes_to_json_and_rebuilds(tmp_path):
    from airflow.sdk.module_loading import import_string

    from kiln.airflow.triggers import LaunchedJobTrigger

    trigger = LaunchedJobTrigger(handle={"backend": "slurm", "job_id": "42", "run_dir": str(tmp_path)}, backend="slurm",
                                 options={"partition": "kiln", "qos": None, "env": {"SLURM_CONF": "/x/slurm.conf"}}, poll_s=2)
    classpath, kwargs = trigger.serialize()
    again = import_string(classpath)(**json.loads(json.dumps(kwargs)))  # what the triggerer does
    assert again.serialize() == (classpath, kwargs)
    assert again._launcher().env == {"SLURM_CONF": "/x/slurm.conf"}


def test_trigger_waits_while_the_job_runs_and_fires_once_with_reason_and_log_tail(tmp_path):
    """The real local backend's poll on a live process (a stand-in for the job's supervisor):
    no event while it runs, one event with the launcher's reason and the log tail when it ends."""
    import asyncio
    import subprocess
    import sys

    from kiln.airflow.triggers import LaunchedJobTrigger

    # The local backend recognises its supervisor by "kiln.launchers.local" in the command line.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kiln.launchers.local"],
                               start_new_session=True)
    launch_dir = tmp_path / ".launch"
    launch_dir.mkdir()
    (launch_dir / "job.log").write_text("[node 0] step 10\n[node 1] RuntimeError: boom\n")
    handle = JobHandle(backend="local", job_id=str(sleeper.pid), run_dir=str(tmp_path))
    trigger = LaunchedJobTrigger(handle=handle.to_json(), backend="local", poll_s=0.05)

    async def scenario():
        events = trigger.run()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.5)
        assert not first.done(), "the trigger fired while the job was still running"
        (launch_dir / "status.json").write_text(json.dumps({"state": "FAILED", "reason": "node 1 lost"}))
        event = await asyncio.wait_for(first, timeout=60)
        with pytest.raises(StopAsyncIteration):  # one event, then the trigger is done
            await events.__anext__()
        return event

    try:
        event = asyncio.run(scenario())
    finally:
        sleeper.kill()
        sleeper.wait()
    assert event.payload["state"] == "FAILED" and event.payload["reason"] == "node 1 lost"
    assert event.payload["handle"] == handle.to_json()
    assert "RuntimeError: boom" in event.payload["log_tail"]


# ------------------------------------------------------------- where a deployment runs training
def test_deployment_sets_the_launcher_and_its_options():
    from kiln.policy import SANDBOX

    policy = SANDBOX.with_launcher('{"launcher": "slurm", "slurm_partition": "gpu", "slurm_conf": "/etc/slurm/b.conf"}',
                                   "Airflow Variable kiln_sandbox_launcher")
    assert policy.launcher == "slurm" and policy.pool == SANDBOX.pool
    assert policy.launcher_options() == {"partition": "gpu", "qos": None, "env": {"SLURM_CONF": "/etc/slurm/b.conf"}}
    assert isinstance(get_launcher(policy.launcher, **policy.launcher_options()), SlurmLauncher)
    assert SANDBOX.with_launcher(None, "x") is SANDBOX and SANDBOX.with_launcher("  ", "x") is SANDBOX
    k8s = SANDBOX.with_launcher('{"launcher": "kubernetes"}', "x").launcher_options(shared_root=Path("/shared"))
    assert k8s["queue"] == SANDBOX.k8s_queue and k8s["shared_root"] == "/shared"


@pytest.mark.parametrize("raw,match", [
    ('{"launcher": "slurm", "pool": "kiln_production"}', "may set only .*; not pool"),  # never the pool or gates
    ('{"launcher": "k8s"}', "launcher must be one of local, slurm, kubernetes"),
    ("slurm", "must be a JSON object"),
    ("[1]", "must be a JSON object"),
])
def test_deployment_launcher_setting_refuses_anything_else(raw, match):
    from kiln.errors import PolicyError
    from kiln.policy import SANDBOX

    with pytest.raises(PolicyError, match=match):
        SANDBOX.with_launcher(raw, "Airflow Variable kiln_sandbox_launcher")


def test_trigger_turns_an_exclude_node_flag_into_one_straggler_event(tmp_path):
    """With the policy's exclude_node, a straggler flag the trainer writes while the job runs ends the
    wait with a STRAGGLER event naming the node (the task acts on it); flags before the offset (an
    earlier attempt's) and alert-only policies do not."""
    import asyncio
    import subprocess
    import sys

    from kiln.airflow.triggers import LaunchedJobTrigger

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kiln.launchers.local"],
                               start_new_session=True)
    (tmp_path / ".launch").mkdir()
    metrics = tmp_path / "metrics.jsonl"
    old = json.dumps({"event": "straggler", "step": 15, "rank": 1, "node": "node1", "ratio": 4.0, "message": "old"})
    metrics.write_text(old + "\n")
    handle = JobHandle(backend="local", job_id=str(sleeper.pid), run_dir=str(tmp_path))

    def trigger(action: str) -> LaunchedJobTrigger:
        stragglers = {"action": action, "offset": metrics.stat().st_size, "excluded": []}
        return LaunchedJobTrigger(handle=handle.to_json(), backend="local", poll_s=0.05, stragglers=stragglers)

    async def scenario(t: LaunchedJobTrigger):
        events = t.run()
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.4)
        assert not first.done(), ("an earlier attempt's flag (before the offset) must not fire", first.result().payload)
        with metrics.open("a") as fh:
            fh.write(json.dumps({"event": "straggler", "step": 30, "rank": 1, "node": "node2", "ratio": 5.0,
                                 "message": "straggler: rank 1 on node node2"}) + "\n")
        done, _ = await asyncio.wait([first], timeout=1.0)
        return first.result() if done else (first.cancel(), None)[1]

    try:
        alert_only = asyncio.run(scenario(trigger("alert")))
        metrics.write_text(old + "\n")
        event = asyncio.run(scenario(trigger("exclude_node")))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert alert_only is None, "an alert-only policy keeps waiting for the job"
    assert event is not None
    payload = event.payload
    assert payload["state"] == "STRAGGLER" and payload["node"] == "node2", payload
    assert "exclude node node2" in payload["reason"]
    assert payload["stragglers"]["excluded"] == ["node2"] and payload["stragglers"]["offset"] == metrics.stat().st_size
    assert payload["handle"] == handle.to_json()


def test_excluded_nodes_are_kept_per_run_and_reach_every_later_batch_script(tmp_path):
    from kiln.launchers.slurm import SlurmLauncher, excluded_nodes
    from kiln.runs import SLURM_EXCLUDED_NODES

    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json", recipe=tmp_path / "r.toml",
                      run_key="dag/run", nodes=2)
    assert excluded_nodes(spec.run_dir) == ()
    spec.launch_dir.mkdir(parents=True)
    (spec.launch_dir / SLURM_EXCLUDED_NODES).write_text('["node2"]')
    script = SlurmLauncher(exclude=("node9",)).render(spec)
    assert "#SBATCH --exclude=node9,node2" in script
    (spec.launch_dir / SLURM_EXCLUDED_NODES).write_text('["node2; rm -rf /"]')
    with pytest.raises(LaunchError, match="list of Slurm node names"):
        excluded_nodes(spec.run_dir)


def test_straggler_action_is_a_deployment_setting_and_exclude_node_needs_slurm():
    from kiln.errors import PolicyError
    from kiln.policy import SANDBOX

    moved = SANDBOX.with_launcher('{"launcher": "slurm", "straggler_action": "exclude_node"}', "test")
    assert moved.straggler_action == "exclude_node"
    with pytest.raises(PolicyError, match="needs launcher 'slurm'"):
        SANDBOX.with_launcher('{"straggler_action": "exclude_node"}', "test")


# ------------------------------------------------------------------------------------ a full disk

def test_status_json_reaches_its_final_state_on_a_full_disk(tmpfs):
    folder = tmpfs("64k")
    record_status(folder, {"state": "RUNNING", "reason": "", "supervisor": 1})
    tmpfs.fill(folder)
    reason = "rank 0 exited 2 (trainer fault, not retried): StorageError: x: No space left on device " * 80
    record_status(folder, {"state": "FATAL", "reason": reason, "supervisor": 1})
    status = json.loads((folder / "status.json").read_text())
    assert status["state"] == "FATAL" and status["reason"].startswith("rank 0 exited 2")
    assert sorted(p.name for p in folder.iterdir()) == ["ballast", "status.json"]  # no torn temp file


def test_a_dead_supervisor_on_a_full_disk_is_failed_never_running(tmpfs):
    run_dir = tmpfs("64k")
    (run_dir / ".launch").mkdir()
    (run_dir / ".launch" / "status.json").write_text(json.dumps({"state": "RUNNING", "restarts": 1}))
    tmpfs.fill(run_dir)
    handle = JobHandle(backend="local", job_id=str(2**22 + 12345), run_dir=str(run_dir))
    for _ in range(2):  # and stays so: the next reader sees the same
        status = LocalLauncher().poll(handle)
        assert status.state == "FAILED" and "died without a final status" in status.reason
        assert "has no space left" in status.reason and status.restarts == 1
    assert json.loads((run_dir / ".launch" / "status.json").read_text())["state"] == "FAILED"
    assert sorted(p.name for p in (run_dir / ".launch").iterdir()) == ["status.json"]


def test_a_supervisor_that_dies_is_failed_with_how_it_ended_and_its_last_log_lines(tmp_path, monkeypatch):
    import signal
    import subprocess
    import sys

    from kiln.launchers import local

    (tmp_path / ".launch").mkdir()
    (tmp_path / ".launch" / "status.json").write_text(json.dumps({"state": "RUNNING", "restarts": 0}))
    (tmp_path / ".launch" / "job.log").write_text("[launcher] submit x\n[node 0] step 12 loss 3.1\n")
    # A stand-in supervisor: its cmdline names the module, as the real one's does.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # kiln.launchers.local"])
    monkeypatch.setitem(local._SUPERVISORS, proc.pid, proc)
    handle = JobHandle(backend="local", job_id=str(proc.pid), run_dir=str(tmp_path))
    try:
        assert LocalLauncher().poll(handle).state == "RUNNING"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        status = LocalLauncher().poll(handle)
    finally:
        proc.kill()
        proc.wait()
    assert status.state == "FAILED"
    assert f"supervisor {proc.pid} died without a final status (killed by SIGKILL)" in status.reason
    assert status.reason.endswith("last lines of its log: [launcher] submit x | [node 0] step 12 loss 3.1")


def test_a_fatal_exit_on_a_full_disk_still_leaves_a_marker(tmpfs):
    run_dir = tmpfs("64k")
    (run_dir / ".launch" / "fatal").mkdir(parents=True)
    tmpfs.fill(run_dir)
    write_fatal_marker(run_dir, 1, "StorageError: /x: No space left on device")
    assert fatal_markers(run_dir) == [{"rank": "1", "exit_code": 2, "error": ""}]  # the reason is in the log
    assert sorted(p.name for p in (run_dir / ".launch" / "fatal").iterdir()) == ["rank-1.json"]


# ------------------------------------------------------------------------------------ bad recipes
@pytest.mark.parametrize("overrides, field", [
    (("train.no_such_field=1",), "train.no_such_field"),
    (("model.n_layer=four",), "model.n_layer"),
    (("optim.lr=-1",), "optim.lr"),
    (("train",), "override 'train'"),
])
@pytest.mark.parametrize("backend", ["local", "slurm", "kubernetes"])
def test_a_bad_recipe_is_refused_at_submit_before_anything_starts(tmp_path, overrides, field, backend):
    """Every backend: no sbatch, no TrainJob, no agent for a recipe the trainer would refuse."""
    from kiln.policy import RECIPES_DIR

    launcher = {
        "local": LocalLauncher,
        "slurm": lambda: SlurmLauncher(partition="p"),
        "kubernetes": lambda: get_launcher("kubernetes", namespace="kiln", queue="q", shared_root=tmp_path,
                                           checkpoint_claim="kiln-shared", kubeconfig=str(tmp_path / "no-kubeconfig")),
    }[backend]()

    recipe = RECIPES_DIR / "tiny.toml"
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json", recipe=recipe, run_key="k/r",
                      overrides=overrides)
    with pytest.raises(ConfigError, match=rf"recipe {re.escape(str(recipe))}: .*{re.escape(field)}") as info:
        launcher.submit(spec)
    assert info.value.retryable is False  # the DAG's train stage fails it without retry
    assert not spec.run_dir.exists()


def test_the_dag_train_stage_refuses_a_bad_recipe_without_retry(tmp_path):
    """``submit_train`` is what the DAG's train task calls with the planned spec."""
    from kiln.stages import submit_train

    recipe = tmp_path / "bad.toml"
    recipe.write_text("[train]\nsteps = 'many'\n")
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json", recipe=recipe, run_key="kiln_sandbox/r")
    plan = LaunchPlan(spec=spec, backend="local", mlflow_run_id="x")
    with pytest.raises(ConfigError, match=rf"recipe {re.escape(str(recipe))}: train.steps: expected int") as info:
        submit_train(plan)
    assert info.value.retryable is False
    assert not spec.run_dir.exists()


def test_a_launch_plan_crosses_a_deferral_as_json_and_a_malformed_one_is_named(tmp_path):
    from kiln.errors import LaunchError

    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json", recipe=tmp_path / "r.toml",
                      run_key="kiln_sandbox/r", nodes=2, overrides=("train.steps=5",))
    plan = LaunchPlan(spec=spec, backend="slurm", options={"partition": "gpu"}, mlflow_run_id="abc")
    wire = json.loads(json.dumps(plan.to_json()))
    assert LaunchPlan.from_json(wire) == plan
    moved = plan.with_options(exclude=["node2"])
    assert moved.options == {"partition": "gpu", "exclude": ["node2"]} and plan.options == {"partition": "gpu"}
    for broken in ({}, {"spec": {}, "backend": "slurm"}, {"spec": spec.to_json()}, []):
        with pytest.raises(LaunchError, match="not a launch plan"):
            LaunchPlan.from_json(broken)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- elastic shrink
def test_elastic_agents_rendezvous_min_to_max_and_wait_the_replacement_timeout(tmp_path):
    plain = agent_argv(_spec(tmp_path, nodes=2, max_restarts=1), 0, 29400)
    assert "--nnodes=2" in plain and "--rdzv-conf=is_host=false" in plain  # no elastic policy: as before
    assert agent_argv(_spec(tmp_path, nodes=2, max_restarts=1, min_nodes=2), 0, 29400) == plain  # min = nodes: same
    elastic = agent_argv(_spec(tmp_path, nodes=3, min_nodes=1, replacement_timeout_s=45), 0, 29400)
    assert "--nnodes=1:3" in elastic and "--rdzv-conf=is_host=false,last_call_timeout=45" in elastic
    assert not [a for a in elastic if a.startswith("--nnodes=3")]
    no_wait = agent_argv(_spec(tmp_path, nodes=2, min_nodes=1, replacement_timeout_s=0), 0, 29400)
    assert "--rdzv-conf=is_host=false,last_call_timeout=1" in no_wait  # torch's shortest last call
    assert _spec(tmp_path, nodes=3).least_nodes == 3 and _spec(tmp_path, nodes=3, min_nodes=2).least_nodes == 2


@pytest.mark.parametrize("left,min_nodes,replacement,action", [
    (1, 1, True, "replace"), (1, 2, True, "replace"),  # a replacement always wins
    (1, 1, False, "shrink"), (2, 2, False, "shrink"),
    (1, 2, False, "fail"), (0, 1, False, "fail"),
])
def test_after_a_lost_node_replace_else_shrink_else_fail(left, min_nodes, replacement, action):
    from kiln.launchers.elastic import after_node_loss

    assert after_node_loss(nodes_left=left, min_nodes=min_nodes, replacement=replacement) == action


def _shrink(**kw):
    from kiln.launchers.elastic import Shrink

    return Shrink(**{"backend": "local", "job_id": "7", "lost": "node 0 (agent killed by signal 9)", "from_nodes": 2,
                     "to_nodes": 1, "timeout_s": 30, "no_replacement": "no spare node slot left", "time": 1.0, **kw})


def test_the_kubernetes_launcher_refuses_a_spec_that_may_shrink(tmp_path):
    from kiln.launchers import render_trainjob

    with pytest.raises(ConfigError, match="min_nodes=1: elastic shrink is not available on the kubernetes launcher"):
        render_trainjob(_spec(tmp_path, nodes=2, min_nodes=1), namespace="kiln", queue="q", priority_class=None,
                        shared_root=tmp_path, checkpoint_claim="c")


def test_the_elastic_record_keeps_every_shrink_and_refuses_to_overwrite_a_bad_one(tmp_path):
    from kiln.launchers.elastic import elastic_record_path, record_shrink, recorded_shrinks, shrinks_for_status

    assert recorded_shrinks(tmp_path) == [] and shrinks_for_status(tmp_path) == ()
    record_shrink(tmp_path, _shrink())
    record_shrink(tmp_path, _shrink(job_id="8", from_nodes=1, to_nodes=1))
    assert [s.job_id for s in recorded_shrinks(tmp_path)] == ["7", "8"]
    assert shrinks_for_status(tmp_path)[0] == ("node 0 (agent killed by signal 9) lost, no replacement within 30 s "
                                               "(no spare node slot left): shrunk 2 -> 1 node(s)")
    path = elastic_record_path(tmp_path)
    assert json.loads(path.read_text())[0]["reason"] == shrinks_for_status(tmp_path)[0]
    path.write_text('{"not": "a list"}')
    with pytest.raises(LaunchError, match=re.escape(str(path))):
        recorded_shrinks(tmp_path)
    with pytest.raises(LaunchError, match="not a list of shrinks"):
        record_shrink(tmp_path, _shrink())
    assert path.read_text() == '{"not": "a list"}'  # nothing stored is lost
    assert "not a list of shrinks" in shrinks_for_status(tmp_path)[0]  # a poll names it, never fails on it


def test_a_shrunk_slurm_job_says_so_in_its_log_and_is_the_same_job_without_the_note(tmp_path):
    from kiln.launchers.slurm import same_job

    spec = _spec(tmp_path, nodes=2, min_nodes=1)
    whole = render_sbatch(spec)
    shrunk = render_sbatch(LaunchSpec.from_json({**spec.to_json(), "nodes": 1}), notes=("elastic shrink: 2 -> 1",))
    assert "#SBATCH --nodes=1\n" in shrunk and "--nnodes=1 " in shrunk and "--ntasks=1 " in shrunk
    assert "echo '[launcher] elastic shrink: 2 -> 1'" in shrunk
    # torchrun inside one Slurm job keeps a fixed size: Slurm shrinks by resubmitting.
    assert "--nnodes=2 " in whole and "last_call_timeout" not in whole
    bare = render_sbatch(LaunchSpec.from_json({**spec.to_json(), "nodes": 1}))
    assert same_job(shrunk, bare) and not same_job(whole, bare)


def test_a_retry_reattaches_to_a_shrunk_slurm_job(tmp_path):
    from kiln.launchers.slurm import _as_it_ran
    from kiln.runs import LAUNCH_SPEC

    spec = _spec(tmp_path, nodes=3, min_nodes=2)
    assert _as_it_ran(spec) == spec  # nothing submitted yet
    spec.launch_dir.mkdir(parents=True)
    (spec.launch_dir / LAUNCH_SPEC).write_text(json.dumps({**spec.to_json(), "nodes": 2}))
    assert _as_it_ran(spec).nodes == 2
    (spec.launch_dir / LAUNCH_SPEC).write_text(json.dumps({**spec.to_json(), "nodes": 1}))  # below min_nodes
    assert _as_it_ran(spec) == spec


@pytest.mark.parametrize("raw,match", [
    ('{"min_nodes": 3}', r"min_nodes must be within \[1, nodes=2\]"),
    ('{"min_nodes": 0}', "min_nodes must be within"),
    ('{"min_nodes": "1"}', "min_nodes must be a whole number"),
    ('{"replacement_timeout_s": -1}', "replacement_timeout_s must be >= 0"),
    ('{"replacement_timeout_s": 2.5}', "replacement_timeout_s must be a whole number"),
    ('{"spare_nodes": -1}', "spare_nodes must be >= 0"),
    ('{"launcher": "kubernetes", "min_nodes": 1}', "min_nodes .* needs launcher 'local' or 'slurm'"),
])
def test_the_elastic_policy_names_the_bad_field(raw, match):
    from kiln.errors import PolicyError
    from kiln.policy import PRODUCTION

    with pytest.raises(PolicyError, match=match):
        PRODUCTION.with_launcher(raw, "Airflow Variable kiln_production_launcher")


def test_policies_never_shrink_unless_a_deployment_says_so():
    from kiln.policy import PRODUCTION, SANDBOX

    assert PRODUCTION.min_nodes is None and SANDBOX.min_nodes is None and PRODUCTION.spare_nodes is None
    assert PRODUCTION.replacement_timeout_s == 300 and SANDBOX.replacement_timeout_s == 60
    elastic = PRODUCTION.with_launcher('{"min_nodes": 1, "spare_nodes": 0, "replacement_timeout_s": 120}', "v")
    assert (elastic.min_nodes, elastic.spare_nodes, elastic.replacement_timeout_s) == (1, 0, 120)


def test_the_train_stage_passes_the_elastic_policy_into_the_launch_spec(tmp_path, monkeypatch):
    """prepare_train, through to its LaunchSpec, from the run's own training manifest and a stand-in
    for the MLflow run: min_nodes is the policy's, but never above the run's nodes."""
    from test_stages import _manifest, _snapshot_of

    from kiln import stages
    from kiln.launchers import LaunchPlan
    from kiln.policy import PRODUCTION, SANDBOX

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    monkeypatch.setattr(stages.training, "mlflow_run_of", lambda policy, key, tags: "mlflow-run-1")
    key = "kiln_sandbox/manual__elastic"
    data = _manifest(tmp_path, key=key)
    policy = SANDBOX.with_launcher('{"min_nodes": 1, "spare_nodes": 0, "replacement_timeout_s": 7}', "v")
    plan = stages.prepare_train(policy, _snapshot_of(data), data, {"nodes": 3}, key)
    assert isinstance(plan, LaunchPlan)
    assert (plan.spec.nodes, plan.spec.min_nodes, plan.spec.spare_nodes, plan.spec.replacement_timeout_s) == (3, 1, 0, 7)
    two = PRODUCTION.with_launcher('{"min_nodes": 2}', "v")  # production runs 2 nodes; this run asks 1
    small = stages.prepare_train(two, _snapshot_of(data), data, {"nodes": 1}, key)
    assert isinstance(small, LaunchPlan) and (small.spec.nodes, small.spec.least_nodes) == (1, 1)
    plain = stages.prepare_train(SANDBOX, _snapshot_of(data), data, {"nodes": 2}, key)
    assert isinstance(plain, LaunchPlan) and plain.spec.least_nodes == 2 and plain.spec.spare_nodes is None


def test_a_retry_after_a_shrunk_training_gets_its_result_not_a_mismatch(tmp_path, monkeypatch):
    """A 2-node run that finished on 1 node after an elastic shrink: its retry hands back the result
    (the launcher recorded the shrink). Without that record a 1-rank checkpoint is another run's."""
    from test_stages import _finished_training, _manifest, _snapshot_of

    from kiln import runs, stages
    from kiln.errors import RunMismatchError
    from kiln.launchers.elastic import record_shrink
    from kiln.policy import SANDBOX
    from kiln.refs import TrainResult

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = "kiln_sandbox/manual__shrunk"
    data = _manifest(tmp_path, key=key)
    made = _finished_training(key, data, seed=5, steps=20)  # world size 1
    asked = {"seed": 5, "max_steps": 20, "nodes": 2}
    with pytest.raises(RunMismatchError, match="world_size: made 1, asked 2"):
        stages.prepare_train(SANDBOX, _snapshot_of(data), data, asked, key)
    record_shrink(runs.run_dir(key) / runs.TRAIN_SUBDIR, _shrink())
    done = stages.prepare_train(SANDBOX, _snapshot_of(data), data, asked, key)
    assert isinstance(done, TrainResult) and done.weights_sha256 == made.weights_sha256


def test_the_outcome_tells_an_elastic_shrink_of_the_runs_training(tmp_path, monkeypatch):
    from kiln import runs, stages
    from kiln.launchers.elastic import record_shrink
    from kiln.policy import SANDBOX
    from kiln.refs import Decision, RegisteredCandidate

    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    key = runs.run_key("kiln_sandbox", "manual__shrunk")
    candidate = RegisteredCandidate(model_name="sandbox.kiln-stdlib-lm", version="3",
                                    decision=Decision(action="hold", reasons=["threshold: FAILED 9.1 > 8.0"],
                                                      candidate_bits_per_byte=9.1))
    assert "training" not in stages.outcome_stage(SANDBOX, candidate, None, key).message
    record_shrink(runs.run_dir(key) / runs.TRAIN_SUBDIR, _shrink())
    out = stages.outcome_stage(SANDBOX, candidate, None, key)
    assert out.message.startswith("NOT promoted: the model gate said hold")
    assert out.message.endswith("; training: elastic shrink: node 0 (agent killed by signal 9) lost, no replacement "
                                "within 30 s (no spare node slot left): shrunk 2 -> 1 node(s)")
    summary = json.loads((runs.run_dir(key) / runs.SUMMARY).read_text())
    assert summary["message"] == out.message


@pytest.mark.slow
def test_an_elastic_agents_first_rendezvous_waits_for_every_node_later_ones_for_min_nodes():
    """torch's c10d rendezvous with the agents' patch (``worker._whole_first_gang``), two nodes in a
    fresh interpreter (``rendezvous_two_nodes.py``): min 1, max 2, a last call of 1 s (torch's
    shortest). The first round still needs both nodes; once one of them is gone (its heartbeats stop),
    the other's next round completes alone."""
    import subprocess
    import sys

    script = Path(__file__).with_name("rendezvous_two_nodes.py")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    worlds = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (worlds.get("first"), worlds.get("second")) == (2, 2), f"the first round must wait for every node: {worlds}"
    assert worlds.get("again") == 1, f"a later round goes on with min_nodes: {worlds}"


def test_a_supervisor_just_started_by_another_process_is_alive_and_a_kernel_thread_is_not():
    """``_alive`` reads /proc for a supervisor this process did not start. Right after ``execve`` a
    process' command line reads empty for a moment (a poll there once called a live supervisor dead);
    one that stays empty is no supervisor (pid 2, kthreadd, where this machine shows it)."""
    import subprocess
    import sys

    from kiln.launchers import local

    for _ in range(20):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "kiln.launchers.local"],
                                start_new_session=True)
        try:
            assert local._alive(proc.pid)
        finally:
            proc.kill()
            proc.wait()
        assert not local._alive(proc.pid)
    if Path("/proc/2/comm").is_file() and Path("/proc/2/cmdline").read_bytes() == b"":
        assert not local._alive(2)
