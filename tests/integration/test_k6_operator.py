"""A load phase as a k6-operator TestRun (issue 31), end to end against a FAKE Kubernetes API server.

Kubernetes cannot run here (no API server, no k6-operator). tests/support/k8s_api.py is a small local FAKE of the API
calls deploybench makes (it is not Kubernetes): it records the applied ConfigMap and TestRun, moves the TestRun's
``status.stage`` from created to started to finished, and serves its runner pods and their logs. What the runner
pods print is REAL: the fake hands the TestRun and the ConfigMap deploybench applied to tests/support/k6_runners.py,
which runs real k6 once per runner with the arguments the operator would give it (its execution segments, the
TestRun's ``arguments``, ``--paused``, resumed by a stand-in of its starter) against simulated engines on 127.0.0.1;
their output becomes the pods' logs. Every wait is bounded (run_load's budget, the fake's hook, k6_runners' own)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pandas as pd
import pytest

from deploybench.config import SLO, K6OperatorSpec, LoadSpec
from deploybench.load import k6_operator as op
from deploybench.load import load_samples, loadgen, run_load
from deploybench.load.kube_load import KubeLoad
from deploybench.load.samples import read_k6_json
from deploybench.rollout.kubernetes import KubeClients
from tests.support.k6_runners import run_testrun
from tests.support.k8s_api import FakeApiServer

pytestmark = pytest.mark.integration

NS = "deploybench"
N = 3
SLO_ = SLO(p99_latency_ms=5000, max_error_rate=0.01)


def _spec(workload: str, rate: float = 20.0) -> LoadSpec:
    # short answers: the simulated engine answers in tens of ms, the phase lasts seconds
    return LoadSpec(rate=rate, duration_s=6, warmup_s=1, workload=workload, output_tokens=8, prompt_tokens=64,
                    ttft_sample_rps=0, scrape_interval_s=0)


def _real_runners(tmp: Path):
    def hook(tr: dict, cm: dict | None) -> tuple[str, list[tuple[int, int, bytes]]]:
        assert cm is not None, "the TestRun was applied before its ConfigMap"
        runs = run_testrun(tr, cm, tmp / tr["metadata"]["name"], timeout_s=120)
        return "finished", [(r.index, r.exit_code, r.log) for r in runs]
    return hook


def _nothing_left(fake) -> None:
    kinds = {(k, name) for (k, _, name) in fake.objects}
    assert not [k for k in kinds if k[0] in ("TestRun", "ConfigMap")], kinds
    assert not [p for p in fake.pods.values() if p.get("_testrun")], "runner pods left behind"
    assert {k for (k, _, _) in fake.deleted} >= {"TestRun", "ConfigMap"}


@pytest.mark.parametrize("workload", ["shared-prefix", "synthetic"])  # timed (Poisson), and constant
def test_a_testrun_of_three_runners_sends_the_plan_once_and_merges_into_one_phase(local_engines, tmp_path, workload):
    eps = local_engines.start(2)
    spec = _spec(workload)
    with FakeApiServer(["k1", "k2"]) as srv:
        fake = srv.cluster
        fake.testrun_hook = _real_runners(tmp_path / "runners")
        kube = KubeClients.from_api_client(srv.api_client())
        gens = KubeLoad(kube, NS, K6OperatorSpec(parallelism=N, start_timeout_s=60), run_key="run-k6op", poll_s=0.2)
        out = tmp_path / "load"
        res = run_load(eps, spec, SLO_, out, phase="sustained", generators=gens)
        assert not fake.hook_errors

        name = op.testrun_name("run-k6op", "sustained")
        # the stages the TestRun went through, as deploybench polled them: it read 'finished' last
        assert fake.stages[name][:1] == ["initialization"] and fake.stages[name][-1] == "finished"
        assert fake.stages[name].index("created") < fake.stages[name].index("started")
        # what was applied: the ConfigMap first, then the TestRun; both deleted after the phase, pods with them
        applied = [(k, n) for (k, _, n) in fake.applied]
        assert applied == [("ConfigMap", name), ("TestRun", name)]
        _nothing_left(fake)

    plan = json.loads((out / "sustained.plan.json").read_text())
    timed = plan["timed"]
    expected = len(plan["requests"]) if timed else int(spec.rate * (spec.warmup_s + spec.duration_s))
    # each runner's own samples, as read back from its pod's log: every plan row (k6 iteration) exactly once
    pods = sorted(g.name for g in res.generators)
    assert len(pods) == N and all(p.startswith(f"{name}-") for p in pods)
    iterations = []
    for pod in pods:
        df, _ = read_k6_json(out / f"sustained.{pod}.k6.json")
        assert len(df) > 0, pod
        iterations += [int(i) for i in df["iteration"]]
    if timed:  # the plan's rows, each sent once
        assert sorted(iterations) == list(range(expected)), (len(iterations), expected)
    else:  # the arrival-rate executor's iterations, each once; k6 starts one more on the test's very end
        assert sorted(iterations) == list(range(len(iterations))) and expected <= len(iterations) <= expected + 1
        expected = len(iterations)
    # the merged phase: N generators, each with the operator's segment, the clock offset absent (not measured)
    assert [g.segment for g in sorted(res.generators, key=lambda g: g.segment)] == sorted(loadgen.segments(N)[0])
    assert all(g.clock_offset_ms is None and g.k6_exit_code in (0, 99) for g in res.generators)
    # the merge's generator column, as the figures per generator count it: N values, each a share of the window
    assert sum(g.requests for g in res.generators) == res.requests
    assert all(g.requests > 0 and g.lag_p99_ms is not None for g in res.generators)
    samples = pd.concat([load_samples(res.samples_path), load_samples(res.warmup_samples_path)])
    # what the merged phase counts: every request the runners sent, in the warm-up, the window, or at its very end
    assert len(samples) <= expected and res.requests + res.warmup_excluded == len(samples)
    assert len(samples) >= expected - N  # at most the one request each runner starts on the window's end
    assert any("split across 3 load generators" in n for n in res.notes)
    assert res.error_rate == 0.0
    summary = json.loads(Path(res.summary_path).read_text())
    assert summary["metrics"][op.SAMPLE_METRIC]["count"] == expected  # the runners' own counts, summed
    assert sorted(summary["generators"]) == pods


def test_a_runner_that_fails_fails_the_phase_naming_it_and_the_objects_are_deleted(local_engines, tmp_path):
    """The stand-in operator reports the stage 'error' and runner 2's pod ended with k6's script error (107)."""
    eps = local_engines.start(1)
    with FakeApiServer(["k1"]) as srv:
        fake = srv.cluster
        fake.testrun_hook = lambda tr, cm: ("error", [(1, 0, b""), (2, 107, b"level=error msg=\"ReferenceError\"\n"),
                                                      (3, 0, b"")])
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS, K6OperatorSpec(parallelism=N),
                        run_key="run-k6op-fail", poll_s=0.1)
        with pytest.raises(op.OperatorRunFailed) as err:
            run_load(eps, _spec("synthetic"), SLO_, tmp_path / "load", phase="sustained", generators=gens)
        msg = str(err.value)
        name = op.testrun_name("run-k6op-fail", "sustained")
        assert f"runner 2 of 3 ({name}-2, segment 1/3:2/3)" in msg and "exited with code 107" in msg, msg
        assert "stage 'error'" in msg and "ReferenceError" in msg, msg
        _nothing_left(fake)


def test_a_testrun_the_operator_puts_in_error_with_no_runner_failed_fails_naming_the_stage(tmp_path):
    with FakeApiServer(["k1"]) as srv:
        fake = srv.cluster
        fake.testrun_hook = lambda tr, cm: ("error", [])  # the runners never ended: the operator gave up on it
        plan = tmp_path / "p.plan.json"
        plan.write_text('{"requests": []}')
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS, K6OperatorSpec(parallelism=2),
                        run_key="run-error", poll_s=0.1)
        env = {"DB_RATE": "1.0", "DB_WARMUP_S": "0.0", "DB_DURATION_S": "1.0", "DB_STAGES": "[]", "DB_PLAN": "x"}
        with pytest.raises(op.OperatorRunFailed, match=r"TestRun deploybench/dbk6-.*-sustained is in stage 'error' "
                                                       r".*no runner pod failed"):
            gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=5.0)
        _nothing_left(fake)


def test_a_testrun_that_never_finishes_fails_within_its_budget_and_is_deleted(tmp_path):
    release = threading.Event()
    with FakeApiServer(["k1"]) as srv:
        fake = srv.cluster

        def stuck(tr: dict, cm: dict | None) -> tuple[str, list]:
            release.wait(30)  # bounded: released below
            return "finished", []
        fake.testrun_hook = stuck
        plan = tmp_path / "p.plan.json"
        plan.write_text('{"requests": []}')
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS,
                        K6OperatorSpec(parallelism=2, start_timeout_s=0.5), run_key="run-stuck", poll_s=0.1)
        env = {"DB_RATE": "1.0", "DB_WARMUP_S": "0.0", "DB_DURATION_S": "1.0", "DB_STAGES": "[]", "DB_PLAN": "x"}
        try:
            with pytest.raises(op.OperatorRunFailed, match=r"did not finish within 2 s \(stage 'started'"):
                gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=1.0)
            _nothing_left(fake)
        finally:
            release.set()


def test_a_retry_applies_its_testrun_only_once_the_earlier_one_is_gone(tmp_path):
    """Foreground deletion keeps a TestRun until its Jobs are gone: run_split waits (bounded) for 404 after deleting
    it, and a TestRun of the same name left by a killed attempt is deleted and waited for before the next apply."""
    with FakeApiServer(["k1"]) as srv:
        fake = srv.cluster
        fake.linger_gets = 3
        fake.testrun_hook = lambda tr, cm: ("error", [])
        plan = tmp_path / "p.plan.json"
        plan.write_text('{"requests": []}')
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS, K6OperatorSpec(parallelism=2),
                        run_key="run-retry", poll_s=0.05)
        env = {"DB_RATE": "1.0", "DB_WARMUP_S": "0.0", "DB_DURATION_S": "1.0", "DB_STAGES": "[]", "DB_PLAN": "x"}
        name = op.testrun_name("run-retry", "sustained")
        with pytest.raises(op.OperatorRunFailed, match="stage 'error'"):
            gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=1.0)
        assert not fake.lingering  # it returned once the TestRun answered 404
        # a killed attempt's TestRun is still there: the next attempt deletes it, waits, then applies its own
        fake.objects[("TestRun", NS, name)] = {"apiVersion": "k6.io/v1alpha1", "kind": "TestRun",
                                               "metadata": {"name": name, "namespace": NS}, "spec": {}}
        fake.calls.clear()
        with pytest.raises(op.OperatorRunFailed, match="stage 'error'"):
            gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=1.0)
        calls = [(m, path.split("?")[0].rsplit("/", 2)[-2]) for m, path, _ in fake.calls
                 if "/testruns/" in path and m in ("DELETE", "PATCH")]
        assert calls[:2] == [("DELETE", "testruns"), ("PATCH", "testruns")], calls
        first_patch = next(i for i, (m, path, _) in enumerate(fake.calls) if m == "PATCH" and "/testruns/" in path)
        gets = [c for c in fake.calls[:first_patch] if c[0] == "GET" and "/testruns/" in c[1]]
        assert len(gets) >= 1 + 3  # the look for a leftover, then until it answered 404
        _nothing_left(fake)


# -- a runner's log is hostile input --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_logs(tmp_path_factory, sim_model_dir) -> list[bytes]:
    """Three runners' real logs (one short phase against one simulated engine), kept for the cases below."""
    from deploybench.sim.local import LocalEngines

    tmp = tmp_path_factory.mktemp("k6op-logs")
    got: list[bytes] = []
    with LocalEngines(sim_model_dir, tmp) as eng, FakeApiServer(["k1"]) as srv:
        eps = eng.start(1)

        def hook(tr: dict, cm: dict | None) -> tuple[str, list]:
            runs = run_testrun(tr, cm or {}, tmp / "runners", timeout_s=120)
            got.extend(r.log for r in runs)
            return "finished", [(r.index, r.exit_code, r.log) for r in runs]
        srv.cluster.testrun_hook = hook
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS, K6OperatorSpec(parallelism=N),
                        run_key="run-logs", poll_s=0.2)
        run_load(eps, _spec("synthetic", rate=10), SLO_, tmp / "load", phase="sustained", generators=gens)
    assert len(got) == N
    return got


