"""Scale-up under load on the kubernetes backend (issue 31): the stable Deployment scaled down to ``scale_up_from`` pods
before the spike, its replicas patched back at the spike's start, each added pod's time to serving, restore on failure.

No Kubernetes API server can run here: tests/support/k8s_api.py is a small local FAKE of the apps/v1 and core/v1
endpoints (it is not Kubernetes) whose controller gives a Deployment ``spec.replicas`` pods, each Ready after its node's
delay; the real ``kubernetes`` client talks to it over HTTP. No engine runs in the fake's pods, so there is no k6 here:
the Load stage's scale-down (``Load._scale_down``) and ``ScaleUp`` are driven directly, and k6's reads of its target
page are made by the test over real loopback HTTP (the whole phase with k6 runs on the ssh backend's netns lab:
tests/integration/test_spike_lab.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from deploybench import params, pipeline, rollout
from deploybench.config import RunConfig
from deploybench.errors import ConfigError
from deploybench.inventory import Inventory
from deploybench.load.results import Endpoint
from deploybench.rollout import manifests
from deploybench.rollout.kubernetes import KubeClients
from deploybench.stages import Load
from deploybench.transport import Cluster
from tests.support.k8s_api import FakeApiServer

NODES = ["n00", "n01", "n02", "n03"]


def _inv() -> Inventory:
    return Inventory.model_validate({"name": "k", "transport": "local", "model_root": "/srv/models", "nodes": [
        {"name": n, "address": f"10.0.0.{i + 10}", "link_mbit": 1000, "k8s_node": f"gpu-{n}"}
        for i, n in enumerate(NODES)]})


def _cfg(mode: str = "replicas") -> RunConfig:
    return RunConfig.parse({"inventory": "x", "engine": {"profile": "vllm"}, "rollout": {
        "backend": "kubernetes", "canary_nodes": 1, "ready_timeout_s": 10, "kubernetes": {"progress_deadline_s": 60}},
        "load": {"phases": ["spike"], "scale_up": True, "scale_up_from": 2, "scale_up_mode": mode}})


def _checks() -> dict:
    return {"smoke": lambda ep: "ok", "gate": lambda eps, i: {"passed": True, "reasons": [], "requests": 10}}


def _until(pred, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(0.02)


class Rig:
    """A rolled-out run of 4 pods (canary n00, stable n01-n03) on the fake, and the Load stage's context for it."""

    def __init__(self, srv: FakeApiServer, mode: str = "replicas"):
        self.srv, self.cfg = srv, _cfg(mode)
        self.kube = KubeClients.from_api_client(srv.api_client())
        self.cluster = Cluster(_inv(), run_key="run-up")
        res = rollout.run(self.cluster, NODES, self.cfg, kube=self.kube, **_checks())
        assert [e["node"] for e in res.endpoints] == NODES
        self.eps = [Endpoint.of(e) for e in res.endpoints]
        self.ctx = SimpleNamespace(run=SimpleNamespace(cfg=self.cfg, nodes=NODES), kube=self.kube)
        self.stable = manifests.Names.of(self.cfg.model.name, "run-up").stable

    def replicas(self) -> int:
        with self.srv.cluster.lock:
            dep = self.srv.cluster.objects[("Deployment", self.cfg.rollout.kubernetes.namespace, self.stable)]
            return dep["spec"]["replicas"]

    def ready_pods(self) -> dict[str, str]:
        """node -> the pod IP of each Ready pod of the run, as the fake has them now."""
        with self.srv.cluster.lock:
            self.srv.cluster.reconcile()
            return {p["spec"]["nodeName"].removeprefix("gpu-"): p["status"]["podIP"]
                    for p in self.srv.cluster.pods.values()
                    if any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))}

    def scale_patches(self) -> list[str]:
        return [path for m, path, _ in self.srv.cluster.calls if m == "PATCH" and path.split("?")[0].endswith("/scale")]


