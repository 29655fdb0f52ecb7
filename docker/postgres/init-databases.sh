#!/usr/bin/env bash
# Runs once, when the PostgreSQL volume is empty (docker-entrypoint-initdb.d): one role and
# database for Airflow's metadata, one role for MLflow with its tracking and basic-auth databases.
# Passwords come from the environment (docker/.env), never from this file.
set -euo pipefail

: "${AIRFLOW_DB_PASSWORD:?set AIRFLOW_DB_PASSWORD in docker/.env}"
: "${MLFLOW_DB_PASSWORD:?set MLFLOW_DB_PASSWORD in docker/.env}"

psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER}" --dbname "${POSTGRES_DB}" \
  -v airflow_pw="${AIRFLOW_DB_PASSWORD}" -v mlflow_pw="${MLFLOW_DB_PASSWORD}" <<'SQL'
CREATE ROLE airflow LOGIN PASSWORD :'airflow_pw';
CREATE DATABASE airflow OWNER airflow;
CREATE ROLE mlflow LOGIN PASSWORD :'mlflow_pw';
CREATE DATABASE mlflow OWNER mlflow;
CREATE DATABASE mlflow_auth OWNER mlflow;
SQL
