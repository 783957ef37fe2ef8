"""GPU utilisation and memory of every node during a load phase, beside the throughput it served.

Where a node's figures come from, decided when the phase starts (``GpuSampler.start``), first found wins:

1. ``dcgm``: DCGM-named gauges in the engine's own /metrics (the simulated engine exports them from its
   batch occupancy, see ``deploybench.sim.metrics``); the /metrics scraper already keeps them
   (``scrape.KEEP``), nothing more is polled;
2. ``dcgm-exporter``: NVIDIA's DCGM exporter on the node, ``http://<node host>:<dcgm_port>/metrics``;
3. ``nvidia-smi``: ``nvidia-smi --query-gpu=utilization.gpu,memory.used,memory.total,power.draw
   --format=csv,noheader,nounits`` over the run's transport to the node (when the caller gives one): utilisation,
   memory and the board's power, so a node without DCGM still has power, hence energy per token;

else the node's figures are absent, with the reason: never a zero that was not measured. Every source
becomes points in the scraper's series format under DCGM's names (``DCGM_FI_DEV_GPU_UTIL`` in %,
``DCGM_FI_DEV_FB_USED``/``_FREE`` in MiB, ``DCGM_FI_DEV_POWER_USAGE`` in W, label ``gpu``; polled ones also
``source``), so the results store ingests them as server metrics. What a node prints is hostile: ``parse_smi``
takes exactly the four numeric columns asked for, in range, or refuses the line; ``[N/A]`` (e.g. memory on
unified-memory GB10 systems, power where power management is not supported) is absent, not 0. A /metrics page
(the engine's or an exporter's) is read within the scraper's bounds (``scrape.get_page``,
``scrape.parse_metrics``: no NaN or infinity is kept), and ``gpu_figures`` leaves out every reading outside its
range (utilisation 0-100 %, memory 0-``MAX_MIB``, power 0-``MAX_W``), whatever its source,
with a warning: a node with none left is absent, so an objective on it is not measured, not met.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from deploybench import http
from deploybench.config import SLO
from deploybench.load.results import Endpoint, GpuFigures, LoadError, LoadResult
from deploybench.load.scrape import MetricsPageError, get_page, parse_metrics

LOG = logging.getLogger(__name__)

UTIL, FB_USED, FB_FREE = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"
# power (W) and energy since the driver loaded (mJ, a counter): dcgm-exporter's etc/default-counters.csv
POWER, ENERGY = "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
# the SM clock (MHz) and why it is below its maximum (a bitmask): dcgm-exporter's default counters; the reasons are
# DCGM field 112, DCGM_FI_DEV_CLOCK_THROTTLE_REASONS, named DCGM_FI_DEV_CLOCKS_EVENT_REASONS by newer DCGMs
# (NVIDIA/DCGM dcgmlib/dcgm_fields.h): either is read
SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
THROTTLE = ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS")
METRICS = (UTIL, FB_USED, FB_FREE, POWER, ENERGY, SM_CLOCK, *THROTTLE)
MAX_W = 5000.0  # one GPU's power draw: past it, the number is not a power
MAX_MHZ = 10_000.0  # an SM clock: GPUs run at 1-3 GHz
MAX_REASONS = float(2**32 - 1)  # the reason bits defined fit in 32 (DCGM's go to 0x100)
DCGM_PORT = 9400
POLL_WORKERS = 16  # nodes asked at once in one poll (an SSH session each, for nvidia-smi)
# nvidia-smi's query fields (``nvidia-smi --help-query-gpu``, NVIDIA's nvidia-smi(1)): "utilization.gpu" percent of
# the past sample period a kernel ran; "memory.used" / "memory.total" MiB; "power.draw" "the last measured power
# draw for the entire board, in watts. Only available if power management is supported" (on Ampere and newer the
# average over one second). ``csv,noheader,nounits``: one line per GPU, the values comma-separated, without the
# " %", " MiB" and " W" units, "[N/A]" where a value is not available (e.g. ``87, 61234, 81559, 243.17``).
SMI_FIELDS = ("utilization.gpu", "memory.used", "memory.total", "power.draw")
SMI_COMMAND = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
MAX_TEXT = 1 << 20  # characters of nvidia-smi output accepted: a GPU query prints ~20 per GPU
MAX_GPUS = 64
MAX_MIB = 16 << 20  # 16 TiB of memory on one GPU: past it, the number is not a memory size
_ABSENT = {"[n/a]", "[not supported]", "n/a", "[unknown error]"}


class GpuReadError(LoadError):
    """What a node printed for its GPUs is not what was asked for."""


def _field(text: str, what: str, top: float, line: int) -> float | None:
    t = text.strip()
    if t.lower() in _ABSENT:
        return None
    try:
        v = float(t)
    except ValueError:
        raise GpuReadError(f"nvidia-smi line {line}: {what} {t[:40]!r} is not a number") from None
    if not math.isfinite(v) or not 0 <= v <= top:
        raise GpuReadError(f"nvidia-smi line {line}: {what} {t[:40]!r} is outside [0, {top:g}]")
    return v


def parse_smi(text: str) -> list[tuple[float | None, float | None, float | None, float | None]]:
    """nvidia-smi's ``utilization.gpu, memory.used, memory.total, power.draw`` CSV (no header, no units): one
    (util %, used MiB, total MiB, power W) per GPU, None where it printed N/A. GpuReadError names a bad line."""
    if len(text) > MAX_TEXT:
        raise GpuReadError(f"nvidia-smi printed {len(text)} characters; a GPU query prints a few per GPU")
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cols = line.split(",")
        if len(cols) != len(SMI_FIELDS):
            raise GpuReadError(f"nvidia-smi line {i}: {line[:80]!r} has {len(cols)} columns, expected "
                               f"{len(SMI_FIELDS)} ({', '.join(SMI_FIELDS)})")
        util = _field(cols[0], "utilization.gpu", 100.0, i)
        used = _field(cols[1], "memory.used", MAX_MIB, i)
        total = _field(cols[2], "memory.total", MAX_MIB, i)
        watts = _field(cols[3], "power.draw", MAX_W, i)
        if used is not None and total is not None and used > total:
            raise GpuReadError(f"nvidia-smi line {i}: memory.used {used:g} MiB is above memory.total {total:g} MiB")
        rows.append((util, used, total, watts))
        if len(rows) > MAX_GPUS:
            raise GpuReadError(f"nvidia-smi listed more than {MAX_GPUS} GPUs")
    if not rows:
        raise GpuReadError("nvidia-smi printed no GPU")
    return rows


def smi_points(text: str, base: dict) -> list[dict]:
    """nvidia-smi's answer as points under DCGM's names (``base``: ts, node, phase, step)."""
    out = []
    for gpu, (util, used, total, watts) in enumerate(parse_smi(text)):
        labels = {"gpu": str(gpu), "source": "nvidia-smi"}
        if util is not None:
            out.append({**base, "metric": UTIL, "labels": labels, "value": util})
        if watts is not None:
            out.append({**base, "metric": POWER, "labels": labels, "value": watts})
        if used is not None:
            out.append({**base, "metric": FB_USED, "labels": labels, "value": used})
            if total is not None:
                out.append({**base, "metric": FB_FREE, "labels": labels, "value": total - used})
    return out


def in_range(metric: str, value: float) -> bool:
    """A GPU reading that can be one: utilisation in [0, 100] %, memory in [0, MAX_MIB] MiB, power in [0, MAX_W] W,
    an energy counter not negative (and finite, as every kept sample is)."""
    top = {UTIL: 100.0, POWER: MAX_W, ENERGY: 1e18, SM_CLOCK: MAX_MHZ}.get(metric, MAX_MIB)
    if metric in THROTTLE:  # a bitmask: a whole number
        return math.isfinite(value) and 0 <= value <= MAX_REASONS and value == int(value)
    return math.isfinite(value) and 0 <= value <= top


def dcgm_points(text: str, base: dict, source: str | None = None) -> list[dict]:
    """The GPU gauges of a Prometheus text page (finite: ``parse_metrics``); their range is judged by
    ``gpu_figures``, for every source alike. MetricsPageError for a page past the scraper's bounds."""
    out = []
    for name, labels, value in parse_metrics(text, keep=METRICS):
        if name not in METRICS:  # a longer name with the same prefix
            continue
        lb = ({"gpu": labels.get("gpu", "0")[:16]} | ({"pod": labels["pod"]} if "pod" in labels else {})
              | ({"source": source} if source else {}))
        out.append({**base, "metric": name, "labels": lb, "value": value})
    return out