def _read(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - the page on 127.0.0.1
        return json.loads(resp.read())


def test_scaled_down_before_the_spike_patched_back_at_its_start_and_each_added_pod_timed():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        before = {e.node: e.url for e in rig.eps}
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        # scaled down to scale_up_from=2 pods in all: the canary's one and one stable pod, both ready
        assert rig.replicas() == 1 and len(rig.ready_pods()) == 2
        assert [e.node for e in first] == ["n00", "n01"] and grow.added == ["n02", "n03"]
        patches = len(rig.scale_patches())
        # the added pods' nodes turn Ready at different delays: their serving times must come out in that order
        srv.cluster.ready_after = {"gpu-n02": 0.3, "gpu-n03": 1.2}
        scraped = grow.follow(list(rig.eps))  # as the phase gives its scraper every node's endpoint
        url = grow.serve(first, after_s=0.5)
        page = _read(url)  # k6's first read: the phase's scenario starts, the spike 0.5 s later
        assert [t["node"] for t in page["targets"]] == ["n00", "n01"] and page["final"] is False
        time.sleep(0.2)
        assert rig.replicas() == 1 and len(rig.scale_patches()) == patches  # nothing asked before the spike
        _until(lambda: _read(url)["final"])
        assert rig.replicas() == 3  # patched back: 4 nodes less the canary's pod
        assert len(rig.scale_patches()) == patches + 1  # one patch of the scale subresource
        page = _read(url)
        ips = rig.ready_pods()
        got = {t["node"]: t["url"] for t in page["targets"]}
        assert list(got) == ["n00", "n01", "n02", "n03"]
        for n in ("n02", "n03"):  # a new pod has a new address: k6 is given it, not the one the rollout recorded
            assert got[n] == f"http://{ips[n]}:{rig.cfg.rollout.port}" and got[n] != before[n]
        assert got["n00"] == before["n00"] and got["n01"] == before["n01"]  # the kept pods are the same pods
        # the scraper reads each added pod's /metrics at its new address, and knows its pod (DCGM's "pod" label)
        assert {e.node: e.url for e in scraped} == got
        assert {e.node: e.page for e in scraped}["n03"] == f"{got['n03']}/metrics"
        assert {e.node: e.pod for e in scraped}["n03"] != {e.node: e.pod for e in rig.eps}["n03"]
        out = grow.finish()
        by = {a["node"]: a for a in out["added"]}
        assert all(a["error"] is None for a in out["added"]), out
        assert 0 < by["n02"]["serving_s"] < by["n03"]["serving_s"]
        assert by["n03"]["serving_s"] >= 1.2 - 0.2  # its pod is Ready 1.2 s after the patch (the poll's slack)
        assert out["deployer_asked_s"] is not None and out["deployer_asked_s"] >= 0
        assert out["all_serving_s"] == by["n03"]["serving_s"] and out["nodes_after"] == NODES
        patches = len(rig.scale_patches())
        Load._restore(grow, None)  # asked at the spike: settle patches the replicas back once (already there)
        assert len(rig.scale_patches()) == patches + 1
        assert rig.replicas() == 3 and sorted(rig.ready_pods()) == NODES


def test_a_phase_that_fails_before_the_spike_puts_the_replicas_back():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        assert rig.replicas() == 1 and len(first) == 2
        grow.serve(first, after_s=60.0)  # k6 never reads its page: it died in its set-up
        failed = RuntimeError("k6 exited 107 in setup()")
        Load._restore(grow, failed)
        assert rig.replicas() == 3 and sorted(rig.ready_pods()) == NODES  # every node serves again
        out = grow.finish()
        assert [a["serving_s"] for a in out["added"]] == [None, None]
        assert all(a["error"] for a in out["added"])  # not added under load: restored, not measured


def test_an_added_pod_that_never_gets_ready_fails_alone_named():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        grow.ready_timeout_s = 1.0
        srv.cluster.broken = {"gpu-n03": "CUDA error: out of memory"}
        url = grow.serve(first, after_s=0.0)
        _read(url)
        _until(lambda: _read(url)["final"])
        out = grow.finish()
        by = {a["node"]: a for a in out["added"]}
        assert by["n02"]["error"] is None and by["n02"]["serving_s"] > 0
        assert by["n03"]["serving_s"] is None and "CrashLoopBackOff" in by["n03"]["error"]
        assert "n03" in by["n03"]["error"] and "out of memory" in by["n03"]["error"]  # its pod's log tail
        assert out["nodes_after"] == ["n00", "n01", "n02"] and out["all_serving_s"] is None


def test_a_scale_down_that_never_settles_is_an_error_and_the_replicas_go_back():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        dep = rollout.deployer(rig.cluster, NODES, rig.cfg, rig.kube)
        srv.cluster.ready_after = {"gpu-n00": 30.0}  # the canary's pod is not ready: the scaled-down set never is
        with srv.cluster.lock:  # ... as after a restart
            for p in srv.cluster.pods.values():
                if p["spec"].get("nodeName") == "gpu-n00":
                    p["_scheduled"] = time.monotonic()
        with pytest.raises(Exception, match=r"still has 2 pods \(1 ready\), not 2"):
            dep.shrink(["n00", "n01"], 0.5)
        with pytest.raises(Exception, match=r"still has 2 pods \(1 ready\), not 2"):
            Load._scale_down(SimpleNamespace(run=SimpleNamespace(cfg=rig.cfg.model_copy(update={
                "rollout": rig.cfg.rollout.model_copy(update={"ready_timeout_s": 0.5})}), nodes=NODES),
                kube=rig.kube), rig.cluster, rig.eps)
        srv.cluster.ready_after = {}
        assert rig.replicas() == 3  # restored: nothing left scaled down


class TaskKilled(BaseException):
    """Stands in for Airflow's AirflowTaskTimeout / AirflowTaskTerminated: BaseExceptions, not Exceptions."""


def test_a_task_killed_during_the_scale_down_puts_the_replicas_back(monkeypatch):
    from deploybench.rollout.kubernetes import KubernetesDeployer

    real = KubernetesDeployer.shrink

    def killed(self, keep, timeout_s):
        real(self, keep, timeout_s)  # scaled down, then the task's timeout fires
        raise TaskKilled("task timed out")

    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        monkeypatch.setattr(KubernetesDeployer, "shrink", killed)
        patches = len(rig.scale_patches())
        with pytest.raises(TaskKilled):
            Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        assert len(rig.scale_patches()) >= patches + 2  # down, then back (settle; restore asks again)
        assert rig.replicas() == 3  # nothing left scaled down


@pytest.fixture
def inventory(tmp_path, monkeypatch):
    folder = tmp_path / "inventories"
    folder.mkdir()
    monkeypatch.setenv("DEPLOYBENCH_INVENTORIES", str(folder))
    monkeypatch.delenv("DEPLOYBENCH_POLICY", raising=False)
    inv = {"name": "kube3", "transport": "local", "python": sys.executable, "model_root": str(tmp_path / "models"),
           "run_root": str(tmp_path / "run"), "nodes": [
               {"name": f"n{i}", "address": f"127.0.0.{i}", "link_mbit": 1000, "k8s_node": f"gpu-{i}"}
               for i in (1, 2, 3)]}
    (folder / "kube3.json").write_text(json.dumps(inv))
    assert Path(os.environ["DEPLOYBENCH_INVENTORIES"]) == folder
    return "kube3"


def test_validate_accepts_scale_up_on_kubernetes_and_refuses_scaling_below_the_canary(inventory):
    conf = params.defaults() | {"inventory": inventory, "rollout_backend": "kubernetes", "load_phases": ["spike"],
                                "scale_up": True, "canary_nodes": 1, "scale_up_from": 1}
    got = pipeline.validate("deploybench_run__k8s_up", conf)
    assert got["nodes"] == ["n1", "n2", "n3"]
    with pytest.raises(ConfigError) as exc:
        pipeline.validate("deploybench_run__k8s_up2", conf | {"canary_nodes": 2, "scale_up_from": 1})
    assert "scale_up_from=1 is below the canary's 2 pods" in str(exc.value) and "between 2 and 2" in str(exc.value)


def test_hpa_mode_applies_the_autoscaler_for_the_phase_times_the_pods_it_adds_and_deletes_it_after():
    """scale_up_mode=hpa: the fake's stand-in of the HPA controller applies Kubernetes' rule (desired = ceil(current x
    metric / target)) to a per-pod metric value the test sets, standing in for the engines' waiting-requests gauge
    under the spike (no engine, no metrics adapter runs here)."""
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv, "hpa")
        ns = rig.cfg.rollout.kubernetes.namespace
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        # not before the spike: an autoscaler applied now could add pods during the warm-up
        assert ("HorizontalPodAutoscaler", ns, rig.stable) not in srv.cluster.objects
        srv.cluster.ready_after = {"gpu-n02": 0.3, "gpu-n03": 1.0}
        url = grow.serve(first, after_s=0.3)
        _read(url)
        _until(lambda: ("HorizontalPodAutoscaler", ns, rig.stable) in srv.cluster.objects)  # at the spike's start
        hpa = srv.cluster.objects[("HorizontalPodAutoscaler", ns, rig.stable)]
        assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 3  # 2 and 4 pods less the canary
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
        assert hpa["spec"]["behavior"]["scaleDown"] == {"selectPolicy": "Disabled"}  # k6 loads the pods to the end
        assert rig.replicas() == 1 and len(first) == 2
        patches = len(rig.scale_patches())
        time.sleep(0.5)  # the spike has started: its queue builds up on the two engines
        assert rig.replicas() == 1  # the queue is short yet: the autoscaler holds its minimum
        srv.cluster.metric_per_pod = 100.0  # 100 waiting per pod, target max_num_seqs/4: the autoscaler adds pods
        _until(lambda: _read(url)["final"])
        assert rig.replicas() == 3 and len(rig.scale_patches()) == patches  # the autoscaler, not deploybench
        out = grow.finish()
        by = {a["node"]: a for a in out["added"]}
        assert all(a["error"] is None for a in out["added"]), out
        assert 0.5 < by["n02"]["serving_s"] < by["n03"]["serving_s"]  # after the queue grew, in their nodes' order
        srv.cluster.metric_per_pod = 0.0  # the recovery: the queue is short again, k6 still loads every pod
        with srv.cluster.lock:
            srv.cluster.reconcile()
        assert rig.replicas() == 3  # the autoscaler removes none (scaleDown disabled)
        Load._restore(grow, None)
        assert ("HorizontalPodAutoscaler", ns, rig.stable) in srv.cluster.deleted
        assert ("HorizontalPodAutoscaler", ns, rig.stable) not in srv.cluster.objects
        assert rig.replicas() == 3


