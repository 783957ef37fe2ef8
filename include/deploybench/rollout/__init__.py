"""Rollout: the engine on a canary first, checked, then on more nodes step by step.

``run(cluster, names, cfg)`` builds the deployer the run's ``rollout.backend`` names and
executes the plan (``plan.py``): canary, gate, scale steps, gate each, endpoints.
``teardown(cluster, names, cfg)`` stops whatever the rollout may have started; it is
idempotent and always safe to call. Parts:

- ``base``: the Deployer interface and the result records (RolloutResult, StepResult);
- ``ssh``: engines as supervised processes (or containers) on the nodes;
- ``kubernetes`` + ``manifests``: Deployments, Services and a canary Deployment through the
  Kubernetes API (the cncf.kubernetes provider's hook supplies the clients);
- ``gate``: the smoke check and the gate load (the real k6 through deploybench.load);
- ``plan``: the step loop, failure attribution and the rollback/teardown policy;
- ``external``: engines already running (rollout.backend=external): nothing deployed or stopped.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploybench import engines
from deploybench.config import RolloutBackend, RunConfig
from deploybench.errors import ConfigError
from deploybench.rollout.base import Capabilities, Deployer, NodeFailure, RolloutResult, StepResult
from deploybench.rollout.gate import SMOKE_PROMPT, SMOKE_TOKENS
from deploybench.transport import Cluster

if TYPE_CHECKING:
    from deploybench.rollout.kubernetes import KubeClients

__all__ = ["BACKENDS", "Capabilities", "Deployer", "NodeFailure", "RolloutResult", "StepResult", "SMOKE_PROMPT",
           "SMOKE_TOKENS", "backend", "capabilities", "deployer", "run", "teardown"]


# The backends, by the name ``rollout.backend`` takes: a new backend is one Deployer class, registered here.
BACKENDS: dict[RolloutBackend, str] = {
    RolloutBackend.SSH: "deploybench.rollout.ssh:SSHDeployer",
    RolloutBackend.KUBERNETES: "deploybench.rollout.kubernetes:KubernetesDeployer",
    RolloutBackend.EXTERNAL: "deploybench.rollout.external:ExternalDeployer",
}


def backend(cfg: RunConfig) -> type[Deployer]:
    """The Deployer class of the run's ``rollout.backend`` (imported on demand: the kubernetes one pulls in
    its client)."""
    module, _, name = BACKENDS[cfg.rollout.backend].partition(":")
    cls: type[Deployer] = getattr(importlib.import_module(module), name)
    return cls


def capabilities(cfg: RunConfig) -> Capabilities:
    """What the run's backend does (deploybench.rollout.base.Capabilities)."""
    return backend(cfg).capabilities


def deployer(cluster: Cluster, names: list[str], cfg: RunConfig, kube: KubeClients | None = None) -> Deployer:
    """The backend the config names; refuses bad knobs (engine profile, Triton config) before anything starts."""
    engines.check(cfg.engine, cfg.model.name)
    return backend(cfg).for_run(cluster, names, cfg, kube)


def run(cluster: Cluster, names: list[str], cfg: RunConfig, out_dir: Path | None = None,
        kube: KubeClients | None = None, **checks: Any) -> RolloutResult:
    """Canary, then each scale step, each gated; StageFailed (with the result so far) on any failure."""
    from deploybench.rollout.plan import execute

    if not capabilities(cfg).deploys:
        raise ConfigError(f"rollout.backend={cfg.rollout.backend.value} deploys nothing: its stage records the given "
                          "endpoints instead (deploybench.rollout.external.run)")
    return execute(deployer(cluster, names, cfg, kube), names, cfg, out_dir, **checks)


def teardown(cluster: Cluster, names: list[str], cfg: RunConfig, kube: KubeClients | None = None) -> dict[str, str]:
    """Stop the engine on every node of ``names`` (ssh) or delete the run's objects (kubernetes). Idempotent.
    The external backend started nothing and stops nothing."""
    return backend(cfg).for_run(cluster, names, cfg, kube).teardown(names)
