"""RunConfig: one deploy-and-benchmark run, typed and validated once, at the edge.

Unknown keys are refused (a typo fails loudly). ``fingerprint()`` hashes everything
that changes performance, so results of the same configuration line up across runs.
The flat form a person fills in (Airflow Params, CLI flags) is in ``deploybench.params``.
"""

from __future__ import annotations

import hashlib
import json
from enum import Enum
from typing import Any

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


class PreflightSpec(_Strict):
    link_mode: LinkMode = LinkMode.RING
    iperf_seconds: float = Field(2.0, gt=0, le=60)
    link_threshold: float = Field(0.9, gt=0, le=1.5, description="fraction of the nominal link speed a link must reach")
    policy: Policy = Policy.ABORT
    min_nodes: int = Field(1, ge=1)


class FanoutSpec(_Strict):
    parallel: int = Field(4, ge=1, le=64, description="copies in flight at once from the source")
    timeout_s: float = Field(1800, gt=0)


class RolloutSpec(_Strict):
    canary_nodes: int = Field(2, ge=1)
    scale_steps: list[int] = Field(default_factory=list, description="node counts after the canary; [] = doubling")
    ready_timeout_s: float = Field(120, gt=0)
    port: int = Field(8000, ge=1024, le=65535)


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


class EngineSpec(_Strict):
    profile: EngineProfileName = EngineProfileName.SIM
    max_num_seqs: int = Field(8, ge=1, le=4096)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_model_len: int = Field(4096, ge=16)
    sim: SimKnobs = Field(default_factory=SimKnobs)


class LoadSpec(_Strict):
    rate: float = Field(8.0, gt=0, le=100000, description="arrival rate for the whole cluster, requests/s")
    duration_s: float = Field(30.0, gt=0)
    warmup_s: float = Field(5.0, ge=0)
    prompt_tokens: int = Field(200, ge=1)
    output_tokens: int = Field(64, ge=1)
    api: Api = Api.COMPLETIONS
    stream: bool = False
    max_vus: int = Field(0, ge=0, description="0 = sized from rate x the SLO's P99 latency")
    request_timeout_s: float = Field(30.0, gt=0)


class SLO(_Strict):
    p99_latency_ms: float = Field(2000.0, gt=0)
    max_error_rate: float = Field(0.01, ge=0, le=1)
    min_rps: float = Field(0.0, ge=0, description="cluster target; 0 = no target")


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
            "engine": self.engine.model_dump(mode="json"),
            "workload": self.load.model_dump(mode="json", exclude={"duration_s", "warmup_s", "max_vus"}),
        }

    def fingerprint(self) -> str:
        return canonical_hash(self.performance_identity())


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
