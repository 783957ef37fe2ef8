"""One load phase sent by a k6-operator ``TestRun`` on the run's Kubernetes cluster (``KubeLoad``), in place of the
controller's k6 or the ssh load generators (opt-in: ``rollout.kubernetes.k6_operator.parallelism`` > 0).

For each phase (``KubeLoad.run_split``, the same call as ``loadgen.run_split``):

1. everything is rendered and checked before the first API call: the ConfigMap (run.js, its library, the plan; at most
   1 MiB), the TestRun (against the operator's CRD schema), and that each runner's share fits its log;
2. the ConfigMap and the TestRun are applied (server-side apply, like the engine's objects);
3. the TestRun's ``status.stage`` is polled until ``finished`` or ``error``, within the operator's start budget plus
   the phase's own (``K6OperatorSpec.start_timeout_s`` + the k6 budget the runner computed);
4. every runner pod's exit code is read (0, or 99: a threshold crossed, a verdict) and its log is read back through
   the pods/log API, bounded, and parsed as hostile input (``k6_operator.parse_runner_log``) into the files the
   existing merge reads (``runner._merge_generators``), the generator named by its pod;
5. whatever happened, the TestRun (the operator's Jobs and pods are its children: deleted with it, in the foreground)
   and the ConfigMap are deleted.

k6_operator's docstring says what was read from the operator's source, and why no barrier time is set.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploybench.config import K6OperatorSpec
from deploybench.errors import ConfigError
from deploybench.load import k6_operator as op
from deploybench.load.loadgen import EXIT_OK, EXIT_THRESHOLDS, GeneratorOutput

LOG = logging.getLogger(__name__)

FIELD_MANAGER = "deploybench"
POLL_S = 1.0
API_TIMEOUT_S = 30  # one API request
# a TestRun deleted in the foreground stays (deletionTimestamp set) until its runner Jobs and pods are gone: the next
# attempt of the phase applies the same name only once it is (timeouts.TESTRUN_OVERHEAD_S counts this wait)
DELETE_WAIT_S = 45.0
READ_CHUNK = 1 << 20


@dataclass
class KubeLoad:
    """Where the runners run: the run's Kubernetes API clients (``KubeClients`` with ``custom``, the custom objects
    API), its namespace, the operator's settings and the run's key (the objects' label and names)."""

    kube: Any
    namespace: str
    spec: K6OperatorSpec
    run_key: str | None = None
    poll_s: float = POLL_S
    applied: list[str] = field(default_factory=list)  # "<kind>/<name>" of the last phase, for the log

    def __post_init__(self) -> None:
        if getattr(self.kube, "custom", None) is None:
            raise ConfigError("rollout.kubernetes.k6_operator.parallelism > 0 needs the Kubernetes custom objects API "
                              "(the run's Kubernetes connection: rollout.kubernetes.conn_id)")

    @property
    def names(self) -> list[str]:
        """The runners' Job names (``<testrun>-<i>``) of a phase, for the checks that only ask how many there are."""
        return [f"runner-{i}" for i in range(1, self.spec.parallelism + 1)]

    # -- API helpers ------------------------------------------------------------------------------------------------
    @staticmethod
    def _json(resp: Any) -> dict[str, Any]:
        data = resp.data if hasattr(resp, "data") else resp
        return json.loads(data) if data else {}

    def _labels(self, name: str) -> dict[str, str]:
        from deploybench.rollout import manifests

        out = {"app.kubernetes.io/name": "deploybench-k6", "app.kubernetes.io/managed-by": "deploybench",
               "app.kubernetes.io/instance": name}
        if self.run_key:
            out[manifests.RUN] = manifests.run_label(self.run_key)
        return out

    def _apply(self, cm: dict[str, Any], tr: dict[str, Any]) -> None:
        self.kube.core.patch_namespaced_config_map(
            cm["metadata"]["name"], self.namespace, cm, field_manager=FIELD_MANAGER, force=True,
            _content_type="application/apply-patch+yaml", _preload_content=False, _request_timeout=API_TIMEOUT_S)
        self.applied.append(f"configmap/{cm['metadata']['name']}")
        self.kube.custom.patch_namespaced_custom_object(
            op.GROUP, op.VERSION, self.namespace, op.PLURAL, tr["metadata"]["name"], tr, field_manager=FIELD_MANAGER,
            force=True, _content_type="application/apply-patch+yaml", _preload_content=False,
            _request_timeout=API_TIMEOUT_S)
        self.applied.append(f"testrun/{tr['metadata']['name']}")
        LOG.info("k6-operator: applied ConfigMap and TestRun %s/%s (parallelism %d)", self.namespace,
                 tr["metadata"]["name"], tr["spec"]["parallelism"])

    def _stage(self, name: str) -> tuple[str, dict[str, Any]]:
        got = self._json(self.kube.custom.get_namespaced_custom_object(
            op.GROUP, op.VERSION, self.namespace, op.PLURAL, name, _preload_content=False,
            _request_timeout=API_TIMEOUT_S))
        status = _dict(got.get("status"))
        stage = status.get("stage", "")
        return (stage if isinstance(stage, str) else repr(stage)[:40]), status

    def _runner_pods(self, name: str) -> list[dict[str, Any]]:
        # the labels runner.go gives every runner pod (newLabels + runner=true)
        resp = self.kube.core.list_namespaced_pod(self.namespace, label_selector=f"app=k6,k6_cr={name},runner=true",
                                                  _preload_content=False, _request_timeout=API_TIMEOUT_S)
        items = self._json(resp).get("items", [])
        return [p for p in items if isinstance(p, dict)] if isinstance(items, list) else []

    def _delete(self, name: str) -> list[str]:
        """Delete the phase's TestRun (its Jobs and pods go with it) and ConfigMap; what could not be deleted."""
        left = []
        for what, call in (
            ("testrun", lambda: self.kube.custom.delete_namespaced_custom_object(
                op.GROUP, op.VERSION, self.namespace, op.PLURAL, name, propagation_policy="Foreground",
                _preload_content=False, _request_timeout=API_TIMEOUT_S)),
            ("configmap", lambda: self.kube.core.delete_namespaced_config_map(
                name, self.namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S)),
        ):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - ApiException (404: already gone) or a connection error
                if getattr(exc, "status", None) != 404:
                    left.append(f"{what}/{name}: {exc}")
                    continue
            if what == "testrun" and (why := self._wait_gone(name)) is not None:
                left.append(why)
        LOG.info("k6-operator: deleted TestRun and ConfigMap %s/%s%s", self.namespace, name,
                 f" except {left}" if left else "")
        return left

    def _exists(self, name: str) -> bool:
        try:
            self.kube.custom.get_namespaced_custom_object(op.GROUP, op.VERSION, self.namespace, op.PLURAL, name,
                                                          _preload_content=False, _request_timeout=API_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - ApiException: 404 is the answer sought, others go up
            if getattr(exc, "status", None) == 404:
                return False
            raise
        return True

    def _wait_gone(self, name: str, bound_s: float = DELETE_WAIT_S) -> str | None:
        """Wait (at most ``bound_s``) until the deleted TestRun ``name`` answers 404; None, else why not."""
        deadline = time.monotonic() + bound_s
        while True:
            try:
                if not self._exists(name):
                    return None
            except Exception as exc:  # noqa: BLE001 - a connection error: said, not hidden
                return f"testrun/{name}: could not check that it is gone: {exc}"
            if time.monotonic() > deadline:
                return (f"testrun/{name}: still there {bound_s:g} s after its deletion (foreground: its runner Jobs "
                        "and pods go first)")
            time.sleep(self.poll_s)

    def _clear(self, name: str) -> None:
        """A TestRun of this name left by an earlier attempt of the phase (a killed task): deleted and waited for
        (bounded) before this attempt applies its own onto the same name."""
        if not self._exists(name):
            return
        LOG.warning("k6-operator: TestRun %s/%s of an earlier attempt is still there; deleting it first",
                    self.namespace, name)
        if left := self._delete(name):
            raise op.OperatorRunFailed(f"k6-operator: the TestRun of an earlier attempt is in the way: "
                                       f"{'; '.join(left)}; delete it by hand, then retry")

    def _read_log(self, pod: str) -> bytes:
        """The runner pod's whole log, at most ``log_max_bytes`` + 1 bytes (asked of the server as limitBytes, and
        counted here: a server is not trusted to keep to it)."""
        limit = self.spec.log_max_bytes + 1
        resp = self.kube.core.read_namespaced_pod_log(pod, self.namespace, container="k6", limit_bytes=limit,
                                                      _preload_content=False, _request_timeout=API_TIMEOUT_S)
        got = bytearray()
        try:
            while len(got) < limit:
                chunk = resp.read(min(READ_CHUNK, limit - len(got)))
                if not chunk:
                    break
                got += chunk
        finally:
            resp.release_conn()
        return bytes(got)

    # -- one phase --------------------------------------------------------------------------------------------------
    def run_split(self, env: Mapping[str, str], *, stem: str, out_dir: Path, plan: Path, timeout_s: float,
                  n_endpoints: int = 1) -> list[GeneratorOutput]:
        """Run one phase as a TestRun; each runner's outputs land in ``out_dir`` as ``<stem>.<pod>.k6.*``.
        OperatorRunFailed names the runner (or the stage) that failed; the TestRun and ConfigMap are deleted
        whatever happens."""
        n = self.spec.parallelism
        if not op.same_segments(n):  # the operator's split must be the one the merge assumes
            raise ConfigError(f"k6-operator: the execution segments for {n} runners differ from loadgen.segments({n})")
        name = op.testrun_name(self.run_key, stem)
        labels = self._labels(name)
        op.log_budget(_requests_of(env), self.spec)
        cm = op.config_map(name, self.namespace, labels, op.config_map_files(plan))
        tr = op.test_run(name, self.namespace, labels, self.spec, op.runner_env(env, n))
        op.validate_test_run(tr)
        from deploybench.rollout import manifests

        manifests.validate(cm)  # the official Kubernetes schema, like the engine's objects
        self.applied = []
        failure: BaseException | None = None
        self._clear(name)
        try:
            self._apply(cm, tr)
            pods = self._wait(name, self.spec.start_timeout_s + timeout_s)
            return self._collect(name, pods, out_dir, stem)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            left = self._delete(name)
            if left and failure is None:
                raise op.OperatorRunFailed(f"k6-operator: the phase ran, but deleting its objects failed: "
                                           f"{'; '.join(left)}; delete them by hand (label {manifests.RUN})")
            if left:
                LOG.error("k6-operator: could not delete %s after the phase failed", "; ".join(left))

    def _wait(self, name: str, budget_s: float) -> list[dict[str, Any]]:
        """Poll the TestRun until ``finished`` (every runner pod, checked) or ``error`` (fails, naming the runners
        that failed, else the stage), at most ``budget_s``."""
        deadline = time.monotonic() + budget_s
        stage = ""
        while True:
            stage, status = self._stage(name)
            if stage == "finished":
                pods = self._runner_pods(name)
                self._check_runners(name, pods, stage)
                return pods
            if stage == "error":
                pods = self._runner_pods(name)
                self._check_runners(name, pods, stage)  # names a failed runner when there is one
                conds = "; ".join(f"{c.get('type')}={c.get('status')} {c.get('reason', '')}".strip()
                                  for c in status.get("conditions") or [] if isinstance(c, dict))[:500]
                raise op.OperatorRunFailed(f"k6-operator: TestRun {self.namespace}/{name} is in stage 'error' "
                                           f"({conds or 'no conditions'}); no runner pod failed, so the operator "
                                           "refused the TestRun itself (see its events)")
            if time.monotonic() > deadline:
                pods = self._runner_pods(name)
                where = ", ".join(f"{_pod_name(p)} {_pod_phase(p)}" for p in pods) or "no runner pods"
                raise op.OperatorRunFailed(f"k6-operator: TestRun {self.namespace}/{name} did not finish within "
                                           f"{budget_s:.0f} s (stage {stage or 'none yet'!r}; {where}); raise "
                                           "rollout.kubernetes.k6_operator.start_timeout_s if its pods start slowly")
            time.sleep(self.poll_s)

    def _check_runners(self, name: str, pods: list[dict[str, Any]], stage: str) -> None:
        """Each of the N runners has one pod that ended with 0 or 99; else fail naming the runner."""
        n = self.spec.parallelism
        by_index: dict[int, dict[str, Any]] = {}
        for p in pods:
            index = _runner_index(p, name)
            if index is None or not 1 <= index <= n or index in by_index:
                raise op.OperatorRunFailed(f"k6-operator: TestRun {name} (stage {stage}): runner pod {_pod_name(p)!r} "
                                           f"is not one of runners 1..{n} (job-name "
                                           f"{_labels(p).get('job-name')!r}), or a second pod of one")
            by_index[index] = p
        for i in range(1, n + 1):
            pod = by_index.get(i)
            code = _exit_code(pod) if pod else None
            if pod is not None and code in (EXIT_OK, EXIT_THRESHOLDS):
                continue
            if stage != "finished" and (pod is None or code is None):
                continue  # stage error, this runner without a pod or still running: another one failed, or none
            what = ("has no pod" if pod is None else f"pod {_pod_name(pod)} ended without an exit code "
                    f"({_pod_phase(pod)})" if code is None else f"pod {_pod_name(pod)}: k6 exited with code {code}")
            tail = self._tail(_pod_name(pod)) if pod is not None else ""
            raise op.OperatorRunFailed(f"k6-operator runner {i} of {n} ({name}-{i}, segment "
                                       f"{op.runner_segment(i, n)}) failed, TestRun stage {stage!r}: {what}"
                                       + (f"; last lines of its log:\n{tail}" if tail else ""))

    def _tail(self, pod: str, lines: int = 15) -> str:
        try:
            resp = self.kube.core.read_namespaced_pod_log(pod, self.namespace, container="k6", tail_lines=lines,
                                                          limit_bytes=8192, _preload_content=False,
                                                          _request_timeout=API_TIMEOUT_S)
            return resp.data[:8192].decode(errors="replace").strip()
        except Exception as exc:  # noqa: BLE001 - ApiException or a connection error: the failure is named anyway
            return f"(log unavailable: {exc})"

    def _collect(self, name: str, pods: list[dict[str, Any]], out_dir: Path, stem: str) -> list[GeneratorOutput]:
        n = self.spec.parallelism
        outputs = []
        for p in sorted(pods, key=lambda p: _runner_index(p, name) or 0):
            index, pod = _runner_index(p, name) or 0, _pod_name(p)
            base = out_dir / f"{stem}.{pod}"
            json_out, summary_out, log_out, count = op.parse_runner_log(self._read_log(pod), f"{index} ({pod})", base,
                                                                        self.spec.log_max_bytes)
            LOG.info("k6-operator runner %d (%s): %d request samples", index, pod, count)
            outputs.append(GeneratorOutput(
                name=pod, segment=op.runner_segment(index, n), rc=_exit_code(p) or 0, cpu_s=None, offset_ms=None,
                rtt_ms=None, json_out=json_out, summary_out=summary_out, log_out=log_out))
        return outputs


def _requests_of(env: Mapping[str, str]) -> int:
    """Requests the phase sends: a timed plan's own count (DB_PLANNED), else rate x (warm-up + duration), or along
    its stages."""
    try:
        if env.get("DB_PLAN_TIMED") == "true":
            return int(env.get("DB_PLANNED", "0"))
        rate = float(env.get("DB_RATE", "0"))
        stages = json.loads(env.get("DB_STAGES", "[]") or "[]")
        warm, dur = float(env.get("DB_WARMUP_S", "0")), float(env.get("DB_DURATION_S", "0"))
    except ValueError as exc:
        raise ConfigError(f"k6-operator: the phase's DB_RATE/DB_STAGES/DB_*_S are not numbers ({exc})") from exc
    if stages:
        total, frm = rate * warm, rate
        for target, secs in stages:
            total += (frm + float(target)) / 2 * float(secs)
            frm = float(target)
        return int(total) + 1
    return int(rate * (warm + dur)) + 1


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _labels(p: dict[str, Any]) -> dict[str, Any]:
    return _dict(_dict(p.get("metadata")).get("labels"))


def _pod_name(p: dict[str, Any]) -> str:
    name = _dict(p.get("metadata")).get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", name):
        raise op.OperatorRunFailed(f"k6-operator: a runner pod's name {str(name)[:80]!r} is not a Kubernetes name")
    return name


def _runner_index(p: dict[str, Any], testrun: str) -> int | None:
    """The runner's index from its Job's name (``<testrun>-<i>``, runner.go), which the Job controller puts on its
    pods as the ``job-name`` label."""
    m = re.fullmatch(re.escape(testrun) + r"-([0-9]{1,4})", str(_labels(p).get("job-name", "")))
    return int(m.group(1)) if m else None


def _pod_phase(p: dict[str, Any]) -> str:
    return str(_dict(p.get("status")).get("phase", "unknown"))[:40]


def _exit_code(p: dict[str, Any] | None) -> int | None:
    """The k6 container's exit code, when it terminated (the container is named "k6": runner.go)."""
    statuses = _dict(_dict(p).get("status")).get("containerStatuses")
    for cs in statuses if isinstance(statuses, list) else []:
        if isinstance(cs, dict) and cs.get("name") == "k6":
            code = _dict(_dict(cs.get("state")).get("terminated")).get("exitCode")
            return code if isinstance(code, int) and not isinstance(code, bool) else None
    return None
