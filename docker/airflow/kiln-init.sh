#!/usr/bin/env bash
# One-shot setup of the production-like stack (the `airflow-init` service in compose.yaml), safe to
# run again and again:
#   1. migrate the Airflow metadata database (PostgreSQL);
#   2. create kiln's pools (same slots as the embedded stack, kiln.stack.embedded.POOL_SLOTS);
#   3. create kiln's FAB roles and users (kiln.airflow.fab_auth) with the passwords from the environment (.env);
#   4. create the S3 buckets for the DVC remote and MLflow artifacts if they do not exist;
#   5. check production's trusted set: the deployment's read-only directory KILN_PRODUCTION_TRUSTED_KEYS_DIR
#      (docker/secrets/production-trusted/) must hold at least one ECDSA P-256 public key and nothing else
#      as *.pem, none of them trusted by sandbox. kiln writes nothing there (nor a deployment-key.json: the
#      variable says production's private key is the deployment's, so no process makes one under
#      KILN_HOME). The workers start only once this script exits 0.
set -euo pipefail

: "${KILN_PRODUCTION_TRUSTED_KEYS_DIR:?the trusted keys of production come from the deployment (compose.yaml)}"

: "${AIRFLOW_ADMIN_PASSWORD:?set AIRFLOW_ADMIN_PASSWORD in docker/.env}"
: "${AIRFLOW_REVIEWER_PASSWORD:?set AIRFLOW_REVIEWER_PASSWORD in docker/.env}"
: "${AIRFLOW_SANDBOX_PASSWORD:?set AIRFLOW_SANDBOX_PASSWORD in docker/.env}"
: "${AIRFLOW_PUBLISHER_PASSWORD:?set AIRFLOW_PUBLISHER_PASSWORD in docker/.env}"

airflow db migrate
airflow pools set kiln_sandbox 2 "kiln sandbox runs"
airflow pools set kiln_production 2 "kiln production runs"

python - <<'PY'
import json, os, subprocess, sys, tempfile

passwords = {
    "admin": os.environ["AIRFLOW_ADMIN_PASSWORD"],
    "reviewer": os.environ["AIRFLOW_REVIEWER_PASSWORD"],
    "demo-reviewer": os.environ["AIRFLOW_REVIEWER_PASSWORD"],
    "sandbox-user": os.environ["AIRFLOW_SANDBOX_PASSWORD"],
    "corpus-publisher": os.environ["AIRFLOW_PUBLISHER_PASSWORD"],
}
# mkstemp creates the file 0600; it never leaves this container and is deleted right after.
fd, tmp = tempfile.mkstemp()
try:
    with os.fdopen(fd, "w") as fh:
        json.dump(passwords, fh)
    subprocess.run([sys.executable, "-m", "kiln.airflow.fab_auth", "provision", tmp], check=True)
finally:
    os.unlink(tmp)
PY

python - <<'PY'
import os

import boto3
from botocore.exceptions import ClientError

s3 = boto3.client("s3", endpoint_url=os.environ["KILN_DVC_REMOTE_ENDPOINT"])
for bucket in (os.environ["KILN_DVC_BUCKET"], os.environ["KILN_MLFLOW_BUCKET"]):
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        s3.create_bucket(Bucket=bucket)
        print(f"kiln-init: created s3://{bucket}")
PY
python - <<'PY'
import json, os, subprocess, sys

# kiln keys list refuses (one error line, exit != 0) a *.pem there that holds no P-256 public key,
# and a key sandbox trusts too.
listed = subprocess.run(["kiln", "keys", "list", "--policy", "production"], stdout=subprocess.PIPE, text=True)
if listed.returncode != 0:
    sys.exit(f"kiln-init: production's trusted set is unusable (kiln keys list exit {listed.returncode})")
entry = json.loads(listed.stdout)[0]
folder = os.environ["KILN_PRODUCTION_TRUSTED_KEYS_DIR"]
if entry.get("trusted_dir") != folder or not entry["trusted"]:
    sys.exit(f"kiln-init: production trusts no key: put the public half of production-signing-key.pem in "
             f"docker/secrets/production-trusted/ (mounted read-only at {folder}; docker/README.md)")
ids = ", ".join(entry["trusted"])
print(f"kiln-init: production trusts {len(entry['trusted'])} key(s), from {folder}: {ids}")
PY
echo "kiln-init: done"
