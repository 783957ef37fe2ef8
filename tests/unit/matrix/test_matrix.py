"""Config matrices without Airflow or a database: expansion, safe constraints, validation, order, skip rule."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deploybench import matrix
from deploybench.errors import StageFailed
from deploybench.matrix import MatrixError, MatrixSpec
from deploybench.matrix.expr import Constraint, ConstraintError
from deploybench.matrix.result import verdict


class FakeInventory:
    def __init__(self, n: int, gpus: str = "1"):
        self.names = [f"n{i:02d}" for i in range(1, n + 1)]
        self._gpus = gpus

    def node(self, name: str):
        return SimpleNamespace(labels={"gpus": self._gpus})


def _plan(spec: dict, measured=None, nodes: int = 2, gpus: str = "1", **kw):
    return matrix.plan(MatrixSpec(**spec), "deploybench_matrix__manual__1", "matrix__manual__1__",
                       measured=measured, inventory_loader=lambda _ref: FakeInventory(nodes, gpus), **kw)


BASE = {"inventory": "demo", "nodes": 2, "canary_nodes": 1}
GRID = {"base": BASE, "axes": {"load_rate": [2, 4], "max_num_seqs": [8, 16]}}


# -- constraints ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,names,expected", [
    ("tensor_parallel_size * replicas <= gpus", {"tensor_parallel_size": 2, "replicas": 2, "gpus": 4}, True),
    ("tensor_parallel_size * replicas <= gpus", {"tensor_parallel_size": 4, "replicas": 2, "gpus": 4}, False),
    ("not (max_num_seqs > 8 and load_rate < 4)", {"max_num_seqs": 16, "load_rate": 2}, False),
    ("engine_profile in ['sim', 'vllm'] or load_rate == 1", {"engine_profile": "triton", "load_rate": 1}, True),
    ("1 < load_rate <= 4", {"load_rate": 4}, True),
    ("load_rate % 2 == 0 and -load_rate < 0", {"load_rate": 4}, True),
])
def test_constraints_evaluate_arithmetic_comparisons_and_logic(text, names, expected):
    assert Constraint(text).holds(names) is expected


@pytest.mark.parametrize("text,what", [
    ("__import__('os').system('id')", "Call"),
    ("load_rate.real > 1", "Attribute"),
    ("load_rate ** 1000000 > 1", "Pow"),
    ("(lambda: 1)()", "Call"),
    ("[x for x in [1]]", "ListComp"),
    ("tags['a'] == 'b'", "Subscript"),
    ("load_rate >", "not an expression"),
    ("", "empty"),
    ("x" * 600, "at most"),
])
def test_constraints_refuse_anything_but_the_small_language(text, what):
    with pytest.raises(ConstraintError, match=what):
        Constraint(text)


def test_constraint_on_unknown_name_or_string_arithmetic_is_refused():
    with pytest.raises(ConstraintError, match="unknown parameter.*gpu_count"):
        Constraint("gpu_count > 1").holds({"gpus": 1})
    with pytest.raises(ConstraintError, match="arithmetic needs numbers"):
        Constraint("engine_profile * 1000000000 == 'x'").holds({"engine_profile": "sim"})


# -- expansion ------------------------------------------------------------------------------------
def test_grid_crossed_with_treatments_in_written_order():
    spec = MatrixSpec(axes={"load_rate": [2, 4]}, treatments=[{"max_num_seqs": 8}, {"max_num_seqs": 16}])
    assert matrix.combinations(spec) == [
        {"max_num_seqs": 8, "load_rate": 2}, {"max_num_seqs": 8, "load_rate": 4},
        {"max_num_seqs": 16, "load_rate": 2}, {"max_num_seqs": 16, "load_rate": 4}]


def test_expansion_refuses_empty_clashing_and_exploding_matrices():
    with pytest.raises(MatrixError, match="no axes and no treatments"):
        matrix.combinations(MatrixSpec())
    with pytest.raises(MatrixError, match=r"both set \['load_rate'\]"):
        matrix.combinations(MatrixSpec(axes={"load_rate": [1]}, treatments=[{"load_rate": 2}]))
    with pytest.raises(MatrixError, match="has 300 cells"):
        matrix.combinations(MatrixSpec(axes={"load_rate": list(range(1, 31)), "max_num_seqs": list(range(1, 11))}))


# -- the plan -------------------------------------------------------------------------------------
def test_plan_orders_cells_sharing_a_deployment_together_with_readable_labels():
    p = _plan(GRID)
    assert [c.label for c in p.cells] == ["max_num_seqs=8 load_rate=2", "max_num_seqs=8 load_rate=4",
                                          "max_num_seqs=16 load_rate=2", "max_num_seqs=16 load_rate=4"]
    assert [c.deployment for c in p.cells] == ["d1", "d1", "d2", "d2"]
    assert p.deployments == {"d1": ["c01", "c02"], "d2": ["c03", "c04"]}
    assert [c.trigger_run_id for c in p.cells] == [f"matrix__manual__1__c0{i}" for i in range(1, 5)]
    assert p.cells[0].run_key == "deploybench_run__matrix__manual__1__c01"
    assert p.cells[0].conf["tags"] == {"matrix": "deploybench_matrix__manual__1",
                                       "matrix_cell": "max_num_seqs=8 load_rate=2", "matrix_deployment": "d1"}
    assert p.cells[0].conf["max_num_seqs"] == 8 and p.cells[0].conf["inventory"] == "demo"
    assert matrix.label_of({"max_num_seqs": 64, "tensor_parallel_size": 2}) == "max_num_seqs=64 tp=2"
    assert matrix.label_of({"load_rate": 2, "tensor_parallel_size": 2}) == "tp=2 load_rate=2"  # the form's order


def test_the_plan_does_not_depend_on_the_order_the_conf_keeps():
    """Airflow's metadata database on PostgreSQL keeps a run's conf as JSONB, which gives an object's keys
    back by length, then name: axes written max_num_seqs, load_rate come back load_rate, max_num_seqs. The
    cells, their labels and ids are the same either way (the trigger form's order of fields)."""
    written = _plan({"base": BASE, "axes": {"max_num_seqs": [8, 16], "load_rate": [2, 4]},
                     "treatments": [{"output_tokens": 32, "tensor_parallel_size": 1}]})
    jsonb = _plan({"base": BASE, "axes": {"load_rate": [2, 4], "max_num_seqs": [8, 16]},
                   "treatments": [{"tensor_parallel_size": 1, "output_tokens": 32}]})
    assert [(c.cell_id, c.label, c.deployment) for c in written.cells] == \
           [(c.cell_id, c.label, c.deployment) for c in jsonb.cells]
    assert written.cells[0].label == "max_num_seqs=8 tp=1 load_rate=2 output_tokens=32"
    assert [c.label for c in written.cells][:2] == ["max_num_seqs=8 tp=1 load_rate=2 output_tokens=32",
                                                    "max_num_seqs=8 tp=1 load_rate=4 output_tokens=32"]


def test_measured_cell_is_skipped_with_the_run_that_measured_it():
    first = _plan(GRID)
    done = first.cells[2]
    seen = []

    def measured(cells):
        seen.extend(cells)
        return {done.measure_key: ["deploybench_run__manual__old"]}

    p = _plan(GRID, measured=measured)
    assert len(seen) == 4
    assert p.counts() == {"cells": 4, "run": 3, "skipped": 1, "ruled_out": 0, "deployments": 2}
    skipped = p.skipped[0]
    assert skipped.label == done.label and skipped.run_key == "deploybench_run__manual__old"
    assert "already measured by run deploybench_run__manual__old" in skipped.reason
    assert p.mapped()[2]["skip_reason"] == skipped.reason and p.mapped()[0]["skip_reason"] == ""
    assert "3 will run, 1 skipped" in p.summary() and "already measured" in p.summary()
    again = _plan({**GRID, "on_measured": "rerun"}, measured=measured)
    assert again.counts()["run"] == 4 and "measured again" in again.cells[2].reason


def test_repeats_run_only_the_missing_ones():
    spec = {"base": BASE, "axes": {"load_rate": [2]}, "repeats": 3}
    key = _plan(spec).cells[0].measure_key
    p = _plan(spec, measured=lambda cells: {key: ["r-new", "r-old"]})
    assert [(c.cell_id, c.action) for c in p.cells] == [("c01r1", "skip"), ("c01r2", "skip"), ("c01r3", "run")]
    assert p.cells[2].label == "load_rate=2 #3"


def test_measure_key_follows_configuration_slo_and_software_not_tags():
    from deploybench import params

    a = params.to_config({"inventory": "demo", "load_rate": 2})
    assert matrix.measure_key(a) == matrix.measure_key(params.to_config({"inventory": "demo", "load_rate": 2,
                                                                          "tags": {"x": "y"}}))
    for other in ({"load_rate": 3}, {"slo_p99_latency_ms": 500}, {"engine_image": "vllm/vllm:0.6"}):
        assert matrix.measure_key(params.to_config({"inventory": "demo", "load_rate": 2, **other})) != \
            matrix.measure_key(a), other


def test_invalid_cell_is_refused_naming_cell_parameter_and_value():
    with pytest.raises(MatrixError) as err:
        _plan({"base": BASE, "axes": {"max_num_seqs": [8, 0], "load_rate": [2]}})
    msg = str(err.value)
    assert "1 of 2 cells are invalid; nothing was started" in msg
    assert "cell 2 (max_num_seqs=0 load_rate=2): max_num_seqs=0 is refused" in msg


def test_cell_that_does_not_fit_the_inventory_is_refused():
    with pytest.raises(MatrixError, match=r"cell 2 \(nodes=3\):.*inventory 'demo' has only 2 nodes"):
        _plan({"base": {"inventory": "demo", "canary_nodes": 1}, "axes": {"nodes": [2, 3]}})


def test_unknown_parameter_names_are_refused_with_where():
    with pytest.raises(MatrixError, match=r"axes: 'max_num_seq'"):
        _plan({"base": BASE, "axes": {"max_num_seq": [8]}})
    with pytest.raises(MatrixError, match=r"treatment 1: 'bogus'"):
        _plan({"base": BASE, "treatments": [{"bogus": 1}]})


def test_constraints_rule_cells_out_and_can_use_the_inventory():
    spec = {"base": BASE, "axes": {"tensor_parallel_size": [1, 2, 4]},
            "constraints": ["tensor_parallel_size * replicas <= gpus"]}
    p = _plan(spec, gpus="2")  # 2 nodes x 2 GPUs
    assert [c.label for c in p.cells] == ["tp=1", "tp=2"]
    assert p.ruled_out == [{"label": "tp=4", "constraint": "ruled out by 'tensor_parallel_size * replicas <= gpus'"}]
    with pytest.raises(MatrixError, match="every one of the 3 combinations is ruled out"):
        _plan({**spec, "constraints": ["tensor_parallel_size > 8"]})
    with pytest.raises(MatrixError, match="Call is not allowed"):
        _plan({**spec, "constraints": ["open('/etc/passwd')"]})


def test_estimate_uses_stored_durations_else_configured_ones_and_an_upper_bound():
    p = _plan(GRID)
    c = p.cells[0]
    assert c.expected_s == pytest.approx(matrix.configured_s(__import__("deploybench").params.to_config(c.conf), 2)
                                         + matrix.OVERHEAD_S)
    assert c.upper_s > c.expected_s
    fp = c.fingerprint
    p2 = _plan(GRID, durations=lambda cfgs: {fp: 42.0})
    assert p2.cells[0].expected_s == 42.0
    assert p2.estimate()["expected_s"] == pytest.approx(42.0 + sum(x.expected_s for x in p2.cells[1:]))
    assert "min expected" in p.summary() or " s expected" in p.summary()


def test_matrix_form_shape_errors_are_matrix_errors():
    assert MatrixSpec.from_params({"axes": {"load_rate": [1]}, "treatments": None, "constraints": None}).repeats == 1
    with pytest.raises(MatrixError, match="repeats"):
        MatrixSpec.from_params({"axes": {"load_rate": [1]}, "repeats": 0})


def test_verdict_names_failed_cells():
    ok = {"matrix_key": "m", "cells": [{"cell_id": "c01", "label": "a", "status": "success", "deployment": "d1",
                                        "run_key": "k1", "reason": ""}], "failed": [], "best": [], "run_keys": ["k1"],
          "comparison_id": 3, "report": "/x.html"}
    assert "c01" in verdict(ok)
    bad = {**ok, "failed": [{"cell_id": "c02", "label": "sim_crash_after=2", "status": "failed", "run_key": "k2"}]}
    with pytest.raises(StageFailed, match=r"1 of 1 cells failed: c02 \(sim_crash_after=2\): failed, run k2"):
        verdict(bad)


def test_matrix_page_shows_cells_best_and_links_the_comparison():
    from deploybench.web import matrix_page
    from deploybench.web.access import AllowAll

    cells = [{"cell_id": "c01", "label": "max_num_seqs=8 load_rate=2", "run_key": "deploybench_run__m__c01",
              "status": "success", "deployment": "d1", "reason": ""},
             {"cell_id": "c02", "label": "max_num_seqs=8 load_rate=4", "run_key": "deploybench_run__manual__x",
              "status": "skipped", "deployment": "d1", "reason": "already measured by run deploybench_run__manual__x"},
             {"cell_id": "c04", "label": "max_num_seqs=8 load_rate=6", "run_key": "deploybench_run__m__c04",
              "status": "success", "deployment": "d1", "reason": "", "rollout_run": "deploybench_run__m__c01"},
             {"cell_id": "c03", "label": "<script>", "run_key": "deploybench_run__m__c03", "status": "failed",
              "deployment": "d2", "reason": ""}]
    found = {"id": 7, "run_keys": ["deploybench_run__m__c01", "deploybench_run__manual__x"],
             "params": {"matrix": {"key": "deploybench_matrix__m", "cells": cells, "reuse": "ordered only"}},
             "result": {"best": {"w1": "deploybench_run__manual__x"}}, "baseline": "deploybench_run__manual__x"}
    html = matrix_page.render(found, "/deploybench", AllowAll())
    assert "<h1>Matrix <code>deploybench_matrix__m</code></h1>" in html
    assert "Best configuration meeting the SLO: <b class='success'>c02 max_num_seqs=8 load_rate=4</b>" in html
    assert ("/deploybench/compare?run=deploybench_run__m__c01&amp;run=deploybench_run__manual__x"
            "&amp;baseline=deploybench_run__manual__x") in html
    assert "/deploybench/runs/deploybench_run__m__c01" in html and "already measured by run" in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "2 success, 1 skipped, 1 failed" in html
    assert "<td>c01&#x27;s (shared)</td>" in html or "<td>c01's (shared)</td>" in html, html


# -- cells of one deployment run on one rollout ------------------------------------------------------
def test_cells_of_one_deployment_are_chained_onto_one_rollout():
    from deploybench import params as form

    p = _plan(GRID)
    c1, c2, c3, c4 = p.cells
    # each keeps its engines for the next cell of its group, which adopts them; groups do not mix
    assert c1.conf["deployment"] == {"keep_for": c2.run_key, "max_reuse_s": 900.0}
    assert c2.conf["deployment"] == {"adopt": c1.run_key, "max_reuse_s": 900.0}
    assert c3.conf["deployment"] == {"keep_for": c4.run_key, "max_reuse_s": 900.0}
    assert c4.conf["deployment"] == {"adopt": c3.run_key, "max_reuse_s": 900.0}
    assert [c.rollout_of for c in p.cells] == ["", "c01", "", "c03"]
    assert p.shared_rollouts() == {"c01": ["c01", "c02"], "c03": ["c03", "c04"]}
    assert [m["cell_label"] for m in p.mapped()][:2] == ["max_num_seqs=8 load_rate=2",
                                                         "max_num_seqs=8 load_rate=4 (on c01's rollout)"]
    assert "cells c01, c02 run on the rollout of c01" in p.summary() and "15.0 min old" in p.summary()
    # the hidden section reaches the run's config but not its fingerprint: a shared cell is the same measurement
    cfg = form.to_config(c2.conf)
    assert cfg.deployment.adopt == c1.run_key
    assert cfg.fingerprint() == form.to_config({k: v for k, v in c2.conf.items() if k != "deployment"}).fingerprint()
    assert c2.measure_key == matrix.measure_key(cfg)
    # an adopting cell is estimated without preflight and rollout gates
    n = 2
    assert c2.expected_s == pytest.approx(c1.expected_s - matrix.deploy_s(cfg, n))


def test_skipped_cells_break_no_chain_and_reuse_can_be_turned_off():
    measured_key = _plan(GRID).cells[3].measure_key
    p = _plan(GRID, measured=lambda cells: {measured_key: ["deploybench_run__manual__old"]})
    assert "deployment" not in p.cells[2].conf and "deployment" not in p.cells[3].conf  # c03 alone: deploys, stops
    assert p.cells[1].conf["deployment"]["adopt"] == p.cells[0].run_key
    off = _plan({**GRID, "reuse_s": 0})
    assert all("deployment" not in c.conf and not c.rollout_of for c in off.cells)
    rep = _plan({"base": BASE, "axes": {"load_rate": [2]}, "repeats": 3, "reuse_s": 60})
    assert [c.rollout_of for c in rep.cells] == ["", "c01r1", "c01r1"]
    assert rep.cells[2].conf["deployment"] == {"adopt": rep.cells[1].run_key, "max_reuse_s": 60.0}


def test_a_person_cannot_set_the_hidden_deployment_section_through_the_matrix():
    with pytest.raises(MatrixError, match="unknown parameter.*base: 'deployment'"):
        _plan({"base": {**BASE, "deployment": {"adopt": "x"}}, "axes": {"load_rate": [2]}})
    from deploybench import params as form
    from deploybench.errors import ConfigError

    with pytest.raises(ConfigError, match="deployment.adopt"):  # a run key, no path or shell characters
        form.to_config({**BASE, "deployment": {"adopt": "../../etc/passwd"}})
    with pytest.raises(ConfigError, match="deployment.max_reuse_s"):
        form.to_config({**BASE, "deployment": {"max_reuse_s": -1}})


def test_the_software_of_a_profile_file_cell_is_the_file_s_name_as_the_store_records_it():
    """engine.profile=file says nothing by itself: two profile files are two engines (the rollout records
    the file's name, and the skip rule compares with that)."""
    from deploybench import matrix
    from deploybench.config import RunConfig

    cfg = RunConfig.model_validate({"inventory": "demo", "engine": {"profile": "file", "profile_file": "llamacpp"}})
    other = RunConfig.model_validate({"inventory": "demo", "engine": {"profile": "file", "profile_file": "sglang"}})
    assert matrix.software_of(cfg) == {"engine": "llamacpp", "image": cfg.engine.image}
    assert matrix.software_of(cfg) != matrix.software_of(other)
