"""Rollout: the engine on a canary first, checked, then on more nodes step by step.

This is the ``ssh`` deployer: the engine runs on each node as a detached process with
a pid file and a log under the inventory's run_root. Every step waits until each new
node answers its health URL, then smoke-checks it (the model is listed and one
deterministic completion comes back). A failure anywhere stops every engine this
rollout started and raises StageFailed with the node, the reason and its log tail,
so a half-done deploy never leaves engines running that nobody will stop.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from deploybench import http
from deploybench.config import RunConfig
from deploybench.engines import EngineProfile, LaunchContext, profile
from deploybench.errors import DeploybenchError, StageFailed
from deploybench.inventory import Node
from deploybench.transport import Cluster, alive_script, spawn_script, stop_script

log = logging.getLogger(__name__)

SMOKE_PROMPT = "deploybench smoke test: say something deterministic"
SMOKE_TOKENS = 8


@dataclass
class StepResult:
    step: int
    nodes: int
    added: list[str]
    ready_s: dict[str, float]
    smoke: dict[str, str]
    seconds: float


@dataclass
class RolloutResult:
    profile: str
    steps: list[StepResult] = field(default_factory=list)
    endpoints: list[dict] = field(default_factory=list)  # {"node", "url", "model"}
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class SSHDeployer:
    """Starts, checks and stops the engine on nodes through their transports."""

    def __init__(self, cluster: Cluster, cfg: RunConfig):
        self.cluster = cluster
        self.cfg = cfg
        self.profile: EngineProfile = profile(cfg.engine.profile)
        self.port = cfg.rollout.port

    # paths on a node
    def _paths(self, node: Node) -> tuple[str, str]:
        base = f"{self.cluster.inventory.run_root.rstrip('/')}/{node.name}"
        return f"{base}/engine.pid", f"{base}/engine.log"

    def url(self, node: Node) -> str:
        return f"http://{node.address}:{self.port}"

    def start(self, node: Node) -> None:
        inv = self.cluster.inventory
        pid, logf = self._paths(node)
        ctx = LaunchContext(inv, node, f"{inv.model_root_of(node).rstrip('/')}/{self.cfg.model.name}",
                            self.cfg.model.name, self.port, self.cfg.engine)
        t = self.cluster[node]
        t.run(stop_script(pid, 2), timeout=30)  # a leftover engine from an earlier run
        t.run(spawn_script(self.profile.command(ctx), logf, pid), timeout=30).check()
        log.info("%s: started %s engine on port %d", node.name, self.profile.name, self.port)

    def stop(self, node: Node) -> None:
        """Stop the engine (TERM, then KILL after a grace period) and make sure its port no longer answers."""
        pid, _ = self._paths(node)
        self.cluster[node].run(stop_script(pid, 5), timeout=30).check()
        url = self.url(node) + self.profile.health_path
        if http.is_up(url, timeout=1):
            raise StageFailed(f"node {node.name}: an engine still answers at {url} after stopping the one in {pid}; "
                              "stop it by hand (it was not started by this run)")

    def alive(self, node: Node) -> bool:
        pid, _ = self._paths(node)
        return self.cluster[node].run(alive_script(pid), timeout=15).ok

    def log_tail(self, node: Node, lines: int = 20) -> str:
        _, logf = self._paths(node)
        try:
            return self.cluster[node].run(["tail", "-n", str(lines), logf], timeout=15).stdout.strip()
        except DeploybenchError as exc:
            return f"(log unavailable: {exc})"

    def wait_ready(self, node: Node, timeout: float) -> float:
        """Seconds until ``node`` answers its health URL; StageFailed if it dies or times out."""
        t0 = time.monotonic()
        url = self.url(node) + self.profile.health_path
        next_alive_check = t0 + 1.0
        while True:
            if http.is_up(url):
                return time.monotonic() - t0
            now = time.monotonic()
            if now >= next_alive_check:
                next_alive_check = now + 1.0
                if not self.alive(node):
                    raise StageFailed(f"node {node.name}: the engine exited before it was ready; log tail:\n"
                                      f"{self.log_tail(node)}")
            if now - t0 > timeout:
                raise StageFailed(f"node {node.name}: not ready at {url} after {timeout:.0f} s "
                                  f"(rollout.ready_timeout_s); log tail:\n{self.log_tail(node)}")
            time.sleep(0.2)

    def smoke(self, node: Node) -> str:
        """The model is listed and one deterministic completion returns what it should."""
        base, model = self.url(node), self.cfg.model.name
        if self.profile.api != "openai":
            return "health only"
        try:
            listed = [m.get("id") for m in http.get_json(f"{base}/v1/models").get("data", [])]
            if model not in listed:
                raise StageFailed(f"node {node.name}: model {model!r} is not served (listed: {listed})")
            body = http.post_json(f"{base}/v1/completions", {
                "model": model, "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_TOKENS, "temperature": 0,
            })
        except http.HTTPFailure as exc:
            raise StageFailed(f"node {node.name}: smoke request failed: {exc}") from exc
        text = body["choices"][0]["text"]
        if self.profile.deterministic:
            from deploybench.lab.service_model import expected_completion

            want = expected_completion(SMOKE_PROMPT, SMOKE_TOKENS, self.cfg.engine.sim.seed)
            if text != want:
                raise StageFailed(f"node {node.name}: smoke completion {text!r} differs from the expected {want!r}")
        elif not text:
            raise StageFailed(f"node {node.name}: smoke completion came back empty")
        return "ok"


def run(cluster: Cluster, names: list[str], cfg: RunConfig) -> RolloutResult:
    """Canary, then each scale step; on any failure stop everything started and raise StageFailed."""
    t0 = time.monotonic()
    dep = SSHDeployer(cluster, cfg)
    inv = cluster.inventory
    result = RolloutResult(dep.profile.name)
    started: list[Node] = []
    plan = cfg.scale_plan(len(names))
    log.info("rollout plan (nodes per step, canary first): %s", plan)
    try:
        for i, count in enumerate(plan):
            ts = time.monotonic()
            new = [inv.node(n) for n in names[len(started):count]]
            started.extend(new)
            with ThreadPoolExecutor(max_workers=min(16, len(new))) as pool:
                list(pool.map(dep.start, new))
                ready = list(pool.map(lambda n: dep.wait_ready(n, cfg.rollout.ready_timeout_s), new))
                smoke = list(pool.map(dep.smoke, new))
            step = StepResult(i, count, [n.name for n in new], {n.name: r for n, r in zip(new, ready)},
                              {n.name: s for n, s in zip(new, smoke)}, time.monotonic() - ts)
            result.steps.append(step)
            log.info("%s %d: %d nodes ready (slowest %.1f s)", "canary" if i == 0 else "step", i, count, max(ready))
    except (DeploybenchError, Exception) as exc:  # noqa: BLE001 - anything: clean up, then re-raise
        log.error("rollout failed, stopping the %d engines it started: %s", len(started), exc)
        teardown(cluster, [n.name for n in started], cfg)
        result.seconds = time.monotonic() - t0
        if isinstance(exc, StageFailed):
            raise StageFailed(f"rollout: {exc}", result.to_dict()) from exc
        raise
    result.endpoints = [{"node": n.name, "url": dep.url(n), "model": cfg.model.name} for n in started]
    result.seconds = time.monotonic() - t0
    return result


def teardown(cluster: Cluster, names: list[str], cfg: RunConfig) -> dict[str, str]:
    """Stop the engine on every node of ``names``. Idempotent; reports per node instead of stopping early."""
    dep = SSHDeployer(cluster, cfg)
    inv = cluster.inventory

    def one(name: str) -> tuple[str, str]:
        try:
            dep.stop(inv.node(name))
            return name, "stopped"
        except DeploybenchError as exc:
            return name, f"error: {exc}"

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
        return dict(pool.map(one, names))