def _cut(log: bytes) -> bytes:
    lines = log.split(b"\n")
    points = [i for i, line in enumerate(lines) if b'"metric":"db_request","type":"Point"' in line]
    return b"\n".join(lines[points[len(points) // 2]:])  # the head rotated away: half its requests gone


def _forge(log: bytes) -> bytes:
    """One request sample whose tags are not what k6 writes (a list), the line still JSON."""
    lines = log.split(b"\n")
    i = next(i for i, line in enumerate(lines) if b'"metric":"db_request","type":"Point"' in line)
    lines[i] = lines[i].replace(b'"tags":{', b'"tags":["node"],"was":{', 1)
    json.loads(lines[i])
    return b"\n".join(lines)


CASES = {
    "cut": (_cut, r"runner 2 \(.*\): its log holds \d+ request samples but its own summary counts \d+: the log "
                  r"was cut"),
    "not UTF-8": (lambda log: log[:5000] + b"\xff\xfe" + log[5000:], r"runner 2 \(.*\): its log is not UTF-8"),
    "no summary": (lambda log: log[:log.rindex(b"\n{\n")], r"runner 2 \(.*\): its log has no complete summary export"),
    "oversized": (lambda log: log + b"x" * (1 << 20), r"runner 2 \(.*\): its log holds more than 1,048,576 bytes"),
    "a forged sample": (lambda log: _forge(log), r"runner 2 \(.*\): .*cannot read k6's JSON output"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_garbled_oversized_or_cut_runner_log_is_refused_naming_the_runner(real_logs, tmp_path, case):
    spoil, message = CASES[case]
    logs = list(real_logs)
    logs[1] = spoil(logs[1])
    with FakeApiServer(["k1"]) as srv:
        fake = srv.cluster
        fake.testrun_hook = lambda tr, cm: ("finished", [(i + 1, 0, log) for i, log in enumerate(logs)])
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS,
                        K6OperatorSpec(parallelism=N, log_max_bytes=1 << 20), run_key="run-bad", poll_s=0.1)
        plan = tmp_path / "p.plan.json"
        plan.write_text('{"requests": []}')
        env = {"DB_RATE": "10.0", "DB_WARMUP_S": "1.0", "DB_DURATION_S": "6.0", "DB_STAGES": "[]", "DB_PLAN": "x"}
        with pytest.raises(op.OperatorRunFailed, match=message):
            gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=5.0)
        _nothing_left(fake)
    # the same logs unspoilt are read back whole (the case above fails because of what was done to it)
    with FakeApiServer(["k1"]) as srv:
        srv.cluster.testrun_hook = lambda tr, cm: ("finished", [(i + 1, 0, log) for i, log in enumerate(real_logs)])
        gens = KubeLoad(KubeClients.from_api_client(srv.api_client()), NS,
                        K6OperatorSpec(parallelism=N, log_max_bytes=1 << 20), run_key="run-bad", poll_s=0.1)
        outs = gens.run_split(env, stem="sustained", out_dir=tmp_path, plan=plan, timeout_s=5.0)
        assert len(outs) == N
