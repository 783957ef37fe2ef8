"""The deployer interface both backends implement, and the rollout's result records.

A deployer owns the engines of one run on a set of nodes. The plan (``plan.py``) only
speaks this interface: deploy the canary, scale to a larger node set, wait until the new
engines are ready, list endpoints, roll back to an earlier node set, tear everything down.
A backend reports a broken engine as ``NodeFailure`` naming the node (or pod), the reason,
and the engine's log tail, so the plan can attribute, store and undo it the same way for
ssh and kubernetes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ConfigDict

from deploybench.errors import StageFailed

if TYPE_CHECKING:
    from deploybench.config import RunConfig
    from deploybench.engines import EngineProfile
    from deploybench.transport import Cluster


class NodeFailure(StageFailed):
    """One node's engine failed (did not start, died, unreachable, not ready in time, failed its smoke check)."""

    def __init__(self, node: str, reason: str, log_tail: str = "", pod: str | None = None):
        where = f"node {node}" + (f" (pod {pod})" if pod else "")
        super().__init__(f"{where}: {reason}" + (f"; log tail:\n{log_tail}" if log_tail else ""))
        self.node, self.reason, self.log_tail, self.pod = node, reason, log_tail, pod

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "pod": self.pod, "reason": self.reason, "log_tail": self.log_tail}


_READ = ConfigDict(extra="forbid")  # how a stage record is read back into these classes (deploybench.records)


@dataclass
class StepResult:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    step: int
    nodes: int
    added: list[str]
    ready_s: dict[str, float]
    smoke: dict[str, str]
    seconds: float
    status: str = "ok"  # ok | failed
    gate: dict[str, Any] | None = None  # requests, errors, error_rate, latency_p99_ms, slo_ok, passed, reasons


@dataclass
class RolloutResult:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    profile: str
    steps: list[StepResult] = field(default_factory=list)
    endpoints: list[dict] = field(default_factory=list)  # {"node", "url", "model"}
    seconds: float = 0.0
    backend: str = "ssh"
    plan: list[int] = field(default_factory=list)
    failure: dict[str, Any] | None = None  # {step, nodes: [{node, pod, reason, log_tail}], action, serving}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Capabilities:
    """What a backend does: the stages, the matrix and the Airflow tasks ask these, never the backend's name."""

    deploys: bool = True  # starts engines (and stops them at teardown); False: measures engines already running
    copies_model: bool = True  # the fan-out puts the model on the nodes (an engine started elsewhere holds its own)
    engines_on_nodes: bool = True  # an engine this run starts listens on each node's port: preflight checks it
    optional_preflight: bool = False  # preflight may be switched off (the nodes may be out of reach)
    shares_deployments: bool = False  # a matrix's cells may run one after another on one rollout
    needs_kube: bool = False  # takes Kubernetes API clients (an Airflow Kubernetes connection)
    scales_under_load: bool = False  # the spike phase may start engines while load runs (load.scale_up)
    stopped: str = "engines stopped on {n} nodes"  # the teardown summary ({n}: how many)


class Deployer(ABC):
    """The engines of one run. Node sets are inventory node names, in rollout order."""

    backend: str = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    exact_placement: bool = True  # False: the backend decides which allowed node a new engine lands on
    profile: EngineProfile  # the engine's profile (engines.profile(cfg.engine)), set by each backend

    @classmethod
    @abstractmethod
    def for_run(cls, cluster: Cluster, names: list[str], cfg: RunConfig, kube: Any = None) -> Deployer:
        """The deployer of the run ``cluster`` works for (its run key) on ``names``."""

    @classmethod
    def validate_config(cls, cfg: RunConfig, names: list[str]) -> None:  # noqa: B027 - optional hook
        """Refuse (ConfigError), at validate, before anything touches a node, what this backend cannot run on
        ``names``. Nothing by default."""
        return None

    @abstractmethod
    def deploy(self, nodes: list[str]) -> None:
        """Start the engine on ``nodes`` (the canary). Returns once started, not once ready."""

    @abstractmethod
    def scale(self, nodes: list[str]) -> None:
        """Make the engine run on exactly ``nodes`` (a superset of the serving set when growing)."""

    def take_over(self, nodes: list[str]) -> None:  # noqa: B027 - optional hook
        """The engines an earlier deployer of this run left serving on ``nodes`` (the rollout's, in another task) are
        this one's to stop and start. Nothing by default: a backend that finds its engines by its own labels."""
        return None

    def start_each(self, nodes: list[str]) -> dict[str, Exception]:
        """Start the engine on each of ``nodes`` (beyond the serving set) on its own: per node that could not start,
        its error; the others are started (and serving once ready). Scale-up under load needs it
        (``Capabilities.scales_under_load``, deploybench.load.scale_up): one node that cannot start must not keep the
        others out of k6's targets, nor be blamed on them."""
        raise NotImplementedError(f"the {self.backend or type(self).__name__} backend does not start engines one by "
                                  "one (scale-up under load)")

    def shrink(self, keep: list[str], timeout_s: float) -> list[str]:
        """Scale-up under load, before the phase: stop every engine but those of ``keep``; the nodes still serving
        (``keep`` itself where the backend places engines by node; where it does not, the ones the cluster kept).
        Returns once only those serve, within ``timeout_s``."""
        self.rollback(keep)
        return list(keep)

    def settle(self) -> None:  # noqa: B027 - optional hook
        """Scale-up under load, after the phase whatever happened: remove what the backend put in place for it (an
        autoscaler) and leave no engine scaled down. Nothing by default (ScaleUp.restore starts what never was)."""
        return None

    def wait_serving(self, node: str, timeout_s: float) -> dict[str, Any] | None:
        """Scale-up under load: wait (``timeout_s``) until the engine started on ``node`` serves. Its endpoint
        ({"node", "url", "model", "pod"}) where it is a new one (a new pod has a new address), None where it is the
        one the rollout recorded; NodeFailure when it does not serve in time."""
        self.wait_ready([node], timeout_s)
        return None

    @abstractmethod
    def wait_ready(self, nodes: list[str], timeout_s: float) -> dict[str, float]:
        """Seconds until each of ``nodes`` is ready; NodeFailure for the first that cannot become ready."""

    @abstractmethod
    def endpoints(self) -> list[dict]:
        """One {"node", "url", "model"} per serving engine."""

    @abstractmethod
    def check_alive(self, nodes: list[str]) -> list[NodeFailure]:
        """The engines of ``nodes`` that are no longer serving (crashed after they were ready)."""

    @abstractmethod
    def rollback(self, nodes: list[str]) -> None:
        """Back to the engines of ``nodes`` (an earlier, good step): stop every other engine."""

    @abstractmethod
    def teardown(self, names: list[str] | None = None) -> dict[str, str]:
        """Stop every engine this run may have started (on ``names``, where the backend places engines by node).
        Idempotent; per node/object: "stopped" or an error."""
