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
from deploybench.config import Api, EngineProfileName, LinkMode, Policy, RunConfig
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
    FormField("fanout_parallel", ("fanout", "parallel"), {**_INT1, "maximum": 64}, "Fan-out",
              "Copies in flight at once from the source node."),
    FormField("canary_nodes", ("rollout", "canary_nodes"), _INT1, "Rollout", "Nodes in the canary step."),
    FormField("scale_steps", ("rollout", "scale_steps"), {"type": "array", "items": _INT1}, "Rollout",
              "Node counts after the canary, e.g. [2, 4, 8, 16]; empty = doubling up to every healthy node."),
    FormField("ready_timeout_s", ("rollout", "ready_timeout_s"), _POS, "Rollout",
              "How long a node may take to answer its health URL."),
    FormField("port", ("rollout", "port"), {"type": "integer", "minimum": 1024, "maximum": 65535}, "Rollout",
              "Engine port on every node."),
    FormField("engine_profile", ("engine", "profile"), _enum(EngineProfileName), "Engine",
              "sim (the lab's simulated engine), vllm or triton."),
    FormField("max_num_seqs", ("engine", "max_num_seqs"), {**_INT1, "maximum": 4096}, "Engine",
              "Batch slots per engine (vLLM --max-num-seqs)."),
    FormField("tensor_parallel_size", ("engine", "tensor_parallel_size"), {**_INT1, "maximum": 64}, "Engine",
              "GPUs per engine (vLLM --tensor-parallel-size)."),
    FormField("max_model_len", ("engine", "max_model_len"), {"type": "integer", "minimum": 16}, "Engine",
              "Context length (vLLM --max-model-len)."),
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
              "Arrival rate for the whole cluster, requests/s (open model)."),
    FormField("load_duration_s", ("load", "duration_s"), _POS, "Load", "Measured duration after warm-up."),
    FormField("warmup_s", ("load", "warmup_s"), _NONNEG, "Load", "Warm-up excluded from every figure."),
    FormField("prompt_tokens", ("load", "prompt_tokens"), _INT1, "Load", "Mean prompt length in tokens."),
    FormField("output_tokens", ("load", "output_tokens"), _INT1, "Load", "Output tokens per request (max_tokens)."),
    FormField("api", ("load", "api"), _enum(Api), "Load", "OpenAI completions or chat completions."),
    FormField("stream", ("load", "stream"), {"type": "boolean"}, "Load", "Ask for SSE streaming responses."),
    FormField("slo_p99_latency_ms", ("slo", "p99_latency_ms"), _POS, "SLO", "P99 end-to-end latency limit."),
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
