"""Airflow Connections -> library objects. Imported only inside Airflow tasks.

Credentials live in Connections, never in task code or params: an SSH connection
(login, key file, pinned host key) for the nodes, a Postgres connection for the
results store. Both are optional: without them the inventory's SSH settings and the
store's own DSN resolution (DEPLOYBENCH_DSN, else the embedded PostgreSQL) apply.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deploybench.rollout.kubernetes import KubeClients

log = logging.getLogger(__name__)

RESULTS_CONN_ID = "deploybench_results"


def _connection_exists(conn_id: str) -> bool:
    from airflow.sdk import BaseHook

    try:
        BaseHook.get_connection(conn_id)
        return True
    except Exception:  # noqa: BLE001 - AirflowNotFoundException moved between modules across versions
        return False


def ssh_overrides(conn_id: str | None) -> dict[str, Any] | None:
    """SSH settings from an Airflow SSH connection, in the form deploybench.transport.ssh_params takes."""
    if not conn_id:
        return None
    from airflow.providers.ssh.hooks.ssh import SSHHook

    hook = SSHHook(ssh_conn_id=conn_id)
    extras = hook.get_connection(conn_id).extra_dejson
    host_key = None
    if hook.host_key is not None:
        host_key = f"{hook.host_key.get_name()} {hook.host_key.get_base64()}"
    if hook.no_host_key_check:
        log.warning("connection %s sets no_host_key_check; deploybench verifies host keys anyway", conn_id)
    return {
        "user": hook.username,
        "port": hook.port,
        "key_file": hook.key_file,
        "known_hosts": extras.get("known_hosts"),
        "host_key": host_key,
        "timeout": hook.conn_timeout,
    }


def results_dsn() -> str | None:
    """The results DSN from the ``deploybench_results`` Postgres connection, if there is one."""
    if not _connection_exists(RESULTS_CONN_ID):
        return None
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    conn = PostgresHook.get_connection(RESULTS_CONN_ID)
    if conn.host and conn.host.startswith("/"):
        return socket_dsn(conn.login, conn.password, conn.host, conn.port, conn.schema)
    return PostgresHook(postgres_conn_id=RESULTS_CONN_ID).get_uri()


def socket_dsn(login: str | None, password: str | None, folder: str, port: int | None, database: str | None) -> str:
    """A DSN for a PostgreSQL listening on a Unix socket in ``folder``: the folder and port go in the query
    (PostgresHook.get_uri() would make the folder a host name and connect to the default socket)."""
    from sqlalchemy.engine import URL

    query = {"host": folder, **({"port": str(port)} if port else {})}
    return URL.create("postgresql+psycopg", username=login or None, password=password or None,
                      database=database or None, query=query).render_as_string(hide_password=False)


def prometheus_source(conn_id: str | None = None) -> Any:
    """The team's Prometheus (deploybench.load.prom.PromSource) from the ``deploybench_prometheus`` connection
    (host, port, schema: http|https; extras: node_selector, gpu_selector, engine_selector, step_s, timeout_s,
    remote_write), or None when there is no such connection: then nothing asks a Prometheus."""
    from deploybench.load.prom import CONN_ID, PromSource

    conn_id = conn_id or CONN_ID
    if not _connection_exists(conn_id):
        return None
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    return PromSource.of_connection(conn.host, conn.port, conn.schema, dict(conn.extra_dejson or {}))


def kube_clients(conn_id: str | None) -> KubeClients | None:
    """Kubernetes API clients (apps/v1, core/v1, policy/v1, custom objects) from the cncf.kubernetes provider's
    KubernetesHook."""
    if not conn_id:
        return None
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    from deploybench.rollout.kubernetes import KubeClients

    hook = KubernetesHook(conn_id=conn_id)
    return KubeClients.from_api_client(hook.api_client)
