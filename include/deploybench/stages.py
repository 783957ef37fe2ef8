"""The stages of a run as objects: one class per stage, one registry (``REGISTRY``), in the order they run.

Each stage declares its ``name``, its typed ``result`` (deploybench.records: what its record holds and what
store, report and pages read back), how it runs (``run``), when it is not done here and why (``skip``: the
backend deploys nothing, a matrix cell adopts the deployment an earlier cell kept), its summary line
(``summary``) and its time budget (``budget_s``, from the run's own durations: deploybench.timeouts).
``deploybench.pipeline.run_stage`` runs one through the recorder (deploybench.run.recording), under the
cluster's lease for the stages that touch nodes; the Airflow tasks and ``deploybench run`` call it.

A stage reads what the stages before it measured from their records (typed: ``Run.preflight_result`` and
the like), never from its caller, so a task can run on any worker of any executor that shares the run
folder, and a cleared task reads what the stages before it left.

What differs between the ssh, kubernetes and external backends is a capability of the run's Deployer
(deploybench.rollout.base.Capabilities): whether it copies the model, deploys engines, runs them on the
nodes' ports, may skip preflight, shares a deployment between matrix cells. Whether the run deploys or
adopts the engines a previous matrix cell kept is decided once, by preflight (``Adoption``), and read by
fan-out, rollout and teardown. A new stage is one class added to ``REGISTRY``; a new backend one Deployer
class registered in deploybench.rollout.BACKENDS.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, is_dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from deploybench import paths
from deploybench.config import LoadPhase, RolloutBackend
from deploybench.errors import StageFailed
from deploybench.records import (
    FanoutStage,
    KeptEngines,
    LoadStageResult,
    PreflightStage,
    ReportResult,
    RolloutStage,
    SkippedExternal,
    StageRecord,
    StoppedEngines,
    StoreResult,
    TeardownStage,
    ValidateResult,
    stage_result,
)
from deploybench.run import LOAD_PHASES, Run, check_owner, now, write_json
from deploybench.timeouts import stage_budget_s

if TYPE_CHECKING:
    from deploybench.rollout.base import Capabilities
    from deploybench.transport import Cluster

log = logging.getLogger(__name__)


def _check_session_rates(cfg: Any, scale: float) -> None:
    """A workload rated in sessions offers its rates x its mean turns in requests/s (load.phases.in_requests): the
    bounds the form's rates were checked against (config: the k6 VUs one generator holds, the rates' maximum) hold
    for what it will offer, not only for what was typed."""
    from deploybench.config import K6_VU_HEADROOM, MAX_K6_VUS
    from deploybench.errors import ConfigError

    if scale == 1.0:
        return
    peak, knob = cfg.load.peak_rate()
    name = knob.split()[0]
    if peak * scale > MAX_RATE:
        raise ConfigError(f"{knob}={peak:g} sessions/s of workload {cfg.load.workload!r} ({scale:.2f} turns each) "
                          f"offers {peak * scale:g} requests/s, past the {MAX_RATE:g} a run may offer; lower {name}")
    vus = peak * scale * cfg.slo.p99_latency_ms / 1000 * K6_VU_HEADROOM
    if not cfg.load.max_vus and vus > MAX_K6_VUS:
        raise ConfigError(f"{knob}={peak:g} sessions/s of workload {cfg.load.workload!r} ({scale:.2f} turns each, "
                          f"{peak * scale:g} requests/s) with slo_p99_latency_ms={cfg.slo.p99_latency_ms:g} sizes k6 "
                          f"at {vus:.0f} virtual users, past the {MAX_K6_VUS} one load generator holds in memory; "
                          f"lower {name}, or set k6_max_vus (at most {MAX_K6_VUS}) to cap them")


MAX_RATE = 100_000.0  # requests/s: the form's rate fields' own bound (config.LoadSpec), for what a run offers


def _rate_unit(name: str) -> str:
    """The unit of a run's rates: sessions/s for a conversation workload rated in sessions, else req/s."""
    from deploybench import workloads

    return "sessions/s" if workloads.workload(name).rate_scale() != 1.0 else "req/s"


def dump(result: Any) -> Any:
    """A typed result as its record holds it (JSON-ready)."""
    if isinstance(result, BaseModel):
        return result.model_dump(mode="json", by_alias=True)
    if is_dataclass(result) and not isinstance(result, type):
        return result.to_dict() if hasattr(result, "to_dict") else asdict(result)
    return result


