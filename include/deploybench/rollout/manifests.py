"""Kubernetes manifests for the engine, as plain dicts (pure functions, tested without mocks).

One run serves from two Deployments with a shared ``app.kubernetes.io/instance`` label:
``<name>-canary`` pinned to the canary nodes, and ``<name>`` over the run's other nodes,
scaled step by step. ``<name>`` carries a digest of the run key and every object the label
``deploybench/run`` (the run key), so two runs in one namespace never touch each other's
objects and teardown (or a later run's recovery) deletes by that label. A required pod anti-affinity on
that label and the node's hostname
keeps one engine per node; a required node affinity keeps pods on the inventory's nodes.
The model comes read-only from the node's local model root (hostPath); the engine gets its
GPU limit and startup/readiness/liveness probes on the profile's health path. A Service
fronts both tracks, a headless Service gives per-pod endpoints, and a ConfigMap carries the
files a profile generates (Triton's config.pbtxt). ``validate`` checks every manifest
against the Kubernetes OpenAPI schema shipped offline in ``kubernetes-validate``.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from deploybench import engines
from deploybench.config import RunConfig
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory

K8S_VERSION = "1.33.0"  # the schema manifests are validated against (kubernetes-validate ships it offline)
HOSTNAME = "kubernetes.io/hostname"
INSTANCE = "app.kubernetes.io/instance"
TRACK = "deploybench/track"
RUN = "deploybench/run"  # the run key (run_label): teardown and recovery delete by it
POD_WORK_DIR = "/var/run/deploybench"
PROBE_PERIOD_S = 5
SHM_SIZE = "2Gi"  # /dev/shm of a tensor-parallel pod (the size vLLM's Kubernetes guide gives)


def _digest(run_key: str) -> str:
    return hashlib.sha256(run_key.encode()).hexdigest()[:8]


def resource_name(model: str, run_key: str | None = None) -> str:
    """A DNS-1123 name for the run's objects: ``deploybench-<model>-<digest of the run key>``, so two runs
    in one namespace never share an object (without a run key: ``deploybench-<model>``)."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"deploybench-{model}".lower()).strip("-")
    if not run_key:
        return base[:50].rstrip("-")
    return f"{base[:41].rstrip('-')}-{_digest(run_key)}"


