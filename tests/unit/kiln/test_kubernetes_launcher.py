"""The kubernetes backend without a cluster: the rendered TrainJob validates, strictly, against
Kubeflow Trainer v2.3's own API types (and the upstream CRD where present: a wrong field, or the
v2.1-only ``podTemplateOverrides``, fails it), passes the webhook's checks against kiln's
ClusterTrainingRuntime, Kueue labels and torchrun settings come from the spec, and TrainJob status
conditions map to kiln's states."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.launchers import LaunchSpec, get_launcher
from kiln.launchers.k8s_schema import (
    crd_schema,
    runtime_problems,
    trainer_api_schema,
    upstream_file,
    upstream_root,
    validate_trainjob,
)
from kiln.launchers.kubernetes import (
    PATCH_MANAGER,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    RUNTIME_MANIFEST,
    KubernetesLauncher,
    render_trainjob,
    state_from_trainjob,
    trainjob_name,
)
from kiln.policy import PRODUCTION, SANDBOX

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "training" / "recipes" / "production" / "small.toml"


def upstream_crd(name: str) -> Path:
    path = upstream_file(name)
    if path is None:
        pytest.skip(f"upstream CRD {upstream_root() / name} not found (docker/k8s/README.md); checked against the API types only")
    return path


@pytest.fixture(scope="module")
def schema():
    """Trainer v2.3's API types (kubeflow-trainer-api), strict."""
    return trainer_api_schema("TrainJob")


def _spec(shared: Path, **kw) -> LaunchSpec:
    return LaunchSpec(run_dir=shared / "runs" / "kiln_production" / "scheduled__2026" / "train",
                      manifest=shared / "runs" / "kiln_production" / "scheduled__2026" / "training-manifest.json",
                      recipe=RECIPE, run_key="kiln_production/scheduled__2026-11-30T03:00:00+00:00",
                      nodes=2, nproc_per_node=8, max_restarts=2, overrides=("train.seed=5",),
                      env={"MLFLOW_RUN_ID": "abc"}, **kw)


def _render(tmp_path: Path, **kw):
    options = {"namespace": "ml-prod", "queue": "kiln-production", "priority_class": "kiln-production",
               "shared_root": tmp_path, "checkpoint_claim": "kiln-shared", "image": "registry.local/kiln-trainer:1.0",
               "resources_per_node": {"limits": {"nvidia.com/gpu": "8", "memory": "512Gi"}}}
    options.update(kw)
    return render_trainjob(_spec(tmp_path), **options)


def test_schema_is_the_strict_v2_3_trainjob(schema):
    spec = schema["properties"]["spec"]
    spec = schema["$defs"][spec["$ref"].rsplit("/", 1)[1]] if "$ref" in spec else spec
    assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
    assert spec["additionalProperties"] is False  # strict, like --validate=strict
    assert "runtimePatches" in spec["properties"] and "podTemplateOverrides" not in spec["properties"]