def test_hpa_mode_a_failed_phase_deletes_the_autoscaler_and_puts_the_replicas_back():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv, "hpa")
        ns = rig.cfg.rollout.kubernetes.namespace
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        url = grow.serve(first, after_s=0.0)
        _read(url)
        _until(lambda: ("HorizontalPodAutoscaler", ns, rig.stable) in srv.cluster.objects)
        Load._restore(grow, RuntimeError("k6 exited 107 in the spike"))
        assert ("HorizontalPodAutoscaler", ns, rig.stable) not in srv.cluster.objects
        assert ("HorizontalPodAutoscaler", ns, rig.stable) in srv.cluster.deleted
        assert rig.replicas() == 3 and sorted(rig.ready_pods()) == NODES
        # a dead run's autoscaler goes with the run's other objects, by its label
        rig.srv.cluster.objects[("HorizontalPodAutoscaler", ns, rig.stable)] = dict(hpa := manifests.hpa(
            rig.cfg, len(NODES), "run-up"), metadata={**hpa["metadata"], "generation": 1})
        out = rollout.teardown(rig.cluster, NODES, rig.cfg, kube=rig.kube)
        assert out.get(f"horizontalpodautoscaler/{rig.stable}") == "stopped", out
        assert not srv.cluster.objects


def test_hpa_mode_is_refused_off_kubernetes_and_with_no_stable_pod_to_scale_from(inventory):
    with pytest.raises(ConfigError) as exc:
        RunConfig.parse({"inventory": "x", "load": {"phases": ["spike"], "scale_up": True,
                                                     "scale_up_mode": "hpa"}})
    assert "scale_up_mode='hpa'" in str(exc.value) and "rollout.backend='ssh'" in str(exc.value)
    conf = params.defaults() | {"inventory": inventory, "rollout_backend": "kubernetes", "load_phases": ["spike"],
                                "scale_up": True, "canary_nodes": 1, "scale_up_mode": "hpa"}
    with pytest.raises(ConfigError) as exc:
        pipeline.validate("deploybench_run__k8s_hpa", conf | {"scale_up_from": 1})
    assert "does not act on a Deployment at 0 replicas" in str(exc.value) and "between 2 and 2" in str(exc.value)
    assert pipeline.validate("deploybench_run__k8s_hpa2", conf | {"scale_up_from": 2})["nodes"] == ["n1", "n2", "n3"]


