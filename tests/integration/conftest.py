"""Fixtures of the integration tests that need more than tests/conftest.py gives every folder: simulated
engines on 127.0.0.1 (deploybench.sim.local), for the load, history and accuracy tests; simulated engines
started outside deploybench on a loopback lab's nodes, for the tests of the external backend."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from deploybench.inventory import Inventory
    from deploybench.sim.local import LocalEngines


@pytest.fixture(scope="module")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1 MB model with its manifest, which the simulated engine verifies at start-up."""
    from deploybench.manifest import seed_model

    path = tmp_path_factory.mktemp("model")
    seed_model(path, total_mb=1)
    return path


@pytest.fixture
def local_engines(sim_model_dir: Path, tmp_path: Path) -> Iterator[LocalEngines]:
    """``local_engines.start(n, *extra_args, engine=EngineSpec)`` -> [Endpoint], healthy before it returns;
    every engine started in the test is stopped after it, whatever happened. Logs in the test's tmp_path."""
    from deploybench.sim.local import LocalEngines

    with LocalEngines(sim_model_dir, tmp_path) as engines:
        yield engines


@pytest.fixture(scope="module")
def external_engines(request: pytest.FixtureRequest) -> Iterator[tuple[Inventory, dict[str, str], list]]:
    """(inventory, {node: url}, processes): a 2-node loopback lab named by the test module's ``LAB`` and one
    simulated engine per node on the module's ``PORT``, started here as plain processes (not by deploybench),
    healthy before the module's tests run; stopped and the lab taken down after its last test."""
    from deploybench import engines, http
    from deploybench.config import EngineSpec
    from deploybench.lab import cluster
    from deploybench.lab.state import LabFiles

    lab, port = request.module.LAB, request.module.PORT
    inv = cluster.up(lab, nodes=2, link_mbit=200, mode="loopback", model_mb=1)
    files = LabFiles(lab)
    spec = EngineSpec(max_num_seqs=4, sim={"decode_base_ms": 8, "decode_per_seq_ms": 1, "prefill_per_token_ms": 0.01})
    procs: list[subprocess.Popen] = []
    try:
        for n in inv.nodes:
            model = files.models(n.name) / "sim-model"
            if not model.exists():
                shutil.copytree(files.models(inv.nodes[0].name) / "sim-model", model)
            ctx = engines.LaunchContext(inv, n, str(model), "sim-model", port, spec)
            argv = [sys.executable if a == inv.python else a for a in engines.profile("sim").command(ctx)]
            with open(files.root / f"external-{n.name}.log", "w") as log:  # the engine holds its own copy
                procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        urls = {n.name: f"http://{n.address}:{port}" for n in inv.nodes}
        deadline = time.monotonic() + 30
        while not all(http.is_up(u + "/health") for u in urls.values()):
            assert time.monotonic() < deadline, "the external engines did not start"
            assert all(p.poll() is None for p in procs), "an external engine exited"
            time.sleep(0.2)
        yield inv, urls, procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.down(lab)


@pytest.fixture
def dag_test_run(airflow_db):
    """``dag_test_run(conf)``: one run of a DAG of this repository through Airflow's own ``dag.test()``."""
    return _dag_test_run


def _dag_test_run(conf: dict, dag_id: str = "deploybench_run") -> tuple[object, str, dict[str, dict]]:
    """(the DagRun, the run's deploybench key, its stage records by name); asserts the run succeeded,
    naming each failed stage's error."""
    import json

    from airflow.dag_processing.dagbag import DagBag

    from deploybench import paths

    dag = DagBag(dag_folder=str(Path(__file__).resolve().parents[2] / "dags")).dags[dag_id]
    dr = dag.test(run_conf=conf)
    key = paths.dag_run_key(dag_id, dr.run_id)
    stages = {p.stem: json.loads(p.read_text()) for p in (paths.run_dir(key) / "stages").glob("*.json")}
    assert dr.state == "success", {s: r.get("error") for s, r in stages.items() if r.get("status") == "failed"}
    return dr, key, stages
