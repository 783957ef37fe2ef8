import pytest

from deploybench import params
from deploybench.config import RunConfig
from deploybench.errors import ConfigError


def test_defaults_form_a_valid_config():
    cfg = params.to_config({})
    assert cfg.rollout.canary_nodes == 2
    assert cfg.load.rate > 0
    assert params.from_config(cfg)["canary_nodes"] == 2


def test_round_trip_flat_nested_flat():
    flat = {"nodes": 4, "canary_nodes": 1, "scale_steps": [2, 4], "load_rate": 3.5, "engine_profile": "vllm"}
    cfg = params.to_config(flat)
    back = params.from_config(cfg)
    for k, v in flat.items():
        assert back[k] == v


@pytest.mark.parametrize(
    "flat, field",
    [
        ({"canary_nodes": 5, "nodes": 4}, "canary_nodes"),
        ({"load_rate": -1}, "load_rate"),
        ({"load_rate": 0}, "load_rate"),
        ({"engine_profile": "tgi"}, "engine_profile"),
        ({"scale_steps": [4, 2]}, "scale_steps"),
        ({"link_threshold": 0}, "link_threshold"),
        ({"nodez": 3}, "nodez"),
    ],
)
def test_bad_params_name_the_field(flat, field):
    with pytest.raises(ConfigError) as exc:
        params.to_config(flat)
    assert field in str(exc.value)


def test_unknown_engine_lists_allowed_values():
    with pytest.raises(ConfigError) as exc:
        params.to_config({"engine_profile": "tgi"})
    assert "'sim'" in str(exc.value) and "'vllm'" in str(exc.value)


def test_nested_config_refuses_unknown_keys():
    with pytest.raises(ConfigError, match="laod|extra"):
        RunConfig.parse({"inventory": "x", "laod": {}})


def test_resolve_nodes_against_inventory():
    cfg = params.to_config({"nodes": 3, "canary_nodes": 2})
    assert cfg.resolve_nodes(["a", "b", "c", "d"]) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="only 2 nodes"):
        cfg.resolve_nodes(["a", "b"])
    cfg = params.to_config({"canary_nodes": 3})
    with pytest.raises(ConfigError, match="canary_nodes=3"):
        cfg.resolve_nodes(["a", "b"])
    cfg = params.to_config({"source_node": "zz"})
    with pytest.raises(ConfigError, match="source_node='zz'"):
        cfg.resolve_nodes(["a", "b"])


@pytest.mark.parametrize(
    "canary, steps, healthy, plan",
    [
        (2, [], 16, [2, 4, 8, 16]),
        (2, [], 5, [2, 4, 5]),
        (1, [], 1, [1]),
        (2, [], 2, [2]),
        (2, [4, 8], 16, [2, 4, 8, 16]),
        (2, [4, 8, 16], 6, [2, 4, 6]),
        (4, [], 3, [3]),
    ],
)
def test_scale_plan(canary, steps, healthy, plan):
    cfg = RunConfig.parse({"inventory": "x", "rollout": {"canary_nodes": canary, "scale_steps": steps}})
    assert cfg.scale_plan(healthy) == plan


def test_fingerprint_tracks_performance_not_duration():
    a = params.to_config({"load_duration_s": 10})
    b = params.to_config({"load_duration_s": 99})
    c = params.to_config({"max_num_seqs": 16})
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != c.fingerprint()
