#!/usr/bin/env bash
# The airflow-init service of docker-compose.yaml: run once before the other components start.
#  1. (root) hand the shared volumes to AIRFLOW_UID (group 0, as the official image expects);
#  2. (AIRFLOW_UID) migrate Airflow's metadata database;
#  3. the admin user of the simple auth manager: its password from _AIRFLOW_WWW_USER_PASSWORD;
#  4. the connections from the environment: deploybench_results (AIRFLOW_CONN_DEPLOYBENCH_RESULTS) must
#     reach the results database, whose schema is migrated here; deploybench_ssh, when set, must parse;
#  5. list the inventories the runs can name.
# Any failure stops the stack before a component starts (they wait for this service to succeed).
set -euo pipefail

if [ "$(id -u)" = 0 ]; then
  uid=${AIRFLOW_UID:-50000}
  mkdir -p /opt/airflow/logs /opt/airflow/auth /var/lib/deploybench
  chown -R "${uid}:0" /opt/airflow/logs /opt/airflow/auth /var/lib/deploybench
  # only AIRFLOW_UID writes the state folder: deploybench refuses run folders below folders others can write
  chmod 0770 /opt/airflow/auth && chmod 0750 /var/lib/deploybench
  if ! getent passwd "${uid}" >/dev/null && [ -w /etc/passwd ]; then
    echo "default:x:${uid}:0:default user:/home/airflow:/sbin/nologin" >> /etc/passwd
  fi
  exec setpriv --reuid="${uid}" --regid=0 --clear-groups env HOME=/home/airflow bash "$0" "$@"
fi
umask 0002

echo "airflow-init: waiting for the metadata database"
for _ in $(seq 1 40); do
  airflow db check >/dev/null 2>&1 && break
  sleep 3
done
airflow db migrate

echo "airflow-init: admin user ${_AIRFLOW_WWW_USER_USERNAME:-admin}"
python - <<'PY'
import json, os
from pathlib import Path
user = os.environ.get("_AIRFLOW_WWW_USER_USERNAME") or "admin"
password = os.environ.get("_AIRFLOW_WWW_USER_PASSWORD") or ""
if len(password) < 8:
    raise SystemExit("airflow-init: _AIRFLOW_WWW_USER_PASSWORD must be set to 8 characters or more in .env")
path = Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"])
tmp = path.with_suffix(".tmp")
tmp.write_text(json.dumps({user: password}) + "\n")
tmp.chmod(0o600)
tmp.replace(path)
PY

echo "airflow-init: connections from the environment"
python - <<'PY'
import os
import subprocess
import sys

from deploybench.airflow.connections import RESULTS_CONN_ID, results_dsn, ssh_overrides
from deploybench.store.db import redact

dsn = results_dsn()
if not dsn:
    raise SystemExit(f"airflow-init: no Airflow connection {RESULTS_CONN_ID!r}; set AIRFLOW_CONN_DEPLOYBENCH_RESULTS")
print(f"airflow-init: {RESULTS_CONN_ID} -> {redact(dsn)}; migrating the results schema", flush=True)
done = subprocess.run([sys.executable, "-m", "deploybench.cli", "store", "migrate"],
                      env={**os.environ, "DEPLOYBENCH_DSN": dsn})
if done.returncode:
    raise SystemExit(f"airflow-init: the results database {redact(dsn)} could not be migrated (exit {done.returncode})")
if os.environ.get("AIRFLOW_CONN_DEPLOYBENCH_SSH"):
    got = ssh_overrides("deploybench_ssh")
    print(f"airflow-init: deploybench_ssh -> user {got['user']!r}, key file {got['key_file']!r}, "
          f"pinned host key {'yes' if got['host_key'] else 'no'}")
else:
    print("airflow-init: deploybench_ssh not set (inventories give their own SSH settings)")
PY

echo "airflow-init: inventory folders ${DEPLOYBENCH_INVENTORIES}:"
for d in ${DEPLOYBENCH_INVENTORIES//:/ }; do ls -1 "$d" 2>/dev/null | sed 's/^/  /' || true; done
echo "airflow-init: done"
