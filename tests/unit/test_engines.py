"""Engine profiles: launch commands from the knobs, Triton's config.pbtxt checked by Triton's own protobuf."""

from __future__ import annotations

import json

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
    knobs = TritonKnobs(max_batch_size=16, preferred_batch_sizes=[4, 8], max_queue_delay_us=250, instance_count=2,
                        instance_kind="KIND_GPU")
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


def test_the_default_triton_repository_is_one_the_vllm_backend_loads():
    """Issue 28, point 1. Upstream: vllm_backend src/model.py (auto_complete_config calls set_max_batch_size(0);
    _validate_device_config refuses KIND_GPU when tensor_parallel_size x pipeline_parallel_size > 1) and
    python_backend src/resources/triton_python_backend_utils.py (set_max_batch_size refuses a value below the
    config's). The seeds' config said max_batch_size 8 and KIND_GPU: Triton's protobuf took it, the backend not."""
    for tp in (1, 2, 8):
        spec = EngineSpec(profile="triton", tensor_parallel_size=tp)
        cfg = engines.parse_triton_config(engines.triton_config("llama", spec.triton))
        assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")
        assert [g.kind for g in cfg.instance_group] == [3]  # KIND_MODEL = 3 in inference.ModelInstanceGroup.Kind
        engines.check(spec, "llama")  # accepted


@pytest.mark.parametrize("knobs, tp, words", [
    ({"max_batch_size": 8}, 1, "refuses max_batch_size=8 .* set triton_max_batch_size to 0"),
    ({"max_batch_size": 16, "preferred_batch_sizes": [4, 8]}, 2, "refuses max_batch_size=16"),
    ({"instance_kind": "KIND_GPU"}, 2, "refuses KIND_GPU for a model on 2 GPUs .* set triton_instance_kind to "
                                       "KIND_MODEL"),
])
def test_a_repository_the_vllm_backend_would_refuse_is_refused_before_any_node_is_touched(knobs, tp, words):
    with pytest.raises(ConfigError, match=words):
        engines.check(EngineSpec(profile="triton", tensor_parallel_size=tp, triton=TritonKnobs(**knobs)), "llama")


def test_kind_gpu_on_one_gpu_and_batching_for_another_backend_stay_allowed():
    engines.check(EngineSpec(profile="triton", triton=TritonKnobs(instance_kind="KIND_GPU")), "llama")
    engines.check(EngineSpec(profile="triton", tensor_parallel_size=2,
                             triton=TritonKnobs(backend="python", max_batch_size=8, instance_kind="KIND_GPU")), "m")


def test_triton_repository_files_hold_the_config_and_the_weights_path():
    files = engines.profile("triton").files(_ctx(EngineSpec(profile="triton")))
    assert set(files) == {"/var/tmp/db/n1/triton-repo/llama/config.pbtxt",
                          "/var/tmp/db/n1/triton-repo/llama/1/model.json"}
    assert '"/srv/m/llama"' in files["/var/tmp/db/n1/triton-repo/llama/1/model.json"]
    argv = engines.profile("triton").command(_ctx(EngineSpec(profile="triton")))
    assert "--model-repository=/var/tmp/db/n1/triton-repo" in argv


def test_knobs_out_of_range_and_unknown_profiles_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="go past max_batch_size=8"):
        RunConfig.parse({"inventory": "x",
                         "engine": {"triton": {"max_batch_size": 8, "preferred_batch_sizes": [4, 16]}}})
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


def test_a_container_gets_the_hosts_ipc_for_tensor_parallel():
    """Issue 28, point 6 (containers). vllm-project/vllm docs/deployment/docker.md: "You can either use the
    `ipc=host` flag or `--shm-size` flag to allow the container to access the host's shared memory"."""
    for runtime in ("docker", "podman"):
        spec = EngineSpec(profile="vllm", runtime=runtime, tensor_parallel_size=2)
        argv = engines.container_command(spec, _ctx(spec), "deploybench-n1")
        assert argv[argv.index("--ipc") + 1] == "host", argv


