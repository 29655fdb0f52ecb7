"""Strict validation of kiln's Kubernetes objects without an API server.

``kubectl apply --validate=strict`` refuses a field the schema does not know; ``strict_schema`` makes a
structural schema do the same under ``jsonschema`` (``additionalProperties: false`` on every object
that lists its properties and does not preserve unknown fields). The schemas: Kubeflow Trainer's own
API types (``trainer_api_schema``, from the pinned ``kubeflow-trainer-api``) and whole upstream CRDs
(``crd_schema`` of an ``upstream_file``, pinned in docker/k8s/upstream-schemas.json). What jsonschema
cannot evaluate, CEL rules and admission webhooks, is checked by ``validate_trainjob`` and
``runtime_problems`` for the rules kiln's objects can break. docker/k8s/README.md has the details.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.launchers.kubernetes import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    GROUP,
    KIND,
    QUANTITY,
    RESERVED_ENV,
    TRAINER_JOB,
    VERSION,
)
from kiln.util.fs import read_own_json

REPO_ROOT = Path(__file__).resolve().parents[3]
K8S_DIR = REPO_ROOT / "docker" / "k8s"
UPSTREAM_PINS = K8S_DIR / "upstream-schemas.json"
UPSTREAM_ENV = "KILN_UPSTREAM_SCHEMAS"
UPSTREAM_ROOT = REPO_ROOT.parent / "shared" / "vendor"
"""Where CI lays out the pinned upstream files: ``shared/vendor/`` in the folder that holds the checkout."""
_INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
_WRAPPED_SCALARS = {
    "IoK8sApimachineryPkgApiResourceQuantity": {**_INT_OR_STRING, "pattern": QUANTITY.pattern},
    "IoK8sApimachineryPkgUtilIntstrIntOrString": _INT_OR_STRING,
}
"""Types the generated models wrap in a oneOf class; on the wire they are a string or a number."""


def upstream_root() -> Path:
    """The folder the pinned upstream files are looked for in: ``$KILN_UPSTREAM_SCHEMAS`` where set, else
    ``UPSTREAM_ROOT``."""
    return Path(os.environ[UPSTREAM_ENV]) if os.environ.get(UPSTREAM_ENV) else UPSTREAM_ROOT


def upstream_file(name: str) -> Path | None:
    """An upstream file (a whole CRD, the Airflow chart's schema and values) pinned in
    ``docker/k8s/upstream-schemas.json``, under ``upstream_root()`` (docker/k8s/README.md: why these files
    are not in the repository). None when absent; ConfigError when present with other content than its
    pin: another release would validate against the wrong API."""
    pins = read_own_json(UPSTREAM_PINS)
    if name not in pins:
        raise ConfigError(f"{name} is not pinned in {UPSTREAM_PINS}")
    pin = pins[name]
    if not pin.get("sha256"):
        raise ConfigError(f"{UPSTREAM_PINS}: {name} has no sha256; a file is trusted only by its content")
    path = upstream_root() / name
    if not path.is_file():
        return None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != pin["sha256"]:
        raise ConfigError(f"{path} is not {pin['repository']}@{pin['tag']}:{pin['path']} "
                          f"(sha256 {digest}, pinned {pin['sha256']})")
    return path


def strict_schema(schema: Any) -> Any:
    """A structural schema as a JSON Schema that rejects unknown fields, like the API server's strict
    field validation (``kubectl --validate=strict``, ``fieldValidation=Strict``): every object that
    lists its ``properties`` and does not preserve unknown fields gets ``additionalProperties: false``.
    Objects without ``properties`` (label maps, free-form fields) keep whatever they allow."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schema(path: Path, version: str = VERSION) -> dict[str, Any]:
    """The JSON Schema of one version of a CustomResourceDefinition file (strict, see ``strict_schema``)."""
    import yaml

    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    for doc in docs:
        if doc.get("kind") != "CustomResourceDefinition":
            continue
        for v in doc["spec"]["versions"]:
            if v["name"] == version:
                return strict_schema(v["schema"]["openAPIV3Schema"])
    raise ConfigError(f"{path} has no CustomResourceDefinition version {version!r}")


@functools.lru_cache(maxsize=4)
def trainer_api_schema(kind: str = KIND) -> dict[str, Any]:
    """The strict JSON Schema of a Trainer kind from Kubeflow Trainer's own API types (the
    ``kubeflow-trainer-api`` package, pinned by constraints.txt to the Trainer release kiln targets)."""
    try:
        from kubeflow_trainer_api import models
    except ImportError as exc:
        raise ConfigError("validating Trainer objects needs the kubeflow-trainer-api package (requirements.in)") from exc
    model = getattr(models, f"TrainerV1alpha1{kind}", None)
    if model is None:
        raise ConfigError(f"kubeflow-trainer-api has no Trainer kind {kind!r}")
    schema = _without_null_alternatives(model.model_json_schema(by_alias=True))
    for name, definition in schema.get("$defs", {}).items():
        if name in _WRAPPED_SCALARS:
            schema["$defs"][name] = _WRAPPED_SCALARS[name]
        elif "actual_instance" in definition.get("properties", {}):
            raise ConfigError(f"kubeflow-trainer-api wraps {name} in a oneOf model kiln does not know how to read")
    return strict_schema(schema)


def _without_null_alternatives(schema: Any) -> Any:
    """``Optional[X]`` as ``X``: pydantic writes ``anyOf: [X, null]``, under which jsonschema reports
    a wrong nested field as "the whole spec matches no alternative"; an omitted field is optional anyway."""
    if isinstance(schema, list):
        return [_without_null_alternatives(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _without_null_alternatives(v) for k, v in schema.items()}
    alternatives = out.get("anyOf")
    if isinstance(alternatives, list) and len(alternatives) == 2 and {"type": "null"} in alternatives:
        out.pop("anyOf")
        out.pop("default", None)
        (kept,) = [a for a in alternatives if a != {"type": "null"}]
        out.update(kept)
    return out


def schema_problems(obj: Any, schema: dict[str, Any]) -> list[str]:
    """Every place where ``obj`` breaks ``schema``, as ``path: message`` (empty when it validates)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {_short(e)}" for e in errors]


def _short(error: Any) -> str:
    """jsonschema's message, cut: some repeat the whole offending instance (a TrainJob spec is long)."""
    return error.message if len(error.message) < 300 else error.message[:300] + "…"


def validate_trainjob(obj: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """Raise ConfigError naming every field of ``obj`` the TrainJob API rejects.

    Also checks the CRD's two CEL rules on ``metadata.name`` (jsonschema cannot evaluate CEL)."""
    problems = schema_problems(obj, schema or trainer_api_schema(KIND))
    name = str((obj.get("metadata") or {}).get("name", ""))
    if not DNS_LABEL.fullmatch(name):
        problems.append(f"metadata.name: {name!r} must match RFC 1035 DNS label format")
    if len(name) > 63:
        problems.append(f"metadata.name: {name!r} must be no more than 63 characters")
    if problems:
        raise ConfigError(f"TrainJob does not match the {GROUP}/{VERSION} API:\n  " + "\n  ".join(problems))


def runtime_problems(trainjob: dict[str, Any], runtime: dict[str, Any]) -> list[str]:
    """What Trainer's admission webhook checks between a TrainJob and the runtime it names (v2.3,
    ``pkg/runtime/framework/plugins/jobset`` and ``torch``): patched jobs and containers exist in the
    runtime, no env in a patch of the ``node`` container, no reserved ``PET_*`` env, a domain-prefixed
    patch manager."""
    problems = []
    ref = trainjob["spec"]["runtimeRef"]
    if (ref.get("kind"), ref.get("name")) != (runtime.get("kind"), runtime["metadata"]["name"]):
        problems.append(f"spec.runtimeRef names {ref.get('kind')}/{ref.get('name')}, not this runtime")
    containers = {
        job["name"]: {c["name"] for c in job["template"]["spec"]["template"]["spec"].get("containers", [])}
        for job in runtime["spec"]["template"]["spec"]["replicatedJobs"]
    }
    for patch in trainjob["spec"].get("runtimePatches", []):
        manager = str(patch.get("manager", ""))
        domain, _, path = manager.partition("/")
        if not path or not DNS_SUBDOMAIN.fullmatch(domain):
            problems.append(f"runtimePatches[{manager!r}].manager must be a domain-prefixed path (example.com/name)")
        jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs", [])
        for job in jobs:
            if job["name"] not in containers:
                problems.append(f"runtimePatches[{manager!r}]: job {job['name']!r} is not in the runtime")
                continue
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                if container["name"] not in containers[job["name"]]:
                    problems.append(f"runtimePatches[{manager!r}]: container {container['name']!r} is not in job {job['name']!r}")
                elif container["name"] == TRAINER_JOB and container.get("env"):
                    problems.append(
                        f"runtimePatches[{manager!r}]: env of the {TRAINER_JOB!r} container belongs in spec.trainer.env"
                    )
    env = {e["name"] for e in (trainjob["spec"].get("trainer") or {}).get("env", [])}
    if env & set(RESERVED_ENV):
        problems.append(f"spec.trainer.env sets reserved {sorted(env & set(RESERVED_ENV))}")
    return problems
