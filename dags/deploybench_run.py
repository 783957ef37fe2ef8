"""deploybench_run: one deploy-and-benchmark run of an inference service on a cluster.

validate -> preflight -> fanout -> rollout (canary, then scale steps) -> load (probe, sustained,
overload) -> teardown -> store -> report -> finish.

Every box calls one function of deploybench.pipeline; this file only declares tasks, their
order, their time budgets and the trigger form. The rollout is a setup task and stopping the
engines its teardown, so clearing a load phase re-deploys before it and stops the engines after
it, and marking a run failed still stops them. A phase not in load_phases is skipped. Store and
report run whatever failed before and retry (the store is one idempotent transaction); the last
task fails the run if any stage failed.
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import Param, TriggerRule, dag, get_current_context, task, task_group
from airflow.sdk.exceptions import AirflowSkipException

from deploybench import params as form
from deploybench import paths

PARAMS = {f.name: Param(form.defaults()[f.name], section=f.section, **f.schema) for f in form.FIELDS}
RETRY = {"retries": 3, "retry_delay": timedelta(seconds=10), "retry_exponential_backoff": True,
         "max_retry_delay": timedelta(minutes=5)}


def _key(context=None) -> str:
    ctx = context or get_current_context()
    return paths.dag_run_key(ctx["dag"].dag_id, ctx["run_id"])


def _budget(stage: str):
    """A pre_execute hook that sets the task's execution_timeout from the run's own durations."""

    def hook(context) -> None:
        from deploybench import pipeline

        seconds = pipeline.budget_s(_key(context), stage)
        if seconds:
            context["task"].execution_timeout = timedelta(seconds=seconds)

    return hook


def _ssh(run_key: str):
    from deploybench.airflow_glue import ssh_overrides
    from deploybench.pipeline import Run

    run = Run.open_if_validated(run_key)
    return ssh_overrides(run.inventory.ssh.conn_id) if run else None


def _kube(run_key: str):
    """Kubernetes API clients when the run's rollout backend is kubernetes, else None."""
    from deploybench.airflow_glue import kube_clients
    from deploybench.pipeline import Run

    run = Run.open_if_validated(run_key)
    r = run.cfg.rollout if run else None
    return kube_clients(r.kubernetes.conn_id) if r and r.backend.value == "kubernetes" else None


def _load_phase(name: str, rule: TriggerRule):
    """A load phase task. It reads the endpoints of the run's latest rollout from the run's records,
    not from XCom, so that only the first phase hangs off the rollout (Airflow wants ALL_SUCCESS
    right after a setup) and the others can follow a skipped phase (NONE_FAILED)."""

    @task(task_id=name, trigger_rule=rule, pre_execute=_budget(name))
    def phase() -> dict:
        from deploybench import pipeline

        out = pipeline.load_phase(_key(), None, name)
        if out.get("skipped"):
            raise AirflowSkipException(f"load phase {name!r} is not in this run's load_phases")
        return out

    return phase


@dag(
    dag_id="deploybench_run",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=PARAMS,
    tags=["deploybench"],
    doc_md=__doc__,
)
def deploybench_run():
    @task(pre_execute=_budget("validate"))
    def validate() -> list[str]:
        from deploybench import pipeline

        ctx = get_current_context()
        meta = {"dag_id": ctx["dag"].dag_id, "airflow_run_id": ctx["run_id"]}
        return pipeline.validate(_key(), dict(ctx["params"]), meta)["nodes"]

    @task_group
    def preflight(nodes: list[str]):
        @task(pre_execute=_budget("preflight"))
        def nodes_and_links(nodes: list[str]) -> list[str]:
            from deploybench import pipeline

            return pipeline.preflight(_key(), _ssh(_key()))["healthy"]

        return nodes_and_links(nodes)

    @task_group
    def fanout(healthy: list[str]):
        @task(pre_execute=_budget("fanout"))
        def copy_and_verify(healthy: list[str]) -> list[str]:
            from deploybench import pipeline

            return pipeline.fanout(_key(), healthy, _ssh(_key()))["nodes"]

        return copy_and_verify(healthy)

    @task_group
    def rollout(nodes: list[str]):
        @task(pre_execute=_budget("rollout"))
        def canary_then_scale(nodes: list[str]) -> list[dict]:
            from deploybench import pipeline

            return pipeline.rollout(_key(), nodes, _ssh(_key()), _kube(_key()))["endpoints"]

        return canary_then_scale(nodes)

    @task_group
    def load():
        """probe (capacity search) -> sustained -> overload; a phase not in load_phases is skipped."""
        probe = _load_phase("probe", TriggerRule.ALL_SUCCESS)()
        probe >> _load_phase("sustained", TriggerRule.NONE_FAILED)() >> _load_phase("overload", TriggerRule.NONE_FAILED)()

    @task(pre_execute=_budget("teardown"))
    def teardown() -> dict:
        from deploybench import pipeline

        return pipeline.teardown(_key(), _ssh(_key()), _kube(_key()))

    # From here on every task runs whatever failed before (ALL_DONE): what was measured is
    # stored and reported, and `finish` decides the run's state.
    @task_group
    def store():
        @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("store"), **RETRY)
        def write_results() -> dict:
            from deploybench import pipeline
            from deploybench.airflow_glue import results_dsn

            return pipeline.store(_key(), results_dsn())

        return write_results()

    @task_group
    def report():
        @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("report"), **RETRY)
        def render() -> str:
            from deploybench import pipeline
            from deploybench.airflow_glue import results_dsn

            out = pipeline.report(_key(), results_dsn())
            print(out["text"])  # the task log shows the summary
            return out["path"]

        return render()

    @task(trigger_rule=TriggerRule.ALL_DONE, pre_execute=_budget("finish"))
    def finish() -> str:
        """Fails the run when any stage failed, so a green run means every stage passed."""
        from deploybench import pipeline

        return pipeline.finish(_key())

    deployed = rollout(fanout(preflight(validate())))
    down = teardown().as_teardown(setups=deployed)
    deployed >> load() >> down >> store() >> report() >> finish()


deploybench_run()
