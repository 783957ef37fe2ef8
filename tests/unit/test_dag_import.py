"""Every DAG imports cleanly, quickly, and declares the stages in order."""

import os
from pathlib import Path

DAGS = Path(__file__).resolve().parents[2] / "dags"


def _dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


def test_no_import_errors():
    bag = _dagbag()
    assert bag.import_errors == {}
    assert "deploybench_run" in bag.dag_ids


def test_stages_are_task_groups_in_order():
    dag = _dagbag().dags["deploybench_run"]
    ids = set(dag.task_ids)
    for group in ("preflight", "fanout", "rollout", "load", "store", "report"):
        assert any(t.startswith(group + ".") for t in ids), group
    order = ["validate", "lease.acquire", "preflight.nodes_and_links", "fanout.copy_and_verify",
             "rollout.canary_then_scale", "load.probe", "load.sustained", "load.spike", "load.overload", "teardown",
             "lease.release", "store.write_results", "report.render", "finish"]
    for a, b in zip(order, order[1:]):
        assert b in dag.get_task(a).get_flat_relative_ids(upstream=False), f"{a} must come before {b}"


def test_cleanup_tasks_run_whatever_failed_and_finish_decides():
    dag = _dagbag().dags["deploybench_run"]
    for tid in ("store.write_results", "report.render", "finish"):
        assert dag.get_task(tid).trigger_rule == "all_done", tid
    leaves = [t.task_id for t in dag.leaves]
    assert leaves == ["finish"]


def test_rollout_is_the_setup_of_the_engine_teardown_and_phases_can_be_skipped():
    dag = _dagbag().dags["deploybench_run"]
    deploy, down = dag.get_task("rollout.canary_then_scale"), dag.get_task("teardown")
    assert deploy.is_setup and down.is_teardown
    assert "rollout.canary_then_scale" in down.upstream_task_ids
    take, release = dag.get_task("lease.acquire"), dag.get_task("lease.release")
    assert take.is_setup and release.is_teardown and "lease.acquire" in release.upstream_task_ids
    assert "teardown" in release.upstream_task_ids  # the cluster is released only after the engines stopped
    assert dag.get_task("load.probe").trigger_rule == "all_success"  # Airflow's rule right after a setup
    for phase in ("load.sustained", "load.spike", "load.overload"):
        assert dag.get_task(phase).trigger_rule == "none_failed", phase  # a skipped phase does not skip the next
    # each phase waits for every phase before it: a phase not asked for is skipped when the rollout succeeds, and
    # the next would otherwise start then, beside the earlier ones (overload during the probe)
    phases = ["load.probe", "load.sustained", "load.spike", "load.overload"]
    for j, tid in enumerate(phases):
        assert set(phases[:j]) <= dag.get_task(tid).upstream_task_ids, tid
    for tid in ("store.write_results", "report.render"):
        t = dag.get_task(tid)
        assert t.retries >= 2 and t.retry_exponential_backoff, tid


def test_task_budgets_follow_the_run_durations():
    from deploybench import params
    from deploybench.timeouts import stage_budget_s

    short = params.to_config({"load_duration_s": 10})
    soak = params.to_config({"load_duration_s": 7200})
    assert stage_budget_s(soak, "sustained", 16) - stage_budget_s(short, "sustained", 16) == 7190
    assert stage_budget_s(params.to_config({"ready_timeout_s": 1800}), "rollout", 16) > 5 * 1800
    dag = _dagbag().dags["deploybench_run"]
    assert all(dag.get_task(t).pre_execute is not None for t in dag.task_ids)


def test_params_form_matches_library():
    from deploybench import params

    dag = _dagbag().dags["deploybench_run"]
    assert list(dag.params.keys()) == params.form_order()  # every field and the preset, in the form's order
    assert set(dag.params.keys()) == {f.name for f in params.FIELDS} | {params.PRESET}
    assert dag.params.get_param("engine_profile").schema["enum"] == ["sim", "vllm", "triton", "file"]


