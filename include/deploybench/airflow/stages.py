"""The tasks of one deploy-and-benchmark run, declared into the DAG being built.

    validate -> lease.acquire -> preflight -> fanout -> rollout -> load (probe, sustained, overload)
             -> teardown -> lease.release -> store -> report -> finish

Every DAG that runs a benchmark (``deploybench_run``, the scheduled regression benchmark) calls
``run_stages`` once, so every stage shows in its Grid and a run is the same run whichever DAG
started it. The tasks and their order come from the stage registry (deploybench.stages.REGISTRY: each stage's
class says its task id, what its task hands it, whether it renews the lease, runs after failures, retries,
and which stage's work it undoes), so a stage registered there is a task here with no line added. Each task
calls one function of ``deploybench.pipeline``.

Airflow's own lifecycle keeps the cluster clean: taking the lease and the rollout are *setup*
tasks, releasing the lease and stopping the engines their *teardowns*. Clearing a load phase
takes the lease again, re-deploys, and stops and releases after it; marking a run failed still
stops the engines and releases the lease. Tasks that touch nodes renew the lease while they work
and stop with a clear error if it was broken. Every task's ``execution_timeout`` comes from the
run's own durations (``deploybench.timeouts``). Store and report run whatever failed before and
retry; ``finish`` fails the run if any stage failed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from airflow.sdk import Param, TriggerRule, get_current_context, task, task_group
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException, DownstreamTasksSkipped

from deploybench import params as form
from deploybench import paths

# Celery queues a run's tasks are spread over, in turn ("worker-1,worker-2"; empty: Airflow's default queue). Read
# when the DAG is parsed. The compose stack's Celery check sets it so that consecutive tasks land on different
# workers, each with its own disk: what one task writes, the next reads through the results database. A task's queue
# comes from its place in the chain (``chain_order``), so every parse of every DAG file gives it the same one.
QUEUES_ENV = "DEPLOYBENCH_TASK_QUEUES"


def chain_order() -> list[tuple[str, str | None]]:
    """The run's tasks in the order ``run_stages`` chains them, as (stage, phase or task): the stages before the
    lease, its acquire, the leased stages' tasks (a phased stage's phases), the undoing stage, the lease's release,
    the stages after failures, finish."""
    from deploybench.stages import REGISTRY

    stages = list(REGISTRY.values())

    def tasks(st: Any) -> list[tuple[str, str | None]]:
        return [(st.name, p) for p in st.phases] if st.phases else [(st.name, None)]

    order = [t for s in stages if not s.leased and not s.after_failure for t in tasks(s)]
    order.append(("lease", "acquire"))
    order += [t for s in stages if s.leased for t in tasks(s)]
    order += [t for s in stages if s.undoes for t in tasks(s)]
    order.append(("lease", "release"))
    order += [t for s in stages if s.after_failure and not s.undoes for t in tasks(s)]
    order.append(("finish", None))
    return order


def queue_of(stage: str, phase: str | None = None) -> dict[str, str]:
    """``{"queue": ...}`` for one task, by its place in ``chain_order`` over $DEPLOYBENCH_TASK_QUEUES (consecutive
    tasks on different queues); {} when it is unset."""
    queues = [q.strip() for q in os.environ.get(QUEUES_ENV, "").split(",") if q.strip()]
    if not queues:
        return {}
    order = chain_order()
    at = order.index((stage, phase)) if (stage, phase) in order else 0
    return {"queue": queues[at % len(queues)]}


RETRY = {"retries": 3, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": True,
         "max_retry_delay": timedelta(minutes=5)}
# A stage that judges the input (validate): one retry for a task that failed before its verdict (a CI run saw
# validate fail under load with no stage record, so no verdict was reached); a verdict fails at once.
RETRY_OUTSIDE = {"retries": 1, "retry_delay": timedelta(seconds=5)}


def run_params() -> dict[str, Param]:
    """The trigger form: one Param per field of ``deploybench.params`` (schema read from RunConfig), in the form's
    order: the everyday fields and the preset first (no section: the form's first section, open when the form
    opens), then the named sections, closed (``deploybench.params.SECTIONS``)."""
    return {name: Param(default, **schema) for name, (default, schema) in form.trigger_form().items()}


def run_key(context: Any = None) -> str:
    """The run key of the current task's DAG run: the run folder's name and the store's idempotency key."""
    ctx = context or get_current_context()
    return paths.dag_run_key(ctx["dag"].dag_id, ctx["run_id"])


def ssh(key: str) -> dict | None:
    """SSH settings from the inventory's Airflow SSH connection (None before validate or without one)."""
    from deploybench.airflow.connections import ssh_overrides
    from deploybench.run import Run

    run = Run.open_if_validated(key)
    return ssh_overrides(run.inventory.ssh.conn_id) if run else None


