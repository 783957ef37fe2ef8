# The Celery broker of the compose stack's optional `celery` profile (docker-compose.yaml), built locally like the
# other stand-ins: no container registry is reachable here. Airflow's own docker-compose.yaml for the
# CeleryExecutor (airflow-core/docs/howto/docker-compose/docker-compose.yaml) uses redis:7.2-bookworm with
# `redis://:@redis:6379/0` and a `redis-cli ping` health check; this is Debian bookworm's redis-server package
# (7.0) on the debootstrap'ed base (local/debian:bookworm, see deploy/compose_check.py), with the same port and
# check. Where a registry is reachable, redis:7.2-bookworm serves the same purpose (REDIS_IMAGE in .env).
# Nothing is persisted (a broker's queue is rebuilt by the scheduler); the port is only on the compose network. The
# compose file gives the arguments (--requirepass from REDIS_PASSWORD, protected mode on), as it does for the
# official image; without them (this CMD) it listens on no TCP port at all.
ARG BASE=local/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
ENTRYPOINT ["/usr/bin/redis-server"]
CMD ["--port", "0", "--protected-mode", "yes"]