def run_label(run_key: str) -> str:
    """The run key as a label value (at most 63 of [A-Za-z0-9_.-], alphanumeric at both ends); a key that
    does not fit keeps its readable start and gets a digest of the whole."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_key).strip("_.-")
    if len(safe) > 63 or safe != run_key:
        safe = f"{safe[:54].rstrip('_.-')}-{_digest(run_key)}".strip("_.-")
    return safe


@dataclass(frozen=True)
class Names:
    stable: str
    canary: str
    service: str
    headless: str
    config: str
    run_key: str | None = None

    @property
    def budget(self) -> str:
        return f"{self.stable}-budget"

    @classmethod
    def of(cls, model: str, run_key: str | None = None) -> Names:
        n = resource_name(model, run_key)
        return cls(n, f"{n}-canary", n, f"{n}-pods", f"{n}-files", run_key)


def _labels(names: Names, track: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "deploybench-engine", INSTANCE: names.stable,
           "app.kubernetes.io/managed-by": "deploybench"}
    if names.run_key:
        out[RUN] = run_label(names.run_key)
    return {**out, TRACK: track} if track else out


def _probe(path: str, port: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 2,
            "failureThreshold": failures}


def deployment(cfg: RunConfig, inv: Inventory, track: str, nodes: list[str], replicas: int,
               run_key: str | None = None) -> dict[str, Any]:
    """The engine Deployment of ``track`` ("canary" or "stable"), its pods allowed on ``nodes`` only."""
    k, r = cfg.rollout.kubernetes, cfg.rollout
    names = Names.of(cfg.model.name, run_key)
    prof = engines.profile(cfg.engine)
    image = engines.image_of(cfg.engine, k.image)
    node_objs = [inv.node(n) for n in nodes]
    roots = {inv.model_root_of(n).rstrip("/") for n in node_objs} or {inv.model_root.rstrip("/")}
    if len(roots) != 1:
        raise ConfigError(f"the kubernetes backend mounts one hostPath model root, but nodes {nodes} use "
                          f"{sorted(roots)}; give them the same model_root")
    ctx = engines.LaunchContext(inv, node_objs[0] if node_objs else inv.nodes[0],
                                f"{engines.CONTAINER_MODEL_ROOT}/{cfg.model.name}", cfg.model.name, r.port,
                                cfg.engine, POD_WORK_DIR, host="0.0.0.0")
    container: dict[str, Any] = {
        "name": "engine", "image": image, "args": prof.container_args(ctx),
        "ports": [{"name": "http", "containerPort": r.port, "protocol": "TCP"}] + (
            [{"name": "metrics", "containerPort": prof.metrics.port, "protocol": "TCP"}]  # Triton's 8002
            if prof.metrics.port not in (None, r.port) else []),
        "volumeMounts": [{"name": "models", "mountPath": engines.CONTAINER_MODEL_ROOT, "readOnly": True}],
        # the kubelet restarts a container that is not started within this: the engine's whole startup budget
        "startupProbe": _probe(prof.health_path, r.port,
                               max(1, math.ceil(engines.ready_timeout_s(cfg) / PROBE_PERIOD_S))),
        "readinessProbe": _probe(prof.health_path, r.port, 2),
        "livenessProbe": _probe(prof.liveness_path or prof.health_path, r.port, 3),
    }
    tp = cfg.engine.tensor_parallel_size
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    if k.gpus_per_pod:  # a tensor-parallel engine needs a GPU per shard: at least tensor_parallel_size
        limits[k.gpu_resource] = str(max(k.gpus_per_pod, tp))
    if k.cpu:
        requests["cpu"] = k.cpu
    if k.memory:  # requested and limited alike: the pod is not the first evicted when the node runs short
        requests["memory"] = limits["memory"] = k.memory
    if limits or requests:
        container["resources"] = {**({"limits": limits} if limits else {}), **({"requests": requests} if requests
                                                                               else {})}
    volumes: list[dict[str, Any]] = [{"name": "models", "hostPath": {"path": roots.pop(), "type": "Directory"}}]
    if tp > 1:  # PyTorch's shards talk through /dev/shm; a pod's is 64 MiB unless a memory volume is mounted there
        # (vllm-project/vllm docs/deployment/k8s.md: an emptyDir of medium Memory, sizeLimit 2Gi, at /dev/shm)
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
    files = prof.files(ctx)
    if files:
        container["volumeMounts"].append({"name": "files", "mountPath": f"{POD_WORK_DIR}/triton-repo",
                                          "readOnly": True})
        volumes.append({"name": "files", "configMap": {"name": names.config, "items": [
            {"key": _key(p), "path": p.removeprefix(f"{POD_WORK_DIR}/triton-repo/")} for p in files]}})
    hostnames = [n.kubernetes_name for n in node_objs]
    spec_nodes = hostnames or ["__none__"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": names.canary if track == "canary" else names.stable, "namespace": k.namespace,
                     "labels": _labels(names, track)},
        "spec": {
            "replicas": replicas,
            "progressDeadlineSeconds": k.progress_deadline_s,
            "selector": {"matchLabels": {INSTANCE: names.stable, TRACK: track}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": _labels(names, track)},
                "spec": {
                    "terminationGracePeriodSeconds": int(math.ceil(r.stop_grace_s)),
                    "affinity": {
                        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                            {"matchExpressions": [{"key": HOSTNAME, "operator": "In", "values": spec_nodes}]}]}},
                        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                            {"labelSelector": {"matchLabels": {INSTANCE: names.stable}}, "topologyKey": HOSTNAME}]},
                    },
                    "containers": [container],
                    "volumes": volumes,
                    **({"tolerations": [{"key": k.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]}
                       if k.tolerate_gpu_taint and k.gpus_per_pod else {}),
                    **({"imagePullSecrets": [{"name": k.image_pull_secret}]} if k.image_pull_secret else {}),
                },
            },
        },
    }


def _key(path: str) -> str:
    """A ConfigMap key for a generated file's path (keys allow [-._a-zA-Z0-9])."""
    return re.sub(r"[^-._a-zA-Z0-9]", "_", path.rsplit("/triton-repo/", 1)[-1])


def config_map(cfg: RunConfig, inv: Inventory, run_key: str | None = None) -> dict[str, Any] | None:
    """The profile's generated files (Triton's model repository), or None when it has none."""
    prof = engines.profile(cfg.engine)
    ctx = engines.LaunchContext(inv, inv.nodes[0], f"{engines.CONTAINER_MODEL_ROOT}/{cfg.model.name}",
                                cfg.model.name, cfg.rollout.port, cfg.engine, POD_WORK_DIR, host="0.0.0.0")
    files = prof.files(ctx)
    if not files:
        return None
    names = Names.of(cfg.model.name, run_key)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": names.config, "namespace": cfg.rollout.kubernetes.namespace,
                         "labels": _labels(names)},
            "data": {_key(p): text for p, text in files.items()}}