@dataclass
class Skip:
    """A stage not done here: its result (what its record says instead) and why, for its summary line;
    ``record`` False: it leaves no record at all (a load phase the run did not ask for)."""

    result: Any
    summary: str
    record: bool = True


@dataclass
class Context:
    """What a stage works with: the run (its folder, config, inventory, nodes; opened when first asked for) and
    what the caller has: SSH settings from an Airflow connection, Kubernetes API clients, the results store's
    DSN, the load phase a load task runs, and for validate the trigger's parameters and how the run started."""

    run_key: str
    ssh_overrides: dict | None = None
    kube: Any = None
    dsn: str | None = None
    phase: str | None = None
    params: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    prometheus: Any = None  # a deploybench.load.prom.PromSource (or what parse_source takes): the team's Prometheus

    @functools.cached_property
    def run(self) -> Run:
        return Run.open(self.run_key)

    @functools.cached_property
    def caps(self) -> Capabilities:
        from deploybench import rollout

        return rollout.capabilities(self.run.cfg)

    def adoption(self, stage: str) -> Skip | None:
        """The record of ``stage`` when this run adopted the deployment a previous matrix cell kept (decided by
        preflight, read by fan-out and rollout): the owner's identity fields, and where they came from."""
        if not self.run.cfg.deployment.adopt:
            return None
        from deploybench.matrix import deployment

        got = deployment.adopt(self.run, self.ssh_overrides) if stage == "preflight" else deployment.adoption(self.run)
        if not got or not got.get("adopted"):
            return None
        result, summary = deployment.reused_record(got, stage)
        return Skip(stage_result(StageRecord(stage=stage, status="success", started_at=now(), result=result),
                                 self.run.dir), summary)


class Stage(ABC):
    """One stage of a run (the module docstring)."""

    name: ClassVar[str]
    result: ClassVar[Any]  # the typed result its record holds (deploybench.records)
    leased: ClassVar[bool] = True  # touches nodes: only under the cluster's lease (deploybench.run.LEASED_STAGES)
    after_failure: ClassVar[bool] = False  # runs whatever failed before: nothing to do if validate never passed
    # How a DAG runs it (deploybench.airflow.stages builds every task from these; nothing there names a stage):
    task: ClassVar[str] = ""  # its task's id inside a group named after the stage; "": the stage's name, no group
    phases: ClassVar[tuple[str, ...]] = ()  # one task per phase instead (in a group named after the stage)
    # what its task hands it: "ssh", "kube", "dsn", "params", "prometheus"
    needs: ClassVar[frozenset[str]] = frozenset()
    retries: ClassVar[bool] = False  # its task retries (safe: it reads the run folder and writes the store)
    # Its failures are verdicts on the run's input (it touches nothing): never retried. Its task retries once
    # only when the task failed outside deploybench's code (its process killed, the execution API unreachable).
    judges_input: ClassVar[bool] = False
    undoes: ClassVar[str | None] = None  # the stage whose work it undoes: its task is that one's Airflow teardown

    def skip(self, ctx: Context) -> Skip | None:
        """Why this stage is not done here (and the record it leaves instead); None: it runs."""
        return None

    def phases_not_asked(self, ctx: Context) -> list[str]:
        """Its phases this run does not ask for (a DAG marks their tasks skipped before they would start)."""
        return []

    @abstractmethod
    def run(self, ctx: Context, cluster: Cluster) -> Any:
        """Do the stage's work; returns its typed result (StageFailed, carrying what it measured, on failure)."""

    def measured(self, ctx: Context) -> tuple[Any, str] | None:
        """(result, summary) of what a failed ``run`` still measured, read after it raised; None: what its
        StageFailed carries."""
        return None

    @abstractmethod
    def summary(self, ctx: Context, result: Any) -> str:
        """One line for people: what the stage did."""

    def budget_s(self, ctx: Context) -> float:
        """Seconds its task may take, from the run's own durations (deploybench.timeouts)."""
        return stage_budget_s(ctx.run.cfg, self.name, len(ctx.run.nodes))

    def returns(self, ctx: Context, result: Any) -> Any:
        """What its task returns (the Grid's XCom tab): by default the result as its record holds it."""
        return dump(result)

    def task_log(self, ctx: Context, result: Any) -> str | None:
        """Text its task prints to its log beside the stage's summary line; None: nothing more."""
        return None


