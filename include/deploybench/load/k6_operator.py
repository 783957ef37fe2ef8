"""A load phase as a k6-operator ``TestRun``: the pure pieces (manifests, their schema check, the operator's execution
segments, a runner's log read back as hostile input). The driver that applies them is ``deploybench.load.kube_load``.

What the operator does, read from its source (grafana/k6-operator at commit e2c9571ac480ad7ca8ed019062ff67847d76724e):

* ``pkg/resources/jobs/runner.go`` ``NewRunnerJob``: runner ``i`` of ``parallelism`` N (1-based) is a Job
  ``<testrun>-<i>`` whose pod runs ``k6 run --quiet`` + ``segmentation.NewCommandFragments(i, N)`` (when N > 1) +
  ``spec.arguments`` split on spaces + ``/test/<file>`` + ``--address=0.0.0.0:6565 --paused --tag instance_id=<i>
  --tag testrun_name=<testrun>``, with ``spec.runner.env``, image and resources; its pods carry the labels ``app=k6``,
  ``k6_cr=<testrun>``, ``runner=true`` (``newLabels`` in helpers.go) and the Job controller's ``job-name``.
* ``pkg/segmentation/segmentation.go``: ``--execution-segment=(i-1)/N:i/N`` ("0" and "1" at the ends, the fractions
  not reduced: "2/4") and ``--execution-segment-sequence=0,1/N,...,(N-1)/N,1``. These are the same rationals as
  ``loadgen.segments(N)``'s for generator i-1 (which reduces them: "1/2"); k6 parses both as rationals
  (``operator_segments`` mirrors the Go code, tests/unit/load/test_k6_operator.py compares them), so the samples of
  the runners merge exactly like the ssh load generators'.
* ``pkg/types/script.go``: a script ConfigMap is mounted at ``/test`` ("keys cannot represent nested directories"),
  so run.js's ``./lib/*.js`` imports are rewritten to ``./*.js`` in the ConfigMap (``config_map_files``) and the plan
  is ``./plan.json`` (k6's ``open()`` resolves a relative path against the script's folder).
* ``internal/controller/k6_start.go`` + ``pkg/resources/containers/curl_start.go``: the runners start ``--paused``;
  once every runner pod runs, a starter pod resumes them one after the other (``curl -X PATCH .../v1/status``).
  That is the barrier: no ``DB_START_AT_MS`` is given (run.js's setup() then does not wait), since a time fixed
  before the pods are scheduled could pass before an image is pulled. k6 runs setup() after the resume, so each
  runner's schedule starts at its own resume plus its readiness checks: the runners' shares start apart by the
  starter's sequential requests and their setups (measured with the stand-ins of tests/support/k6_runners.py, three
  runners on this 2-core machine, three runs: 43, 28 and 45 ms between the first and the last start). Each
  runner's send lag is against its own start; that spread is not in the figures (a known limit: write down the
  starts if it matters).
* ``internal/controller/k6_finish.go``: the stage turns ``finished`` once every runner Job is done, failed or not
  ("TODO: We should distinguish between Suceeded/Failed"): a runner's exit code is read from its pod, never implied
  by the stage. ``error`` is set when the spec is invalid (``testrun_controller.go``).

The operator does not merge the runners' results: each runner writes its per-request samples to its stdout
(``--out json=-``: k6's JSON output writes to stdout for the file name "-", internal/output/json/json.go in k6 1.1.0)
and its summary export after them (``--summary-export=/dev/stdout``: k6 writes the end-of-test summary after every
output has flushed, internal/cmd/run.go), and deploybench reads each runner pod's log back through the pods/log API
(``parse_runner_log``): bounded, UTF-8, the summary found and parsed, and the number of request samples equal to
the ``db_request`` count of that runner's own summary, so a log the kubelet cut (it keeps a running container's log
up to containerLogMaxSize, 10 MiB by default, and the log API serves the current file only) is refused, never merged
short.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from deploybench.config import K6OperatorSpec
from deploybench.errors import ConfigError
from deploybench.load.loadgen import GeneratorFailed, segments
from deploybench.load.results import LoadError
from deploybench.load.samples import SAMPLE_METRIC, read_k6_json
from deploybench.paths import k6_dir

GROUP, VERSION, PLURAL, KIND = "k6.io", "v1alpha1", "testruns", "TestRun"
SCRIPT_DIR = "/test"  # where the operator mounts a script ConfigMap (pkg/types/script.go, VolumeMount)
SCRIPT = "run.js"
PLAN = "plan.json"
# Kubernetes refuses a ConfigMap whose data (values of data and binaryData) exceed 1 MiB: ValidateConfigMap in
# kubernetes/kubernetes pkg/apis/core/validation/validation.go (totalSize > core.MaxSecretSize, 1024 * 1024).
# Counted here with the keys too: a little stricter than the API server.
CONFIGMAP_MAX_BYTES = 1 << 20
# each runner's k6: per-request samples (JSON lines) and then its summary export on stdout, the pod's log
RUNNER_ARGUMENTS = "--no-color --out json=- --summary-export=/dev/stdout"
MAX_LOG_TEXT = 1 << 20  # what is kept of a runner's own log lines (its k6 messages), from the end
# Bytes of a runner's log per request it sends (k6's JSON lines for the request's built-in and own metrics), measured
# with three runners of a 20 req/s phase on the simulated engine (6,223 to 6,234 bytes per request with the synthetic
# workload, 6,430 with shared-prefix; the runner's summary included; tests/support/k6_runners.py's runners, as
# tests/integration/test_k6_operator.py runs them) and rounded up: a phase is refused before anything is applied
# when a runner's share would not fit ``K6OperatorSpec.log_max_bytes``. At the kubelet's default 10 MiB that is about
# 1,500 requests per runner.
LOG_BYTES_PER_REQUEST = 7000
SCHEMA_FILE = Path(__file__).resolve().parent.parent / "rollout" / "schemas" / "k6.io_testruns.v1alpha1.json"


class OperatorRunFailed(GeneratorFailed):
    """A k6-operator TestRun failed its phase: a runner's exit, the stage ``error``, a log that cannot be trusted."""