def test_tritons_model_json_names_the_weights_where_the_engine_sees_them():
    """Issue 28, point 5: under docker or podman the node's model root is mounted at /models, so model.json (read
    by Triton inside the container) must name /models/<model>; a process reads the node's own path."""
    for runtime, want in (("process", "/srv/m/llama"), ("docker", "/models/llama"), ("podman", "/models/llama")):
        spec = EngineSpec(profile="triton", runtime=runtime)
        files = engines.engine_files(spec, _ctx(spec))
        got = json.loads(files["/var/tmp/db/n1/triton-repo/llama/1/model.json"])
        assert got["model"] == want, (runtime, got)


def test_new_engine_knobs_at_their_defaults_keep_the_fingerprint():
    a = RunConfig.parse({"inventory": "x"})
    b = RunConfig.parse({"inventory": "x", "engine": {"triton": {"max_batch_size": 32}}})  # sim: triton unused
    c = RunConfig.parse({"inventory": "x", "engine": {"profile": "triton", "triton": {"max_batch_size": 32}}})
    d = RunConfig.parse({"inventory": "x", "engine": {"profile": "triton"}})
    assert "triton" not in a.performance_identity()["engine"]
    assert a.fingerprint() == b.fingerprint() and c.fingerprint() != d.fingerprint()


def test_the_sims_prefix_cache_knobs_at_their_defaults_keep_the_fingerprint():
    a = RunConfig.parse({"inventory": "x"})
    assert not {"prefix_caching", "kv_cache_tokens"} & set(a.performance_identity()["engine"]["sim"])
    assert a.performance_identity()["engine"]["sim"]["decode_base_ms"] == a.engine.sim.decode_base_ms
    off = RunConfig.parse({"inventory": "x", "engine": {"sim": {"prefix_caching": False}}})
    small = RunConfig.parse({"inventory": "x", "engine": {"sim": {"kv_cache_tokens": 4096}}})
    assert off.performance_identity()["engine"]["sim"]["prefix_caching"] is False
    assert len({a.fingerprint(), off.fingerprint(), small.fingerprint()}) == 3


# -- profiles as data (issue 17) ---------------------------------------------------------------------
def _write(folder, name: str, body: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(body)
    return folder


def test_every_shipped_profile_loads_and_the_builtins_are_files_like_any_other():
    known = engines.profiles()
    assert {"sim", "vllm", "triton", "llamacpp", "llamacpp-native", "sglang", "openai"} <= set(known)
    for name in ("sim", "vllm", "triton"):
        assert known[name].source.endswith(f"engine_profiles/{name}.toml")
    assert known["llamacpp"].readiness.kind == "models" and known["llamacpp"].metrics.names == {}
    assert known["sglang"].metrics.names["running"] == "sglang:num_running_reqs"


def test_sim_profile_expands_its_knobs_from_the_template():
    spec = EngineSpec(max_num_seqs=6, sim={"decode_base_ms": 7.5, "seed": 3})
    argv = engines.profile("sim").command(_ctx(spec))
    assert argv[1:4] == ["-I", "-m", "deploybench.sim.engine"]  # isolated: nothing planted beside it is imported
    assert argv[argv.index("--max-num-seqs") + 1] == "6" and argv[argv.index("--decode-base-ms") + 1] == "7.5"
    assert argv[argv.index("--seed") + 1] == "3" and argv[argv.index("--host") + 1] == "10.0.0.11"
    assert argv[argv.index("--served-model-name") + 1] == "llama"
    # prefix caching on by default, as in vLLM v1, with vLLM's spelling of the switch
    assert "--enable-prefix-caching" in argv and argv[argv.index("--kv-cache-tokens") + 1] == "0"
    spec = EngineSpec(sim={"prefix_caching": False, "kv_cache_tokens": 8192})
    argv = engines.profile("sim").command(_ctx(spec))
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert argv[argv.index("--kv-cache-tokens") + 1] == "8192"
    from deploybench.cli.engine import options_from_args, parse_serve_args

    opts = options_from_args(parse_serve_args(["--model-dir", "m", *engines.sim_service_args(spec)]))
    assert (opts.prefix_caching, opts.kv_cache_tokens) == (False, 8192)
    assert options_from_args(parse_serve_args(["--model-dir", "m"])).prefix_caching is True


def test_a_profile_file_in_the_profiles_folder_is_used_without_touching_the_library(tmp_path, monkeypatch):
    _write(tmp_path, "tgi", '''name = "tgi"
command = ["text-generation-launcher", "--model-id", "{model_dir}", "--port", "{port}", "--hostname", "{host}",
           "--max-concurrent-requests", "{max_num_seqs}", "{extra_args}"]
[readiness]
kind = "completion"
path = "/v1/completions"
timeout_s = 7
''')
    monkeypatch.setenv(engines.PROFILE_ENV, str(tmp_path))
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": "file", "profile_file": "tgi",
                                                        "extra_args": ["--dtype", "bfloat16"]}})
    prof = engines.profile(cfg.engine)
    assert prof.name == "tgi" and prof.readiness.kind == "completion" and prof.readiness.timeout_s == 7
    assert prof.command(_ctx(cfg.engine)) == [
        "text-generation-launcher", "--model-id", "/srv/m/llama", "--port", "8000", "--hostname", "10.0.0.11",
        "--max-concurrent-requests", "8", "--dtype", "bfloat16"]
    assert engines.profile_name(cfg.engine) == "tgi"
    monkeypatch.delenv(engines.PROFILE_ENV)
    with pytest.raises(ConfigError, match=r"unknown engine profile 'tgi'.*DEPLOYBENCH_ENGINE_PROFILES"):
        engines.profile(cfg.engine)


