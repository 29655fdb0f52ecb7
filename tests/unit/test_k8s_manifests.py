"""docker/k8s/: kiln's ClusterTrainingRuntime and Kueue objects, checked without a cluster.

No Kubernetes API server runs on the development machines. What is checked instead:

* every object validates strictly (an unknown field fails, as under ``kubectl --validate=strict``):
  the ClusterTrainingRuntime against Kubeflow Trainer v2.3's own API types (``kubeflow-trainer-api``)
  and, like the Kueue objects, against the whole upstream CRD, pinned by sha256
  (``kiln.launchers.k8s_schema.upstream_file``; docker/k8s/README.md says why the CRDs are not in the
  repository); the CEL rules of those CRDs that bear on these objects are checked here by hand;
* no kiln object and no TrainJob the launcher renders uses Kueue's ``v1beta1`` (Kueue v0.20 stops
  serving it);
* the launcher's Kueue labels name objects that exist: each policy's LocalQueue in its namespace,
  its ClusterQueue, its WorkloadPriorityClass;
* the properties that keep a production retrain from being starved by sandbox jobs (docs/launchers.md);
* docker/helm/values-kiln.yaml: kiln's topology, and the Airflow chart 1.22.0's values.schema.json and
  values.yaml (a misspelt key fails).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from kiln.errors import ConfigError
from kiln.launchers.base import LaunchSpec
from kiln.launchers.k8s_schema import (
    UPSTREAM_ENV,
    UPSTREAM_PINS,
    crd_schema,
    schema_problems,
    trainer_api_schema,
    upstream_file,
    upstream_root,
)
from kiln.launchers.kubernetes import (
    CHECKPOINT_VOLUME,
    DEFAULT_IMAGE,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    RUNTIME_MANIFEST,
    TRAINER_JOB,
    render_trainjob,
)
from kiln.policy import POLICIES, PRODUCTION, SANDBOX

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
KUEUE = K8S / "kueue"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_DROPPED_VERSIONS = ("v1beta1",)
"""Served by Kueue v0.19, no longer by v0.20."""
KUEUE_CRDS = {
    "ResourceFlavor": "kueue/v0.19.2/kueue.x-k8s.io_resourceflavors.yaml",
    "ClusterQueue": "kueue/v0.19.2/kueue.x-k8s.io_clusterqueues.yaml",
    "LocalQueue": "kueue/v0.19.2/kueue.x-k8s.io_localqueues.yaml",
    "WorkloadPriorityClass": "kueue/v0.19.2/kueue.x-k8s.io_workloadpriorityclasses.yaml",
}
RUNTIME_CRD = "kubeflow-trainer/v2.3.0/trainer.kubeflow.org_clustertrainingruntimes.yaml"


def upstream_or_skip(name: str) -> Path:
    """A pinned upstream file (its sha256 checked), or a skip naming the path looked for."""
    path = upstream_file(name)
    if path is None:
        pytest.skip(f"upstream file {upstream_root() / name} not found (docker/k8s/README.md)")
    return path


def kueue_objects() -> list[dict]:
    return [doc for path in sorted(KUEUE.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict[tuple[str | None, str], dict]:
    return {(o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in kueue_objects() if o["kind"] == kind}


def cel_problems(obj: dict) -> list[str]:
    """The CEL rules of Kueue v0.19's ClusterQueue CRD that a new object can break (jsonschema does
    not evaluate CEL); the rest compare with the old object and matter on update only."""
    if obj["kind"] != "ClusterQueue":
        return []
    spec, problems = obj["spec"], []
    for group in spec.get("resourceGroups", []):
        for flavor in group["flavors"]:
            if len(flavor["resources"]) != len(group["coveredResources"]):
                problems.append(
                    f"flavor {flavor['name']}: flavors must have the same number of resources as the coveredResources"
                )
            if "cohortName" not in spec and any("borrowingLimit" in r for r in flavor["resources"]):
                problems.append(f"flavor {flavor['name']}: borrowingLimit must be nil when cohort is empty")
    preemption = spec.get("preemption", {})
    if preemption.get("reclaimWithinCohort", "Never") == "Never" and \
            preemption.get("borrowWithinCohort", {}).get("policy", "Never") != "Never":
        problems.append("reclaimWithinCohort=Never and borrowWithinCohort.Policy!=Never")
    return problems


# --------------------------------------------------------------------- the ClusterTrainingRuntime
@pytest.fixture(scope="module")
def runtime() -> dict:
    return yaml.safe_load(RUNTIME_MANIFEST.read_text())


def test_runtime_validates_against_trainer_api_types(runtime):
    assert schema_problems(runtime, trainer_api_schema("ClusterTrainingRuntime")) == []


def test_runtime_validates_against_the_upstream_crd(runtime):
    assert schema_problems(runtime, crd_schema(upstream_or_skip(RUNTIME_CRD))) == []


@pytest.mark.parametrize("mutate,field", [
    (lambda r: r["spec"]["mlPolicy"].__setitem__("pytorch", {}), "pytorch"),  # a misspelt policy
    (lambda r: _node_pod(r)["containers"][0].__setitem__("volumeMount", []), "volumeMount"),
    (lambda r: r["spec"]["mlPolicy"].__setitem__("numNodes", "one"), "numNodes"),
])
def test_a_wrong_runtime_field_fails_strict_validation(runtime, mutate, field):
    broken = copy.deepcopy(runtime)
    mutate(broken)
    assert any(field in p for p in schema_problems(broken, trainer_api_schema("ClusterTrainingRuntime")))


def _node_pod(runtime: dict) -> dict:
    (job,) = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == TRAINER_JOB]
    return job["template"]["spec"]["template"]["spec"]


def test_runtime_runs_torchrun_in_the_trainer_image_on_the_shared_volume(runtime):
    assert runtime["metadata"]["name"] == PRODUCTION.k8s_runtime == SANDBOX.k8s_runtime
    assert "torch" in runtime["spec"]["mlPolicy"]  # the torch plugin: PET_* env and the rendezvous service
    pod = _node_pod(runtime)
    (container,) = pod["containers"]
    assert container["name"] == TRAINER_JOB and container["image"] == DEFAULT_IMAGE
    dockerfile = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    assert "USER 1000:1000" in dockerfile and pod["securityContext"]["runAsUser"] == 1000
    assert "KILN_HOME=/var/lib/kiln" in dockerfile
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[CHECKPOINT_VOLUME]["persistentVolumeClaim"]["claimName"] == PRODUCTION.k8s_checkpoint_claim
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[CHECKPOINT_VOLUME] == "/var/lib/kiln"


# ---------------------------------------------------------------------------------------- Kueue
def test_kueue_objects_validate_against_the_upstream_crds():
    schemas = {kind: crd_schema(upstream_or_skip(name), KUEUE_VERSION) for kind, name in KUEUE_CRDS.items()}
    objects = kueue_objects()
    assert {o["kind"] for o in objects} == set(KUEUE_CRDS), f"{KUEUE} should hold one of each kind"
    for obj in objects:
        assert obj["apiVersion"] == f"{KUEUE_GROUP}/{KUEUE_VERSION}"
        assert schema_problems(obj, schemas[obj["kind"]]) + cel_problems(obj) == [], obj["metadata"]["name"]


def test_kilns_kueue_version_is_served_and_stored_by_the_pinned_release():
    for name in KUEUE_CRDS.values():
        crd = yaml.safe_load(upstream_or_skip(name).read_text())
        versions = {v["name"]: v for v in crd["spec"]["versions"]}
        assert versions[KUEUE_VERSION]["served"] and versions[KUEUE_VERSION]["storage"], name


def dropped_kueue_versions(obj: object, where: str = "") -> list[str]:
    """Every place in ``obj`` (an object, or anything nesting objects) whose ``apiVersion`` is a Kueue
    version that Kueue v0.20 no longer serves."""
    if isinstance(obj, list):
        return [p for i, item in enumerate(obj) for p in dropped_kueue_versions(item, f"{where}[{i}]")]
    if not isinstance(obj, dict):
        return []
    found = [f"{where or '<root>'}: {obj['apiVersion']}"] if obj.get("apiVersion") in {
        f"{KUEUE_GROUP}/{v}" for v in KUEUE_DROPPED_VERSIONS} else []
    return found + [p for k, v in obj.items() for p in dropped_kueue_versions(v, f"{where}.{k}" if where else str(k))]


def _rendered_trainjob(policy: str, tmp_path: Path) -> dict:
    p = POLICIES[policy]
    options = p.with_launcher('{"launcher": "kubernetes"}', source="test").launcher_options(tmp_path)
    spec = LaunchSpec(run_dir=tmp_path / "run", manifest=tmp_path / "m.json",
                      recipe=ROOT / "training" / "recipes" / p.default_recipe, run_key=f"{p.dag_id}/r1")
    return render_trainjob(spec, **{k: v for k, v in options.items() if k != "shared_root"}, shared_root=tmp_path)


def test_no_kiln_object_uses_a_kueue_version_that_v0_20_drops(tmp_path):
    manifests = sorted(K8S.rglob("*.yaml")) + sorted((ROOT / "docker" / "helm").rglob("*.yaml"))
    found = [f"{path.relative_to(ROOT)} {p}" for path in manifests
             for doc in yaml.safe_load_all(path.read_text()) for p in dropped_kueue_versions(doc)]
    found += [f"{policy}'s TrainJob {p}" for policy in sorted(POLICIES)
              for p in dropped_kueue_versions(_rendered_trainjob(policy, tmp_path))]
    # The launcher's own code, should it ever call Kueue's API or write a Kueue object itself.
    found += [str(path.relative_to(ROOT)) for path in sorted((ROOT / "src" / "kiln").rglob("*.py"))
              if any(f"{KUEUE_GROUP}/{v}" in path.read_text() for v in KUEUE_DROPPED_VERSIONS)]
    assert found == []


def test_a_kueue_v1beta1_object_is_found(tmp_path):
    queue = copy.deepcopy(by_kind("ClusterQueue")[(None, "kiln-production")])
    assert dropped_kueue_versions(queue) == []
    queue["apiVersion"] = f"{KUEUE_GROUP}/v1beta1"
    assert dropped_kueue_versions(queue) == [f"<root>: {KUEUE_GROUP}/v1beta1"]
    trainjob = _rendered_trainjob("production", tmp_path)
    trainjob["metadata"]["ownerReferences"] = [{"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload", "name": "w",
                                                "uid": "u"}]
    assert dropped_kueue_versions(trainjob) == [f"metadata.ownerReferences[0]: {KUEUE_GROUP}/v1beta1"]


def test_a_wrong_kueue_field_fails_strict_validation():
    schema = crd_schema(upstream_or_skip(KUEUE_CRDS["ClusterQueue"]), KUEUE_VERSION)
    for mutate, problem in (
        (lambda q: q["spec"].__setitem__("cohort", q["spec"].pop("cohortName")), "'cohort' was unexpected"),  # v1beta1's name
        (lambda q: q["spec"]["preemption"].__setitem__("reclaimWithInCohort", "Any"), "'reclaimWithInCohort' was unexpected"),
        (lambda q: q["spec"]["preemption"].__setitem__("reclaimWithinCohort", "Always"), "'Always' is not one of"),
    ):
        queue = copy.deepcopy(by_kind("ClusterQueue")[(None, "kiln-production")])
        mutate(queue)
        problems = schema_problems(queue, schema)
        assert any(problem in p for p in problems), (problem, problems)


def test_cel_rules_catch_a_flavor_without_every_covered_resource():
    queue = copy.deepcopy(by_kind("ClusterQueue")[(None, "kiln-sandbox")])
    queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop()
    queue["spec"].pop("cohortName")
    problems = "\n".join(cel_problems(queue))
    assert "same number of resources" in problems and "borrowingLimit must be nil" in problems


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_launcher_kueue_labels_name_existing_objects(policy, tmp_path):
    """What the launcher writes on a policy's TrainJob is a LocalQueue in that namespace, feeding a
    ClusterQueue, and a WorkloadPriorityClass, all shipped in docker/k8s/kueue/."""
    body = _rendered_trainjob(policy, tmp_path)
    labels, namespace = body["metadata"]["labels"], body["metadata"]["namespace"]
    local_queues, cluster_queues = by_kind("LocalQueue"), by_kind("ClusterQueue")
    assert (namespace, labels[QUEUE_LABEL]) in local_queues, f"no LocalQueue {labels[QUEUE_LABEL]} in {namespace}"
    target = local_queues[(namespace, labels[QUEUE_LABEL])]["spec"]["clusterQueue"]
    assert (None, target) in cluster_queues
    assert (None, labels[PRIORITY_LABEL]) in by_kind("WorkloadPriorityClass")
    # The namespace reaches the ClusterQueue (its namespaceSelector).
    ns = yaml.safe_load((K8S / "namespace.yaml").read_text())
    assert ns["metadata"]["name"] == namespace
    selector = cluster_queues[(None, target)]["spec"]["namespaceSelector"]["matchLabels"]
    assert selector.items() <= ns["metadata"]["labels"].items()


def test_production_cannot_be_starved_by_sandbox():
    queues = {name: q["spec"] for (_, name), q in by_kind("ClusterQueue").items()}
    priority = {name: c["value"] for (_, name), c in by_kind("WorkloadPriorityClass").items()}
    prod, sand = queues[PRODUCTION.k8s_queue], queues[SANDBOX.k8s_queue]
    assert prod["cohortName"] == sand["cohortName"], "one cohort: sandbox borrows production's idle quota"
    # Production owns nominal quota and takes it back from any borrower, whatever its priority.
    assert all(r["nominalQuota"] not in (0, "0") for g in prod["resourceGroups"] for f in g["flavors"] for r in f["resources"])
    assert prod["preemption"]["reclaimWithinCohort"] == "Any"
    # ... and, when it must borrow itself, preempts sandbox workloads only (threshold = sandbox's value).
    assert prod["preemption"]["borrowWithinCohort"] == {"policy": "LowerPriority",
                                                        "maxPriorityThreshold": priority[SANDBOX.k8s_priority_class]}
    assert priority[PRODUCTION.k8s_priority_class] > priority[SANDBOX.k8s_priority_class]
    # Sandbox borrows idle capacity but can never reclaim from production (higher priority).
    assert any("borrowingLimit" in r for g in sand["resourceGroups"] for f in g["flavors"] for r in f["resources"])
    assert sand["preemption"]["reclaimWithinCohort"] in ("Never", "LowerPriority")
    assert "borrowWithinCohort" not in sand["preemption"]
    flavors = {name for (_, name) in by_kind("ResourceFlavor")}
    assert {f["name"] for q in (prod, sand) for g in q["resourceGroups"] for f in g["flavors"]} <= flavors


def test_upstream_file_refuses_another_release(tmp_path, monkeypatch):
    """A CRD of another release under the pinned name would validate against the wrong API."""
    name = KUEUE_CRDS["ClusterQueue"]
    (tmp_path / name).parent.mkdir(parents=True)
    (tmp_path / name).write_text("kind: CustomResourceDefinition\n")
    monkeypatch.setenv(UPSTREAM_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="is not kubernetes-sigs/kueue@v0.19.2"):
        upstream_file(name)
    (tmp_path / name).unlink()
    assert upstream_file(name) is None


def test_a_missing_upstream_file_skips_naming_the_path_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv(UPSTREAM_ENV, str(tmp_path / "absent"))
    with pytest.raises(pytest.skip.Exception, match=re.escape(str(tmp_path / "absent" / RUNTIME_CRD))):
        upstream_or_skip(RUNTIME_CRD)


def test_upstream_file_refuses_a_pin_without_sha256(tmp_path, monkeypatch):
    import kiln.launchers.k8s_schema as k8s_schema

    pins = json.loads(UPSTREAM_PINS.read_text())
    pins[RUNTIME_CRD]["sha256"] = None
    (tmp_path / "pins.json").write_text(json.dumps(pins))
    monkeypatch.setattr(k8s_schema, "UPSTREAM_PINS", tmp_path / "pins.json")
    with pytest.raises(ConfigError, match="has no sha256"):
        upstream_file(RUNTIME_CRD)


def test_every_pinned_upstream_file_is_there_with_its_content():
    """Where the upstream folder is laid out, every pin of docker/k8s/upstream-schemas.json is in it,
    byte for byte (upstream_file checks the sha256)."""
    for name in json.loads(UPSTREAM_PINS.read_text()):
        assert upstream_or_skip(name).is_file()


# ------------------------------------------------------------------------ the Airflow Helm chart
HELM_VALUES = ROOT / "docker" / "helm" / "values-kiln.yaml"
HELM_SCHEMA = "airflow-helm-chart/values.schema.json"
HELM_DEFAULTS = "airflow-helm-chart/values.yaml"
HELM_CHART = "airflow-helm-chart/Chart.yaml"


@pytest.fixture(scope="module")
def helm_values() -> dict:
    return yaml.safe_load(HELM_VALUES.read_text())


def _env(entries: list[dict]) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in entries}


def _secret_ref(value: object) -> tuple[str, str]:
    assert isinstance(value, dict), f"{value!r} is not taken from a Secret"
    return value["secretKeyRef"]["name"], value["secretKeyRef"]["key"]


def test_helm_values_run_kilns_image_and_airflow_version(helm_values):
    from importlib.metadata import version

    # The chart deploys the Airflow release named by airflowVersion and defaultAirflowTag.
    assert helm_values["airflowVersion"] == helm_values["defaultAirflowTag"] == version("apache-airflow") == "3.3.2"
    assert helm_values["executor"] == "CeleryExecutor"
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    worker_image = compose["services"]["airflow-worker-production"]["image"]  # the `worker` target
    repository, tag = worker_image.split(":")
    # ... in kiln's image, for every component: the default image (the official one) lacks kiln.
    assert helm_values["images"]["airflow"] == {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"}
    assert helm_values["images"]["useDefaultImageForMigration"] is False
    dockerfile = (ROOT / "docker" / "airflow.Dockerfile").read_text()
    assert f"USER {helm_values['uid']}:{helm_values['gid']}" in dockerfile
    # The chart's containers run `bash -c "exec airflow ..."` and probe through /entrypoint.
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/entrypoint"]' in dockerfile
    assert "COPY docker/airflow/entrypoint.sh /entrypoint" in dockerfile


def test_helm_values_bundle_the_image_dags_and_route_like_the_cluster_policy(helm_values):
    dockerfile = (ROOT / "docker" / "airflow.Dockerfile").read_text()
    assert "AIRFLOW__CORE__DAGS_FOLDER=/opt/kiln/dags" in dockerfile and "COPY dags /opt/kiln/dags" in dockerfile
    assert helm_values["config"]["core"]["dags_folder"] == "/opt/kiln/dags"
    (bundle,) = helm_values["dagProcessor"]["dagBundleConfigList"]
    assert bundle["classpath"] == "airflow.dag_processing.bundles.local.LocalDagBundle"
    assert bundle["kwargs"]["path"] == "/opt/kiln/dags"
    assert not helm_values["dags"]["gitSync"]["enabled"] and not helm_values["dags"]["persistence"]["enabled"]
    namespace: dict = {}
    exec(helm_values["airflowLocalSettings"], namespace)  # what the chart mounts as airflow_local_settings.py
    from kiln.cluster_policy import task_policy

    assert namespace["task_policy"] is task_policy


def worker_set_problems(values: dict) -> list[str]:
    """Where the chart values break kiln's worker topology: one set per policy queue (kiln.stack.prodlike),
    each holding exactly its own policy's MLflow identity, nothing shared holding one."""
    from types import SimpleNamespace

    from kiln.mlflow_auth import identity_env_names
    from kiln.stack.prodlike import QUEUES, WORKER_CONCURRENCY, task_policy

    problems = []
    celery = values["workers"]["celery"]
    if celery.get("enableDefault", True):
        problems.append("workers.celery.enableDefault: a default worker would serve queues with no policy's identity")
    sets = {s["name"]: s for s in celery.get("sets", [])}
    if set(sets) != set(POLICIES) or set(POLICIES) != set(WORKER_CONCURRENCY):
        return [*problems, f"worker sets {sorted(sets)}, policies {sorted(POLICIES)}"]
    for name, p in POLICIES.items():
        worker = sets[name]
        queues = [QUEUES[p.dag_id]] + (["default"] if name == "sandbox" else [])
        if worker["queue"] != ",".join(queues):
            problems.append(f"set {name}: queue {worker['queue']!r}, kiln.stack.prodlike serves {queues}")
        expected_args = ["bash", "-c", f"exec airflow celery worker --queues {','.join(queues)} "
                                       f"--concurrency {WORKER_CONCURRENCY[name]}"]
        if worker.get("args") != expected_args:
            problems.append(f"set {name}: args {worker.get('args')} (kiln.stack.prodlike runs {expected_args})")
        task = SimpleNamespace(dag_id=p.dag_id, queue="default")
        task_policy(task)
        if task.queue not in queues:
            problems.append(f"{p.dag_id} is routed to {task.queue}, which set {name} does not serve")
        env = _env(worker.get("env", []))
        secret = f"kiln-mlflow-{name}"
        for var, key in zip((*identity_env_names(p), "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"),
                            ("username", "password") * 2, strict=True):
            if not isinstance(env.get(var), dict) or _secret_ref(env[var]) != (secret, key):
                problems.append(f"set {name}: {var} must come from Secret {secret} key {key}")
        for other in set(POLICIES) - {name}:
            if f"kiln-mlflow-{other}" in str(worker) or f"KILN_MLFLOW_{other.upper()}" in str(worker):
                problems.append(f"set {name} holds the {other} identity")
    shared = str(values.get("env")) + str(values.get("secret"))
    if "MLFLOW_TRACKING_PASSWORD" in shared or "kiln-mlflow" in shared or "ADMIN" in shared:
        problems.append("an MLflow identity is in the env every component gets")
    api = _env(values["apiServer"]["env"])
    if set(api) != {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} or \
            {_secret_ref(v)[0] for v in api.values()} != {"kiln-mlflow-reader"}:
        problems.append("the api-server must hold the read-only kiln-reader identity and nothing else")
    return problems


