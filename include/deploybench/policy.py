"""The operator's policy: what a run may use, whoever triggered it.

deploybench runs as a privileged user on every node. Whoever may trigger ``deploybench_run`` (or the
matrix, which triggers it) chooses a run's parameters in the form; the **operator** - who deploys
deploybench and writes its inventories, engine profiles, benchmark files, connections and this file -
decides what those parameters may reach. The form chooses among what the policy allows and is refused,
at ``validate`` (before anything touches a node), naming the field, the value and the policy entry.

The policy is a TOML file: ``$DEPLOYBENCH_POLICY``, else ``<DEPLOYBENCH_HOME>/policy.toml`` when it exists,
else the defaults below, which are safe: no container image but the engine profiles' own, the default
Kubernetes connection and namespace only, a short list of tuning flags for the engines, no target URL
but the run's own endpoints. ``deploy/policy.example.toml`` shows every key. Unknown keys are refused (a
typo must not silently fall back to a default).

Keys (what a run may use; the default):
- ``images``: container images (engine image, Kubernetes image) besides the profiles' own; an item ending
  in ``*`` is a prefix (``registry.internal/vllm/*``); none.
- ``runtimes``: engine runtimes of the ssh backend; process, docker, podman.
- ``kubernetes_connections`` / ``kubernetes_namespaces``: the kubernetes backend's Airflow connection and
  namespace; ``kubernetes_default`` / ``deploybench``.
- ``engine_flags``: options ``engine_extra_args`` may pass (``--flag`` or ``--flag=value``, a value after its
  flag, never a program or positional argument first); ``DEFAULT_ENGINE_FLAGS``.
- ``target_urls``: origins (``http://host:port``) that ``target_url`` and external endpoints may name; none.
- ``notifier_modules``: modules (and their submodules) whose Airflow notifier classes a benchmark file may
  name; ``airflow.providers``.

``$DEPLOYBENCH_TARGET_URLS`` (the allow-list before this file existed) still adds origins to ``target_urls``.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploybench import paths
from deploybench.config import (
    IMAGE_PATTERN,
    ContainerRuntime,
    RunConfig,
    engine_flag,
)
from deploybench.errors import ConfigError

POLICY_ENV = "DEPLOYBENCH_POLICY"
TARGETS_ENV = "DEPLOYBENCH_TARGET_URLS"  # origins a target_url may name besides the run's own endpoints

# Options of the engines that tune performance and neither read nor write files nor load code: what a form
# user may pass by default. Left out on purpose, e.g. vLLM's --trust-remote-code, --chat-template (a file),
# --download-dir, --middleware and --tool-parser-plugin (import code), --allowed-local-media-path, SSL files;
# Triton's --model-control-mode/--load-model, --backend-directory, --repoagent-directory; llama.cpp's
# --lora, --mmproj, --chat-template-file. An operator who wants one lists it in the policy.
DEFAULT_ENGINE_FLAGS = (
    # vLLM (vllm/engine/arg_utils.py EngineArgs.add_cli_args)
    "--gpu-memory-utilization", "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--block-size", "--kv-cache-dtype", "--dtype",
    "--quantization", "--swap-space", "--seed", "--pipeline-parallel-size", "--data-parallel-size",
    "--enforce-eager", "--max-seq-len-to-capture", "--disable-log-requests", "--disable-log-stats",
    "--scheduling-policy", "--max-num-partial-prefills", "--async-scheduling", "--cuda-graph-sizes",
    # SGLang (sglang/srt/server_args.py)
    "--mem-fraction-static", "--chunked-prefill-size", "--schedule-policy", "--max-running-requests",
    "--max-prefill-tokens", "--disable-radix-cache",
    # llama.cpp's server (tools/server/README.md)
    "--ctx-size", "--batch-size", "--ubatch-size", "--n-gpu-layers", "--threads", "--threads-batch", "--parallel",
    "--cont-batching", "--no-cont-batching", "--flash-attn", "--cache-type-k", "--cache-type-v",
    # Triton's server (tritonserver --help)
    "--log-verbose", "--log-info", "--log-warning", "--log-error", "--exit-timeout-secs",
)
_FLAG = r"^--?[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"


class OperatorPolicy(BaseModel):
    """What a run may use (module docstring). ``source``: the file it was read from, or "the defaults"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    images: list[str] = Field(default_factory=list, max_length=1024)
    runtimes: list[ContainerRuntime] = Field(default_factory=lambda: list(ContainerRuntime))
    kubernetes_connections: list[str] = Field(default_factory=lambda: ["kubernetes_default"], max_length=1024)
    kubernetes_namespaces: list[str] = Field(default_factory=lambda: ["deploybench"], max_length=1024)
    engine_flags: list[str] = Field(default_factory=lambda: list(DEFAULT_ENGINE_FLAGS), max_length=4096)
    target_urls: list[str] = Field(default_factory=list, max_length=1024)
    notifier_modules: list[str] = Field(default_factory=lambda: ["airflow.providers"], max_length=256)
    source: str = "the defaults"

    def allows_image(self, image: str) -> bool:
        return any(image.startswith(p[:-1]) if p.endswith("*") else image == p for p in self.images)

    def targets(self) -> list[str]:
        """The allowed origins: the file's ``target_urls`` and ``$DEPLOYBENCH_TARGET_URLS``."""
        env = [t for t in os.environ.get(TARGETS_ENV, "").replace(",", " ").split() if t]
        return [*self.target_urls, *env]

    def problems(self) -> list[str]:
        """What is wrong in the file itself (a pattern a value could never match)."""
        bad = [f"images: {p!r} is not an image reference (or a prefix ending in *)" for p in self.images
               if not re.match(IMAGE_PATTERN, p.removesuffix("*") or "x")]
        bad += [f"engine_flags: {f!r} is not an option (--name)" for f in self.engine_flags if not re.match(_FLAG, f)]
        return bad