def _skipped_external(why: str) -> Skip:
    return Skip(SkippedExternal(skipped="external", deployed_by="not deployed by deploybench", nodes=[]),
                f"skipped (external backend: {why})")


def _engine_program(run: Run) -> str | None:
    """The program an engine profile starts (its command's first item), for preflight to find on the nodes:
    the inventory's python for ``{python}``; None when the item is another placeholder."""
    from deploybench.engines import profile

    program = profile(run.cfg.engine).program
    if program == "{python}":
        return run.inventory.python
    return program if program and "{" not in program else None


class Preflight(Stage):
    name = "preflight"
    result = PreflightStage
    task = "nodes_and_links"
    needs = frozenset({"ssh"})

    def skip(self, ctx: Context) -> Skip | None:
        if (adopted := ctx.adoption(self.name)) is not None:
            return adopted
        if ctx.caps.optional_preflight and not ctx.run.cfg.rollout.external_preflight:
            return _skipped_external("rollout.external_preflight is off")
        return None

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import preflight

        run = ctx.run
        # Engines this run starts on the nodes need their port free and their binary there; pods do not.
        on_nodes = ctx.caps.engines_on_nodes
        runtime = run.cfg.engine.runtime.value  # docker/podman: the engine runs in a container
        binary = runtime if runtime != "process" else _engine_program(run)
        return preflight.run(cluster, run.nodes, run.cfg.preflight, source=run.source, model_name=run.cfg.model.name,
                             engine_port=run.cfg.rollout.port if on_nodes else None,
                             engine_binary=binary if on_nodes else None)

    def summary(self, ctx: Context, result: Any) -> str:
        worst = min((lt for lt in result.links if lt.ratio is not None), key=lambda lt: lt.ratio or 0.0, default=None)
        return f"{len(result.healthy)}/{len(ctx.run.nodes)} nodes healthy, {len(result.links)} links tested" + (
            f", worst {worst.src}->{worst.dst} {worst.mbit:.0f} Mbit/s ({worst.ratio:.0%} of nominal)" if worst else "")

    def returns(self, ctx: Context, result: Any) -> Any:
        return healthy_nodes(ctx.run)


def healthy_nodes(run: Run) -> list[str]:
    """The nodes preflight kept (every node of the run when it was skipped)."""
    pf = run.preflight_result()
    return list(run.nodes) if pf is None or isinstance(pf, SkippedExternal) else list(pf.healthy)


class Fanout(Stage):
    name = "fanout"
    result = FanoutStage
    task = "copy_and_verify"
    needs = frozenset({"ssh"})

    def skip(self, ctx: Context) -> Skip | None:
        if (adopted := ctx.adoption(self.name)) is not None:
            return adopted
        if not ctx.caps.copies_model:
            return _skipped_external("the engines already hold their model")
        return None

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import fanout

        run = ctx.run
        return fanout.run(cluster, healthy_nodes(run), run.source, run.cfg.model.name, run.cfg.fanout,
                          policy=run.cfg.preflight.policy, min_nodes=run.cfg.preflight.min_nodes)

    def summary(self, ctx: Context, result: Any) -> str:
        copied = [c for c in result.nodes if c.status == "copied"]
        return (f"{result.total_bytes / 2**20:.0f} MiB model ({result.manifest_digest[:12]}) verified on "
                f"{len(result.verified_nodes)} nodes by {result.strategy} in {result.seconds:.1f} s: "
                f"{len(copied)} copied, {sum(c.status == 'repaired' for c in result.nodes)} repaired, "
                f"{sum(c.status == 'skipped' for c in result.nodes)} already held it"
                + (f", {len(result.nodes) - len(result.verified_nodes)} left out"
                   if len(result.verified_nodes) < len(result.nodes) else ""))

    def returns(self, ctx: Context, result: Any) -> Any:
        return verified_nodes(ctx.run)


def verified_nodes(run: Run) -> list[str]:
    """The nodes that hold the verified model: fan-out's own; the healthy ones when it was skipped (or when a
    reused record does not name them); never a node a fan-out of this run did not verify."""
    from deploybench.fanout.result import FanoutResult

    fo = run.fanout_result()
    if isinstance(fo, FanoutResult):
        return list(fo.verified_nodes)
    if fo is None or isinstance(fo, SkippedExternal):
        return healthy_nodes(run)
    return list(fo.verified_nodes) or healthy_nodes(run)


