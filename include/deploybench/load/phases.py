"""The three phases as the pipeline runs them, one call per phase, results kept in the run's folder.

Each phase writes ``<out_dir>/<phase>.result.json`` (``PhaseOutcome``); ``assemble`` turns the files
present into the load stage's result::

    {**<the headline LoadResult: sustained, else overload, else the probe's capacity step>,
     "phases":   {"probe": {...}, "sustained": {...}, "overload": {...}},   # those that ran
     "capacity": {"capacity_rps", "bracket", "converged", "reason", "steps": [ProbeStep...], "seconds"}
                 | {"capacity_rps": <load.rate>, "source": "config"} when the probe did not run,
     "series":   [paths of the scraped /metrics series, NDJSON.gz, one per k6 run]}

``phases[p]`` is ``{"status": "success"|"failed", "result": LoadResult dump | None, "error": str | None,
"analysis": {...}}``; analysis is the probe's CapacityResult, sustained's Drift or overload's
OverloadAnalysis. The sustained and overload phases take the probe's capacity when it ran, else
``load.rate``; ``sustained_fraction`` scales a probed capacity only: without the probe, the sustained
phase offers exactly the load rate a person typed (``phase_spec``).

A conversation workload whose file counts its rate in sessions (``[session] rate = "sessions"``, the default for
sessions) has the run's rates (load rate, probe_start_rps, probe_max_rps, the SLO's min_rps) in conversations per
second: ``in_requests`` turns them into requests/s (x its mean turns) once, here, and everything below works in
requests/s as for any workload; the capacity says its unit and factor (``rate_unit``, ``requests_per_session``) so
the report gives both.

Every k6 run (each probe step, sustained, overload) is measured with the nodes' GPUs beside it
(``gpu.GpuSampler``: the engine's DCGM gauges, a DCGM exporter, or nvidia-smi over ``transports``):
``LoadResult.gpu`` per node, ``gpu_util_pct`` per node and for the cluster. The SLO's optional
``min_gpu_util_pct`` is judged on the sustained phase only (the reference runbook's "at least 80 % at
the sustained rate"); its reasons join that phase's SLO verdict.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from deploybench import workloads
from deploybench.config import SLO, LoadPhase, LoadSpec
from deploybench.engines import Metrics
from deploybench.errors import ConfigError
from deploybench.load import cost, gpu, overload, probe, prom, spike, sustained
from deploybench.load.results import Endpoint, GpuFigures, LoadError, LoadResult, SloVerdict
from deploybench.load.runner import ApiFlavour, run_load
from deploybench.load.scrape import read_series, save_series
from deploybench.policy import POLICY_ENV, TARGETS_ENV, current
from deploybench.workloads import MAX_TOKENS

if TYPE_CHECKING:
    from deploybench.load.kube_load import KubeLoad
    from deploybench.load.loadgen import Generators
    from deploybench.load.scale_up import ScaleUp

LOG = logging.getLogger(__name__)
ORDER = tuple(p.value for p in LoadPhase)  # probe -> sustained -> spike -> overload, as config.LoadPhase declares
LB_NODE = "lb"


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of an http(s) URL, the default port filled in; None if it is not one."""
    try:
        u = urlsplit(url.strip())
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:
        return None
    if u.scheme not in ("http", "https") or not u.hostname or port is None:
        return None
    return u.scheme, u.hostname.lower().rstrip("."), port


def allowed_targets() -> list[str]:
    """The operator's allow-list of origins: the policy's ``target_urls`` and ``$DEPLOYBENCH_TARGET_URLS``
    (deploybench.policy)."""
    return current().targets()


def check_target(url: str, endpoints: list[Endpoint]) -> None:
    """A ``target_url`` must lead to this run: the origin of one of its own endpoints, or one the operator
    allowed. Anyone who can trigger a run could otherwise send load at any URL the worker reaches."""
    want = origin(url)
    own = {origin(e.url) for e in endpoints}
    listed = {origin(t) for t in allowed_targets()}
    if want is not None and (want in own or want in listed):
        return
    mine = ", ".join(sorted({f"{o[0]}://{o[1]}:{o[2]}" for o in own if o})) or "none"
    raise ConfigError(
        f"target_url {url[:200]!r} is neither one of this run's endpoints ({mine}) nor in the operator's allow-list "
        f"({', '.join(allowed_targets()) or 'empty'}); leave target_url empty to load every node, or have the "
        f"operator add its origin (e.g. http://my-lb.example:8000) to target_urls in the policy file "
        f"(${POLICY_ENV}) or to ${TARGETS_ENV}")


