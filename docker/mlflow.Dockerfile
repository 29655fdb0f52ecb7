# syntax=docker/dockerfile:1
# The MLflow tracking server of the production-like stack: PostgreSQL backend store, S3 artifacts
# (proxied: clients never need S3 credentials), basic-auth (`--app-name basic-auth`).
# Same mlflow version as kiln's clients, pinned by constraints.txt; `auth` adds Flask-WTF, psycopg2
# talks to PostgreSQL, boto3 to S3.
#
#   docker build -f docker/mlflow.Dockerfile -t kiln-mlflow:dev .
#
# No Docker engine runs on the development machines: this file is linted, not built, there.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false

COPY constraints.txt /tmp/constraints.txt
RUN grep -v '^torch==' /tmp/constraints.txt > /tmp/constraints-notorch.txt \
    && python -m pip install --constraint /tmp/constraints-notorch.txt \
        "mlflow[auth]==3.17.2" \
        psycopg2-binary \
        boto3 \
    && rm /tmp/constraints.txt /tmp/constraints-notorch.txt

COPY docker/mlflow/entrypoint.sh /usr/local/bin/kiln-mlflow

RUN groupadd --gid 1000 mlflow \
    && useradd --uid 1000 --gid mlflow --create-home --home-dir /home/mlflow --shell /bin/bash mlflow \
    && chmod 0755 /usr/local/bin/kiln-mlflow

USER 1000:1000
WORKDIR /home/mlflow

EXPOSE 5000

HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=5 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:5000/health', timeout=5).status == 200 else 1)"]

ENTRYPOINT ["/usr/local/bin/kiln-mlflow"]
