"""The spike phase's fields: in a closed form section, derived from RunConfig, and bad values refused at validate with
the value and the way out, before anything touches a node."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from deploybench import params, pipeline
from deploybench.config import LoadPhase
from deploybench.errors import ConfigError

SPIKE = {"load_phases": ["sustained", "spike"]}


def test_the_fields_come_from_runconfig_in_a_closed_section():
    cfg = params.to_config(SPIKE | {"spike_factor": 4, "spike_hold_s": 3, "spike_recovery_s": 9})
    assert cfg.load.phases == [LoadPhase.SUSTAINED, LoadPhase.SPIKE]
    assert (cfg.load.spike_factor, cfg.load.spike_hold_s, cfg.load.spike_recovery_s) == (4, 3, 9)
    back = params.from_config(cfg)
    assert back["spike_factor"] == 4 and back["scale_up"] is False and back["scale_up_from"] == 1
    by_name = {f.name: f for f in params.FIELDS}
    for name in ("spike_factor", "spike_hold_s", "spike_recovery_s", "scale_up", "scale_up_from"):
        assert by_name[name].section == "Phase settings", name  # not an everyday field
    assert "spike" in by_name["load_phases"].schema["examples"]
    # the order of the phases: after sustained, before overload (one Airflow task each, in this order)
    assert [p.value for p in LoadPhase] == ["probe", "sustained", "spike", "overload"]


@pytest.mark.parametrize("flat, words", [
    (SPIKE | {"spike_factor": 1}, ["spike_factor=1", "must be above 1", "spike_factor=3"]),
    (SPIKE | {"spike_factor": 0.5}, ["spike_factor=0.5", "must be above 1"]),
    (SPIKE | {"spike_hold_s": 20, "spike_recovery_s": 10}, ["spike_hold_s=20", "spike_recovery_s=10",
                                                            "shorten spike_hold_s"]),
    (SPIKE | {"scale_up": True, "nodes": 1, "canary_nodes": 1}, ["scale_up=true", "nodes=1", "nodes >= 2"]),
    (SPIKE | {"scale_up": True, "nodes": 3, "scale_up_from": 3}, ["scale_up_from=3", "between 1 and 2"]),
    ({"load_phases": ["sustained"], "scale_up": True}, ["scale_up=true", "add 'spike'"]),
    (SPIKE | {"spike_hold_s": 601, "spike_recovery_s": 900}, ["spike_hold_s", "600", "got 601"]),
    (SPIKE | {"spike_recovery_s": 1801}, ["spike_recovery_s", "1800", "got 1801"]),
    (SPIKE | {"spike_hold_s": 0.5, "spike_recovery_s": 1.5}, ["spike_recovery_s", "greater than or equal to 2",
                                                             "got 1.5"]),
    (SPIKE | {"scale_up": True, "target_url": "http://lb.example:8000"}, ["target_url='http://lb.example:8000'",
                                                                         "leave target_url empty"]),
])
def test_bad_values_are_refused_naming_the_value_and_the_way_out(flat, words):
    with pytest.raises(ConfigError) as exc:
        params.to_config(flat)
    for w in words:
        assert w in str(exc.value), (w, str(exc.value))


def test_a_spike_off_leaves_its_fields_unjudged():
    """A factor of 1 is no spike, but a run without the spike phase does not use it: not refused."""
    assert params.to_config({"load_phases": ["sustained"], "spike_factor": 1}).load.spike_factor == 1


@pytest.fixture
def inventory(tmp_path, monkeypatch):
    """inventory(n) -> the name of an n-node inventory on this machine (local transport) in the operator's folder."""
    folder = tmp_path / "inventories"
    folder.mkdir()
    monkeypatch.setenv("DEPLOYBENCH_INVENTORIES", str(folder))
    monkeypatch.delenv("DEPLOYBENCH_POLICY", raising=False)
    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", "http://127.0.0.1:18001,http://127.0.0.2:18001")

    def make(n: int) -> str:
        inv = {"name": f"rack{n}", "transport": "local", "python": sys.executable,
               "model_root": str(tmp_path / "models"), "run_root": str(tmp_path / "run"),
               "nodes": [{"name": f"n{i}", "address": f"127.0.0.{i}", "link_mbit": 1000} for i in range(1, n + 1)]}
        (folder / f"rack{n}.json").write_text(json.dumps(inv))
        return f"rack{n}"

    return make