def policy_path() -> Path | None:
    """The policy file in force: $DEPLOYBENCH_POLICY, else <home>/policy.toml when it exists, else None."""
    env = os.environ.get(POLICY_ENV, "").strip()
    if env:
        return Path(env)
    default = paths.home() / "policy.toml"
    return default if default.is_file() else None


def current() -> OperatorPolicy:
    """The policy in force now (read on every call: an edited file is seen by the next run)."""
    path = policy_path()
    if path is None:
        return OperatorPolicy()
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"${POLICY_ENV} names {str(path)!r}, which cannot be read ({exc.strerror}); fix or unset "
                          "it") from None
    return _read(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> OperatorPolicy:
    try:
        data = tomllib.loads(Path(path).read_text())
        pol = OperatorPolicy.model_validate({**data, "source": path})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"operator policy {path}: {exc}; fix the file (deploy/policy.example.toml shows every "
                          "key)") from None
    except ValidationError as exc:
        errs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"operator policy {path}: {errs}; allowed keys: images, runtimes, kubernetes_connections, "
                          "kubernetes_namespaces, engine_flags, target_urls, notifier_modules") from None
    if bad := pol.problems():
        raise ConfigError(f"operator policy {path}: " + "; ".join(bad))
    return pol


def _refuse(field: str, value: Any, key: str, allowed: list[str], pol: OperatorPolicy, more: str = "") -> ConfigError:
    shown = ", ".join(allowed[:12]) + (f", ... ({len(allowed)} in all)" if len(allowed) > 12 else "")
    return ConfigError(f"{field}={value!r} is not allowed by the operator's policy ({pol.source}: {key} = "
                       f"[{shown or 'nothing'}]){more}; choose one of those, or ask the operator to add it to "
                       f"{key} in the policy file (${POLICY_ENV})")


def check(cfg: RunConfig, uses_kube: bool, pol: OperatorPolicy | None = None) -> None:
    """Refuse what ``cfg`` asks for beyond the policy (ConfigError naming the form field, its value, the policy
    key and file); nothing touches a node before this passed. ``uses_kube``: the run's backend takes Kubernetes
    clients (its Deployer's capabilities), so its connection and namespace are checked."""
    from deploybench import engines

    pol = pol or current()
    eng, ro = cfg.engine, cfg.rollout
    if eng.runtime not in pol.runtimes:
        raise _refuse("engine_runtime", eng.runtime.value, "runtimes", [r.value for r in pol.runtimes], pol)
    profile_image = engines.profile(eng).image if (eng.image or ro.kubernetes.image) else ""
    for field, image in (("engine_image", eng.image), ("k8s_image", ro.kubernetes.image)):
        if image and image != profile_image and not pol.allows_image(image):
            raise _refuse(field, image, "images", pol.images, pol,
                          f" (the {engines.profile_name(eng)} profile's own image {profile_image or '(none)'} is "
                          "always allowed: leave the field empty for it)")
    if uses_kube:
        if ro.kubernetes.conn_id not in pol.kubernetes_connections:
            raise _refuse("k8s_conn_id", ro.kubernetes.conn_id, "kubernetes_connections", pol.kubernetes_connections,
                          pol)
        if ro.kubernetes.namespace not in pol.kubernetes_namespaces:
            raise _refuse("k8s_namespace", ro.kubernetes.namespace, "kubernetes_namespaces",
                          pol.kubernetes_namespaces, pol)
    flags = {engine_flag(f) for f in pol.engine_flags}
    for i, arg in enumerate(eng.extra_args):
        flag = engine_flag(arg)
        if flag is None and i == 0:  # a program (the openai profile's whole command) or a positional argument
            raise ConfigError(f"engine_extra_args[0]={arg!r} is not an option: extra arguments are options of the "
                              "engine (\"--flag\", \"value\"), never a program or a positional argument; a command "
                              "of your own belongs in an engine profile file (the operator's "
                              "$DEPLOYBENCH_ENGINE_PROFILES)")
        if flag is not None and flag not in flags:
            raise _refuse(f"engine_extra_args[{i}]", arg, "engine_flags", pol.engine_flags, pol,
                          " (an option is compared without its =value, with _ read as -)")