def _has_util(url: str, timeout_s: float) -> bool:
    """Whether the page at ``url`` has the utilisation gauge (its values are judged later, ``gpu_figures``)."""
    try:
        return any(n == UTIL for n, _, _ in parse_metrics(get_page(url, timeout_s), keep=(UTIL,)))
    except MetricsPageError as exc:
        LOG.warning("%s: not taken as a GPU source: %s", url, exc)
    except http.HTTPFailure:
        pass
    return False


def _host(url: str) -> str:
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


class GpuSampler:
    """Decides each node's source when started and polls those that need polling every ``interval_s``
    in a thread; ``stop()`` returns the polled points (the engine-sourced ones are the scraper's)."""

    def __init__(self, endpoints: list[Endpoint], interval_s: float, phase: str, step: int = 0, *,
                 transports: Mapping[str, Any] | None = None, dcgm_port: int | None = DCGM_PORT,
                 timeout_s: float = 2.0, plan: Mapping[str, str] | None = None,
                 why: Mapping[str, str] | None = None) -> None:
        self.endpoints, self.interval_s, self.phase, self.step = endpoints, interval_s, phase, step
        self.transports = dict(transports or {})
        self.dcgm_port = dcgm_port
        self.timeout_s = min(timeout_s, max(0.5, interval_s))
        self.plan: dict[str, str] = dict(plan or {})  # node -> dcgm | dcgm-exporter | nvidia-smi | absent
        self.why: dict[str, str] = dict(why or {})  # node -> why absent / what failed
        self.points: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # poll_once's, once two nodes are polled
        self._t0: float | None = None  # when the first poll started (start): the cadence's origin

    def _exporter(self, ep: Endpoint) -> str:
        """The node's DCGM exporter: at the node's address (on Kubernetes, not the pod's)."""
        host = ep.host if ep.host else _host(ep.url)
        return f"http://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{self.dcgm_port}/metrics"

    def _choose(self, ep: Endpoint) -> str:
        if _has_util(ep.page, self.timeout_s):
            return "dcgm"
        if self.dcgm_port and _has_util(self._exporter(ep), self.timeout_s):
            return "dcgm-exporter"
        if ep.node in self.transports:
            try:  # once, to choose: a node without nvidia-smi is absent with the reason, not polled in vain
                res = self.transports[ep.node].run(SMI_COMMAND, timeout=max(2.0, self.timeout_s))
                if res.rc == 0 and smi_points(res.stdout, {"node": ep.node}):
                    return "nvidia-smi"
                self.why[ep.node] = f"nvidia-smi exited {res.rc}: {(res.stderr or res.stdout).strip()[:200]}"
            except Exception as exc:  # noqa: BLE001 - an unreachable node is absent, not the phase's failure
                self.why[ep.node] = f"nvidia-smi: {exc}"
            return "absent"
        self.why[ep.node] = (f"no {UTIL} in its /metrics" + (f" nor at {self._exporter(ep)}" if self.dcgm_port else "")
                             + ", and no transport to run nvidia-smi over")
        return "absent"

    def poll_once(self) -> None:
        """One sample of every polled node. The nodes are asked at once (up to ``POLL_WORKERS`` at a time): a slow
        node delays none of the others, and a round over 16 nodes takes one node's time, not 16 (over SSH, 16 x a
        round trip and a process start would stretch a 1-s interval to 2). Each point is stamped when its node was
        asked."""
        polled = [ep for ep in self.endpoints if self.plan.get(ep.node) in ("dcgm-exporter", "nvidia-smi")]
        if len(polled) > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(POLL_WORKERS, len(polled)),
                                            thread_name_prefix="gpu-poll")
        got = map(self._poll, polled) if len(polled) <= 1 or self._pool is None else self._pool.map(self._poll, polled)
        for points in list(got):
            self.points.extend(points)

    def _poll(self, ep: Endpoint) -> list[dict]:
        """One node's points now; [] with its reason (the first) when it gave none: a gap in its series."""
        how = self.plan.get(ep.node)
        base = {"ts": datetime.now(UTC).isoformat(), "node": ep.node, "phase": self.phase, "step": self.step}
        if how == "dcgm-exporter":
            url = self._exporter(ep)
            try:
                return dcgm_points(get_page(url, self.timeout_s), base, "dcgm-exporter")
            except MetricsPageError as exc:
                if ep.node not in self.why:
                    LOG.warning("node %s: %s refused: %s", ep.node, url, exc)
                self.why.setdefault(ep.node, f"{url} refused: {exc}")
            except http.HTTPFailure:
                self.why.setdefault(ep.node, f"{url} stopped answering")
        elif how == "nvidia-smi":
            try:
                res = self.transports[ep.node].run(SMI_COMMAND, timeout=max(2.0, self.interval_s * 2))
                if res.rc != 0:
                    raise GpuReadError(f"nvidia-smi exited {res.rc}: {(res.stderr or res.stdout).strip()[:200]}")
                return smi_points(res.stdout, base)
            except Exception as exc:  # noqa: BLE001 - a node's failure is a gap in its series, not the phase's
                self.why.setdefault(ep.node, f"nvidia-smi: {exc}")
                LOG.debug("GPU sample of %s failed: %r", ep.node, exc)
        return []

    def start(self) -> GpuSampler:
        """Choose each node's source (in parallel: a silent node costs one timeout, not one per node), unless
        a plan was given (the steps of one probe keep the first step's), then poll those that need it."""
        missing = [ep for ep in self.endpoints if ep.node not in self.plan]
        if missing:
            with ThreadPoolExecutor(max_workers=min(16, len(missing))) as pool:
                self.plan.update(zip([ep.node for ep in missing], pool.map(self._choose, missing)))
        if any(p in ("dcgm-exporter", "nvidia-smi") for p in self.plan.values()):
            self._t0 = time.monotonic()  # the cadence counts from the first poll's start, not its end
            self.poll_once()
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        """Poll on a fixed cadence, as Prometheus scrapes: at ``k x interval_s`` from the start, whatever the last
        poll took (waiting ``interval_s`` after each poll would stretch the interval by every poll's length). A poll
        that overran skips the ticks it missed rather than bunching the next polls behind it."""
        t0 = self._t0 if self._t0 is not None else time.monotonic()
        k = max(1, math.floor((time.monotonic() - t0) / self.interval_s) + 1)  # start()'s poll may have overrun tick 1
        while not self._stop.wait(max(0.0, t0 + k * self.interval_s - time.monotonic())):
            self.poll_once()
            k = max(k + 1, math.floor((time.monotonic() - t0) / self.interval_s) + 1)

    def stop(self) -> list[dict]:
        self._stop.set()
        try:
            if self._thread is not None:
                self._thread.join(self.timeout_s * max(1, len(self.endpoints)) + 5)
                self.poll_once()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
        return list(self.points)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def _power(samples: dict[str, dict[str, list[float]]], counters: dict[str, list[tuple[datetime, float]]]
           ) -> tuple[float | None, str | None]:
    """(mean power of the engine's GPUs in W, where it came from): the energy counters' increase over the time
    between their first and last sample in the window (exact: whatever happened between two samples is in it),
    else the mean of the power gauge's samples (the sum over the GPUs, in the samples where every GPU had one);
    (None, None) when neither was reported."""
    spans = [sorted(v) for v in counters.values() if len(v) >= 2]
    if spans and len(spans) == len(counters) and all(s[-1][0] > s[0][0] and s[-1][1] >= s[0][1] for s in spans):
        # (a counter that went down was reset, a driver reload: no reading)
        total = sum((s[-1][1] - s[0][1]) / 1000.0 / (s[-1][0] - s[0][0]).total_seconds() for s in spans)
        return round(total, 3), "energy counter"
    # a sample where some GPU said nothing of its power (nvidia-smi's [N/A]) does not count: its sum would take
    # that GPU's power for 0
    gauge = [sum(s[POWER]) for s in samples.values()
             if s.get(POWER) and len(s[POWER]) >= max(len(s.get(UTIL, ())), len(s.get(FB_USED, ())))]
    return (_mean(gauge), "power gauge") if gauge else (None, None)


