"""``kubernetes`` backend: one Kubeflow Trainer v2 ``TrainJob`` per run, admitted as a gang by Kueue.

Why a TrainJob and not a bare JobSet: the TrainJob is what a platform team exposes to its users. It
names a (Cluster)TrainingRuntime that owns the JobSet template (failure policy, pod-level restarts,
the headless service for rendezvous, the torch plugin that injects ``PET_MASTER_ADDR``/``PET_MASTER_PORT``),
and Kueue admits a TrainJob as one workload (all ``numNodes`` pods or none), which is the gang
semantics torchrun needs. Rendering a JobSet would copy the runtime's template into every run.

What ``render_trainjob`` writes (Kubeflow Trainer v2.3 API; checked strictly before submission and in
tests by ``kiln.launchers.k8s_schema``, see ``docker/k8s/README.md``)::

    metadata.labels   kueue.x-k8s.io/queue-name        the policy's LocalQueue (Kueue gang admission)
                      kueue.x-k8s.io/priority-class    the policy's WorkloadPriorityClass (production
                                                       outranks and may preempt sandbox)
    spec.runtimeRef   the ClusterTrainingRuntime (default ``kiln-torch``, docker/k8s/trainer/)
    spec.trainer      image (docker/trainer), numNodes × numProcPerNode, resources per node, env,
                      command = torchrun with c10d rendezvous at $(PET_MASTER_ADDR):$(PET_MASTER_PORT)
                      (the runtime's first node), --max-restarts from the policy, the worker shim
    spec.runtimePatches   one patch owned by ``kiln.dev/kubernetes-launcher``: the shared checkpoint
                      volume (the policy's PVC) mounted on every node at ``shared_root``

Paths: the shared volume is mounted in the pods at the same path as on the Airflow side
(``shared_root``), so run dir, manifest and checkpoints keep their names; recipes in this repository
are mapped to the image's copy (``/opt/kiln``). The handle is ``namespace/name``; state comes from the
TrainJob's ``status.conditions`` (``state_from_trainjob``), logs from the pods of its JobSet, cancel
deletes the TrainJob. No live cluster runs in kiln's tests (docs/launchers.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError, LaunchError
from kiln.launchers.base import (
    JobHandle,
    JobStatus,
    LaunchSpec,
    check_recipe,
    clear_launch_state,
    fatal_markers,
    fatal_reason,
    result_for,
    tail_text,
    torchrun_argv,
)
from kiln.refs import TrainResult
from kiln.runs import CANCELLED_MARK, K8S_LOG, LAUNCH_SUBDIR

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
KIND = "TrainJob"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
RUN_KEY_ANNOTATION = "kiln.dev/run-key"
SPEC_HASH_ANNOTATION = "kiln.dev/spec-sha256"
TRAINER_JOB = "node"
"""The replicated job (and container) of the runtime that runs torchrun (kiln's and Trainer's ``torch-distributed``)."""
CHECKPOINT_VOLUME = "kiln-shared"
IMAGE_REPO_ROOT = "/opt/kiln"
"""Where docker/trainer.Dockerfile puts the repository (recipes under ``training/recipes``)."""
DEFAULT_IMAGE = "kiln-trainer:cpu"
RENDEZVOUS_ENDPOINT = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
"""Expanded by the kubelet from the env the runtime's torch plugin injects: the first node's pod."""
DEFAULT_RUNTIME = "kiln-torch"
"""kiln's ClusterTrainingRuntime (docker/k8s/trainer/cluster-training-runtime.yaml)."""
PATCH_MANAGER = "kiln.dev/kubernetes-launcher"
"""Owner of kiln's entry in ``spec.runtimePatches`` (Trainer wants a domain-prefixed path)."""
RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
"""Set by the runtime's torch plugin; Trainer's webhook refuses a TrainJob whose trainer env names one."""

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"  # the number
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"  # its binary or decimal suffix, or exponent
)
_REPO_ROOT = Path(__file__).resolve().parents[3]
RUNTIME_MANIFEST = _REPO_ROOT / "docker" / "k8s" / "trainer" / "cluster-training-runtime.yaml"
"""kiln's ClusterTrainingRuntime ``kiln-torch``, which the TrainJobs name (``DEFAULT_RUNTIME``)."""


def trainjob_name(spec: LaunchSpec) -> str:
    """A DNS-1035 label (≤ 63 chars) that is stable for the run: readable prefix + hash of the run key."""
    digest = hashlib.sha256(spec.run_key.encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9-]+", "-", spec.run_key.lower()).strip("-")
    stem = re.sub(r"-+", "-", stem)[: 63 - len("kiln--") - len(digest)].strip("-")
    return f"kiln-{stem}-{digest}" if stem else f"kiln-{digest}"


