"""Engine profiles: how to launch an inference engine on a node, and how to talk to it.

A profile is data: a TOML file (``engine_profiles/<name>.toml`` beside this module, or one of
yours in a folder named by ``$DEPLOYBENCH_ENGINE_PROFILES``) giving the launch command as a
template, the readiness check, the API flavour, the Prometheus names of its metrics, whether its
output is deterministic, and its container image. vLLM, Triton and the simulated engine are
profiles like any other; presets ship for llama.cpp's server and SGLang. A new engine is one file,
not another branch in the rollout code.

The command template's items may hold placeholders (``{port}``, ``{model_dir}``...); an item that
is exactly ``{extra_args}`` or ``{sim_args}`` stands for a list of arguments. A profile naming
any other placeholder is refused when it is loaded, naming the placeholder and the allowed ones.
What is code stays code: Triton's model repository with its generated ``config.pbtxt`` is a file
generator a profile names (``files = "triton"``).

Readiness is one of: ``health`` (GET a path, 200), ``models`` (GET /v1/models lists the served
name), ``completion`` (a one-token completion answers) -- each bounded by the profile's own
``timeout_s``, since some servers hold /v1/models while they generate.

``check(spec, model_name)`` refuses knobs a profile cannot use before anything starts;
for Triton it renders ``config.pbtxt`` and parses it with Triton's own model-config
protobuf (``tritonclient``), so a config the server would reject fails here instead.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import string
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploybench.config import ContainerRuntime, EngineProfileName, EngineSpec, TritonKnobs
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory, Node
from deploybench.transport import isolated

CONTAINER_MODEL_ROOT = "/models"  # where containers see the node's model root (read-only)


@dataclass(frozen=True)
class LaunchContext:
    inventory: Inventory
    node: Node
    model_dir: str
    model_name: str
    port: int
    engine: EngineSpec
    work_dir: str = ""  # the engine's folder of this run on the node (generated files; a container's only rw folder)
    host: str = ""  # address to listen on; default the node's address ("0.0.0.0" in a pod)

    @property
    def listen(self) -> str:
        return self.host or self.node.address


@dataclass(frozen=True)
class Readiness:
    """How the controller knows an engine can take requests (see the module's docstring)."""

    kind: str = "health"  # health | models | completion
    path: str = "/health"
    timeout_s: float = 2.0  # one check's own bound: a server may hold /v1/models while it generates
    startup_s: float = 600.0  # how long it may take to become ready when the run does not say (rollout.ready_timeout_s)


# The roles a profile's ``[metrics]`` map may name, by kind: the profile is the only place an engine's metric
# names live (deploybench.load.scrape keeps what the map names and computes the figures by role).
HISTOGRAM_ROLES = ("ttft", "itl", "e2e", "queue")  # Prometheus histograms in seconds: time to first token,
# inter-token latency, end to end, time waiting in the engine's queue
GAUGE_ROLES = ("running", "waiting", "kv_usage",  # requests in the batch, requests queued, KV-cache use (0-1)
               "resident_memory")  # the server process's resident bytes (prometheus_client's process collector)
COUNTER_ROLES = ("prompt_tokens", "generation_tokens", "prefix_hits", "prefix_queries", "preemptions",
                 "success", "failure",
                 # Triton's per-model counters (docs/user_guide/metrics.md of triton-inference-server/server):
                 # inferences over executions is the average batch size; the *_us are cumulative microseconds
                 "inferences", "executions", "request_us", "queue_us", "compute_us")
METRIC_ROLES = (*HISTOGRAM_ROLES, *GAUGE_ROLES, *COUNTER_ROLES)
METRIC_NAME = r"^[A-Za-z_:][A-Za-z0-9_:]{0,199}$"  # Prometheus' metric name syntax


@dataclass(frozen=True)
class Metrics:
    """Where an engine's Prometheus page is and what its figures are called: ``names`` role -> metric name (the
    profile's ``[metrics]`` map), ``port`` (None: the serving port; Triton's is its own, 8002 by default) and
    ``path``."""

    names: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    path: str = "/metrics"

    def url(self, base_url: str) -> str:
        """The page of the engine serving at ``base_url`` (``http://host:port``, of a node or a pod)."""
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(base_url.rstrip("/"))
        netloc = parts.netloc
        if self.port is not None:
            host = parts.hostname or ""
            netloc = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        return urlunsplit((parts.scheme, netloc, self.path, "", ""))


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
    metrics: Metrics = Metrics()  # its Prometheus page: where, and the names of its figures by role
    readiness: Readiness = Readiness()
    source: str = ""  # the profile file it was read from
    program: str = ""  # the command's first item as written ("{python}", "vllm"): what preflight looks for
    liveness_path: str = ""  # where a Kubernetes liveness probe looks ("" = health_path)

    def container_args(self, ctx: LaunchContext) -> list[str]:
        argv = self.command(ctx)
        n = len(self.entrypoint)
        return argv[n:] if tuple(argv[:n]) == self.entrypoint else argv

    def is_ready(self, base_url: str, model: str, timeout_s: float | None = None) -> bool:
        """One readiness check of the engine at ``base_url`` (no retry; False on any failure)."""
        from deploybench import http

        t = self.readiness.timeout_s if timeout_s is None else timeout_s
        url = base_url.rstrip("/") + self.readiness.path
        try:
            if self.readiness.kind == "models":
                data = http.get_json(url, timeout=t)
                listed = data.get("data") if isinstance(data, dict) else None
                return isinstance(listed, list) and any(isinstance(m, dict) and m.get("id") == model for m in listed)
            if self.readiness.kind == "completion":
                status, _ = http.request(url, {"model": model, "prompt": "ready", "max_tokens": 1}, timeout=t)
                return status == 200
            return http.is_up(url, timeout=t)
        except (http.HTTPFailure, ValueError, OSError):
            return False


def sim_service_args(engine: EngineSpec) -> list[str]:
    """The simulated engine's batching and service-time options (what its capacity depends on)."""
    k = engine.sim
    return [
        "--max-num-seqs", str(engine.max_num_seqs),
        "--decode-base-ms", f"{k.decode_base_ms:g}", "--decode-per-seq-ms", f"{k.decode_per_seq_ms:g}",
        "--prefill-per-token-ms", f"{k.prefill_per_token_ms:g}", "--queue-limit", str(k.queue_limit),
        "--enable-prefix-caching" if k.prefix_caching else "--no-enable-prefix-caching",
        "--kv-cache-tokens", str(k.kv_cache_tokens),
    ]


TRITON_VLLM = "vllm"  # Triton's vLLM backend (triton-inference-server/vllm_backend)


def triton_repository(ctx: LaunchContext) -> str:
    return f"{ctx.work_dir.rstrip('/')}/triton-repo"


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
    if knobs.backend == TRITON_VLLM:  # the backend's own metrics (TTFT, time per output token, end to end, tokens) on
        # Triton's page: vllm_backend src/model.py reads this parameter (_get_bool_config_param)
        lines += ['parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }']
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


# -- profiles as data ------------------------------------------------------------------------------
PROFILE_DIR = Path(__file__).with_name("engine_profiles")
PROFILE_ENV = "DEPLOYBENCH_ENGINE_PROFILES"
LIST_PLACEHOLDERS = ("extra_args", "sim_args")  # an item exactly "{name}" becomes these arguments
PLACEHOLDERS = ("python", "model_dir", "model_name", "served_name", "host", "port", "metrics_port", "work_dir",
                "max_num_seqs", "tensor_parallel_size", "max_model_len", "triton_repository", *LIST_PLACEHOLDERS)
FILE_GENERATORS: dict[str, Callable[[LaunchContext], dict[str, str]]] = {"triton": _triton_files}


def _placeholder_values(ctx: LaunchContext) -> dict[str, str]:
    e = ctx.engine
    return {"python": ctx.inventory.python, "model_dir": ctx.model_dir, "model_name": ctx.model_name,
            "served_name": ctx.model_name, "host": ctx.listen, "port": str(ctx.port), "work_dir": ctx.work_dir,
            "max_num_seqs": str(e.max_num_seqs), "tensor_parallel_size": str(e.tensor_parallel_size),
            "max_model_len": str(e.max_model_len), "triton_repository": triton_repository(ctx)}


# The simulated engine's faults (deploybench.sim.faults says what each stands for): their flags and magnitudes
THROTTLE_FRACTION = 0.5  # a GPU in thermal slowdown runs well under its clocks: half is what HW slowdown does
LEAK_BYTES_PER_REQUEST = 2 << 20  # 2 MiB a request: a short lab phase of tens of requests grows by tens of MiB
SMALL_KV_TOKENS = 80  # 5 blocks of 16: two short sequences fill it as they grow
ERROR_RATE = 0.3  # of a short lab phase's ~40 requests per node, ~12 fail: enough to say where errors come from
DRIFT_PER_REQUEST = 0.1  # each answered request makes later steps 10 % longer: x 45 after 40 answered, so a lab
# phase of ~50 requests a node ends at half the throughput it began with (tests/support/fault_runs.py)


def fault_args(fault: str | None) -> list[str]:
    """The sim engine's flags for ``fault`` (None: none); they come last, so they win over the run's knobs."""
    if fault is None:
        return []
    args = {
        "throttle": ["--throttle", f"{THROTTLE_FRACTION:g}"],
        "leak": ["--leak-bytes-per-request", str(LEAK_BYTES_PER_REQUEST)],
        "small_kv": ["--kv-cache-tokens", str(SMALL_KV_TOKENS)],
        "no_batching": ["--no-batching"],
        "errors": ["--error-rate", f"{ERROR_RATE:g}"],
        "drift": ["--drift-per-request", f"{DRIFT_PER_REQUEST:g}"],
    }
    return list(args[fault])


def _list_values(e: EngineSpec, node: Node | None = None) -> dict[str, list[str]]:
    """The list placeholders; ``{sim_args}`` ends with the fault the inventory puts on ``node`` (sim.faults), and
    ``--no-dcgm`` where the inventory says the node has no DCGM (``Node.sim_dcgm``)."""
    k = e.sim
    sim = [*sim_service_args(e), "--seed", str(k.seed), "--slowdown", f"{k.slowdown:g}",
           "--error-rate", f"{k.error_rate:g}", "--crash-after", str(k.crash_after),
           *fault_args(node.sim_fault if node is not None else None),
           *(["--no-dcgm"] if node is not None and not node.sim_dcgm else [])]
    return {"extra_args": list(e.extra_args), "sim_args": sim}


def _allowed() -> str:
    return ", ".join("{" + p + "}" for p in PLACEHOLDERS)


def _template_problems(item: str) -> list[str]:
    """What is wrong with one command item of a profile (unknown or malformed placeholders)."""
    try:
        parts = list(string.Formatter().parse(item))
    except ValueError as exc:
        return [f"command item {item!r}: {exc} (a literal brace is written {{{{ or }}}})"]
    out = []
    for _, name, spec, conv in parts:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conv:
            shown = "{" + name + ("!" + conv if conv else "") + (":" + spec if spec else "") + "}"
            out.append(f"unknown placeholder {shown} in command item {item!r}; allowed: {_allowed()}")
        elif name in LIST_PLACEHOLDERS and item != "{" + name + "}":
            out.append(f"{{{name}}} stands for several arguments: it must be a command item of its own, "
                       f"not part of {item!r}")
    return out


class _ReadinessFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["health", "models", "completion"] = "health"
    path: str = Field("/health", pattern=r"^/[A-Za-z0-9._~/%-]*$", max_length=256)
    timeout_s: float = Field(2.0, gt=0, le=300)
    # the liveness check's path where the engine has one of its own (Triton: /v2/health/live); else ``path``
    live_path: str | None = Field(None, pattern=r"^/[A-Za-z0-9._~/%-]*$", max_length=256)
    # how long the engine may take to become ready when the run does not say (rollout.ready_timeout_s)
    startup_s: float = Field(600.0, gt=0, le=7200)


class _MetricsFile(BaseModel):
    """A profile's ``[metrics]``: role = "metric name" (roles: METRIC_ROLES), and where the page is."""

    model_config = ConfigDict(extra="allow")  # the roles; checked in ProfileFile.problems
    port: int | None = Field(None, ge=1, le=65535)
    path: str = Field("/metrics", pattern=r"^/[A-Za-z0-9._~/%-]*$", max_length=256)

    def names(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ProfileFile(BaseModel):
    """A profile file, checked: unknown keys, unknown placeholders and unknown file generators are refused."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")
    api: Literal["openai", "triton"] = "openai"
    command: list[str] = Field(min_length=1, max_length=256)
    image: str = Field("", max_length=512)
    entrypoint: list[str] = Field(default_factory=list, max_length=16)
    deterministic: bool = False
    files: str = ""
    readiness: _ReadinessFile = Field(default_factory=_ReadinessFile)
    metrics: _MetricsFile = Field(default_factory=_MetricsFile)

    def problems(self) -> list[str]:
        out = [p for item in self.command for p in _template_problems(item)]
        for role, name in self.metrics.names().items():
            if role not in METRIC_ROLES:
                out.append(f"[metrics] {role} is no role deploybench reads; roles: {', '.join(METRIC_ROLES)} "
                           "(and port, path)")
            elif not isinstance(name, str) or not re.match(METRIC_NAME, name):
                out.append(f"[metrics] {role} = {str(name)[:80]!r} is not a Prometheus metric name")
        if self.files and self.files not in FILE_GENERATORS:
            out.append(f"files = {self.files!r} names no file generator; known: {', '.join(FILE_GENERATORS)}")
        return out

    def to_profile(self, source: str) -> EngineProfile:
        template = tuple(self.command)

        metrics_port = self.metrics.port

        def command(ctx: LaunchContext) -> list[str]:
            values, lists = _placeholder_values(ctx), _list_values(ctx.engine, ctx.node)
            if ctx.node.sim_fault is not None and "{sim_args}" not in template:
                raise ConfigError(f"node {ctx.node.name}: the inventory puts the simulated fault "
                                  f"{ctx.node.sim_fault!r} on it, but engine profile {self.name!r} runs no simulated "
                                  "engine (its command has no {sim_args}); remove sim_fault from the inventory or "
                                  "run the sim profile")
            values["metrics_port"] = str(metrics_port or ctx.port)  # the profile's [metrics] port
            argv: list[str] = []
            for item in template:
                if item.startswith("{") and item[1:-1] in lists:
                    argv += lists[item[1:-1]]
                else:
                    argv.append(item.format_map(values))
            return argv

        r = self.readiness
        return EngineProfile(self.name, r.path, self.api, command, deterministic=self.deterministic,
                             image=self.image, entrypoint=tuple(self.entrypoint),
                             files=FILE_GENERATORS.get(self.files, lambda ctx: {}),
                             metrics=Metrics(self.metrics.names(), self.metrics.port, self.metrics.path),
                             readiness=Readiness(r.kind, r.path, r.timeout_s, r.startup_s), source=source,
                             program=template[0], liveness_path=r.live_path or "")


def load_profile_file(path: str | Path) -> EngineProfile:
    """One profile file, validated; ConfigError names the file, what is wrong and what is allowed."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"engine profile {path}: cannot read it as TOML: {exc}") from exc
    try:
        pf = ProfileFile.model_validate(data)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'file'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"engine profile {path}: {msgs}") from None
    if pf.name != path.stem:
        raise ConfigError(f"engine profile {path}: name = {pf.name!r} must be the file's name ({path.stem!r})")
    bad = pf.problems()
    if bad:
        raise ConfigError(f"engine profile {path}: " + "; ".join(bad))
    return pf.to_profile(str(path))


def profile_dirs() -> list[Path]:
    """The shipped profiles, then the folders of $DEPLOYBENCH_ENGINE_PROFILES (os.pathsep-separated)."""
    extra = [Path(p) for p in os.environ.get(PROFILE_ENV, "").split(os.pathsep) if p.strip()]
    return [PROFILE_DIR, *extra]


def profiles() -> dict[str, EngineProfile]:
    """Every profile by name, read now (a file added is seen at once). Two files of one name are refused."""
    out: dict[str, EngineProfile] = {}
    for folder in profile_dirs():
        if not folder.is_dir():
            raise ConfigError(f"${PROFILE_ENV} names {str(folder)!r}, which is not a folder; fix or unset it")
        for f in sorted(folder.glob("*.toml")):
            prof = load_profile_file(f)
            if prof.name in out:
                raise ConfigError(f"engine profile {prof.name!r} is defined twice: {out[prof.name].source} and {f}; "
                                  "rename one")
            out[prof.name] = prof
    return out


def profile_name(spec: EngineSpec) -> str:
    """The name of the profile ``spec`` runs: engine.profile, or engine.profile_file when profile = file."""
    if spec.profile is EngineProfileName.FILE:
        return spec.profile_file or ""
    return spec.profile.value


def profile(name: str | EngineProfileName | EngineSpec) -> EngineProfile:
    """The profile of that name (or of an EngineSpec); ConfigError lists the known ones."""
    if isinstance(name, EngineSpec):
        key = profile_name(name)
    else:
        key = name.value if isinstance(name, EngineProfileName) else name
    known = profiles()
    try:
        return known[key]
    except KeyError:
        raise ConfigError(f"unknown engine profile {key!r}; choose one of: {', '.join(sorted(known))} (or add "
                          f"{key}.toml to a folder named by ${PROFILE_ENV})") from None


def ready_timeout_s(cfg: Any) -> float:
    """How long a node's engine may take to become ready: the run's ``rollout.ready_timeout_s``, else its engine
    profile's startup budget (``[readiness] startup_s``)."""
    return float(cfg.rollout.ready_timeout_s or profile(cfg.engine).readiness.startup_s)


def image_of(spec: EngineSpec, override: str | None = None) -> str:
    """The container image for ``spec``: the override, the engine's image, else the profile's default."""
    img = override or spec.image or profile(spec).image
    if not img:
        raise ConfigError(f"engine profile {profile_name(spec)!r} has no container image; set engine image "
                          "(or use the ssh backend with runtime=process)")
    return img


def check_triton_backend(cfg: Any, tensor_parallel_size: int) -> None:
    """Refuse a parsed config.pbtxt that Triton accepts but its vLLM backend would not load (the model would never
    become ready): ConfigError names the value and what to set instead."""
    if cfg.backend != TRITON_VLLM:
        return
    # vllm_backend src/model.py auto_complete_config: set_max_batch_size(0), which python_backend's
    # triton_python_backend_utils.ModelConfig.set_max_batch_size refuses below a configured value
    if cfg.max_batch_size > 0:
        raise ConfigError(f"Triton's vllm backend batches itself and refuses max_batch_size={cfg.max_batch_size} "
                          "(it sets 0 and the Python backend refuses a smaller value than the config's); set "
                          "triton_max_batch_size to 0")
    kinds = {g.kind for g in cfg.instance_group}
    kind_gpu = 1  # inference.ModelInstanceGroup.Kind.KIND_GPU
    # vllm_backend src/model.py _validate_device_config: "KIND_GPU is currently for single-GPU models"
    if tensor_parallel_size > 1 and kind_gpu in kinds:
        raise ConfigError(f"Triton's vllm backend refuses KIND_GPU for a model on {tensor_parallel_size} GPUs "
                          "(tensor_parallel_size > 1); set triton_instance_kind to KIND_MODEL")


def check(spec: EngineSpec, model_name: str) -> None:
    """Refuse knobs the profile cannot run with, before anything touches a node."""
    prof = profile(spec)
    if prof.files is _triton_files:
        check_triton_backend(parse_triton_config(triton_config(model_name, spec.triton)), spec.tensor_parallel_size)
    if spec.runtime is not ContainerRuntime.PROCESS:
        image_of(spec)


def in_container(ctx: LaunchContext) -> LaunchContext:
    """``ctx`` as the engine's container sees it: the model under CONTAINER_MODEL_ROOT (the node's model root is
    mounted there); its own folder is bound at the same path."""
    return LaunchContext(ctx.inventory, ctx.node, f"{CONTAINER_MODEL_ROOT}/{ctx.model_name}", ctx.model_name,
                         ctx.port, ctx.engine, ctx.work_dir, ctx.host)


def engine_files(spec: EngineSpec, ctx: LaunchContext) -> dict[str, str]:
    """The files the engine reads (Triton's model repository), with the paths the engine itself sees: a process
    the node's, a container's its own (model.json must name /models/<model>, not the node's folder)."""
    return profile(spec).files(ctx if spec.runtime is ContainerRuntime.PROCESS else in_container(ctx))


def process_env(spec: EngineSpec) -> dict[str, str]:
    """The environment an engine process starts with: only its GPUs visible (``EngineSpec.gpu_ids``)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpu_ids()))}


def container_command(spec: EngineSpec, ctx: LaunchContext, name: str) -> list[str]:
    """``docker|podman run`` for the ssh backend: host network, model root read-only, and the engine's folder of
    this run (``LaunchContext.work_dir``) as its only writable folder of the node. ``--ipc=host``: PyTorch shares
    tensors between the processes of a tensor-parallel engine through /dev/shm, which is 64 MiB in a container by
    default (vllm-project/vllm docs/deployment/docker.md: "use the ipc=host flag or --shm-size flag")."""
    prof = profile(spec)
    root = ctx.inventory.model_root_of(ctx.node).rstrip("/")
    inner = in_container(ctx)
    argv = [spec.runtime.value, "run", "--rm", "--name", name, "--network", "host", "--ipc", "host",
            "-v", f"{root}:{CONTAINER_MODEL_ROOT}:ro", "-v", f"{ctx.work_dir}:{ctx.work_dir}"]
    ids = spec.gpu_ids()  # the engine's GPUs only: another engine (or run) may use the node's others
    if spec.runtime is ContainerRuntime.DOCKER:  # docker run --gpus '"device=0,1"' (the quotes: a list, not CSV)
        argv += ["--gpus", f'"device={",".join(map(str, ids))}"']
    else:  # podman with NVIDIA's CDI spec: one device per GPU (nvidia.com/gpu=<index>)
        argv += [x for i in ids for x in ("--device", f"nvidia.com/gpu={i}")]
    return argv + [image_of(spec), *prof.container_args(inner)]


def write_files_script(files: dict[str, str], python: str = "python3") -> tuple[str, bytes]:
    """A shell script and its stdin that write ``files`` on a node (contents as one JSON document)."""
    blob = json.dumps(files).encode()
    py = ("import json,os,sys\n"
          "for p,t in json.load(sys.stdin).items():\n"
          " os.makedirs(os.path.dirname(p),exist_ok=True)\n"
          " open(p+'.tmp','w').write(t); os.replace(p+'.tmp',p)\n")
    return f"{shlex.join(isolated(python))} -c {shlex.quote(py)}", blob