@pytest.mark.parametrize("command, words", [
    ('["srv", "--model", "{model_path}"]', r"unknown placeholder \{model_path\}.*allowed: \{python\}, \{model_dir\}"),
    ('["srv", "--port={port:05d}"]', r"unknown placeholder \{port:05d\}"),
    ('["srv", "--x", "{extra_args}x"]', r"\{extra_args\} stands for several arguments"),
    ('["srv", "{port"]', "a literal brace"),
])
def test_a_profile_with_a_bad_placeholder_is_refused_naming_it(tmp_path, command, words):
    path = _write(tmp_path, "bad", f'name = "bad"\ncommand = {command}\n') / "bad.toml"
    with pytest.raises(ConfigError, match=words):
        engines.load_profile_file(path)


@pytest.mark.parametrize("body, words", [
    ('name = "other"\ncommand = ["x"]\n', "must be the file's name"),
    ('name = "bad"\ncommand = ["x"]\nhealth = "/h"\n', "health: Extra inputs are not permitted"),
    ('name = "bad"\ncommand = ["x"]\nfiles = "pbtxt"\n', "names no file generator; known: triton"),
    ('name = "bad"\ncommand = ["x"]\n[readiness]\nkind = "ping"\n', "readiness.kind"),
    ('name = "bad"\ncommand = [\n', "cannot read it as TOML"),
    ('name = "bad"\ncommand = ["x"]\n[metrics]\nttfb = "x"\n', "ttfb is no role deploybench reads; roles: ttft, "),
    ('name = "bad"\ncommand = ["x"]\n[metrics]\nttft = "not a name"\n', "is not a Prometheus metric name"),
    ('name = "bad"\ncommand = ["x"]\n[metrics]\nport = 70000\n', "metrics.port"),
    ('name = "bad"\ncommand = ["x"]\n[metrics]\npath = "metrics"\n', "metrics.path"),
])
def test_a_malformed_profile_file_is_refused_naming_the_file(tmp_path, body, words):
    path = _write(tmp_path, "bad", body) / "bad.toml"
    with pytest.raises(ConfigError, match=words) as err:
        engines.load_profile_file(path)
    assert str(path) in str(err.value)


