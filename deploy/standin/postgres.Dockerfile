# A local stand-in for the official postgres image (deploy/compose_check.py builds it where no registry is
# reachable). Debian bookworm's PostgreSQL 15 behind an entrypoint with the official image's interface as
# docker-compose.yaml uses it: POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, data in
# /var/lib/postgresql/data (PGDATA), scripts in /docker-entrypoint-initdb.d (*.sh sourced, *.sql run) on
# the first start only, password (scram-sha-256) access from the network, pg_isready on PATH.
ARG BASE=local/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8 PGDATA=/var/lib/postgresql/data \
    PATH=/usr/lib/postgresql/15/bin:${PATH}
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends postgresql-15 gosu >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /docker-entrypoint-initdb.d /var/run/postgresql "${PGDATA}" \
 && chown -R postgres:postgres /var/run/postgresql "${PGDATA}"
COPY postgres-entrypoint /usr/local/bin/docker-entrypoint.sh
EXPOSE 5432
STOPSIGNAL SIGINT
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
CMD ["postgres"]