def test_helm_worker_sets_serve_each_policy_queue_with_only_its_identity(helm_values):
    assert worker_set_problems(helm_values) == []


@pytest.mark.parametrize("mutate,problem", [
    (lambda v: v["workers"]["celery"]["sets"][0]["env"].append(
        {"name": "KILN_MLFLOW_SANDBOX_PASSWORD",
         "valueFrom": {"secretKeyRef": {"name": "kiln-mlflow-sandbox", "key": "password"}}}),
     "set production holds the sandbox identity"),
    (lambda v: v["workers"]["celery"].__setitem__("enableDefault", True), "enableDefault"),
    (lambda v: v["workers"]["celery"]["sets"][1].__setitem__("queue", "kiln-sandbox,kiln-production"), "set sandbox: queue"),
    (lambda v: v["env"].append({"name": "MLFLOW_TRACKING_PASSWORD", "value": "x"}), "every component"),
])
def test_a_worker_topology_break_is_found(helm_values, mutate, problem):
    values = copy.deepcopy(helm_values)
    mutate(values)
    assert any(problem in p for p in worker_set_problems(values)), worker_set_problems(values)


def test_helm_values_create_kilns_pools_and_run_training_on_kubernetes(helm_values):
    from kiln.stack.embedded import POOL_SLOTS

    script = " ".join(helm_values["migrateDatabaseJob"]["args"])
    assert script.startswith("bash -c airflow db migrate")
    for pool, slots in POOL_SLOTS.items():
        assert f"airflow pools set {pool} {slots} " in script
    env = _env(helm_values["env"])
    for name, p in POLICIES.items():
        raw = env[f"AIRFLOW_VAR_KILN_{name.upper()}_LAUNCHER"]
        assert p.with_launcher(raw, source="helm values").launcher == "kubernetes"
    # ... which the image can run: the kubernetes client and Trainer's API types are installed.
    installs = (ROOT / "docker" / "airflow.Dockerfile").read_text().split("FROM airflow AS worker")[0]
    assert re.search(r"^\s+kubernetes \\$", installs, re.M) and '"kubeflow-trainer-api==2.3.0"' in installs
    assert env["KILN_HOME"] == "/var/lib/kiln"
    (volume,) = helm_values["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == PRODUCTION.k8s_checkpoint_claim
    assert helm_values["volumeMounts"] == [{"name": volume["name"], "mountPath": env["KILN_HOME"]}]
    # Every credential comes from a Secret: no literal password, key or connection string.
    for key in env:
        assert not re.search(r"PASSWORD|SECRET|TOKEN|KEY", key), f"{key} has a literal value in the values file"
    assert "://" not in json.dumps(helm_values["data"]), "connection strings belong in the Secrets"
    assert helm_values["createUserJob"]["enabled"] is False, "the chart's default user is admin/admin"


def test_rbac_grants_what_the_launcher_calls(helm_values):
    role, binding = [d for d in yaml.safe_load_all((K8S / "rbac.yaml").read_text()) if d]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "get", "delete"} <= rules[("trainer.kubeflow.org", "trainjobs")]
    assert {"list"} <= rules[("", "pods")] and {"get"} <= rules[("", "pods/log")]
    assert role["metadata"]["namespace"] == PRODUCTION.k8s_namespace == SANDBOX.k8s_namespace
    accounts = {s["name"] for s in binding["subjects"]}
    assert accounts == {helm_values["workers"]["serviceAccount"]["name"], helm_values["triggerer"]["serviceAccount"]["name"]}