def test_the_phase_after_a_kubernetes_scale_up_loads_the_new_pods(tmp_path, monkeypatch):
    """After the spike's scale-down and up the stable pods are new pods at new addresses: the overload phase (and a
    retry of the spike) must load those, not the addresses the rollout recorded (load/endpoints.json)."""
    from deploybench.load import phases
    from deploybench.load.scale_up import LIVE_ENDPOINTS

    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        recorded = [{"node": e.node, "url": e.url, "model": e.model, "pod": e.pod} for e in rig.eps]
        rollout_rec = SimpleNamespace(status="success", started_at="2026-12-07T00:00:00+00:00")
        run = SimpleNamespace(cfg=rig.cfg.model_copy(update={"load": rig.cfg.load.model_copy(update={
            "phases": [phases.LoadPhase.SPIKE, phases.LoadPhase.OVERLOAD]})}), nodes=NODES, key="run-up",
            dir=tmp_path, inventory=_inv(), endpoints=lambda: recorded,
            stage=lambda name: rollout_rec if name == "rollout" else None)
        loaded: dict[str, list[str]] = {}

        def phase_run(phase, eps, *a, **kw):
            loaded[phase] = [e.url for e in eps]
            return {}  # the spike never started: restore starts the engines it stopped (new pods)

        monkeypatch.setattr(phases, "run_phase", phase_run)
        monkeypatch.setattr(Load, "_assembled", lambda self, ctx: None)
        load = Load()
        load.run(SimpleNamespace(run=run, phase="spike", kube=rig.kube, prometheus=None), rig.cluster)
        assert loaded["spike"] == [e["url"] for e in recorded[:2]]  # scaled down to scale_up_from=2 first
        _until(lambda: len(rig.ready_pods()) == 4)
        ips = rig.ready_pods()
        now = [f"http://{ips[n]}:{rig.cfg.rollout.port}" for n in NODES]
        assert now[2:] != [e["url"] for e in recorded[2:]]  # n02, n03: new pods at new addresses
        assert (tmp_path / "load" / LIVE_ENDPOINTS).is_file()
        load.run(SimpleNamespace(run=run, phase="overload", kube=rig.kube, prometheus=None), rig.cluster)
        assert loaded["overload"] == now
        # a re-deploy (another rollout record) makes the record stale: the rollout's endpoints again
        rollout_rec.started_at = "2026-12-07T01:00:00+00:00"
        load.run(SimpleNamespace(run=run, phase="overload", kube=rig.kube, prometheus=None), rig.cluster)
        assert loaded["overload"] == [e["url"] for e in recorded]
        # a record that is not one: a clear error naming the file and the way out
        rollout_rec.started_at = "2026-12-07T00:00:00+00:00"
        (tmp_path / "load" / LIVE_ENDPOINTS).write_text('{"rollout_started_at": "2026-12-07T00:00:00+00:00", '
                                                       '"endpoints": [{"node": "n00", "url": "file:///etc/passwd", '
                                                       '"model": "m"}]}')
        with pytest.raises(Exception, match=r"(?s)endpoints\.json is not a record.*delete it"):
            load.run(SimpleNamespace(run=run, phase="overload", kube=rig.kube, prometheus=None), rig.cluster)


