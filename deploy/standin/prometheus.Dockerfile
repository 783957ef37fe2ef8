# Prometheus for the compose stack's optional `monitoring` profile (docker-compose.yaml), built locally like the
# other stand-ins: no container registry is reachable here, so it is Debian bookworm's `prometheus` package (2.42,
# with promtool) on the debootstrap'ed base (local/debian:bookworm, see deploy/compose_check.py). Where a registry
# is reachable, prom/prometheus serves the same purpose with the same flags. curl is for the health check.
ARG BASE=local/debian:bookworm
FROM ${BASE}
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
RUN apt-get update -qq \
 && apt-get install -y -qq --no-install-recommends prometheus curl ca-certificates >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/deploybench-monitoring/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=:9090"]