def _check_name(label: str, value: str | None, pattern: re.Pattern[str], *, required: bool = True) -> None:
    if value is None or value == "":
        if required:
            raise ConfigError(f"kubernetes {label} is required")
        return
    too_long = len(value) > (63 if pattern is DNS_LABEL else 253)
    if too_long or not pattern.match(value):
        raise ConfigError(f"kubernetes {label} must be a DNS name ({pattern.pattern}), got {value!r}")


def _pod_path(path: Path, shared_root: Path, image_repo_root: str, what: str, *, repo_ok: bool = False) -> str:
    """The path the pods see: the shared volume is mounted at ``shared_root`` itself; repository files
    (recipes) are the image's copy."""
    path = Path(path).resolve()
    root = Path(shared_root).resolve()
    if path == root or root in path.parents:
        return str(path)
    if repo_ok and _REPO_ROOT in path.parents:
        return str(Path(image_repo_root) / path.relative_to(_REPO_ROOT))
    where = f"under the shared volume's mount {root}" + (f" or in the repository {_REPO_ROOT}" if repo_ok else "")
    raise ConfigError(f"the {what} {path} must lie {where}: the training pods see nothing else")


def runtime_patch(checkpoint_claim: str, shared_root: Path) -> dict[str, Any]:
    """kiln's ``spec.runtimePatches`` entry (Trainer v2.2+): the shared volume on the ``node`` job.

    Only the volume and its mount: Trainer refuses env in a patch of the ``node`` container (env goes
    in ``spec.trainer.env``)."""
    pod_spec = {
        "volumes": [{"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": checkpoint_claim}}],
        "containers": [{
            "name": TRAINER_JOB,
            "volumeMounts": [{"name": CHECKPOINT_VOLUME, "mountPath": str(Path(shared_root).resolve())}],
        }],
    }
    job = {"name": TRAINER_JOB, "template": {"spec": {"template": {"spec": pod_spec}}}}
    return {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [job]}}}}


