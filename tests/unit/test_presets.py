"""Presets (deploybench.params): named sets of flat form values in data files, the shipped ones and the
operator's ($DEPLOYBENCH_PRESETS), checked like any conf when read, and overlaid on a conf by one rule: a
preset value goes into a field that is missing or at its form default; a field holding any other value keeps
it. The validate stage logs what the preset set and writes it into run.json."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from deploybench import params, paths, pipeline, presets
from deploybench.errors import ConfigError

SHIPPED = ("capacity", "quick", "runbook", "soak")


@pytest.fixture
def operator_dir(tmp_path, monkeypatch) -> Path:
    """An empty folder of the operator's presets, named by $DEPLOYBENCH_PRESETS."""
    folder = tmp_path / "presets"
    folder.mkdir()
    monkeypatch.setenv(presets.PRESET_ENV, str(folder))
    return folder


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


# -- the files -------------------------------------------------------------------------------------------------
def test_the_shipped_presets_load_and_each_makes_a_valid_run_by_itself(monkeypatch):
    monkeypatch.delenv(presets.PRESET_ENV, raising=False)
    found = presets.presets()
    assert tuple(sorted(found)) == SHIPPED
    for name, p in found.items():
        assert p.description and p.values and Path(p.source) == presets.PRESET_DIR / f"{name}.toml"
        cfg = params.to_config({params.PRESET: name})
        assert [ph.value for ph in cfg.load.phases] == p.values["load_phases"], name
    assert params.to_config({params.PRESET: "capacity"}).load.phases[0].value == "probe"
    assert params.to_config({params.PRESET: "soak"}).load.duration_s == 3600
    assert [ph.value for ph in params.to_config({params.PRESET: "runbook"}).load.phases] == [
        "probe", "sustained", "overload"]


def test_an_unknown_parameter_is_refused_naming_the_file_and_the_key(operator_dir):
    path = _write(operator_dir, "typo", 'description = "x"\n[params]\nload_rat = 5\n')
    with pytest.raises(ConfigError) as exc:
        presets.load_preset_file(path)
    assert str(path) in str(exc.value) and "'load_rat'" in str(exc.value) and "load_rate" in str(exc.value)
    with pytest.raises(ConfigError, match="load_rat"):
        presets.presets()  # the strict listing refuses it too
    with pytest.raises(ConfigError, match="load_rat"):
        params.to_config({params.PRESET: "typo"})  # and a run naming it fails at validate, naming it


def test_an_unknown_top_level_key_and_a_bad_value_are_refused_naming_the_file(operator_dir):
    path = _write(operator_dir, "odd", 'description = "x"\nvalues = {}\n[params]\nload_rate = 5\n')
    with pytest.raises(ConfigError, match=r"odd\.toml: unknown key\(s\) \['values'\]"):
        presets.load_preset_file(path)
    path = _write(operator_dir, "neg", 'description = "x"\n[params]\nload_rate = -5\n')
    with pytest.raises(ConfigError) as exc:
        presets.load_preset_file(path)
    assert str(path) in str(exc.value) and "load_rate" in str(exc.value)
    path = _write(operator_dir, "bare", "[params]\nload_rate = 5\n")
    with pytest.raises(ConfigError, match=r"bare\.toml: description"):
        presets.load_preset_file(path)
    path = _write(operator_dir, "nested", 'description = "x"\n[params]\npreset = "quick"\n')
    with pytest.raises(ConfigError, match="'preset'"):  # a preset does not name another
        presets.load_preset_file(path)


