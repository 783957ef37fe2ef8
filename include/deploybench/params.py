"""The flat form of a RunConfig: what a person types into the Airflow trigger form or the CLI.

Each field maps one flat name to a path in RunConfig and carries the JSON schema the
form shows (type, bounds, allowed values, section). Defaults come from RunConfig
itself, so the form and the library cannot disagree. ``to_config`` turns a filled-in
form into a validated RunConfig; an unknown name is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deploybench import paths
from deploybench.config import Api, EngineProfileName, FanoutStrategy, LinkMode, LoadPhase, Policy, PreflightNetwork, RunConfig
from deploybench.config import RolloutBackend, StepFailurePolicy  # rollout fields (issue 5)
from deploybench.errors import ConfigError


@dataclass(frozen=True)
class FormField:
    name: str
    path: tuple[str, ...]
    schema: dict[str, Any]
    section: str
    description: str
    default: Any = None
    explicit_default: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _enum(e: type) -> dict:
    return {"type": "string", "enum": [m.value for m in e]}


_INT0 = {"type": "integer", "minimum": 0}
_INT1 = {"type": "integer", "minimum": 1}
_POS = {"type": "number", "exclusiveMinimum": 0}
_NONNEG = {"type": "number", "minimum": 0}
_FRACTION = {"type": "number", "minimum": 0, "maximum": 1}


def default_inventory() -> str:
    """The demo lab's inventory (written by `deploybench lab up`)."""
    return str(paths.PROJECT_ROOT / ".deploybench" / "lab" / "demo" / "inventory.json")


