"""The kubernetes deployer: a canary Deployment, then the stable Deployment scaled step by step.

Objects are applied with server-side apply (``fieldManager=deploybench``, forced), so a
re-run updates instead of failing with 409; a step patches the stable Deployment's scale
subresource. Readiness follows ``kubectl rollout status``: the controller has observed the
current generation, no ProgressDeadlineExceeded, updated replicas reach the spec, no old
replicas left, and every updated replica available. Failures name the pod, its node, the
reason from its container status, and the pod's log tail. The API clients come from the
cncf.kubernetes provider's KubernetesHook (``deploybench.airflow.connections.kube_clients``); any
``kubernetes.client`` ApiClient works, which is how the tests drive a local fake API server.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deploybench import engines
from deploybench.config import RunConfig, ScaleUpMode
from deploybench.errors import ConfigError, DeploybenchError
from deploybench.inventory import Inventory
from deploybench.rollout import manifests
from deploybench.rollout.base import Capabilities, Deployer, NodeFailure

if TYPE_CHECKING:
    from deploybench.transport import Cluster

log = logging.getLogger(__name__)

FIELD_MANAGER = "deploybench"
POLL_S = 0.2
API_TIMEOUT_S = 30  # one API request (as deploybench.load.kube_load.API_TIMEOUT_S): a hung API server is an error
SETTLE_GONE_S = 30.0  # settle: how long the deleted autoscaler may take to be gone before the replicas are patched
TERMINAL_PHASES = frozenset({"Failed", "Succeeded"})  # a pod in these serves no more (its phase never changes back)


@dataclass(frozen=True)
class KubeClients:
    apps: Any  # kubernetes.client.AppsV1Api
    core: Any  # kubernetes.client.CoreV1Api
    policy: Any  # kubernetes.client.PolicyV1Api (the engine pods' PodDisruptionBudget)
    custom: Any = None  # kubernetes.client.CustomObjectsApi (k6-operator TestRuns: deploybench.load.kube_load)
    autoscaling: Any = None  # kubernetes.client.AutoscalingV2Api (scale-up under load with scale_up_mode=hpa)

    @classmethod
    def from_api_client(cls, api_client: Any) -> KubeClients:
        from kubernetes import client

        return cls(client.AppsV1Api(api_client), client.CoreV1Api(api_client), client.PolicyV1Api(api_client),
                   client.CustomObjectsApi(api_client), client.AutoscalingV2Api(api_client))


def rollout_status(dep: dict[str, Any]) -> tuple[bool, bool, str]:
    """(done, failed, message) for a Deployment, by the rules of ``kubectl rollout status``."""
    meta, spec, st = dep.get("metadata", {}), dep.get("spec", {}), dep.get("status") or {}
    name = meta.get("name", "?")
    if meta.get("generation", 0) > st.get("observedGeneration", 0):
        return False, False, f"deployment {name}: waiting for the controller to observe the new spec"
    for c in st.get("conditions") or []:
        if c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            return False, True, f"deployment {name} exceeded its progress deadline: {c.get('message', '')}"
    want = spec.get("replicas", 1)
    updated, replicas, available = (st.get(k, 0) or 0 for k in ("updatedReplicas", "replicas", "availableReplicas"))
    if updated < want:
        return False, False, f"deployment {name}: {updated} of {want} new replicas updated"
    if replicas > updated:
        return False, False, f"deployment {name}: {replicas - updated} old replicas pending termination"
    if available < updated:
        return False, False, f"deployment {name}: {available} of {updated} updated replicas available"
    return True, False, f"deployment {name} successfully rolled out"


def _pod_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _pod_ip(pod: dict[str, Any]) -> str | None:
    """The pod's IP as its status gives it, when it is an IP address (a node's answer: checked); IPv6 bracketed for
    a URL."""
    raw = (pod.get("status") or {}).get("podIP")
    try:
        ip = ipaddress.ip_address(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    if ip is None or ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast:
        return None  # not a pod's address: k6 and the scraper would load this machine or nothing
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
        return None  # a zone id ("fe80::1%eth0") names an interface of the node, not the pod
    return f"[{ip}]" if ip.version == 6 else str(ip)


def _pod_problem(pod: dict[str, Any]) -> str:
    """Why a pod is not serving, from its phase, conditions and container statuses."""
    st = pod.get("status") or {}
    for c in st.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"not scheduled: {c.get('reason', '')} {c.get('message', '')}".strip()
    for cs in st.get("containerStatuses") or []:
        state = cs.get("state") or {}
        restarts = cs.get("restartCount", 0)
        if "waiting" in state:
            w = state["waiting"]
            return f"container {cs.get('name')} waiting: {w.get('reason', '')} {w.get('message', '')} " \
                   f"(restarts: {restarts})".replace("  ", " ")
        if "terminated" in state:
            t = state["terminated"]
            return f"container {cs.get('name')} terminated with exit code {t.get('exitCode')} ({t.get('reason', '')})"
        if restarts:
            return f"container {cs.get('name')} restarted {restarts} times"
    return f"not ready (phase {st.get('phase', 'unknown')})"


class KubernetesDeployer(Deployer):
    backend = "kubernetes"
    # pods, not processes on the nodes: no port or binary on a node to check, one object set per run (not shared)
    capabilities = Capabilities(engines_on_nodes=False, needs_kube=True, scales_under_load=True,
                                stopped="objects deleted {n}")
    exact_placement = False  # the scheduler picks which allowed node a new stable pod lands on

    @classmethod
    def for_run(cls, cluster: Cluster, names: list[str], cfg: RunConfig, kube: Any = None) -> KubernetesDeployer:
        return cls(kube, cluster.inventory, names, cfg, run_key=cluster.run_key)

    def __init__(self, kube: KubeClients | None, inventory: Inventory, names: list[str], cfg: RunConfig,
                 run_key: str | None = None):
        if kube is None:
            raise ConfigError("rollout.backend=kubernetes needs Kubernetes API clients; in Airflow they come from "
                              f"the connection {cfg.rollout.kubernetes.conn_id!r} (rollout.kubernetes.conn_id)")
        self.kube, self.inv, self.names, self.cfg = kube, inventory, list(names), cfg
        self.profile = engines.profile(cfg.engine)
        self.ns = cfg.rollout.kubernetes.namespace
        self.run_key = run_key
        self.obj = manifests.Names.of(cfg.model.name, run_key)
        self.canary: list[str] = []
        self._by_host = {inventory.node(n).kubernetes_name: n for n in names}
        self._ready_at: dict[str, float] = {}  # pod -> when this deployer first saw it ready
        self._restarts: dict[str, int] = {}
        self._kept: list[str] | None = None  # scale-up under load: the nodes shrink() left serving
        self._hpa: dict[str, Any] | None = None  # scale_up_mode=hpa: rendered by shrink(), applied by start_each()

    @classmethod
    def validate_config(cls, cfg: RunConfig, names: list[str]) -> None:
        """Scale-up under load scales the stable Deployment only: the canary's pods serve throughout, so
        ``scale_up_from`` cannot be below the canary's count."""
        canary = cfg.scale_plan(len(names))[0]
        if cfg.load.scale_up and cfg.load.scale_up_mode == ScaleUpMode.HPA and cfg.load.scale_up_from <= canary:
            raise ConfigError(f"load.scale_up_mode='hpa' with scale_up_from={cfg.load.scale_up_from} would scale the "
                              f"stable Deployment to 0 pods beside the canary's {canary}, and a "
                              "HorizontalPodAutoscaler does not act on a Deployment at 0 replicas; choose "
                              f"scale_up_from between {canary + 1} and {len(names) - 1}, or scale_up_mode='replicas'")
        if cfg.load.scale_up and cfg.load.scale_up_from < canary:
            raise ConfigError(f"load.scale_up_from={cfg.load.scale_up_from} is below the canary's {canary} pods "
                              f"(rollout.canary_nodes={cfg.rollout.canary_nodes}): the kubernetes backend scales the "
                              "stable Deployment down for the spike, never the canary's; choose scale_up_from between "
                              f"{canary} and {len(names) - 1}, or lower rollout.canary_nodes")

    # -- API helpers ----------------------------------------------------------------------------
    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        data = resp.data if hasattr(resp, "data") else resp
        return json.loads(data) if data else {}

    def _apply(self, obj: dict[str, Any]) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        fn = {"Deployment": self.kube.apps.patch_namespaced_deployment,
              "Service": self.kube.core.patch_namespaced_service,
              "ConfigMap": self.kube.core.patch_namespaced_config_map,
              "PodDisruptionBudget": self.kube.policy.patch_namespaced_pod_disruption_budget,
              # scale_up_mode=hpa: shrink() checked the client is there (_autoscaling) before anything changed
              "HorizontalPodAutoscaler": lambda *a, **kw: (
                  self.kube.autoscaling.patch_namespaced_horizontal_pod_autoscaler(*a, **kw))}[kind]
        fn(name, self.ns, obj, field_manager=FIELD_MANAGER, force=True,
           _content_type="application/apply-patch+yaml", _preload_content=False, _request_timeout=API_TIMEOUT_S)
        log.info("applied %s %s/%s", kind, self.ns, name)

    def _autoscaling(self) -> Any:
        if self.kube.autoscaling is None:
            raise ConfigError("load.scale_up_mode='hpa' needs the autoscaling/v2 API client (KubeClients.autoscaling; "
                              "KubeClients.from_api_client makes it)")
        return self.kube.autoscaling

    def _deployment(self, name: str) -> dict[str, Any]:
        return self._json(self.kube.apps.read_namespaced_deployment(name, self.ns, _preload_content=False,
                                                                    _request_timeout=API_TIMEOUT_S))

    def _pods(self) -> list[dict[str, Any]]:
        resp = self.kube.core.list_namespaced_pod(self.ns, label_selector=f"{manifests.INSTANCE}={self.obj.stable}",
                                                  _preload_content=False, _request_timeout=API_TIMEOUT_S)
        return self._json(resp).get("items", [])

    def _log_tail(self, pod: str, lines: int = 20) -> str:
        try:
            resp = self.kube.core.read_namespaced_pod_log(pod, self.ns, tail_lines=lines, _preload_content=False,
                                                          _request_timeout=API_TIMEOUT_S)
            return resp.data.decode(errors="replace").strip()
        except Exception as exc:  # noqa: BLE001 - kubernetes ApiException or a connection error
            return f"(log unavailable: {exc})"

    def _node_of(self, pod: dict[str, Any]) -> str:
        host = (pod.get("spec") or {}).get("nodeName")
        return self._by_host.get(host, host) if host else "(unscheduled)"

    def _failure(self, pod: dict[str, Any], reason: str | None = None) -> NodeFailure:
        name = pod["metadata"]["name"]
        return NodeFailure(self._node_of(pod), reason or _pod_problem(pod), self._log_tail(name), pod=name)

    # -- the interface ----------------------------------------------------------------------------
    def manifests(self, canary_replicas: int, stable_replicas: int) -> list[dict[str, Any]]:
        objs = manifests.render_all(self.cfg, self.inv, self.canary, self.names[len(self.canary):],
                                    canary_replicas, stable_replicas, self.run_key)
        for o in objs:
            manifests.validate(o)
        return objs

    def deploy(self, nodes: list[str]) -> None:
        self.canary = list(nodes)
        objs = self.manifests(len(nodes), 0)  # every manifest is valid before the first API call
        try:
            for o in objs:
                self._apply(o)
        except Exception as exc:  # noqa: BLE001 - ApiException, connection errors
            raise DeploybenchError(f"kubernetes: applying the engine objects in namespace {self.ns!r} failed: "
                                   f"{exc}") from exc

    def _scale_stable(self, replicas: int) -> None:
        self.kube.apps.patch_namespaced_deployment_scale(
            self.obj.stable, self.ns, {"spec": {"replicas": replicas}}, field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json", _preload_content=False, _request_timeout=API_TIMEOUT_S)
        log.info("scaled deployment %s/%s to %d replicas", self.ns, self.obj.stable, replicas)

    def scale(self, nodes: list[str]) -> None:
        self._scale_stable(max(0, len(nodes) - len(self.canary)))

    def wait_ready(self, nodes: list[str], timeout_s: float) -> dict[str, float]:
        """Both Deployments rolled out; returns seconds-to-ready for the pods that became ready meanwhile."""
        t0 = time.monotonic()
        new: dict[str, float] = {}
        while True:
            done = []
            for name in (self.obj.canary, self.obj.stable):
                ok, failed, msg = rollout_status(self._deployment(name))
                if failed:
                    raise self._first_unready(msg)
                done.append(ok)
            now = time.monotonic()
            for pod in self._pods():
                pname = pod["metadata"]["name"]
                if _pod_ready(pod) and pname not in self._ready_at:
                    self._ready_at[pname] = now
                    new[self._node_of(pod)] = round(now - t0, 3)
            if all(done):
                return new
            if now - t0 > timeout_s:
                raise self._first_unready(f"not rolled out after {timeout_s:g} s (rollout.ready_timeout_s)")
            time.sleep(POLL_S)

    def _first_unready(self, why: str) -> NodeFailure | DeploybenchError:
        for pod in self._pods():
            if not _pod_ready(pod):
                return self._failure(pod, f"{_pod_problem(pod)}; {why}")
        return DeploybenchError(f"kubernetes: {why}")

    def endpoints(self) -> list[dict]:
        eps = []
        for pod in self._pods():
            ip = _pod_ip(pod)  # a node's answer: checked (None: not an address a pod serves on)
            if _pod_ready(pod) and ip:
                eps.append({"node": self._node_of(pod), "url": f"http://{ip}:{self.cfg.rollout.port}",
                            "model": self.cfg.model.name, "pod": pod["metadata"]["name"]})
        order = {n: i for i, n in enumerate(self.names)}
        return sorted(eps, key=lambda e: order.get(e["node"], len(order)))

    def check_alive(self, nodes: list[str]) -> list[NodeFailure]:
        out = []
        for pod in self._pods():
            name = pod["metadata"]["name"]
            restarts = sum(cs.get("restartCount", 0) for cs in (pod.get("status") or {}).get("containerStatuses") or [])
            was_ready = name in self._ready_at
            if was_ready and (not _pod_ready(pod) or restarts > self._restarts.get(name, 0)):
                out.append(self._failure(pod, f"the engine stopped serving after it was ready ({_pod_problem(pod)})"))
            self._restarts.setdefault(name, restarts)
        return out

    def rollback(self, nodes: list[str]) -> None:
        self._scale_stable(max(0, len(nodes) - self._canary_count()))

    def _canary_count(self) -> int:
        """The canary Deployment's pods: the canary this deployer deployed, else the plan's first step (a deployer
        made after the rollout, as the load stage's)."""
        return len(self.canary) if self.canary else self.cfg.scale_plan(len(self.names))[0]

    # -- scale-up under load (deploybench.load.scale_up) --------------------------------------------
    def shrink(self, keep: list[str], timeout_s: float) -> list[str]:
        """Scale the stable Deployment down to ``len(keep)`` pods in all (the canary's included) and wait, at most
        ``timeout_s``, until exactly that many pods of the run are left and ready; their nodes, in the run's order
        (the ReplicaSet controller, not deploybench, chooses which pods go)."""
        want = len(keep)
        if self.cfg.load.scale_up_mode == ScaleUpMode.HPA:  # rendered and checked before anything changes
            hpa = manifests.hpa(self.cfg, len(self.names), self.run_key)
            manifests.validate(hpa)
            self._autoscaling()
            self._hpa = hpa  # applied at the spike's start (start_each): it adds no pod during the warm-up
        self.rollback(keep)
        t0 = time.monotonic()
        while True:
            # a pod being deleted or in a terminal phase serves no more: not one of the pods left
            pods = [p for p in self._pods() if not p["metadata"].get("deletionTimestamp")
                    and (p.get("status") or {}).get("phase") not in TERMINAL_PHASES]
            ready = [p for p in pods if _pod_ready(p)]
            if len(pods) == want and len(ready) == want:
                order = {n: i for i, n in enumerate(self.names)}
                self._kept = sorted((self._node_of(p) for p in ready), key=lambda n: order.get(n, len(order)))
                log.info("kubernetes: %d pods serving before the spike, on %s", want, self._kept)
                return list(self._kept)
            if time.monotonic() - t0 > timeout_s:
                raise DeploybenchError(f"kubernetes: deployment {self.ns}/{self.obj.stable} scaled down for the spike "
                                       f"still has {len(pods)} pods ({len(ready)} ready), not {want}, after "
                                       f"{timeout_s:g} s (rollout.ready_timeout_s)")
            time.sleep(POLL_S)

    def start_each(self, nodes: list[str]) -> dict[str, Exception]:
        """One patch of the stable Deployment's scale back to the pods of the kept nodes and ``nodes``: the scheduler
        puts one on each of ``nodes`` (the only allowed nodes left free: node affinity and one pod per node). The
        patch failing fails every node of ``nodes``, named."""
        total = len(set(self._kept) | set(nodes)) if self._kept is not None else len(self.names)
        if self._kept is not None and self._hpa is not None:  # scale_up_mode=hpa, at the spike's start
            hpa, self._hpa = self._hpa, None  # applied once: a start after settle patches the replicas
            try:
                self._apply(hpa)
            except Exception as exc:  # noqa: BLE001 - ApiException, connection errors: every node's
                err = DeploybenchError(f"kubernetes: applying the HorizontalPodAutoscaler {self.ns}/{self.obj.stable} "
                                       f"failed: {exc}")
                return dict.fromkeys(nodes, err)
            log.info("kubernetes: the spike started; the HorizontalPodAutoscaler %s adds pods as the queue grows",
                     self.obj.stable)
            return {}
        try:
            self._scale_stable(max(0, total - self._canary_count()))
        except Exception as exc:  # noqa: BLE001 - ApiException, connection errors: every node's
            err = DeploybenchError(f"kubernetes: patching the scale of deployment {self.ns}/{self.obj.stable} to "
                                   f"{total - self._canary_count()} replicas failed: {exc}")
            return dict.fromkeys(nodes, err)
        return {}

    def settle(self) -> None:
        """After the scale-up phase, whatever happened: its HorizontalPodAutoscaler deleted (absent: fine), and the
        stable Deployment's replicas back at the run's node count (nothing left scaled down)."""
        errors = []
        self._hpa = None  # not applied now, whatever comes
        if self.cfg.load.scale_up_mode == ScaleUpMode.HPA:
            try:
                self._delete_hpa()
            except Exception as exc:  # noqa: BLE001 - reported with the patch's outcome, which is tried anyway
                errors.append(f"deleting the HorizontalPodAutoscaler {self.ns}/{self.obj.stable}: {exc}")
        try:
            self._scale_stable(max(0, len(self.names) - self._canary_count()))
        except Exception as exc:  # noqa: BLE001 - ApiException, connection errors
            errors.append(f"patching deployment {self.ns}/{self.obj.stable} back to "
                          f"{len(self.names) - self._canary_count()} replicas: {exc}")
        else:
            try:
                self.wait_ready(self.names, engines.ready_timeout_s(self.cfg))  # the rollout's own bound
            except Exception as exc:  # noqa: BLE001 - NodeFailure, DeploybenchError, ApiException
                errors.append(f"deployment {self.ns}/{self.obj.stable} back at {len(self.names) - self._canary_count()}"
                              f" replicas: {exc}")
        if errors:
            raise DeploybenchError("kubernetes: after the scale-up: " + "; ".join(errors)[:2000])

    def _delete_hpa(self) -> None:
        """Delete the spike's HorizontalPodAutoscaler and wait (``SETTLE_GONE_S``) until the API says it is gone (404),
        so it patches the replicas no more; absent already: done."""
        api = self._autoscaling()
        try:
            api.delete_namespaced_horizontal_pod_autoscaler(self.obj.stable, self.ns, _preload_content=False,
                                                            _request_timeout=API_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - 404: never applied (the phase failed before the spike)
            if getattr(exc, "status", None) == 404:
                return
            raise
        t0 = time.monotonic()
        while True:
            try:
                api.read_namespaced_horizontal_pod_autoscaler(self.obj.stable, self.ns, _preload_content=False,
                                                              _request_timeout=API_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - 404: gone
                if getattr(exc, "status", None) == 404:
                    log.info("kubernetes: deleted the HorizontalPodAutoscaler %s/%s", self.ns, self.obj.stable)
                    return
                raise
            if time.monotonic() - t0 > SETTLE_GONE_S:
                raise DeploybenchError(f"still there {SETTLE_GONE_S:g} s after its deletion")
            time.sleep(POLL_S)

    def wait_serving(self, node: str, timeout_s: float) -> dict[str, Any]:
        """Wait (``timeout_s``) for a ready pod of the run on ``node``'s Kubernetes node; its endpoint (the pod's
        own address: a new pod has a new one). NodeFailure naming the pod and its problem when none is ready."""
        host = self.inv.node(node).kubernetes_name
        t0 = time.monotonic()
        last: dict[str, Any] | None = None
        while True:
            for pod in self._pods():
                if ((pod.get("spec") or {}).get("nodeName") != host or pod["metadata"].get("deletionTimestamp")
                    or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES):
                    continue
                last = pod
                ip = _pod_ip(pod)
                if _pod_ready(pod) and ip:
                    name = pod["metadata"]["name"]
                    self._ready_at.setdefault(name, time.monotonic())
                    return {"node": node, "url": f"http://{ip}:{self.cfg.rollout.port}", "model": self.cfg.model.name,
                            "pod": name}
            if time.monotonic() - t0 > timeout_s:
                why = f"no ready pod on {host} after {timeout_s:g} s (rollout.ready_timeout_s)"
                if last is not None:
                    raise self._failure(last, f"{_pod_problem(last)}; {why}")
                raise NodeFailure(node, f"no pod of the run was scheduled on {host}: {why}")
            time.sleep(POLL_S)

    def teardown(self, names: list[str] | None = None) -> dict[str, str]:
        """Delete the run's objects: by the run's label when it has a run key (whatever names they have),
        else both Deployments, both Services and the ConfigMap by name; absent objects count as done."""
        self._ready_at.clear()
        if self.run_key:
            return {k: "stopped" if v == "deleted" else v
                    for k, v in delete_run_objects(self.kube, self.ns, self.run_key).items()}
        calls = [("deployment", self.obj.canary, self.kube.apps.delete_namespaced_deployment),
                 ("deployment", self.obj.stable, self.kube.apps.delete_namespaced_deployment),
                 ("service", self.obj.service, self.kube.core.delete_namespaced_service),
                 ("service", self.obj.headless, self.kube.core.delete_namespaced_service),
                 ("configmap", self.obj.config, self.kube.core.delete_namespaced_config_map),
                 ("poddisruptionbudget", self.obj.budget, self.kube.policy.delete_namespaced_pod_disruption_budget)]
        if self.kube.autoscaling is not None:
            calls.append(("horizontalpodautoscaler", self.obj.stable,
                          self.kube.autoscaling.delete_namespaced_horizontal_pod_autoscaler))
        out = {}
        for kind, name, fn in calls:
            try:
                fn(name, self.ns, propagation_policy="Foreground", _preload_content=False)
                out[f"{kind}/{name}"] = "stopped"
            except Exception as exc:  # noqa: BLE001 - 404 is fine, anything else is reported
                out[f"{kind}/{name}"] = "stopped" if getattr(exc, "status", None) == 404 else f"error: {exc}"
        return out


def delete_run_objects(kube: KubeClients, namespace: str, run_key: str) -> dict[str, str]:
    """Delete every Deployment, Service, ConfigMap, PodDisruptionBudget (and k6-operator TestRun, when the clients have
    the custom objects API) in ``namespace`` labelled with ``run_key``
    (``deploybench/run``): ``{"deployment/<name>": "deleted" | "error: ..."}``; nothing found = ``{}``."""
    selector = f"{manifests.RUN}={manifests.run_label(run_key)}"
    kinds = [("deployment", kube.apps.list_namespaced_deployment, kube.apps.delete_namespaced_deployment),
             ("service", kube.core.list_namespaced_service, kube.core.delete_namespaced_service),
             ("configmap", kube.core.list_namespaced_config_map, kube.core.delete_namespaced_config_map),
             ("poddisruptionbudget", kube.policy.list_namespaced_pod_disruption_budget,
              kube.policy.delete_namespaced_pod_disruption_budget)]
    if kube.autoscaling is not None:  # a scale-up phase's autoscaler left by a dead run (scale_up_mode=hpa)
        kinds.append(("horizontalpodautoscaler", kube.autoscaling.list_namespaced_horizontal_pod_autoscaler,
                      kube.autoscaling.delete_namespaced_horizontal_pod_autoscaler))
    if kube.custom is not None:  # a load phase's k6-operator TestRun left by a dead run (deploybench.load.kube_load)
        from deploybench.load import k6_operator as op

        kinds.insert(0, ("testrun",
                         lambda ns, **kw: kube.custom.list_namespaced_custom_object(op.GROUP, op.VERSION, ns, op.PLURAL,
                                                                                    **kw),
                         lambda name, ns, **kw: kube.custom.delete_namespaced_custom_object(
                             op.GROUP, op.VERSION, ns, op.PLURAL, name, **kw)))
    out: dict[str, str] = {}
    for kind, list_fn, delete_fn in kinds:
        try:
            items = KubernetesDeployer._json(list_fn(namespace, label_selector=selector,
                                                     _preload_content=False)).get("items", [])
        except Exception as exc:  # noqa: BLE001 - ApiException, connection errors
            if kind == "testrun" and getattr(exc, "status", None) == 404:
                continue  # no k6-operator on this cluster (its CRD is not installed): no TestRun to delete
            if kind == "horizontalpodautoscaler" and getattr(exc, "status", None) == 403:
                # a Role from before scale_up_mode=hpa: this run could not have applied one either
                log.warning("kubernetes: listing horizontalpodautoscalers in %r is forbidden (a Role from before "
                            "scale_up_mode=hpa); none deleted: %s", namespace, str(exc)[:300])
                continue
            out[f"{kind}s"] = f"error: listing {kind}s labelled {selector} in {namespace!r} failed: {exc}"
            continue
        for item in items:
            name = item["metadata"]["name"]
            try:
                delete_fn(name, namespace, propagation_policy="Foreground", _preload_content=False)
                out[f"{kind}/{name}"] = "deleted"
            except Exception as exc:  # noqa: BLE001 - 404: deleted meanwhile
                out[f"{kind}/{name}"] = "deleted" if getattr(exc, "status", None) == 404 else f"error: {exc}"
    if out:
        log.info("kubernetes: objects of run %s in %s: %s", run_key, namespace, out)
    return out