def test_the_operators_folder_adds_presets_and_may_not_redefine_one(operator_dir, monkeypatch):
    _write(operator_dir, "rack1-nightly", 'description = "the nightly run on rack 1"\n'
                                          '[params]\ninventory = "rack1"\nnodes = 16\nload_rate = 40\n')
    assert set(presets.presets()) == {*SHIPPED, "rack1-nightly"}
    cfg = params.to_config({params.PRESET: "rack1-nightly"})
    assert (cfg.inventory, cfg.nodes, cfg.load.rate) == ("rack1", 16, 40)
    schema = presets.preset_schema()
    assert schema["enum"] == [None, *SHIPPED[:2], "rack1-nightly", *SHIPPED[2:]]
    assert schema["values_display"]["rack1-nightly"] == "rack1-nightly - the nightly run on rack 1"

    _write(operator_dir, "quick", 'description = "mine"\n[params]\nload_rate = 1\n')
    with pytest.raises(ConfigError, match="'quick' is defined twice"):
        presets.presets()
    with pytest.raises(ConfigError, match="'quick' is defined twice"):
        params.to_config({params.PRESET: "quick"})
    assert "quick" not in presets.form_presets()  # the form leaves it out rather than break the DAG

    monkeypatch.setenv(presets.PRESET_ENV, str(operator_dir / "missing"))
    with pytest.raises(ConfigError, match="not a folder"):
        presets.presets()
    assert set(presets.form_presets()) == set(SHIPPED)


def test_a_bad_operator_file_is_left_out_of_the_form_and_logged(operator_dir, caplog):
    _write(operator_dir, "broken", 'description = "x"\n[params]\nnodez = 3\n')
    with caplog.at_level(logging.ERROR, logger=params.__name__):
        assert set(presets.form_presets()) == set(SHIPPED)
    assert "broken.toml" in caplog.text and "nodez" in caplog.text


@pytest.mark.parametrize("name", ["../quick", "/etc/passwd", "Quick", "quick\n", "", "q" * 65, 7])
def test_a_preset_name_is_a_name_not_a_path(name):
    if name == "":
        assert presets.apply_preset({params.PRESET: name}) == ({}, None)  # empty: no preset
        return
    with pytest.raises(ConfigError, match="not a preset name"):
        params.to_config({params.PRESET: name})


def test_an_unknown_preset_lists_the_known_ones(monkeypatch):
    monkeypatch.delenv(presets.PRESET_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"unknown preset 'nightly'; choose one of: capacity, quick, runbook, soak"):
        params.to_config({params.PRESET: "nightly"})


# -- the overlay -------------------------------------------------------------------------------------------------
def test_preset_values_fill_the_fields_left_at_their_defaults_and_changed_fields_keep_their_value(operator_dir):
    _write(operator_dir, "mine", 'description = "x"\n[params]\nload_duration_s = 10\nwarmup_s = 2\n'
                                 'iperf_seconds = 1\ntarget_url = "http://lb:8000"\n'
                                 'load_phases = ["probe", "sustained"]\n')
    form = params.defaults() | {params.PRESET: "mine"}  # what Airflow's form sends: every field, defaults included
    form |= {"load_duration_s": 8,  # typed: the person's value stays
             "warmup_s": 5,  # the default, typed or not: the preset's value applies
             "iperf_seconds": 2,  # the default 2.0 sent as an integer: still the default
             "target_url": ""}  # an optional text field left empty: the default
    resolved, used = presets.apply_preset(form)
    assert params.PRESET not in resolved
    assert used is not None and used.name == "mine" and used.source == str(operator_dir / "mine.toml")
    assert used.set == {"warmup_s": 2, "iperf_seconds": 1, "target_url": "http://lb:8000",
                        "load_phases": ["probe", "sustained"]}
    assert used.kept == {"load_duration_s": 8}
    cfg, again = params.configure(form)
    assert again == used
    assert (cfg.load.duration_s, cfg.load.warmup_s, cfg.preflight.iperf_seconds) == (8, 2, 1)
    assert cfg.load.target_url == "http://lb:8000" and [p.value for p in cfg.load.phases] == ["probe", "sustained"]
    assert "preset 'mine' set warmup_s=2" in used.describe() and "kept the typed load_duration_s=8" in used.describe()
    # a partial conf (REST, CLI): a missing field is at its default
    assert params.to_config({params.PRESET: "mine", "inventory": "demo"}).load.duration_s == 10


