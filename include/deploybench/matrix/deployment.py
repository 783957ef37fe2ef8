"""One deployment shared by the cells of a matrix: keep it running for the next cell, adopt it, stop it.

Standing the service up (preflight, fan-out, rollout) dominates a cell's cost, and cells that differ
only in load or SLO parameters serve the very same deployment. So the matrix's plan chains the cells
of one deployment group (``deploybench.matrix.plan``): each cell's conf carries the hidden section
``deployment`` with ``keep_for`` (the next cell's run key) and/or ``adopt`` (the previous cell's).

- **keep** (``keep``, at the giver's teardown): when the giver's rollout and load succeeded and its
  engines still answer, they are left running and ``deployment.json`` in the giver's run folder says
  for whom (``kept_for``), whose engines they are (``owner``: the run that rolled them out) and which
  preflight and fan-out they rest on. The giver then hands the cluster's lease to that run by name
  (``deploybench.lease.LeaseStore.hand_over``) instead of releasing it: nothing outside the matrix
  slips in between, and if the taker never comes the lease expires and the next run cleans the kept
  engines up as leftovers.
- **adopt** (``adopt``, at the taker's preflight, under the lease): the record is checked like any
  input from disk or a node - it must have been kept by the named run *for this run*; the owner's
  configuration (its own ``run.json``) must deploy exactly what this run would (the deployment
  fingerprint: every parameter but load, SLO, lease and tags); the owner's preflight must be younger
  than ``deployment.max_reuse_s`` (default 900 s: the links measured minutes ago, the model verified
  on every node since); every engine must still run the command the owner started (pid file and
  ``/proc/<pid>/cmdline``, as ``deploybench.leftovers`` checks) and answer its health URL. Endpoints are
  recomputed from the inventory and the owner's configuration, never read from the record. Then the
  taker's preflight, fan-out and rollout records say "reused from run X (age N s)" and carry the
  owner's identity fields (model manifest, engine, replicas) but not its per-node facts, which stay
  stored with the run that measured them. A record that fails a check is not adopted: the kept engines
  are stopped (when the record itself is sound) and the cell deploys on its own.
- **stop**: a taker that keeps nothing for a next cell stops the adopted engines at its teardown, by
  the owner's key (pid files ``engine-<owner tag>.pid``, command line checked).

Only the ssh backend shares deployments; with kubernetes every cell deploys on its own.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploybench import paths
from deploybench.errors import ConfigError
from deploybench.rollout import capabilities

if TYPE_CHECKING:
    from deploybench.config import RunConfig
    from deploybench.run import Run

log = logging.getLogger(__name__)

KEPT = "deployment.json"  # in the giver's run folder: the deployment it left running, and for whom
ADOPTED = "adoption.json"  # in the taker's run folder: what it adopted, or why not
REUSED_STAGES = ("preflight", "fanout", "rollout")
# what the store's identities read of a reused stage's result (deploybench.store.identity); per-node facts stay
# with the run that measured them
_IDENTITY_KEYS = {"preflight": ("healthy",),
                  "fanout": ("model", "manifest_digest", "total_bytes", "files", "verified_nodes", "strategy"),
                  "rollout": ("profile", "backend", "image", "version", "endpoints")}


def _now() -> datetime:
    return datetime.now(UTC)


def _age_s(stamp: Any) -> float | None:
    try:
        t = datetime.fromisoformat(str(stamp))
    except (TypeError, ValueError):
        return None
    return (_now() - t).total_seconds() if t.tzinfo else None


def fingerprint(cfg: RunConfig) -> str:
    """What is deployed (the matrix's deployment key): every form parameter but load, SLO, lease and tags."""
    from deploybench import params as form
    from deploybench.matrix import deployment_key

    return deployment_key(form.from_config(cfg))


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def kept_record(run_key: str) -> dict | None:
    """The deployment ``run_key`` kept running (None: it kept none)."""
    return _read_json(paths.run_dir(run_key) / KEPT)


def adoption(run: Run) -> dict | None:
    """What this run adopted (``{"adopted": True, "owner", "giver", ...}``) or why not; None: it was not asked to."""
    return _read_json(run.dir / ADOPTED)


def adopted_owner(run: Run) -> str | None:
    a = adoption(run)
    return a["owner"] if a and a.get("adopted") else None


def _deployer(run_key: str, cfg: RunConfig, inventory: Any, nodes: list[str], ssh_overrides: dict | None):
    """The ssh deployer of ``run_key``'s engines on ``nodes`` (pid files and command lines of that run)."""
    from deploybench.rollout.ssh import SSHDeployer
    from deploybench.transport import Cluster

    cluster = Cluster(inventory, ssh_overrides, run_key=run_key)
    dep = SSHDeployer(cluster, cfg)
    dep.take_over(nodes)
    return cluster, dep


def _unhealthy(dep: Any, nodes: list[str]) -> list[str]:
    """Why the engines on ``nodes`` are not the running, answering engines ``dep``'s run started: each must
    still run the recorded command (pid file + /proc cmdline, as leftovers checks) and answer its health URL."""
    from deploybench.errors import DeploybenchError

    bad = [f"{f.node}: {f}" for f in dep.check_alive(nodes)]
    for n in nodes:
        try:
            if not dep.alive(n):
                bad.append(f"{n}: the engine's pid file does not name a live process running the owner's command")
        except DeploybenchError as exc:
            bad.append(f"{n}: unreachable: {exc}")
    return bad


def stop(owner_key: str, nodes: list[str], ssh_overrides: dict | None = None) -> dict[str, str]:
    """Stop ``owner_key``'s engines on ``nodes`` (command line checked; idempotent): node -> stopped | error."""
    from deploybench.run import Run

    owner = Run.open(owner_key)
    cluster, dep = _deployer(owner_key, owner.cfg, owner.inventory, nodes, ssh_overrides)
    with cluster:
        return dep.teardown(list(nodes))


# -- the giver ------------------------------------------------------------------------------------------------
def keep(run: Run, ssh_overrides: dict | None = None) -> dict:
    """At teardown, for a run with ``deployment.keep_for``: leave the engines running for that run if they are
    worth reusing. Returns ``{"kept": bool, "why" | record...}``; writes ``deployment.json`` when kept."""
    taker = run.cfg.deployment.keep_for
    recs = run.stages()
    why = None
    if not capabilities(run.cfg).shares_deployments:
        why = f"the {run.cfg.rollout.backend.value} backend does not share deployments"
    elif "rollout" not in recs or recs["rollout"].status != "success":
        why = "the rollout did not succeed"
    elif "load" not in recs or recs["load"].status != "success":
        why = "the load stage did not succeed (the engines may be unhealthy)"
    if why:
        return {"kept": False, "why": why}
    owner = adopted_owner(run) or run.key
    source = run if owner == run.key else None
    if source is None:
        from deploybench.run import Run

        source = Run.open(owner)
    nodes = [e["node"] for e in source.endpoints() if e.get("node") in source.nodes]
    cluster, dep = _deployer(owner, source.cfg, source.inventory, nodes, ssh_overrides)
    with cluster:
        failures = _unhealthy(dep, nodes)
    if failures or not nodes:
        return {"kept": False, "why": "engines no longer answer: " + ("; ".join(failures) or "no endpoints")}
    stamps = {s: rec.finished_at if (rec := source.stage(s)) else None for s in REUSED_STAGES}
    record = {"kept": True, "kept_by": run.key, "kept_for": taker, "owner": owner, "cluster": run.inventory.name,
              "nodes": nodes, "deployment": fingerprint(run.cfg), "kept_at": _now().isoformat(),
              "preflight_at": stamps["preflight"], "fanout_at": stamps["fanout"], "deployed_at": stamps["rollout"]}
    _write_json(run.dir / KEPT, record)
    log.info("run %s: engines of run %s on %s left running for run %s", run.key, owner, ", ".join(nodes), taker)
    return record


# -- the taker -------------------------------------------------------------------------------------------------
class NotAdopted(Exception):
    """A kept deployment this run will not use; ``sound``: the record itself is ours (its engines may be stopped)."""

    def __init__(self, why: str, sound: bool = False, record: dict | None = None):
        super().__init__(why)
        self.sound, self.record = sound, record


def _verify(run: Run, giver: str, ssh_overrides: dict | None) -> dict:
    """The checks of the module doc, in order; NotAdopted names the first that fails."""
    import re

    from deploybench.config import RUN_KEY_PATTERN
    from deploybench.errors import DeploybenchError
    from deploybench.run import Run

    spec = run.cfg.deployment
    if not capabilities(run.cfg).shares_deployments:
        raise NotAdopted(f"the {run.cfg.rollout.backend.value} backend does not share deployments")
    rec = kept_record(giver)
    if rec is None:
        raise NotAdopted(f"run {giver} kept no deployment (no readable {KEPT} in its run folder)")
    if rec.get("kept_by") != giver or rec.get("kept_for") != run.key:
        raise NotAdopted(f"the deployment run {giver} kept is for run {rec.get('kept_for')!r}, not this one")
    if rec.get("adopted_by") and rec["adopted_by"] != run.key:
        raise NotAdopted(f"the deployment run {giver} kept was already adopted by run {rec['adopted_by']}")
    owner_key = rec.get("owner")
    if not isinstance(owner_key, str) or not re.match(RUN_KEY_PATTERN, owner_key):
        raise NotAdopted(f"the record of run {giver} names no valid owner run ({owner_key!r})")
    try:
        owner = Run.open(owner_key)
    except (DeploybenchError, OSError, ValueError, KeyError) as exc:
        raise NotAdopted(f"the owner run {owner_key} of the kept deployment cannot be read: {exc}") from None
    record = {**rec, "owner_nodes": owner.nodes}

    def refused(why: str) -> NotAdopted:
        """The record is sound: its engines may be stopped."""
        return NotAdopted(why, sound=True, record=record)

    mine, theirs = fingerprint(run.cfg), fingerprint(owner.cfg)
    if mine != theirs or owner.inventory.name != run.inventory.name:
        raise refused(f"run {owner_key} deployed another configuration (deployment {theirs[:12]}, this run "
                   f"needs {mine[:12]})")
    pf = owner.stage("preflight")
    age = _age_s(pf.finished_at) if pf else None
    if pf is None or pf.status != "success" or age is None:
        raise refused(f"run {owner_key} has no successful preflight to rely on")
    if age > spec.max_reuse_s:
        raise refused(f"the preflight of run {owner_key} is {age:.0f} s old, past deployment.max_reuse_s="
                   f"{spec.max_reuse_s:g}")
    ro = owner.stage("rollout")
    if ro is None or ro.status != "success":
        raise refused(f"run {owner_key} has no successful rollout")
    try:
        served = [e.get("node") for e in owner.endpoints()]
    except DeploybenchError as exc:  # a record that does not match the contract (records.RecordError)
        raise refused(f"the rollout record of run {owner_key} cannot be read: {exc}") from None
    nodes = [n for n in served if isinstance(n, str) and n in run.nodes]
    if not served or len(nodes) != len(served):
        raise refused(f"run {owner_key} served on {served}, not among this run's nodes {run.nodes}")
    cluster, dep = _deployer(owner_key, owner.cfg, owner.inventory, nodes, ssh_overrides)
    with cluster:
        failures = _unhealthy(dep, nodes)
        endpoints = dep.endpoints()
    if failures:
        raise refused("kept engines no longer answer: " + "; ".join(failures))
    return {"adopted": True, "giver": giver, "owner": owner_key, "nodes": nodes, "endpoints": endpoints,
            "deployment": mine, "age_s": round(age, 1), "max_reuse_s": spec.max_reuse_s,
            "records": {s: r.model_dump(mode="json") if (r := owner.stage(s)) else None for s in REUSED_STAGES}}


def adopt(run: Run, ssh_overrides: dict | None = None) -> dict:
    """At preflight, for a run with ``deployment.adopt``: use the kept deployment, or say why not (and stop the
    kept engines when the record is sound, so that they neither block this run's port nor stay up).
    Writes ``adoption.json``; returns it."""
    giver = run.cfg.deployment.adopt
    if giver is None:
        raise ConfigError(f"run {run.key} sets no deployment.adopt: there is no kept deployment to adopt")
    try:
        got = _verify(run, giver, ssh_overrides)
    except NotAdopted as no:
        got = {"adopted": False, "giver": giver, "why": str(no), "stopped": None}
        if no.sound and no.record:
            try:
                got["stopped"] = stop(no.record["owner"], [n for n in no.record.get("nodes") or []
                                                           if n in no.record["owner_nodes"]], ssh_overrides)
            except Exception as exc:  # noqa: BLE001 - the run goes on; leftovers are the lease's to clean
                got["stopped"] = f"error: {type(exc).__name__}: {exc}"
            _mark(giver, run.key, adopted=False)
        log.warning("run %s does not adopt the deployment of run %s: %s; it deploys on its own", run.key, giver,
                    got["why"])
    else:
        _mark(giver, run.key, adopted=True)
        log.info("run %s adopts the engines of run %s (kept by %s, preflight %.0f s old)", run.key, got["owner"],
                 giver, got["age_s"])
    got["at"] = _now().isoformat()
    _write_json(run.dir / ADOPTED, got)
    return got


def _mark(giver: str, taker: str, adopted: bool) -> None:
    """The giver's record says the taker took it over (or stopped it): the matrix's cleanup leaves it alone."""
    path = paths.run_dir(giver) / KEPT
    rec = _read_json(path)
    if rec is not None and rec.get("kept_for") == taker:
        _write_json(path, {**rec, "adopted_by": taker, "adopted": adopted, "taken_at": _now().isoformat()})


def reused_record(got: dict, stage: str) -> tuple[dict, str]:
    """(result, summary) of a stage that reused the owner's: its identity fields, and where they came from."""
    src = (got.get("records") or {}).get(stage) or {}
    res = src.get("result") or {}
    age = _age_s(src.get("finished_at"))
    reused = {"from": got["owner"], "via": got["giver"], "age_s": round(age, 1) if age is not None else None,
              "max_reuse_s": got["max_reuse_s"]}
    out = {k: res[k] for k in _IDENTITY_KEYS[stage] if k in res}
    if stage == "rollout":
        out["endpoints"] = got["endpoints"]
    if stage == "preflight":  # the fabric the owner's preflight read: part of the cluster's identity
        from deploybench.preflight.checks import fabric_identity

        out["fabric"] = {str(n.get("node")): fabric_identity(n.get("facts") or {}) for n in res.get("nodes") or []
                         if isinstance(n, dict) and n.get("node")}
    out["reused"] = reused
    what = {"preflight": "nodes and links checked", "fanout": "model verified on every node",
            "rollout": f"engines on {len(got['nodes'])} nodes, checked alive and answering"}[stage]
    return out, (f"reused from run {got['owner']} (age {reused['age_s']:.0f} s, at most {got['max_reuse_s']:g} s): "
                 f"{what} - {src.get('summary', '')}")


# -- the matrix's cleanup ----------------------------------------------------------------------------------------
def _finished(run_key: str) -> bool:
    """The run never started, or is past its teardown (its engines and lease are no longer its own business)."""
    from deploybench.run import STAGES, record_path

    d = paths.run_dir(run_key)
    if not (d / "run.json").is_file():
        return True
    return any(record_path(d, s).is_file() for s in STAGES[STAGES.index("teardown"):])


def cleanup(run_keys: list[str], dsn: str | None, ssh_for: Any = None) -> list[dict]:
    """After a matrix's cells: stop every kept deployment that its taker did not take over, and release a lease
    handed to a cell that never took it. ``ssh_for(run_key)``: the SSH overrides of a run. Idempotent."""
    from deploybench.lease import LeaseStore
    from deploybench.run import Run

    done = []
    for key in run_keys:
        rec = kept_record(key)
        if not rec or rec.get("adopted_by") or rec.get("cleaned_at"):
            continue
        taker, owner_key = rec.get("kept_for"), rec.get("owner")
        if not isinstance(taker, str) or not _finished(taker):
            continue  # the taker is still at work: adopting or deploying is its business
        store = LeaseStore(dsn)
        cluster = str(rec.get("cluster"))
        info = store.status(cluster)
        entry: dict[str, Any] = {"kept_by": key, "kept_for": taker, "owner": owner_key, "stopped": {},
                                 "released": False}
        holder = taker if info is not None and info.holder == taker else None
        if info is None or info.free:  # the taker let the lease go without stopping them: take it to stop them
            from deploybench.config import LeaseSpec
            from deploybench.lease import Holder, LeaseBusy

            try:
                store.acquire(cluster, Holder(f"{key}:cleanup", "deploybench_matrix"), LeaseSpec(on_busy="fail"))
                holder = f"{key}:cleanup"
            except LeaseBusy:
                holder = None
            info = store.status(cluster)
        if holder is not None and info is not None:
            try:
                if not isinstance(owner_key, str):
                    raise ValueError(f"the record names no owner run ({owner_key!r})")
                owner = Run.open(owner_key)
                nodes = [n for n in rec.get("nodes") or [] if n in owner.nodes]
                entry["stopped"] = stop(owner_key, nodes, ssh_for(owner_key) if ssh_for else None)
            except Exception as exc:  # noqa: BLE001 - left for the lease's leftover cleanup
                entry["stopped"] = {"*": f"error: {type(exc).__name__}: {exc}"}
            dirty = any(str(v).startswith("error") for v in entry["stopped"].values())
            entry["released"] = store.release(info.cluster, holder, leftovers=dirty,
                                              detail={"by": "matrix cleanup", "kept_by": key})
        else:
            entry["why"] = ("the lease is no longer the taker's: "
                            + (info.describe() if info else "no lease row") + " (its leftovers are the lease's)")
        _write_json(paths.run_dir(key) / KEPT, {**rec, "cleaned_at": _now().isoformat(), "cleanup": entry})
        log.warning("matrix cleanup: deployment of run %s kept by %s for %s, never taken over: %s", owner_key, key,
                    taker, entry)
        done.append(entry)
    return done