# -- names and segments ---------------------------------------------------------------------------------------------
def testrun_name(run_key: str | None, stem: str) -> str:
    """A DNS-1123 name for one phase's TestRun (and its ConfigMap): ``deploybench-k6-<digest of the run>-<phase>``,
    short enough that the operator's ``<name>-service-<i>`` objects stay within 63 characters."""
    digest = hashlib.sha256((run_key or "").encode()).hexdigest()[:8]
    phase = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:18].rstrip("-") or "phase"
    return f"dbk6-{digest}-{phase}"


def operator_segments(index: int, total: int) -> list[str]:
    """The arguments k6-operator gives runner ``index`` (1-based) of ``total``: pkg/segmentation/segmentation.go
    ``NewCommandFragments``, line for line (no segment arguments at all for a single runner: runner.go adds them only
    when parallelism > 1)."""
    if not 1 <= index <= total:
        raise ConfigError(f"runner index {index} is outside 1..{total}")
    if total == 1:
        return []

    def part(i: int) -> str:
        return "0" if i == 0 else "1" if i == total else f"{i}/{total}"

    sequence = ",".join(["0", *(f"{i}/{total}" for i in range(1, total)), "1"])
    return [f"--execution-segment={part(index - 1)}:{part(index)}", f"--execution-segment-sequence={sequence}"]


def _rationals(text: str) -> list[Fraction]:
    return [Fraction(p) for p in re.split(r"[,:]", text)]


def same_segments(total: int) -> bool:
    """True when the operator's segments for ``total`` runners are, as rationals, deploybench's ``segments(total)``
    (the ones the ssh load generators take): then one merge fits both."""
    ours, sequence = segments(total)
    for i in range(1, total + 1):
        got = operator_segments(i, total)
        if not got:  # one runner: the whole test, k6's default segment
            return ours == ["0:1"]
        seg, seq = (a.split("=", 1)[1] for a in got)
        if _rationals(seg) != _rationals(ours[i - 1]) or _rationals(seq) != _rationals(sequence):
            return False
    return True


def runner_segment(index: int, total: int) -> str:
    """The segment of runner ``index`` as deploybench names it (``loadgen.segments``), for the report."""
    return segments(total)[0][index - 1]


# -- manifests ------------------------------------------------------------------------------------------------------
def config_map_files(plan: Path) -> dict[str, str]:
    """run.js, its library and the phase's plan as one flat folder (a ConfigMap's keys): run.js's ``./lib/`` imports
    become ``./`` (the operator mounts the ConfigMap's keys side by side in /test)."""
    root = k6_dir()
    script = (root / SCRIPT).read_text()
    flat = re.sub(r"""(from\s+['"])\./lib/""", r"\1./", script)
    if "./lib/" in flat:
        raise ConfigError(f"{root / SCRIPT}: an import of ./lib/ is not in the form `from './lib/x.js'` and cannot be "
                          "flattened for the k6-operator's ConfigMap")
    files = {SCRIPT: flat}
    for js in sorted((root / "lib").glob("*.js")):
        if js.name in (SCRIPT, PLAN):
            raise ConfigError(f"k6/lib/{js.name} would overwrite {js.name} in the k6-operator's flat ConfigMap; "
                              "rename it")
        files[js.name] = js.read_text()
    files[PLAN] = Path(plan).read_text()
    return files


