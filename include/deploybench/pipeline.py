"""One run: the loop over its stages (deploybench.stages.REGISTRY), and the cluster's lease.

The DAG's tasks and the ``deploybench run`` command call ``run_stage`` (or ``run_all`` for the stages that
touch the cluster) and the lease functions here. A run lives in a folder (deploybench.run): its validated
config, and one record per stage (deploybench.records.StageRecord: status, timing, its typed result, the
error). Records are written whether the stage succeeds or fails, so the store task keeps every result
already measured, and a retried stage simply overwrites its record. Nothing here knows a backend, a stage's
insides or the matrix: the stages do (deploybench.stages), and a deployment kept for another run is handed
over by the lease here, by what its teardown recorded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from deploybench import paths
from deploybench.errors import StageFailed
from deploybench.records import KeptDeployment, KeptEngines, StageRecord
from deploybench.run import (
    LEASED_STAGES,
    LOAD_PHASES,
    REQUIRED_STAGES,
    Run,
    now,
    read_record,
    recording,
    run_status,
    save_record,
)
from deploybench.stages import REGISTRY, Context, Validate, dump

log = logging.getLogger(__name__)


# -- the stages (deploybench.stages): each run through the recorder ----------------------------------------
def run_stage(name: str, run_key: str, *, ssh_overrides: dict | None = None, kube: Any = None,
              dsn: str | None = None, phase: str | None = None, params: dict[str, Any] | None = None,
              meta: dict[str, Any] | None = None, prometheus: Any = None) -> Any:
    """Run the stage ``name`` of the registry for ``run_key`` and write its record, success or failure (a
    retried stage overwrites it); returns its typed result, or None when it did nothing (a load phase not
    asked for; a stage that runs after failures, of a run whose validate failed). ``prometheus``: the team's
    Prometheus (deploybench.load.prom.PromSource, or a URL), asked by the load stage."""
    stage = REGISTRY[name]
    ctx = Context(run_key, ssh_overrides=ssh_overrides, kube=kube, dsn=dsn, phase=phase, params=params, meta=meta,
                  prometheus=prometheus)
    if name == "validate":
        Validate.clear(run_key)
    elif stage.after_failure and Run.open_if_validated(run_key) is None:
        log.warning("run %s was never validated; %s has nothing to do", run_key, name)
        return None
    folder = paths.run_dir(run_key)
    if (skip := stage.skip(ctx) if name != "validate" else None) is not None and not skip.record:
        log.info("stage %s of %s: %s", name, run_key, skip.summary)
        return None
    with recording(folder, name) as rec:
        if skip is not None:
            rec.result, rec.summary = dump(skip.result), skip.summary
            return skip.result
        try:
            with contextlib.ExitStack() as stack:
                cluster = stack.enter_context(ctx.run.cluster(ssh_overrides)) if name != "validate" else None
                result = stage.run(ctx, cluster)  # type: ignore[arg-type]  # (None for validate: it touches no node)
        except BaseException:
            measured = stage.measured(ctx) if name != "validate" else None
            if measured is not None:
                rec.result, rec.summary = dump(measured[0]), measured[1]
            raise
        rec.result, rec.summary = dump(result), stage.summary(ctx, result)
    return result


def validate(run_key: str, flat_params: dict[str, Any], meta: dict[str, Any] | None = None) -> dict:
    """Params -> RunConfig, checked against the policy and the inventory (deploybench.stages.Validate)."""
    got = run_stage("validate", run_key, params=flat_params, meta=meta)
    return dump(got)


def run_all(run_key: str, *, ssh_overrides: dict | None = None, kube: Any = None, prometheus: Any = None) -> None:
    """The stages that touch the cluster, in order, under the lease's heartbeat (the CLI's run): preflight,
    fan-out, rollout, then every load phase (with the team's Prometheus, when given)."""
    with lease_heartbeat(run_key):
        for name in LEASED_STAGES:
            for phase in LOAD_PHASES if name == "load" else (None,):
                run_stage(name, run_key, ssh_overrides=ssh_overrides, kube=kube, phase=phase,
                          prometheus=prometheus if name == "load" else None)


def report(run_key: str, dsn: str | None = None) -> dict:
    """The report stage, and the run's summary for the task log."""
    from deploybench import report as stage_mod

    got = run_stage("report", run_key, dsn=dsn)
    if got is None:
        return {"path": "", "text": f"run {run_key}: validation failed, nothing ran (see the validate task's log)"}
    return {"path": got.path, "text": stage_mod.summary_text(Run.open(run_key))}


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
    """The time budget of a run's task from its own durations (a stage's ``budget_s``, a load phase's, or a
    fixed one for the lease and finish: deploybench.timeouts); None before validate."""
    from deploybench.timeouts import stage_budget_s

    run = Run.open_if_validated(run_key)
    if run is None:
        return None
    if task in LOAD_PHASES:
        return REGISTRY["load"].budget_s(Context(run_key, phase=task))
    if task in REGISTRY:
        return REGISTRY[task].budget_s(Context(run_key))
    return stage_budget_s(run.cfg, task, len(run.nodes))


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

    got = run.typed("lease")
    return LeaseSpec.model_validate(got.spec) if got is not None else run.cfg.lease


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
    kept = run.typed("teardown") if td and td.status == "success" else None
    if isinstance(kept, KeptEngines):
        return _hand_over(run, rec, kept.kept, dsn)
    worked = any(run.stage(s) for s in LEASED_STAGES)
    dirty = (td is not None and td.status == "failed") or (td is None and worked)
    released = LeaseStore(dsn).release(run.inventory.name, run_key, leftovers=dirty)
    rec.result = {**(rec.result or {}), "released_at": now(), "released": released, "leftovers": dirty}
    save_record(run.dir, rec)
    return {"released": released, "leftovers": dirty}


# -- a deployment kept for the next cell of a matrix: the lease goes to it by name ----------------------------
HANDOVER_TTL_S = 600.0  # the next cell must take the handed-over lease within this long, else it expires


def _hand_over(run: Run, rec: StageRecord, kept: KeptDeployment, dsn: str | None) -> dict:
    """Release of a run that kept its engines for another run (its teardown's ``kept``): the lease goes to that
    run by name. If this run no longer holds it, the kept engines are stopped here (nobody else would)."""
    from deploybench import rollout
    from deploybench.lease import LeaseStore

    spec = _lease_spec(run)
    handed = LeaseStore(dsn).hand_over(run.inventory.name, run.key, kept.kept_for, [kept.owner],
                                       max(spec.ttl_s, HANDOVER_TTL_S))
    out: dict[str, Any] = {"released": False, "handed_over_to": kept.kept_for if handed else None,
                           "leftovers": False}
    if not handed:  # the owner's engines, by the owner's own pid files and command lines
        owner = Run.open(kept.owner)
        with owner.cluster() as cluster:
            out["stopped"] = rollout.teardown(cluster, list(kept.nodes), owner.cfg)
    rec.result = {**(rec.result or {}), "released_at": now(), **out}
    save_record(run.dir, rec)
    return out


def _open_or_none(run_key: str) -> Run | None:
    run = Run.open_if_validated(run_key)
    if run is None:
        log.warning("run %s was never validated; nothing to do", run_key)
    return run