def gpu_figures(points: list[dict], nodes: list[str], start: datetime, end: datetime,
                why: Mapping[str, str] | None = None, engines: Mapping[str, Endpoint] | None = None
                ) -> dict[str, GpuFigures]:
    """Per node: its GPU samples taken in ``(start, end]``; a node without one is absent, with the reason. With
    ``engines`` (node -> its Endpoint) only the engine's own GPUs count (``Endpoint.has_gpu``: the GPUs it was
    given, or on Kubernetes its pod's): an engine on 1 GPU of 8 is not averaged with 7 idle ones.
    A reading outside its range (``in_range``: NaN, infinite, a utilisation of 1e9 %, a negative memory) is
    left out with a warning, never averaged in: where none is left the figure is absent, not 0 nor NaN."""
    per: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    sources: dict[str, str] = {}
    gpus: dict[str, set] = defaultdict(set)
    bad: dict[str, Counter[str]] = defaultdict(Counter)
    others: Counter[str] = Counter()  # samples of GPUs that are not the engine's
    counters: dict[str, dict[str, list[tuple[datetime, float]]]] = defaultdict(lambda: defaultdict(list))
    example: dict[tuple[str, str], float] = {}
    for p in points:
        if p.get("metric") not in METRICS or p.get("node") not in nodes:
            continue
        ts = datetime.fromisoformat(p["ts"])
        if not start < ts <= end:
            continue
        node, metric, value = p["node"], p["metric"], float(p["value"])
        if engines and node in engines and not engines[node].has_gpu(p.get("labels") or {}):
            others[node] += 1
            continue
        if not in_range(metric, value):
            bad[node][metric] += 1
            example.setdefault((node, metric), value)
            continue
        gpu = str((p.get("labels") or {}).get("gpu", "0"))
        if metric == ENERGY:  # a counter: its increase over the window, per GPU
            counters[node][gpu].append((ts, value))
            continue
        per[node][p["ts"]][metric].append(value)
        sources.setdefault(node, (p.get("labels") or {}).get("source", "dcgm"))
        gpus[node].add(gpu)
    out = {}
    for node in nodes:
        left_out = ", ".join(f"{n} of {m} (e.g. {example[(node, m)]:g})" for m, n in sorted(bad[node].items()))
        if left_out:
            LOG.warning("node %s: GPU readings outside their range left out: %s; utilisation is 0-100 %%, memory "
                        "0-%d MiB: the node's GPU figures are absent where nothing else was reported", node,
                        left_out, MAX_MIB)
        odd = f"readings outside their range left out: {left_out}" if bad[node][UTIL] else None
        samples = per.get(node) or {}
        utils = [sum(s[UTIL]) / len(s[UTIL]) for s in samples.values() if s.get(UTIL)]
        used = [sum(s[FB_USED]) for s in samples.values() if s.get(FB_USED)]
        total = [sum(s[FB_USED]) + sum(s[FB_FREE]) for s in samples.values() if s.get(FB_USED) and s.get(FB_FREE)]
        if not utils and not used:
            reason = odd or (why or {}).get(node) or "no GPU sample in the measured window"
            mine = (engines or {}).get(node)
            if mine is not None and others[node] and reason.startswith("no GPU sample"):
                given = f"pod {mine.pod}" if mine.pod else f"GPUs {', '.join(mine.gpus)}"
                reason = (f"no sample of the engine's GPUs ({given}) in the measured window; {others[node]} samples "
                          "of other GPUs left out" + ("; none had the pod's label: turn on the DCGM exporter's pod "
                                                     "mapping (-k)" if mine.pod else ""))
            out[node] = GpuFigures(reason=reason)
            continue
        watts, power_from = _power(samples, counters.get(node) or {})
        clocks = [sum(s[SM_CLOCK]) / len(s[SM_CLOCK]) for s in samples.values() if s.get(SM_CLOCK)]
        masks = [int(v) for s in samples.values() for m in THROTTLE for v in s.get(m, [])]
        reasons = None
        for mask in masks:
            reasons = (reasons or 0) | mask
        out[node] = GpuFigures(
            sm_clock_mhz_mean=_mean(clocks), sm_clock_mhz_min=min(clocks) if clocks else None,
            throttle_reasons=reasons,
            power_mean_w=watts, power_source=power_from,
            energy_j=None if watts is None else round(watts * (end - start).total_seconds(), 3),
            source=sources[node], gpus=len(gpus[node]), samples=len(samples), util_mean_pct=_mean(utils),
            util_min_pct=min(utils) if utils else None, util_max_pct=max(utils) if utils else None,
            mem_used_mib_mean=_mean(used), mem_used_mib_max=max(used) if used else None,
            mem_total_mib=max(total) if total else None,
            reason=None if utils else odd or "memory reported, utilisation not")
    return out


