#!/usr/bin/env bash
# Run once by the postgres image on an empty data folder: deploybench's results database, separate from
# Airflow's metadata database, owned by its own role (password: DEPLOYBENCH_RESULTS_PASSWORD).
set -euo pipefail
: "${DEPLOYBENCH_RESULTS_PASSWORD:?set DEPLOYBENCH_RESULTS_PASSWORD}"
psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER}" --dbname "${POSTGRES_DB}" \
     --set=pw="${DEPLOYBENCH_RESULTS_PASSWORD}" <<'SQL'
CREATE ROLE deploybench LOGIN PASSWORD :'pw';
CREATE DATABASE deploybench OWNER deploybench;
SQL