def test_validate_refuses_scale_up_on_one_node_and_on_the_external_backend(inventory):
    conf = params.defaults() | SPIKE | {"scale_up": True, "canary_nodes": 1, "min_nodes": 1}
    with pytest.raises(ConfigError) as exc:
        pipeline.validate("deploybench_run__spike_one", conf | {"inventory": inventory(1)})
    assert "scale_up=true needs at least 2 nodes" in str(exc.value) and "this run has 1 (n1)" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        pipeline.validate("deploybench_run__spike_ext", conf | {
            "inventory": inventory(2), "rollout_backend": "external",
            "external_endpoints": ["n1=http://127.0.0.1:18001", "n2=http://127.0.0.2:18001"]})
    assert "external backend" in str(exc.value) and "set scale_up=false" in str(exc.value)
    # load generators: k6 would not reach the target page on the controller's loopback
    gens = inventory(2)
    path = Path(os.environ["DEPLOYBENCH_INVENTORIES"]) / f"{gens}.json"
    doc = json.loads(path.read_text())
    path.with_name("gens.json").write_text(json.dumps({**doc, "name": "gens", "loadgens": [
        {"name": "g1", "address": "127.0.0.9"}]}))
    with pytest.raises(ConfigError) as exc:
        pipeline.validate("deploybench_run__spike_gens", conf | {"inventory": "gens"})
    assert "lists load generators (g1)" in str(exc.value) and "set scale_up=false" in str(exc.value)
    # the same conf on the ssh backend with two nodes passes validate
    got = pipeline.validate("deploybench_run__spike_ok", conf | {"inventory": inventory(2)})
    assert got["nodes"] == ["n1", "n2"]


def test_the_phase_that_starts_a_load_stage_clean_is_the_first_that_runs_not_the_first_listed():
    from deploybench.load import phases

    cfg = params.to_config({"load_phases": ["spike", "sustained"]})
    assert [p.value for p in cfg.load.phases] == ["spike", "sustained"]  # as typed ...
    assert phases.first_asked(cfg.load.phases) == "sustained"  # ... but sustained runs first
    assert phases.first_asked(["overload", "probe", "spike"]) == "probe"


def test_scale_up_is_refused_in_a_matrix_cell_sharing_its_deployment():
    from deploybench.config import RunConfig

    base = {"inventory": "demo", "nodes": 3, "load": {"phases": ["sustained", "spike"], "scale_up": True}}
    assert RunConfig.parse(base).load.scale_up
    for key in ("keep_for", "adopt"):
        with pytest.raises(ConfigError) as exc:
            RunConfig.parse(base | {"deployment": {key: "run-cell-2"}})
        assert f"deployment.{key}='run-cell-2'" in str(exc.value) and "set scale_up=false" in str(exc.value)


def test_the_k6_operator_is_refused_off_kubernetes_and_beside_load_generators(inventory):
    from deploybench.config import RunConfig

    with pytest.raises(ConfigError) as exc:
        RunConfig.parse({"inventory": "demo", "rollout": {"kubernetes": {"k6_operator": {"parallelism": 2}}}})
    assert "parallelism=2" in str(exc.value) and "backend='ssh'" in str(exc.value) and "parallelism=0" in str(exc.value)
    gens = inventory(2)
    path = Path(os.environ["DEPLOYBENCH_INVENTORIES"]) / f"{gens}.json"
    doc = json.loads(path.read_text())
    path.with_name("gens.json").write_text(json.dumps({**doc, "name": "gens", "loadgens": [
        {"name": "g1", "address": "127.0.0.9"}]}))
    from deploybench.inventory import Inventory
    from deploybench.stages import check_load_senders

    k8s = {"backend": "kubernetes", "kubernetes": {"image": "vllm/vllm-openai:v0.6.0"}}
    cfg = RunConfig.parse({"inventory": "gens", "rollout": k8s | {"kubernetes": k8s["kubernetes"] | {
        "k6_operator": {"parallelism": 2}}}})
    with pytest.raises(ConfigError) as exc:
        check_load_senders(cfg, Inventory.load("gens"))
    assert "parallelism=2" in str(exc.value) and "load generators (g1)" in str(exc.value)
    check_load_senders(cfg, Inventory.load(gens))  # no load generators: the TestRun sends it
    check_load_senders(RunConfig.parse({"inventory": "gens", "rollout": k8s}), Inventory.load("gens"))
