"""Engine profiles: how to launch an inference engine on a node, and how to talk to it.

A profile turns the run's serving knobs into a launch command (an argument list),
and names the engine's health URL and API flavour. Profiles live in a registry, so a
new engine is one entry, not another branch in the rollout code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deploybench.config import EngineProfileName, EngineSpec
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory, Node


@dataclass(frozen=True)
class LaunchContext:
    inventory: Inventory
    node: Node
    model_dir: str
    model_name: str
    port: int
    engine: EngineSpec


@dataclass(frozen=True)
class EngineProfile:
    name: str
    health_path: str
    api: str  # "openai" or "triton"
    command: Callable[[LaunchContext], list[str]]
    deterministic: bool = False  # the smoke check can predict its output exactly


def _sim_command(ctx: LaunchContext) -> list[str]:
    e, k = ctx.engine, ctx.engine.sim
    return [
        ctx.inventory.python, "-m", "deploybench.lab.engine",
        "--host", ctx.node.address, "--port", str(ctx.port),
        "--model-dir", ctx.model_dir, "--served-model-name", ctx.model_name,
        "--max-num-seqs", str(e.max_num_seqs), "--max-model-len", str(e.max_model_len),
        "--decode-base-ms", f"{k.decode_base_ms:g}", "--decode-per-seq-ms", f"{k.decode_per_seq_ms:g}",
        "--prefill-per-token-ms", f"{k.prefill_per_token_ms:g}", "--queue-limit", str(k.queue_limit),
        "--seed", str(k.seed), "--slowdown", f"{k.slowdown:g}", "--error-rate", f"{k.error_rate:g}",
        "--crash-after", str(k.crash_after),
    ]


def _vllm_command(ctx: LaunchContext) -> list[str]:
    e = ctx.engine
    return [
        "vllm", "serve", ctx.model_dir,
        "--host", ctx.node.address, "--port", str(ctx.port),
        "--served-model-name", ctx.model_name,
        "--max-num-seqs", str(e.max_num_seqs),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--max-model-len", str(e.max_model_len),
    ]


def _triton_command(ctx: LaunchContext) -> list[str]:
    return [
        "tritonserver", f"--model-repository={ctx.model_dir}",
        f"--http-address={ctx.node.address}", f"--http-port={ctx.port}",
        "--allow-metrics=true",
    ]


PROFILES: dict[str, EngineProfile] = {
    EngineProfileName.SIM.value: EngineProfile("sim", "/health", "openai", _sim_command, deterministic=True),
    EngineProfileName.VLLM.value: EngineProfile("vllm", "/health", "openai", _vllm_command),
    EngineProfileName.TRITON.value: EngineProfile("triton", "/v2/health/ready", "triton", _triton_command),
}


def profile(name: str | EngineProfileName) -> EngineProfile:
    key = name.value if isinstance(name, EngineProfileName) else name
    try:
        return PROFILES[key]
    except KeyError:
        raise ConfigError(f"unknown engine profile {key!r}; choose one of: {', '.join(PROFILES)}") from None