def targets(endpoints: list[Endpoint], spec: LoadSpec) -> tuple[list[Endpoint], list[Endpoint]]:
    """(where the load goes, whose /metrics are scraped): every node, or one load-balanced URL in front of them
    (refused unless it is the run's own or allowed, ``check_target``)."""
    if not spec.target_url:
        return endpoints, endpoints
    check_target(spec.target_url, endpoints)
    model = endpoints[0].model if endpoints else "model"
    return [Endpoint(LB_NODE, spec.target_url, model)], endpoints


def first_asked(asked: list) -> str:
    """The phase a (re-)run of the load stage starts with: the first of ``asked`` (LoadPhase values or names) in
    ORDER, the order the phases run in (load_phases as typed may list them in any order)."""
    names = {getattr(p, "value", p) for p in asked}
    got = next((p for p in ORDER if p in names), None)
    if got is None:
        raise ValueError(f"load phases {sorted(names)} name none of {', '.join(ORDER)}")
    return got


def _path(out_dir: Path, phase: str) -> Path:
    return Path(out_dir) / f"{phase}.result.json"


def read_outcomes(out_dir: Path) -> dict[str, dict]:
    return {p: json.loads(_path(out_dir, p).read_text()) for p in ORDER if _path(out_dir, p).is_file()}


def _write(out_dir: Path, phase: str, outcome: dict) -> None:
    path = _path(out_dir, phase)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(outcome, indent=1, default=str))
    tmp.replace(path)


def in_requests(spec: LoadSpec, slo: SLO | None = None) -> tuple[LoadSpec, SLO | None, float]:
    """(spec, slo, requests per unit) with every rate in requests/s: a sessions-rated workload's rates x its mean
    turns (``Workload.rate_scale``); others as they are."""
    scale = workloads.workload(spec.workload).rate_scale()
    if scale == 1.0:
        return spec, slo, 1.0
    spec = spec.model_copy(update={"rate": spec.rate * scale, "probe_start_rps": spec.probe_start_rps * scale,
                                   "probe_max_rps": spec.probe_max_rps * scale})
    if slo is not None and slo.min_rps:
        slo = slo.model_copy(update={"min_rps": slo.min_rps * scale})
    return spec, slo, scale


def _unit(capacity: dict, scale: float) -> dict:
    return {**capacity, "rate_unit": "sessions", "requests_per_session": round(scale, 6)} if scale != 1.0 else capacity


def capacity_of(out_dir: Path, spec: LoadSpec) -> tuple[float, str]:
    """The capacity sustained/overload work from: the probe's, else ``spec.rate``."""
    got = read_outcomes(out_dir).get("probe")
    if got is None:
        return spec.rate, "config"
    cap = ((got.get("analysis") or {}).get("capacity_rps"))
    if got.get("status") != "success" or not cap:
        why = (got.get("analysis") or {}).get("reason") or got.get("error")
        raise LoadError(f"the probe found no capacity ({why}); "
                        "lower probe_start_rps, loosen the SLO, or run without the probe at a fixed load_rate")
    return float(cap), "probe"


def phase_spec(spec: LoadSpec, source: str) -> LoadSpec:
    """The spec the sustained and overload phases run with, given where their capacity came from
    (``capacity_of``). ``sustained_fraction`` is a fraction of a capacity the probe measured; a load rate a
    person typed means what it says: without the probe the sustained phase offers exactly ``load.rate``, and
    overload starts there and ramps to ``overload_factor`` x it."""
    return spec if source == "probe" else spec.model_copy(update={"sustained_fraction": 1.0})


