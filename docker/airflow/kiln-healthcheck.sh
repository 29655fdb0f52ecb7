#!/usr/bin/env bash
# Healthcheck of kiln's Airflow image: KILN_AIRFLOW_COMPONENT (set per service in compose.yaml)
# says which Airflow component this container runs. Exit 0 = healthy.
set -euo pipefail

case "${KILN_AIRFLOW_COMPONENT:-api-server}" in
  api-server)
    exec python -c 'import sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:8080/api/v2/monitor/health", timeout=10) as r:
    sys.exit(0 if r.status == 200 else 1)'
    ;;
  scheduler)
    exec airflow jobs check --job-type SchedulerJob --hostname "${HOSTNAME}"
    ;;
  dag-processor)
    exec airflow jobs check --job-type DagProcessorJob --hostname "${HOSTNAME}"
    ;;
  triggerer)
    exec airflow jobs check --job-type TriggererJob --hostname "${HOSTNAME}"
    ;;
  celery-worker)
    exec celery --app airflow.providers.celery.executors.celery_executor.app inspect ping \
      --destination "celery@${HOSTNAME}" --timeout 10
    ;;
  signals)
    exec python -c 'import sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:9469/healthz", timeout=5) as r:
    sys.exit(0 if r.status == 200 else 1)'
    ;;
  init)
    exit 0
    ;;
  *)
    echo "kiln-healthcheck: unknown KILN_AIRFLOW_COMPONENT=${KILN_AIRFLOW_COMPONENT}" >&2
    exit 1
    ;;
esac
