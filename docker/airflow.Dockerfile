# syntax=docker/dockerfile:1
# kiln's Airflow image: Airflow 3.3.2 + standard and celery providers + kiln's orchestration library,
# with the DAGs and plugins baked in. Two targets:
#   airflow  NO torch: api-server, scheduler, dag-processor, triggerer. GPU training runs in the
#            trainer image (docker/trainer.Dockerfile), on GPU nodes, through a launcher.
#   worker   the same plus torch (CPU wheel, the locked version): the Celery workers, which run the
#            stages that need torch in the task's process tree (evaluate, model export at
#            registration, and training itself with the `local` launcher).
#
# Build from the repository root (the compose file does this):
#   docker build -f docker/airflow.Dockerfile --target airflow -t kiln-airflow:dev .
#   docker build -f docker/airflow.Dockerfile --target worker -t kiln-airflow-worker:dev .
#
# Every Python package is pinned by the repository's constraints.txt (the same lock `make` installs),
# so the image runs the exact versions the test suite ran. No Docker engine runs on the development
# machines: this file is linted (tests/unit/test_docker_files.py, hadolint), not built, there.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE} AS airflow

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DVC_NO_ANALYTICS=1 \
    GIT_PYTHON_REFRESH=quiet

# git: DVC and kiln's lineage (`git rev-parse`, answers "unknown" without a checkout); tini: PID 1
# that reaps the task processes the scheduler, workers and triggerer fork.
RUN apt-get update \
    && apt-get install -y --no-install-recommends git=1:2.39.* tini=0.19.* \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid 50000 airflow \
    && useradd --uid 50000 --gid airflow --create-home --home-dir /home/airflow --shell /bin/bash airflow

COPY constraints.txt /opt/kiln/constraints.txt

# Orchestration dependencies, each pinned by constraints.txt. This list is pyproject.toml's
# `dependencies` WITHOUT torch, plus what the production-like stack needs on top of the embedded one
# (celery provider for the CeleryExecutor over Redis, psycopg2 + asyncpg for the PostgreSQL metadata database,
# the FAB provider for per-DAG permissions), and the `kubernetes` launcher's client and Kubeflow Trainer's
# API types (TrainJobs are validated strictly before they are submitted; docker/helm/ runs on it), and
# `tokenizers` for the tokenize stage (BPE trained and applied on the orchestration side, torch-free),
# and `datatrove` + `datasketch` for the web-text@1 contract's document rules and near-duplicates
# (and `spacy`, whose blank English tokenizer a contract's `"words": "datatrove"` rules use),
# and `transformers` + `safetensors` for the Hugging Face model folder every registered version carries
# (written by the model export on the workers).
# The lock pins torch to a CPU build; torch is filtered out of the constraints here because it is
# never installed in this image.
RUN grep -v '^torch==' /opt/kiln/constraints.txt > /tmp/constraints.txt \
    && python -m pip install --constraint /tmp/constraints.txt \
        "apache-airflow==3.3.2" \
        apache-airflow-providers-standard \
        apache-airflow-providers-celery \
        apache-airflow-providers-fab \
        psycopg2-binary \
        asyncpg \
        "mlflow==3.17.2" \
        "dvc[s3]==3.67.1" \
        "great-expectations==1.24.1" \
        numpy \
        pyarrow \
        boto3 \
        requests \
        "tokenizers==0.23.3" \
        "transformers==5.25.0" \
        "safetensors==0.8.0" \
        "datatrove==0.10.1" \
        "datasketch==2.0.0" \
        "spacy==3.8.18" \
        "model-signing==1.1.1" \
        pyopenssl \
        croniter \
        kubernetes \
        "kubeflow-trainer-api==2.3.0" \
    && rm /tmp/constraints.txt

