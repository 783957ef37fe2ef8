"""The k6-operator TestRun's pure pieces: manifests checked against the operator's own CRD schema (vendored from
grafana/k6-operator, rollout/schemas/README.md), its execution segments against deploybench's, the ConfigMap's size,
a runner's log. Kubernetes and the operator cannot run here: nothing is applied in these tests (see
tests/integration/test_k6_operator.py for the driver against a fake API server)."""

from __future__ import annotations

import copy
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from deploybench.config import K6_RUNNER_IMAGE, K6OperatorSpec, RunConfig
from deploybench.errors import ConfigError
from deploybench.load import k6_operator as op
from deploybench.load import loadgen
from deploybench.paths import k6_dir
from deploybench.rollout import manifests

ROOT = Path(__file__).resolve().parents[3]
ENV = {"DB_RATE": "20.0", "DB_PLAN": "/runs/x/load/sustained.plan.json", "DB_START_AT_MS": "1796598519964",
       "DB_ENDPOINTS": '[{"node": "n1", "url": "http://10.0.0.1:8000", "model": "m"}]', "DB_PHASE": "sustained"}


def _plan(tmp_path: Path, size: int = 1000) -> Path:
    p = tmp_path / "sustained.plan.json"
    p.write_text(json.dumps({"requests": [[0, 1, 2]], "pad": "x" * size}))
    return p


def _testrun(n: int = 3, **spec_kw) -> dict:
    spec = K6OperatorSpec(parallelism=n, **spec_kw)
    return op.test_run(op.testrun_name("run-1", "sustained"), "deploybench", {"deploybench/run": "run-1"}, spec,
                       op.runner_env(ENV, n))


# -- segments -------------------------------------------------------------------------------------------------------
def test_the_operators_segments_are_deploybenchs_for_any_parallelism():
    """pkg/segmentation/segmentation.go NewCommandFragments, mirrored: runner 3 of 4 gets "2/4:3/4" (not reduced),
    which is loadgen.segments(4)'s "1/2:3/4" as rationals; so the ssh generators' merge fits the runners'."""
    assert op.operator_segments(3, 4) == ["--execution-segment=2/4:3/4",
                                          "--execution-segment-sequence=0,1/4,2/4,3/4,1"]
    assert op.operator_segments(1, 4)[0] == "--execution-segment=0:1/4"
    assert op.operator_segments(4, 4)[0] == "--execution-segment=3/4:1"
    assert op.operator_segments(1, 1) == []  # runner.go: no segment arguments for one runner
    assert loadgen.segments(4)[0][2] == "1/2:3/4"  # deploybench reduces: only the rationals agree
    for n in range(1, 17):
        assert op.same_segments(n), n
        total = sum((Fraction(b) - Fraction(a) for a, b in (s.split(":") for s in loadgen.segments(n)[0])),
                    Fraction(0))
        assert total == 1
    with pytest.raises(ConfigError, match="runner index 5 is outside 1..4"):
        op.operator_segments(5, 4)


# -- the TestRun against the CRD schema -----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3, 16])
def test_every_rendered_testrun_validates_against_the_operators_crd_schema(n):
    tr = _testrun(n)
    op.validate_test_run(tr)
    spec = tr["spec"]
    assert spec["parallelism"] == n and spec["separate"] is False
    assert spec["script"] == {"configMap": {"name": tr["metadata"]["name"], "file": "run.js"}}
    assert spec["arguments"].split() == ["--no-color", "--out", "json=-", "--summary-export=/dev/stdout"]
    env = {e["name"]: e["value"] for e in spec["runner"]["env"]}
    # the phase's env, with the plan beside run.js, the runners counted, and no barrier time (the starter is one)
    assert env["DB_PLAN"] == "./plan.json" and env["DB_GENERATORS"] == str(n) and "DB_START_AT_MS" not in env
    assert env["DB_ENDPOINTS"] == ENV["DB_ENDPOINTS"] and env["K6_NO_USAGE_REPORT"] == "true"
    assert spec["runner"]["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"},
                                           "limits": {"cpu": "1", "memory": "1Gi"}}
    assert len(tr["metadata"]["name"]) + len("-service-16") <= 63


def test_the_runner_image_is_the_k6_of_the_controllers_wheel():
    pinned = re.search(r"^k6==([0-9.]+)$", (ROOT / "requirements.txt").read_text(), re.M)
    assert pinned and f"grafana/k6:{pinned.group(1)}" == K6_RUNNER_IMAGE
    assert _testrun()["spec"]["runner"]["image"] == K6_RUNNER_IMAGE


def _broken(path: str, value: object) -> dict:
    tr = copy.deepcopy(_testrun())
    node = tr
    *parents, last = path.split(".")
    for p in parents:
        node = node[p]
    node[last] = value
    return tr


