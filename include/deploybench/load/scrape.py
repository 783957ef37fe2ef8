"""The engines' own view during a phase: each endpoint's Prometheus /metrics, scraped on an interval.

``Scraper`` runs in a thread beside k6, GETs every endpoint's Prometheus page (``Endpoint.page``: the engine
profile says its port and path) every ``interval_s`` (plus once before and once after the load) and keeps the
series of the families the engine profile's ``[metrics]`` map names (``keep_of``), and DCGM's GPU gauges when
the engine's page has them.
A failed scrape is a point of its own
(``metric="up"``, value 0): an endpoint that dies mid-phase shows in its series.

The series file (``<stem>.metrics.jsonl.gz``, one JSON object per line) is what the results store
ingests as server-metric series::

    {"ts": "2026-01-01T00:00:01.250000+00:00", "node": "n01", "phase": "sustained", "step": 0,
     "metric": "vllm:num_requests_running", "labels": {"model_name": "m"}, "value": 3.0}

``engine_figures`` turns them into per-node figures between two scrapes (the measured window), by the role
each family has in the profile's map (histograms, gauges, counters): the figures labelled ``engine``.

What an engine sends is hostile input (a node may be anyone's), so a page is read within bounds: at most
``MAX_PAGE_BYTES`` (``get_page``) and ``MAX_SAMPLES`` kept samples (``parse_metrics``), else it is refused
whole (a failed scrape, with a warning naming the URL and the size) rather than kept in part; a sample
whose value is not a finite number within ``MAX_VALUE``, whose ``le`` is not a number (or ``+Inf``), or
with more than ``MAX_LABELS`` labels or a label longer than ``MAX_LABEL_CHARS``, is left out (and counted).
So no NaN or infinity reaches a series, an engine figure or a stage record, and no page fails a phase.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import re
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path

from deploybench import http
from deploybench.engines import COUNTER_ROLES, GAUGE_ROLES, HISTOGRAM_ROLES, Metrics
from deploybench.load.results import Endpoint, LoadError, NodeFigures

LOG = logging.getLogger(__name__)

# Kept whatever the engine: DCGM-named GPU gauges on an engine's own page (gpu.py), and the simulated engine's
# exact occupancy integral they are checked against. The engine's figures: the names of its profile's map.
GPU_KEEP = ("DCGM_FI_DEV_", "deploybench_sim_")
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def keep_of(metrics: Metrics) -> tuple[str, ...]:
    """The families a scrape keeps: what the profile's map names (a histogram's _bucket/_sum/_count, a counter's
    _total with it), and GPU_KEEP."""
    return (*sorted(set(metrics.names.values())), *GPU_KEEP)


# The bounds of one page. A real vLLM /metrics page is 20-100 KB with 400-700 samples of the kept families
# (about 100 bytes a line); a data-parallel vLLM repeats them per engine (8 engines: ~5,000 samples, ~500 KB);
# a DCGM exporter's page with 8 GPUs is smaller. 4 MiB and 20,000 samples leave even that room four times
# over, and hold what one scrape of a hostile page costs to ~4 MiB of text and ~18 MB of points (a kept
# point is ~900 bytes), where an unbounded read kept a 23 MB page as 200,001 points and 174 MiB.
MAX_PAGE_BYTES = 4 << 20
MAX_SAMPLES = 20_000
MAX_LABELS = 32  # labels of one sample: vLLM's have 1-4, DCGM's about 10
MAX_LABEL_CHARS = 256  # a label value or name (or a metric name): model names, GPU UUIDs, bucket bounds are short
# |value| past it is no count, time or gauge an engine exports (1e18 us is 30,000 years), and sums of
# MAX_SAMPLES of them stay finite.
MAX_VALUE = 1e18

Sample = tuple[str, dict[str, str], float]


class MetricsPageError(LoadError):
    """A /metrics page refused whole: over ``MAX_PAGE_BYTES`` or ``MAX_SAMPLES`` (the module doc)."""


def get_page(url: str, timeout_s: float) -> str:
    """The text of the Prometheus page at ``url``, read at most ``MAX_PAGE_BYTES``: MetricsPageError past
    that (its message without the URL: the caller's log line names it), http.HTTPFailure when it does not
    answer 200 within ``timeout_s``."""
    try:
        return http.get_text(url, timeout=timeout_s, limit=MAX_PAGE_BYTES)
    except http.BodyTooLarge as exc:
        raise MetricsPageError(
            f"the page is {exc.size}, over the {MAX_PAGE_BYTES:,}-byte bound (a real engine's /metrics is tens "
            "of KB); refused unread: check what answers there") from None


def _bad(name: str, labels: dict[str, str], n_labels: int, value: float) -> str | None:
    """Why a parsed sample is not kept (None: it is)."""
    if not (math.isfinite(value) and abs(value) <= MAX_VALUE):
        return "value NaN, infinite, out of range or not a number"
    if n_labels > MAX_LABELS:
        return f"more than {MAX_LABELS} labels"
    if len(name) > MAX_LABEL_CHARS or any(len(k) > MAX_LABEL_CHARS or len(v) > MAX_LABEL_CHARS
                                          for k, v in labels.items()):
        return f"a name or label longer than {MAX_LABEL_CHARS} characters"
    if "le" in labels:
        try:
            le = float(labels["le"])
        except ValueError:
            le = math.nan
        if not (le == math.inf or (math.isfinite(le) and abs(le) <= MAX_VALUE)):
            return "le not a number (nor +Inf)"
    return None


def parse_metrics(text: str, keep: tuple[str, ...], dropped: Counter[str] | None = None) -> list[Sample]:
    """Prometheus text format -> [(name, labels, value)] of the kept families (comments skipped), within the
    bounds of the module doc: a bad sample is left out (counted by reason in ``dropped``), a page of more
    than ``MAX_SAMPLES`` kept samples is refused (MetricsPageError)."""
    out: list[Sample] = []
    for line in io.StringIO(text):  # line by line: never a list of every line of the page
        m = _LINE.match(line) if line.startswith(keep) else None
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            value = math.nan  # not a number: left out as such below
        pairs = _LABEL.findall(m.group(3) or "")
        labels = dict(pairs)
        why = _bad(m.group(1), labels, len(pairs), value)
        if why is not None:
            if dropped is not None:
                dropped[why] += 1
            continue
        if len(out) == MAX_SAMPLES:
            raise MetricsPageError(f"the page has more than {MAX_SAMPLES:,} samples of the kept families "
                                   f"({', '.join(keep)}); a real engine's has hundreds: refused")
        out.append((m.group(1), labels, value))
    return out


class Scraper:
    """Scrapes every endpoint's /metrics every ``interval_s`` in a thread; ``stop()`` returns the points."""

    def __init__(self, endpoints: list[Endpoint], interval_s: float, phase: str, step: int = 0,
                 timeout_s: float = 2.0, metrics: Metrics | None = None) -> None:
        self.endpoints, self.interval_s, self.phase, self.step = endpoints, interval_s, phase, step
        self.keep = keep_of(metrics or Metrics())  # no map: the GPU families only
        self.timeout_s = min(timeout_s, max(0.5, interval_s))
        self.points: list[dict] = []
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _warn(self, url: str, msg: str, *args: object) -> None:
        """Warn the first time an endpoint's page is refused or has samples left out; debug after (every interval)."""
        LOG.log(logging.DEBUG if url in self._warned else logging.WARNING, msg, *args)
        self._warned.add(url)

    def scrape_once(self) -> None:
        for ep in self.endpoints:
            url = ep.page
            base = {"ts": datetime.now(UTC).isoformat(), "node": ep.node, "phase": self.phase, "step": self.step}
            dropped: Counter[str] = Counter()
            try:
                samples = parse_metrics(get_page(url, self.timeout_s), self.keep, dropped=dropped)
            except MetricsPageError as exc:
                self._warn(url, "node %s: scrape of %s refused, counted as failed: %s", ep.node, url, exc)
                self.points.append({**base, "metric": "up", "labels": {}, "value": 0.0})
                continue
            except http.HTTPFailure as exc:
                LOG.debug("scrape of %s failed: %s", url, exc)
                self.points.append({**base, "metric": "up", "labels": {}, "value": 0.0})
                continue
            if dropped:
                self._warn(url, "node %s: %s: left out %s; its figures use the other %d samples", ep.node, url,
                           ", ".join(f"{n} with {why}" for why, n in dropped.most_common()), len(samples))
            self.points.append({**base, "metric": "up", "labels": {}, "value": 1.0})
            self.points.extend({**base, "metric": n, "labels": lb, "value": v} for n, lb, v in samples)

    def start(self) -> None:
        self.scrape_once()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_at = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            self.scrape_once()
            next_at += self.interval_s

    def stop(self) -> list[dict]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s * len(self.endpoints) + 5)
        self.scrape_once()
        return list(self.points)


