"""The engines' own view during a phase: each endpoint's Prometheus /metrics, scraped on an interval.

``Scraper`` runs in a thread beside k6, GETs ``<url>/metrics`` of every endpoint every ``interval_s``
(plus once before and once after the load) and keeps the series of the families in ``KEEP`` (vLLM's,
Triton's ``nv_``, the simulated engine's own, and DCGM's GPU gauges when the engine's page has them).
A failed scrape is a point of its own
(``metric="up"``, value 0): an endpoint that dies mid-phase shows in its series.

The series file (``<stem>.metrics.jsonl.gz``, one JSON object per line) is what the results store
ingests as server-metric series::

    {"ts": "2026-01-01T00:00:01.250000+00:00", "node": "n01", "phase": "sustained", "step": 0,
     "metric": "vllm:num_requests_running", "labels": {"model_name": "m"}, "value": 3.0}

``engine_figures`` turns the histograms into per-node figures between two scrapes (the measured
window): mean (exact: _sum/_count) and P50/P90/P99 interpolated within buckets, as Prometheus'
``histogram_quantile`` does — these are the figures labelled ``engine``.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import threading
import time
import urllib.request
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

from deploybench.load.results import Endpoint

LOG = logging.getLogger(__name__)

KEEP = ("vllm:", "nv_inference_", "nv_gpu_", "deploybench_sim_", "DCGM_FI_DEV_")  # DCGM: see gpu.py
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "itl": "vllm:inter_token_latency_seconds",
              "e2e": "vllm:e2e_request_latency_seconds"}
GAUGES = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}


def parse_metrics(text: str, keep: tuple[str, ...] = KEEP) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> [(name, labels, value)] of the kept families (comments skipped)."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#" or not line.startswith(keep):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


class Scraper:
    """Scrapes every endpoint's /metrics every ``interval_s`` in a thread; ``stop()`` returns the points."""

    def __init__(self, endpoints: list[Endpoint], interval_s: float, phase: str, step: int = 0,
                 timeout_s: float = 2.0) -> None:
        self.endpoints, self.interval_s, self.phase, self.step = endpoints, interval_s, phase, step
        self.timeout_s = min(timeout_s, max(0.5, interval_s))
        self.points: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape_once(self) -> None:
        for ep in self.endpoints:
            ts = datetime.now(UTC).isoformat()
            base = {"ts": ts, "node": ep.node, "phase": self.phase, "step": self.step}
            try:
                with urllib.request.urlopen(f"{ep.url.rstrip('/')}/metrics", timeout=self.timeout_s) as resp:
                    text = resp.read().decode("utf-8", "replace")
            except (OSError, ValueError) as exc:
                LOG.debug("scrape of %s failed: %r", ep.url, exc)
                self.points.append({**base, "metric": "up", "labels": {}, "value": 0.0})
                continue
            self.points.append({**base, "metric": "up", "labels": {}, "value": 1.0})
            self.points.extend({**base, "metric": n, "labels": lb, "value": v} for n, lb, v in parse_metrics(text))

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


def engine_figures(points: list[dict], start: datetime | None = None) -> dict[str, dict]:
    """Per node: the engine's histograms between the last scrape at or before ``start`` (else the
    first) and the last scrape; times in ms. Gauges: the max seen over the scrapes after ``start``."""
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
        for key, name in HISTOGRAMS.items():
            count = b.get((f"{name}_count", None), 0.0) - a.get((f"{name}_count", None), 0.0)
            total = b.get((f"{name}_sum", None), 0.0) - a.get((f"{name}_sum", None), 0.0)
            les = sorted({le for (m, le) in b if m == f"{name}_bucket" and le is not None}, key=float)
            cum = [(float(le), b[(f"{name}_bucket", le)] - a.get((f"{name}_bucket", le), 0.0)) for le in les]
            fig[f"{key}_count"] = int(count)
            fig[f"{key}_mean_ms"] = round(1000 * total / count, 3) if count > 0 else None
            for q in (0.5, 0.9, 0.99):
                v = _quantile(q, cum) if count > 0 else None
                fig[f"{key}_p{round(q * 100)}_ms"] = None if v is None else round(1000 * v, 3)
        after = [t for t in up if start is None or datetime.fromisoformat(t) >= start]
        for key, name in GAUGES.items():
            vals = [v for t in after for (m, _), v in _snapshot(pts, t).items() if m == name]
            fig[f"{key}_max"] = max(vals) if vals else None
        out[node] = fig
    return out