def service(cfg: RunConfig, headless: bool = False, run_key: str | None = None) -> dict[str, Any]:
    """The Service in front of every engine pod (both tracks); ``headless`` for per-pod endpoints."""
    names = Names.of(cfg.model.name, run_key)
    spec: dict[str, Any] = {"selector": {INSTANCE: names.stable},
                            "ports": [{"name": "http", "port": cfg.rollout.port, "targetPort": "http",
                                       "protocol": "TCP"}]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": names.headless if headless else names.service,
                         "namespace": cfg.rollout.kubernetes.namespace, "labels": _labels(names)},
            "spec": spec}


def disruption_budget(cfg: RunConfig, run_key: str | None = None) -> dict[str, Any]:
    """A PodDisruptionBudget that lets no engine pod of the run be evicted on purpose (a node drain, the cluster
    autoscaler) while it is measured: an eviction mid-phase would be read as the configuration's failure. The
    run's teardown deletes it with the Deployments, so a drain waits for the run, not for a person."""
    names = Names.of(cfg.model.name, run_key)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": names.budget, "namespace": cfg.rollout.kubernetes.namespace,
                         "labels": _labels(names)},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {INSTANCE: names.stable}}}}


HPA_SCALE_UP_PERIOD_S = 15  # how often the autoscaler may add pods (each time: as many as the run has nodes)


def hpa(cfg: RunConfig, nodes: int, run_key: str | None = None) -> dict[str, Any]:
    """Scale-up under load by the cluster itself, for an operator who autoscales (deploybench's own ``scale_up``
    patches the stable Deployment's replicas: ``KubernetesDeployer.shrink``/``start_each``): an autoscaling/v2
    HorizontalPodAutoscaler on the stable Deployment, driven by the engine's waiting-requests gauge per pod (its
    name from the engine profile's metric map, role ``waiting``: vllm:num_requests_waiting, sglang:num_queue_reqs,
    Triton's nv_inference_pending_request_count; the cluster's metrics adapter must expose it under that name).

    It holds at least the pods serving before the spike (``scale_up_from``, less the canary's Deployment) and at most
    the run's ``nodes`` less the canary's; a pod is added when the mean queue per pod passes a quarter of the batch
    (``max_num_seqs`` / 4, at least 1): a request queued behind that many waits about a quarter of a batch's service
    time. Up at once (no stabilisation window), never down (``scaleDown.selectPolicy: Disabled``): k6 still loads the
    pods during the recovery, and ``KubernetesDeployer.settle`` deletes the autoscaler after the phase."""
    names = Names.of(cfg.model.name, run_key)
    metric = engines.profile(cfg.engine).metrics.names.get("waiting")
    if not metric:
        raise ConfigError(f"engine profile {engines.profile(cfg.engine).name!r} names no waiting-requests gauge "
                          "([metrics] waiting = ...): the autoscaler has nothing to scale on; add it to the profile")
    canary = cfg.rollout.canary_nodes
    low = max(1, cfg.load.scale_up_from - canary)
    high = max(low, nodes - canary)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": names.stable, "namespace": cfg.rollout.kubernetes.namespace,
                         "labels": _labels(names)},
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": names.stable},
                     "minReplicas": low, "maxReplicas": high,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": metric},
                         "target": {"type": "AverageValue", "averageValue": str(max(1, cfg.engine.max_num_seqs // 4))},
                     }}],
                     "behavior": {
                         "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max",
                                     "policies": [{"type": "Pods", "value": max(1, high),
                                                   "periodSeconds": HPA_SCALE_UP_PERIOD_S}]},
                         "scaleDown": {"selectPolicy": "Disabled"}}}}


def render_all(cfg: RunConfig, inv: Inventory, canary: list[str], stable: list[str],
               canary_replicas: int, stable_replicas: int, run_key: str | None = None) -> list[dict[str, Any]]:
    objs = [config_map(cfg, inv, run_key), service(cfg, run_key=run_key), service(cfg, headless=True, run_key=run_key),
            disruption_budget(cfg, run_key),
            deployment(cfg, inv, "canary", canary, canary_replicas, run_key),
            deployment(cfg, inv, "stable", stable, stable_replicas, run_key)]
    return [o for o in objs if o is not None]


def validate(obj: dict[str, Any], version: str = K8S_VERSION) -> None:
    """Check ``obj`` against the official Kubernetes OpenAPI schema (strict: unknown fields are errors)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise ConfigError(f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}: invalid at {path or '(top)'}: "
                          f"{exc.message}") from exc
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as exc:
        raise ConfigError(f"no Kubernetes {version} schema for {obj.get('kind')}: {exc}") from exc
