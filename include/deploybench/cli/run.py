"""`deploybench run` (the pipeline in-process, no scheduler) and `deploybench demo`
(a whole run of the deploybench_run DAG through Airflow on a fresh lab)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from deploybench import paths, pipeline
from deploybench.airflow.home import airflow_env, metadata_db_ready
from deploybench.errors import ConfigError, DeploybenchError, StageFailed
from deploybench.report import summary_text
from deploybench.run import STAGES, Run, read_record, run_status

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run every stage in this process, without Airflow")
    p.add_argument("--conf", default="{}", help="flat parameters as JSON (the DAG's trigger form)")
    p.add_argument("--key", default=None, help="run key (default: cli__<timestamp>_<pid>)")
    p.add_argument("--on-busy", choices=["wait", "fail"], default=None,
                   help="when another run holds the cluster: wait for it, or fail naming it (default: lease.on_busy)")
    p.add_argument("--lease-wait", type=float, default=None, metavar="S",
                   help="wait at most this long for the cluster's lease (default: lease.wait_s)")
    p.add_argument("--lease-ttl", type=float, default=None, metavar="S",
                   help="the lease expires this long after the last heartbeat (default: lease.ttl_s)")
    p.add_argument("--lease-heartbeat", type=float, default=None, metavar="S",
                   help="renew the lease this often (default: lease.heartbeat_s)")
    p.add_argument("--prometheus", default=os.environ.get("DEPLOYBENCH_PROMETHEUS") or None, metavar="URL|JSON",
                   help="the team's Prometheus, asked for every node's figures over each load window: its URL "
                        "(http://host:9090) or a JSON object (url, node_selector, gpu_selector, engine_selector, "
                        "step_s, timeout_s, remote_write); default $DEPLOYBENCH_PROMETHEUS, else none")
    p.set_defaults(func=cmd_run)

    d = sub.add_parser("demo", help="start a lab and run the deploybench_run DAG on it through Airflow")
    d.add_argument("--nodes", type=int, default=16)
    d.add_argument("--lab", default="demo", help="lab name")
    d.add_argument("--link-mbit", type=float, default=None)
    d.add_argument("--conf", default="{}", help="extra flat parameters as JSON")
    d.set_defaults(func=cmd_demo)

    a = sub.add_parser(
        "airflow",
        help="run an `airflow` command with this checkout's Airflow home, dags and plugins",
        description="e.g. `deploybench airflow standalone` (UI on :8080), `deploybench airflow dags list`",
    )
    a.add_argument("args", nargs=argparse.REMAINDER, help="arguments for airflow")
    a.set_defaults(func=cmd_airflow)


def cmd_airflow(args: argparse.Namespace) -> int:
    env = airflow_env()
    if not metadata_db_ready(env) and args.args[:2] != ["db", "migrate"]:
        subprocess.run(["airflow", "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL)
    return subprocess.run(["airflow", *args.args], env=env, check=False).returncode


def run_inline(run_key: str, flat: dict, lease: dict | None = None, prometheus: Any = None) -> str:
    """All stages in order under the cluster's lease, teardown/store/report always; returns the summary,
    raises if the run failed.

    The lease is taken after validate (nothing has touched a node before), after cleaning up what a
    dead holder left; a heartbeat renews it while the stages work, and it is released after teardown.
    ``lease``: overrides of the run's lease settings for acquire_lease (wait_s, on_busy, ttl_s,
    heartbeat_s). A run refused by the lease touches no node, not even for teardown. ``prometheus``: the team's
    Prometheus for the load stage (deploybench.load.prom.PromSource, or what ``parse_source`` takes).
    """
    from deploybench.load import prom

    source = prom.parse_source(prometheus)  # a bad one is refused before anything touches a node
    leased = False
    try:
        pipeline.validate(run_key, flat)
        pipeline.acquire_lease(run_key, **(lease or {}))
        leased = True
        pipeline.run_all(run_key, prometheus=source)
    except DeploybenchError as exc:
        log.error("%s", exc)
    finally:
        finals: list[tuple[str, Callable[[], Any]]] = [
            ("teardown", lambda: pipeline.run_stage("teardown", run_key)),
            ("release", lambda: pipeline.release_lease(run_key))] if leased else []
        finals += [("store", lambda: pipeline.run_stage("store", run_key)),
                   ("report", lambda: pipeline.report(run_key))]
        for what, final in finals:
            try:
                final()
            except Exception as exc:  # noqa: BLE001 - keep going: every final step must get its chance
                log.error("%s failed: %s", what, exc)
    return pipeline.finish(run_key)


def _conf(text: str) -> dict:
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--conf is not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(conf, dict):
        raise ConfigError(f"--conf must be a JSON object of parameters, got {text!r}")
    return conf


def cmd_run(args: argparse.Namespace) -> int:
    # the pid too: two runs started in the same second must not share a key (the lease's holder)
    key = args.key or f"cli__{datetime.now(UTC):%Y%m%dT%H%M%S}_{os.getpid()}"
    conf = _conf(args.conf)
    lease = {k: v for k, v in (("on_busy", args.on_busy), ("wait_s", args.lease_wait), ("ttl_s", args.lease_ttl),
                               ("heartbeat_s", args.lease_heartbeat)) if v is not None}
    try:
        print(run_inline(key, conf, lease, prometheus=args.prometheus))
        return 0
    except StageFailed as exc:
        if (paths.run_dir(key) / "run.json").exists():
            print(summary_text(Run.open(key)))
        print(f"deploybench: {exc}", file=sys.stderr)
        return 1


def _newest_run(since: float) -> str | None:
    best = None
    for d in paths.runs_dir().glob("deploybench_run__*"):
        f = d / "run.json"
        if f.is_file() and f.stat().st_mtime >= since and (best is None or f.stat().st_mtime > best[0]):
            best = (f.stat().st_mtime, json.loads(f.read_text())["run_key"])
    return best[1] if best else None


def cmd_demo(args: argparse.Namespace) -> int:
    from deploybench.lab import cluster as lab

    t_all = time.monotonic()
    kwargs = {"link_mbit": args.link_mbit} if args.link_mbit else {}
    print(f"[demo] starting a {args.nodes}-node lab {args.lab!r} ...", flush=True)
    t0 = time.monotonic()
    inv = lab.up(args.lab, nodes=args.nodes, **kwargs)
    inv_path = paths.lab_dir(args.lab) / "inventory.json"
    print(f"[demo] lab up in {time.monotonic() - t0:.1f} s: {len(inv.nodes)} nodes, inventory {inv_path}", flush=True)

    env = airflow_env()
    if not metadata_db_ready(env):
        print("[demo] creating Airflow's metadata database ...", flush=True)
        subprocess.run(["airflow", "db", "migrate"], env=env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    # The reference scenario's load: 20 requests/s for the cluster (without the probe, the rate offered as typed),
    # P99 under 2 s, under 1 % errors.
    conf = {"inventory": str(inv_path), "nodes": args.nodes, "load_rate": 20, **_conf(args.conf)}
    logf = paths.home() / "demo-airflow.log"
    print(f"[demo] airflow dags test deploybench_run (task logs: {logf}) ...", flush=True)
    since = time.time() - 1
    seen: set[str] = set()
    with open(logf, "w") as out:
        proc = subprocess.Popen(["airflow", "dags", "test", "deploybench_run", "-c", json.dumps(conf)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(1)
            _print_progress(_newest_run(since), seen)
    key = _newest_run(since)
    _print_progress(key, seen)
    if key is None:
        print(f"[demo] the DAG run did not start; see {logf}", file=sys.stderr)
        return 1
    run = Run.open(key)
    print()
    print(summary_text(run))
    print(f"\n[demo] wall time {time.monotonic() - t_all:.0f} s (Airflow log: {logf})")
    return 0 if run_status(run.stages()) == "success" else 1


def _print_progress(key: str | None, seen: set[str]) -> None:
    if key is None:
        return
    for s in STAGES:
        rec = None if s in seen else read_record(paths.run_dir(key), s)
        if rec is None:
            continue
        seen.add(s)
        print(f"[demo]   {s:<10} {rec.status:<8} {rec.seconds or 0:6.1f} s  {rec.summary}", flush=True)