class Rollout(Stage):
    name = "rollout"
    result = RolloutStage
    task = "canary_then_scale"
    needs = frozenset({"ssh", "kube"})

    def skip(self, ctx: Context) -> Skip | None:
        return ctx.adoption(self.name)

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import rollout
        from deploybench.records import ExternalRollout, RolloutResult
        from deploybench.rollout import external

        run = ctx.run
        if not ctx.caps.deploys:  # engines started elsewhere: the given endpoints, checked ready
            return ExternalRollout.model_validate(external.run(run.cfg, run.nodes, verified_nodes(run)))
        res: RolloutResult = rollout.run(cluster, verified_nodes(run), run.cfg, out_dir=run.dir / "rollout",
                                         kube=ctx.kube)
        return res

    def summary(self, ctx: Context, result: Any) -> str:
        from deploybench.rollout import external

        if not ctx.caps.deploys:
            return (f"skipped (external backend): {len(result.endpoints)} given endpoints of the {result.profile} "
                    f"engine ready, {external.NOT_DEPLOYED}")
        slowest = max((v for s in result.steps for v in s.ready_s.values()), default=0.0)
        return (f"{result.profile} engine ({result.backend}) on {len(result.endpoints)} nodes in steps "
                + " -> ".join(f"{s.nodes}" for s in result.steps) + f" (slowest ready {slowest:.1f} s), every gate "
                "passed")

    def returns(self, ctx: Context, result: Any) -> Any:
        return ctx.run.endpoints()


