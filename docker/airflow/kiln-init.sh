#!/usr/bin/env bash
# One-shot setup of the production-like stack (the `airflow-init` service in compose.yaml), safe to
# run again and again:
#   1. migrate the Airflow metadata database (PostgreSQL);
#   2. create kiln's pools (same slots as the embedded stack, kiln.stack.embedded.POOL_SLOTS);
#   3. create kiln's FAB roles and users (kiln.airflow.fab_auth) with the passwords from the environment (.env);
#   4. create the S3 buckets for the DVC remote and MLflow artifacts if they do not exist;
#   5. trust the public half of production's signing key (the compose secret production-signing-public-key):
#      production's private key comes from the deployment (the production worker's secret), and from
#      now on kiln makes none under KILN_HOME. The workers start only once this script exits 0.
set -euo pipefail

PRODUCTION_PUBLIC_KEY=/run/secrets/production-signing-public-key

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
kiln keys trust --policy production "$PRODUCTION_PUBLIC_KEY"
echo "kiln-init: done"