def test_a_profile_name_defined_twice_or_a_missing_folder_is_refused(tmp_path, monkeypatch):
    _write(tmp_path, "vllm", 'name = "vllm"\ncommand = ["x"]\n')
    monkeypatch.setenv(engines.PROFILE_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="'vllm' is defined twice"):
        engines.profiles()
    monkeypatch.setenv(engines.PROFILE_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="not a folder"):
        engines.profiles()


def test_profile_file_goes_with_engine_file_and_external_needs_endpoints():
    with pytest.raises(ConfigError, match="goes with engine.profile=file"):
        RunConfig.parse({"inventory": "x", "engine": {"profile_file": "llamacpp"}})
    with pytest.raises(ConfigError, match="goes with engine.profile=file"):
        RunConfig.parse({"inventory": "x", "engine": {"profile": "file"}})
    with pytest.raises(ConfigError, match="needs rollout.endpoints"):
        RunConfig.parse({"inventory": "x", "rollout": {"backend": "external"}})
    with pytest.raises(ConfigError, match="are for rollout.backend=external"):
        RunConfig.parse({"inventory": "x", "rollout": {"endpoints": ["n1=http://127.0.0.1:8000"]}})
    with pytest.raises(ConfigError, match="names a node twice"):
        RunConfig.parse({"inventory": "x", "rollout": {"backend": "external", "endpoints": [
            "n1=http://127.0.0.1:8000", "n1=http://127.0.0.1:8001"]}})
    ok = RunConfig.parse({"inventory": "x", "engine": {"profile": "file", "profile_file": "llamacpp"}})
    assert ok.fingerprint() != RunConfig.parse({"inventory": "x"}).fingerprint()


def test_external_endpoints_must_be_allow_listed_plain_urls_on_the_runs_nodes(monkeypatch):
    from deploybench.rollout import external

    def cfg(*eps):
        return RunConfig.parse({"inventory": "x", "rollout": {"backend": "external", "endpoints": list(eps)}})

    monkeypatch.setenv("DEPLOYBENCH_TARGET_URLS", "http://10.0.0.11:8000, http://10.0.0.12:8000")
    eps = external.check(cfg("n1=http://10.0.0.11:8000/", "n2=http://10.0.0.12:8000"), ["n1", "n2"])
    assert eps == [{"node": "n1", "url": "http://10.0.0.11:8000", "model": "sim-model"},
                   {"node": "n2", "url": "http://10.0.0.12:8000", "model": "sim-model"}]
    with pytest.raises(ConfigError, match=r"'http://10.0.0.13:8000' is not in the operator's allow-list"):
        external.check(cfg("n1=http://10.0.0.13:8000"), ["n1"])
    with pytest.raises(ConfigError, match="no user, query or fragment"):
        external.check(cfg("n1=http://u:p@10.0.0.11:8000"), ["n1"])
    with pytest.raises(ConfigError, match="node 'n9'"):
        external.check(cfg("n9=http://10.0.0.11:8000"), ["n1"])
    monkeypatch.delenv("DEPLOYBENCH_TARGET_URLS")
    with pytest.raises(ConfigError, match=r"operator.s allow-list \(empty\)"):
        external.check(cfg("n1=http://10.0.0.11:8000"), ["n1"])


# -- issue 28: each profile's metrics as its engine's source names them ------------------------------------------
def test_the_metrics_map_names_where_the_page_is_and_the_port_reaches_the_command():
    tri = engines.profile("triton")
    # Triton serves metrics on their own port (triton-inference-server/server docs/user_guide/metrics.md: 8002)
    assert tri.metrics.port == 8002 and tri.metrics.url("http://10.0.0.11:8000") == "http://10.0.0.11:8002/metrics"
    assert engines.profile("vllm").metrics.url("http://10.0.0.11:8000/") == "http://10.0.0.11:8000/metrics"
    assert engines.Metrics(port=9).url("http://[fd00::1]:8000") == "http://[fd00::1]:9/metrics"
    argv = tri.command(_ctx(EngineSpec(profile="triton")))
    assert "--metrics-port=8002" in argv and "--allow-metrics=true" in argv