def test_rendered_trainjob_validates_and_carries_policy_and_spec(tmp_path, schema):
    body = _render(tmp_path)
    validate_trainjob(body, schema)
    assert body["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and body["kind"] == "TrainJob"
    labels = body["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == "kiln-production" and labels[PRIORITY_LABEL] == "kiln-production"
    trainer = body["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["command"] == ["python", "-m", "torch.distributed.run"]
    args = trainer["args"]
    assert "--rdzv-backend=c10d" in args and "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in args
    assert "--max-restarts=2" in args and "--nnodes=2" in args and "--nproc-per-node=8" in args
    assert args[args.index("--recipe") + 1] == "/opt/kiln/training/recipes/production/small.toml"
    assert args[args.index("--run-dir") + 1] == str(tmp_path.resolve() / "runs/kiln_production/scheduled__2026/train")
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["MLFLOW_RUN_ID"] == "abc"
    assert env["KILN_HOME"] == str(tmp_path.resolve())
    assert "podTemplateOverrides" not in body["spec"]  # Trainer v2.1 only; v2.2+ refuse it
    (patch,) = body["spec"]["runtimePatches"]
    assert patch["manager"] == PATCH_MANAGER
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == "node"
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "kiln-shared"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == str(tmp_path.resolve())


def test_rendered_trainjob_passes_the_webhook_checks_against_kilns_runtime(tmp_path):
    import yaml

    runtime = yaml.safe_load(RUNTIME_MANIFEST.read_text())
    body = _render(tmp_path)
    assert body["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "kiln-torch"
    assert runtime_problems(body, runtime) == []
    broken = copy.deepcopy(body)
    pod = broken["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod["template"]["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "X", "value": "1"}]
    pod["name"] = "launcher"
    broken["spec"]["runtimePatches"][0]["manager"] = "kiln"
    problems = "\n".join(runtime_problems(broken, runtime))
    assert "job 'launcher' is not in the runtime" in problems and "domain-prefixed" in problems


def test_reserved_torch_env_is_refused(tmp_path):
    spec = dataclasses.replace(_spec(tmp_path), env={"PET_MASTER_ADDR": "elsewhere"})
    with pytest.raises(ConfigError, match="PET_MASTER_ADDR"):
        render_trainjob(spec, namespace="ml", queue="q", priority_class=None, shared_root=tmp_path, checkpoint_claim="c")


def test_rendered_trainjob_validates_against_the_upstream_v2_3_crd(tmp_path):
    """The whole upstream CRD also has the patterns, enums and list limits the API types lack."""
    crd = crd_schema(upstream_crd("kubeflow-trainer/v2.3.0/trainer.kubeflow.org_trainjobs.yaml"))
    body = _render(tmp_path)
    validate_trainjob(body, crd)
    old = copy.deepcopy(body)
    old["spec"]["podTemplateOverrides"] = [{"targetJobs": [{"name": "node"}], "spec": {"volumes": []}}]
    with pytest.raises(ConfigError, match="'podTemplateOverrides' was unexpected"):
        validate_trainjob(old, crd)
    typo = copy.deepcopy(body)
    _patched_pod(typo)["volumes"][0]["pvc"] = {}
    with pytest.raises(ConfigError, match="'pvc' was unexpected"):
        validate_trainjob(typo, crd)


def test_render_is_stable_for_a_run(tmp_path):
    assert _render(tmp_path) == _render(tmp_path)
    name = trainjob_name(_spec(tmp_path))
    assert len(name) <= 63 and name.startswith("kiln-kiln-production-scheduled")


def _patched_pod(body):
    return body["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("mutate,field", [
    # What kiln rendered before Trainer v2.2: the CRD of v2.2 and v2.3 refuses it.
    (lambda b: b["spec"].__setitem__("podTemplateOverrides", [{"targetJobs": [{"name": "node"}]}]), "podTemplateOverrides"),
    (lambda b: b["spec"]["trainer"].__setitem__("numNode", 2), "numNode"),  # a typo'd field
    (lambda b: b["spec"]["trainer"].__setitem__("numNodes", "two"), "numNodes"),  # a wrong type
    (lambda b: b["spec"].pop("runtimeRef"), "runtimeRef"),  # a required field missing
    (lambda b: _patched_pod(b)["volumes"][0].__setitem__("pvc", {}), "pvc"),
    (lambda b: b["spec"]["runtimePatches"][0].pop("manager"), "manager"),
    (lambda b: b["spec"]["trainer"]["resourcesPerNode"]["limits"].__setitem__("cpu", "lots"), "cpu"),
    (lambda b: b["metadata"].__setitem__("name", "Kiln_Run"), "metadata.name"),
])
def test_a_wrong_field_fails_the_schema(tmp_path, schema, mutate, field):
    body = copy.deepcopy(_render(tmp_path))
    mutate(body)
    with pytest.raises(ConfigError, match=field):
        validate_trainjob(body, schema)


def test_status_fixtures_validate_against_the_crd(schema, tmp_path):
    body = _render(tmp_path)
    body["status"] = {"conditions": [_cond("Failed", "NodeFailed", "pod node-1 exited 137")],
                      "jobsStatus": [{"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 1, "suspended": 0}]}
    validate_trainjob(body, schema)


@pytest.mark.parametrize("kw,match", [
    ({"namespace": "ML_Prod"}, "namespace"),
    ({"queue": ""}, "queue"),
    ({"checkpoint_claim": "bad claim"}, "checkpoint claim"),
    ({"resources_per_node": {"limits": {"memory": "lots"}}}, "memory"),
    ({"resources_per_node": {"limit": {"memory": "1Gi"}}}, "limits"),
    ({"image": ""}, "image"),
])
def test_bad_settings_name_the_field(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _render(tmp_path, **kw)


def test_paths_outside_the_shared_volume_are_refused(tmp_path):
    spec = LaunchSpec(run_dir=Path("/elsewhere/run"), manifest=tmp_path / "m.json", recipe=RECIPE, run_key="k/r")
    with pytest.raises(ConfigError, match="run dir /elsewhere/run must lie under the shared volume"):
        render_trainjob(spec, namespace="ml", queue="q", priority_class=None, shared_root=tmp_path, checkpoint_claim="c")


def _cond(kind: str, reason: str, message: str = "", status: str = "True") -> dict:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-11-30T03:00:00Z"}


@pytest.mark.parametrize("status,state,reason", [
    ({}, "PENDING", "not running yet"),
    ({"conditions": [_cond("Suspended", "Suspended")]}, "PENDING", "waiting for Kueue to admit the gang in queue q1"),
    ({"conditions": [_cond("Suspended", "Resumed", status="False")],
      "jobsStatus": [{"name": "node", "active": 2, "ready": 2, "succeeded": 0, "failed": 0, "suspended": 0}]}, "RUNNING", ""),
    ({"conditions": [_cond("Complete", "JobsCompleted", "done")]}, "SUCCEEDED", "done"),
    ({"conditions": [_cond("Failed", "BackoffLimitExceeded", "node-1 exited 1")]}, "FAILED",
     "TrainJob tj failed: BackoffLimitExceeded: node-1 exited 1"),
    # A job preempted by a higher-priority workload is suspended again by Kueue: pending, not failed.
    ({"conditions": [_cond("Suspended", "Preempted")],
      "jobsStatus": [{"name": "node", "active": 0, "ready": 0, "succeeded": 0, "failed": 0, "suspended": 1}]},
     "PENDING", "Preempted"),
])
def test_state_from_trainjob_conditions(status, state, reason):
    got = state_from_trainjob({"metadata": {"name": "tj", "labels": {QUEUE_LABEL: "q1"}}, "status": status})
    assert got.state == state
    assert reason in got.reason


def test_policies_give_production_the_higher_kueue_priority():
    assert PRODUCTION.k8s_priority_class != SANDBOX.k8s_priority_class
    assert PRODUCTION.k8s_queue != SANDBOX.k8s_queue


def test_get_launcher_builds_the_kubernetes_backend(tmp_path):
    launcher = get_launcher("kubernetes", namespace="ml", queue="q", shared_root=tmp_path, checkpoint_claim="c")
    assert isinstance(launcher, KubernetesLauncher)
    with pytest.raises(TypeError):
        get_launcher("kubernetes", namespace="ml")  # queue, shared root and claim are required
