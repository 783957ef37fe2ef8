"""The flat form of a RunConfig: what a person types into the Airflow trigger form or the CLI.

One source of truth: every field's JSON schema (type, bounds, allowed values, pattern),
title and description are read from the pydantic ``RunConfig`` model, so the form and the
validation cannot disagree. Only the flat name, the path in RunConfig and the form's
section are declared here (plus, for a few fields, how the form should draw them).
Defaults come from RunConfig too. ``to_config`` turns a filled-in form into a validated
RunConfig; an unknown name is refused.

Optional values are nullable (``"type": ["null", ...]``, default null): the Airflow form
treats every other field as required, and an empty required field disables its Trigger button.

The form a person meets: about fifteen everyday fields (``section=None``: inventory, nodes, model,
engine, preset, phases, rate, durations, SLO) in the form's first section, the only one Airflow's
trigger form opens; everything else in named sections that start closed (``SECTIONS``, in the form's
order). ``FIELDS`` keeps the pipeline's order (cluster, preflight, fan-out, rollout, engine, load, SLO),
which matrix labels and ``from_config`` follow.

**Presets** (deploybench.presets) are named sets of these flat values, data files like the engine profiles;
``configure`` applies the conf's ``preset`` and says what it set.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from deploybench.config import LoadPhase, RunConfig
from deploybench.errors import ConfigError

if TYPE_CHECKING:
    from deploybench.presets import PresetUse

log = logging.getLogger(__name__)

# What the form shows of a field's JSON schema (Airflow's form reads these keys).
_SCHEMA_KEYS = (
    "type", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength",
    "pattern", "items", "minItems", "maxItems", "uniqueItems", "additionalProperties", "maxProperties",
    "title", "description",
)


@dataclass(frozen=True)
class FormField:
    """One form field: its flat name, where it lives in RunConfig, and the form section it shows in
    (None: the everyday fields, in the form's first section, open when the form opens)."""

    name: str
    path: tuple[str, ...]
    section: str | None
    ui: dict[str, Any] = field(default_factory=dict)  # drawing hints: examples (a multi-select), values_display

    @property
    def schema(self) -> dict[str, Any]:
        return {**field_schema(self.path), **self.ui}

    @property
    def title(self) -> str:
        return self.schema["title"]

    @property
    def description(self) -> str:
        return self.schema.get("description", "")

    @property
    def nullable(self) -> bool:
        t = self.schema.get("type")
        return isinstance(t, list) and "null" in t


def default_inventory() -> str:
    """The demo lab's inventory, by name (`deploybench lab up` writes it; see deploybench.inventory.resolve)."""
    return "demo"


def _f(name: str, path: str, section: str | None, **ui: Any) -> FormField:
    return FormField(name, tuple(path.split(".")), section, ui)


EVERYDAY = None  # the section of the everyday fields: none, so Airflow's form puts them in its first, open one
# Airflow 3.3's trigger form (airflow/ui, ConfigForm + FlexibleForm): an accordion whose only item open at first
# is the default section, "Run Parameters", holding every Param without a ``section``; every named section
# starts closed, and opening one closes the others (one item open at a time).
OPEN_SECTION = "Run Parameters"
PRESET = "preset"  # the form field that picks a preset; not a RunConfig field (see apply_preset)

FIELDS: list[FormField] = [
    _f("inventory", "inventory", EVERYDAY),
    _f("nodes", "nodes", EVERYDAY),
    _f("source_node", "source_node", "Fan-out"),
    _f("model_name", "model.name", EVERYDAY),
    _f("lease_on_busy", "lease.on_busy", "Tags and cluster lease"),
    _f("lease_wait_s", "lease.wait_s", "Tags and cluster lease"),
    _f("lease_ttl_s", "lease.ttl_s", "Tags and cluster lease"),
    _f("lease_heartbeat_s", "lease.heartbeat_s", "Tags and cluster lease"),
    _f("link_mode", "preflight.link_mode", "Preflight"),
    _f("iperf_seconds", "preflight.iperf_seconds", "Preflight"),
    _f("link_threshold", "preflight.link_threshold", "Preflight"),
    _f("preflight_policy", "preflight.policy", "Preflight"),
    _f("min_nodes", "preflight.min_nodes", "Preflight"),
    _f("preflight_network", "preflight.network", "Preflight"),
    _f("iperf_bidir", "preflight.bidir", "Preflight"),
    _f("require_gpu", "preflight.require_gpu", "Preflight"),
    _f("free_space_margin", "preflight.free_space_margin", "Preflight"),
    _f("max_clock_offset_ms", "preflight.max_clock_offset_ms", "Preflight"),
    _f("iperf_streams", "preflight.streams", "Preflight"),
    _f("iperf_stream_gbit", "preflight.stream_gbit", "Preflight"),
    _f("iperf_processes", "preflight.processes", "Preflight"),
    _f("iperf_omit_s", "preflight.omit_s", "Preflight"),
    _f("iperf_zerocopy", "preflight.zerocopy", "Preflight"),
    _f("iperf_affinity", "preflight.affinity", "Preflight"),
    _f("ping_count", "preflight.ping_count", "Preflight"),
    _f("ping_interval_s", "preflight.ping_interval_s", "Preflight"),
    _f("max_rtt_ms", "preflight.max_rtt_ms", "Preflight"),
    _f("max_jitter_ms", "preflight.max_jitter_ms", "Preflight"),
    _f("rdma_test", "preflight.rdma", "Preflight"),
    _f("rdma_seconds", "preflight.rdma_seconds", "Preflight"),
    _f("fanout_strategy", "fanout.strategy", "Fan-out"),
    _f("fanout_parallel", "fanout.parallel", "Fan-out"),
    _f("fanout_retries", "fanout.retries", "Fan-out"),
    _f("canary_nodes", "rollout.canary_nodes", "Rollout"),
    _f("scale_steps", "rollout.scale_steps", "Rollout"),
    _f("ready_timeout_s", "rollout.ready_timeout_s", "Rollout"),
    _f("port", "rollout.port", "Rollout"),
    _f("rollout_backend", "rollout.backend", "Rollout"),
    _f("on_step_failure", "rollout.on_step_failure", "Rollout"),
    _f("gate_rate_per_node", "rollout.gate_rate_per_node", "Rollout"),
    _f("gate_duration_s", "rollout.gate_duration_s", "Rollout"),
    _f("gate_min_requests", "rollout.gate_min_requests", "Rollout"),
    _f("k8s_conn_id", "rollout.kubernetes.conn_id", "Kubernetes backend"),
    _f("k8s_namespace", "rollout.kubernetes.namespace", "Kubernetes backend"),
    _f("k8s_image", "rollout.kubernetes.image", "Kubernetes backend"),
    _f("k8s_gpus_per_pod", "rollout.kubernetes.gpus_per_pod", "Kubernetes backend"),
    _f("k8s_gpu_resource", "rollout.kubernetes.gpu_resource", "Kubernetes backend"),
    _f("k8s_cpu", "rollout.kubernetes.cpu", "Kubernetes backend"),
    _f("k8s_memory", "rollout.kubernetes.memory", "Kubernetes backend"),
    _f("k8s_image_pull_secret", "rollout.kubernetes.image_pull_secret", "Kubernetes backend"),
    _f("k8s_tolerate_gpu_taint", "rollout.kubernetes.tolerate_gpu_taint", "Kubernetes backend"),
    _f("external_endpoints", "rollout.endpoints", "Rollout"),
    _f("external_preflight", "rollout.external_preflight", "Rollout"),
    _f("engine_profile", "engine.profile", EVERYDAY),
    _f("engine_profile_file", "engine.profile_file", EVERYDAY),
    _f("max_num_seqs", "engine.max_num_seqs", "Engine"),
    _f("tensor_parallel_size", "engine.tensor_parallel_size", "Engine"),
    _f("max_model_len", "engine.max_model_len", "Engine"),
    _f("engine_extra_args", "engine.extra_args", "Engine"),
    _f("engine_runtime", "engine.runtime", "Engine"),
    _f("engine_image", "engine.image", "Engine"),
    _f("engine_gpus", "engine.gpus", "Engine"),
    _f("triton_max_batch_size", "engine.triton.max_batch_size", "Triton"),
    _f("triton_preferred_batch_sizes", "engine.triton.preferred_batch_sizes", "Triton"),
    _f("triton_max_queue_delay_us", "engine.triton.max_queue_delay_us", "Triton"),
    _f("triton_instance_count", "engine.triton.instance_count", "Triton"),
    _f("triton_instance_kind", "engine.triton.instance_kind", "Triton"),
    _f("sim_decode_base_ms", "engine.sim.decode_base_ms", "Simulated engine"),
    _f("sim_decode_per_seq_ms", "engine.sim.decode_per_seq_ms", "Simulated engine"),
    _f("sim_prefill_per_token_ms", "engine.sim.prefill_per_token_ms", "Simulated engine"),
    _f("sim_slowdown", "engine.sim.slowdown", "Simulated engine"),
    _f("sim_error_rate", "engine.sim.error_rate", "Simulated engine"),
    _f("sim_crash_after", "engine.sim.crash_after", "Simulated engine"),
    _f("load_rate", "load.rate", EVERYDAY),
    _f("load_duration_s", "load.duration_s", EVERYDAY),
    _f("warmup_s", "load.warmup_s", EVERYDAY),
    _f("workload", "load.workload", "Workload"),
    _f("prompt_tokens", "load.prompt_tokens", "Workload"),
    _f("output_tokens", "load.output_tokens", "Workload"),
    _f("api", "load.api", "Workload"),
    _f("stream", "load.stream", "Workload"),
    _f("output_spread", "load.output_spread", "Workload"),
    _f("target_url", "load.target_url", "Load generator"),
    # a multi-select: Airflow's form draws an array with top-level `examples` as one
    _f("load_phases", "load.phases", EVERYDAY, examples=[p.value for p in LoadPhase]),
    _f("probe_start_rps", "load.probe_start_rps", "Phase settings"),
    _f("probe_max_rps", "load.probe_max_rps", "Phase settings"),
    _f("probe_step_s", "load.probe_step_s", "Phase settings"),
    _f("probe_tolerance", "load.probe_tolerance", "Phase settings"),
    _f("sustained_fraction", "load.sustained_fraction", "Phase settings"),
    _f("drift_threshold", "load.drift_threshold", "Phase settings"),
    _f("window_s", "load.window_s", "Phase settings"),
    _f("overload_factor", "load.overload_factor", "Phase settings"),
    _f("overload_ramp_s", "load.overload_ramp_s", "Phase settings"),
    _f("recovery_s", "load.recovery_s", "Phase settings"),
    _f("spike_factor", "load.spike_factor", "Phase settings"),
    _f("spike_hold_s", "load.spike_hold_s", "Phase settings"),
    _f("spike_recovery_s", "load.spike_recovery_s", "Phase settings"),
    _f("scale_up", "load.scale_up", "Phase settings"),
    _f("scale_up_from", "load.scale_up_from", "Phase settings"),
    _f("scale_up_mode", "load.scale_up_mode", "Phase settings"),
    _f("ttft_sample_rps", "load.ttft_sample_rps", "Load generator"),
    _f("scrape_interval_s", "load.scrape_interval_s", "Load generator"),
    _f("k6_max_vus", "load.max_vus", "Load generator"),
    _f("request_timeout_s", "load.request_timeout_s", "Load generator"),
    _f("slo_p99_latency_ms", "slo.p99_latency_ms", EVERYDAY),
    _f("slo_p99_ttft_ms", "slo.p99_ttft_ms", EVERYDAY),
    _f("slo_max_error_rate", "slo.max_error_rate", EVERYDAY),
    _f("slo_min_rps", "slo.min_rps", EVERYDAY),
    _f("slo_min_gpu_util_pct", "slo.min_gpu_util_pct", EVERYDAY),
    _f("tags", "tags", "Tags and cluster lease"),
]

# The form's order: the everyday fields as a person reads them ("this model, on these nodes, this kind of run, at
# this rate, judged so"), then the closed sections where a person looking for a knob would look first.
EVERYDAY_ORDER = ("inventory", "nodes", "model_name", "engine_profile", "engine_profile_file", PRESET, "load_phases",
                  "load_rate", "load_duration_s", "warmup_s", "slo_p99_latency_ms", "slo_p99_ttft_ms",
                  "slo_max_error_rate", "slo_min_rps", "slo_min_gpu_util_pct")
SECTIONS = ("Workload", "Phase settings", "Load generator", "Engine", "Simulated engine", "Triton", "Rollout",
            "Kubernetes backend", "Preflight", "Fan-out", "Tags and cluster lease")


def form_order() -> list[str]:
    """Every name of the trigger form (the preset included) in the order the form shows them."""
    by_section: dict[str | None, list[str]] = {}
    for f in FIELDS:
        by_section.setdefault(f.section, []).append(f.name)
    return [*EVERYDAY_ORDER, *(n for s in SECTIONS for n in by_section.get(s, []))]


BY_NAME = {f.name: f for f in FIELDS}
# RunConfig sections a conf may carry whole but the form does not show: ``deployment`` (keep/adopt) is
# what a matrix's plan writes into its cells' conf so that they share one rollout; a person does not set it
HIDDEN = ("deployment",)


# -- the schema, read from the pydantic model -------------------------------------------------------
def _owner(path: tuple[str, ...]) -> type[BaseModel]:
    """The pydantic model that declares the last part of ``path``."""
    model: type[BaseModel] = RunConfig
    for part in path[:-1]:
        model = model.model_fields[part].annotation  # type: ignore[assignment]
    return model


@functools.cache
def _json_schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema()


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``$ref`` replaced by its definition (enums are small)."""
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        own = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**{k: v for k, v in target.items() if k not in ("title", "description")}, **own}, defs)
    return {k: _inline(v, defs) for k, v in node.items()}


@functools.cache
def _field_schema(path: tuple[str, ...]) -> dict[str, Any]:
    full = _json_schema(_owner(path))
    prop = _inline(full["properties"][path[-1]], full.get("$defs", {}))
    if "anyOf" in prop:  # Optional[X] -> X with "null" among its types (what Airflow's form understands)
        options = prop.pop("anyOf")
        real = [o for o in options if o.get("type") != "null"]
        if len(real) != 1 or len(options) != 2:
            raise ConfigError(f"form field {'.'.join(path)}: only Optional[X] unions can be shown in the form")
        prop = {**real[0], **prop, "type": ["null", real[0]["type"]]}
        if "enum" in prop:
            prop["enum"] = [*prop["enum"], None]
    if not _owner(path).model_fields[path[-1]].title:  # pydantic's made-up title would be the raw name
        raise ConfigError(f"form field {'.'.join(path)} has no title in deploybench.config; give it Field(title=...)")
    return {k: prop[k] for k in _SCHEMA_KEYS if k in prop}


def field_schema(path: tuple[str, ...]) -> dict[str, Any]:
    """The JSON schema of one RunConfig field, as the trigger form shows it (a copy)."""
    return dict(_field_schema(path))


# -- defaults, conversions -------------------------------------------------------------------------
def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def defaults() -> dict[str, Any]:
    """Flat defaults for every form field (taken from RunConfig; the inventory is the demo lab's)."""
    return from_config(RunConfig(inventory=default_inventory()))


def to_config(flat: dict[str, Any]) -> RunConfig:
    """A validated RunConfig from a (partial) flat form, its ``preset`` applied (``configure``); unknown names
    are refused.

    A missing value, or null for a field that is not optional, means the default. An empty
    string in an optional text field means "not set" (what older confs sent)."""
    return configure(flat)[0]


def configure(flat: dict[str, Any]) -> tuple[RunConfig, PresetUse | None]:
    """``to_config``, and what the conf's preset set (None without one): for the validate log and run.json."""
    from deploybench.presets import apply_preset

    resolved, used = apply_preset(flat)
    try:
        return without_preset(resolved), used
    except ConfigError as exc:
        if used is None or not used.set:
            raise
        raise ConfigError(f"{exc}\n  ({used.describe()})") from exc


def without_preset(flat: dict[str, Any]) -> RunConfig:
    """``to_config`` of a conf whose preset was applied already (no ``preset`` key)."""
    flat = dict(flat)
    hidden = {k: flat.pop(k) for k in HIDDEN if k in flat and flat[k] is not None}
    unknown = sorted(set(flat) - set(BY_NAME))
    if unknown:
        raise ConfigError(f"unknown parameter(s) {unknown}; allowed: {', '.join([*BY_NAME, PRESET])}")
    nested: dict[str, Any] = dict(hidden)
    for name, value in {**defaults(), **flat}.items():
        f = BY_NAME[name]
        if value == "" and f.nullable:
            value = None
        if value is None and not f.nullable:
            continue
        node = nested
        for part in f.path[:-1]:
            node = node.setdefault(part, {})
        node[f.path[-1]] = value
    return RunConfig.parse(nested, {f.path: f.name for f in FIELDS})


def from_config(cfg: RunConfig) -> dict[str, Any]:
    """The flat form of ``cfg`` (what a backfill or a matrix cell passes as conf)."""
    data = cfg.model_dump(mode="json")
    return {f.name: _get(data, f.path) for f in FIELDS}


# -- the trigger form -------------------------------------------------------------------------------
def trigger_form() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Every field of the trigger form in the form's order: name -> (default, JSON schema with the form's
    ``section`` where it has one). What ``deploybench.airflow.stages.run_params`` makes Params of."""
    base = defaults()
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name in form_order():
        if name == PRESET:
            from deploybench.presets import preset_schema

            out[name] = (None, preset_schema())
            continue
        f = BY_NAME[name]
        out[name] = (base[name], {**({"section": f.section} if f.section else {}), **f.schema})
    return out
