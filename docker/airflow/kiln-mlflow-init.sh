#!/usr/bin/env bash
# One-shot MLflow identity setup of the production-like stack (the `mlflow-init` service in
# compose.yaml, started once mlflow is healthy), safe to run again and again (it also rotates):
#   1. kiln.mlflow_auth.provision_identities as the admin: users kiln-production and kiln-sandbox,
#      the registered models and experiments each policy writes, and their grants (production
#      names: EDIT for kiln-production only; sandbox names: EDIT for kiln-sandbox) — the same call
#      kiln.stack.prodlike.up and kiln.stack.embedded.up make;
#   2. kiln-reader (same call), the api-server's read-only identity: a non-admin user with an
#      explicit READ on each policy's models and experiment (what the "kiln run" view looks up,
#      whatever default_permission is) and no write grant on any kiln name. (MLflow's basic-auth
#      lets any user create NEW experiments and models; kiln's own names are created by the admin
#      in step 1, so none can be taken over.)
# Passwords come from the environment (docker/.env) and are never printed.
set -euo pipefail

: "${MLFLOW_TRACKING_URI:?}"
: "${MLFLOW_ADMIN_USERNAME:?}"
: "${MLFLOW_ADMIN_PASSWORD:?set MLFLOW_ADMIN_PASSWORD in docker/.env}"
: "${MLFLOW_PRODUCTION_USERNAME:?}"
: "${MLFLOW_PRODUCTION_PASSWORD:?set MLFLOW_PRODUCTION_PASSWORD in docker/.env}"
: "${MLFLOW_SANDBOX_USERNAME:?}"
: "${MLFLOW_SANDBOX_PASSWORD:?set MLFLOW_SANDBOX_PASSWORD in docker/.env}"
: "${MLFLOW_READER_USERNAME:?}"
: "${MLFLOW_READER_PASSWORD:?set MLFLOW_READER_PASSWORD in docker/.env}"

python - <<'PY'
import os

from kiln.mlflow_auth import provision_identities

env = os.environ
grants = provision_identities(
    env["MLFLOW_TRACKING_URI"], env["MLFLOW_ADMIN_USERNAME"], env["MLFLOW_ADMIN_PASSWORD"],
    production_user=env["MLFLOW_PRODUCTION_USERNAME"], production_password=env["MLFLOW_PRODUCTION_PASSWORD"],
    sandbox_user=env["MLFLOW_SANDBOX_USERNAME"], sandbox_password=env["MLFLOW_SANDBOX_PASSWORD"],
    reader_user=env["MLFLOW_READER_USERNAME"], reader_password=env["MLFLOW_READER_PASSWORD"],
)
users = sorted({g.username for g in grants})
print(f"kiln-mlflow-init: {', '.join(users)}: {len(grants)} grants")
PY
echo "kiln-mlflow-init: done"