def test_hpa_mode_a_spike_that_never_started_applies_no_autoscaler():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv, "hpa")
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        grow.serve(first, after_s=60.0)  # k6 never reads its page
        Load._restore(grow, RuntimeError("k6 exited 107 in setup()"))
        assert all(k[0] != "HorizontalPodAutoscaler" for k in srv.cluster.applied)  # settle left none to apply
        assert rig.replicas() == 3 and sorted(rig.ready_pods()) == NODES


def test_settle_whose_autoscaler_delete_fails_still_patches_the_replicas_and_says_so():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv, "hpa")
        dep = rollout.deployer(rig.cluster, NODES, rig.cfg, rig.kube)
        dep.shrink(["n00", "n01"], 5.0)
        assert rig.replicas() == 1
        srv.cluster.fail[("DELETE", "HorizontalPodAutoscaler")] = 500
        with pytest.raises(Exception, match=r"(?s)deleting the HorizontalPodAutoscaler .*fails every DELETE") as exc:
            dep.settle()
        assert "patching" not in str(exc.value)  # the patch went through
        assert rig.replicas() == 3 and sorted(rig.ready_pods()) == NODES  # and settle waited for the pods


def test_shrink_counts_no_pod_being_deleted_or_terminated():
    """A Failed (evicted) pod of the run, or one with a deletionTimestamp, is not one of the pods left serving."""
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        dep = rollout.deployer(rig.cluster, NODES, rig.cfg, rig.kube)
        real = dep._pods
        dead = {"metadata": {"name": "evicted-1", "labels": {}}, "spec": {"nodeName": "gpu-n03"},
                "status": {"phase": "Failed", "reason": "Evicted", "conditions": []}}
        going = {"metadata": {"name": "going-1", "labels": {}, "deletionTimestamp": "2026-12-07T00:00:00Z"},
                 "spec": {"nodeName": "gpu-n02"}, "status": {"phase": "Running", "podIP": "10.1.0.9",
                                                              "conditions": [{"type": "Ready", "status": "True"}]}}
        dep._pods = lambda: [*real(), dead, going]  # type: ignore[method-assign]
        assert dep.shrink(["n00", "n01"], 5.0) == ["n00", "n01"]


