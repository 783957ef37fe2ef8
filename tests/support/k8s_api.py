"""A FAKE Kubernetes API server for tests: a small, local stand-in for apps/v1 and core/v1.

It is not Kubernetes. No real API server can run on this machine, so this fake answers the
few REST calls the kubernetes deployer makes, over real HTTP, to the real ``kubernetes``
Python client: server-side apply (PATCH application/apply-patch+yaml, fieldManager
required) of Deployments, Services, ConfigMaps and PodDisruptionBudgets; merge-patches of a Deployment's scale
subresource; GET of Deployments; lists of pods, Deployments, Services, ConfigMaps and
PodDisruptionBudgets (stored, not enforced: the fake evicts nothing) by label selector; pod logs; DELETE.
autoscaling/v2 HorizontalPodAutoscalers (apply, list, DELETE) get a stand-in of the HPA controller's rule on a metric
value the test sets (``metric_per_pod``).

A tiny "controller" runs on every request: each Deployment gets ``spec.replicas`` pods,
scheduled like the real scheduler under the manifests' rules (a required node affinity
``kubernetes.io/hostname In [...]`` and a required pod anti-affinity on the instance label:
at most one pod of the instance per node; no allowed free node = Pending/Unschedulable).
A pod turns Ready ``ready_after_s`` (or its node's ``ready_after``) after it was created, unless its node is in
``broken``
(CrashLoopBackOff, restarts counting up, never ready) or in ``crash_after_ready`` (ready,
then restarting). Deployment status follows the controller's fields (observedGeneration,
replicas, updatedReplicas, readyReplicas, availableReplicas) and a Progressing condition
that turns ProgressDeadlineExceeded after ``progressDeadlineSeconds * deadline_scale``.

k6-operator TestRuns (k6.io/v1alpha1, custom objects: apply, GET, list, DELETE) get a stand-in of the operator's
reconciler: an applied TestRun's ``status.stage`` moves initialization -> created (its N runner pods appear, labelled as
the operator's pkg/resources/jobs/runner.go labels them: app=k6, k6_cr=<name>, runner=true, job-name=<name>-<i>) ->
started -> finished (or what ``testrun_hook`` says), and each stage it passed is recorded in ``stages``. What the
runners do is ``testrun_hook(testrun, configmap)``: the tests run REAL k6 there (tests/support/k6_runners.py) and
return each runner's exit code and log, which become the pods' terminated states and their logs (served with
``limitBytes``). Deleting a TestRun deletes its pods, as its Jobs' garbage collection would.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

HOSTNAME = "kubernetes.io/hostname"


class FakeCluster:
    def __init__(self, nodes: list[str], ready_after_s: float = 0.3, deadline_scale: float = 0.01):
        self.nodes = list(nodes)
        self.ready_after_s = ready_after_s
        self.ready_after: dict[str, float] = {}  # node -> its own ready_after_s (pods there turn Ready that late)
        self.deadline_scale = deadline_scale
        self.broken: dict[str, str] = {}  # node -> log text of an engine that never starts
        self.crash_after_ready: set[str] = set()
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (kind, ns, name) -> object
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (ns, name) -> pod
        self.calls: list[tuple[str, str, str]] = []  # (method, path, content-type)
        self.lock = threading.Lock()
        self._seq = 0
        # k6-operator: (testrun, its configmap) -> (final stage, [(runner index, exit code, log bytes)])
        self.testrun_hook: Callable[[dict, dict | None], tuple[str, list[tuple[int, int, bytes]]]] | None = None
        self.stages: dict[str, list[str]] = {}  # testrun name -> every stage it was in, in order
        self.pod_logs: dict[tuple[str, str], bytes] = {}
        self.applied: list[tuple[str, str, str]] = []  # (kind, ns, name) of every apply
        self.deleted: list[tuple[str, str, str]] = []
        # a TestRun deleted in the foreground answers this many more GETs (deletionTimestamp set) before 404, as the
        # API server keeps it while the garbage collector deletes its Jobs and pods
        self.linger_gets = 0
        self.lingering: dict[tuple[str, str, str], list[Any]] = {}  # key -> [object, GETs left]
        self.hook_errors: list[BaseException] = []
        # HorizontalPodAutoscalers (autoscaling/v2): the stand-in reads this as every pod's value of the HPA's metric
        # (the engines' waiting-requests gauge, as a metrics adapter would serve it)
        self.metric_per_pod = 0.0
        self.fail: dict[tuple[str, str], int] = {}  # (method, kind) -> the HTTP status every such request gets

    # -- the controller -------------------------------------------------------------------------
    def _allowed(self, dep: dict) -> list[str]:
        terms = dep["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        return [v for t in terms for e in t["matchExpressions"] if e["key"] == HOSTNAME for v in e["values"]]

    def _instance(self, obj: dict) -> str:
        return obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"]

    def _autoscale(self) -> None:
        """The HPA controller's rule (desired = ceil(current x metric / target), within min and max), on the
        stand-in's ``metric_per_pod``; a Deployment at 0 replicas is left alone, as Kubernetes leaves it. Down only
        when ``behavior.scaleDown.selectPolicy`` is not ``Disabled``, then at once (the stand-in has no stabilisation
        window)."""
        for (kind, ns, _), hpa in list(self.objects.items()):
            if kind != "HorizontalPodAutoscaler":
                continue
            spec = hpa["spec"]
            dep = self.objects.get(("Deployment", ns, spec["scaleTargetRef"]["name"]))
            current = (dep or {}).get("spec", {}).get("replicas", 0)
            if not dep or not current:
                continue
            target = float(spec["metrics"][0]["pods"]["target"]["averageValue"])
            want = math.ceil(current * self.metric_per_pod / target) if self.metric_per_pod else current
            want = max(spec.get("minReplicas", 1), min(spec["maxReplicas"], want))
            down_off = ((spec.get("behavior") or {}).get("scaleDown") or {}).get("selectPolicy") == "Disabled"
            if want != current and not (want < current and down_off):
                dep["spec"]["replicas"] = want
                dep["metadata"]["generation"] += 1

    def reconcile(self) -> None:
        now = time.monotonic()
        self._autoscale()
        for (kind, ns, name), dep in list(self.objects.items()):
            if kind != "Deployment":
                continue
            owned = sorted((p for (pns, _), p in self.pods.items() if pns == ns and p["_owner"] == name),
                           key=lambda p: p["_seq"])
            want = dep["spec"].get("replicas", 1)
            for p in owned[want:]:
                del self.pods[(ns, p["metadata"]["name"])]
            for _ in range(want - len(owned)):
                self._seq += 1
                pname = f"{name}-{self._seq:05d}"
                self.pods[(ns, pname)] = {"_owner": name, "_seq": self._seq, "_created": now,
                                          "metadata": {"name": pname, "namespace": ns,
                                                       "labels": dict(dep["spec"]["template"]["metadata"]["labels"])},
                                          "spec": {}, "status": {"phase": "Pending"}}
            self._schedule(ns, dep)
            self._status(ns, name, dep, now)

    def _schedule(self, ns: str, dep: dict) -> None:
        inst = self._instance(dep)
        taken = {p["spec"].get("nodeName") for (pns, _), p in self.pods.items()
                 if pns == ns and p["metadata"]["labels"].get("app.kubernetes.io/instance") == inst}
        for (pns, _), p in sorted(self.pods.items(), key=lambda kv: kv[1]["_seq"]):
            if pns != ns or p["_owner"] != dep["metadata"]["name"] or p["spec"].get("nodeName"):
                continue
            free = [n for n in self._allowed(dep) if n in self.nodes and n not in taken]
            if not free:
                p["status"] = {"phase": "Pending", "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": f"0/{len(self.nodes)} nodes are available: didn't match pod anti-affinity "
                                "or node affinity"}]}
                continue
            p["spec"]["nodeName"] = free[0]
            taken.add(free[0])
            p["_scheduled"] = time.monotonic()

    def _pod_state(self, p: dict, now: float) -> None:
        node = p["spec"].get("nodeName")
        if not node:
            return
        age = now - p["_scheduled"]
        idx = int(re.sub(r"\D", "", node) or 0)
        ip = f"10.244.{idx % 250}.{10 + p['_seq'] % 200}"
        if node in self.broken:
            restarts = int(age / 0.2)
            p["status"] = {"phase": "Running", "podIP": ip, "conditions": [
                {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": "engine", "ready": False, "restartCount": restarts, "state": {
                    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}}}]}
            return
        after = self.ready_after.get(node, self.ready_after_s)
        ready = age >= after
        restarts = 0
        if ready and node in self.crash_after_ready and age >= 2 * after:
            ready, restarts = False, 1
        p["status"] = {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "engine", "ready": ready, "restartCount": restarts,
                                   "state": {"running": {}}}]}

    def _status(self, ns: str, name: str, dep: dict, now: float) -> None:
        pods = [p for (pns, _), p in self.pods.items() if pns == ns and p["_owner"] == name]
        for p in pods:
            self._pod_state(p, now)
        ready = sum(1 for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                           for c in p["status"].get("conditions", [])))
        want = dep["spec"].get("replicas", 1)
        st = dep.setdefault("status", {})
        complete = ready >= want
        # progress as the deployment controller counts it (``DeploymentProgressing``, kubernetes
        # pkg/controller/deployment/util/deployment_util.go): more updated pods (a scale-up creates them) or more
        # ready pods than the last status said. The deadline runs from the last progress, not from the last time
        # the Deployment was complete (a scale-up made 0.6 s after the last read timed out at its first read)
        progressed = len(pods) > st.get("updatedReplicas", 0) or ready > st.get("readyReplicas", 0)
        if complete or progressed or "_progress" not in dep:
            dep["_progress"] = now
        deadline = dep["spec"].get("progressDeadlineSeconds", 600) * self.deadline_scale
        reason = ("NewReplicaSetAvailable" if complete else
                  "ProgressDeadlineExceeded" if now - dep["_progress"] > deadline else "ReplicaSetUpdated")
        st.update(observedGeneration=dep["metadata"]["generation"], replicas=len(pods), updatedReplicas=len(pods),
                  readyReplicas=ready, availableReplicas=ready,
                  conditions=[{"type": "Progressing", "status": "False" if reason == "ProgressDeadlineExceeded"
                               else "True", "reason": reason, "message": f"{ready}/{want} available"}])

    # -- the k6-operator stand-in ----------------------------------------------------------------
    def _set_stage(self, ns: str, name: str, stage: str) -> bool:
        with self.lock:
            tr = self.objects.get(("TestRun", ns, name))
            if tr is None:
                return False  # deleted meanwhile
            tr["status"] = {"stage": stage}
            self.stages.setdefault(name, []).append(stage)
            return True

    def start_testrun(self, ns: str, name: str) -> None:
        threading.Thread(target=self._operate, args=(ns, name), daemon=True).start()

    def _operate(self, ns: str, name: str) -> None:
        try:
            with self.lock:
                tr = json.loads(json.dumps(_public(self.objects[("TestRun", ns, name)])))
                cm_name = tr["spec"]["script"]["configMap"]["name"]
                cm = self.objects.get(("ConfigMap", ns, cm_name))
                cm = json.loads(json.dumps(_public(cm))) if cm else None
            n = int(tr["spec"]["parallelism"])
            if not self._set_stage(ns, name, "initialized"):
                return
            with self.lock:
                for i in range(1, n + 1):
                    self._seq += 1
                    pname = f"{name}-{i}-{self._seq:05d}"
                    self.pods[(ns, pname)] = {
                        "_owner": f"testrun:{name}", "_testrun": name, "_seq": self._seq, "_created": time.monotonic(),
                        "metadata": {"name": pname, "namespace": ns, "labels": {
                            "app": "k6", "k6_cr": name, "runner": "true", "job-name": f"{name}-{i}"}},
                        "spec": {"nodeName": self.nodes[i % len(self.nodes)]},
                        "status": {"phase": "Running", "containerStatuses": [
                            {"name": "k6", "ready": True, "restartCount": 0, "state": {"running": {}}}]}}
            if not self._set_stage(ns, name, "created") or not self._set_stage(ns, name, "started"):
                return
            stage, runs = self.testrun_hook(tr, cm) if self.testrun_hook else ("finished", [])
            with self.lock:
                for index, code, log in runs:
                    key = next((k for k, p in self.pods.items() if p.get("_testrun") == name
                                and p["metadata"]["labels"]["job-name"] == f"{name}-{index}"), None)
                    if key is None:
                        continue
                    self.pods[key]["status"] = {
                        "phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
                            {"name": "k6", "ready": False, "restartCount": 0,
                             "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0
                                                      else "Error"}}}]}
                    self.pod_logs[key] = log
            self._set_stage(ns, name, stage)
        except BaseException as exc:  # noqa: BLE001 - kept for the test to see
            self.hook_errors.append(exc)
            self._set_stage(ns, name, "error")

    # -- REST ---------------------------------------------------------------------------------
    def pod_log(self, ns: str, name: str, tail: int) -> str:
        if (ns, name) in self.pod_logs:
            return self.pod_logs[(ns, name)].decode(errors="replace")
        p = self.pods.get((ns, name))
        if p is None:
            return ""
        node = p["spec"].get("nodeName")
        text = self.broken.get(node, f"engine on {node}: serving") if node else ""
        return "\n".join(text.splitlines()[-tail:])

    def live(self, kind: str, ns: str | None = None) -> list[dict]:
        with self.lock:
            self.reconcile()
            return [o for (k, n, _), o in self.objects.items() if k == kind and (ns is None or n == ns)]


_ROUTES = [
    (re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$"), "Deployment", "scale"),
    (re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)(/status)?$"), "Deployment", "obj"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/]+)$"), "Service", "obj"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$"), "ConfigMap", "obj"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$"), "Pod", "log"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/pods$"), "Pod", "list"),
    (re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments$"), "Deployment", "list"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/services$"), "Service", "list"),
    (re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps$"), "ConfigMap", "list"),
    (re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/]+)$"), "PodDisruptionBudget", "obj"),
    (re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets$"), "PodDisruptionBudget", "list"),
    (re.compile(r"^/apis/autoscaling/v2/namespaces/([^/]+)/horizontalpodautoscalers/([^/]+)$"),
     "HorizontalPodAutoscaler", "obj"),
    (re.compile(r"^/apis/autoscaling/v2/namespaces/([^/]+)/horizontalpodautoscalers$"), "HorizontalPodAutoscaler",
     "list"),
    (re.compile(r"^/apis/k6.io/v1alpha1/namespaces/([^/]+)/testruns/([^/]+)$"), "TestRun", "obj"),
    (re.compile(r"^/apis/k6.io/v1alpha1/namespaces/([^/]+)/testruns$"), "TestRun", "list"),
]


def _public(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if not k.startswith("_")}


def _handler(fake: FakeCluster):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _send(self, code: int, body: Any, ctype: str = "application/json") -> None:
            data = (body if isinstance(body, bytes) else body.encode() if isinstance(body, str)
                    else json.dumps(body).encode())
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _status(self, code: int, reason: str, msg: str) -> None:
            self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": msg,
                              "reason": reason, "code": code})

        def _route(self):
            u = urlparse(self.path)
            for rx, kind, what in _ROUTES:
                m = rx.match(u.path)
                if m:
                    return kind, what, m.group(1), m.group(2) if what != "list" else None, parse_qs(u.query)
            return None

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}")

        def do_GET(self):
            r = self._route()
            fake.calls.append(("GET", self.path, ""))
            if r is None:
                return self._status(404, "NotFound", f"the fake has no route for {self.path}")
            kind, what, ns, name, q = r
            if what == "list" and (code := fake.fail.get(("LIST", kind))) is not None:
                return self._status(code, "Forbidden" if code == 403 else "InternalError",
                                    f"the fake refuses every list of {kind}s")
            with fake.lock:
                fake.reconcile()
                if what == "list":
                    sel = dict(s.split("=", 1) for s in q.get("labelSelector", [""])[0].split(",") if s)
                    pool = (sorted(fake.pods.items()) if kind == "Pod" else
                            sorted(((n, nm), o) for (k, n, nm), o in fake.objects.items() if k == kind))
                    items = [_public(p) for (pns, _), p in pool if pns == ns
                             and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in sel.items())]
                    return self._send(200, {"kind": f"{kind}List", "apiVersion": "v1", "items": items})
                if what == "log":
                    if (ns, name) in fake.pod_logs:  # a runner's log: whole (or its tail), at most limitBytes
                        data = fake.pod_logs[(ns, name)]
                        if "tailLines" in q:
                            data = b"\n".join(data.splitlines()[-int(q["tailLines"][0]):])
                        if "limitBytes" in q:
                            data = data[:int(q["limitBytes"][0])]
                        return self._send(200, data, "text/plain")
                    return self._send(200, fake.pod_log(ns, name, int(q.get("tailLines", ["50"])[0])), "text/plain")
                obj = fake.objects.get((kind, ns, name))
                if obj is None and (ling := fake.lingering.get((kind, ns, name))) is not None:
                    ling[1] -= 1
                    if ling[1] <= 0:
                        fake.lingering.pop((kind, ns, name), None)
                    return self._send(200, _public(ling[0]))
                if obj is None:
                    return self._status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
                return self._send(200, _public(obj))

        def do_PATCH(self):
            r = self._route()
            ctype = self.headers.get("Content-Type", "")
            fake.calls.append(("PATCH", self.path, ctype))
            if r is None:
                return self._status(404, "NotFound", f"the fake has no route for {self.path}")
            kind, what, ns, name, q = r
            body = self._body()
            with fake.lock:
                key = (kind, ns, name)
                if what == "scale":
                    if ctype != "application/merge-patch+json":
                        return self._status(415, "UnsupportedMediaType", f"scale patch as {ctype}")
                    obj = fake.objects.get(key)
                    if obj is None:
                        return self._status(404, "NotFound", f'deployments.apps "{name}" not found')
                    replicas = body["spec"]["replicas"]
                    if obj["spec"].get("replicas") != replicas:
                        obj["spec"]["replicas"] = replicas
                        obj["metadata"]["generation"] += 1
                    fake.reconcile()
                    return self._send(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                            "metadata": {"name": name, "namespace": ns},
                                            "spec": {"replicas": replicas}, "status": {"replicas": replicas}})
                if ctype != "application/apply-patch+yaml":
                    return self._status(
                        415, "UnsupportedMediaType", f"the fake only takes server-side apply, not {ctype}"
                    )
                if not q.get("fieldManager"):
                    return self._status(400, "BadRequest", "fieldManager is required for apply patch")
                if body.get("kind") != kind or body.get("metadata", {}).get("name") != name:
                    return self._status(400, "BadRequest", "kind/name of the body do not match the URL")
                old = fake.objects.get(key)
                fake.applied.append(key)
                if old is None:
                    obj = {**body, "metadata": {**body["metadata"], "generation": 1, "uid": f"uid-{name}",
                                                "managedFields": [{"manager": q["fieldManager"][0],
                                                                   "operation": "Apply"}]}}
                    fake.objects[key] = obj
                    code = 201
                    if kind == "TestRun":
                        obj["status"] = {"stage": "initialization"}
                        fake.stages[name] = ["initialization"]
                        fake.start_testrun(ns, name)
                else:
                    obj, code = old, 200
                    spec = body.get("spec", body.get("data"))
                    field = "spec" if "spec" in body else "data"
                    if old.get(field) != spec:
                        old[field] = spec
                        old["metadata"]["generation"] += 1
                    old["metadata"]["labels"] = body["metadata"].get("labels", {})
                fake.reconcile()
                return self._send(code, _public(obj))

        def do_DELETE(self):
            r = self._route()
            fake.calls.append(("DELETE", self.path, ""))
            if r is None:
                return self._status(404, "NotFound", f"the fake has no route for {self.path}")
            kind, _, ns, name, _ = r
            if (code := fake.fail.get(("DELETE", kind))) is not None:
                return self._status(code, "InternalError", f"the fake fails every DELETE of a {kind}")
            with fake.lock:
                obj = fake.objects.pop((kind, ns, name), None)
                if obj is None:
                    return self._status(404, "NotFound", f'{kind.lower()}s "{name}" not found')
                fake.deleted.append((kind, ns, name))
                if kind == "TestRun" and fake.linger_gets > 0:
                    gone = {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": "2026-12-06T00:00:00Z"}}
                    fake.lingering[(kind, ns, name)] = [gone, fake.linger_gets]
                if kind == "Deployment":
                    for key in [k for k, p in fake.pods.items() if k[0] == ns and p["_owner"] == name]:
                        del fake.pods[key]
                if kind == "TestRun":  # its Jobs, and their pods, are garbage-collected with it
                    for key in [k for k, p in fake.pods.items() if k[0] == ns and p.get("_testrun") == name]:
                        del fake.pods[key]
                return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    return H


class FakeApiServer:
    """``with FakeApiServer(nodes) as srv: srv.api_client()`` - a kubernetes ApiClient pointed at the fake."""

    def __init__(self, nodes: list[str], **kw: Any):
        self.cluster = FakeCluster(nodes, **kw)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.cluster))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def api_client(self):
        from kubernetes import client

        conf = client.Configuration()
        conf.host = self.url
        return client.ApiClient(conf)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
