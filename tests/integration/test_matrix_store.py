"""A matrix against a real results store: the skip rule, stored durations, the comparison of its cells."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from deploybench import matrix, params
from deploybench.errors import StageFailed
from deploybench.matrix import result, store
from deploybench.store import set_excluded, write_run
from tests.support import store_fixtures as fx

pytestmark = pytest.mark.integration

BASE = {"inventory": "demo", "nodes": 2, "canary_nodes": 1, "load_rate": 4}


class Inv:
    names = ["n1", "n2"]

    def node(self, name):
        return SimpleNamespace(labels={})


def _plan(spec: dict, dsn: str, key: str = "deploybench_matrix__m1"):
    return matrix.plan(matrix.MatrixSpec(**spec), key, f"matrix__{key}__", inventory_loader=lambda _r: Inv(),
                       measured=lambda cells: store.measured(dsn, cells),
                       durations=lambda cfgs: store.durations(dsn, cfgs))


def _write(dsn: str, key: str, conf: dict, status: str = "success", latency_ms: float = 300.0, hour: int = 0,
           with_load: bool = True):
    cfg = params.to_config(conf)
    data = cfg.model_dump(mode="json")
    rec = fx.run_record(key, data, fx.T0 + timedelta(hours=hour)).model_copy(
        update={"status": status, "fingerprint": cfg.fingerprint(), "tags": {}})
    frame = fx.samples(200, latency_ms, np.random.default_rng(hour), start=fx.T0 + timedelta(hours=hour))
    if with_load:
        write_run(dsn, rec, [], fx.phase_from(frame, 4), frame, facts=fx.facts(data))
    else:
        write_run(dsn, rec, [], [], None, facts=fx.facts(data))


@pytest.fixture(scope="module")
def dsn():
    test_dsn, _ = fx.make_database()
    yield test_dsn
    fx.drop_database(test_dsn)


def test_measured_cells_are_skipped_failed_and_excluded_runs_are_not(dsn):
    spec = {"base": BASE, "axes": {"max_num_seqs": [8, 16, 32]}}
    before = _plan(spec, dsn)
    assert before.counts()["skipped"] == 0
    _write(dsn, "deploybench_run__manual__a", {**BASE, "max_num_seqs": 8}, hour=1)
    _write(dsn, "deploybench_run__manual__b", {**BASE, "max_num_seqs": 16}, status="failed", hour=2)
    _write(dsn, "deploybench_run__manual__c", {**BASE, "max_num_seqs": 32}, hour=3)
    set_excluded(dsn, "deploybench_run__manual__c", True, "node n2 was throttling")
    _write(dsn, "deploybench_run__manual__d", {**BASE, "max_num_seqs": 8, "slo_p99_latency_ms": 500}, hour=4)
    after = _plan(spec, dsn)
    assert [(c.label, c.action) for c in after.cells] == [("max_num_seqs=8", "skip"), ("max_num_seqs=16", "run"),
                                                          ("max_num_seqs=32", "run")]
    assert after.cells[0].run_key == "deploybench_run__manual__a"  # not d: another SLO
    # the stored run's wall time (one minute in the fixtures) is the expected time of its configuration
    assert _plan({**spec, "on_measured": "rerun"}, dsn).cells[0].expected_s == 60.0


def test_conclude_compares_cells_stores_the_matrix_and_names_failures(dsn, tmp_path):
    from deploybench.web import matrix_page
    from deploybench.web.access import AllowAll

    spec = {"base": BASE, "axes": {"max_num_seqs": [8, 64, 128]}}
    planned = _plan(spec, dsn, "deploybench_matrix__m2")
    c01, c02, c03 = planned.cells
    assert c01.action == "skip"  # measured by run a above
    _write(dsn, c02.run_key, c02.conf, latency_ms=250.0, hour=5)
    _write(dsn, c03.run_key, c03.conf, status="failed", hour=6, with_load=False)  # the engine crashed in rollout
    out = result.conclude(dsn, planned.to_dict(), out_dir=tmp_path)
    assert [(r["cell_id"], r["status"]) for r in out["cells"]] == [("c01", "skipped"), ("c02", "success"),
                                                                    ("c03", "failed")]
    assert [f["cell_id"] for f in out["failed"]] == ["c03"]
    assert len(out["best"]) == 1 and out["best"][0]["cell_id"] in ("c01", "c02")
    assert out["comparison_id"] and Path(out["report"]).is_file()
    assert "Change against the baseline" in Path(out["report"]).read_text()  # the others against the best, p-values
    assert "c03 (max_num_seqs=128): failed" in str(pytest.raises(StageFailed, result.verdict, out).value)
    found = matrix_page.load(dsn, "deploybench_matrix__m2")
    assert found["id"] == out["comparison_id"]
    assert [c["deployment"] for c in found["params"]["matrix"]["cells"]] == ["d1", "d2", "d3"]
    assert "max_num_seqs=128" in matrix_page.render(found, "/deploybench", AllowAll())
    assert matrix_page.load(dsn, "deploybench_matrix__nope") is None