def kube(key: str) -> Any:
    """Kubernetes API clients when the run's backend needs them (its capabilities), else None."""
    from deploybench import rollout
    from deploybench.airflow.connections import kube_clients
    from deploybench.run import Run

    run = Run.open_if_validated(key)
    needs = run is not None and rollout.capabilities(run.cfg).needs_kube
    return kube_clients(run.cfg.rollout.kubernetes.conn_id) if run is not None and needs else None


def _dsn() -> str | None:
    from deploybench.airflow.connections import results_dsn

    return results_dsn()


def run_folder(key: str, only_run_json: bool = False) -> contextlib.AbstractContextManager[None]:
    """``with run_folder(key):`` around one task's work on a run: the run's folder on this worker is pulled from
    the results database before and what the task wrote is pushed after, failed or stopped or not
    (deploybench.store.run_sync.synced), so the next task finds it on any worker of any executor. Nothing happens
    without a results database. A matrix cell also brings its matrix's folder (the plan it is checked against) and
    its sibling cells' records (the engines one cell keeps for the next). ``only_run_json``: just the run's run.json
    (a hook that reads the run's durations; the task body syncs the rest)."""
    from deploybench.matrix.planned import cell_of, cells_of
    from deploybench.store.run_sync import synced

    if only_run_json:
        return synced(key, _dsn(), files=lambda p: p == "run.json")
    cell = cell_of(key)
    if cell is None:
        return synced(key, _dsn())
    matrix_key, cell_id = cell
    return synced(key, _dsn(), also=[matrix_key], prefixes=[key[:len(key) - len(cell_id)]],
                  member=cells_of(matrix_key))


@contextlib.contextmanager
def _leased(key: str) -> Iterator[None]:
    """Renew the cluster lease while the task works on nodes; LeaseLost stops it if the lease was broken."""
    from deploybench import pipeline

    with pipeline.lease_heartbeat(key, _dsn()):
        yield


def _budget(stage: str):
    """A pre_execute hook that sets the task's execution_timeout from the run's own durations."""

    def hook(context: Any) -> None:
        from deploybench import pipeline

        with run_folder(run_key(context), only_run_json=True):  # the run's durations, in its run.json
            seconds = pipeline.budget_s(run_key(context), stage)
        if seconds:
            context["task"].execution_timeout = timedelta(seconds=seconds)

    return hook


def _stage_task(name: str, phase: str | None = None, rule: TriggerRule | None = None, then: str | None = None):
    """The task of one stage of the registry (one load phase of the load stage): everything about it comes
    from the stage's class (deploybench.stages.Stage: its task id, what it needs, whether it renews the lease,
    runs after failures, retries); it calls ``deploybench.pipeline.run_stage`` and returns ``Stage.returns``.
    Each stage reads what the stages before it left from the run's records (deploybench.stages), not XCom, so
    only the first load phase hangs off the rollout (Airflow wants ALL_SUCCESS right after a setup) and the
    others can follow a skipped phase (NONE_FAILED). ``then``: the phased stage declared right after it, whose
    phases this run does not ask for are marked skipped when this task succeeds, so they never start a task
    process (measured in a backfill of the regression benchmark: a skipped phase's task took 0.4-5.5 s)."""
    from deploybench.stages import REGISTRY

    stage = REGISTRY[name]
    if rule is None and stage.after_failure and not stage.undoes:
        rule = TriggerRule.ALL_DONE  # store and report run whatever failed before; finish gives the verdict
    retry = RETRY if stage.retries else RETRY_OUTSIDE if stage.judges_input else {}
    kwargs: dict[str, Any] = {**retry, **({"trigger_rule": rule} if rule else {}),
                              **queue_of(name, phase)}

    @task(task_id=phase or stage.task or name, pre_execute=_budget(phase or name), **kwargs)
    def run_one(conf: dict | None = None) -> Any:
        key = run_key()
        with run_folder(key):
            return _work(key, conf)

    def _work(key: str, conf: dict | None) -> Any:
        from deploybench import pipeline
        from deploybench.stages import Context

        given: dict[str, Any] = {"phase": phase}
        if "ssh" in stage.needs:
            given["ssh_overrides"] = ssh(key)
        if "kube" in stage.needs:
            given["kube"] = kube(key)
        if "dsn" in stage.needs:
            given["dsn"] = _dsn()
        if "prometheus" in stage.needs:  # the team's Prometheus (optional): a malformed connection fails the task
            from deploybench.airflow.connections import prometheus_source
            from deploybench.errors import ConfigError

            try:
                given["prometheus"] = prometheus_source()
            except ConfigError as exc:  # the operator's connection, not the node's or the network's: no retry
                raise AirflowFailException(f"ConfigError: {exc}") from exc
        if "params" in stage.needs:  # the DAG run's params (the trigger form), or a benchmark's or a cell's conf
            ctx = get_current_context()
            given["params"] = dict(ctx["params"]) if conf is None else conf
            given["meta"] = {"dag_id": ctx["dag"].dag_id, "airflow_run_id": ctx["run_id"],
                             "run_type": str(getattr(ctx["dag_run"], "run_type", "") or ""),
                             "logical_date": str(ctx.get("logical_date") or "") or None}
        try:
            with _leased(key) if stage.leased else contextlib.nullcontext():
                got = pipeline.run_stage(name, key, **given)
        except Exception as exc:
            if stage.judges_input:  # its verdict (recorded in the stage's record): a retry would say the same
                raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
            raise
        if got is None:
            if phase is not None:
                raise AirflowSkipException(f"load phase {phase!r} is not in this run's load_phases")
            return None  # a stage after failures, of a run whose validate failed: nothing to do
        done = Context(key, phase=phase, dsn=given.get("dsn"))
        if (text := stage.task_log(done, got)) is not None:
            print(text)  # the task log shows it (the report: the run's summary table)
        value = stage.returns(done, got)
        if then and (idle := REGISTRY[then].phases_not_asked(Context(key))):
            get_current_context()["ti"].xcom_push("return_value", value)  # skipping ends the task before its push
            raise DownstreamTasksSkipped(tasks=[f"{then}.{p}" for p in idle])
        return value

    return run_one