@pytest.mark.parametrize("path, value, where", [
    ("spec.parallelism", "3", r"invalid at spec\.parallelism: '3' is not of type 'integer'"),
    ("spec.parallelism", 2 ** 31, r"invalid at spec\.parallelism: .* is greater than the maximum"),
    ("spec.paralellism", 3, r"invalid at spec: Additional properties are not allowed \('paralellism'"),
    ("spec.runner.imagee", "x", r"invalid at spec\.runner: Additional properties are not allowed \('imagee'"),
    ("spec.script.configMap.nam", "x", r"invalid at spec\.script\.configMap: Additional properties"),
    ("spec.cleanup", "always", r"invalid at spec\.cleanup: 'always' is not one of \['post'\]"),
    ("spec.separate", "false", r"invalid at spec\.separate: 'false' is not of type 'boolean'"),
    ("spec.runner.env", [{"value": "x"}], r"invalid at spec\.runner\.env\.0: 'name' is a required property"),
])
def test_a_broken_testrun_is_refused_naming_the_field(path, value, where):
    with pytest.raises(ConfigError, match=where):
        op.validate_test_run(_broken(path, value))


def test_a_testrun_without_its_script_or_of_another_kind_is_refused():
    tr = _testrun()
    del tr["spec"]["script"]
    with pytest.raises(ConfigError, match=r"invalid at spec: 'script' is a required property"):
        op.validate_test_run(tr)
    with pytest.raises(ConfigError, match="not a k6.io/v1alpha1 TestRun"):
        op.validate_test_run({**_testrun(), "apiVersion": "k6.io/v1"})
    with pytest.raises(ConfigError, match="parallelism=0"):
        _testrun(0)


def test_the_vendored_schema_names_its_source_and_commit():
    schema = json.loads(op.SCHEMA_FILE.read_text())
    readme = (op.SCHEMA_FILE.parent / "README.md").read_text()
    commit = "e2c9571ac480ad7ca8ed019062ff67847d76724e"
    assert commit in schema["$comment"] and commit in readme and "config/crd/bases/k6.io_testruns.yaml" in readme
    assert schema["properties"]["spec"]["required"] == ["parallelism", "script"]
    assert schema["properties"]["status"]["properties"]["stage"]["enum"] == [
        "initialization", "initialized", "created", "started", "stopped", "finished", "error"]


def test_the_opt_in_is_off_by_default_and_bounded():
    cfg = RunConfig.parse({"inventory": "x"})
    assert cfg.rollout.kubernetes.k6_operator.parallelism == 0
    with pytest.raises(ConfigError, match="parallelism"):
        RunConfig.parse({"inventory": "x", "rollout": {"kubernetes": {"k6_operator": {"parallelism": -1}}}})
    with pytest.raises(ConfigError, match="paralelism"):
        RunConfig.parse({"inventory": "x", "rollout": {"kubernetes": {"k6_operator": {"paralelism": 2}}}})


# -- the ConfigMap ---------------------------------------------------------------------------------------------------
def test_the_configmap_holds_run_js_its_library_flat_and_the_plan(tmp_path):
    files = op.config_map_files(_plan(tmp_path))
    libs = sorted(p.name for p in (k6_dir() / "lib").glob("*.js"))
    assert sorted(files) == sorted(["run.js", "plan.json", *libs])
    assert "./lib/" not in files["run.js"]
    for lib in libs:  # every import of the library now points beside run.js
        if f"./lib/{lib}" in (k6_dir() / "run.js").read_text():
            assert f"'./{lib}'" in files["run.js"] or f'"./{lib}"' in files["run.js"]
    cm = op.config_map("dbk6-x-sustained", "deploybench", {"a": "b"}, files)
    manifests.validate(cm)  # the official Kubernetes schema: keys are valid ConfigMap keys
    assert cm["data"]["plan.json"] == _plan(tmp_path).read_text()


def test_a_plan_too_large_for_a_configmap_is_refused_with_its_size_and_the_way_out(tmp_path):
    files = op.config_map_files(_plan(tmp_path, size=op.CONFIGMAP_MAX_BYTES))
    with pytest.raises(ConfigError) as err:
        op.config_map("dbk6-x-sustained", "deploybench", {}, files)
    msg = str(err.value)
    assert re.search(r"would hold 1,0[0-9]{2},[0-9]{3} bytes .*more than the 1,048,576 bytes", msg), msg
    assert "shorten the phase" in msg and "ssh load generators" in msg
    small = op.config_map_files(_plan(tmp_path, size=op.CONFIGMAP_MAX_BYTES - 200_000))
    assert op.data_bytes(op.config_map("dbk6-x-sustained", "deploybench", {}, small)["data"]) <= (1 << 20)


