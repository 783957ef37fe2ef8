"""Engine profiles: how to launch an inference engine on a node, and how to talk to it.

A profile turns the run's serving knobs into a launch command (an argument list), the
files the engine needs beside its model (Triton's model repository with a generated
``config.pbtxt``), the container image the kubernetes backend runs, and names the
engine's health URL, API flavour and metric names. Profiles live in a registry, so a new
engine is one entry, not another branch in the rollout code.

``check(spec, model_name)`` refuses knobs a profile cannot use before anything starts;
for Triton it renders ``config.pbtxt`` and parses it with Triton's own model-config
protobuf (``tritonclient``), so a config the server would reject fails here instead.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Callable

from deploybench.config import ContainerRuntime, EngineProfileName, EngineSpec, TritonKnobs
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory, Node

CONTAINER_MODEL_ROOT = "/models"  # where containers see the node's model root (read-only)


@dataclass(frozen=True)
class LaunchContext:
    inventory: Inventory
    node: Node
    model_dir: str
    model_name: str
    port: int
    engine: EngineSpec
    work_dir: str = ""  # the engine's own folder on the node (logs, pid, generated files)
    host: str = ""  # address to listen on; default the node's address ("0.0.0.0" in a pod)

    @property
    def listen(self) -> str:
        return self.host or self.node.address


@dataclass(frozen=True)
class EngineProfile:
    name: str
    health_path: str
    api: str  # "openai" or "triton"
    command: Callable[[LaunchContext], list[str]]
    deterministic: bool = False  # the smoke check can predict its output exactly
    image: str = ""  # default container image ("" = cannot run in a container)
    entrypoint: tuple[str, ...] = ()  # leading argv the image's ENTRYPOINT already supplies
    files: Callable[[LaunchContext], dict[str, str]] = lambda ctx: {}
    metrics: dict[str, str] = field(default_factory=dict)  # role -> the engine's Prometheus metric name

    def container_args(self, ctx: LaunchContext) -> list[str]:
        argv = self.command(ctx)
        n = len(self.entrypoint)
        return argv[n:] if tuple(argv[:n]) == self.entrypoint else argv


def sim_service_args(engine: EngineSpec) -> list[str]:
    """The simulated engine's batching and service-time options (what its capacity depends on)."""
    k = engine.sim
    return [
        "--max-num-seqs", str(engine.max_num_seqs),
        "--decode-base-ms", f"{k.decode_base_ms:g}", "--decode-per-seq-ms", f"{k.decode_per_seq_ms:g}",
        "--prefill-per-token-ms", f"{k.prefill_per_token_ms:g}", "--queue-limit", str(k.queue_limit),
    ]


def _sim_command(ctx: LaunchContext) -> list[str]:
    e, k = ctx.engine, ctx.engine.sim
    return [
        ctx.inventory.python, "-m", "deploybench.lab.engine",
        "--host", ctx.listen, "--port", str(ctx.port),
        "--model-dir", ctx.model_dir, "--served-model-name", ctx.model_name,
        *sim_service_args(e), "--max-model-len", str(e.max_model_len),
        "--seed", str(k.seed), "--slowdown", f"{k.slowdown:g}", "--error-rate", f"{k.error_rate:g}",
        "--crash-after", str(k.crash_after),
    ]


def _vllm_command(ctx: LaunchContext) -> list[str]:
    e = ctx.engine
    return [
        "vllm", "serve", ctx.model_dir,
        "--host", ctx.listen, "--port", str(ctx.port),
        "--served-model-name", ctx.model_name,
        "--max-num-seqs", str(e.max_num_seqs),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--max-model-len", str(e.max_model_len),
        *e.extra_args,
    ]


def triton_repository(ctx: LaunchContext) -> str:
    return f"{ctx.work_dir.rstrip('/')}/triton-repo"


def _triton_command(ctx: LaunchContext) -> list[str]:
    return [
        "tritonserver", f"--model-repository={triton_repository(ctx)}",
        f"--http-address={ctx.listen}", f"--http-port={ctx.port}",
        "--allow-metrics=true", "--allow-grpc=false",
        *ctx.engine.extra_args,
    ]


# -- Triton's config.pbtxt -------------------------------------------------------------------------
def triton_config(model_name: str, knobs: TritonKnobs) -> str:
    """config.pbtxt (protobuf text format of inference.ModelConfig) from the knobs the seeds tune."""
    lines = [f"name: {json.dumps(model_name)}", f"backend: {json.dumps(knobs.backend)}",
             f"max_batch_size: {knobs.max_batch_size}"]
    if knobs.max_batch_size > 0:
        sizes = ", ".join(str(s) for s in knobs.preferred_batch_sizes)
        lines += ["dynamic_batching {"]
        if sizes:
            lines += [f"  preferred_batch_size: [ {sizes} ]"]
        lines += [f"  max_queue_delay_microseconds: {knobs.max_queue_delay_us}", "}"]
    lines += ["instance_group [", f"  {{ count: {knobs.instance_count} kind: {knobs.instance_kind} }}", "]"]
    return "\n".join(lines) + "\n"


