"""Kubernetes backend: manifests validated against the official schema; rollout logic against a FAKE API server.

No Kubernetes API server can run here. tests/support/k8s_api.py is a small local FAKE of the apps/v1 and
core/v1 endpoints the deployer calls (it is not Kubernetes); the real `kubernetes` client talks to it
over HTTP, so the requests (server-side apply, scale subresource patches, pod lists, logs) are real.
"""

from __future__ import annotations

import pytest

from deploybench import engines, rollout
from deploybench.config import RunConfig
from deploybench.errors import ConfigError, StageFailed
from deploybench.inventory import Inventory
from deploybench.rollout import manifests
from deploybench.rollout.kubernetes import KubeClients, rollout_status
from deploybench.transport import Cluster
from tests.support.k8s_api import FakeApiServer

NODES = [f"n{i:02d}" for i in range(16)]


def _inv() -> Inventory:
    return Inventory.model_validate({"name": "k", "transport": "local", "model_root": "/srv/models", "nodes": [
        {"name": n, "address": f"10.0.0.{i + 10}", "link_mbit": 1000, "k8s_node": f"gpu-{n}"}
        for i, n in enumerate(NODES)]})


def _cfg(**rollout_kw) -> RunConfig:
    return RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"}, "rollout": {
        "backend": "kubernetes", "canary_nodes": 2, "ready_timeout_s": 10,
        "kubernetes": {"progress_deadline_s": 60}, **rollout_kw}})


