"""One run, stage by stage, as plain functions over a run key.

The DAG's tasks and the ``deploybench run`` command call these same functions. A run
lives in a folder (deploybench.run): its validated config, and one record per stage
(deploybench.records.StageRecord: status, timing, what it measured, the error). Records are written whether the
stage succeeds or fails, so the store task keeps every result already measured, and a
retried stage simply overwrites its record.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from deploybench import params as form
from deploybench import paths
from deploybench.config import RunConfig
from deploybench.errors import StageFailed
from deploybench.inventory import Inventory
from deploybench.records import LoadStageResult, StageRecord
from deploybench.run import (
    LEASED_STAGES,
    LOAD_PHASES,
    REQUIRED_STAGES,
    Run,
    check_owner,
    now,
    read_record,
    recording,
    run_status,
    save_record,
    write_json,
)

log = logging.getLogger(__name__)


# -- stages ----------------------------------------------------------------------------------
def validate(run_key: str, flat_params: dict[str, Any], meta: dict[str, Any] | None = None) -> dict:
    """Params -> RunConfig, checked against the inventory. Nothing touches a node here."""
    from deploybench import policy
    from deploybench.matrix import planned

    d = paths.run_dir(run_key)
    check_owner(d, run_key)  # before anything in it is deleted: never another run's folder
    for old in (d / "stages").glob("*.json") if (d / "stages").is_dir() else []:
        old.unlink()  # a re-run of the same key starts clean
    with recording(d, "validate") as rec:
        cfg = form.to_config(flat_params)
        policy.check(cfg)  # what the form chose, within what the operator allows
        planned.verify(run_key, cfg)  # a matrix cell's run id and 'deployment' section: only as its plan wrote them
        inv = Inventory.load(cfg.inventory)
        names = cfg.resolve_nodes(inv.names)
        if cfg.rollout.backend.value == "external":  # hostile URLs: refused before anything touches a node
            from deploybench.rollout import external

            external.check(cfg, names)
        write_json(d / "run.json", {
            "run_key": run_key, "config": cfg.model_dump(mode="json"), "nodes": names,
            "meta": {**(meta or {}), "started_at": now()}, "fingerprint": cfg.fingerprint(),
        })
        rec.result = {"nodes": names, "fingerprint": cfg.fingerprint()}
        rec.summary = (f"{len(names)} nodes of inventory {inv.name!r}, engine {_engine_name(cfg)}, "
                          f"load {cfg.load.rate:g} req/s for {cfg.load.duration_s:g} s")
    return rec.result


def _engine_name(cfg: RunConfig) -> str:
    from deploybench.engines import profile_name

    return profile_name(cfg.engine)


def _skipped_external(run: Run, name: str, why: str) -> StageRecord:
    """The record of a stage the external backend does not do: kept as a success that says it was skipped."""
    with recording(run.dir, name) as rec:
        rec.result = {"skipped": "external", "deployed_by": "not deployed by deploybench", "nodes": []}
        rec.summary = f"skipped (external backend: {why})"
    return rec


def _engine_program(run: Run) -> str | None:
    """The program an engine profile starts (its command's first item), for preflight to find on the nodes:
    the inventory's python for ``{python}``; None when the item is another placeholder."""
    from deploybench.engines import profile

    program = profile(run.cfg.engine).program
    if program == "{python}":
        return run.inventory.python
    return program if program and "{" not in program else None


def preflight(run_key: str, ssh_overrides: dict | None = None) -> dict:
    from deploybench import preflight as stage_mod

    if (reused := _reused(run_key, "preflight", ssh_overrides)) is not None:  # a matrix cell's shared deployment
        return {"healthy": reused["healthy"]}
    run = Run.open(run_key)
    if run.cfg.rollout.backend.value == "external" and not run.cfg.rollout.external_preflight:
        _skipped_external(run, "preflight", "rollout.external_preflight is off")
        return {"healthy": list(run.nodes)}
    # Engines started over SSH need their port free and their binary on every node; pods do not.
    on_nodes = run.cfg.rollout.backend.value == "ssh"
    runtime = run.cfg.engine.runtime.value  # docker/podman: the engine runs in a container
    binary = runtime if runtime != "process" else _engine_program(run)
    with recording(run.dir, "preflight") as rec, run.cluster(ssh_overrides) as cluster:
        res = stage_mod.run(cluster, run.nodes, run.cfg.preflight, source=run.source, model_name=run.cfg.model.name,
                            engine_port=run.cfg.rollout.port if on_nodes else None,
                            engine_binary=binary if on_nodes else None)
        rec.result = res.to_dict()
        worst = min((lt for lt in res.links if lt.ratio is not None), key=lambda lt: lt.ratio or 0.0, default=None)
        rec.summary = f"{len(res.healthy)}/{len(run.nodes)} nodes healthy, {len(res.links)} links tested" + (
            f", worst {worst.src}->{worst.dst} {worst.mbit:.0f} Mbit/s ({worst.ratio:.0%} of nominal)" if worst else "")
    return {"healthy": res.healthy}


def fanout(run_key: str, healthy: list[str], ssh_overrides: dict | None = None) -> dict:
    from deploybench import fanout as stage_mod

    if (reused := _reused(run_key, "fanout")) is not None:  # a matrix cell's shared deployment
        return {"nodes": reused.get("verified_nodes") or list(healthy)}
    run = Run.open(run_key)
    if run.cfg.rollout.backend.value == "external":
        _skipped_external(run, "fanout", "the engines already hold their model")
        return {"nodes": list(healthy)}
    with recording(run.dir, "fanout") as rec, run.cluster(ssh_overrides) as cluster:
        res = stage_mod.run(cluster, healthy, run.source, run.cfg.model.name, run.cfg.fanout,
                            policy=run.cfg.preflight.policy, min_nodes=run.cfg.preflight.min_nodes)
        rec.result = res.to_dict()
        copied = [c for c in res.nodes if c.status == "copied"]
        rec.summary = (f"{res.total_bytes / 2**20:.0f} MiB model ({res.manifest_digest[:12]}) verified on "
                          f"{len(res.verified_nodes)} nodes by {res.strategy} in {res.seconds:.1f} s: "
                          f"{len(copied)} copied, {sum(c.status == 'repaired' for c in res.nodes)} repaired, "
                          f"{sum(c.status == 'skipped' for c in res.nodes)} already held it"
                          + (f", {len(res.nodes) - len(res.verified_nodes)} left out" if
                             len(res.verified_nodes) < len(res.nodes) else ""))
    return {"nodes": res.verified_nodes}


def rollout(run_key: str, nodes: list[str], ssh_overrides: dict | None = None, kube: Any = None) -> dict:
    """Canary, then scale steps, each gated (deploybench.rollout). ``kube``: Kubernetes API clients
    for rollout.backend=kubernetes (deploybench.airflow.connections.kube_clients)."""
    from deploybench import rollout as stage_mod

    if (reused := _reused(run_key, "rollout")) is not None:  # a matrix cell's shared deployment
        return {"endpoints": reused["endpoints"]}
    run = Run.open(run_key)
    if run.cfg.rollout.backend.value == "external":
        from deploybench.rollout import external

        with recording(run.dir, "rollout") as rec:
            rec.result = external.run(run.cfg, run.nodes, nodes)
            rec.summary = (f"skipped (external backend): {len(rec.result['endpoints'])} given endpoints of the "
                           f"{rec.result['profile']} engine ready, {external.NOT_DEPLOYED}")
        return {"endpoints": rec.result["endpoints"]}
    with recording(run.dir, "rollout") as rec, run.cluster(ssh_overrides) as cluster:
        res = stage_mod.run(cluster, nodes, run.cfg, out_dir=run.dir / "rollout", kube=kube)
        rec.result = res.to_dict()
        slowest = max((v for s in res.steps for v in s.ready_s.values()), default=0.0)
        rec.summary = (f"{res.profile} engine ({res.backend}) on {len(res.endpoints)} nodes in steps "
                          + " -> ".join(f"{s.nodes}" for s in res.steps)
                          + f" (slowest ready {slowest:.1f} s), every gate passed")
    return {"endpoints": res.endpoints}


def load(run_key: str, endpoints: list[dict]) -> dict:
    """Every phase of ``load.phases`` in order (probe -> sustained -> overload); the CLI's load stage."""
    out: dict = {}
    for phase in LOAD_PHASES:
        out = load_phase(run_key, endpoints, phase)
    return out


def load_phase(run_key: str, endpoints: list[dict] | None, phase: str) -> dict:
    """One load phase (a DAG task each); a phase not in ``load.phases`` is skipped. The stage record
    'load' is rebuilt from every phase run so far (deploybench.load.phases.assemble): its result is
    the headline phase's LoadResult with ``phases``, ``capacity`` and ``series`` added.

    ``endpoints`` None: those of the run's latest rollout record (a cleared phase re-deploys first,
    so it reads the endpoints of that new rollout)."""
    from deploybench import load as stage_mod
    from deploybench.load import phases

    run = Run.open(run_key)
    if endpoints is None:
        ro = run.stage("rollout")
        if ro is None or ro.status != "success":
            raise StageFailed(f"load {phase}: run {run_key} has no successful rollout to load (rollout record: "
                              f"{ro.status if ro else 'missing'})")
        endpoints = ro.result["endpoints"]
    out_dir = run.dir / "load"
    wanted = [p.value for p in run.cfg.load.phases]
    if phase not in wanted:
        return {"phase": phase, "skipped": True, "slo_ok": None}
    if phase == wanted[0]:
        for old in out_dir.glob("*.result.json") if out_dir.is_dir() else []:
            old.unlink()  # the first phase of a (re-)run starts clean
    with recording(run.dir, "load") as rec, run.cluster() as cluster:
        eps = [stage_mod.Endpoint(e["node"], e["url"], e["model"]) for e in endpoints]
        try:  # the transports let nodes without DCGM metrics report their GPUs through nvidia-smi (lazy: no
            # connection is made unless a node needs it)
            phases.run_phase(phase, eps, run.cfg.load, run.cfg.slo, out_dir, tags={"run": run_key},
                             transports={n: cluster[n] for n in {e.node for e in eps}})
        finally:
            data = phases.assemble(out_dir, run.cfg.load)
            rec.result = data
            rec.summary = phases.summary(data)
        LoadStageResult.of(rec, run.dir)  # the contract the store reads: a mismatch fails here, named
    done = data["phases"][phase]
    return {"phase": phase, "slo_ok": (done.get("result") or {}).get("slo_ok"),
            "capacity_rps": (data.get("capacity") or {}).get("capacity_rps")}


def teardown(run_key: str, ssh_overrides: dict | None = None, kube: Any = None) -> dict:
    """Stop the engine on every node of the run (or delete its Kubernetes objects). Always runs; safe to run twice."""
    from deploybench import rollout as stage_mod

    run = _open_or_none(run_key)
    if run is None:
        return {}
    with recording(run.dir, "teardown") as rec, run.cluster(ssh_overrides) as cluster:
        if run.cfg.deployment.keep_for and (kept := _keep(run, ssh_overrides, rec)):
            return kept
        theirs = _stop_adopted(run, ssh_overrides)  # first: an adopted engine answers on the port this run checks
        stopped = stage_mod.teardown(cluster, run.nodes, run.cfg, kube=kube)
        stopped = {**stopped, **{n: s for n, s in theirs.items() if stopped.get(n, "stopped") == "stopped"}}
        rec.result = stopped
        errors = {n: s for n, s in stopped.items() if s.startswith("error")}
        what = "objects deleted" if run.cfg.rollout.backend.value == "kubernetes" else "engines stopped on"
        rec.summary = f"{what} {len(stopped) - len(errors)}/{len(stopped)}" + (
            "" if run.cfg.rollout.backend.value == "kubernetes" else " nodes")
        if errors:
            raise StageFailed("teardown: " + "; ".join(f"{n}: {s}" for n, s in errors.items()), stopped)
    return stopped


def store(run_key: str, dsn: str | None = None) -> dict:
    from deploybench.store import ingest

    run = _open_or_none(run_key)
    if run is None:
        return {}
    with recording(run.dir, "store") as rec:
        rec.result = ingest.store_run(run, dsn)
        rec.summary = f"run {run_key} stored: " + ", ".join(f"{k} {v}" for k, v in rec.result.items())
    return rec.result


def report(run_key: str, dsn: str | None = None) -> dict:
    from deploybench import report as stage_mod

    run = _open_or_none(run_key)
    if run is None:
        return {"path": "", "text": f"run {run_key}: validation failed, nothing ran (see the validate task's log)"}
    with recording(run.dir, "report") as rec:
        history = stage_mod.history_for(run, dsn)  # change points of the run's series; None if not stored
        path = stage_mod.write_html(run, history)
        rec.result = {"path": str(path), "verdicts": history.verdicts if history else None}
        rec.summary = f"report at {path}" + (f"; {stage_mod.verdict_line(history)}" if history else "")
    return {"path": str(path), "text": stage_mod.summary_text(Run.open(run_key))}


def finish(run_key: str) -> str:
    """The run's verdict: raises StageFailed naming every failed stage, else returns the summary."""
    from deploybench import report as stage_mod

    d = paths.run_dir(run_key)
    if not (d / "run.json").is_file():
        rec = read_record(d, "validate")
        raise StageFailed(f"run {run_key}: invalid parameters: {rec.error if rec else 'validate did not run'}")
    run = Run.open(run_key)
    recs = run.stages()
    if run_status(recs) != "success":
        failed = [f"{s}: {r.error or ''}" for s, r in recs.items() if r.status == "failed"]
        missing = [s for s in REQUIRED_STAGES if s not in recs]
        raise StageFailed(f"run {run_key} failed: " + " | ".join(failed + [f"{m}: did not run" for m in missing]))
    return stage_mod.summary_text(run)


def budget_s(run_key: str, task: str) -> float | None:
    """The time budget of a run's task from its own durations (deploybench.timeouts); None before validate."""
    from deploybench.timeouts import stage_budget_s

    run = Run.open_if_validated(run_key)
    return stage_budget_s(run.cfg, task, len(run.nodes)) if run else None


# -- the cluster's lease (deploybench.lease): one run per cluster ------------------------------------
def acquire_lease(run_key: str, wait_s: float | None = None, on_busy: str | None = None, *, dsn: str | None = None,
                  dag_id: str | None = None, ttl_s: float | None = None, heartbeat_s: float | None = None,
                  ssh_overrides: dict | None = None, kube: Any = None, queue: bool | None = None) -> dict:
    """Take the lease of the run's cluster (after validate, before preflight), then clean up after the runs
    whose leftovers are pending (an expired holder, a broken lease, a failed teardown). Waits or fails as
    ``on_busy``/``wait_s`` say (default: the run's ``lease`` config); LeaseBusy names the holder. ``queue``:
    keep a place among the runs waiting for the cluster (``LeaseStore.acquire``; default: when it waits here).

    Writes the 'lease' stage record: the effective lease settings (``ttl_s``/``heartbeat_s`` override the
    config here, for ``lease_heartbeat``), how long it waited, whom it took over from and what it cleaned.
    Returns ``{"cluster", "waited_s", "taken_over", "cleaned": [per dead run: what was stopped where]}``."""
    from deploybench import leftovers
    from deploybench.lease import Holder, LeaseBusy, LeaseStore

    run = Run.open(run_key)
    spec = run.cfg.lease.model_copy(update={k: v for k, v in (("ttl_s", ttl_s), ("heartbeat_s", heartbeat_s))
                                            if v is not None})
    spec = type(spec).model_validate(spec.model_dump())  # the overrides checked like the config
    store = LeaseStore(dsn)
    cluster = run.inventory.name
    with recording(run.dir, "lease") as rec:
        rec.result = {"cluster": cluster, "spec": spec.model_dump(mode="json")}
        try:
            grant = store.acquire(cluster, Holder(run_key, dag_id or run.meta.get("dag_id") or "cli"), spec,
                                  wait_s=wait_s, on_busy=on_busy, queue=queue)
        except LeaseBusy as exc:
            rec.result["holder"] = exc.info.to_dict()
            raise
        cleaned = []
        if grant.cleanup:
            from deploybench.lease import held

            try:
                with held(store, cluster, run_key, spec, interrupt=False):
                    for entry in grant.cleanup:
                        res = leftovers.clean(run.inventory, entry["run_key"], ssh_overrides=ssh_overrides, kube=kube,
                                              namespace=run.cfg.rollout.kubernetes.namespace if kube else None,
                                              grace_s=run.cfg.rollout.stop_grace_s)
                        cleaned.append({**res, "reason": entry.get("reason"), "dead_holder": entry})
                store.cleaned(cluster, run_key, [e["run_key"] for e in grant.cleanup], {"cleaned": cleaned})
            except BaseException:
                store.release(cluster, run_key)  # the dead runs stay pending: the next taker cleans up after them
                raise
        rec.result.update(waited_s=grant.waited_s, taken_over=grant.taken_over, cleaned=cleaned,
                             acquired_at=now())
        rec.summary = f"cluster {cluster!r} leased after {grant.waited_s:.1f} s" + "".join(
            f"; cleaned up after {c['reason']} run {c['run_key']} in {c['seconds']:.1f} s: {leftovers.describe(c)}"
            for c in cleaned)
    return {"cluster": cluster, "waited_s": grant.waited_s, "taken_over": grant.taken_over, "cleaned": cleaned}


def _lease_spec(run: Run):
    """The lease settings acquire_lease used (its record), else the run's config."""
    from deploybench.config import LeaseSpec

    got = run.result("lease").get("spec")
    return LeaseSpec.model_validate(got) if got else run.cfg.lease


@contextlib.contextmanager
def lease_heartbeat(run_key: str, dsn: str | None = None, interrupt: bool = True) -> Iterator[Any]:
    """``with lease_heartbeat(key):`` around work on the cluster (the CLI's stages, or one DAG task): renews
    the lease at once (LeaseLost if this run no longer holds it), then every ``heartbeat_s`` from a
    thread; a lease broken or taken meanwhile stops the work with LeaseLost (deploybench.lease.Heartbeat)."""
    from deploybench.lease import LeaseStore, held

    run = Run.open(run_key)
    spec = _lease_spec(run)
    store = LeaseStore(dsn)
    store.renew(run.inventory.name, run_key, spec.ttl_s)
    with held(store, run.inventory.name, run_key, spec, interrupt=interrupt) as hb:
        yield hb


def release_lease(run_key: str, dsn: str | None = None) -> dict:
    """Release the run's lease (after teardown; safe to call twice or when it was never taken). A run whose
    teardown failed, or that worked on nodes without a teardown, is left for the next run to clean up."""
    from deploybench.lease import LeaseStore

    run = _open_or_none(run_key)
    rec = run.stage("lease") if run else None
    if run is None or rec is None or rec.status != "success":
        return {"released": False}
    td = run.stage("teardown")
    if td and td.status == "success" and (run.result("teardown").get("kept") or {}).get("kept"):
        return _hand_over(run, rec, td.result["kept"], dsn)
    worked = any(run.stage(s) for s in LEASED_STAGES)
    dirty = (td is not None and td.status == "failed") or (td is None and worked)
    released = LeaseStore(dsn).release(run.inventory.name, run_key, leftovers=dirty)
    rec.result = {**(rec.result or {}), "released_at": now(), "released": released, "leftovers": dirty}
    save_record(run.dir, rec)
    return {"released": released, "leftovers": dirty}


# -- a deployment shared by a matrix's cells (deploybench.matrix.deployment): adopt, keep, hand over ----------------
HANDOVER_TTL_S = 600.0  # the next cell must take the handed-over lease within this long, else it expires


def _reused(run_key: str, name: str, ssh_overrides: dict | None = None) -> dict | None:
    """For a run with ``deployment.adopt``: the stage ``name`` reuses the adopted deployment's record (the
    result, written as this run's with where it came from); None when this run deploys on its own. Preflight
    verifies and decides (deployment.adopt); fan-out and rollout follow its decision."""
    from deploybench.matrix import deployment

    run = Run.open(run_key)
    if not run.cfg.deployment.adopt:
        return None
    got = deployment.adopt(run, ssh_overrides) if name == "preflight" else deployment.adoption(run)
    if not got or not got.get("adopted"):
        return None
    with recording(run.dir, name) as rec:
        rec.result, rec.summary = deployment.reused_record(got, name)
    return rec.result


def _keep(run: Run, ssh_overrides: dict | None, rec: StageRecord) -> dict | None:
    """Teardown of a run with ``deployment.keep_for``: leave the engines up for that run when they are worth it
    (filling the teardown record); None: they are stopped as usual (the record says why not)."""
    from deploybench.matrix import deployment

    kept = deployment.keep(run, ssh_overrides)
    if not kept.get("kept"):
        log.warning("run %s stops its engines instead of keeping them for run %s: %s", run.key,
                    run.cfg.deployment.keep_for, kept.get("why"))
        return None
    rec.result = {"kept": kept}
    rec.summary = (f"engines of run {kept['owner']} left running on {', '.join(kept['nodes'])} for run "
                      f"{kept['kept_for']} (deployment.keep_for); it stops them, or the matrix's cleanup does")
    return rec.result


def _stop_adopted(run: Run, ssh_overrides: dict | None) -> dict[str, str]:
    """Teardown of a run that adopted another run's engines and keeps them for nobody: stop them too."""
    from deploybench.matrix import deployment

    owner = deployment.adopted_owner(run)
    if owner is None:
        return {}
    nodes = (deployment.adoption(run) or {}).get("nodes") or []
    return deployment.stop(owner, [n for n in nodes if n in run.nodes], ssh_overrides)


def _hand_over(run: Run, rec: StageRecord, kept: dict, dsn: str | None) -> dict:
    """Release of a run that kept its engines for the next cell: the lease goes to that run by name. If this run
    no longer holds it, the kept engines are stopped here (nobody else would)."""
    from deploybench.lease import LeaseStore
    from deploybench.matrix import deployment

    spec = _lease_spec(run)
    handed = LeaseStore(dsn).hand_over(run.inventory.name, run.key, kept["kept_for"], [kept["owner"]],
                                       max(spec.ttl_s, HANDOVER_TTL_S))
    out: dict[str, Any] = {"released": False, "handed_over_to": kept["kept_for"] if handed else None,
                           "leftovers": False}
    if not handed:
        out["stopped"] = deployment.stop(kept["owner"], kept["nodes"])
    rec.result = {**(rec.result or {}), "released_at": now(), **out}
    save_record(run.dir, rec)
    return out


def _open_or_none(run_key: str) -> Run | None:
    run = Run.open_if_validated(run_key)
    if run is None:
        log.warning("run %s was never validated; nothing to do", run_key)
    return run
