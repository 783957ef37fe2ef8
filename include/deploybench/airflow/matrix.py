"""The tasks of a config matrix, declared into the DAG being built (``dags/deploybench_matrix.py``).

    plan -> share (setup) -> cell (mapped: one deploybench_run per cell, one at a time) -> cleanup (its teardown)
         -> compare -> finish

``plan`` validates every cell before anything starts and logs counts and a wall-time estimate
(``deploybench.matrix.plan``). Each ``cell`` triggers a real ``deploybench_run`` DAG run with the
cell's conf and waits for it deferred (``TriggerDagRunOperator``), so every stage of a cell shows in
that run's Grid, runs under the cluster lease like any run, and is stored exactly as a manual run of
the same conf. The cell's run id is ``matrix__<matrix run id>__<cell id>``: clearing a cell
re-triggers the same run (``reset_dag_run``). Cells already measured are mapped too and skip with
their reason, so the Grid shows the whole matrix with labels such as ``max_num_seqs=64 load_rate=4``.
``max_active_tis_per_dagrun=1`` runs one cell at a time in plan order (cells sharing a deployment
adjacent). Cells of one deployment run on one rollout: each keeps its engines for the next and hands
it the cluster's lease; the next adopts them (``deploybench.matrix.deployment``); the Grid labels such
a cell ``... (on c01's rollout)``. ``cleanup`` is the teardown of ``share``: it runs however the cells
ended (and when a person marks the matrix run failed) and stops engines kept for a cell that never
took them over, releasing the lease handed to it. ``compare`` and ``finish`` run whatever happened
to the cells; ``finish`` fails naming the failed cells.
"""

from __future__ import annotations

from typing import Any

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import Param, TriggerRule, get_current_context, task
from airflow.sdk.exceptions import AirflowSkipException

from deploybench import paths

RUN_DAG_ID = "deploybench_run"
POKE_S = 2  # how often the triggerer looks at a cell's run (one metadata query): up to this much per cell