# kiln itself: its two distributions, `kiln-trainer` (training/, package `kiln_trainer`, of which the
# orchestration side runs the contract, the tokenizer and packer, and the model export) and `kiln`
# (src/, which depends on it). Both list torch as a dependency, so a plain install would pull torch
# (a multi-GB CUDA build). Install them with --no-deps: their orchestration dependencies are the
# explicit list above (tests/unit/test_docker_files.py holds that it covers both). That is safe because kiln never imports torch at module level (a rule of its layout), and tests/unit/test_docker_files.py imports the DAG files and plugins with torch blocked.
# Editable (-e), like `make`: kiln finds data_contracts/, training/recipes/, dags/ relative to the
# repository root (kiln.policy.REPO_ROOT), so the source tree lives at /opt/kiln.
# Stages that need torch (train with the `local` launcher, evaluate, export/register the model)
# run on the Celery workers, built from the `worker` target below.
COPY pyproject.toml README.md /opt/kiln/
COPY src /opt/kiln/src
COPY training /opt/kiln/training
COPY data_contracts /opt/kiln/data_contracts
COPY dags /opt/kiln/dags
COPY plugins /opt/kiln/plugins
RUN python -m pip install --constraint /opt/kiln/constraints.txt --no-deps -e /opt/kiln/training -e /opt/kiln \
    && if python -c "import torch" 2>/dev/null; then echo "torch must not be in the Airflow image" >&2; exit 1; fi \
    && { python -m pip check || true; } \
        | grep -v -e '^kiln .* requires torch, which is not installed' -e '^kiln-trainer .* requires torch, which is not installed' \
            -e '^No broken requirements found' \
        | { if grep .; then echo "pip check found broken requirements (above)" >&2; exit 1; fi; } \
    && python -c "import kiln.stages, kiln.registry, kiln.signals, kiln.data.snapshot, kiln.data.validation"

COPY docker/airflow/kiln-healthcheck.sh /usr/local/bin/kiln-healthcheck
COPY docker/airflow/kiln-init.sh /usr/local/bin/kiln-init
COPY docker/airflow/kiln-mlflow-init.sh /usr/local/bin/kiln-mlflow-init
COPY docker/airflow/entrypoint.sh /entrypoint

ENV AIRFLOW_HOME=/opt/airflow \
    KILN_HOME=/var/lib/kiln \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/kiln/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/kiln/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False

RUN mkdir -p /opt/airflow/logs /var/lib/kiln /var/lib/airflow-auth \
    && chown -R airflow:airflow /opt/airflow /var/lib/kiln /var/lib/airflow-auth \
    && chmod 0755 /usr/local/bin/kiln-healthcheck /usr/local/bin/kiln-init /usr/local/bin/kiln-mlflow-init /entrypoint

# kiln's cluster policy (kiln.stack.prodlike.task_policy): each policy DAG's tasks go to its own Celery
# queue, served by the worker holding only that policy's MLflow identity (compose.yaml). Airflow
# imports `airflow_local_settings` from $AIRFLOW_HOME/config, which it puts on sys.path; the file is
# copied after the chown above so it stays root-owned (a task cannot rewrite the routing).
COPY docker/airflow/airflow_local_settings.py /opt/airflow/config/airflow_local_settings.py

USER 50000:50000
WORKDIR /opt/airflow

EXPOSE 8080

# One check for every component; KILN_AIRFLOW_COMPONENT (set per service in compose.yaml) picks
# what "healthy" means: api-server answers /api/v2/monitor/health, scheduler / dag-processor /
# triggerer have a live job heartbeat, a celery worker answers a ping.
HEALTHCHECK --interval=30s --timeout=20s --start-period=60s --retries=5 CMD ["/usr/local/bin/kiln-healthcheck"]

# /entrypoint dispatches like the official image's (docker/airflow/entrypoint.sh): `scheduler` runs
# `airflow scheduler`, `bash -c ...` runs bash, so the official Helm chart's commands and probes work.
ENTRYPOINT ["/usr/bin/tini", "--", "/entrypoint"]
CMD ["api-server"]


# ------------------------------------------------------------------------------- worker target
# The Celery workers: the image above plus torch. A task's evaluate, its model export and, with the
# `local` launcher, its torchrun agents run in the worker's process tree, so the worker needs torch;
# the other components never do and keep the image above. torch comes from the CPU wheel index (a
# plain PyPI install pulls the multi-GB CUDA build) at the version constraints.txt locks (`+cpu`
# there); GPU training goes through a launcher to nodes that run the trainer image.
FROM airflow AS worker

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

USER 0:0
RUN python -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && python -m pip check \
    && python -c "import torch, kiln_trainer.train, kiln_trainer.evaluate, kiln_trainer.export; print('torch', torch.__version__)"
USER 50000:50000

