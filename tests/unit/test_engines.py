"""Engine profiles: launch commands from the knobs, Triton's config.pbtxt checked by Triton's own protobuf."""

from __future__ import annotations

import pytest

from deploybench import engines
from deploybench.config import EngineSpec, RunConfig, TritonKnobs
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory


def _ctx(spec: EngineSpec) -> engines.LaunchContext:
    inv = Inventory.model_validate({"name": "t", "transport": "local", "model_root": "/srv/m",
                                    "nodes": [{"name": "n1", "address": "10.0.0.11", "link_mbit": 1000}]})
    return engines.LaunchContext(inv, inv.nodes[0], "/srv/m/llama", "llama", 8000, spec, "/var/tmp/db/n1")


def test_vllm_command_carries_the_serving_knobs():
    argv = engines.profile("vllm").command(_ctx(EngineSpec(profile="vllm", max_num_seqs=64, tensor_parallel_size=4)))
    assert argv[:3] == ["vllm", "serve", "/srv/m/llama"]
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--host") + 1] == "10.0.0.11"


def test_triton_config_round_trips_through_tritons_model_config_protobuf():
    knobs = TritonKnobs(max_batch_size=16, preferred_batch_sizes=[4, 8], max_queue_delay_us=250, instance_count=2)
    cfg = engines.parse_triton_config(engines.triton_config("llama", knobs))
    assert cfg.name == "llama" and cfg.backend == "vllm" and cfg.max_batch_size == 16
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 250
    assert [(g.count, g.kind) for g in cfg.instance_group] == [(2, 1)]  # KIND_GPU = 1


def test_triton_without_batching_has_no_dynamic_batching_block():
    cfg = engines.parse_triton_config(engines.triton_config("m", TritonKnobs(max_batch_size=0)))
    assert not cfg.HasField("dynamic_batching")


@pytest.mark.parametrize("text, words", [
    ('name: "m"\nmax_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }\n', "outside 1..max_batch_size"),
    ('name: "m"\nmax_batch_size: 0\ndynamic_batching { }\n', "needs max_batch_size > 0"),
    ('name: "m"\nmax_batch_sise: 4\n', "does not parse"),
    ('name: "m"\ninstance_group [ { count: 0 } ]\n', "count must be >= 1"),
])
def test_a_config_triton_would_reject_is_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        engines.parse_triton_config(text)


def test_triton_repository_files_hold_the_config_and_the_weights_path():
    files = engines.profile("triton").files(_ctx(EngineSpec(profile="triton")))
    assert set(files) == {"/var/tmp/db/n1/triton-repo/llama/config.pbtxt", "/var/tmp/db/n1/triton-repo/llama/1/model.json"}
    assert '"/srv/m/llama"' in files["/var/tmp/db/n1/triton-repo/llama/1/model.json"]
    argv = engines.profile("triton").command(_ctx(EngineSpec(profile="triton")))
    assert "--model-repository=/var/tmp/db/n1/triton-repo" in argv


def test_knobs_out_of_range_and_unknown_profiles_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="go past max_batch_size=8"):
        RunConfig.parse({"inventory": "x", "engine": {"triton": {"preferred_batch_sizes": [4, 16]}}})
    with pytest.raises(ConfigError, match="increasing positive"):
        RunConfig.parse({"inventory": "x", "engine": {"triton": {"preferred_batch_sizes": [8, 4]}}})
    with pytest.raises(ConfigError, match="engine.profile"):
        RunConfig.parse({"inventory": "x", "engine": {"profile": "tgi"}})
    with pytest.raises(ConfigError, match="unknown engine profile 'tgi'"):
        engines.profile("tgi")
    with pytest.raises(ConfigError, match="runtime=process"):
        RunConfig.parse({"inventory": "x", "engine": {"runtime": "docker"}})


def test_container_command_mounts_the_model_read_only_and_drops_the_image_entrypoint():
    spec = EngineSpec(profile="vllm", runtime="docker")
    argv = engines.container_command(spec, _ctx(spec), "deploybench-n1")
    assert argv[:3] == ["docker", "run", "--rm"] and "/srv/m:/models:ro" in argv
    img = argv.index(engines.profile("vllm").image)
    assert argv[img + 1] == "/models/llama"  # `vllm serve` is the image's entrypoint


def test_new_engine_knobs_at_their_defaults_keep_the_fingerprint():
    a = RunConfig.parse({"inventory": "x"})
    b = RunConfig.parse({"inventory": "x", "engine": {"triton": {"max_batch_size": 32}}})  # sim: triton unused
    c = RunConfig.parse({"inventory": "x", "engine": {"profile": "triton", "triton": {"max_batch_size": 32}}})
    d = RunConfig.parse({"inventory": "x", "engine": {"profile": "triton"}})
    assert "triton" not in a.performance_identity()["engine"]
    assert a.fingerprint() == b.fingerprint() and c.fingerprint() != d.fingerprint()