def test_booleans_and_lists_are_compared_as_they_are(operator_dir):
    _write(operator_dir, "flags", 'description = "x"\n[params]\niperf_bidir = false\nscale_steps = [2, 4]\n'
                                  'min_nodes = 1\n')
    # iperf_bidir at its default (true) and scale_steps at theirs ([]) take the preset's values; min_nodes=true
    # is not the default 1 (a boolean is no number, however Python compares them): kept, then refused by the schema
    _, used = presets.apply_preset(params.defaults() | {params.PRESET: "flags", "iperf_bidir": True,
                                                       "scale_steps": [], "min_nodes": True})
    assert used is not None and used.set == {"iperf_bidir": False, "scale_steps": [2, 4]}
    assert used.kept == {"min_nodes": True}  # True is not the default 1: kept, and the schema refuses it
    with pytest.raises(ConfigError, match="min_nodes"):
        params.to_config(params.defaults() | {params.PRESET: "flags", "min_nodes": True})


def test_an_error_from_a_preset_value_says_the_preset_set_it(operator_dir):
    _write(operator_dir, "fast", 'description = "x"\n[params]\ncanary_nodes = 4\n')
    with pytest.raises(ConfigError) as exc:
        params.to_config({params.PRESET: "fast", "nodes": 2})
    assert "canary_nodes=4" in str(exc.value) and "preset 'fast' set canary_nodes=4" in str(exc.value)


def test_no_preset_is_the_conf_as_it_stands():
    base = params.defaults()
    assert presets.apply_preset(base | {params.PRESET: None}) == (base, None)
    assert params.configure(base)[1] is None
    assert params.to_config(base | {params.PRESET: None}) == params.to_config(base)


# -- the run's record ---------------------------------------------------------------------------------------------
@pytest.fixture
def inventory(tmp_path, monkeypatch) -> str:
    """A two-node inventory named ``rack`` on this machine (local transport), in the operator's folder."""
    folder = tmp_path / "inventories"
    folder.mkdir()
    inv = {"name": "rack", "transport": "local", "python": sys.executable, "model_root": str(tmp_path / "models"),
           "run_root": str(tmp_path / "run"),
           "nodes": [{"name": f"n0{i}", "address": f"127.0.0.{i}", "link_mbit": 1000} for i in (1, 2)]}
    (folder / "rack.json").write_text(json.dumps(inv))
    monkeypatch.setenv("DEPLOYBENCH_INVENTORIES", str(folder))
    monkeypatch.delenv("DEPLOYBENCH_POLICY", raising=False)
    monkeypatch.delenv(presets.PRESET_ENV, raising=False)
    return "rack"


def test_validate_logs_the_preset_and_writes_what_it_set_into_run_json(inventory, caplog):
    key = "deploybench_run__preset_unit"
    conf = params.defaults() | {"inventory": inventory, params.PRESET: "quick", "load_duration_s": 8}
    with caplog.at_level(logging.INFO, logger="deploybench.stages"):
        pipeline.validate(key, conf)
    run = json.loads((paths.run_dir(key) / "run.json").read_text())
    assert run["preset"]["name"] == "quick" and run["preset"]["source"].endswith("include/presets/quick.toml")
    assert run["preset"]["set"] == {"load_phases": ["sustained"], "iperf_seconds": 1, "gate_duration_s": 3,
                                    "warmup_s": 2}
    assert run["preset"]["kept"] == {"load_duration_s": 8}
    assert run["config"]["load"]["duration_s"] == 8 and run["config"]["rollout"]["gate_duration_s"] == 3
    assert f"run {key}: preset 'quick' set load_phases=[\"sustained\"]" in caplog.text, caplog.text
    assert "kept the typed load_duration_s=8" in caplog.text

    pipeline.validate(key + "_none", params.defaults() | {"inventory": inventory, params.PRESET: None})
    assert json.loads((paths.run_dir(key + "_none") / "run.json").read_text())["preset"] is None