class MatrixCellOperator(TriggerDagRunOperator):
    """Triggers one cell's deploybench_run and waits for it; a cell planned as ``skip`` skips with its reason.

    ``cell_label`` is the cell's readable name (the map index label); both fields are templated like
    ``conf`` so they can come from the plan's XCom through ``expand_kwargs``."""

    template_fields = (*TriggerDagRunOperator.template_fields, "cell_label", "skip_reason")

    def __init__(self, *, cell_label: str = "", skip_reason: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell_label = cell_label
        self.skip_reason = skip_reason

    def execute(self, context: Any) -> Any:
        if self.skip_reason:
            raise AirflowSkipException(f"cell {self.cell_label}: {self.skip_reason}")
        self._refuse_planted(context)
        self.log.info("cell %s: triggering %s run %s with conf %s", self.cell_label, self.trigger_dag_id,
                      self.trigger_run_id, self.conf)
        return super().execute(context)


    def _refuse_planted(self, context: Any) -> None:
        """A run already under this cell's run id must be this cell (a cleared cell's own run): Airflow's reset
        keeps an existing run's conf, so a run created first with another configuration would be measured and
        reported as the cell. Such a run is refused, not reset; its validate would refuse it too
        (deploybench.matrix.planned.verify)."""
        from airflow.sdk.exceptions import AirflowFailException

        from deploybench import params as form
        from deploybench.errors import ConfigError
        from deploybench.matrix.planned import differences

        run_id = str(self.trigger_run_id)
        if not context["ti"].get_dr_count(dag_id=self.trigger_dag_id, run_ids=[run_id]):
            return
        # the Task SDK's own fetch of a DAG run (airflow/sdk/execution_time/comms.py, _fetch_dag_run, 3.3): the
        # only way a task reads another run's conf
        from airflow.sdk.execution_time.comms import _fetch_dag_run

        existing = _fetch_dag_run(dag_id=self.trigger_dag_id, run_id=run_id).conf or {}
        try:
            diff = differences(form.to_config(dict(existing)), form.to_config(dict(self.conf or {})))
        except ConfigError as exc:
            diff = f"its conf is not a valid run configuration ({exc})"
        if diff:
            raise AirflowFailException(
                f"cell {self.cell_label}: a {self.trigger_dag_id} run {run_id!r} exists already and is not this cell "
                f"as planned: {diff}; refused, not reset. Delete that run in Airflow, then clear this cell")


def matrix_params() -> dict[str, Param]:
    """The matrix trigger form."""
    from deploybench import params as form

    return {
        "base": Param({}, type="object", maxProperties=len(form.FIELDS), title="Base configuration",
                      description="deploybench_run parameters every cell shares (the run form's names, e.g. "
                                  "{\"inventory\": \"demo\", \"load_duration_s\": 60}); the rest take their defaults."),
        # null by default: a REST trigger that gives only treatments must not inherit an example grid
        "axes": Param(None, type=["null", "object"], maxProperties=16,
                      additionalProperties={"type": "array", "minItems": 1, "maxItems": 64},
                      title="Axes (full grid)",
                      description="Parameter -> values, e.g. {\"max_num_seqs\": [8, 16], \"load_rate\": [2, 4]}; every "
                                  "combination is a cell (crossed with the treatments); labels list parameters in "
                                  "this form's order."),
        "treatments": Param(None, type=["null", "array"], maxItems=256, items={"type": "object", "maxProperties": 32},
                            title="Treatments",
                            description="Explicit combinations, e.g. [{\"max_num_seqs\": 64, \"tensor_parallel_size\": "
                                        "2}], when a full grid would explode; crossed with the axes."),
        "constraints": Param(None, type=["null", "array"], maxItems=32, items={"type": "string", "maxLength": 500},
                             title="Constraints",
                             description="Expressions a cell must satisfy, e.g. \"tensor_parallel_size * replicas "
                                         "<= gpus\"; names: the run form's fields, replicas, gpus_per_node, gpus."),
        "repeats": Param(1, type="integer", minimum=1, maximum=20, title="Repeats per cell",
                         description="Runs per cell (significance between repeats needs 2+)."),
        "reuse_s": Param(900, type="number", minimum=0, maximum=86400, title="Reuse a deployment for (s)",
                         description="Cells that differ only in load/SLO parameters run on one rollout: the next cell "
                                     "adopts the engines, preflight and fan-out of the previous one while they are at "
                                     "most this old (after checking the engines still run and answer). 0: every cell "
                                     "deploys on its own."),
        "on_measured": Param("skip", type="string", enum=["skip", "rerun"], title="Cells already measured",
                             description="skip: a cell with a successful, non-excluded run of the same configuration, "
                                         "SLO and software is not run again; rerun: measure it again."),
    }


def _matrix_key(ctx: Any) -> str:
    return paths.dag_run_key(ctx["dag"].dag_id, ctx["run_id"])


def _dsn() -> str | None:
    from deploybench.airflow.connections import results_dsn

    return results_dsn()


def _folders(ctx: Any) -> Any:
    """The matrix's run folder and its cells' on this worker for one task (deploybench.store.run_sync.synced:
    pulled from the results database before, pushed after; nothing without one)."""
    from deploybench.matrix.planned import cells_of
    from deploybench.store.run_sync import synced

    key = _matrix_key(ctx)
    return synced(key, _dsn(), prefixes=[paths.dag_run_key(RUN_DAG_ID, f"matrix__{ctx['run_id']}__")],
                  member=cells_of(key))


def matrix_tasks() -> dict[str, Any]:
    """Declare the matrix's tasks in the DAG being built; returns them by name."""

    @task
    def plan() -> list[dict[str, Any]]:
        """Expand, validate every cell, skip measured ones, estimate: refuses the matrix before anything runs."""
        from deploybench import matrix
        from deploybench.matrix import planned as record
        from deploybench.matrix import store

        ctx = get_current_context()
        key, dsn = _matrix_key(ctx), _dsn()
        spec = matrix.MatrixSpec.from_params(dict(ctx["params"]))
        planned = matrix.plan(spec, key, f"matrix__{ctx['run_id']}__",
                              measured=lambda cells: store.measured(dsn, cells),
                              durations=lambda cfgs: store.durations(dsn, cfgs))
        print(planned.summary())  # the task log: what will run, what is skipped and why, how long
        with _folders(ctx):
            record.save(planned.to_dict())  # what each cell's validate checks its run id and conf against
        ctx["ti"].xcom_push(key="plan", value=planned.to_dict())
        return planned.mapped()  # what the cells are mapped over

    @task
    def share() -> dict[str, list[str]]:
        """Setup of the cells: which cells run on which cell's rollout (cleanup is its teardown)."""
        planned = get_current_context()["ti"].xcom_pull(task_ids="plan", key="plan") or {}
        shared: dict[str, list[str]] = {}
        for c in planned.get("cells", []):
            if c.get("rollout_of"):
                shared.setdefault(c["rollout_of"], [c["rollout_of"]]).append(c["cell_id"])
        print("cells sharing a rollout: " + (", ".join(f"{', '.join(v)} on {k}'s" for k, v in shared.items())
                                             or "none (every cell deploys on its own)"))
        return shared

    @task
    def cleanup() -> list[dict[str, Any]]:
        """Teardown: stop engines kept for a cell that never took them over, release the lease handed to it."""
        from deploybench.airflow.stages import ssh
        from deploybench.matrix import deployment

        ctx = get_current_context()
        planned = ctx["ti"].xcom_pull(task_ids="plan", key="plan") or {}
        keys = [c["run_key"] for c in planned.get("cells", []) if c["action"] == "run"]
        with _folders(ctx):
            done = deployment.cleanup(keys, _dsn(), ssh_for=ssh)
        print(f"{len(done)} kept deployment(s) nobody took over, stopped: {done}" if done
              else "every kept deployment was taken over and stopped by its cells: nothing to clean up")
        return done

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def compare() -> dict[str, Any]:
        """Compare every cell's run (skipped cells with the run that measured them), store it, write the report."""
        from deploybench.matrix import result

        ctx = get_current_context()
        planned = ctx["ti"].xcom_pull(task_ids="plan", key="plan")
        if not planned:
            raise AirflowSkipException("the plan refused the matrix: nothing ran (see the plan task's log)")
        with _folders(ctx):
            out = result.conclude(_dsn(), planned)
        print(result.summary(out))
        return out

    @task(trigger_rule=TriggerRule.ALL_DONE)
    def finish() -> str:
        """Fails the matrix run naming the failed cells (or the refused plan); else its summary."""
        from deploybench.errors import StageFailed
        from deploybench.matrix import result

        ctx = get_current_context()
        out = ctx["ti"].xcom_pull(task_ids="compare")
        if not out:
            if not ctx["ti"].xcom_pull(task_ids="plan", key="plan"):
                raise StageFailed(f"matrix {_matrix_key(ctx)}: the plan refused it, no cell ran (see the plan task)")
            raise StageFailed(f"matrix {_matrix_key(ctx)}: the comparison did not run (see the compare task)")
        return result.verdict(out)

    planned = plan()
    opened = share()
    cells = MatrixCellOperator.partial(
        task_id="cell", trigger_dag_id=RUN_DAG_ID, wait_for_completion=True, deferrable=True, poke_interval=POKE_S,
        reset_dag_run=True, max_active_tis_per_dagrun=1, openlineage_inject_parent_info=False,
        map_index_template="{{ task.cell_label }}",
    ).expand_kwargs(planned)
    # Airflow's annotation of setups omits XComArg, which it accepts (a @task call's result)
    closed = cleanup().as_teardown(setups=opened)  # type: ignore[arg-type]
    compared = compare()
    done = finish()
    planned >> opened >> cells >> closed >> compared >> done
    cells >> compared
    return {"plan": planned, "share": opened, "cell": cells, "cleanup": closed, "compare": compared, "finish": done}