def data_bytes(data: Mapping[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in data.items())


def config_map(name: str, namespace: str, labels: Mapping[str, str], files: Mapping[str, str]) -> dict[str, Any]:
    """The ConfigMap of the script, its library and the plan; a plan that makes it larger than a ConfigMap may be is
    refused here, before anything is applied (one ConfigMap: the operator mounts exactly one)."""
    size = data_bytes(files)
    if size > CONFIGMAP_MAX_BYTES:
        plan = len(files.get(PLAN, "").encode())
        raise ConfigError(
            f"k6-operator: the phase's ConfigMap {name} would hold {size:,} bytes (the plan {plan:,} of them), more "
            f"than the {CONFIGMAP_MAX_BYTES:,} bytes (1 MiB) Kubernetes allows a ConfigMap; shorten the phase or lower "
            "its rate (fewer requests in the plan), pick a workload with shorter prompts or a smaller dataset, or send "
            "this phase from the ssh load generators (the inventory's loadgens, rollout.kubernetes.k6_operator."
            "parallelism 0)")
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "data": dict(files)}


def runner_env(env: Mapping[str, str], parallelism: int) -> dict[str, str]:
    """The runners' environment: the phase's DB_* variables as the controller's k6 gets them (runner.build_env),
    the plan at ./plan.json beside run.js, no barrier time (the operator's starter is the barrier), the runners'
    count, and no usage report."""
    out = {k: v for k, v in env.items() if k != "DB_START_AT_MS"}
    if "DB_PLAN" in out:
        out["DB_PLAN"] = f"./{PLAN}"
    out.update(DB_GENERATORS=str(parallelism), K6_NO_USAGE_REPORT="true")
    return out


def test_run(name: str, namespace: str, labels: Mapping[str, str], spec: K6OperatorSpec, env: Mapping[str, str],
             ) -> dict[str, Any]:
    """The ``k6.io/v1alpha1`` TestRun of one phase: ``spec.parallelism`` runners of ``spec.image``, the script from the
    ConfigMap of the same name, ``separate: false`` (several runners may share a node: a runner is small), the env
    as given (``runner_env``), and k6's outputs on stdout (``RUNNER_ARGUMENTS``)."""
    if spec.parallelism < 1:
        raise ConfigError(f"rollout.kubernetes.k6_operator.parallelism={spec.parallelism}: a TestRun needs at least "
                          "one runner (0 means: no TestRun, the controller's k6 sends the phase)")
    res: dict[str, dict[str, str]] = {}
    for key, value in (("cpu", spec.cpu), ("memory", spec.memory)):
        if value:  # requested and limited alike: a runner starved of CPU would send late, and say so only as lag
            res.setdefault("requests", {})[key] = value
            res.setdefault("limits", {})[key] = value
    runner: dict[str, Any] = {
        "image": spec.image,
        "metadata": {"labels": dict(labels)},
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
    }
    if res:
        runner["resources"] = res
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "parallelism": spec.parallelism,
            "separate": False,
            "script": {"configMap": {"name": name, "file": SCRIPT}},
            "arguments": RUNNER_ARGUMENTS,
            "runner": runner,
        },
    }