@pytest.mark.parametrize("ip", ["127.0.0.1", "0.0.0.0", "169.254.1.1", "224.0.0.1", "::1", "::", "fe80::1",
                                "fe80::1%eth0", "fd00::1%2", "ff02::1", "not-an-ip", 7, None])
def test_a_pod_address_that_is_not_a_pods_is_refused(ip):
    from deploybench.rollout.kubernetes import _pod_ip

    assert _pod_ip({"status": {"podIP": ip}}) is None


def test_a_pods_own_address_is_taken():
    from deploybench.rollout.kubernetes import _pod_ip

    assert _pod_ip({"status": {"podIP": "10.244.1.7"}}) == "10.244.1.7"
    assert _pod_ip({"status": {"podIP": "fd00:10:244::7"}}) == "[fd00:10:244::7]"


def test_teardown_with_a_role_that_cannot_list_autoscalers_still_deletes_the_rest():
    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv)
        srv.cluster.fail[("LIST", "HorizontalPodAutoscaler")] = 403
        out = rollout.teardown(rig.cluster, NODES, rig.cfg, kube=rig.kube)
        assert not any(k.startswith("horizontalpodautoscaler") for k in out), out
        assert all(v == "stopped" for v in out.values()), out
        assert not [k for k in srv.cluster.objects if k[0] == "Deployment"]


def test_scale_up_with_the_k6_operator_is_refused_naming_both_settings():
    with pytest.raises(ConfigError) as exc:
        RunConfig.parse({"inventory": "x", "rollout": {"backend": "kubernetes", "kubernetes": {
            "k6_operator": {"parallelism": 2}}}, "load": {"phases": ["spike"], "scale_up": True}})
    assert "load.scale_up=true" in str(exc.value) and "k6_operator.parallelism=2" in str(exc.value)
    # without scale_up the operator sends the spike as any phase
    RunConfig.parse({"inventory": "x", "rollout": {"backend": "kubernetes", "kubernetes": {
        "k6_operator": {"parallelism": 2}}}, "load": {"phases": ["spike"]}})


def test_hpa_mode_off_kubernetes_is_refused_only_with_scale_up():
    got = RunConfig.parse({"inventory": "x", "load": {"phases": ["sustained"], "scale_up_mode": "hpa"}})
    assert got.load.scale_up_mode.value == "hpa"  # not read: no scale-up


class _Spy:
    """An API object whose every call is recorded with whether it carried ``_request_timeout``."""

    def __init__(self, api, calls: list):
        self._api, self._calls = api, calls

    def __getattr__(self, name):
        fn = getattr(self._api, name)

        def call(*a, **kw):
            self._calls.append((name, kw.get("_request_timeout")))
            return fn(*a, **kw)
        return call


def test_every_api_call_of_the_scale_up_is_bounded():
    from deploybench.rollout.kubernetes import API_TIMEOUT_S

    with FakeApiServer([f"gpu-{n}" for n in NODES], ready_after_s=0.1) as srv:
        rig = Rig(srv, "hpa")
        calls: list = []
        k = rig.kube
        rig.ctx.kube = KubeClients(*(_Spy(a, calls) for a in (k.apps, k.core, k.policy, k.custom, k.autoscaling)))
        grow, first = Load._scale_down(rig.ctx, rig.cluster, rig.eps)
        url = grow.serve(first, after_s=0.0)
        _read(url)
        _until(lambda: any(n == "patch_namespaced_horizontal_pod_autoscaler" for n, _ in calls))
        srv.cluster.metric_per_pod = 100.0
        _until(lambda: _read(url)["final"])
        grow.finish()
        Load._restore(grow, None)
        names = {n for n, _ in calls}
        assert {"list_namespaced_pod", "patch_namespaced_deployment_scale",
                "patch_namespaced_horizontal_pod_autoscaler", "delete_namespaced_horizontal_pod_autoscaler",
                "read_namespaced_horizontal_pod_autoscaler"} <= names
        unbounded = sorted({n for n, t in calls if t != API_TIMEOUT_S})
        assert not unbounded
