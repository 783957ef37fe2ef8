"""The trigger form and RunConfig agree: every value the form's JSON schema (as Airflow's Param
checks it) accepts, validation accepts, and every value it refuses, validation refuses — for
every field, at its bounds, with its allowed values, patterns, null and wrong types."""

from __future__ import annotations

import pytest
from airflow.sdk import Param
from pydantic import ValidationError

from deploybench import params, presets
from deploybench.config import MAX_K6_VUS, RunConfig
from deploybench.errors import ConfigError


def _probes(schema: dict) -> list:
    """Values at and around the field's bounds, its enum, its pattern, null and a wrong type."""
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    out: list = [None, "not-a-number" if "string" not in types else 12345, [1], {"x": 1}]
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if key in schema:
            b = schema[key]
            out += [b, b - 1, b + 1, b - 0.5, b + 0.5] if "number" in types else [b, b - 1, b + 1]
    if "integer" in types:
        out += [0, 1, 2, 1.5, True]
    if "number" in types:
        out += [0, 0.5, 1, 3.25]
    if "enum" in schema:
        out += [v for v in schema["enum"]] + ["nonsense", "SIM"]
    if "string" in types:
        out += ["", "a", "a b", "../x", "-x", "A-1.b_c", "http://lb:8000", "https://x", "ftp://x", "x" * 600,
                "nvidia.com/gpu", "repo/img:1.0", "n01", "UPPER"]
    if "array" in types:
        items = schema.get("items", {})
        out += [[], [1, 2], [2, 1], [0], [1, 1], ["probe"], ["probe", "sustained"], ["sustained", "sustained"],
                ["bogus"], ["--flag", "1"], ["--port", "9"], [""], ["a\nb"], list(range(1, 70)), ["x"] * 3]
        out += [[v] for v in items.get("enum", [])]
    if "object" in types:
        out += [{}, {"purpose": "nightly"}, {"n": 1}, {f"k{i}": "v" for i in range(70)}]
    if "boolean" in types:
        out += [True, False, 0, "true"]
    return out


def _form_accepts(f: params.FormField, value) -> bool:
    try:
        Param(params.defaults()[f.name], **f.schema).resolve(value)
        return True
    except Exception:  # noqa: BLE001 - ParamValidationError, or the TypeError a bad JSON type raises
        return False


def _config_verdict(f: params.FormField, value) -> tuple[bool, list[tuple]]:
    """(accepted, locations of the errors) of RunConfig validation with only this field changed."""
    nested = RunConfig(inventory="inv.json").model_dump(mode="json")
    node = nested
    for part in f.path[:-1]:
        node = node[part]
    node[f.path[-1]] = value
    try:
        RunConfig.validate_strict(nested)
        return True, []
    except ValidationError as exc:
        return False, [tuple(str(p) for p in e["loc"]) for e in exc.errors()]


@pytest.mark.parametrize("f", params.FIELDS, ids=lambda f: f.name)
def test_form_and_validation_agree_on_every_field(f):
    checked = 0
    for value in _probes(f.schema):
        form_ok = _form_accepts(f, value)
        cfg_ok, locs = _config_verdict(f, value)
        if form_ok and not cfg_ok:
            # allowed only when a rule across fields refuses it (e.g. VU sizing), never the field's own bounds
            own = [loc for loc in locs if loc[: len(f.path)] == f.path]
            assert not own, f"{f.name}={value!r}: the form accepts it, validation refuses it at {own}"
        elif cfg_ok and not form_ok:
            pytest.fail(f"{f.name}={value!r}: validation accepts it, the form refuses it (schema {f.schema})")
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("f", params.FIELDS, ids=lambda f: f.name)
def test_every_field_has_a_title_a_description_and_a_default_the_form_accepts(f):
    assert f.title and f.title != f.name and "_" not in f.title, f.title
    assert len(f.description) > 10
    assert _form_accepts(f, params.defaults()[f.name])


def test_nothing_the_form_requires_defaults_to_empty():
    """Airflow's form treats a field whose type has no null as required: its default must not be empty."""
    for f in params.FIELDS:
        default = params.defaults()[f.name]
        if not f.nullable:
            assert default is not None and default != "", \
                f"{f.name} is required in the form but defaults to {default!r}"


def test_optional_text_fields_are_nullable_and_default_to_null():
    for name in ("source_node", "k8s_image", "engine_image", "target_url"):
        f = next(x for x in params.FIELDS if x.name == name)
        assert f.nullable and params.defaults()[name] is None, name


def test_choices_are_selects_and_phases_a_multi_select():
    by = {f.name: f.schema for f in params.FIELDS}
    assert by["engine_runtime"]["enum"] == ["process", "docker", "podman"]
    assert by["load_phases"]["type"] == "array"
    assert by["load_phases"]["examples"] == ["probe", "sustained", "spike", "overload"]


def test_empty_string_from_an_older_conf_means_not_set():
    cfg = params.to_config({"target_url": "", "k8s_image": "", "source_node": ""})
    assert cfg.load.target_url is None and cfg.rollout.kubernetes.image is None and cfg.source_node is None


def test_a_rate_whose_k6_sizing_would_exhaust_memory_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as exc:
        params.to_config({"load_rate": 5000})
    assert "load_rate=5000" in str(exc.value) and "k6_max_vus" in str(exc.value) and str(MAX_K6_VUS) in str(exc.value)
    with pytest.raises(ConfigError, match="probe_max_rps=2000"):
        params.to_config({"load_phases": ["probe", "sustained"], "probe_max_rps": 2000})
    assert params.to_config({"load_rate": 5000, "k6_max_vus": 2000}).load.max_vus == 2000  # the way out works