class Load(Stage):
    """One load phase per task (``ctx.phase``); the record 'load' is rebuilt from every phase run so far
    (deploybench.load.phases.assemble): the headline phase's LoadResult with ``phases``, ``capacity`` and
    ``series``. The endpoints are those of the run's latest rollout record (a cleared phase re-deploys first,
    so it reads the endpoints of that new rollout)."""

    name = "load"
    result = LoadStageResult
    phases = LOAD_PHASES
    # nodes without DCGM metrics report their GPUs through nvidia-smi; the team's Prometheus (optional) is asked for
    # every node's figures over each window
    needs = frozenset({"ssh", "prometheus", "kube"})  # kube: a k6-operator TestRun sends the phase (opt-in)

    def phases_not_asked(self, ctx: Context) -> list[str]:
        asked = {p.value for p in ctx.run.cfg.load.phases}
        return [p for p in self.phases if p not in asked]

    def skip(self, ctx: Context) -> Skip | None:
        if ctx.phase in self.phases_not_asked(ctx):
            return Skip(None, f"load phase {ctx.phase!r} is not in this run's load_phases", record=False)
        ro = ctx.run.stage("rollout")
        if ro is None or ro.status != "success":
            raise StageFailed(f"load {ctx.phase}: run {ctx.run_key} has no successful rollout to load (rollout "
                              f"record: {ro.status if ro else 'missing'})")
        return None

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import engines
        from deploybench.load import Endpoint, loadgen, phases, prom

        run, phase = ctx.run, str(ctx.phase)
        out_dir = run.dir / "load"
        if phase == phases.first_asked(run.cfg.load.phases):  # in the ORDER they run, not as load_phases lists them
            for old in out_dir.glob("*.result.json") if out_dir.is_dir() else []:
                old.unlink()  # the first phase of a (re-)run starts clean
        prof = engines.profile(run.cfg.engine)  # its API, its metrics page and the names of its figures
        addr = {n.name: n.address for n in run.inventory.nodes}  # the node's exporters (on Kubernetes: not the pod's)
        eps = [Endpoint.of(e, prof.metrics.url(e["url"]), addr.get(e["node"], "")) for e in self._served(ctx)]
        # the transports let nodes without DCGM metrics report their GPUs through nvidia-smi (lazy: no connection
        # is made unless a node needs it)
        # the inventory's load generators split each k6 run by execution segments; none: the controller sends it all
        gens: Any = loadgen.Generators(cluster, run.inventory.loadgen_names) if run.inventory.loadgens else None
        k8s = run.cfg.rollout.kubernetes
        if run.cfg.rollout.backend == RolloutBackend.KUBERNETES and k8s.k6_operator.parallelism:
            from deploybench.load.kube_load import KubeLoad

            # opt-in: a k6-operator TestRun on the run's cluster sends each phase (deploybench.load.kube_load)
            gens = KubeLoad(ctx.kube, k8s.namespace, k8s.k6_operator, run.key)
        grow: Any = None
        try:
            first = eps
            if phase == LoadPhase.SPIKE.value and run.cfg.load.scale_up:
                grow, first = self._scale_down(ctx, cluster, eps)
            out = phases.run_phase(phase, first, run.cfg.load, run.cfg.slo, out_dir, tags={"run": run.key},
                                   transports={n: cluster[n] for n in {e.node for e in eps}},
                                   api="triton" if prof.api == "triton" else None, metrics=prof.metrics,
                                   max_model_len=run.cfg.engine.max_model_len, generators=gens,
                                   prices={n.name: run.inventory.price_of(n) for n in run.inventory.nodes},
                                   prometheus=prom.parse_source(ctx.prometheus), grow=grow)
        except BaseException as exc:
            self._restore(grow, exc)
            self._record_live(ctx, grow, exc)
            raise
        try:
            self._restore(grow, None)
        except BaseException as exc:  # some engines did not come back: the later phases load those that did
            self._record_live(ctx, grow, exc)
            raise
        self._record_live(ctx, grow, None)
        up = (out.get("analysis") or {}).get("scale_up") or {}
        bad = [f"{a['node']}: {a['error']}" for a in up.get("added") or [] if a.get("error")]
        if bad:  # the phase's figures are written; the engines the later phases expect are not all there
            raise StageFailed(f"load spike: scale-up under load could not add every engine ({'; '.join(bad)[:2000]}); "
                              "the recovery and the other figures are in the phase's record")
        return self._assembled(ctx)

    @staticmethod
    def _served(ctx: Context) -> list[dict[str, Any]]:
        """The engines this phase loads: those a scale-up phase recorded as serving after it (kubernetes: the
        scale-down and up made new pods at new addresses) for the run's current rollout, else the rollout's."""
        from deploybench.load.scale_up import read_live

        ro = ctx.run.stage("rollout")
        live = read_live(ctx.run.dir / "load", ro.started_at) if ro is not None else None
        return live if live is not None else ctx.run.endpoints()

    @staticmethod
    def _record_live(ctx: Context, grow: Any, failed: BaseException | None) -> None:
        """After a scale-up phase whose deployer's engines are not where the rollout recorded them (kubernetes: new
        pods), the engines serving now, for the later phases and a retry (``load/endpoints.json``)."""
        from deploybench.load.scale_up import write_live

        ro = ctx.run.stage("rollout")
        if grow is None or grow.deployer.capabilities.engines_on_nodes or ro is None:
            return  # ssh: the same engines at the same addresses
        try:
            path = write_live(ctx.run.dir / "load", ro.started_at, grow.deployer.endpoints())
        except Exception as err:  # noqa: BLE001 - after the phase's own error: logged beside it
            if failed is None:
                raise StageFailed(f"load spike: the engines serving after the scale-up could not be recorded for the "
                                  f"later phases: {err}"[:2000]) from err
            log.error("load spike: after the phase failed (%s), the engines serving could not be recorded: %s",
                      failed, err)
            return
        log.info("load spike: the later phases load the engines serving now (%s)", path)

    @staticmethod
    def _restore(grow: Any, failed: BaseException | None) -> None:
        """Every engine serving again when the spike never asked for them (``ScaleUp.restore``). After the phase's
        own error (``failed``) a restore error is logged and chained to it, never put in its place."""
        if grow is None:
            return
        errors: list[Exception] = []
        try:  # a start under way (kubernetes: applying the autoscaler, patching) ends first, never beside settle
            grow.cancel()
        except Exception as err:  # noqa: BLE001 - reported as the steps' errors are
            errors.append(err)
        # kubernetes: the phase's autoscaler deleted and the replicas back (settle); then the engines the spike never
        # asked for started again (restore): each tried even when the other failed
        for step in (grow.deployer.settle, grow.restore):
            try:
                step()
            except Exception as err:  # noqa: BLE001 - the first is reported below
                errors.append(err)
        if not errors:
            return
        first = errors[0]
        if failed is None:
            raise StageFailed(f"load spike: the engines stopped for the scale-up could not serve again: {first}"
                              ) from first
        log.error("load spike: after the phase failed (%s), the engines stopped for the scale-up could not serve "
                  "again: %s", failed, first)
        failed.add_note(f"and the engines stopped for the scale-up could not serve again: {first}"[:2000])
        if failed.__context__ is None:
            failed.__context__ = first

    @staticmethod
    def _scale_down(ctx: Context, cluster: Cluster, eps: list) -> tuple[Any, list]:
        """Scale-up under load (deploybench.load.scale_up): stop the engines past ``scale_up_from`` through the run's
        deployer (the rollout's own), and the ScaleUp that starts them again at the spike's start."""
        from deploybench import rollout
        from deploybench.engines import ready_timeout_s
        from deploybench.load.scale_up import ScaleUp

        cfg = ctx.run.cfg
        nodes = [e.node for e in eps]
        keep = nodes[:cfg.load.scale_up_from]
        if len(keep) >= len(nodes):
            raise StageFailed(f"load spike: scale_up_from={cfg.load.scale_up_from} leaves none of the {len(nodes)} "
                              f"serving nodes ({', '.join(nodes)}) to add; lower scale_up_from")
        dep = rollout.deployer(cluster, list(ctx.run.nodes), cfg, ctx.kube)
        dep.take_over(nodes)  # the rollout's engines, this run's own
        timeout = ready_timeout_s(cfg)
        grow = ScaleUp(dep, keep, eps, timeout)
        try:
            # ssh: the engines past keep stop; kubernetes: the stable Deployment scales down and the cluster
            # chooses which pods go (the nodes still serving are then those it kept)
            left = set(dep.shrink(keep, timeout))
            kept = [n for n in nodes if n in left]
            if len(kept) != len(left) or not kept or len(kept) >= len(nodes):
                raise StageFailed(f"load spike: scaled down to {sorted(left)} for the scale-up, which is not "
                                  f"{len(keep)} of the serving nodes ({', '.join(nodes)})")
            if kept != keep:
                grow = ScaleUp(dep, kept, eps, timeout)
        except BaseException as exc:  # stopped some, not all: those it stopped serve again before the error goes up
            # BaseException: Airflow's AirflowTaskTimeout / AirflowTaskTerminated are not Exceptions, and Load.run has
            # no ScaleUp to restore until this returns
            Load._restore(grow, exc)
            raise
        log.info("load spike: serving on %s; %s start when the spike does", kept, grow.added)
        return grow, [e for e in eps if e.node in kept]

    def _assembled(self, ctx: Context) -> LoadStageResult:
        from deploybench.load import phases

        data = phases.assemble(ctx.run.dir / "load", ctx.run.cfg.load)
        # the contract the store reads: a mismatch fails here, named
        return LoadStageResult.of(StageRecord(stage="load", status="success", started_at=now(), result=data),
                                  ctx.run.dir)

    def measured(self, ctx: Context) -> tuple[Any, str] | None:
        got = self._assembled(ctx)
        return got, self.summary(ctx, got)

    def summary(self, ctx: Context, result: Any) -> str:
        from deploybench.load import phases

        return phases.summary(dump(result))

    def budget_s(self, ctx: Context) -> float:
        return stage_budget_s(ctx.run.cfg, str(ctx.phase or LoadPhase.SUSTAINED.value), len(ctx.run.nodes))

    def returns(self, ctx: Context, result: Any) -> Any:
        done = result.phases.get(str(ctx.phase))
        return {"phase": ctx.phase, "slo_ok": done.result.slo_ok if done and done.result else None,
                "capacity_rps": result.capacity.capacity_rps}


