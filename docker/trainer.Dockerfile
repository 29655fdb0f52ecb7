# syntax=docker/dockerfile:1
# kiln's trainer image: torch + the trainer (the kiln-trainer distribution), NO Airflow. One
# container per node; the entrypoint is torchrun running kiln's worker, `-m kiln.launchers.worker`.
#
# CPU build (default base):
#   docker build -f docker/trainer.Dockerfile -t kiln-trainer:cpu .
# GPU build (CUDA base that already ships torch; the build checks it is the locked version):
#   docker build -f docker/trainer.Dockerfile -t kiln-trainer:cuda \
#     --build-arg BASE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime .
#
# Run (one node, 2 ranks; TORCHRUN_ARGS replaces the torchrun options for multi-node):
#   docker run --rm --init --gpus all -v /shared:/shared kiln-trainer:cuda \
#     --manifest /shared/M.json --recipe training/recipes/small.toml --run-dir /shared/run
#
# No Docker engine runs on the development machines: this file is linted, not built, there.

ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
# Where torch comes from when the base does not ship it: the CPU wheels (a plain PyPI install pulls
# the multi-GB CUDA build). For a CUDA base this is unused: the base's torch is kept.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KILN_HOME=/var/lib/kiln

# kiln requires Python 3.11 (pyproject.toml requires-python); a CUDA base with another Python fails here.
RUN python -c 'import sys; assert sys.version_info[:2] == (3, 11), f"kiln needs Python 3.11, the base has {sys.version}"'

COPY constraints.txt /opt/kiln/constraints.txt

# torch: a base that ships torch (CUDA bases) must ship the locked version, and its build is kept;
# a base without torch gets the CPU wheel. Every other package comes from the trainer distribution's
# own declared dependencies below.
RUN if python -c "import torch" 2>/dev/null; then \
        have="$(python -c 'import torch; print(torch.__version__)')"; \
        if [ "${have%%+*}" != "${TORCH_VERSION}" ]; then \
            echo "the base ships torch ${have}; kiln is locked to ${TORCH_VERSION}: pick a matching BASE" >&2; exit 1; \
        fi; \
        echo "using the base image's torch ${have}"; \
    else \
        python -m pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi

# The trainer: the kiln-trainer distribution (training/pyproject.toml, package kiln_trainer) with the
# dependencies it declares, no list kept here: torch (already satisfied above), numpy, pyarrow,
# tokenizers, and its extras `mlflow` (live metrics to the run's MLflow run) and `s3` (token shards
# behind s3:// URLs). Every version is pinned by the lock; constraints.txt pins torch to the CPU build
# (`+cpu`), so torch is filtered out of the constraints (a CUDA base's torch must stay).
# Editable, like `make`, so the recipes resolve from /opt/kiln/training/recipes.
COPY training /opt/kiln/training
RUN grep -v '^torch==' /opt/kiln/constraints.txt > /tmp/constraints.txt \
    && python -m pip install --constraint /tmp/constraints.txt -e "/opt/kiln/training[mlflow,s3]" \
    && rm /tmp/constraints.txt

# kiln.launchers.worker, the per-rank shim every launcher runs (the trainer the recipe names, and the
# fatal marker a rank's exit 2 leaves), is part of the orchestration distribution `kiln`, whose
# dependencies are Airflow, DVC and GE: install it --no-deps. The worker imports only the standard
# library and kiln_trainer (tests/packaging/test_trainer_wheel.py runs it so); the checks below
# refuse an image where Airflow came in or the worker does not import.
COPY pyproject.toml README.md /opt/kiln/
COPY src /opt/kiln/src
RUN python -m pip install --no-deps -e /opt/kiln \
    && if python -c "import airflow" 2>/dev/null; then echo "airflow must not be in the trainer image" >&2; exit 1; fi \
    && python -c "import torch, kiln_trainer.train, kiln.launchers.worker; print('torch', torch.__version__)"

COPY docker/trainer/entrypoint.sh /usr/local/bin/kiln-trainer

RUN groupadd --gid 1000 kiln \
    && useradd --uid 1000 --gid kiln --create-home --home-dir /home/kiln --shell /bin/bash kiln \
    && mkdir -p /var/lib/kiln \
    && chown kiln:kiln /var/lib/kiln \
    && chmod 0755 /usr/local/bin/kiln-trainer

USER 1000:1000
WORKDIR /opt/kiln

# A batch job, not a service: liveness is torchrun's and the launcher's business (heartbeats,
# checkpoint lag in Prometheus), not a container healthcheck.
HEALTHCHECK NONE

ENTRYPOINT ["/usr/local/bin/kiln-trainer"]
CMD ["--help"]
