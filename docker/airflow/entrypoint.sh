#!/usr/bin/env bash
# Entrypoint of kiln's Airflow image, installed as /entrypoint: the same dispatch as the official
# apache/airflow image's, so one image serves both docker/compose.yaml and the official Airflow Helm
# chart (docker/helm/), whose containers run `bash -c "exec airflow scheduler"`, whose probes run
# `/entrypoint airflow jobs check ...` / `/entrypoint python -c ...`, and whose init containers run
# `airflow db check-migrations`:
#   bash ARGS...    -> bash ARGS...
#   python ARGS...  -> python ARGS...
#   airflow ARGS... -> airflow ARGS...
#   ARGS...         -> airflow ARGS...     (compose: `command: ["scheduler"]`)
set -euo pipefail

case "${1:-}" in
    bash | python)
        exec "$@"
        ;;
    airflow)
        shift
        exec airflow "$@"
        ;;
    *)
        exec airflow "$@"
        ;;
esac
