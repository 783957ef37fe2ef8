"""Shared pieces of the store, compare, history and report integration tests (imported by them)."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pandas as pd
import psycopg
from sqlalchemy.engine import make_url

from deploybench.store import PhaseRecord, RunRecord, db, embedded
from deploybench.store.facts import (
    CapacityStepRow,
    FanoutNodeRow,
    PreflightLinkRow,
    PreflightNodeRow,
    RolloutStepRow,
    RunFacts,
)
from deploybench.store.identity import identity_of

T0 = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
NODES = ["n1", "n2"]


def make_database() -> tuple[str, str]:
    """(test DSN, admin DSN) of a throwaway database on the DEPLOYBENCH_DSN or embedded server."""
    server = os.environ.get(db.ENV_DSN) or embedded.ensure_running()
    name = f"deploybench_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    url = make_url(db.normalize_dsn(server))
    embedded.create_database(url.render_as_string(hide_password=False), name)
    return url.set(database=name).render_as_string(hide_password=False), name


def airflow_connection(dsn: str) -> str:
    """An Airflow connection (JSON, for AIRFLOW_CONN_DEPLOYBENCH_RESULTS) for ``dsn``. A Unix-socket DSN
    (the embedded PostgreSQL's, ``...@/db?host=/dir&port=N``) keeps its host and port as SQLAlchemy
    query arguments: given as the connection's host, PostgresHook.get_uri() would make the directory a
    hostname."""
    import json

    url = make_url(dsn)
    conn = {"conn_type": "postgres", "login": url.username, "password": url.password, "host": url.host,
            "port": url.port, "schema": url.database,
            "extra": {"sqlalchemy_query": {k: v for k, v in url.query.items() if isinstance(v, str)}}}
    return json.dumps({k: v for k, v in conn.items() if v not in (None, "")})


def drop_database(test_dsn: str) -> None:
    db.dispose_engines()
    url = make_url(test_dsn)
    admin = url.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)')


def config(max_num_seqs: int = 8, prompt_tokens: int = 32, slowdown: float = 1.0, p99_ms: float = 2000.0) -> dict:
    return {"inventory": "lab7", "nodes": 2, "model": {"name": "sim-model"},
            "engine": {"profile": "sim", "max_num_seqs": max_num_seqs, "tensor_parallel_size": 1,
                       "max_model_len": 4096, "sim": {"decode_base_ms": 15.0, "slowdown": slowdown, "seed": 0}},
            "load": {"rate": 8.0, "duration_s": 10.0, "warmup_s": 1.0, "prompt_tokens": prompt_tokens,
                     "output_tokens": 8, "api": "completions", "stream": False},
            "slo": {"p99_latency_ms": p99_ms, "max_error_rate": 0.01, "min_rps": 0.0}}


FANOUT = {"model": "sim-model", "manifest_digest": "d" * 64, "total_bytes": 2048,
          "files": [{"path": "a.bin", "size": 1024, "sha256": "a" * 64}, {"path": "b.bin", "size": 1024,
                                                                          "sha256": "b" * 64}]}


def facts(cfg: dict, metrics: pd.DataFrame | None = None, capacity: list[tuple[float, float, float, bool]] = ()
          ) -> RunFacts:
    inventory = {"name": "lab7", "nodes": [{"name": n, "link_mbit": 1000.0, "labels": {"gpu": "gb10"}} for n in NODES]}
    return RunFacts(
        identity=identity_of(cfg, NODES, inventory, FANOUT, {"profile": "sim", "endpoints": [{}, {}]}),
        preflight_nodes=[PreflightNodeRow(node=n, ok=True, facts={"cpus": 2}) for n in NODES],
        preflight_links=[PreflightLinkRow(src="n1", dst="n2", nominal_mbit=1000, mbit=950, ratio=0.95, ok=True),
                         PreflightLinkRow(src="n2", dst="n1", nominal_mbit=1000, mbit=420, ratio=0.42, ok=False,
                                          error="slow")],
        fanout_nodes=[FanoutNodeRow(node="n2", status="copied", bytes=2048, seconds=1.5, verified=True,
                                    started_s=0.2)],
        rollout_steps=[RolloutStepRow(step=0, nodes=1, added=["n1"], ready_s={"n1": 0.8}, seconds=1.0),
                       RolloutStepRow(step=1, nodes=2, added=["n2"], ready_s={"n2": 0.9}, seconds=1.1)],
        capacity_steps=[CapacityStepRow(step=i, offered_rps=o, achieved_rps=a, latency_p99_ms=p, slo_ok=ok)
                        for i, (o, a, p, ok) in enumerate(capacity)],
        server_metrics=metrics,
    )


def samples(n: int, latency_ms: float, rng: np.random.Generator, phase: str = "sustained", rate: float = 20.0,
            start: datetime = T0, errors: int = 0) -> pd.DataFrame:
    """Synthetic samples: open-loop arrivals at ``rate``, log-normal latencies around ``latency_ms``."""
    ts = pd.Timestamp(start) + pd.to_timedelta(np.arange(n) / rate, unit="s")
    lat = rng.lognormal(np.log(latency_ms), 0.15, n)
    status = np.full(n, 200)
    if errors:
        status[np.linspace(0, n - 1, errors).astype(int)] = 503  # spread over the phase
    return pd.DataFrame(
        {
            "ts": ts,
            "phase": phase,
            "node": np.where(np.arange(n) % 2 == 0, NODES[0], NODES[1]),
            "status": status,
            "error_kind": np.where(status == 200, None, "http_503"),
            "latency_ms": lat,
            "ttft_ms": lat * 0.3,
            "prompt_tokens": 32,
            "output_tokens": 8,
        }
    )


def phase_from(frame: pd.DataFrame, offered: float, phase: str = "sustained") -> list[PhaseRecord]:
    ok = frame[frame["status"] == 200]
    dur = (frame["ts"].max() - frame["ts"].min()).total_seconds() or 1.0
    q = ok["latency_ms"].quantile([0.5, 0.9, 0.99, 0.999]).tolist()
    errors = int((frame["status"] != 200).sum())
    return [PhaseRecord(phase=phase, offered_rps=offered, achieved_rps=len(ok) / dur, output_tps=ok["output_tokens"]
                        .sum() / dur, requests=len(frame), errors=errors, error_rate=errors / len(frame),
                        latency_p50_ms=q[0], latency_p90_ms=q[1], latency_p99_ms=q[2], latency_p999_ms=q[3],
                        ttft_p50_ms=float(ok["ttft_ms"].median()), ttft_p99_ms=float(ok["ttft_ms"].quantile(0.99)),
                        duration_s=dur, started_at=frame["ts"].min().to_pydatetime())]


def run_record(key: str, cfg: dict, started: datetime = T0, **kw) -> RunRecord:
    from deploybench.config import canonical_hash

    return RunRecord(run_key=key, dag_id="deploybench_run", airflow_run_id=key.split("/")[-1], status="success",
                     started_at=started, finished_at=started + timedelta(minutes=1), config=cfg,
                     fingerprint=canonical_hash(cfg), inventory="lab7", node_count=2, tags={"suite": "i7"},
                     trigger="manual", **kw)
