#!/usr/bin/env bash
# Start kiln's MLflow server with basic-auth. The auth app reads its settings from an ini file; the
# user database URI holds a password, so the file is written here, at start, from the environment
# (docker/.env), into the container's home (mode 0600) — never into the image or the repository.
# MLflow reads the admin password from MLFLOW_AUTH_ADMIN_PASSWORD and the session key from
# MLFLOW_FLASK_SERVER_SECRET_KEY itself.
set -euo pipefail

: "${MLFLOW_BACKEND_STORE_URI:?}"
: "${MLFLOW_AUTH_DATABASE_URI:?}"
: "${MLFLOW_ARTIFACTS_DESTINATION:?}"
: "${MLFLOW_AUTH_ADMIN_PASSWORD:?set MLFLOW_ADMIN_PASSWORD in docker/.env}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?set MLFLOW_SECRET_KEY in docker/.env}"

umask 077
export MLFLOW_AUTH_CONFIG_PATH="${HOME}/basic_auth.ini"
cat > "${MLFLOW_AUTH_CONFIG_PATH}" <<INI
[mlflow]
default_permission = ${MLFLOW_AUTH_DEFAULT_PERMISSION:-READ}
database_uri = ${MLFLOW_AUTH_DATABASE_URI}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
# Without a cache every request pays a PBKDF2 check (~0.4 s measured here).
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_SECONDS:-60}
INI

exec mlflow server \
  --host 0.0.0.0 \
  --port 5000 \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI}" \
  --artifacts-destination "${MLFLOW_ARTIFACTS_DESTINATION}" \
  --serve-artifacts \
  --workers "${MLFLOW_WORKERS:-2}" \
  --app-name basic-auth \
  "$@"
