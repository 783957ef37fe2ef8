"""The external backend: engines that are already running, measured but not deployed by deploybench.

The run names its engines as ``rollout.endpoints`` ("node=URL" items): one per node, or the
nodes behind one load-balanced URL (``load.target_url``) so that each node's /metrics is still
scraped. Nothing is copied, started, scaled or stopped: fan-out and rollout are recorded as
skipped, teardown stops nothing, and the rollout record says the service was not deployed by
deploybench (its ``version`` field, which the store's software identity keeps).

The URLs are typed by whoever triggers the run, so they are hostile: each must be a plain
http(s) origin (no user, query or fragment), on a node of the run, and its origin must be in
the operator's allow-list (the policy's ``target_urls``, deploybench.policy, and
``$DEPLOYBENCH_TARGET_URLS``; the same list ``load.target_url`` answers to) -- anyone who can
trigger a run could otherwise aim load at any address the worker reaches. ``check`` runs at validate
time, before anything touches a node.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from deploybench import engines
from deploybench.config import RunConfig
from deploybench.errors import ConfigError, StageFailed
from deploybench.rollout.base import Capabilities, Deployer, NodeFailure

if TYPE_CHECKING:
    from deploybench.transport import Cluster

log = logging.getLogger(__name__)

NOT_DEPLOYED = "not deployed by deploybench"


def parse(cfg: RunConfig) -> list[dict]:
    """``rollout.endpoints`` as {"node", "url", "model"} (the rollout's endpoint records)."""
    out = []
    for item in cfg.rollout.endpoints:
        node, url = item.split("=", 1)
        out.append({"node": node, "url": url.rstrip("/"), "model": cfg.model.name})
    return out


def check(cfg: RunConfig, nodes: list[str]) -> list[dict]:
    """The endpoints, each on a node of the run and inside the allow-list, and ``load.target_url`` (the
    load-balanced URL in front of them) one of them or allowed; ConfigError names the bad one."""
    from deploybench.load.phases import allowed_targets, check_target, origin
    from deploybench.load.results import Endpoint
    from deploybench.policy import POLICY_ENV, TARGETS_ENV

    allowed = {origin(t) for t in allowed_targets()} - {None}
    eps = parse(cfg)
    for ep in eps:
        u, url = urlsplit(ep["url"]), ep["url"][:200]
        if ep["node"] not in nodes:
            raise ConfigError(f"rollout.endpoints: node {ep['node']!r} ({url}) is not one of this run's nodes "
                              f"({', '.join(nodes)}); name the inventory node the engine runs on")
        if u.username or u.password or u.query or u.fragment or origin(ep["url"]) is None:
            raise ConfigError(f"rollout.endpoints: {url!r} must be a plain http(s)://host:port[/prefix] URL "
                              "(no user, query or fragment)")
        if origin(ep["url"]) not in allowed:
            raise ConfigError(f"rollout.endpoints: {url!r} is not in the operator's allow-list "
                              f"({', '.join(allowed_targets()) or 'empty'}); have the operator add its origin "
                              f"(e.g. http://10.0.0.11:8000) to target_urls in the policy file (${POLICY_ENV}) or "
                              f"to ${TARGETS_ENV}")
    if cfg.load.target_url:  # known now with this backend: refused before anything runs, not at the load stage
        check_target(cfg.load.target_url, [Endpoint(e["node"], e["url"], e["model"]) for e in eps])
    return eps


class ExternalDeployer(Deployer):
    """The given endpoints (``rollout.endpoints``) as a deployer: engines started elsewhere, so nothing is started,
    scaled or stopped; "deploying" on a node set selects the given engines of those nodes, "ready" is each
    one passing its profile's readiness check. The stages ask its capabilities: no fan-out, no rollout plan
    (``run``), preflight optional (``rollout.external_preflight``), nothing for teardown to stop."""

    backend = "external"
    capabilities = Capabilities(deploys=False, copies_model=False, engines_on_nodes=False, optional_preflight=True,
                                stopped="nothing stopped ({n} engines not deployed by deploybench)")

    def __init__(self, cfg: RunConfig, nodes: list[str]):
        self.cfg, self.nodes = cfg, list(nodes)
        self.profile = engines.profile(cfg.engine)
        self.serving: list[str] = []

    @functools.cached_property
    def given(self) -> list[dict]:
        """The given endpoints, checked (``check``) when first needed: a teardown needs none of them."""
        return check(self.cfg, self.nodes)

    @classmethod
    def for_run(cls, cluster: Cluster, names: list[str], cfg: RunConfig, kube: Any = None) -> ExternalDeployer:
        return cls(cfg, names)

    @classmethod
    def validate_config(cls, cfg: RunConfig, names: list[str]) -> None:
        check(cfg, names)  # hostile URLs: refused before anything touches a node

    def deploy(self, nodes: list[str]) -> None:
        self.scale(nodes)

    def scale(self, nodes: list[str]) -> None:
        self.serving = [e["node"] for e in self.given if e["node"] in nodes]

    def endpoints(self) -> list[dict]:
        return [e for e in self.given if e["node"] in self.serving]

    def wait_ready(self, nodes: list[str], timeout_s: float) -> dict[str, float]:
        t0 = time.monotonic()
        ready_s: dict[str, float] = {}
        for ep in (e for e in self.given if e["node"] in nodes):
            while not self.profile.is_ready(ep["url"], ep["model"]):
                if time.monotonic() - t0 > timeout_s:
                    raise NodeFailure(ep["node"], f"the external endpoint {ep['url']} does not pass the "
                                                  f"{self.profile.name} profile's readiness check "
                                                  f"({self.profile.readiness.kind} {self.profile.readiness.path}) "
                                                  f"after {timeout_s:g} s; is it running?")
                time.sleep(0.2)
            ready_s[ep["node"]] = round(time.monotonic() - t0, 3)
        return ready_s

    def check_alive(self, nodes: list[str]) -> list[NodeFailure]:
        return [NodeFailure(e["node"], f"the external endpoint {e['url']} stopped answering its readiness check")
                for e in self.given if e["node"] in nodes and not self.profile.is_ready(e["url"], e["model"])]

    def rollback(self, nodes: list[str]) -> None:
        self.scale(nodes)

    def teardown(self, names: list[str] | None = None) -> dict[str, str]:
        return {}  # started elsewhere: stopped elsewhere


def run(cfg: RunConfig, nodes: list[str], healthy: list[str] | None = None) -> dict:
    """The rollout record of an external run: no step, the given endpoints of the ``healthy`` nodes (those
    preflight kept; default all), each checked ready (its profile's readiness, within
    ``rollout.ready_timeout_s``); StageFailed names one that is not."""
    t0 = time.monotonic()
    dep = ExternalDeployer(cfg, nodes)
    dep.deploy(healthy if healthy is not None else nodes)
    if not dep.serving:
        raise StageFailed(f"external backend: no given endpoint is on a healthy node ({healthy})")
    ready_s = dep.wait_ready(dep.serving, engines.ready_timeout_s(cfg))
    log.info("external backend: %d endpoints given, %s; rollout skipped", len(dep.serving), NOT_DEPLOYED)
    return {"profile": dep.profile.name, "backend": "external", "skipped": "external", "deployed_by": NOT_DEPLOYED,
            "version": f"external ({NOT_DEPLOYED})", "steps": [], "plan": [], "endpoints": dep.endpoints(),
            "ready_s": ready_s, "failure": None, "seconds": round(time.monotonic() - t0, 3)}