def _declare(name: str, conf: Any = None, then: str | None = None) -> tuple[Any, Any]:
    """The task(s) of one stage, in a group named after it when it has a task id or phases of its own;
    returns (first, last) of its tasks. ``then``: the next stage, when it has phases (see _stage_task)."""
    from deploybench.stages import REGISTRY

    stage = REGISTRY[name]
    if stage.phases:
        with task_group_named(name):
            tasks = [_stage_task(name, p, TriggerRule.ALL_SUCCESS if i == 0 else TriggerRule.NONE_FAILED)()
                     for i, p in enumerate(stage.phases)]
        # each phase hangs off every phase before it, not only the one just before: a phase this run does not ask
        # for is marked skipped as soon as the rollout succeeds, and a NONE_FAILED task after a skipped one alone
        # would start then, beside the phases before it (overload running while the probe still searched)
        for j, b in enumerate(tasks[1:], start=1):
            tasks[:j] >> b
        return tasks[0], tasks[-1]
    with task_group_named(name) if stage.task else contextlib.nullcontext():
        one = _stage_task(name, then=then)(conf) if "params" in stage.needs else _stage_task(name, then=then)()
    return one, one


def run_stages(conf: Any = None) -> dict[str, Any]:
    """Declare the run's tasks in the DAG being built, from the registry (deploybench.stages.REGISTRY) in its
    order: the stages before the lease (validate), the lease's acquire, the stages that touch nodes (under the
    lease; the last of them the setup its undoing stage tears down), the stage that undoes it (teardown), the
    lease's release, the stages that run after failures (store, report), and finish. Returns the ones other
    tasks hang off (``validate``, ``report``, ``finish``). ``conf``: an XComArg of flat parameters (a reference
    benchmark, a matrix cell); None = the DAG run's params (the trigger form)."""
    from deploybench.airflow.lease import AcquireLease
    from deploybench.stages import REGISTRY

    @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("finish"), **queue_of("finish"))
    def finish() -> str:
        """Fails the run when any stage failed, so a green run means every stage passed."""
        from deploybench import pipeline

        with run_folder(run_key()):
            return pipeline.finish(run_key())

    @task(task_id="release", pre_execute=_budget("lease"), **queue_of("lease", "release"))
    def release_lease() -> dict:
        from deploybench import pipeline

        with run_folder(run_key()):
            return pipeline.release_lease(run_key(), _dsn())

    @task_group(group_id="lease")
    def lease_group():
        take = AcquireLease(task_id="acquire", pre_execute=_budget("lease"), **queue_of("lease", "acquire"))
        return take, release_lease().as_teardown(setups=take)

    stages = list(REGISTRY.values())
    declared: dict[str, tuple[Any, Any]] = {}
    last = None
    for st in (s for s in stages if not s.leased and not s.after_failure):  # validate: before the lease
        declared[st.name] = first, end = _declare(st.name, conf)
        if last is not None:
            last >> first
        last = end
    take, release = lease_group()
    last >> take
    last = take
    leased = [s for s in stages if s.leased]
    for st, nxt in zip(leased, [*leased[1:], None]):  # preflight, fanout, rollout, load: under the lease
        declared[st.name] = first, end = _declare(st.name, then=nxt.name if nxt is not None and nxt.phases else None)
        last >> first
        last = end
    for st in (s for s in stages if s.undoes):  # teardown: Airflow runs it even when the work failed
        declared[st.name] = first, end = _declare(st.name)
        first.as_teardown(setups=declared[str(st.undoes)][1])
        last >> first
        last = end
    last >> release
    last = release
    for st in (s for s in stages if s.after_failure and not s.undoes):  # store, report
        declared[st.name] = first, end = _declare(st.name)
        last >> first
        last = end
    done = finish()
    last >> done
    return {"validate": declared["validate"][0], "report": declared["report"][1], "finish": done}


def task_group_named(group_id: str):
    """A task group for one stage: the Grid shows the stage's name around its task(s)."""
    from airflow.sdk import TaskGroup

    return TaskGroup(group_id=group_id)