@pytest.mark.parametrize("name, roles", [
    # vllm-project/vllm v0.11.0 vllm/v1/metrics/loggers.py
    ("vllm", {"running": "vllm:num_requests_running", "kv_usage": "vllm:kv_cache_usage_perc",
              "itl": "vllm:inter_token_latency_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefix_hits": "vllm:prefix_cache_hits", "preemptions": "vllm:num_preemptions"}),
    # sgl-project/sglang 0.5.23 python/sglang/srt/observability/metrics_collector.py
    ("sglang", {"running": "sglang:num_running_reqs", "waiting": "sglang:num_queue_reqs",
                "kv_usage": "sglang:token_usage", "itl": "sglang:inter_token_latency_seconds"}),
    # ggml-org/llama.cpp tools/server/server-task.cpp (to_metrics)
    ("llamacpp-native", {"running": "llamacpp:requests_processing",
                         "generation_tokens": "llamacpp:tokens_predicted_total"}),
    # triton-inference-server/server docs/user_guide/metrics.md; vllm_backend src/utils/metrics.py
    ("triton", {"inferences": "nv_inference_count", "executions": "nv_inference_exec_count",
                "queue_us": "nv_inference_queue_duration_us", "compute_us": "nv_inference_compute_infer_duration_us",
                "itl": "vllm:time_per_output_token_seconds", "waiting": "nv_inference_pending_request_count"}),
])
def test_each_profile_maps_its_engines_own_metric_names(name, roles):
    names = engines.profile(name).metrics.names
    assert {r: names.get(r) for r in roles} == roles


def test_the_generated_triton_config_asks_the_vllm_backend_for_its_own_metrics():
    cfg = engines.parse_triton_config(engines.triton_config("m", TritonKnobs()))
    # vllm_backend src/model.py: _get_bool_config_param("REPORT_CUSTOM_METRICS")
    assert cfg.parameters["REPORT_CUSTOM_METRICS"].string_value == "true"
    other = engines.parse_triton_config(engines.triton_config("m", TritonKnobs(backend="python")))
    assert "REPORT_CUSTOM_METRICS" not in other.parameters


def test_images_are_pinned_and_llamacpp_runs_on_the_gpu():
    for prof in engines.profiles().values():
        assert not prof.image.endswith(":latest"), (prof.name, prof.image)  # a moving tag: two runs, two softwares
    native = engines.profile("llamacpp-native")
    argv = native.command(_ctx(EngineSpec(profile="file", profile_file="llamacpp-native")))
    # .github/workflows/docker.yml: :server is the CPU image; common/arg.cpp: -ngl, --kv-unified
    assert native.image.endswith(":server-cuda") and "--kv-unified" in argv
    assert argv[argv.index("--n-gpu-layers") + 1] == "999"
    py = engines.profile("llamacpp").command(_ctx(EngineSpec(profile="file", profile_file="llamacpp")))
    assert py[py.index("--n_gpu_layers") + 1] == "-1"  # llama_cpp/server/settings.py: the default 0 is the CPU


def test_the_engine_sees_only_its_gpus():
    """Issue 28, point 9: a process gets CUDA_VISIBLE_DEVICES, a docker container --gpus '"device=..."' (docker's
    list syntax), a podman one a CDI device per GPU; by default the first tensor_parallel_size GPUs."""
    assert engines.process_env(EngineSpec(tensor_parallel_size=2)) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    spec = EngineSpec(profile="vllm", runtime="docker", tensor_parallel_size=2, gpus=[4, 6])
    argv = engines.container_command(spec, _ctx(spec), "c")
    assert argv[argv.index("--gpus") + 1] == '"device=4,6"' and "all" not in argv
    pod = EngineSpec(profile="vllm", runtime="podman", gpus=[5])
    argv = engines.container_command(pod, _ctx(pod), "c")
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=5" and "nvidia.com/gpu=all" not in argv
    with pytest.raises(ValueError, match=r"engine.gpus=\[1, 1\] must name tensor_parallel_size=2 different GPUs"):
        EngineSpec(tensor_parallel_size=2, gpus=[1, 1])
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineSpec(gpus=[0, 1])