def test_extra_engine_args_reach_the_command_and_cannot_override_managed_flags():
    from deploybench.engines import LaunchContext, profile
    from deploybench.inventory import Inventory

    cfg = params.to_config({"engine_profile": "vllm", "engine_extra_args": ["--gpu-memory-utilization", "0.9"]})
    inv = Inventory.model_validate({"name": "c", "transport": "local", "nodes": [{"name": "n1", "address": "127.0.0.1",
                                                                                   "link_mbit": 1000}]})
    argv = profile("vllm").command(LaunchContext(inv, inv.nodes[0], "/m/x", "x", 8000, cfg.engine))
    assert argv[-2:] == ["--gpu-memory-utilization", "0.9"]
    with pytest.raises(ConfigError, match="--max-num-seqs.*max_num_seqs"):
        params.to_config({"engine_profile": "vllm", "engine_extra_args": ["--max-num-seqs=64"]})
    with pytest.raises(ConfigError, match="extra_args=.*sim engine"):
        params.to_config({"engine_profile": "sim", "engine_extra_args": ["--x"]})


def test_a_bad_list_item_is_named_with_its_index():
    with pytest.raises(ConfigError, match=r"load_phases\[1\]"):
        params.to_config({"load_phases": ["probe", "bogus"]})


def test_every_number_and_list_in_the_form_has_an_upper_bound():
    """A value a person can type must not be able to hurt the worker or the cluster by its size."""
    for f in params.FIELDS:
        s = f.schema
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if "number" in types or "integer" in types:
            assert "maximum" in s or "exclusiveMaximum" in s, f.name
        if "array" in types:
            assert "maxItems" in s or "enum" in s.get("items", {}), f.name  # a list of choices is bounded by them
        if "string" in types and "enum" not in s:
            assert "maxLength" in s or "{" in s.get("pattern", ""), f.name  # patterns here bound their length


def test_tags_are_bounded_and_a_refused_value_is_not_echoed_whole():
    """A tag is stored with the run and shown on its pages: keys up to 128 characters, values up to 2048; the error
    names the tag and shows the start of the value only."""
    with pytest.raises(ConfigError) as exc:
        params.to_config({"tags": {"purpose": "x" * 5000}})
    assert "tags[purpose]" in str(exc.value) and "at most 2048" in str(exc.value) and len(str(exc.value)) < 500
    with pytest.raises(ConfigError, match="at most 128"):
        params.to_config({"tags": {"k" * 129: "v"}})
    assert params.to_config({"tags": {"purpose": "nightly"}}).tags == {"purpose": "nightly"}


# -- the form a person meets: everyday fields open, the rest in closed sections ---------------------------------
def test_about_fifteen_everyday_fields_are_open_and_the_rest_in_closed_sections():
    """Airflow's form opens only its default section (the Params without a section); every named section starts
    closed. 15 fields are visible before a section is opened: the preset and 14 of RunConfig's 85."""
    form = params.trigger_form()
    open_ = [n for n, (_, schema) in form.items() if "section" not in schema]
    assert open_ == list(params.EVERYDAY_ORDER) and len(open_) == 15, open_
    assert list(form)[:15] == open_  # they come first: the open section is the form's first
    assert {"inventory", "nodes", "model_name", "engine_profile", params.PRESET, "load_rate", "load_duration_s",
            "slo_p99_latency_ms"} <= set(open_)
    assert {"sim_decode_per_seq_ms", "k6_max_vus", "sustained_fraction", "k8s_namespace"}.isdisjoint(open_)
    # every RunConfig field once, in SECTIONS order, each section a block of its own
    assert sorted(form) == sorted([*(f.name for f in params.FIELDS), params.PRESET])
    sections = [schema["section"] for _, schema in list(form.values())[15:]]
    assert list(dict.fromkeys(sections)) == list(params.SECTIONS)
    assert sections == sorted(sections, key=params.SECTIONS.index)
    assert params.OPEN_SECTION not in params.SECTIONS


def test_the_dags_params_are_the_trigger_form_in_its_order():
    from deploybench.airflow.stages import run_params

    got = run_params()
    assert list(got) == params.form_order()
    assert got[params.PRESET].value is None and got["load_rate"].value == params.defaults()["load_rate"]
    assert "section" not in got["load_rate"].schema and got["k6_max_vus"].schema["section"] == "Load generator"


def test_the_preset_field_is_a_select_of_the_presets_empty_by_default(monkeypatch):
    monkeypatch.delenv(presets.PRESET_ENV, raising=False)
    default, schema = params.trigger_form()[params.PRESET]
    assert default is None and schema["enum"] == [None, "capacity", "quick", "runbook", "soak"]
    assert set(schema["values_display"]) == {"null", "capacity", "quick", "runbook", "soak"}
    p = Param(default, **schema)
    assert p.resolve(None) is None and p.resolve("quick") == "quick"
    for bad in ("nightly", "../quick", 1):
        with pytest.raises(Exception):  # noqa: B017 - ParamValidationError: not one of the choices
            p.resolve(bad)


def test_load_rate_says_what_it_means_in_the_form():
    by = {f.name: f for f in params.FIELDS}
    assert "offers exactly this rate" in by["load_rate"].description
    assert "not applied without the probe" in by["sustained_fraction"].description
