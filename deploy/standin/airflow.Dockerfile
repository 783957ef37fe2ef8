# A local stand-in for apache/airflow:3.3.2-python3.11, for machines that reach no container registry
# (deploy/compose_check.py builds it; nothing else should). It reproduces what deploybench's Dockerfile
# and docker-compose.yaml rely on in the official image:
#   - Debian bookworm, Python 3.11, Airflow installed in a virtual environment at /home/airflow/.local
#     whose bin/ is first on PATH (so `airflow`, `python` and `pip` are Airflow's);
#   - user `airflow`, uid 50000, primary group root (gid 0), home /home/airflow; AIRFLOW_HOME=/opt/airflow,
#     the working directory, group-writable; /etc/passwd group-writable for arbitrary uids;
#   - ENTRYPOINT dumb-init -> /entrypoint (what the official entrypoint does that the stack uses: umask 0002,
#     an entry in /etc/passwd for an arbitrary uid, wait for the metadata DB, _AIRFLOW_DB_MIGRATE,
#     `bash`/`python` run as given, anything else is an `airflow` sub-command); CMD --help.
# Not reproduced: the official image's extra providers and its constraint-pinned dependency set (here pip
# resolves apache-airflow==3.3.2 alone), MySQL/MSSQL clients, _PIP_ADDITIONAL_REQUIREMENTS,
# _AIRFLOW_WWW_USER_CREATE (FAB users; the stack uses the simple auth manager).
# The base is a `docker import` of a debootstrap'ed bookworm (local/debian:bookworm). The host's CA bundle
# is copied in because HTTPS from a build here goes through the host's proxy; PIP_CERT points pip at it.
ARG BASE=local/debian:bookworm
FROM ${BASE}

ARG AIRFLOW_VERSION=3.3.2
ARG AIRFLOW_UID=50000
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 LC_ALL=C.UTF-8 \
    AIRFLOW_VERSION=${AIRFLOW_VERSION} AIRFLOW_UID=${AIRFLOW_UID} \
    AIRFLOW_USER_HOME_DIR=/home/airflow AIRFLOW_HOME=/opt/airflow \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends python3 python3-venv dumb-init netcat-openbsd \
      ca-certificates curl libpq5 procps >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid "${AIRFLOW_UID}" --gid 0 --home-dir /home/airflow --create-home --shell /bin/bash airflow \
 && mkdir -p /opt/airflow/dags /opt/airflow/logs /opt/airflow/plugins \
 && chown -R airflow:0 /opt/airflow /home/airflow && chmod -R g+rwX /opt/airflow /home/airflow \
 && chmod g=u /etc/passwd
# the host's bundle again: installing ca-certificates above may have rewritten it
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt

USER airflow
ENV PATH=/home/airflow/.local/bin:${PATH} VIRTUAL_ENV=/home/airflow/.local
RUN python3 -m venv /home/airflow/.local \
 && pip install -q --upgrade pip \
 && pip install -q "apache-airflow[postgres]==${AIRFLOW_VERSION}" \
 && airflow version

COPY --chown=airflow:0 entrypoint /entrypoint
WORKDIR /opt/airflow
EXPOSE 8080
ENTRYPOINT ["/usr/bin/dumb-init", "--", "/entrypoint"]
CMD ["--help"]