class Teardown(Stage):
    """Stops the engines of the run on every node (or deletes its Kubernetes objects); always runs, safe twice.
    A matrix cell that keeps its engines for the next cell leaves them running (deploybench.matrix.deployment),
    and one that adopted a kept deployment stops that one too."""

    name = "teardown"
    result = TeardownStage  # StoppedEngines (node or object -> "stopped" | "error: ..."), or KeptEngines
    leased = False  # it stops only this run's own engines (per-run pid files, objects labelled with its key)
    after_failure = True
    needs = frozenset({"ssh", "kube"})
    undoes = "rollout"

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import rollout

        run = ctx.run
        if run.cfg.deployment.keep_for and (kept := self._keep(ctx)) is not None:
            return kept
        theirs = self._stop_adopted(ctx)  # first: an adopted engine answers on the port this run checks
        stopped = rollout.teardown(cluster, run.nodes, run.cfg, kube=ctx.kube)
        got = StoppedEngines({**stopped, **{n: s for n, s in theirs.items() if stopped.get(n, "stopped") == "stopped"}})
        if errors := got.errors():
            raise StageFailed("teardown: " + "; ".join(f"{n}: {s}" for n, s in errors.items()), got.root)
        return got

    def summary(self, ctx: Context, result: Any) -> str:
        if isinstance(result, KeptEngines):
            kept = result.kept
            return (f"engines of run {kept.owner} left running on {', '.join(kept.nodes)} for run "
                    f"{kept.kept_for} (deployment.keep_for); it stops them, or the matrix's cleanup does")
        return ctx.caps.stopped.format(n=f"{len(result.root)}/{len(result.root)}")

    def _keep(self, ctx: Context) -> KeptEngines | None:
        """Leave the engines up for the run ``deployment.keep_for`` names when they are worth it; None: they are
        stopped as usual (the log says why not)."""
        from deploybench.matrix import deployment

        kept = deployment.keep(ctx.run, ctx.ssh_overrides)
        if not kept.get("kept"):
            log.warning("run %s stops its engines instead of keeping them for run %s: %s", ctx.run.key,
                        ctx.run.cfg.deployment.keep_for, kept.get("why"))
            return None
        return KeptEngines.model_validate({"kept": kept})

    def _stop_adopted(self, ctx: Context) -> dict[str, str]:
        """The engines this run adopted from another (and keeps for nobody): stopped with its own."""
        if not ctx.run.cfg.deployment.adopt:
            return {}
        from deploybench.matrix import deployment

        owner = deployment.adopted_owner(ctx.run)
        if owner is None:
            return {}
        nodes = (deployment.adoption(ctx.run) or {}).get("nodes") or []
        return deployment.stop(owner, [n for n in nodes if n in ctx.run.nodes], ctx.ssh_overrides)