def attach(res: LoadResult, figs: dict[str, GpuFigures], series_path: str | None = None) -> LoadResult:
    """``res`` with the GPU figures set: per node, on each NodeFigures, and the mean over the nodes."""
    utils = [f.util_mean_pct for f in figs.values() if f.util_mean_pct is not None]
    nodes = [n.model_copy(update={"gpu_util_pct": figs[n.node].util_mean_pct if n.node in figs else None,
                                  "gpu_mem_used_mib": figs[n.node].mem_used_mib_mean if n.node in figs else None})
             for n in res.nodes]
    srcs = sorted({f.source for f in figs.values() if f.source})
    sources = {**res.sources, "gpu": (f"node: {', '.join(srcs)} samples in the measured window, mean over the "
                                      "engine's GPUs per node"
                                      if srcs else "absent: no node reported GPU figures")}
    energy = (sum(f.energy_j for f in figs.values() if f.energy_j is not None)
              if figs and all(f.energy_j is not None for f in figs.values()) else None)
    tokens, answered = res.output_tps * res.duration_s, res.achieved_rps * res.duration_s
    if energy is not None:
        how = ", ".join(sorted({str(f.power_source) for f in figs.values()}))
        sources["energy"] = (f"GPU power of every node ({how}) x the measured window; per output token and per "
                             "answer of that window")
    else:
        missing = sorted(n for n, f in figs.items() if f.energy_j is None)
        sources["energy"] = f"absent: no GPU power from {', '.join(missing) or 'any node'}"
    return res.model_copy(update={
        "gpu": figs, "gpu_util_pct": _mean(utils), "nodes": nodes, "sources": sources, "gpu_series_path": series_path,
        "energy_j": None if energy is None else round(energy, 3),
        "energy_per_output_token_j": None if energy is None or tokens <= 0 else round(energy / tokens, 6),
        "energy_per_request_j": None if energy is None or answered <= 0 else round(energy / answered, 6)})


def gpu_verdict(figs: Mapping[str, GpuFigures], slo: SLO) -> list[str]:
    """Reasons the utilisation objective (``slo.min_gpu_util_pct``) is not met; [] when met or not set.
    Every node must reach it; a node that reported nothing cannot be judged, and that fails it."""
    want = slo.min_gpu_util_pct
    if want is None:
        return []
    if not figs:
        return [f"GPU utilisation was not measured; the SLO asks for at least {want:g} % (unset "
                "slo_min_gpu_util_pct, or give the nodes a DCGM exporter or nvidia-smi)"]
    out = []
    for node, f in sorted(figs.items()):
        if f.util_mean_pct is None or not in_range(UTIL, f.util_mean_pct):  # NaN < want is False: never a pass
            got = f.reason or f"{f.util_mean_pct} is no utilisation"
            out.append(f"node {node}: GPU utilisation not measured ({got}); the SLO asks for at least {want:g} %")
        elif f.util_mean_pct < want:
            out.append(f"node {node}: GPU utilisation {f.util_mean_pct:.1f} % (mean of {f.samples} samples) is under "
                       f"the SLO's {want:g} %")
    return out