def with_prometheus(res: LoadResult, nodes: list[Endpoint], source: prom.PromSource | None,
                    metrics: Metrics | None = None) -> LoadResult:
    """``res`` with its nodes' figures over its measured window from the team's Prometheus (``prom.node_windows``)
    beside those deploybench scraped itself; unchanged without a source."""
    if source is None:
        return res
    start = res.started_at
    pairs = [(e.node, e.host or urlsplit(e.url).hostname or "") for e in nodes]
    got = prom.node_windows(source, pairs, start, start + timedelta(seconds=res.duration_s), metrics)
    return res.model_copy(update={"node_windows": [*prom.scraped_windows(res), *got]})


def with_gpu(run: Callable[[], LoadResult], nodes: list[Endpoint], spec: LoadSpec, out_dir: Path, phase: str,
             step: int = 0, transports: Mapping[str, Any] | None = None, plan: dict | None = None,
             prometheus: prom.PromSource | None = None, metrics: Metrics | None = None) -> LoadResult:
    """``run()`` (one k6 run) with the GPUs of ``nodes`` sampled beside it; its result with ``gpu`` set (and with
    ``node_windows`` from ``prometheus``, when given: ``with_prometheus``).
    ``plan`` (a dict, filled on first use) keeps each node's source from one call to the next."""
    if spec.scrape_interval_s <= 0:
        return with_prometheus(
            gpu.attach(run(), {e.node: GpuFigures(reason="scraping is off (scrape_interval_s=0)") for e in nodes}),
            nodes, prometheus, metrics)
    known = plan if plan is not None else {}
    sampler = gpu.GpuSampler(nodes, spec.scrape_interval_s, phase, step, transports=transports,
                             plan=known.get("plan"), why=known.get("why")).start()
    known.update(plan=sampler.plan, why={k: v for k, v in sampler.why.items() if sampler.plan.get(k) == "absent"})
    try:
        res = run()
    finally:
        polled = sampler.stop()
    stem = phase + (f".step{step:02d}" if step else "")
    path = save_series(polled, Path(out_dir) / f"{stem}.gpu.jsonl.gz") if polled else None
    points = (read_series(res.metrics_path) if res.metrics_path else []) + polled
    figs = gpu.gpu_figures(points, [e.node for e in nodes], res.started_at,
                           res.started_at + timedelta(seconds=res.duration_s), sampler.why, {e.node: e for e in nodes})
    return with_prometheus(gpu.attach(res, figs, str(path) if path else None), nodes, prometheus, metrics)


DRAIN_FACTOR = 2.0  # idle again: a lone request within this factor of the idle baseline
DRAIN_POLL_S = 0.2


