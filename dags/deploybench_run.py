"""deploybench_run: one deploy-and-benchmark run of an inference service on a cluster.

preflight -> fanout -> rollout (canary, then scale steps) -> load (probe, sustained, overload) -> teardown
-> store -> report.
Every box calls one function of deploybench.pipeline; this file only declares tasks,
their order and the trigger form. Teardown, store and report run whatever failed
before; the last task fails the run if any stage failed.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import Param, TriggerRule, dag, get_current_context, task, task_group

from deploybench import params as form
from deploybench import paths


def _run_key() -> str:
    ctx = get_current_context()
    return paths.dag_run_key(ctx["dag"].dag_id, ctx["run_id"])


def _ssh(run_key: str):
    from deploybench.airflow_glue import ssh_overrides
    from deploybench.pipeline import Run

    return ssh_overrides(Run.open(run_key).inventory.ssh.conn_id)


def _kube(run_key: str):
    """Kubernetes API clients when the run's rollout backend is kubernetes, else None."""
    from deploybench.airflow_glue import kube_clients
    from deploybench.pipeline import Run

    r = Run.open(run_key).cfg.rollout
    return kube_clients(r.kubernetes.conn_id) if r.backend.value == "kubernetes" else None


PARAMS = {
    f.name: Param(form.defaults()[f.name], description=f.description, section=f.section, **f.schema)
    for f in form.FIELDS
}


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
    @task
    def validate() -> list[str]:
        from deploybench import pipeline

        ctx = get_current_context()
        meta = {"dag_id": ctx["dag"].dag_id, "airflow_run_id": ctx["run_id"]}
        return pipeline.validate(_run_key(), dict(ctx["params"]), meta)["nodes"]

    @task_group
    def preflight(nodes: list[str]):
        @task
        def nodes_and_links(nodes: list[str]) -> list[str]:
            from deploybench import pipeline

            return pipeline.preflight(_run_key(), _ssh(_run_key()))["healthy"]

        return nodes_and_links(nodes)

    @task_group
    def fanout(healthy: list[str]):
        @task
        def copy_and_verify(healthy: list[str]) -> list[str]:
            from deploybench import pipeline

            return pipeline.fanout(_run_key(), healthy, _ssh(_run_key()))["nodes"]

        return copy_and_verify(healthy)

    @task_group
    def rollout(nodes: list[str]):
        @task
        def canary_then_scale(nodes: list[str]) -> list[dict]:
            from deploybench import pipeline

            return pipeline.rollout(_run_key(), nodes, _ssh(_run_key()), _kube(_run_key()))["endpoints"]

        return canary_then_scale(nodes)

    @task_group
    def load(endpoints: list[dict]):
        """probe (capacity search) -> sustained -> overload; a phase not in load_phases is skipped."""

        @task
        def probe(endpoints: list[dict]) -> dict:
            from deploybench import pipeline

            return pipeline.load_phase(_run_key(), endpoints, "probe")

        @task
        def sustained(endpoints: list[dict], _after: dict) -> dict:
            from deploybench import pipeline

            return pipeline.load_phase(_run_key(), endpoints, "sustained")

        @task
        def overload(endpoints: list[dict], _after: dict) -> dict:
            from deploybench import pipeline

            return pipeline.load_phase(_run_key(), endpoints, "overload")

        return overload(endpoints, sustained(endpoints, probe(endpoints)))

    # From here on every task runs whatever failed before (ALL_DONE): engines are stopped,
    # what was measured is stored and reported, and `finish` decides the run's state.
    @task(trigger_rule=TriggerRule.ALL_DONE)
    def teardown() -> dict:
        from deploybench import pipeline

        return pipeline.teardown(_run_key(), _ssh(_run_key()), _kube(_run_key()))

    @task_group
    def store():
        @task(trigger_rule=TriggerRule.ALL_DONE)
        def write_results() -> dict:
            from deploybench import pipeline
            from deploybench.airflow_glue import results_dsn

            return pipeline.store(_run_key(), results_dsn())

        return write_results()

    @task_group
    def report():
        @task(trigger_rule=TriggerRule.ALL_DONE)
        def render() -> str:
            from deploybench import pipeline

            out = pipeline.report(_run_key())
            print(out["text"])  # the task log shows the summary
            return out["path"]

        return render()

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def finish() -> str:
        """Fails the run when any stage failed, so a green run means every stage passed."""
        from deploybench import pipeline

        return pipeline.finish(_run_key())

    endpoints = rollout(fanout(preflight(validate())))
    measured = load(endpoints)
    down = teardown()
    [endpoints, measured] >> down
    down >> store() >> report() >> finish()


deploybench_run()