# -- the CRD's schema -----------------------------------------------------------------------------------------------
def _strict(node: Any) -> Any:
    """The CRD's structural schema as the API server applies it with fieldValidation=Strict: objects with
    ``properties`` refuse unknown fields unless they preserve them; int-or-string is either; int32 is 32 bits."""
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("format") == "int32" and out.get("type") == "integer":
        out.setdefault("minimum", -(2 ** 31))
        out.setdefault("maximum", 2 ** 31 - 1)
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema

    try:
        schema = json.loads(SCHEMA_FILE.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the vendored TestRun schema {SCHEMA_FILE}: {exc}") from exc
    schema.pop("$comment", None)
    return jsonschema.Draft7Validator(_strict(schema))


def validate_test_run(obj: Mapping[str, Any]) -> None:
    """Check a rendered TestRun against the operator's CRD schema (vendored: rollout/schemas/README.md); ConfigError
    names the first field that is wrong."""
    if obj.get("apiVersion") != f"{GROUP}/{VERSION}" or obj.get("kind") != KIND:
        raise ConfigError(f"not a {GROUP}/{VERSION} {KIND}: apiVersion {obj.get('apiVersion')!r}, kind "
                          f"{obj.get('kind')!r}")
    name = (obj.get("metadata") or {}).get("name", "?")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?", str(name)):
        raise ConfigError(f"TestRun name {name!r} is not a DNS-1123 label of at most 50 characters (the operator "
                          "names its Jobs and Services after it)")
    errors = sorted(_validator().iter_errors(dict(obj)), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        path = ".".join(str(p) for p in e.absolute_path) or "(top)"
        raise ConfigError(f"TestRun {name}: invalid at {path}: {e.message} (the k6-operator's CRD schema, "
                          f"{SCHEMA_FILE.name})")


# -- a runner's log, read back --------------------------------------------------------------------------------------
def parse_runner_log(data: bytes, runner: str, base: Path, max_bytes: int) -> tuple[Path, Path, Path, int]:
    """Split runner ``runner``'s pod log into its JSON output (``<base>.k6.json``), its summary export
    (``<base>.k6-summary.json``) and its own messages (``<base>.k6.log``, the last MAX_LOG_TEXT bytes); returns the
    three paths and its count of request samples. OperatorRunFailed, naming the runner, for a log over ``max_bytes``,
    not UTF-8, without a summary export, with a summary that is not k6's, or whose request samples are not as many as
    its own summary counts (the log was cut, or something else wrote to it)."""
    if len(data) > max_bytes:
        raise OperatorRunFailed(
            f"k6-operator runner {runner}: its log holds more than {max_bytes:,} bytes (rollout.kubernetes.k6_operator."
            "log_max_bytes), more than deploybench reads of one runner; raise parallelism so each runner sends less, "
            "or raise both the kubelet's containerLogMaxSize and log_max_bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OperatorRunFailed(f"k6-operator runner {runner}: its log is not UTF-8 text ({exc.reason} at byte "
                                f"{exc.start}); it is not k6's output") from exc
    points, other, summary_lines = [], [], []
    in_summary = False
    for line in text.splitlines():
        if in_summary:
            summary_lines.append(line)
            if line == "}":
                in_summary = False
        elif line == "{" and not summary_lines:  # k6 writes its summary export indented: "{" alone opens it
            in_summary = True
            summary_lines.append(line)
        elif line.startswith('{"'):  # k6's JSON output: one object a line
            points.append(line)
        else:
            other.append(line)
    if not summary_lines or in_summary:
        raise OperatorRunFailed(
            f"k6-operator runner {runner}: its log has no complete summary export at its end (k6 writes it last, "
            "after every sample): k6 did not finish, or the log was cut; last lines:\n" + "\n".join(other[-10:]))
    try:
        summary = json.loads("\n".join(summary_lines))
    except ValueError as exc:
        raise OperatorRunFailed(f"k6-operator runner {runner}: its summary export is not JSON ({exc})") from exc
    counted: Any = summary  # each level checked: hostile input, a list or a string in place of an object is refused
    for key in ("metrics", SAMPLE_METRIC, "count"):
        counted = counted.get(key) if isinstance(counted, dict) else None
    if (not isinstance(counted, int | float) or isinstance(counted, bool) or not math.isfinite(counted)
            or not 0 <= counted <= 1e12):
        raise OperatorRunFailed(f"k6-operator runner {runner}: its summary export has no count of {SAMPLE_METRIC} "
                                f"samples (got {str(counted)[:40]!r}): not the summary run.js's k6 writes")
    json_out, summary_out, log_out = (Path(f"{base}.k6.json"), Path(f"{base}.k6-summary.json"),
                                      Path(f"{base}.k6.log"))
    json_out.write_text("".join(p + "\n" for p in points))
    summary_out.write_text(json.dumps(summary))
    log_out.write_text("\n".join(other)[-MAX_LOG_TEXT:])
    try:
        df, _ = read_k6_json(json_out)
    except LoadError as exc:
        raise OperatorRunFailed(f"k6-operator runner {runner}: {exc}") from exc
    if len(df) != int(counted):
        raise OperatorRunFailed(
            f"k6-operator runner {runner}: its log holds {len(df)} request samples but its own summary counts "
            f"{int(counted)}: the log was cut (the kubelet keeps at most containerLogMaxSize of it, 10 MiB by "
            "default) or garbled; raise parallelism so each runner sends less, or the kubelet's containerLogMaxSize")
    return json_out, summary_out, log_out, len(df)


def log_budget(requests: int, spec: K6OperatorSpec) -> None:
    """Refuse, before anything is applied, a phase whose share per runner would not fit a runner's log."""
    per_runner = math.ceil(requests / max(1, spec.parallelism))
    need = per_runner * LOG_BYTES_PER_REQUEST
    if need > spec.log_max_bytes:
        enough = math.ceil(requests * LOG_BYTES_PER_REQUEST / spec.log_max_bytes)
        raise ConfigError(
            f"k6-operator: the phase sends about {requests:,} requests, {per_runner:,} per runner with parallelism "
            f"{spec.parallelism}; at about {LOG_BYTES_PER_REQUEST:,} bytes of log each that is {need:,} bytes, more "
            f"than a runner's log may hold (log_max_bytes {spec.log_max_bytes:,}, the kubelet's containerLogMaxSize); "
            f"raise rollout.kubernetes.k6_operator.parallelism to at least {enough}, shorten the phase, or raise the "
            "kubelet's containerLogMaxSize and log_max_bytes together")
