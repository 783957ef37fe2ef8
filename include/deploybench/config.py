"""RunConfig: one deploy-and-benchmark run, typed and validated once, at the edge.

Unknown keys are refused (a typo fails loudly). ``fingerprint()`` hashes everything
that changes performance, so results of the same configuration line up across runs.
The flat form a person fills in (Airflow Params, CLI flags) is in ``deploybench.params``.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deploybench.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineProfileName(str, Enum):
    SIM = "sim"
    VLLM = "vllm"
    TRITON = "triton"


class LinkMode(str, Enum):
    RING = "ring"
    MESH = "mesh"
    STAR = "star"


class Policy(str, Enum):
    ABORT = "abort"
    EXCLUDE = "exclude"


class Api(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


class ModelSpec(_Strict):
    name: str = Field("sim-model", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class PreflightNetwork(str, Enum):
    """Which address iperf3 tests: the backend (bulk-data) network when a node has one, or the front one."""

    BACKEND = "backend"
    FRONT = "front"


class PreflightSpec(_Strict):
    link_mode: LinkMode = LinkMode.RING
    iperf_seconds: float = Field(2.0, gt=0, le=60)
    link_threshold: float = Field(0.9, gt=0, le=1.5, description="fraction of the nominal link speed a link must reach")
    policy: Policy = Policy.ABORT
    min_nodes: int = Field(1, ge=1)
    network: PreflightNetwork = PreflightNetwork.BACKEND
    bidir: bool = Field(True, description="both directions at once (iperf3 --bidir); off: one after the other (-R)")
    require_gpu: bool = Field(False, description="a node without a GPU (nvidia-smi) fails; off: it is only reported")
    free_space_margin: float = Field(0.1, ge=0, le=10, description="free space needed beyond the model's size, "
                                                                   "as a fraction of it")
    max_clock_offset_ms: float = Field(500.0, gt=0, description="largest clock offset of a node against the controller")


class FanoutStrategy(str, Enum):
    CHAIN = "chain"
    TREE = "tree"
    STAR = "star"


class FanoutSpec(_Strict):
    strategy: FanoutStrategy = Field(FanoutStrategy.CHAIN, description="chain (pipelined relay), tree, star (rsync)")
    parallel: int = Field(4, ge=1, le=64, description="star: copies in flight at once from the source")
    retries: int = Field(2, ge=0, le=10, description="extra attempts per node (resume / route around) before policy")
    port: int = Field(7471, ge=1024, le=65535, description="TCP port of the relay on the backend network")
    io_timeout_s: float = Field(15.0, gt=0, le=600, description="a relay stalled this long gives up its hop")
    timeout_s: float = Field(1800, gt=0)


class RolloutBackend(str, Enum):
    SSH = "ssh"
    KUBERNETES = "kubernetes"


class StepFailurePolicy(str, Enum):
    ROLLBACK = "rollback"  # back to the last good step (its engines serve until teardown), then fail
    TEARDOWN = "teardown"  # stop every engine at once, then fail


class KubernetesSpec(_Strict):
    """The kubernetes backend: where and how the engine's Deployments run (see deploybench.rollout.manifests)."""

    conn_id: str = Field("kubernetes_default", min_length=1, description="Airflow Kubernetes connection")
    namespace: str = Field("deploybench", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    image: str = Field("", description="engine container image; empty = the engine profile's default")
    gpus_per_pod: int = Field(1, ge=0, le=64)
    gpu_resource: str = Field("nvidia.com/gpu", pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$")
    progress_deadline_s: int = Field(600, ge=10, le=86400)


class RolloutSpec(_Strict):
    canary_nodes: int = Field(2, ge=1)
    scale_steps: list[int] = Field(default_factory=list, description="node counts after the canary; [] = doubling")
    ready_timeout_s: float = Field(120, gt=0)
    port: int = Field(8000, ge=1024, le=65535)
    backend: RolloutBackend = RolloutBackend.SSH
    on_step_failure: StepFailurePolicy = StepFailurePolicy.ROLLBACK
    gate_rate_per_node: float = Field(2.0, gt=0, le=1000, description="gate load, requests/s per serving node")
    gate_duration_s: float = Field(5.0, gt=0, le=600)
    gate_warmup_s: float = Field(1.0, ge=0, le=60)
    gate_min_requests: int = Field(5, ge=1, description="fewer measured requests fail the gate")
    stop_grace_s: float = Field(5.0, ge=0, le=300, description="TERM, then KILL after this long")
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)

    @model_validator(mode="after")
    def _gate_reachable(self) -> "RolloutSpec":
        offered = self.gate_rate_per_node * self.canary_nodes * self.gate_duration_s
        if offered < self.gate_min_requests:
            raise ValueError(
                f"the canary gate offers only {offered:g} requests (gate_rate_per_node={self.gate_rate_per_node:g} x "
                f"canary_nodes={self.canary_nodes} x gate_duration_s={self.gate_duration_s:g}) but "
                f"gate_min_requests={self.gate_min_requests}; raise the rate or the duration, or lower the minimum"
            )
        return self


class SimKnobs(_Strict):
    """The simulated engine's service model (see deploybench.lab.engine)."""

    decode_base_ms: float = Field(15.0, gt=0)
    decode_per_seq_ms: float = Field(2.0, ge=0)
    prefill_per_token_ms: float = Field(0.1, ge=0)
    queue_limit: int = Field(64, ge=0)
    seed: int = 0
    slowdown: float = Field(1.0, gt=0)
    error_rate: float = Field(0.0, ge=0, le=1)
    crash_after: int = Field(0, ge=0, description="exit after this many requests; 0 = never")


class TritonKnobs(_Strict):
    """What Triton's generated config.pbtxt says (see deploybench.engines.triton_config)."""

    backend: str = Field("vllm", pattern=r"^[a-z][a-z0-9_]{0,63}$", description="Triton backend serving the model")
    max_batch_size: int = Field(8, ge=0, le=4096, description="0 = the backend batches itself (no dynamic batching)")
    preferred_batch_sizes: list[int] = Field(default_factory=list, description="dynamic batching; [] = none preferred")
    max_queue_delay_us: int = Field(100, ge=0, le=10_000_000)
    instance_count: int = Field(1, ge=1, le=64)
    instance_kind: Literal["KIND_GPU", "KIND_CPU", "KIND_MODEL", "KIND_AUTO"] = "KIND_GPU"

    @model_validator(mode="after")
    def _sizes(self) -> "TritonKnobs":
        p = self.preferred_batch_sizes
        if any(s < 1 for s in p) or p != sorted(set(p)):
            raise ValueError(f"triton preferred_batch_sizes={p} must be increasing positive sizes, e.g. [4, 8]")
        if p and p[-1] > self.max_batch_size:
            raise ValueError(f"triton preferred_batch_sizes={p} go past max_batch_size={self.max_batch_size}; "
                             "raise max_batch_size or drop the larger sizes")
        return self


class ContainerRuntime(str, Enum):
    PROCESS = "process"  # a supervised process on the node (the ssh backend's default)
    DOCKER = "docker"
    PODMAN = "podman"


class EngineSpec(_Strict):
    profile: EngineProfileName = EngineProfileName.SIM
    max_num_seqs: int = Field(8, ge=1, le=4096)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_model_len: int = Field(4096, ge=16)
    sim: SimKnobs = Field(default_factory=SimKnobs)
    triton: TritonKnobs = Field(default_factory=TritonKnobs)
    runtime: ContainerRuntime = Field(ContainerRuntime.PROCESS, description="ssh backend: process or a container")
    image: str = Field("", description="container image (ssh with a container runtime, kubernetes); empty = default")

    @model_validator(mode="after")
    def _profile_fits(self) -> "EngineSpec":
        if self.profile is EngineProfileName.SIM and self.runtime is not ContainerRuntime.PROCESS:
            raise ValueError(f"engine runtime={self.runtime.value} needs an image; the sim engine runs as a "
                             "process (runtime=process)")
        return self


# Engine fields added after the first stored runs: left out of the fingerprint while at their
# defaults (or irrelevant to the profile), so earlier series keep their identity.
_LATER_ENGINE_FIELDS = ("triton", "runtime", "image")


class LoadPhase(str, Enum):
    PROBE = "probe"
    SUSTAINED = "sustained"
    OVERLOAD = "overload"


class LoadSpec(_Strict):
    rate: float = Field(8.0, gt=0, le=100000, description="arrival rate for the whole cluster, requests/s; "
                        "without the probe, the capacity sustained (x sustained_fraction) and overload work from")
    duration_s: float = Field(30.0, gt=0, le=86400, description="measured duration of the sustained phase")
    warmup_s: float = Field(5.0, ge=0, le=3600)
    prompt_tokens: int = Field(200, ge=1)
    output_tokens: int = Field(64, ge=1)
    output_spread: float = Field(0.0, ge=0, lt=1, description="output lengths spread over [1-x, 1+x] x output_tokens")
    api: Api = Api.COMPLETIONS
    stream: bool = False
    max_vus: int = Field(0, ge=0, description="0 = sized from rate x the SLO's P99 latency")
    request_timeout_s: float = Field(30.0, gt=0, le=3600)
    target_url: str = Field("", pattern=r"^(https?://[^\s]+)?$",
                            description="one load-balanced URL for all requests; empty = every node's endpoint")
    # the phases (see deploybench.load): probe finds the capacity, sustained holds a fraction of it,
    # overload ramps past it and watches the recovery
    phases: list[LoadPhase] = Field(default_factory=lambda: [LoadPhase.SUSTAINED])
    probe_start_rps: float = Field(1.0, gt=0, le=100000)
    probe_max_rps: float = Field(1000.0, gt=0, le=100000)
    probe_step_s: float = Field(10.0, gt=0, le=3600, description="measured seconds of each probe step")
    probe_warmup_s: float = Field(2.0, ge=0, le=600, description="warm-up of each probe step, excluded")
    probe_tolerance: float = Field(0.05, ge=0.005, le=0.5, description="stop when the bracket is this narrow (relative)")
    probe_max_steps: int = Field(14, ge=2, le=100)
    min_achieved_ratio: float = Field(0.99, gt=0.5, le=1, description="achieved / offered a step must reach")
    sustained_fraction: float = Field(0.8, gt=0, le=1.5, description="sustained rate = this x the capacity")
    drift_threshold: float = Field(0.1, gt=0, le=10, description="relative change first->last window reported as drift")
    window_s: float = Field(5.0, gt=0, le=3600, description="window of the per-window figures")
    overload_factor: float = Field(2.0, gt=1, le=20, description="the overload ramp ends at this x the capacity")
    overload_ramp_s: float = Field(30.0, gt=0, le=86400)
    recovery_s: float = Field(30.0, gt=0, le=86400, description="time at half the capacity after the ramp")
    ttft_sample_rps: float = Field(1.0, ge=0, le=1000, description="streamed requests/s of the client TTFT sampler; 0 = off")
    scrape_interval_s: float = Field(1.0, ge=0, le=300, description="/metrics scrape interval per endpoint; 0 = off")

    @model_validator(mode="after")
    def _coherent(self) -> "LoadSpec":
        if self.probe_max_rps <= self.probe_start_rps:
            raise ValueError(f"load.probe_max_rps={self.probe_max_rps} must be above probe_start_rps="
                             f"{self.probe_start_rps}")
        if len(set(self.phases)) != len(self.phases) or not self.phases:
            raise ValueError(f"load.phases={[p.value for p in self.phases]} must name each phase at most once, "
                             "at least one of probe, sustained, overload")
        return self


class SLO(_Strict):
    p99_latency_ms: float = Field(2000.0, gt=0)
    p99_ttft_ms: float = Field(0.0, ge=0, description="P99 time to first token limit; 0 = no objective")
    max_error_rate: float = Field(0.01, ge=0, le=1)
    min_rps: float = Field(0.0, ge=0, description="cluster target; 0 = no target")


# how the load is offered, not what is served: left out of the fingerprint
LOAD_SHAPE_FIELDS = {
    "phases", "probe_start_rps", "probe_max_rps", "probe_step_s", "probe_warmup_s", "probe_tolerance",
    "probe_max_steps", "min_achieved_ratio", "sustained_fraction", "drift_threshold", "window_s",
    "overload_factor", "overload_ramp_s", "recovery_s", "ttft_sample_rps", "scrape_interval_s", "target_url",
}


class RunConfig(_Strict):
    inventory: str
    nodes: int = Field(0, ge=0, description="use the first N nodes of the inventory; 0 = all")
    source_node: str | None = None
    model: ModelSpec = Field(default_factory=ModelSpec)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    fanout: FanoutSpec = Field(default_factory=FanoutSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    load: LoadSpec = Field(default_factory=LoadSpec)
    slo: SLO = Field(default_factory=SLO)
    tags: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _coherent(self) -> "RunConfig":
        if self.nodes and self.rollout.canary_nodes > self.nodes:
            raise ValueError(
                f"rollout.canary_nodes={self.rollout.canary_nodes} is larger than nodes={self.nodes}; "
                f"choose canary_nodes between 1 and {self.nodes}"
            )
        steps = self.rollout.scale_steps
        if any(s < 1 for s in steps) or steps != sorted(set(steps)):
            raise ValueError(f"rollout.scale_steps={steps} must be increasing positive node counts, e.g. [2, 4, 8, 16]")
        if self.nodes and steps and steps[-1] > self.nodes:
            raise ValueError(f"rollout.scale_steps={steps} goes past nodes={self.nodes}")
        if self.preflight.min_nodes > (self.nodes or self.preflight.min_nodes):
            raise ValueError(f"preflight.min_nodes={self.preflight.min_nodes} is larger than nodes={self.nodes}")
        return self

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def parse(cls, data: dict[str, Any], names: dict[tuple[str, ...], str] | None = None) -> "RunConfig":
        """Validate a nested dict; a bad value raises ConfigError naming the field and what is allowed.

        ``names`` maps nested paths to the names the user typed (the flat form's), for the message.
        """
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, names)) from exc

    # -- checks that need the inventory (still before anything touches a node) ----------------
    def resolve_nodes(self, inventory_names: list[str]) -> list[str]:
        """The node names this run uses, in inventory order; raises ConfigError if the config does not fit."""
        count = self.nodes or len(inventory_names)
        if count > len(inventory_names):
            raise ConfigError(
                f"nodes={self.nodes} but inventory {self.inventory!r} has only {len(inventory_names)} nodes "
                f"({', '.join(inventory_names)}); choose nodes between 1 and {len(inventory_names)} (0 = all)"
            )
        names = inventory_names[:count]
        if self.source_node and self.source_node not in names:
            raise ConfigError(
                f"source_node={self.source_node!r} is not among the nodes of this run ({', '.join(names)})"
            )
        if self.rollout.canary_nodes > count:
            raise ConfigError(
                f"rollout.canary_nodes={self.rollout.canary_nodes} is larger than the {count} nodes of this run; "
                f"choose canary_nodes between 1 and {count}"
            )
        if self.rollout.scale_steps and self.rollout.scale_steps[-1] > count:
            raise ConfigError(f"rollout.scale_steps={self.rollout.scale_steps} goes past the {count} nodes of this run")
        if self.preflight.min_nodes > count:
            raise ConfigError(f"preflight.min_nodes={self.preflight.min_nodes} is larger than the {count} nodes of this run")
        return names

    def scale_plan(self, healthy: int) -> list[int]:
        """Node counts to reach, canary first: explicit steps, or doubling up to every healthy node."""
        canary = min(self.rollout.canary_nodes, healthy)
        if self.rollout.scale_steps:
            steps = [s for s in self.rollout.scale_steps if canary < s <= healthy]
        else:
            steps, n = [], canary
            while n < healthy:
                n = min(n * 2, healthy)
                steps.append(n)
        if not steps or steps[-1] != healthy:
            steps.append(healthy) if healthy > canary else None
        return [canary] + [s for s in steps if s > canary]

    # -- identity ------------------------------------------------------------------------------
    def performance_identity(self) -> dict[str, Any]:
        """What changes performance: engine and knobs, model, workload, node count, SLO-independent."""
        return {
            "inventory": self.inventory,
            "nodes": self.nodes,
            "model": self.model.model_dump(mode="json"),
            "engine": _engine_identity(self.engine),
            "workload": self.load.model_dump(mode="json", exclude={"duration_s", "warmup_s", "max_vus", *LOAD_SHAPE_FIELDS}),
        }

    def fingerprint(self) -> str:
        return canonical_hash(self.performance_identity())


def _engine_identity(engine: EngineSpec) -> dict[str, Any]:
    data = engine.model_dump(mode="json")
    default = EngineSpec().model_dump(mode="json")
    for k in _LATER_ENGINE_FIELDS:
        if data[k] == default[k] or (k == "triton" and engine.profile is not EngineProfileName.TRITON):
            data.pop(k)
    return data


def canonical_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def format_validation_error(exc: ValidationError, names: dict[tuple[str, ...], str] | None = None) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        field = (names or {}).get(loc) or ".".join(loc) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = f" (got {value!r})" if not isinstance(value, dict) and loc else ""
        lines.append(f"{field}: {msg}{shown}" if loc else msg)
    return "invalid run configuration:\n  " + "\n  ".join(lines)