def check_load_senders(cfg: Any, inv: Any) -> None:
    """Refuse (ConfigError) two senders of one phase's load: the k6-operator's TestRun would silently replace the
    inventory's load generators (deploybench.load.kube_load)."""
    from deploybench.errors import ConfigError

    par = cfg.rollout.kubernetes.k6_operator.parallelism
    if par and inv.loadgens:
        raise ConfigError(f"k6_operator.parallelism={par} sends every load phase from a k6-operator TestRun, but "
                          f"inventory {cfg.inventory!r} also lists load generators ({', '.join(inv.loadgen_names)}), "
                          "which would be left unused; set parallelism=0 to use the load generators, or use an "
                          "inventory without them")


class Validate(Stage):
    """The trigger's parameters -> a RunConfig, within the operator's policy, checked against the inventory;
    writes run.json. Nothing touches a node here."""

    name = "validate"
    result = ValidateResult
    leased = False
    judges_input = True
    needs = frozenset({"params", "prometheus"})  # a malformed Prometheus connection is refused here, not at load

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import params as form
        from deploybench import policy, rollout, workloads
        from deploybench.errors import ConfigError
        from deploybench.inventory import Inventory
        from deploybench.load import prom
        from deploybench.matrix import planned

        prom.parse_source(ctx.prometheus)
        cfg, preset = form.configure(ctx.params or {})
        if preset is not None:  # what the form's preset did, in the task log and in run.json
            log.info("run %s: %s", ctx.run_key, preset.describe())
        policy.check(cfg, rollout.capabilities(cfg).needs_kube)  # what the form chose, within what the operator allows
        planned.verify(ctx.run_key, cfg)  # a matrix cell's run id and 'deployment' section: only as its plan wrote them
        inv = Inventory.load(cfg.inventory)
        names = cfg.resolve_nodes(inv.names)
        rollout.backend(cfg).validate_config(cfg, names)  # what the backend cannot run, before any node is touched
        if cfg.load.scale_up and inv.loadgens:
            raise ConfigError(f"scale_up=true runs the spike phase's k6 on the controller (it re-reads its targets "
                              f"from a page on the controller's loopback), but inventory {cfg.inventory!r} lists load "
                              f"generators ({', '.join(inv.loadgen_names)}); use an inventory without them for this "
                              "run, or set scale_up=false")
        check_load_senders(cfg, inv)
        caps = rollout.capabilities(cfg)
        if cfg.load.scale_up and not caps.scales_under_load:
            how = ("measures engines it did not start (it cannot add any)" if not caps.deploys else
                   "cannot start engines one by one")
            raise ConfigError(f"scale_up=true starts engines while the spike runs, which the "
                              f"{cfg.rollout.backend.value} backend does not: it {how}; use the ssh or kubernetes "
                              "backend, or set scale_up=false")
        work = workloads.workload(cfg.load.workload)  # an unknown name, a bad file: refused here
        work.check_fits(cfg.load.prompt_tokens, cfg.load.output_tokens, cfg.load.output_spread,
                        cfg.engine.max_model_len, [p.value for p in cfg.load.phases])
        _check_session_rates(cfg, work.rate_scale())
        write_json(paths.run_dir(ctx.run_key) / "run.json", {
            "run_key": ctx.run_key, "config": cfg.model_dump(mode="json"), "nodes": names,
            "meta": {**(ctx.meta or {}), "started_at": now()}, "fingerprint": cfg.fingerprint(),
            "preset": preset.record() if preset else None, "workload": work.summary(),
        })
        return ValidateResult(nodes=names, fingerprint=cfg.fingerprint())

    def summary(self, ctx: Context, result: Any) -> str:
        from deploybench.engines import profile_name

        cfg = ctx.run.cfg
        return (f"{len(result.nodes)} nodes of inventory {ctx.run.inventory.name!r}, engine "
                f"{profile_name(cfg.engine)}, load {cfg.load.rate:g} {_rate_unit(cfg.load.workload)} for "
                f"{cfg.load.duration_s:g} s")

    def budget_s(self, ctx: Context) -> float:
        from deploybench.timeouts import FIXED_S

        return FIXED_S[self.name]

    def returns(self, ctx: Context, result: Any) -> Any:
        return result.nodes

    @staticmethod
    def clear(run_key: str) -> None:
        """A (re-)validated run starts clean: its stage records go (never another run's folder's)."""
        d = paths.run_dir(run_key)
        check_owner(d, run_key)  # before anything in it is deleted
        for old in (d / "stages").glob("*.json") if (d / "stages").is_dir() else []:
            old.unlink()