def render_trainjob(
    spec: LaunchSpec, *, namespace: str, queue: str, priority_class: str | None, shared_root: Path,
    checkpoint_claim: str, runtime: str = DEFAULT_RUNTIME, image: str = DEFAULT_IMAGE,
    resources_per_node: dict[str, dict[str, str]] | None = None, image_repo_root: str = IMAGE_REPO_ROOT,
) -> dict[str, Any]:
    """The TrainJob for ``spec``: JSON-safe dict, ready for ``CustomObjectsApi.create_namespaced_custom_object``."""
    if spec.least_nodes < spec.nodes:
        raise ConfigError(f"min_nodes={spec.least_nodes}: elastic shrink is not available on the kubernetes launcher "
                          f"(a TrainJob's numNodes is fixed when it is created); leave min_nodes unset")
    _check_name("namespace", namespace, DNS_LABEL)
    _check_name("queue (Kueue LocalQueue)", queue, DNS_SUBDOMAIN)
    _check_name("priority class (Kueue WorkloadPriorityClass)", priority_class, DNS_SUBDOMAIN, required=False)
    _check_name("runtime (ClusterTrainingRuntime)", runtime, DNS_SUBDOMAIN)
    _check_name("checkpoint claim (PersistentVolumeClaim)", checkpoint_claim, DNS_SUBDOMAIN)
    if not image or any(c.isspace() for c in image):
        raise ConfigError(f"kubernetes image must be a non-empty image reference, got {image!r}")
    for kind, amounts in (resources_per_node or {}).items():
        if kind not in ("limits", "requests"):
            raise ConfigError(f"resources_per_node keys must be 'limits' or 'requests', got {kind!r}")
        for resource, amount in amounts.items():
            if not QUANTITY.match(str(amount)):
                raise ConfigError(f"resources_per_node.{kind}.{resource} must be a Kubernetes quantity, got {amount!r}")
    reserved = sorted(set(spec.env) & set(RESERVED_ENV))
    if reserved:
        raise ConfigError(f"the training env must not set {', '.join(reserved)}: the runtime's torch plugin sets them")
    pod_spec = replace(
        spec,
        run_dir=Path(_pod_path(spec.run_dir, shared_root, image_repo_root, "run dir")),
        manifest=Path(_pod_path(spec.manifest, shared_root, image_repo_root, "training manifest")),
        recipe=Path(_pod_path(spec.recipe, shared_root, image_repo_root, "recipe", repo_ok=True)),
    )
    argv = torchrun_argv(pod_spec, RENDEZVOUS_ENDPOINT, python="python")
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", "KILN_HOME": str(Path(shared_root).resolve()),
           **spec.env}
    labels = {"app.kubernetes.io/managed-by": "kiln", QUEUE_LABEL: queue}
    if priority_class:
        labels[PRIORITY_LABEL] = priority_class
    trainer: dict[str, Any] = {
        "image": image,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.nproc_per_node,
        "command": argv[:3],  # python -m torch.distributed.run
        "args": argv[3:],
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
    }
    if resources_per_node:
        trainer["resourcesPerNode"] = {k: {r: str(a) for r, a in v.items()} for k, v in resources_per_node.items()}
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": trainjob_name(spec),
            "namespace": namespace,
            "labels": labels,
            "annotations": {RUN_KEY_ANNOTATION: spec.run_key},
        },
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": runtime},
            "trainer": trainer,
            "runtimePatches": [runtime_patch(checkpoint_claim, shared_root)],
        },
    }
    digest = hashlib.sha256(json.dumps(body["spec"], sort_keys=True).encode()).hexdigest()
    body["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = digest
    return body


def _condition(conditions: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    for cond in conditions:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def state_from_trainjob(obj: dict[str, Any]) -> JobStatus:
    """Map a TrainJob's status to kiln's states.

    Complete → SUCCEEDED; Failed → FAILED with the controller's reason and message; Suspended (Kueue
    has not admitted the gang yet, or preempted it) → PENDING; a child job with active pods →
    RUNNING; anything else (no status yet, JobSet being created) → PENDING.
    """
    status = obj.get("status") or {}
    conditions = list(status.get("conditions") or [])
    name = (obj.get("metadata") or {}).get("name", "?")
    if done := _condition(conditions, "Complete"):
        return JobStatus(state="SUCCEEDED", reason=str(done.get("message") or ""))
    if failed := _condition(conditions, "Failed"):
        why = f"TrainJob {name} failed: {failed.get('reason') or 'Failed'}"
        if failed.get("message"):
            why += f": {failed['message']}"
        return JobStatus(state="FAILED", reason=why)
    if suspended := _condition(conditions, "Suspended"):
        queue = ((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "?")
        return JobStatus(state="PENDING", reason=f"suspended ({suspended.get('reason') or 'Suspended'}): "
                                                  f"waiting for Kueue to admit the gang in queue {queue}")
    jobs = list(status.get("jobsStatus") or [])
    if any(int(j.get("active", 0)) > 0 or int(j.get("ready", 0)) > 0 for j in jobs):
        return JobStatus(state="RUNNING")
    return JobStatus(state="PENDING", reason="TrainJob created; pods not running yet")


def _client_error(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


class KubernetesLauncher:
    """The ``kubernetes`` backend (Kubeflow Trainer v2 + Kueue) through the ``kubernetes`` client.

    ``kubeconfig``/``context`` pick the cluster (in a pod: the service account, by default)."""

    name = "kubernetes"

    def __init__(self, *, namespace: str, queue: str, shared_root: Path | str, checkpoint_claim: str,
                 priority_class: str | None = None, runtime: str = DEFAULT_RUNTIME, image: str = DEFAULT_IMAGE,
                 resources_per_node: dict[str, dict[str, str]] | None = None, kubeconfig: str | None = None,
                 context: str | None = None) -> None:
        self.namespace, self.queue, self.priority_class = namespace, queue, priority_class
        self.shared_root, self.checkpoint_claim = Path(shared_root), checkpoint_claim
        self.runtime, self.image, self.resources_per_node = runtime, image, resources_per_node
        self.kubeconfig, self.context = kubeconfig, context
        self._api_client: Any = None

    # ------------------------------------------------------------------------------- rendering
    def render(self, spec: LaunchSpec) -> dict[str, Any]:
        return render_trainjob(spec, namespace=self.namespace, queue=self.queue, priority_class=self.priority_class,
                               shared_root=self.shared_root, checkpoint_claim=self.checkpoint_claim,
                               runtime=self.runtime, image=self.image, resources_per_node=self.resources_per_node)

    # ------------------------------------------------------------------------------ API access
    def _apis(self) -> tuple[Any, Any]:
        try:
            from kubernetes import client, config
        except ImportError as exc:  # pragma: no cover - the lock installs it
            raise LaunchError("the kubernetes launcher needs the `kubernetes` package (see requirements.in)") from exc
        if self._api_client is None:
            try:
                if self.kubeconfig or self.context:
                    self._api_client = config.new_client_from_config(config_file=self.kubeconfig, context=self.context)
                else:
                    try:
                        config.load_incluster_config()
                    except config.ConfigException:
                        config.load_kube_config()
                    self._api_client = client.ApiClient()
            except Exception as exc:
                raise LaunchError(f"no Kubernetes cluster configured (kubeconfig {self.kubeconfig or 'default'}): {exc}") from exc
        return client.CustomObjectsApi(self._api_client), client.CoreV1Api(self._api_client)

    def _split(self, handle: JobHandle) -> tuple[str, str]:
        namespace, _, name = handle.job_id.partition("/")
        if not name:
            raise LaunchError(f"kubernetes job id must be 'namespace/name', got {handle.job_id!r}")
        return namespace, name

    def _get(self, handle: JobHandle) -> dict[str, Any] | None:
        custom, _ = self._apis()
        namespace, name = self._split(handle)
        try:
            return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except Exception as exc:
            if _client_error(exc) == 404:
                return None
            raise LaunchError(f"reading TrainJob {handle.job_id} failed: {exc}") from exc

    # ------------------------------------------------------------------------------- interface
    def submit(self, spec: LaunchSpec) -> JobHandle:
        """Create the TrainJob, or re-attach to this run's TrainJob if it exists with the same spec
        (a retried task must not start a second gang on the same checkpoints)."""
        check_recipe(spec)  # before the TrainJob: no pod is scheduled for a recipe the trainer refuses
        body = self.render(spec)
        if importlib.util.find_spec("kubeflow_trainer_api"):  # the lock and the Airflow image install it
            from kiln.launchers.k8s_schema import validate_trainjob

            validate_trainjob(body)
        name = body["metadata"]["name"]
        handle = JobHandle(backend=self.name, job_id=f"{self.namespace}/{name}", run_dir=str(spec.run_dir))
        existing = self._get(handle)
        if existing is not None:
            same = (existing.get("metadata", {}).get("annotations") or {}).get(SPEC_HASH_ANNOTATION) == \
                body["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
            if same and not state_from_trainjob(existing).done:
                return handle
            self._delete(handle)
        folder = clear_launch_state(spec)
        (folder / CANCELLED_MARK).unlink(missing_ok=True)
        (folder / "trainjob.json").write_text(json.dumps(body, indent=2, sort_keys=True))
        custom, _ = self._apis()
        try:
            custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)
        except Exception as exc:
            raise LaunchError(f"creating TrainJob {handle.job_id} failed: {exc}") from exc
        return handle

    def poll(self, handle: JobHandle) -> JobStatus:
        markers = fatal_markers(handle.run_dir)  # the run dir is on the shared volume
        obj = self._get(handle)
        if markers:
            if obj is not None and not state_from_trainjob(obj).done:
                self._delete(handle)
            return JobStatus(state="FATAL", reason=fatal_reason(markers))
        if obj is None:
            if (Path(handle.run_dir) / LAUNCH_SUBDIR / CANCELLED_MARK).exists():
                return JobStatus(state="CANCELLED", reason=f"TrainJob {handle.job_id} was deleted by kiln")
            return JobStatus(state="FAILED", reason=f"TrainJob {handle.job_id} no longer exists (deleted outside kiln)")
        return state_from_trainjob(obj)

    def _delete(self, handle: JobHandle) -> None:
        custom, _ = self._apis()
        namespace, name = self._split(handle)
        try:
            custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                   propagation_policy="Foreground")
        except Exception as exc:
            if _client_error(exc) != 404:
                raise LaunchError(f"deleting TrainJob {handle.job_id} failed: {exc}") from exc

    def cancel(self, handle: JobHandle) -> None:
        """Delete the TrainJob (its JobSet and pods go with it, foreground)."""
        folder = Path(handle.run_dir) / LAUNCH_SUBDIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CANCELLED_MARK).write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self._delete(handle)

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[str, int]:
        """The pods' logs (JobSet label = TrainJob name), each line prefixed with its pod, mirrored to
        ``RUN/.launch/k8s.log`` so offsets stay valid while pods come and go."""
        _, core = self._apis()
        namespace, name = self._split(handle)
        mirror = Path(handle.run_dir) / LAUNCH_SUBDIR / K8S_LOG
        try:
            pods = core.list_namespaced_pod(namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
            text = ""
            for pod in sorted(pods, key=lambda p: p.metadata.name):
                try:
                    body = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=TRAINER_JOB)
                except Exception:  # not started yet
                    continue
                text += "".join(f"[{pod.metadata.name}] {line}\n" for line in body.splitlines())
            if text:
                mirror.parent.mkdir(parents=True, exist_ok=True)
                mirror.write_text(text)
        except Exception:
            pass  # the mirror keeps what was read before
        try:
            data = mirror.read_bytes()
        except OSError:
            return "", offset
        chunk = data[offset:]
        cut = chunk.rfind(b"\n") + 1
        return chunk[:cut].decode("utf-8", errors="replace"), offset + cut

    def result(self, handle: JobHandle) -> TrainResult:
        status = self.poll(handle)
        text = "" if status.state == "SUCCEEDED" else tail_text(self.logs(handle, 0)[0])
        return result_for(status, handle, text)
