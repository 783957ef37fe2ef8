"""Canary first, then scale out step by step; the same plan for every backend.

For each step of ``cfg.scale_plan`` (canary first): grow the deployment to the step's
nodes, wait until the new engines are ready (time-to-ready per node), smoke-check each new
engine, run the gate load over every serving engine, then make sure every engine is still
serving (an engine that crashed under the gate is named, with its log tail). A failed step
is undone by ``rollout.on_step_failure``: ``rollback`` returns to the last good step's
engines (they serve until the run's teardown), ``teardown`` stops everything at once; a
failed canary has no good step and always tears down. Either way the stage fails with the
node, the reason and the log tail, and the result keeps every step measured so far.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deploybench import engines
from deploybench.config import RunConfig, StepFailurePolicy
from deploybench.errors import StageFailed
from deploybench.rollout import gate as gates
from deploybench.rollout.base import Deployer, NodeFailure, RolloutResult, StepResult

log = logging.getLogger(__name__)

SmokeFn = Callable[[dict], str]  # endpoint -> "ok" (raises gates.SmokeFailed)
GateFn = Callable[[list[dict], int], dict]  # serving endpoints, step -> {"passed", "reasons", ...}


def default_checks(dep: Deployer, cfg: RunConfig, out_dir: Path) -> tuple[SmokeFn, GateFn]:
    prof = dep.profile

    def smoke(ep: dict) -> str:
        return gates.smoke(prof, ep["url"], ep["model"], cfg.engine.sim.seed)

    def gate(eps: list[dict], step: int) -> dict:
        return gates.gate_load(eps, cfg, prof, out_dir, step)

    return smoke, gate


def execute(dep: Deployer, names: list[str], cfg: RunConfig, out_dir: Path | None = None,
            smoke: SmokeFn | None = None, gate: GateFn | None = None) -> RolloutResult:
    """Run the rollout plan with ``dep``; StageFailed (result attached) when a step fails."""
    t0 = time.monotonic()
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="deploybench-gate-"))
    d_smoke, d_gate = default_checks(dep, cfg, out_dir)
    smoke, gate = smoke or d_smoke, gate or d_gate
    plan = cfg.scale_plan(len(names))
    result = RolloutResult(dep.profile.name, backend=dep.backend, plan=plan)
    good: list[str] = []  # the nodes of the last step that passed
    log.info("rollout plan (%s backend, nodes per step, canary first): %s", dep.backend, plan)
    for i, count in enumerate(plan):
        target, new = names[:count], names[len(good):count]
        ts = time.monotonic()
        step = StepResult(i, count, list(new), {}, {}, 0.0)
        try:
            (dep.deploy if i == 0 else dep.scale)(target)
            step.ready_s = dep.wait_ready(new, engines.ready_timeout_s(cfg))
            if not getattr(dep, "exact_placement", True):  # kubernetes: where the scheduler put the new pods
                step.added = list(step.ready_s)
            step.smoke = _smoke_new(dep, step.added, smoke)
            step.gate = gate(dep.endpoints(), i)
            dead = dep.check_alive(target)
            if dead:
                raise _Failures(dead)
            if not step.gate.get("passed"):
                raise StageFailed(f"{'canary' if i == 0 else f'step {i}'} gate failed: "
                                  + "; ".join(step.gate.get("reasons") or ["no reason given"]))
        except Exception as exc:  # noqa: BLE001 - any failure: attribute, undo by policy, store, re-raise
            step.status, step.seconds = "failed", round(time.monotonic() - ts, 3)
            result.steps.append(step)
            _fail(dep, cfg, result, i, good, exc, t0)
        step.seconds = round(time.monotonic() - ts, 3)
        result.steps.append(step)
        good = list(target)
        log.info("%s: %d nodes serving, slowest new engine ready in %.1f s, gate %s",
                 "canary" if i == 0 else f"step {i}", count, max(step.ready_s.values(), default=0.0),
                 _gate_line(step.gate))
    result.endpoints = dep.endpoints()
    result.seconds = round(time.monotonic() - t0, 3)
    return result


class _Failures(StageFailed):
    def __init__(self, failures: list[NodeFailure]):
        super().__init__("; ".join(str(f) for f in failures))
        self.failures = failures


def _smoke_new(dep: Deployer, new: list[str], smoke: SmokeFn) -> dict[str, str]:
    by_node = {e["node"]: e for e in dep.endpoints()}

    def one(node: str) -> str:
        ep = by_node.get(node)
        if ep is None:
            raise NodeFailure(node, "ready, but it has no endpoint")
        try:
            return smoke(ep)
        except gates.SmokeFailed as exc:
            raise NodeFailure(node, f"smoke check failed: {exc}") from exc

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(new)))) as pool:
        futures = [pool.submit(one, n) for n in new]
    errors = [e for f in futures if (e := f.exception()) is not None]
    if errors:
        raise errors[0]
    return {n: f.result() for n, f in zip(new, futures)}


def _attribute(dep: Deployer, exc: BaseException, nodes: list[str]) -> list[dict]:
    """Which nodes failed and why: from the exception, else by checking every serving engine."""
    if isinstance(exc, _Failures):
        return [f.as_dict() for f in exc.failures]
    if isinstance(exc, NodeFailure):
        return [exc.as_dict()]
    try:
        return [f.as_dict() for f in dep.check_alive(nodes)]
    except Exception as probe:  # noqa: BLE001 - attribution is best effort; the failure itself is reported
        log.warning("could not check the engines after the failure: %s", probe)
        return []


def _fail(dep: Deployer, cfg: RunConfig, result: RolloutResult, i: int, good: list[str], exc: Exception,
          t0: float) -> None:
    where = "canary" if i == 0 else f"step {i} ({result.plan[i]} nodes)"
    culprits = _attribute(dep, exc, list(dict.fromkeys(good + [n for s in result.steps for n in s.added])))
    policy = cfg.rollout.on_step_failure
    cleanup = ""
    try:
        if good and policy is StepFailurePolicy.ROLLBACK:
            dep.rollback(good)
            action, serving = f"rolled back to step {i - 1} ({len(good)} nodes)", list(good)
        else:
            bad = {k: v for k, v in dep.teardown().items() if v.startswith("error")}
            action, serving = "torn down", []
            if bad:
                cleanup = "; could not stop " + "; ".join(f"{k}: {v}" for k, v in bad.items())
    except Exception as undo:  # noqa: BLE001 - report both: the failure and the failed undo
        action, serving, cleanup = f"{policy.value} FAILED", [], f"; undo failed: {undo}"
    log.error("rollout %s failed (%s): %s", where, action + cleanup, exc)
    result.failure = {"step": i, "error": str(exc), "nodes": culprits, "action": action + cleanup,
                      "policy": policy.value, "serving": serving}
    result.endpoints = dep.endpoints() if serving else []
    result.seconds = round(time.monotonic() - t0, 3)
    who = ", ".join(c["node"] + (f" (pod {c['pod']})" if c.get("pod") else "") for c in culprits)
    msg = f"rollout {where} failed" + (f" on {who}" if who else "") + f": {exc}\n-> {action}{cleanup}"
    if not isinstance(exc, StageFailed) and culprits:
        msg += "\n" + "\n".join(f"{c['node']}: {c['reason']}\n{c['log_tail']}" for c in culprits)
    raise StageFailed(msg, result.to_dict()) from exc


def _gate_line(g: dict | None) -> str:
    if not g:
        return "n/a"
    p99 = g.get("latency_p99_ms")
    return (f"{g.get('requests', 0)} requests, errors {100 * (g.get('error_rate') or 0):.1f} %, "
            f"P99 {'n/a' if p99 is None else f'{p99:.0f} ms'}")