def parse_triton_config(text: str):
    """Parse ``text`` with Triton's own ModelConfig protobuf; ConfigError names what Triton would reject."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as exc:  # pragma: no cover - a requirement of the project
        raise ConfigError(f"cannot check Triton's config.pbtxt: {exc}; pip install tritonclient") from exc
    try:
        cfg = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigError(f"Triton's model config does not parse: {exc}\n{text}") from exc
    if cfg.max_batch_size < 0:
        raise ConfigError(f"Triton max_batch_size={cfg.max_batch_size} must be >= 0")
    if cfg.HasField("dynamic_batching"):
        if cfg.max_batch_size == 0:
            raise ConfigError("Triton dynamic_batching needs max_batch_size > 0")
        bad = [s for s in cfg.dynamic_batching.preferred_batch_size if not 0 < s <= cfg.max_batch_size]
        if bad:
            raise ConfigError(f"Triton preferred_batch_size {bad} outside 1..max_batch_size={cfg.max_batch_size}")
    if any(g.count < 1 for g in cfg.instance_group):
        raise ConfigError("Triton instance_group count must be >= 1")
    return cfg


def _triton_files(ctx: LaunchContext) -> dict[str, str]:
    """The model repository: <repo>/<model>/config.pbtxt, and 1/model.json pointing at the weights."""
    base = f"{triton_repository(ctx)}/{ctx.model_name}"
    e = ctx.engine
    model_json = {"model": ctx.model_dir, "tensor_parallel_size": e.tensor_parallel_size,
                  "max_num_seqs": e.max_num_seqs, "max_model_len": e.max_model_len}
    return {f"{base}/config.pbtxt": triton_config(ctx.model_name, e.triton),
            f"{base}/1/model.json": json.dumps(model_json, indent=1) + "\n"}


_VLLM_METRICS = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
                 "ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds"}

PROFILES: dict[str, EngineProfile] = {
    EngineProfileName.SIM.value: EngineProfile(
        "sim", "/health", "openai", _sim_command, deterministic=True, metrics=_VLLM_METRICS),
    EngineProfileName.VLLM.value: EngineProfile(
        "vllm", "/health", "openai", _vllm_command, image="vllm/vllm-openai:v0.11.0",
        entrypoint=("vllm", "serve"), metrics=_VLLM_METRICS),
    EngineProfileName.TRITON.value: EngineProfile(
        "triton", "/v2/health/ready", "triton", _triton_command,
        image="nvcr.io/nvidia/tritonserver:25.09-vllm-python-py3", files=_triton_files,
        metrics={"success": "nv_inference_request_success", "failure": "nv_inference_request_failure",
                 "queue_us": "nv_inference_queue_duration_us", "compute_us": "nv_inference_compute_infer_duration_us"}),
}


def profile(name: str | EngineProfileName) -> EngineProfile:
    key = name.value if isinstance(name, EngineProfileName) else name
    try:
        return PROFILES[key]
    except KeyError:
        raise ConfigError(f"unknown engine profile {key!r}; choose one of: {', '.join(PROFILES)}") from None


def image_of(spec: EngineSpec, override: str | None = None) -> str:
    """The container image for ``spec``: the override, the engine's image, else the profile's default."""
    img = override or spec.image or profile(spec.profile).image
    if not img:
        raise ConfigError(f"engine profile {spec.profile.value!r} has no container image; set engine image "
                          "(or use the ssh backend with runtime=process)")
    return img


def check(spec: EngineSpec, model_name: str) -> None:
    """Refuse knobs the profile cannot run with, before anything touches a node."""
    prof = profile(spec.profile)
    if prof.name == "triton":
        parse_triton_config(triton_config(model_name, spec.triton))
    if spec.runtime is not ContainerRuntime.PROCESS:
        image_of(spec)


def container_command(spec: EngineSpec, ctx: LaunchContext, name: str) -> list[str]:
    """``docker|podman run`` for the ssh backend: host network, model root read-only, the engine's folder."""
    prof = profile(spec.profile)
    root = ctx.inventory.model_root_of(ctx.node).rstrip("/")
    inner = LaunchContext(ctx.inventory, ctx.node, f"{CONTAINER_MODEL_ROOT}/{ctx.model_name}", ctx.model_name,
                          ctx.port, ctx.engine, ctx.work_dir, ctx.host)
    argv = [spec.runtime.value, "run", "--rm", "--name", name, "--network", "host",
            "-v", f"{root}:{CONTAINER_MODEL_ROOT}:ro", "-v", f"{ctx.work_dir}:{ctx.work_dir}"]
    if spec.runtime is ContainerRuntime.DOCKER:
        argv += ["--gpus", "all"]
    else:
        argv += ["--device", "nvidia.com/gpu=all"]
    return argv + [image_of(spec), *prof.container_args(inner)]


def write_files_script(files: dict[str, str], python: str = "python3") -> tuple[str, bytes]:
    """A shell script and its stdin that write ``files`` on a node (contents as one JSON document)."""
    blob = json.dumps(files).encode()
    py = ("import json,os,sys\n"
          "for p,t in json.load(sys.stdin).items():\n"
          " os.makedirs(os.path.dirname(p),exist_ok=True)\n"
          " open(p+'.tmp','w').write(t); os.replace(p+'.tmp',p)\n")
    return f"{shlex.quote(python)} -c {shlex.quote(py)}", blob
