"""Config matrices: a grid of run configurations, planned, validated and ordered before any cell runs.

A matrix is a base configuration (flat parameters, the trigger form's names), **axes** (a parameter
-> the values to sweep: the full grid) and/or explicit **treatments** (combinations, for when a full
grid would explode; treatments x axes when both are given), **constraints** that rule combinations
out (``deploybench.matrix.expr``), **repeats** per cell, and what to do with cells already measured
(``skip`` | ``rerun``).

``plan`` turns that into the list of cells, in the order they run:

1. expand the grid; drop the combinations a constraint rules out (each named with the constraint);
2. validate every cell - each axis value against the schema on its own (so a refusal names the
   parameter and the value), then each whole cell (``params.to_config``) and against its inventory
   (node count, canary size, ...). Any refusal raises ``MatrixError`` naming every bad cell: nothing
   starts;
3. order the cells so that those sharing a deployment (they differ only in load or SLO parameters)
   are adjacent (``deployment`` groups d1, d2, ... in the order they first appear);
4. mark the cells already measured - a successful, non-excluded stored run with the same
   configuration fingerprint, the same SLO and the same software (engine, image) - as ``skip`` with
   the run that measured them, unless ``on_measured`` is ``rerun``. With repeats, a cell measured
   m times runs only its missing repeats, so re-triggering or backfilling fills only the gaps;
5. chain the cells of a group that run (``share``): each keeps its engines running for the next and
   hands it the cluster's lease, the next adopts them instead of its own preflight, fan-out and
   rollout, so a group runs on one rollout (``deploybench.matrix.deployment``: what is checked before
   reuse, and ``reuse_s``, how old the preflight and fan-out may be);
6. estimate the wall time of the cells that run: an upper bound from the per-stage budgets
   (``deploybench.timeouts``) and an expected time from stored durations of the same configuration
   (else the configured durations plus a fixed per-run overhead).

Every cell that runs is one ``deploybench_run`` DAG run (the matrix DAG triggers it and waits,
deferred), with the conf a person would type for it plus three tags (``matrix``, ``matrix_cell``,
``matrix_deployment``), so its results in the store are those of a manual run of that conf; a
chained cell's conf also carries the hidden section ``deployment`` (keep_for / adopt), which is not
part of the fingerprint.

Nothing here imports Airflow; the store is reached only through the callables ``plan`` is given
(``deploybench.matrix.store`` has the real ones), so the planning is unit-tested without a database.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploybench import params as form
from deploybench import policy
from deploybench.config import LinkMode, LoadPhase, RunConfig, canonical_hash
from deploybench.engines import profile_name
from deploybench.errors import ConfigError
from deploybench.matrix.expr import Constraint, ConstraintError
from deploybench.rollout import capabilities

log = logging.getLogger(__name__)

MAX_CELLS = 256  # Airflow maps at most [core] max_map_length (1024) instances; a matrix past this is a typo
MAX_AXIS_VALUES = 64
OVERHEAD_S = 60.0  # scheduling ~13 task processes, lease, store and report of one run on a small cluster
RUN_DAG_ID = "deploybench_run"
# parameters that change only how the service is loaded or judged, not what is deployed
_NOT_DEPLOYMENT = {f.name for f in form.FIELDS if f.path[0] in ("load", "slo")} | {
    "lease_on_busy", "lease_wait_s", "lease_ttl_s", "lease_heartbeat_s", "tags"}
_SHORT = {"tensor_parallel_size": "tp"}  # label abbreviations a serving engineer reads at a glance
_FORM_ORDER = {f.name: i for i, f in enumerate(form.FIELDS)}


def in_form_order(names: Iterable[str]) -> list[str]:
    """Parameter names in the trigger form's order (what is deployed before how it is loaded). The order a
    matrix was written in does not survive Airflow's metadata database on PostgreSQL, which keeps a run's
    conf as JSONB (an object's keys come back by length, then name), so no order is taken from it."""
    return sorted(names, key=lambda n: (_FORM_ORDER.get(n, len(_FORM_ORDER)), n))
_DERIVED = ("replicas", "gpus_per_node", "gpus")


class MatrixError(ConfigError):
    """A matrix that cannot run as given: names every bad cell, its parameter and value. Nothing started."""


class MatrixSpec(BaseModel):
    """What the matrix form holds (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]] = Field(default_factory=dict, max_length=16)
    treatments: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_CELLS)
    constraints: list[str] = Field(default_factory=list, max_length=32)
    repeats: int = Field(1, ge=1, le=20)
    on_measured: Literal["skip", "rerun"] = "skip"
    reuse_s: float = Field(900.0, ge=0, le=86400)  # cells of one deployment share it this long; 0: each deploys

    @classmethod
    def from_params(cls, raw: dict[str, Any]) -> MatrixSpec:
        """From the matrix DAG's params (null fields mean empty); a bad shape raises MatrixError."""
        data = {k: v for k, v in raw.items() if k in cls.model_fields and v is not None}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise MatrixError(f"matrix form: {errs}") from None


@dataclass
class Cell:
    """One cell of the matrix, as planned: what it sets, its full conf, whether it runs and why."""

    index: int  # 1-based position in run order
    cell_id: str  # c01, or c01r2 for a second repeat
    label: str  # "max_num_seqs=64 tp=2" (the Grid's map index label)
    params: dict[str, Any]  # the values the axes/treatment set (on top of the base)
    repeat: int
    conf: dict[str, Any]  # what the cell's deploybench_run gets: base + params + matrix tags
    fingerprint: str  # RunConfig.fingerprint()
    measure_key: str  # fingerprint + SLO + software: "measured before" means this matched
    deployment: str  # d1, d2, ...: cells with the same one could share a rollout
    action: Literal["run", "skip"] = "run"
    reason: str = ""
    measured_by: list[str] = field(default_factory=list)
    trigger_run_id: str = ""
    run_key: str = ""  # the deploybench_run key it produces, or the stored run that measured it
    expected_s: float = 0.0
    upper_s: float = 0.0
    rollout_of: str = ""  # the cell whose rollout this one runs on (its group's first running cell), "" = its own

    @property
    def grid_label(self) -> str:
        """The Grid's map index label: the cell's values, and the rollout it reuses."""
        return self.label + (f" (on {self.rollout_of}'s rollout)" if self.rollout_of else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    matrix_key: str
    spec: dict[str, Any]
    cells: list[Cell]
    ruled_out: list[dict[str, Any]]  # {"label", "constraint"}
    deployments: dict[str, list[str]]  # d1 -> cell ids

    @property
    def to_run(self) -> list[Cell]:
        return [c for c in self.cells if c.action == "run"]

    @property
    def skipped(self) -> list[Cell]:
        return [c for c in self.cells if c.action == "skip"]

    def estimate(self) -> dict[str, float]:
        return {"expected_s": round(sum(c.expected_s for c in self.to_run), 1),
                "upper_s": round(sum(c.upper_s for c in self.to_run), 1)}

    def counts(self) -> dict[str, int]:
        return {"cells": len(self.cells), "run": len(self.to_run), "skipped": len(self.skipped),
                "ruled_out": len(self.ruled_out), "deployments": len(self.deployments)}

    def mapped(self) -> list[dict[str, Any]]:
        """One dict per cell for the matrix DAG's mapped trigger task (expand_kwargs)."""
        return [{"trigger_run_id": c.trigger_run_id, "conf": c.conf, "cell_label": c.grid_label,
                 "skip_reason": c.reason if c.action == "skip" else ""} for c in self.cells]

    def to_dict(self) -> dict[str, Any]:
        return {"matrix_key": self.matrix_key, "spec": self.spec, "cells": [c.to_dict() for c in self.cells],
                "ruled_out": self.ruled_out, "deployments": self.deployments, "counts": self.counts(),
                "estimate": self.estimate()}

    def summary(self) -> str:
        """What a person reads in the plan task's log before anything runs."""
        n, est = self.counts(), self.estimate()
        lines = [f"matrix {self.matrix_key}: {n['cells']} cells - {n['run']} will run, {n['skipped']} skipped "
                 f"(already measured), {n['ruled_out']} ruled out by constraints; {n['deployments']} deployment(s)",
                 f"estimated wall time of the cells that run: {_dur(est['expected_s'])} expected, at most "
                 f"{_dur(est['upper_s'])} (sum of the per-stage time budgets)"]
        for c in self.cells:
            what = (f"run   ~{_dur(c.expected_s)}" if c.action == "run" else "skip ") + f"  {c.deployment}"
            lines.append(f"  {c.cell_id:7} {what}  {c.label}" + (f"  - {c.reason}" if c.reason else ""))
        for r in self.ruled_out:
            lines.append(f"  ruled out  {r['label']}  - {r['constraint']}")
        for d, ids in self.deployments.items():
            if len(ids) > 1:
                lines.append(f"  {d}: cells {', '.join(ids)} differ only in load/SLO parameters (one deployment)")
        for owner, ids in self.shared_rollouts().items():
            lines.append(f"  cells {', '.join(ids)} run on the rollout of {owner}: its preflight (nodes, links), "
                         f"fan-out (model verified on every node) and engines are reused while at most "
                         f"{_dur(self.spec.get('reuse_s', 0))} old, after checking the engines still run and answer")
        return "\n".join(lines)

    def shared_rollouts(self) -> dict[str, list[str]]:
        """cell id whose rollout is reused -> every cell that runs on it (itself first)."""
        out: dict[str, list[str]] = {}
        for c in self.cells:
            if c.rollout_of:
                out.setdefault(c.rollout_of, [c.rollout_of]).append(c.cell_id)
        return out


def _dur(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def label_of(values: dict[str, Any]) -> str:
    """``max_num_seqs=64 tp=2``: the cell's own values, as the Grid shows them."""
    def show(v: Any) -> str:
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)
    return " ".join(f"{_SHORT.get(k, k)}={show(values[k])}" for k in in_form_order(values)) or "base"


def deployment_key(flat: dict[str, Any]) -> str:
    """Hash of what is deployed: the flat conf without load and SLO (and lease, tags) parameters."""
    return canonical_hash({k: v for k, v in flat.items() if k not in _NOT_DEPLOYMENT})


def software_of(cfg: RunConfig) -> dict[str, Any]:
    """The software a cell will run, as the store records it (identity.software): engine and image."""
    return {"engine": profile_name(cfg.engine), "image": cfg.engine.image}


def measure_key(cfg: RunConfig) -> str:
    """What 'measured before' matches: the run fingerprint, the SLO and the software."""
    return canonical_hash({"fingerprint": cfg.fingerprint(), "slo": cfg.slo.model_dump(mode="json"),
                           "software": software_of(cfg)})


# -- expansion ----------------------------------------------------------------------------------------
def combinations(spec: MatrixSpec) -> list[dict[str, Any]]:
    """treatments x the full grid of the axes (either may be absent): treatments in the order given, the
    grid with its axes in the form's order (``in_form_order``), the last varying fastest."""
    if not spec.axes and not spec.treatments:
        raise MatrixError("the matrix has no axes and no treatments; give axes such as "
                          "{\"max_num_seqs\": [32, 64], \"load_rate\": [2, 4]} or a list of treatments")
    for name, values in spec.axes.items():
        if not values or len(values) > MAX_AXIS_VALUES:
            raise MatrixError(f"axis {name!r} has {len(values)} values; give 1 to {MAX_AXIS_VALUES}")
    size = max(len(spec.treatments), 1) * math.prod(len(v) for v in spec.axes.values()) * spec.repeats
    if size > MAX_CELLS:
        raise MatrixError(f"the matrix has {size} cells (treatments x axes x repeats), at most {MAX_CELLS}; "
                          "use treatments or constraints to keep the combinations that matter")
    names = in_form_order(spec.axes)
    grid = [dict(zip(names, vals)) for vals in itertools.product(*(spec.axes[n] for n in names))]
    out = []
    for t in spec.treatments or [{}]:
        for g in grid:
            clash = sorted(set(t) & set(g))
            if clash:
                raise MatrixError(f"treatment {label_of(t)!r} and the axes both set {clash}; set each parameter "
                                  "in one place")
            cell = {**t, **g}
            out.append({k: cell[k] for k in in_form_order(cell)})
    return out


def _check_names(spec: MatrixSpec) -> None:
    known = {f.name for f in form.FIELDS}
    where = [("base", n) for n in spec.base] + [("axes", n) for n in spec.axes] + [
        (f"treatment {i}", n) for i, t in enumerate(spec.treatments, 1) for n in t]
    bad = [f"{w}: {n!r}" for w, n in where if n not in known]
    if bad:
        raise MatrixError(f"unknown parameter(s) {', '.join(bad)}; the matrix takes deploybench_run's form fields "
                          f"({', '.join(sorted(known))})")


def _value_errors(spec: MatrixSpec) -> dict[tuple[str, str], str]:
    """(parameter, repr(value)) -> why the schema refuses it on its own, over the base."""
    errors: dict[tuple[str, str], str] = {}
    values = [(n, v) for n, vs in spec.axes.items() for v in vs] + [(n, v) for t in spec.treatments
                                                                       for n, v in t.items()]
    for name, value in values:
        key = (name, repr(value))
        if key in errors:
            continue
        try:
            form.to_config({**spec.base, name: value})
        except ConfigError as exc:
            if name in str(exc) or _path_name(name) in str(exc):
                errors[key] = str(exc)
    return errors


def _path_name(name: str) -> str:
    f = next(f for f in form.FIELDS if f.name == name)
    return ".".join(f.path)


def _names(flat: dict[str, Any], cfg: RunConfig, nodes: list[str], inventory: Any) -> dict[str, Any]:
    """What a constraint may name: every form field (its effective value) + replicas, gpus_per_node, gpus."""
    gpus = []
    for n in nodes:
        raw = inventory.node(n).labels.get("gpus", "1")
        gpus.append(int(raw) if str(raw).isdigit() else 1)
    return {**form.from_config(cfg), **{k: v for k, v in flat.items() if k != "tags"},
            "replicas": len(nodes), "gpus_per_node": min(gpus, default=1), "gpus": sum(gpus)}


# -- the plan -----------------------------------------------------------------------------------------
Measured = Callable[[list[tuple[str, RunConfig]]], dict[str, list[str]]]
Durations = Callable[[list[RunConfig]], dict[str, float]]


def plan(spec: MatrixSpec, matrix_key: str, trigger_prefix: str, *, measured: Measured | None = None,
         durations: Durations | None = None, inventory_loader: Callable[[str], Any] | None = None) -> Plan:
    """Expand, validate, order, mark measured cells and estimate (see the module doc).

    ``trigger_prefix``: the start of every cell's deploybench_run run id (the cell id is appended), so a
    cell's run id is the same whenever this matrix run is planned again (clearing a cell re-runs it).
    ``measured(cells)``: measure_key -> run keys of stored runs that measured it (newest first), given
    (measure_key, RunConfig) pairs; ``durations(cfgs)``: fingerprint -> expected wall seconds of a run.
    """
    from deploybench.inventory import Inventory
    from deploybench.timeouts import stage_budget_s

    load_inventory = inventory_loader or Inventory.load
    _check_names(spec)
    combos = combinations(spec)
    value_errors = _value_errors(spec)
    constraints = []
    for text in spec.constraints:
        try:
            constraints.append(Constraint(text))
        except ConstraintError as exc:
            raise MatrixError(str(exc)) from None

    errors: list[str] = []
    kept: list[tuple[dict[str, Any], dict[str, Any], RunConfig]] = []
    ruled_out: list[dict[str, Any]] = []
    inventories: dict[str, Any] = {}
    for n, values in enumerate(combos, 1):
        label = label_of(values)
        bad = [f"{k}={v!r} is refused: {value_errors[(k, repr(v))]}" for k, v in values.items()
               if (k, repr(v)) in value_errors]
        if bad:
            errors.append(f"cell {n} ({label}): " + "; ".join(bad))
            continue
        flat = {**spec.base, **values}
        try:
            cfg = form.to_config(flat)
            policy.check(cfg, capabilities(cfg).needs_kube)  # the operator's policy, for every cell before any runs
            if cfg.inventory not in inventories:
                inventories[cfg.inventory] = load_inventory(cfg.inventory)
            inv = inventories[cfg.inventory]
            nodes = cfg.resolve_nodes(inv.names)
        except ConfigError as exc:
            errors.append(f"cell {n} ({label}): {exc}")
            continue
        try:
            names = _names(flat, cfg, nodes, inv)
            broken = next((c for c in constraints if not c.holds(names)), None)
        except ConstraintError as exc:
            raise MatrixError(f"cell {n} ({label}): {exc}") from None
        if broken is not None:
            ruled_out.append({"label": label, "constraint": f"ruled out by {broken.text!r}"})
            continue
        kept.append((values, flat, cfg))
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise MatrixError(f"{len(errors)} of {len(combos)} cells are invalid; nothing was started:\n  {shown}")
    if not kept:
        raise MatrixError(f"every one of the {len(combos)} combinations is ruled out by the constraints "
                          f"{spec.constraints}; nothing to run")

    # deployment groups, in order of first appearance; cells of one group adjacent
    groups: dict[str, list[tuple[dict, dict, RunConfig]]] = {}
    for item in kept:
        groups.setdefault(deployment_key({k: v for k, v in item[1].items()}), []).append(item)
    cells: list[Cell] = []
    deployments: dict[str, list[str]] = {}
    pos = 0
    for d_no, items in enumerate(groups.values(), 1):
        dep = f"d{d_no}"
        for values, flat, cfg in items:
            pos += 1
            for rep in range(1, spec.repeats + 1):
                cid = f"c{pos:02d}" + (f"r{rep}" if spec.repeats > 1 else "")
                label = label_of(values) + (f" #{rep}" if spec.repeats > 1 else "")
                tags = {**(flat.get("tags") or {}), "matrix": matrix_key, "matrix_cell": label,
                        "matrix_deployment": dep}
                trigger_run_id = f"{trigger_prefix}{cid}"
                cells.append(Cell(
                    index=len(cells) + 1, cell_id=cid, label=label, params=values, repeat=rep,
                    conf={**flat, "tags": tags}, fingerprint=cfg.fingerprint(), measure_key=measure_key(cfg),
                    deployment=dep, trigger_run_id=trigger_run_id,
                    run_key=f"{RUN_DAG_ID}__{trigger_run_id}"))
                deployments.setdefault(dep, []).append(cid)
    configs = {c.cell_id: form.to_config(c.conf) for c in cells}

    found = measured([(c.measure_key, configs[c.cell_id]) for c in cells]) if measured else {}
    for c in cells:
        runs = found.get(c.measure_key) or []
        c.measured_by = list(runs)
        if runs and c.repeat <= len(runs):
            prior = runs[c.repeat - 1]
            if spec.on_measured == "skip":
                c.action, c.run_key = "skip", prior
                c.reason = (f"already measured by run {prior} (successful, not excluded, same configuration, SLO "
                            "and software); on_measured=rerun measures it again")
            else:
                c.reason = f"measured before by {prior}; measured again (on_measured=rerun)"

    _share(cells, configs, spec.reuse_s)
    expected = durations(list(configs.values())) if durations else {}
    for c in cells:
        cfg = configs[c.cell_id]
        n_nodes = len(inventories[cfg.inventory].names) if not cfg.nodes else cfg.nodes
        c.upper_s = round(sum(stage_budget_s(cfg, t, n_nodes) for t in _tasks(cfg)), 1)
        c.expected_s = round(expected.get(c.fingerprint) or configured_s(cfg, n_nodes) + OVERHEAD_S, 1)
        if c.rollout_of:  # no preflight iperf3 rounds, no rollout gates
            c.expected_s = round(max(c.expected_s - deploy_s(cfg, n_nodes), 0.0), 1)
    result = Plan(matrix_key=matrix_key, spec=spec.model_dump(mode="json"), cells=cells, ruled_out=ruled_out,
                  deployments=deployments)
    log.info("%s", result.summary())
    return result


def _share(cells: list[Cell], configs: dict[str, RunConfig], reuse_s: float) -> None:
    """Chain the running cells of each deployment group: keep_for the next, adopt the previous (module doc, 5)."""
    if reuse_s <= 0:
        return
    groups: dict[str, list[Cell]] = {}
    for c in cells:
        if c.action == "run" and capabilities(configs[c.cell_id]).shares_deployments:
            groups.setdefault(c.deployment, []).append(c)
    for chain in groups.values():
        for prev, cur in zip(chain, chain[1:]):
            prev.conf["deployment"] = {**prev.conf.get("deployment", {}), "keep_for": cur.run_key,
                                       "max_reuse_s": reuse_s}
            cur.conf["deployment"] = {**cur.conf.get("deployment", {}), "adopt": prev.run_key,
                                      "max_reuse_s": reuse_s}
            cur.rollout_of = prev.rollout_of or prev.cell_id


def _tasks(cfg: RunConfig) -> list[str]:
    """A cell's tasks in the order they run: the stages, the load stage as one task per phase, the lease taken
    before preflight and released after teardown, then the run's verdict."""
    from deploybench.run import STAGES

    out: list[str] = []
    for s in STAGES:
        out += [p.value for p in cfg.load.phases] if s == "load" else [s]
        out += ["lease"] if s == "teardown" else []
    return [*out, "finish"]


def deploy_s(cfg: RunConfig, nodes: int) -> float:
    """The configured seconds of standing a deployment up: preflight's iperf3 rounds and the rollout's gates."""
    p, r = cfg.preflight, cfg.rollout
    rounds = 3 if p.link_mode is LinkMode.RING else max(nodes, 2)
    return rounds * p.iperf_seconds * (1 if p.bidir else 2) + len(cfg.scale_plan(nodes)) * (
        r.gate_warmup_s + r.gate_duration_s)


def configured_s(cfg: RunConfig, nodes: int) -> float:
    """Seconds a run's configured durations add up to (iperf3 tests, gates, load phases); no fixed costs."""
    ld = cfg.load
    total = deploy_s(cfg, nodes)
    if LoadPhase.PROBE in ld.phases:  # a typical search: about half its steps
        total += ld.probe_max_steps / 2 * (ld.probe_warmup_s + ld.probe_step_s)
    if LoadPhase.SUSTAINED in ld.phases:
        total += ld.warmup_s + ld.duration_s
    if LoadPhase.OVERLOAD in ld.phases:
        total += ld.warmup_s + ld.overload_ramp_s + ld.recovery_s
    return total