class Store(Stage):
    """The run, its identities, every stage's facts, the load phases and the raw samples into the results store,
    in one transaction (deploybench.store.ingest); runs whatever failed before, a retry replaces."""

    name = "store"
    result = StoreResult
    leased = False
    after_failure = True
    task = "write_results"
    needs = frozenset({"dsn"})
    retries = True

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench.analyse.findings import run_findings
        from deploybench.store import ingest

        return StoreResult(ingest.store_run(ctx.run, ctx.dsn, findings=run_findings(ctx.run)))

    def summary(self, ctx: Context, result: Any) -> str:
        return f"run {ctx.run_key} stored: " + ", ".join(f"{k} {v}" for k, v in result.root.items())


class Report(Stage):
    """The run's HTML report, with the change points of its series' history and the verdict on it."""

    name = "report"
    result = ReportResult
    leased = False
    after_failure = True
    task = "render"
    needs = frozenset({"dsn"})
    retries = True

    def run(self, ctx: Context, cluster: Cluster) -> Any:
        from deploybench import report

        history = report.history_for(ctx.run, ctx.dsn)  # change points of the run's series; None if not stored
        path = report.write_html(ctx.run, history)
        return ReportResult(path=str(path), verdicts=history.verdicts if history else None,
                            verdict_line=report.verdict_line(history) if history else "")

    def summary(self, ctx: Context, result: Any) -> str:
        return f"report at {result.path}" + (f"; {result.verdict_line}" if result.verdict_line else "")

    def returns(self, ctx: Context, result: Any) -> Any:
        return result.path

    def task_log(self, ctx: Context, result: Any) -> str | None:
        from deploybench import report

        return report.summary_text(ctx.run)  # the run's summary table, in the task log


# The run's stages in the order they run (the lease is taken after validate and released after teardown:
# deploybench.pipeline); the DAG's tasks, the reports' stage table, the store's stage rows and the CLI follow it.
REGISTRY: dict[str, Stage] = {s.name: s for s in (Validate(), Preflight(), Fanout(), Rollout(), Load(), Teardown(),
                                                  Store(), Report())}