@pytest.mark.parametrize("argv,expected", [
    (["scheduler"], "airflow scheduler"),                                  # compose: command: ["scheduler"]
    (["celery", "worker", "--queues", "q"], "airflow celery worker --queues q"),
    (["airflow", "db", "check-migrations"], "airflow db check-migrations"),  # the chart's init containers
    (["bash", "-c", "exec airflow api-server"], "airflow api-server"),       # the chart's containers
    (["python", "-c", "print('python ran')"], "python ran"),                 # the chart's worker probe
])
def test_image_entrypoint_dispatches_like_the_official_images(tmp_path, argv, expected):
    import os
    import subprocess
    import sys

    fake = tmp_path / "airflow"
    fake.write_text('#!/usr/bin/env bash\necho "airflow $*"\n')
    fake.chmod(0o755)
    (tmp_path / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = subprocess.run(["bash", str(ROOT / "docker" / "airflow" / "entrypoint.sh"), *argv], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def unknown_chart_keys(values: dict, chart_defaults: dict) -> list[str]:
    """The keys of ``values``, top-level and one below, that the chart's own values.yaml does not have.
    The chart's schema refuses unknown keys in most nested sections but not at the top level, where a
    misspelt key would be silently ignored; below the second level are free-form maps (Airflow config
    options, env lists) that values.yaml does not list."""
    unknown = []
    for key, value in values.items():
        if key not in chart_defaults:
            unknown.append(key)
        elif isinstance(value, dict) and isinstance(chart_defaults[key], dict):
            unknown += [f"{key}.{sub}" for sub in value if sub not in chart_defaults[key]]
        elif isinstance(value, dict):
            unknown.append(f"{key} (a section here, {type(chart_defaults[key]).__name__} in the chart)")
    return unknown


@pytest.fixture(scope="module")
def helm_chart() -> dict:
    """Chart 1.22.0's schema and default values, each checked against its pin."""
    chart = yaml.safe_load(upstream_or_skip(HELM_CHART).read_text())
    assert json.loads(UPSTREAM_PINS.read_text())[HELM_CHART]["tag"] == f"helm-chart/{chart['version']}"
    assert chart["name"] == "airflow"
    return {"schema": json.loads(upstream_or_skip(HELM_SCHEMA).read_text()),
            "defaults": yaml.safe_load(upstream_or_skip(HELM_DEFAULTS).read_text())}


def test_helm_values_validate_against_the_charts_values_schema(helm_values, helm_chart):
    assert schema_problems(helm_values, helm_chart["schema"]) == []


def test_helm_values_keys_exist_in_the_charts_values(helm_values, helm_chart):
    assert unknown_chart_keys(helm_values, helm_chart["defaults"]) == []


@pytest.mark.parametrize("mutate,key,schema_catches", [
    (lambda v: v.__setitem__("dagProccessor", v.pop("dagProcessor")), "dagProccessor", False),
    (lambda v: v["workers"].__setitem__("celerey", v["workers"].pop("celery")), "workers.celerey", True),
    (lambda v: v["config"].__setitem__("dag_procesor", v["config"].pop("dag_processor")), "config.dag_procesor", False),
    (lambda v: v.__setitem__("secret", {"envName": "X"}), "secret (a section here, list in the chart)", True),
])
def test_a_misspelt_helm_key_is_found(helm_values, helm_chart, mutate, key, schema_catches):
    """Caught by the key check whether or not the chart's schema refuses it (it does not at the top
    level, nor inside `config`, whose sections are open maps)."""
    values = copy.deepcopy(helm_values)
    mutate(values)
    assert unknown_chart_keys(values, helm_chart["defaults"]) == [key]
    assert bool(schema_problems(values, helm_chart["schema"])) is schema_catches


@pytest.mark.parametrize("mutate,problem", [
    (lambda v: v.__setitem__("airflowVersion", 3.3), "airflowVersion: 3.3 is not of type 'string'"),
    (lambda v: v["workers"]["celery"].__setitem__("enableDefault", "no"), "workers.celery.enableDefault: 'no' is not of type"),
    (lambda v: v["dagProcessor"].__setitem__("dagBundleConfigLists", []), "'dagBundleConfigLists' was unexpected"),
])
def test_a_wrong_helm_value_fails_the_charts_schema(helm_values, helm_chart, mutate, problem):
    values = copy.deepcopy(helm_values)
    mutate(values)
    problems = schema_problems(values, helm_chart["schema"])
    assert any(problem in p for p in problems), problems