FIELDS: list[FormField] = [
    FormField("inventory", ("inventory",), {"type": "string", "minLength": 1}, "Cluster",
              "Path of the inventory JSON (the lab writes one; see README for a real cluster).",
              default=default_inventory(), explicit_default=True),
    FormField("nodes", ("nodes",), _INT0, "Cluster", "Use the first N nodes of the inventory; 0 = all."),
    FormField("source_node", ("source_node",), {"type": ["string", "null"]}, "Cluster",
              "Node that holds the model and feeds the fan-out; empty = the first node."),
    FormField("model_name", ("model", "name"), {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
              "Cluster", "Model folder under each node's model root (also the served model name)."),
    FormField("link_mode", ("preflight", "link_mode"), _enum(LinkMode), "Preflight",
              "Which node pairs iperf3 tests: ring (neighbours), mesh (every pair), star (source to each)."),
    FormField("iperf_seconds", ("preflight", "iperf_seconds"), {**_POS, "maximum": 60}, "Preflight",
              "Length of each iperf3 test."),
    FormField("link_threshold", ("preflight", "link_threshold"), {**_POS, "maximum": 1.5}, "Preflight",
              "Fraction of the nominal link speed a link must reach (0.9 = 90 %)."),
    FormField("preflight_policy", ("preflight", "policy"), _enum(Policy), "Preflight",
              "abort: any bad node fails the run; exclude: drop bad nodes and go on."),
    FormField("min_nodes", ("preflight", "min_nodes"), _INT1, "Preflight",
              "Under 'exclude', the fewest healthy nodes the run goes on with."),
    FormField("preflight_network", ("preflight", "network"), _enum(PreflightNetwork), "Preflight",
              "Network iperf3 tests: backend (the nodes' backend addresses, where given) or front."),
    FormField("iperf_bidir", ("preflight", "bidir"), {"type": "boolean"}, "Preflight",
              "Test both directions at once (iperf3 --bidir); off: one after the other, twice as long."),
    FormField("require_gpu", ("preflight", "require_gpu"), {"type": "boolean"}, "Preflight",
              "A node without a GPU fails preflight; off: 'no GPU' is only reported (the lab has none)."),
    FormField("free_space_margin", ("preflight", "free_space_margin"), {**_NONNEG, "maximum": 10}, "Preflight",
              "Free space each node needs beyond the model's size, as a fraction of it (0.1 = 10 %)."),
    FormField("max_clock_offset_ms", ("preflight", "max_clock_offset_ms"), _POS, "Preflight",
              "Largest clock offset of a node against the controller."),
    FormField("fanout_strategy", ("fanout", "strategy"), _enum(FanoutStrategy), "Fan-out",
              "chain: pipelined relay source->n1->n2..., about one copy's time; tree: doubling rounds; "
              "star: rsync from the source to every node (baseline, needs no relay)."),
    FormField("fanout_parallel", ("fanout", "parallel"), {**_INT1, "maximum": 64}, "Fan-out",
              "star: copies in flight at once from the source node."),
    FormField("fanout_retries", ("fanout", "retries"), {**_INT0, "maximum": 10}, "Fan-out",
              "Extra attempts per node (resume, route around a dead node) before the preflight policy applies."),
    FormField("canary_nodes", ("rollout", "canary_nodes"), _INT1, "Rollout", "Nodes in the canary step."),
    FormField("scale_steps", ("rollout", "scale_steps"), {"type": "array", "items": _INT1}, "Rollout",
              "Node counts after the canary, e.g. [2, 4, 8, 16]; empty = doubling up to every healthy node."),
    FormField("ready_timeout_s", ("rollout", "ready_timeout_s"), _POS, "Rollout",
              "How long a node may take to answer its health URL."),
    FormField("port", ("rollout", "port"), {"type": "integer", "minimum": 1024, "maximum": 65535}, "Rollout",
              "Engine port on every node."),
    FormField("rollout_backend", ("rollout", "backend"), _enum(RolloutBackend), "Rollout",
              "ssh: the engine as a supervised process on each node; kubernetes: Deployments through the "
              "Kubernetes connection."),
    FormField("on_step_failure", ("rollout", "on_step_failure"), _enum(StepFailurePolicy), "Rollout",
              "A failed scale step: rollback to the last good step, or teardown everything. A failed canary "
              "always tears down."),
    FormField("gate_rate_per_node", ("rollout", "gate_rate_per_node"), {**_POS, "maximum": 1000}, "Rollout",
              "Gate load after every step, requests/s per serving node (k6, judged against the SLO)."),
    FormField("gate_duration_s", ("rollout", "gate_duration_s"), {**_POS, "maximum": 600}, "Rollout",
              "Measured length of each gate load."),
    FormField("gate_min_requests", ("rollout", "gate_min_requests"), _INT1, "Rollout",
              "A gate with fewer measured requests fails: no data is not a pass."),
    FormField("k8s_namespace", ("rollout", "kubernetes", "namespace"), {"type": "string", "minLength": 1}, "Rollout",
              "kubernetes backend: namespace of the Deployments and Services."),
    FormField("k8s_image", ("rollout", "kubernetes", "image"), {"type": "string"}, "Rollout",
              "kubernetes backend: engine image; empty = the engine profile's default."),
    FormField("k8s_gpus_per_pod", ("rollout", "kubernetes", "gpus_per_pod"), {**_INT0, "maximum": 64}, "Rollout",
              "kubernetes backend: GPU limit of each engine pod."),
    FormField("engine_profile", ("engine", "profile"), _enum(EngineProfileName), "Engine",
              "sim (the lab's simulated engine), vllm or triton."),
    FormField("max_num_seqs", ("engine", "max_num_seqs"), {**_INT1, "maximum": 4096}, "Engine",
              "Batch slots per engine (vLLM --max-num-seqs)."),
    FormField("tensor_parallel_size", ("engine", "tensor_parallel_size"), {**_INT1, "maximum": 64}, "Engine",
              "GPUs per engine (vLLM --tensor-parallel-size)."),
    FormField("max_model_len", ("engine", "max_model_len"), {"type": "integer", "minimum": 16}, "Engine",
              "Context length (vLLM --max-model-len)."),
    FormField("triton_max_batch_size", ("engine", "triton", "max_batch_size"), {**_INT0, "maximum": 4096}, "Engine",
              "Triton config.pbtxt max_batch_size; 0 = no dynamic batching."),
    FormField("triton_preferred_batch_sizes", ("engine", "triton", "preferred_batch_sizes"),
              {"type": "array", "items": _INT1}, "Engine",
              "Triton dynamic_batching preferred_batch_size, e.g. [4, 8]; each at most max_batch_size."),
    FormField("triton_max_queue_delay_us", ("engine", "triton", "max_queue_delay_us"),
              {**_INT0, "maximum": 10_000_000}, "Engine", "Triton dynamic_batching max_queue_delay_microseconds."),
    FormField("triton_instance_count", ("engine", "triton", "instance_count"), {**_INT1, "maximum": 64}, "Engine",
              "Triton instance_group count (model instances per server)."),
    FormField("sim_decode_base_ms", ("engine", "sim", "decode_base_ms"), _POS, "Simulated engine",
              "Decode step time with an empty batch."),
    FormField("sim_decode_per_seq_ms", ("engine", "sim", "decode_per_seq_ms"), _NONNEG, "Simulated engine",
              "Extra decode step time per running sequence."),
    FormField("sim_prefill_per_token_ms", ("engine", "sim", "prefill_per_token_ms"), _NONNEG, "Simulated engine",
              "Prefill cost per prompt token."),
    FormField("sim_slowdown", ("engine", "sim", "slowdown"), _POS, "Simulated engine",
              "Multiplies every simulated time (fault injection)."),
    FormField("sim_error_rate", ("engine", "sim", "error_rate"), _FRACTION, "Simulated engine",
              "Fraction of requests answered with HTTP 500 (fault injection)."),
    FormField("sim_crash_after", ("engine", "sim", "crash_after"), _INT0, "Simulated engine",
              "The engine exits after this many requests; 0 = never (fault injection)."),
    FormField("load_rate", ("load", "rate"), {**_POS, "maximum": 100000}, "Load",
              "Arrival rate for the whole cluster, requests/s (open model): without the probe, the capacity "
              "that sustained (sustained_fraction x it) and overload work from."),
    FormField("load_duration_s", ("load", "duration_s"), {**_POS, "maximum": 86400}, "Load",
              "Measured duration of the sustained phase, after its warm-up."),
    FormField("warmup_s", ("load", "warmup_s"), {**_NONNEG, "maximum": 3600}, "Load",
              "Warm-up excluded from every figure (sustained and overload)."),
    FormField("prompt_tokens", ("load", "prompt_tokens"), _INT1, "Load", "Mean prompt length in tokens."),
    FormField("output_tokens", ("load", "output_tokens"), _INT1, "Load", "Output tokens per request (max_tokens)."),
    FormField("api", ("load", "api"), _enum(Api), "Load", "OpenAI completions or chat completions."),
    FormField("stream", ("load", "stream"), {"type": "boolean"}, "Load", "Ask for SSE streaming responses."),
    FormField("output_spread", ("load", "output_spread"), {**_NONNEG, "exclusiveMaximum": 1}, "Load",
              "Output lengths spread uniformly over [1-x, 1+x] x output_tokens; 0 = all the same."),
    FormField("target_url", ("load", "target_url"), {"type": "string", "pattern": r"^(https?://\S+)?$"}, "Load",
              "One load-balanced URL (e.g. a Kubernetes Service) for all requests; empty = every node directly."),
    FormField("load_phases", ("load", "phases"),
              {"type": "array", "items": _enum(LoadPhase), "minItems": 1, "uniqueItems": True}, "Load",
              "Phases to run, in order: probe (find the capacity), sustained (hold a fraction of it), overload "
              "(ramp past it, then recover). Without probe, load_rate is taken as the capacity.",
              default=[LoadPhase.SUSTAINED.value], explicit_default=True),
    FormField("probe_start_rps", ("load", "probe_start_rps"), {**_POS, "maximum": 100000}, "Load",
              "Probe: first rate tried; doubled until a step breaks the SLO, then bisected."),
    FormField("probe_max_rps", ("load", "probe_max_rps"), {**_POS, "maximum": 100000}, "Load",
              "Probe: highest rate tried."),
    FormField("probe_step_s", ("load", "probe_step_s"), {**_POS, "maximum": 3600}, "Load",
              "Probe: measured seconds of each step."),
    FormField("probe_tolerance", ("load", "probe_tolerance"), {"type": "number", "minimum": 0.005, "maximum": 0.5},
              "Load", "Probe: stop when the bracket is narrower than this fraction of its top."),
    FormField("sustained_fraction", ("load", "sustained_fraction"), {**_POS, "maximum": 1.5}, "Load",
              "Sustained rate as a fraction of the capacity."),
    FormField("drift_threshold", ("load", "drift_threshold"), {**_POS, "maximum": 10}, "Load",
              "Report drift when throughput or P99 moves more than this fraction between first and last window."),
    FormField("window_s", ("load", "window_s"), {**_POS, "maximum": 3600}, "Load", "Window of per-window figures."),
    FormField("overload_factor", ("load", "overload_factor"), {"type": "number", "exclusiveMinimum": 1,
              "maximum": 20}, "Load", "Overload: the ramp ends at this multiple of the capacity."),
    FormField("overload_ramp_s", ("load", "overload_ramp_s"), {**_POS, "maximum": 86400}, "Load",
              "Overload: length of the ramp."),
    FormField("recovery_s", ("load", "recovery_s"), {**_POS, "maximum": 86400}, "Load",
              "Overload: time at half the capacity after the ramp."),
    FormField("ttft_sample_rps", ("load", "ttft_sample_rps"), {**_NONNEG, "maximum": 1000}, "Load",
              "Streamed requests/s sent by the client-side TTFT/ITL sampler (part of the offered rate); 0 = off."),
    FormField("scrape_interval_s", ("load", "scrape_interval_s"), {**_NONNEG, "maximum": 300}, "Load",
              "Scrape every endpoint's /metrics this often during every phase; 0 = off."),
    FormField("slo_p99_latency_ms", ("slo", "p99_latency_ms"), _POS, "SLO", "P99 end-to-end latency limit."),
    FormField("slo_p99_ttft_ms", ("slo", "p99_ttft_ms"), _NONNEG, "SLO",
              "P99 time-to-first-token limit (client-measured); 0 = no objective."),
    FormField("slo_max_error_rate", ("slo", "max_error_rate"), _FRACTION, "SLO", "Highest error rate allowed."),
    FormField("slo_min_rps", ("slo", "min_rps"), _NONNEG, "SLO", "Cluster throughput target; 0 = none."),
    FormField("tags", ("tags",), {"type": "object", "additionalProperties": {"type": "string"}}, "Run",
              "Free labels stored with the run (e.g. {\"purpose\": \"nightly\"})."),
]

_BY_NAME = {f.name: f for f in FIELDS}


def _model_default(path: tuple[str, ...]) -> Any:
    obj: Any = RunConfig.model_construct()
    for part in path:
        fields = type(obj).model_fields
        obj = getattr(obj, part, None) if part in getattr(obj, "__dict__", {}) else fields[part].get_default(
            call_default_factory=True
        )
    if hasattr(obj, "value"):
        return obj.value
    return obj


def defaults() -> dict[str, Any]:
    """Flat defaults for every form field (taken from RunConfig)."""
    return {f.name: (f.default if f.explicit_default else _model_default(f.path)) for f in FIELDS}


def to_config(flat: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from a (partial) flat form; unknown names are refused."""
    unknown = sorted(set(flat) - set(_BY_NAME))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; allowed: {', '.join(_BY_NAME)}")
    nested: dict[str, Any] = {}
    for name, value in {**defaults(), **flat}.items():
        if value is None or value == "" and name == "source_node":
            continue
        node = nested
        path = _BY_NAME[name].path
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return RunConfig.parse(nested, {f.path: f.name for f in FIELDS})


def from_config(cfg: RunConfig) -> dict[str, Any]:
    """The flat form of ``cfg`` (what a backfill or a matrix cell passes as conf)."""
    data = cfg.model_dump(mode="json")
    out = {}
    for f in FIELDS:
        v: Any = data
        for part in f.path:
            v = v.get(part) if isinstance(v, dict) else None
        out[f.name] = v
    return out