class Drainer:
    """Waits, between probe steps, for the server to be idle again (``probe`` module doc): the engines'
    running + waiting gauges (the roles of the engine profile's map) at 0 when every scraped node exports them,
    else a lone streamed request per endpoint answering within ``DRAIN_FACTOR`` x its idle baseline
    (``baseline()``, measured before the search). At most ``2 x request_timeout_s`` per call."""

    def __init__(self, load_eps: list[Endpoint], scrape_eps: list[Endpoint], spec: LoadSpec, api: str,
                 metrics: Metrics | None = None) -> None:
        import random

        self.load_eps, self.scrape_eps, self.spec, self.api = load_eps, scrape_eps, spec, api
        names = (metrics or Metrics()).names
        self.gauge_names = tuple(names[r] for r in ("running", "waiting") if r in names)
        self.rng = random.Random(17)
        self.idle_ms: dict[str, float] = {}
        self.gauges = self._gauges() is not None

    def _gauges(self) -> float | None:
        """running + waiting over the scraped nodes; None if a node does not export both (or cannot be read)."""
        from deploybench import http
        from deploybench.load.scrape import MetricsPageError, get_page, parse_metrics

        if len(self.gauge_names) < 2:
            return None  # the profile does not name both
        total = 0.0
        for ep in self.scrape_eps:
            try:  # within the scraper's bounds: finite values only (a NaN gauge is not exported)
                got = {n: v for n, _, v in parse_metrics(get_page(ep.page, 2.0), self.gauge_names)}
            except (MetricsPageError, http.HTTPFailure):
                return None
            if set(got) != set(self.gauge_names):
                return None
            total += sum(v for v in got.values() if v >= 0)  # negative: hostile, ignored
        return total

    def _lone_ms(self, ep: Endpoint, timeout_s: float) -> float | None:
        """One streamed request alone: its latency in ms, None if it failed."""
        import asyncio

        from deploybench.load.ttft import make_prompt, stream_once

        text, p, o = make_prompt(self.rng, self.spec)
        row = asyncio.run(stream_once(ep, self.api, text, p, o, max(0.5, timeout_s)))
        return None if row["error_kind"] else float(row["latency_ms"])

    def baseline(self, n: int = 3) -> dict[str, float]:
        """Each endpoint's idle latency: the median of ``n`` lone requests (skipped when gauges tell idleness)."""
        if self.gauges:
            return {}
        for ep in self.load_eps:
            got = sorted(x for x in (self._lone_ms(ep, self.spec.request_timeout_s) for _ in range(n)) if x is not None)
            if got:
                self.idle_ms[ep.node] = got[len(got) // 2]
        return dict(self.idle_ms)

    def __call__(self) -> tuple[float, str]:
        import time

        t0 = time.monotonic()
        bound = 2 * self.spec.request_timeout_s
        left = lambda: bound - (time.monotonic() - t0)  # noqa: E731
        if self.gauges:
            while left() > 0:
                busy = self._gauges()
                if busy is None:
                    break
                if busy == 0:
                    return time.monotonic() - t0, "idle: running and waiting gauges at 0"
                time.sleep(DRAIN_POLL_S)
        if not self.idle_ms:
            return time.monotonic() - t0, "no idle baseline and no gauges: not waited for"
        pending = [ep for ep in self.load_eps if ep.node in self.idle_ms]
        while pending and left() > 0:
            ep = pending[0]
            ms = self._lone_ms(ep, left())
            if ms is not None and ms <= DRAIN_FACTOR * self.idle_ms[ep.node]:
                pending.pop(0)
        secs = time.monotonic() - t0
        if pending:
            return secs, f"NOT idle after {bound:.0f} s (2 x request_timeout_s): {', '.join(e.node for e in pending)}"
        return secs, f"idle: a lone request within {DRAIN_FACTOR:g} x the idle latency"


def _judge_gpu(res: LoadResult, slo: SLO) -> LoadResult:
    """The sustained phase's verdict with the utilisation objective (when the SLO sets one)."""
    extra = gpu.gpu_verdict(res.gpu, slo)
    if not extra:
        return res
    return res.model_copy(update={"slo_ok": False, "slo": SloVerdict(passed=False, reasons=[*res.slo.reasons, *extra])})


def _series(res: LoadResult) -> list[str]:
    return [p for p in (res.metrics_path, res.gpu_series_path) if p]


def run_phase(phase: str, endpoints: list[Endpoint], spec: LoadSpec, slo: SLO, out_dir: Path, *,
              tags: dict | None = None, api: ApiFlavour | None = None, transports: Mapping[str, Any] | None = None,
              search: str = "ramp", metrics: Metrics | None = None, max_model_len: int | None = None,
              generators: Generators | KubeLoad | None = None, prices: Mapping[str, Any] | None = None,
              prometheus: prom.PromSource | None = None, grow: ScaleUp | None = None) -> dict:
    """Run one phase and record its outcome (also when it fails: then LoadError/ConfigError propagate).

    ``transports`` (node -> deploybench.transport.Transport) let nodes without DCGM report their GPUs
    through nvidia-smi; ``metrics`` is the engine profile's (its page and the names of its figures).
    ``search`` "doubling" runs the earlier capacity search (for the side-by-side bench). ``max_model_len`` is the
    engine's context: a workload's conversation stops before a turn that would not fit it. ``generators`` (the
    inventory's load generators) split every k6 run of the phase by execution segments (deploybench.load.loadgen).
    ``prices`` (node -> the inventory's Price or None) give each result its cost per million output tokens
    (deploybench.load.cost). ``prometheus``: the team's Prometheus, asked for every node's figures over each k6
    run's window (``with_prometheus``); with ``remote_write`` it also receives k6's own metrics. ``grow``: the spike
    phase scales up under load (deploybench.load.scale_up; ``endpoints`` are then those serving before the spike)."""
    ctx_len = max_model_len or MAX_TOKENS
    spec, judged, scale = in_requests(spec, slo)
    assert judged is not None
    slo = judged
    rw = prometheus.remote_write_url() if prometheus is not None and prometheus.remote_write else None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_eps, scrape_eps = targets(endpoints, spec)
    if grow is not None:
        # scale-up under load: the engines it adds are scraped, GPU-sampled and priced from the phase's start too
        # (an engine not started yet answers its page with up=0), so every node whose tokens count is paid for
        # an added engine at a new address (a new pod on kubernetes) replaces its entry in this list when it serves
        scrape_eps = grow.follow([*scrape_eps, *(e for e in grow.more if e.node not in {s.node for s in scrape_eps})])
    serving = [e.node for e in scrape_eps]  # the engines that served, also behind a load balancer
    outcome: dict[str, Any] = {"phase": phase, "status": "failed", "result": None, "error": None, "analysis": None}
    try:
        if phase == "probe":
            steps: dict[int, Any] = {}
            plan: dict = {}  # each node's GPU source, chosen at the first step

            def measure(n: int, rate: float, stages: list | None = None) -> LoadResult:
                s = spec.model_copy(update={"window_s": probe.ramp_window_s(spec)}) if stages else spec
                res = with_gpu(lambda: run_load(load_eps, s, slo, out_dir, phase="probe", tags=tags, rate=rate,
                                                duration_s=spec.probe_step_s, warmup_s=spec.probe_warmup_s, api=api,
                                                step=n, seed=n, scrape_endpoints=scrape_eps, stages=stages,
                                                metrics=metrics, max_model_len=ctx_len, generators=generators,
                                                remote_write=rw),
                               scrape_eps, spec, out_dir, "probe", n, transports, plan, prometheus, metrics)
                res = cost.attach(res, prices, serving)
                steps[n] = res
                return res

            drain = None
            if search != "doubling":  # the earlier search, kept as it was for the side-by-side bench
                drain = Drainer(load_eps, scrape_eps, spec, api or spec.api.value, metrics)
                drain.baseline()
            found = probe.search(measure, spec, slo, run_ramp=(
                None if search == "doubling" else lambda n, frm, to: measure(n, frm, [(to, spec.probe_step_s)])),
                drain=drain)
            outcome["analysis"] = _unit(found.model_dump(mode="json"), scale)
            best = max((s for s in found.steps if s.passed), key=lambda s: s.rate, default=found.steps[-1])
            outcome["result"] = steps[best.step].model_dump(mode="json")
            outcome["series"] = [p for r in steps.values() for p in _series(r)]
            outcome["node_windows"] = {n: [w.model_dump(mode="json") for w in r.node_windows]
                                       for n, r in steps.items() if r.node_windows}
        else:
            cap, source = capacity_of(out_dir, spec)
            shaped = phase_spec(spec, source)
            mod: Any = {"sustained": sustained, "spike": spike}.get(phase, overload)
            done: dict[str, Any] = {}
            more: dict[str, Any] = {}
            if phase == "spike" and grow is not None:
                # a probed capacity is every node's; the spike starts on scale_up_from of them: its base is their
                # share of it (a typed load_rate stays as typed: it is the user's)
                share = len(load_eps) / (len(load_eps) + len(grow.added)) if source == "probe" else 1.0
                more = {"grow": grow, "base_share": share}

            def run() -> LoadResult:
                done["res"], done["analysis"] = mod.run(load_eps, shaped, slo, out_dir, cap, tags=tags, api=api,
                                                        scrape_endpoints=scrape_eps, metrics=metrics,
                                                        max_model_len=ctx_len, generators=generators,
                                                        remote_write=rw, **more)
                return done["res"]

            res = cost.attach(with_gpu(run, scrape_eps, spec, out_dir, phase, 0, transports, prometheus=prometheus,
                                       metrics=metrics), prices, serving)
            res = _judge_gpu(res, slo) if phase == "sustained" else res
            outcome["result"] = res.model_dump(mode="json")
            outcome["analysis"] = _unit({**done["analysis"].model_dump(mode="json"), "capacity_rps": cap,
                                         "capacity_source": source}, scale)
            outcome["series"] = _series(res)
            if res.node_windows:
                outcome["node_windows"] = {0: [w.model_dump(mode="json") for w in res.node_windows]}
        outcome["status"] = "success"
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _write(out_dir, phase, outcome)
    return outcome


def assemble(out_dir: Path, spec: LoadSpec) -> dict:
    """The load stage's result from the phase files present (see the module doc)."""
    got = read_outcomes(out_dir)
    spec, _, scale = in_requests(spec)
    head = next((got[p]["result"] for p in ("sustained", "overload", "probe") if p in got and got[p].get("result")),
                None)
    pr = got.get("probe")
    capacity = ((pr.get("analysis") or {"capacity_rps": None, "reason": pr.get("error")}) if pr
                else _unit({"capacity_rps": spec.rate, "source": "config"}, scale))
    return {**(head or {}), "phases": got, "capacity": capacity,
            "series": [s for p in got.values() for s in p.get("series") or []]}


def spike_summary(an: dict) -> str:
    """The spike phase in one line: its recovery time (or why it is absent) and, scaling up, its times."""
    rec = (f"recovered in {an['recovery_s']:g} s" if an.get("recovery_s") is not None
           else f"recovery ABSENT ({(an.get('recovery_reason') or '')[:120]})")
    peak = an.get("peak_p99_ms")
    line = (f"spike: {an.get('base_rps', 0):.2f} -> {an.get('peak_rps', 0):.2f} req/s for {an.get('hold_s', 0):g} s, "
            f"peak P99 {peak:.0f} ms, " if peak is not None else
            f"spike: {an.get('base_rps', 0):.2f} -> {an.get('peak_rps', 0):.2f} req/s, peak P99 absent, ")
    line += f"{an.get('failed_spike', 0)} failed in the spike, {rec}"
    up = an.get("scale_up")
    if up:
        serving = up.get("all_serving_s")
        line += (f"; scale-up {len(up.get('nodes_before') or [])} -> {len(up.get('nodes_after') or [])} engines, "
                 + (f"all serving {serving:g} s" if serving is not None else "NOT all serving")
                 + (f", SLO again {up['slo_again_s']:g} s" if up.get("slo_again_s") is not None else
                    ", SLO not again") + " after the spike's start")
    return line


def summary(data: dict) -> str:
    """One line per phase for the stage record."""
    parts = []
    cap = data.get("capacity") or {}
    for name, ph in (data.get("phases") or {}).items():
        res, an = ph.get("result") or {}, ph.get("analysis") or {}
        if ph.get("status") != "success":
            parts.append(f"{name}: FAILED ({(ph.get('error') or '')[:120]})")
        elif name == "probe":
            per = an.get("requests_per_session")
            parts.append(f"probe: capacity {an.get('capacity_rps') or 0:.2f} req/s"
                         + (f" ({(an.get('capacity_rps') or 0) / per:.2f} sessions/s)" if per else "")
                         + f" in {len(an.get('steps') or [])} steps ({an.get('reason')})")
        elif name == "sustained":
            util = res.get("gpu_util_pct")
            parts.append(f"sustained: {res.get('achieved_rps', 0):.2f} of {res.get('offered_rps', 0):.2f} req/s, "
                         f"P99 {res.get('latency_p99_ms') or 0:.0f} ms, GPU "
                         + (f"{util:.0f} %" if util is not None else "not measured")
                         + f", SLO {'met' if res.get('slo_ok') else 'not met'}"
                         + (", DRIFT " + "; ".join(an.get("reasons") or []) if an.get("drifted") else ""))
        elif name == "spike":
            parts.append(spike_summary(an))
        else:
            broke = {k: round(v["rate"], 2) for k, v in (an.get("broke_at") or {}).items() if v}
            parts.append(f"overload: broke at {broke or 'nothing'}, "
                         + (f"recovered in {an.get('recovery_s')} s" if an.get("recovered") else "did NOT recover"))
    if not parts:
        parts.append(f"capacity {cap.get('capacity_rps')}")
    return " | ".join(parts)
