"""The tasks of one deploy-and-benchmark run, declared into the DAG being built.

    validate -> lease.acquire -> preflight -> fanout -> rollout -> load (probe, sustained, overload)
             -> teardown -> lease.release -> store -> report -> finish

Every DAG that runs a benchmark (``deploybench_run``, the scheduled regression benchmark) calls
``run_stages`` once, so every stage shows in its Grid and a run is the same run whichever DAG
started it. Each task calls one function of ``deploybench.pipeline``.

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
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from airflow.sdk import Param, TriggerRule, get_current_context, task, task_group
from airflow.sdk.exceptions import AirflowSkipException

from deploybench import params as form
from deploybench import paths

RETRY = {"retries": 3, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": True,
         "max_retry_delay": timedelta(minutes=5)}


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

        seconds = pipeline.budget_s(run_key(context), stage)
        if seconds:
            context["task"].execution_timeout = timedelta(seconds=seconds)

    return hook


def _load_phase(name: str, rule: TriggerRule):
    """A load phase task. It reads the endpoints of the run's latest rollout from the run's records,
    not from XCom, so that only the first phase hangs off the rollout (Airflow wants ALL_SUCCESS
    right after a setup) and the others can follow a skipped phase (NONE_FAILED)."""

    @task(task_id=name, trigger_rule=rule, pre_execute=_budget(name))
    def phase() -> dict:
        from deploybench import pipeline

        key = run_key()
        with _leased(key):
            got = pipeline.run_stage("load", key, phase=name)
        if got is None:
            raise AirflowSkipException(f"load phase {name!r} is not in this run's load_phases")
        done = got.phases.get(name)
        return {"phase": name, "slo_ok": done.result.slo_ok if done and done.result else None,
                "capacity_rps": got.capacity.capacity_rps}

    return phase


def run_stages(conf: Any = None) -> dict[str, Any]:
    """Declare the run's tasks in the DAG being built; returns the ones other tasks hang off
    (``validate``, ``report``, ``finish``). ``conf``: an XComArg of flat parameters (a reference
    benchmark, a matrix cell); None = the DAG run's params (the trigger form)."""
    from deploybench.airflow.lease import AcquireLease

    @task(pre_execute=_budget("validate"))
    def validate(conf: dict | None = None) -> list[str]:
        from deploybench import pipeline

        ctx = get_current_context()
        meta = {"dag_id": ctx["dag"].dag_id, "airflow_run_id": ctx["run_id"],
                "run_type": str(getattr(ctx["dag_run"], "run_type", "") or ""),
                "logical_date": str(ctx.get("logical_date") or "") or None}
        flat = dict(ctx["params"]) if conf is None else conf
        return pipeline.validate(run_key(), flat, meta)["nodes"]

    # Each stage reads what the stages before it left from the run's records (deploybench.stages); what a task
    # returns is for the Grid's XCom tab: the nodes it kept, the endpoints it serves.
    @task(pre_execute=_budget("preflight"))
    def nodes_and_links(_nodes: list[str]) -> list[str]:
        from deploybench import pipeline, stages
        from deploybench.run import Run

        key = run_key()
        with _leased(key):
            pipeline.run_stage("preflight", key, ssh_overrides=ssh(key))
        return stages.healthy_nodes(Run.open(key))

    @task(pre_execute=_budget("fanout"))
    def copy_and_verify(_healthy: list[str]) -> list[str]:
        from deploybench import pipeline, stages
        from deploybench.run import Run

        key = run_key()
        with _leased(key):
            pipeline.run_stage("fanout", key, ssh_overrides=ssh(key))
        return stages.verified_nodes(Run.open(key))

    @task(pre_execute=_budget("rollout"))
    def canary_then_scale(_nodes: list[str]) -> list[dict]:
        from deploybench import pipeline
        from deploybench.run import Run

        key = run_key()
        with _leased(key):
            pipeline.run_stage("rollout", key, ssh_overrides=ssh(key), kube=kube(key))
        return Run.open(key).endpoints()

    @task(task_id="teardown", pre_execute=_budget("teardown"))
    def stop_engines() -> dict:
        """Stops only this run's engines (per-run pid files, objects labelled with its key): no lease needed."""
        from deploybench import pipeline

        key = run_key()
        return pipeline.run_stage("teardown", key, ssh_overrides=ssh(key), kube=kube(key)) or {}

    @task(task_id="release", pre_execute=_budget("lease"))
    def release_lease() -> dict:
        from deploybench import pipeline

        return pipeline.release_lease(run_key(), _dsn())

    @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("store"), **RETRY)
    def write_results() -> dict:
        from deploybench import pipeline

        return pipeline.run_stage("store", run_key(), dsn=_dsn()) or {}

    @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("report"), **RETRY)
    def render() -> str:
        from deploybench import pipeline

        out = pipeline.report(run_key(), _dsn())
        print(out["text"])  # the task log shows the summary
        return out["path"]

    @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("finish"))
    def finish() -> str:
        """Fails the run when any stage failed, so a green run means every stage passed."""
        from deploybench import pipeline

        return pipeline.finish(run_key())

    @task_group(group_id="lease")
    def lease_group():
        take = AcquireLease(task_id="acquire", pre_execute=_budget("lease"))
        return take, release_lease().as_teardown(setups=take)

    @task_group(group_id="load")
    def load():
        """probe (capacity search) -> sustained -> overload; a phase not in load_phases is skipped."""
        probe = _load_phase("probe", TriggerRule.ALL_SUCCESS)()
        sustained = _load_phase("sustained", TriggerRule.NONE_FAILED)()
        probe >> sustained >> _load_phase("overload", TriggerRule.NONE_FAILED)()

    nodes = validate(conf)
    take, release = lease_group()
    nodes >> take
    with task_group_named("preflight"):
        healthy = nodes_and_links(nodes)
    take >> healthy
    with task_group_named("fanout"):
        copied = copy_and_verify(healthy)
    with task_group_named("rollout"):
        deployed = canary_then_scale(copied)
    down = stop_engines().as_teardown(setups=deployed)
    deployed >> load() >> down >> release
    with task_group_named("store"):
        stored = write_results()
    with task_group_named("report"):
        reported = render()
    done = finish()
    release >> stored >> reported >> done
    return {"validate": nodes, "report": reported, "finish": done}


def task_group_named(group_id: str):
    """A task group for one stage: the Grid shows the stage's name around its task(s)."""
    from airflow.sdk import TaskGroup

    return TaskGroup(group_id=group_id)
