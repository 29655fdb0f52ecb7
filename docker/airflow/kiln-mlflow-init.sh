#!/usr/bin/env bash
# One-shot MLflow identity setup of the production-like stack (the `mlflow-init` service in
# compose.yaml, started once mlflow is healthy), safe to run again and again (it also rotates):
#   1. kiln.mlflow_auth.provision_identities as the admin: users kiln-production and kiln-sandbox,
#      the registered models and experiments each policy writes, and their grants (production
#      names: EDIT for kiln-production only; sandbox names: EDIT for kiln-sandbox) — the same call
#      kiln.prodstack.up and kiln.stack.up make;
#   2. kiln-reader, the api-server's read-only identity: a non-admin user with an explicit READ on
#      each policy's experiment (what the "kiln run" view looks up, whatever default_permission is)
#      and no write grant on any kiln name. (MLflow's basic-auth lets any user create NEW experiments
#      and models; kiln's own names are created by the admin in step 1, so none can be taken over.)
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
import sys

from kiln.mlflow_auth import MIN_PASSWORD_LEN, provision_identities
from kiln.policy import POLICIES
from kiln.registry import experiment_name

env = os.environ
uri, admin, admin_pw = env["MLFLOW_TRACKING_URI"], env["MLFLOW_ADMIN_USERNAME"], env["MLFLOW_ADMIN_PASSWORD"]
grants = provision_identities(
    uri, admin, admin_pw,
    production_user=env["MLFLOW_PRODUCTION_USERNAME"], production_password=env["MLFLOW_PRODUCTION_PASSWORD"],
    sandbox_user=env["MLFLOW_SANDBOX_USERNAME"], sandbox_password=env["MLFLOW_SANDBOX_PASSWORD"],
)
print(f"kiln-mlflow-init: {env['MLFLOW_PRODUCTION_USERNAME']}, {env['MLFLOW_SANDBOX_USERNAME']}: {len(grants)} grants")

reader, reader_pw = env["MLFLOW_READER_USERNAME"], env["MLFLOW_READER_PASSWORD"]
if reader in {admin, env["MLFLOW_PRODUCTION_USERNAME"], env["MLFLOW_SANDBOX_USERNAME"]}:
    sys.exit("kiln-mlflow-init: the reader must be a user of its own, not the admin or a policy identity")
if len(reader_pw) < MIN_PASSWORD_LEN:
    sys.exit(f"kiln-mlflow-init: MLFLOW_READER_PASSWORD must be at least {MIN_PASSWORD_LEN} characters")

# This process alone acts as the admin from here on (mlflow's clients read these variables).
env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"] = admin, admin_pw
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.server import get_app_client

auth = get_app_client("basic-auth", tracking_uri=uri)
try:
    existing = auth.get_user(reader)
except MlflowException as exc:
    if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
        raise
    auth.create_user(reader, reader_pw)
else:
    if existing.is_admin:
        sys.exit(f"kiln-mlflow-init: MLflow user {reader!r} is an admin; it must be read-only")
    auth.update_user_password(reader, reader_pw)

client = MlflowClient(tracking_uri=uri)
for policy in POLICIES.values():
    exp_id = client.get_experiment_by_name(experiment_name(policy)).experiment_id  # created by provision_identities
    try:
        auth.grant_user_permission(reader, "experiment", exp_id, "READ")
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        if auth.get_user_permission(reader, "experiment", exp_id).permission != "READ":
            auth.revoke_user_permission(reader, "experiment", exp_id)
            auth.grant_user_permission(reader, "experiment", exp_id, "READ")
print(f"kiln-mlflow-init: {reader}: READ on {len(POLICIES)} experiments")
PY
echo "kiln-mlflow-init: done"