def test_a_phase_whose_share_per_runner_would_not_fit_its_log_is_refused_before_anything_is_applied():
    spec = K6OperatorSpec(parallelism=2)
    op.log_budget(2000, spec)  # 1,000 per runner: 7 MB of log, under 10 MiB
    with pytest.raises(ConfigError, match=r"30,000 requests, 15,000 per runner .*parallelism to at least 21"):
        op.log_budget(30_000, spec)


# -- a runner's log --------------------------------------------------------------------------------------------------
def _point(i: int) -> str:
    return json.dumps({"metric": "db_request", "type": "Point", "data": {
        "time": "2026-12-06T23:08:42Z", "value": 12.5, "tags": {"node": "n1", "phase": "sustained", "status": "200",
                                                               "window": "measure"},
        "metadata": {"t0": str(1796598519964 + i), "lag_ms": "0", "prompt_tokens": "5", "output_tokens": "8",
                     "iter": str(i)}}}, separators=(",", ":"))


def _log(points: int, counted: int) -> bytes:
    summary = json.dumps({"metrics": {"db_request": {"count": counted, "avg": 12.5}}}, indent=4)
    lines = ['time="2026-12-06T23:08:40Z" level=info msg="starting"', *(_point(i) for i in range(points)),
             "", "  █ TOTAL RESULTS", summary]
    return "\n".join(lines).encode() + b"\n"


def test_a_runner_log_is_split_into_samples_summary_and_messages(tmp_path):
    json_out, summary_out, log_out, n = op.parse_runner_log(_log(3, 3), "1 (p1)", tmp_path / "s.p1", 1 << 20)
    assert n == 3 and len(json_out.read_text().splitlines()) == 3
    assert json.loads(summary_out.read_text())["metrics"]["db_request"]["count"] == 3
    assert "level=info" in log_out.read_text() and "db_request" not in log_out.read_text()


@pytest.mark.parametrize("data, message", [
    (_log(3, 4), r"runner 1 \(p1\): its log holds 3 request samples but its own summary counts 4"),
    (_log(3, 3)[:-40], "no complete summary export"),
    (_log(3, 3).replace(b'"count": 3', b'"count": NaN'), r"no count of db_request samples"),
    (_log(3, 3).replace(b'"count": 3', b'"count": "3"'), r"no count of db_request samples"),
    (_log(3, 3).replace(b'"metrics": {', b'"metrics": [{').replace(b'"avg": 12.5\n        }\n    }',
                                                                   b'"avg": 12.5\n        }\n    }]'),
     r"runner 1 \(p1\): its summary export has no count"),  # metrics a list, not an object
    (_log(3, 3).replace(b'"db_request": {', b'"db_request": [{').replace(b'"avg": 12.5\n        }',
                                                                         b'"avg": 12.5\n        }]'),
     r"runner 1 \(p1\): its summary export has no count"),  # metrics.db_request a list
    (b"\x00\xff" + _log(3, 3), "not UTF-8"),
    (_log(3, 3) + b"x" * 2000, "more than 2,048 bytes"),
])
def test_a_runner_log_that_cannot_be_trusted_is_refused_naming_the_runner(tmp_path, data, message):
    with pytest.raises(op.OperatorRunFailed, match=message):
        op.parse_runner_log(data, "1 (p1)", tmp_path / "s.p1", 2048 if b"xxxx" in data else 1 << 20)


def test_the_driver_needs_the_custom_objects_api_of_the_runs_connection():
    from deploybench.load.kube_load import KubeLoad
    from deploybench.rollout.kubernetes import KubeClients

    with pytest.raises(ConfigError, match=r"custom objects API .*rollout.kubernetes.conn_id"):
        KubeLoad(KubeClients(None, None, None), "deploybench", K6OperatorSpec(parallelism=2))


def test_a_phase_sent_by_the_operator_has_its_start_in_its_time_budget():
    from deploybench.timeouts import TESTRUN_OVERHEAD_S, stage_budget_s

    k8s = {"backend": "kubernetes", "kubernetes": {"image": "vllm/vllm-openai:v0.6.0"}}
    plain = RunConfig.parse({"inventory": "demo", "rollout": k8s})
    with_op = RunConfig.parse({"inventory": "demo", "rollout": k8s | {"kubernetes": k8s["kubernetes"] | {
        "k6_operator": {"parallelism": 3, "start_timeout_s": 200}}}})
    per_run = 200 + TESTRUN_OVERHEAD_S
    assert stage_budget_s(with_op, "sustained", 4) - stage_budget_s(plain, "sustained", 4) == per_run
    steps = with_op.load.probe_max_steps
    assert stage_budget_s(with_op, "probe", 4) - stage_budget_s(plain, "probe", 4) == steps * per_run
    assert stage_budget_s(with_op, "rollout", 4) == stage_budget_s(plain, "rollout", 4)