def save_series(points: list[dict], path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        for p in points:
            fh.write(json.dumps(p, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def read_series(path: str | Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile over cumulative (le, count) pairs sorted by le."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_c = q * buckets[-1][1], 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return prev_le


def _snapshot(points: list[dict], ts: str) -> dict:
    """The scrape at ``ts``: {(metric, le or None): value summed over the other labels}."""
    snap: dict = defaultdict(float)
    for p in points:
        if p["ts"] == ts:
            snap[(p["metric"], p["labels"].get("le"))] += p["value"]
    return snap


def _counter(snap: dict, name: str) -> float | None:
    """A counter's value in one scrape, under its name or the name with ``_total`` (prometheus_client adds it on
    the page); None when the page has neither."""
    for n in (name, f"{name}_total"):
        if (n, None) in snap:
            return snap[(n, None)]
    return None


def _delta(a: dict, b: dict, name: str) -> float | None:
    """A counter's increase between two scrapes (None: absent from the later one; a restart reads from 0)."""
    vb, va = _counter(b, name), _counter(a, name)
    if vb is None:
        return None
    return vb - (va or 0.0) if va is not None and vb >= va else vb


def _ratio(x: float | None, y: float | None, scale: float = 1.0) -> float | None:
    return None if x is None or not y else scale * x / y


def engine_figures(points: list[dict], start: datetime | None = None, metrics: Metrics | None = None
                   ) -> dict[str, dict]:
    """Per node, by the roles of the profile's map (``metrics.names``; a role it does not map has no figure, a role
    it maps that the page lacks is None: absent, never 0), between the last scrape at or before ``start`` (else
    the first) and the last scrape:

    - histograms (ttft, itl, e2e, queue): ``<role>_count``, ``_mean_ms`` (exact: _sum/_count) and
      ``_p50/_p90/_p99_ms`` interpolated within buckets, as Prometheus' ``histogram_quantile`` does;
    - gauges (running, waiting, kv_usage, resident_memory): ``<role>_max`` over the scrapes after ``start``, and
      ``_mean``; ``resident_memory_growth``: its last value less its value at the window's start (bytes);
    - counters: ``<role>`` the increase; and what they give together: ``prefix_hit_rate`` (hits / queries),
      ``batch_mean`` (Triton's inferences / executions: the average batch size), ``queue_mean_ms`` and
      ``compute_mean_ms`` (Triton's cumulative microseconds over the requests that succeeded in the window).

    These are the figures labelled ``engine``."""
    names = (metrics or Metrics()).names
    by_node: dict[str, list[dict]] = defaultdict(list)
    for p in points:
        by_node[p["node"]].append(p)
    out = {}
    for node, pts in sorted(by_node.items()):
        up = sorted({p["ts"] for p in pts if p["metric"] == "up" and p["value"] == 1.0})
        fig: dict = {"scrapes": len(up),
                     "scrape_errors": sum(1 for p in pts if p["metric"] == "up" and p["value"] == 0)}
        if len(up) < 2:
            out[node] = fig
            continue
        before = [t for t in up if start is None or datetime.fromisoformat(t) <= start]
        t0, t1 = (before[-1] if before else up[0]), up[-1]
        a, b = _snapshot(pts, t0), _snapshot(pts, t1)
        for key in (r for r in HISTOGRAM_ROLES if r in names):
            name = names[key]
            count = b.get((f"{name}_count", None), 0.0) - a.get((f"{name}_count", None), 0.0)
            total = b.get((f"{name}_sum", None), 0.0) - a.get((f"{name}_sum", None), 0.0)
            les = sorted({le for (m, le) in b if m == f"{name}_bucket" and le is not None}, key=float)
            cum = [(float(le), b[(f"{name}_bucket", le)] - a.get((f"{name}_bucket", le), 0.0)) for le in les]
            fig[f"{key}_count"] = int(count) if (f"{name}_count", None) in b else None
            fig[f"{key}_mean_ms"] = round(1000 * total / count, 3) if count > 0 else None
            for q in (0.5, 0.9, 0.99):
                v = _quantile(q, cum) if count > 0 else None
                fig[f"{key}_p{round(q * 100)}_ms"] = None if v is None else round(1000 * v, 3)
        after = [t for t in up if start is None or datetime.fromisoformat(t) >= start]
        snaps = [_snapshot(pts, t) for t in after]
        for key in (r for r in GAUGE_ROLES if r in names):
            vals = [v for snap in snaps for (m, _), v in snap.items() if m == names[key]]
            fig[f"{key}_max"] = max(vals) if vals else None
            fig[f"{key}_mean"] = round(sum(vals) / len(vals), 6) if vals else None
        if "resident_memory" in names:  # a leak shows as growth over the window (deploybench.analyse.findings)
            ra, rb = a.get((names["resident_memory"], None)), b.get((names["resident_memory"], None))
            fig["resident_memory_growth"] = None if ra is None or rb is None else rb - ra
        counted = {key: _delta(a, b, names[key]) for key in COUNTER_ROLES if key in names}
        fig.update(counted)
        if "prefix_hits" in names and "prefix_queries" in names:
            fig["prefix_hit_rate"] = _ratio(counted["prefix_hits"], counted["prefix_queries"])
        if "inferences" in names and "executions" in names:
            fig["batch_mean"] = _ratio(counted["inferences"], counted["executions"])
        for key in ("queue_us", "compute_us", "request_us"):
            if key in names and "success" in names:
                fig[f"{key[:-3]}_mean_ms"] = _ratio(counted[key], counted["success"], 1e-3)
        # the samples are finite and bounded (parse_metrics), but a hostile page can still make a quotient
        # overflow (a _sum over a _count of 1e-300): such a figure is absent, never NaN or infinity
        out[node] = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in fig.items()}
    return out


# NodeFigures field <- engine figure (``engine_figures``): what the findings read, typed
NODE_SIGNALS = {"running_max": "running_max", "waiting_mean": "waiting_mean", "kv_usage_mean": "kv_usage_mean",
                "preemptions": "preemptions", "resident_memory_growth_bytes": "resident_memory_growth",
                "batch_mean": "batch_mean", "inferences": "inferences"}


def with_engine_signals(nodes: list[NodeFigures], engine: dict[str, dict]) -> list[NodeFigures]:
    """``nodes`` with their engine's figures of ``NODE_SIGNALS`` set (finite numbers only; else absent)."""
    out = []
    for n in nodes:
        fig = engine.get(n.node) or {}
        vals = {field: fig.get(key) for field, key in NODE_SIGNALS.items()}
        out.append(n.model_copy(update={k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool)
                                        and math.isfinite(v) else None for k, v in vals.items()}))
    return out