def test_dag_file_does_not_import_heavy_modules():
    """Parsing the DAG must not pull in pandas, paramiko or SQLAlchemy's PostgreSQL driver."""
    import subprocess
    import sys

    code = (
        f"import sys, runpy; runpy.run_path({str(DAGS / 'deploybench_run.py')!r}); "
        "bad=[m for m in ('pandas','paramiko','psycopg','deploybench.pipeline') if m in sys.modules]; "
        "print('HEAVY=' + ','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=120)
    assert out.returncode == 0, out.stderr[-1500:]
    heavy = [line for line in out.stdout.splitlines() if line.startswith("HEAVY=")]
    assert heavy == ["HEAVY="], out.stdout[-1500:]


def test_a_stage_added_to_the_registry_is_a_task_in_its_place(monkeypatch):
    """The tasks come from the registry: one class registered (no line in the DAG code) is a task of every run,
    where its kind puts it: a stage that touches nodes after the rollout, under the lease, before the teardown;
    one that runs after failures after the report, before finish."""
    import pendulum
    from airflow.sdk import DAG

    from deploybench import stages
    from deploybench.airflow.stages import run_stages

    class Warm(stages.Stage):
        name, task, needs = "warm", "caches", frozenset({"ssh"})

        def run(self, ctx, cluster):
            return {}

        def summary(self, ctx, result):
            return ""

    class Notify(stages.Stage):
        name, leased, after_failure, retries, needs = "notify", False, True, True, frozenset({"dsn"})

        def run(self, ctx, cluster):
            return {}

        def summary(self, ctx, result):
            return ""

    order = list(stages.REGISTRY.values())
    at = [s.name for s in order].index("load")
    monkeypatch.setattr(stages, "REGISTRY", {s.name: s for s in [*order[:at], Warm(), *order[at:], Notify()]})
    with DAG("registry_probe", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
        run_stages()
    chain = ["rollout.canary_then_scale", "warm.caches", "load.probe", "load.sustained", "load.spike", "load.overload",
             "teardown", "lease.release", "store.write_results", "report.render", "notify", "finish"]
    for a, b in zip(chain, chain[1:]):
        assert b in dag.get_task(a).downstream_task_ids, f"{a} must come right before {b}"
    assert dag.get_task("load.probe").trigger_rule == "all_success"  # still right after the stage before it
    assert dag.get_task("notify").trigger_rule == "all_done" and dag.get_task("notify").retries >= 2
    assert dag.get_task("warm.caches").trigger_rule == "all_success"
    assert [t.task_id for t in dag.leaves] == ["finish"]


def test_tasks_take_the_queues_of_deploybench_task_queues_in_turn(monkeypatch):
    """The compose stack's Celery check spreads a run's tasks over two workers' own queues: consecutive tasks of the
    chain alternate (so a run's hand-overs cross workers); unset, every task stays on Airflow's default queue."""
    order = ["validate", "lease.acquire", "preflight.nodes_and_links", "fanout.copy_and_verify",
             "rollout.canary_then_scale", "load.probe", "load.sustained", "load.spike", "load.overload", "teardown",
             "lease.release", "store.write_results", "report.render", "finish"]
    monkeypatch.setenv("DEPLOYBENCH_TASK_QUEUES", "worker-1, worker-2")
    dag = _dagbag().dags["deploybench_run"]
    queues = {t.task_id: t.queue for t in dag.tasks}
    assert set(queues.values()) == {"worker-1", "worker-2"}, queues
    crossings = sum(queues[a] != queues[b] for a, b in zip(order, order[1:]))
    assert crossings >= len(order) // 2, queues
    assert queues["validate"] != queues["lease.acquire"]
    assert all(queues[a] != queues[b] for a, b in zip(order, order[1:])), queues  # every hand-over crosses
    # a task's queue is its place in the chain, not the count of tasks parsed before it in this process
    again = {t.task_id: t.queue for t in _dagbag().dags["deploybench_run"].tasks}
    assert again == queues
    monkeypatch.delenv("DEPLOYBENCH_TASK_QUEUES")
    assert {t.queue for t in _dagbag().dags["deploybench_run"].tasks} == {"default"}
