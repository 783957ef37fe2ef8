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

import logging
import time
from urllib.parse import urlsplit

from deploybench import engines
from deploybench.config import RunConfig
from deploybench.errors import ConfigError, StageFailed

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


def run(cfg: RunConfig, nodes: list[str], healthy: list[str] | None = None) -> dict:
    """The rollout record of an external run: no step, the given endpoints of the ``healthy`` nodes (those
    preflight kept; default all), each checked ready (its profile's readiness, within
    ``rollout.ready_timeout_s``); StageFailed names one that is not."""
    t0 = time.monotonic()
    eps = [e for e in check(cfg, nodes) if healthy is None or e["node"] in healthy]
    if not eps:
        raise StageFailed(f"external backend: no given endpoint is on a healthy node ({healthy})")
    prof = engines.profile(cfg.engine)
    deadline = t0 + cfg.rollout.ready_timeout_s
    ready_s: dict[str, float] = {}
    for ep in eps:
        while not prof.is_ready(ep["url"], ep["model"]):
            if time.monotonic() > deadline:
                raise StageFailed(f"external endpoint of node {ep['node']} ({ep['url']}) does not pass the "
                                  f"{prof.name} profile's readiness check ({prof.readiness.kind} "
                                  f"{prof.readiness.path}) after {cfg.rollout.ready_timeout_s:g} s; is it running?")
            time.sleep(0.2)
        ready_s[ep["node"]] = round(time.monotonic() - t0, 3)
    log.info("external backend: %d endpoints given, %s; rollout skipped", len(eps), NOT_DEPLOYED)
    return {"profile": prof.name, "backend": "external", "skipped": "external", "deployed_by": NOT_DEPLOYED,
            "version": f"external ({NOT_DEPLOYED})", "steps": [], "plan": [], "endpoints": eps,
            "ready_s": ready_s, "failure": None, "seconds": round(time.monotonic() - t0, 3)}