@pytest.mark.parametrize("profile", ["vllm", "triton"])
def test_every_manifest_validates_against_the_kubernetes_schema(profile):
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": profile}})
    objs = manifests.render_all(cfg, _inv(), NODES[:2], NODES[2:], 2, 0)
    assert {o["kind"] for o in objs} >= {"Deployment", "Service"}
    for o in objs:
        manifests.validate(o)
    dep = next(o for o in objs if o["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert c["volumeMounts"][0]["readOnly"] is True and pod["volumes"][0]["hostPath"]["path"] == "/srv/models"
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["gpu-n00", "gpu-n01"]
    assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] \
        == "kubernetes.io/hostname"
    headless = next(o for o in objs if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None")
    assert headless["metadata"]["name"].endswith("-pods")


@pytest.mark.parametrize("profile, live", [("vllm", "/health"), ("triton", "/v2/health/live")])
def test_a_tensor_parallel_pod_gets_a_gpu_per_shard_a_memory_shm_and_the_engines_own_liveness_path(profile, live):
    """Issue 28, point 6. Upstream: vllm-project/vllm docs/deployment/k8s.md (an emptyDir of medium Memory,
    sizeLimit "2Gi", mounted at /dev/shm: "vLLM needs to access the host's shared memory for tensor parallel
    inference"); Triton's KServe v2 liveness endpoint /v2/health/live (its readiness is /v2/health/ready)."""
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": profile, "tensor_parallel_size": 2}})
    objs = manifests.render_all(cfg, _inv(), NODES[:2], NODES[2:], 2, 0)
    for o in objs:
        manifests.validate(o)  # the official schema
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}  # gpus_per_pod 1 is raised to the shards' 2
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    assert c["livenessProbe"]["httpGet"]["path"] == live
    assert c["readinessProbe"]["httpGet"]["path"] == engines.profile(cfg.engine).health_path
    one = next(o for o in manifests.render_all(RunConfig.parse({"inventory": "x", "engine": {"profile": profile}}),
                                               _inv(), NODES[:2], NODES[2:], 2, 0) if o["kind"] == "Deployment")
    assert "dshm" not in str(one)  # one GPU, no shards to talk between


def test_a_pod_gets_its_cpu_memory_pull_secret_gpu_toleration_and_tritons_metrics_port():
    """Issue 28, point 6: requests and limits (memory requested and limited alike), the GPU taint tolerated (GKE,
    AKS and the GPU operator taint GPU nodes <resource>:NoSchedule), a private image's pull secret, and Triton's
    metrics port (8002) declared beside the serving one; all checked against the official schema."""
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": "triton", "tensor_parallel_size": 2,
                                                        "triton": {"instance_kind": "KIND_MODEL"}},
                           "rollout": {"backend": "kubernetes", "kubernetes": {
                               "cpu": "7500m", "memory": "64Gi", "image_pull_secret": "registry-creds"}}})
    objs = manifests.render_all(cfg, _inv(), NODES[:2], NODES[2:], 2, 0)
    for o in objs:
        manifests.validate(o)
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "2", "memory": "64Gi"},
                              "requests": {"cpu": "7500m", "memory": "64Gi"}}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert {"name": "metrics", "containerPort": 8002, "protocol": "TCP"} in c["ports"]
    none = RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"},
                            "rollout": {"backend": "kubernetes", "kubernetes": {"gpus_per_pod": 0}}})
    pod = next(o for o in manifests.render_all(none, _inv(), NODES[:2], NODES[2:], 2, 0)
               if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert "tolerations" not in pod and "resources" not in pod["containers"][0]  # no GPU asked: nothing to tolerate
    with pytest.raises(ValueError, match="cpu"):
        RunConfig.parse({"inventory": "x", "rollout": {"kubernetes": {"cpu": "8 cores"}}})


def test_a_manifest_the_schema_refuses_is_reported_with_its_path():
    svc = manifests.service(RunConfig.parse({"inventory": "x"}))
    svc["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(ConfigError, match=r"spec\.ports\.0\.port"):
        manifests.validate(svc)
    svc = manifests.service(RunConfig.parse({"inventory": "x"}))
    svc["spec"]["replicas"] = 3  # not a Service field: strict validation refuses it
    with pytest.raises(ConfigError, match="replicas"):
        manifests.validate(svc)


@pytest.mark.parametrize("status, done, failed", [
    ({"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}, True, False),
    ({"observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 1}, False, False),
    ({"observedGeneration": 0, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}, False, False),
    ({"observedGeneration": 1, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 2}, False, False),
    ({"observedGeneration": 1, "replicas": 2, "updatedReplicas": 1, "availableReplicas": 1}, False, False),
    ({"observedGeneration": 1, "conditions": [{"type": "Progressing", "reason": "ProgressDeadlineExceeded"}]},
     False, True),
])
def test_rollout_status_follows_kubectl(status, done, failed):
    dep = {"metadata": {"name": "d", "generation": 1}, "spec": {"replicas": 2}, "status": status}
    assert rollout_status(dep)[:2] == (done, failed)


def _checks(seen: list):
    return {"smoke": lambda ep: "ok", "gate": lambda eps, i: seen.append(sorted(e["node"] for e in eps))
            or {"passed": True, "reasons": [], "requests": 10}}


def test_full_scale_out_against_the_fake_api_server():
    cfg, seen = _cfg(), []
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.2) as srv:
        kube = KubeClients.from_api_client(srv.api_client())
        res = rollout.run(Cluster(_inv()), NODES, cfg, kube=kube, **_checks(seen))
        assert res.plan == [2, 4, 8, 16] and [s.nodes for s in res.steps] == [2, 4, 8, 16]
        assert res.steps[0].added == NODES[:2]  # the canary Deployment is pinned to the canary nodes
        assert sorted(n for s in res.steps for n in s.added) == sorted(NODES)
        assert [len(s) for s in seen] == [2, 4, 8, 16]
        assert sorted(e["node"] for e in res.endpoints) == sorted(NODES)
        applies = [c for c in srv.cluster.calls if c[0] == "PATCH" and "/scale" not in c[1]]
        assert applies and all(c[2] == "application/apply-patch+yaml" and "fieldManager=deploybench" in c[1]
                               for c in applies)
        scales = [c for c in srv.cluster.calls if c[0] == "PATCH" and "/scale?" in c[1]]
        assert len(scales) == 3
        # idempotent: applying again changes nothing and does not fail (no create-only 409)
        dep = rollout.deployer(Cluster(_inv()), NODES, cfg, kube)
        dep.canary = NODES[:2]
        gen = srv.cluster.objects[("Deployment", "deploybench", "deploybench-sim-model-canary")]["metadata"][
            "generation"
        ]
        for o in dep.manifests(2, 0)[:-1]:
            dep._apply(o)
        assert srv.cluster.objects[("Deployment", "deploybench", "deploybench-sim-model-canary")]["metadata"][
            "generation"] == gen
        out = rollout.teardown(Cluster(_inv()), NODES, cfg, kube=kube)
        assert set(out.values()) == {"stopped"} and srv.cluster.objects == {} and srv.cluster.pods == {}
        assert set(rollout.teardown(Cluster(_inv()), NODES, cfg, kube=kube).values()) == {"stopped"}  # twice: fine


def test_a_pod_that_never_becomes_ready_fails_the_step_names_it_and_rolls_back():
    cfg, seen = _cfg(ready_timeout_s=30), []
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.2, deadline_scale=0.02) as srv:
        kube = KubeClients.from_api_client(srv.api_client())
        cl = Cluster(_inv())
        dep = rollout.deployer(cl, NODES[:8], cfg, kube)
        orig_scale = dep.scale

        def scale(nodes):  # break the nodes of step 2 just before it starts
            if len(nodes) == 8:
                srv.cluster.broken = {f"gpu-{n}": "FATAL: CUDA out of memory" for n in NODES[4:8]}
            orig_scale(nodes)

        dep.scale = scale
        with pytest.raises(StageFailed) as err:
            rollout.plan.execute(dep, NODES[:8], cfg, **_checks(seen))
        res = err.value.result
        f = res["failure"]
        assert f["step"] == 2 and f["nodes"][0]["node"] in NODES[4:8] and f["nodes"][0]["pod"]
        assert "CrashLoopBackOff" in f["nodes"][0]["reason"] and "progress deadline" in f["nodes"][0]["reason"]
        assert f["nodes"][0]["log_tail"] == "FATAL: CUDA out of memory"
        assert f["action"] == "rolled back to step 1 (4 nodes)"
        stable = srv.cluster.objects[("Deployment", "deploybench", "deploybench-sim-model")]
        assert stable["spec"]["replicas"] == 2  # 4 nodes = 2 canary + 2 stable
        rollout.teardown(cl, NODES[:8], cfg, kube=kube)
        assert srv.cluster.objects == {} and srv.cluster.pods == {}


def test_canary_failure_deletes_everything():
    cfg = _cfg()
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.2, deadline_scale=0.02) as srv:
        srv.cluster.broken = {"gpu-n01": "model.safetensors: checksum mismatch"}
        kube = KubeClients.from_api_client(srv.api_client())
        with pytest.raises(StageFailed, match="n01") as err:
            rollout.run(Cluster(_inv()), NODES[:4], cfg, kube=kube, **_checks([]))
        assert err.value.result["failure"]["action"] == "torn down"
        assert srv.cluster.objects == {} and srv.cluster.pods == {}


def test_kubernetes_backend_without_clients_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="kubernetes_default"):
        rollout.run(Cluster(_inv()), NODES[:4], _cfg())


def test_names_and_labels_carry_the_run_key_and_stay_valid():
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"}})
    key = "deploybench_run__manual__2026-12-03T07:29:15.123456+00:00"
    objs = manifests.render_all(cfg, _inv(), NODES[:2], NODES[2:], 2, 0, run_key=key)
    for o in objs:
        manifests.validate(o)
        assert o["metadata"]["labels"][manifests.RUN] == manifests.run_label(key)
        assert o["metadata"]["name"] != manifests.Names.of(cfg.model.name).stable  # not the model-only name
    label = manifests.run_label(key)
    assert len(label) <= 63 and label[0].isalnum() and label[-1].isalnum()
    assert manifests.run_label("a" * 80) != manifests.run_label("a" * 79 + "b")  # long keys stay distinct
    assert manifests.Names.of("m", "run-1").stable != manifests.Names.of("m", "run-2").stable
    dep = next(o for o in objs if o["kind"] == "Deployment")
    assert dep["spec"]["template"]["metadata"]["labels"][manifests.RUN] == label


def test_two_runs_in_one_namespace_never_touch_each_others_objects():
    from deploybench.rollout.kubernetes import delete_run_objects

    cfg = _cfg()
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        kube = KubeClients.from_api_client(srv.api_client())
        res_a = rollout.run(Cluster(_inv(), run_key="run-a"), NODES[:4], cfg, kube=kube, **_checks([]))
        res_b = rollout.run(Cluster(_inv(), run_key="run-b"), NODES[4:8], cfg, kube=kube, **_checks([]))
        assert len(res_a.endpoints) == 4 and len(res_b.endpoints) == 4
        by_run = {}
        for (_, _, name), o in srv.cluster.objects.items():
            by_run.setdefault(o["metadata"]["labels"][manifests.RUN], set()).add(name)
        assert set(by_run) == {"run-a", "run-b"} and not by_run["run-a"] & by_run["run-b"]
        out = rollout.teardown(Cluster(_inv(), run_key="run-a"), NODES[:4], cfg, kube=kube)
        assert len(out) == 5 and set(out.values()) == {"stopped"}  # 2 Deployments, 2 Services, the budget: by label
        assert any(k.startswith("poddisruptionbudget/") for k in out), out
        left = {o["metadata"]["labels"][manifests.RUN] for o in srv.cluster.objects.values()}
        assert left == {"run-b"} and len(srv.cluster.pods) == 4  # run b still serves
        # a later run cleaning up after a dead run b: by b's label, whatever the names are
        assert set(delete_run_objects(kube, "deploybench", "run-b").values()) == {"deleted"}
        assert srv.cluster.objects == {} and srv.cluster.pods == {}
        assert delete_run_objects(kube, "deploybench", "run-b") == {}


def test_the_startup_budget_is_the_engines_unless_the_run_says():
    """Issue 28, point 6: a 120 s startup probe restarted a large model's container before it had loaded. Without
    rollout.ready_timeout_s the budget is the profile's (vLLM, SGLang, Triton: 1800 s; the sim: 120 s), and the
    kubelet's startup probe waits as long as the rollout does."""
    vllm = RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"}})
    assert engines.ready_timeout_s(vllm) == 1800 and engines.ready_timeout_s(RunConfig.parse({"inventory": "x"})) == 120
    mine = RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"}, "rollout": {"ready_timeout_s": 300}})
    assert engines.ready_timeout_s(mine) == 300
    dep = next(o for o in manifests.render_all(vllm, _inv(), NODES[:2], NODES[2:], 2, 0) if o["kind"] == "Deployment")
    probe = dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= 1800


def test_no_engine_pod_is_evicted_on_purpose_while_it_is_measured_and_the_budget_goes_with_the_run():
    """Issue 28, point 6: a PodDisruptionBudget with maxUnavailable 0 over the run's engine pods (a node drain or the
    autoscaler waits instead of evicting one mid-phase); checked against the official schema, applied through the
    (fake) API server with the Deployments, deleted by the run's teardown."""
    cfg = _cfg()
    budget = manifests.disruption_budget(cfg, "run-a")
    manifests.validate(budget)
    assert budget["spec"] == {"maxUnavailable": 0,
                              "selector": {"matchLabels": {manifests.INSTANCE: manifests.Names.of("sim-model", "run-a")
                                                           .stable}}}
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.2) as srv:
        kube = KubeClients.from_api_client(srv.api_client())
        res = rollout.run(Cluster(_inv(), run_key="run-a"), NODES[:2], cfg, kube=kube, **_checks([]))
        assert len(res.endpoints) == 2
        kinds = {k for k, _, _ in srv.cluster.objects}
        assert "PodDisruptionBudget" in kinds, kinds
        rollout.teardown(Cluster(_inv(), run_key="run-a"), NODES[:2], cfg, kube=kube)
        assert srv.cluster.objects == {}


@pytest.mark.parametrize("profile,metric", [("vllm", "vllm:num_requests_waiting"),
                                            ("triton", "nv_inference_pending_request_count")])
def test_scale_up_under_load_renders_an_hpa_on_the_engines_waiting_requests(profile, metric):
    """Issue 31: the kubernetes backend's scale-up under load is a HorizontalPodAutoscaler (autoscaling/v2) on the
    engine's waiting-requests gauge, named by its profile, over the stable Deployment the rollout applies; checked
    against the official schema offline. Kubernetes (and so an autoscaler acting on it) cannot run here."""
    cfg = RunConfig.parse({"inventory": "x", "engine": {"profile": profile, "max_num_seqs": 64},
                           "rollout": {"backend": "kubernetes", "canary_nodes": 2},
                           "load": {"phases": ["spike"], "scale_up": True, "scale_up_from": 4}})
    got = manifests.hpa(cfg, 16, "run-a")
    manifests.validate(got)  # the official schema, strict: a misspelt field fails here
    stable = next(o for o in manifests.render_all(cfg, _inv(), NODES[:2], NODES[2:], 2, 0, "run-a")
                  if o["kind"] == "Deployment" and not o["metadata"]["name"].endswith("-canary"))
    spec = got["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": stable["metadata"]["name"]}
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 14)  # 4 - 2 canary pods, 16 - 2 canary nodes
    assert spec["metrics"][0]["pods"] == {"metric": {"name": metric},
                                          "target": {"type": "AverageValue", "averageValue": "16"}}
    assert got["metadata"]["labels"][manifests.RUN] == manifests.run_label("run-a")  # torn down with the run
    bad = {**got, "spec": {**spec, "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric}}}]}}
    with pytest.raises(ConfigError, match="HorizontalPodAutoscaler"):
        manifests.validate(bad)  # no target: the schema refuses it (the check can fail)
