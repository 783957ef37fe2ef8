"""The team's Prometheus as a source: each node's figures over a load window, read with ``query_range``.

deploybench scrapes the engines' own /metrics itself (``scrape.py``, source ``scrape``); where the team already runs
a Prometheus (node exporter on every node, DCGM exporter, the engines scraped), it holds what deploybench cannot
see from the engine's page: node CPU, memory and network, GPU power, temperature, clocks and throttle reasons.
``node_windows`` asks it, for one window (a phase's measured window, or one probe step's), one aggregated query per
node and figure (``queries``: PromQL built here, from the source's label selectors and the engine profile's names),
at ``step_s`` (the scrape interval), and turns each answer into a ``NodeWindow`` (mean, max, samples) with
``source="prometheus"``; a figure without a series, or a Prometheus that does not answer, is absent with its
reason, never 0.

The source (``PromSource``) comes from an Airflow connection (``deploybench.airflow.connections.prometheus_source``,
default id ``deploybench_prometheus``: host, port, schema; extras name the selectors) or from ``deploybench run
--prometheus URL`` without Airflow. Its selectors are templates in which ``{node}`` and ``{address}`` stand for the
inventory node's name and address (regex-escaped as they are put in): the default,
``instance=~"{address}(:[0-9]+)?"``, matches every target Prometheus scrapes on the node's address.

What Prometheus answers is hostile input like any node's (``read_matrix``): at most ``MAX_ANSWER_BYTES``, a JSON
object whose ``status`` is "success" and whose data is a matrix of at most ``MAX_SERIES`` series of at most
``MAX_POINTS`` points; a value that is not a finite number within ``MAX_VALUE`` (NaN, +Inf, "abc") is left out and
counted; points outside the window (plus a step) are left out; labels are bounded in number and length.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlencode, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deploybench import http
from deploybench.engines import Metrics
from deploybench.errors import ConfigError
from deploybench.load.results import LoadError, LoadResult, NodeWindow

LOG = logging.getLogger(__name__)

CONN_ID = "deploybench_prometheus"
DEFAULT_SELECTOR = 'instance=~"{address}(:[0-9]+)?"'
MAX_ANSWER_BYTES = 8 << 20  # a window of 10 min at 1 s is 600 points of ~30 bytes: 8 MiB is far past any answer
MAX_SERIES = 64  # every query is aggregated to one series: more is not an answer to it
MAX_POINTS = 11_000  # Prometheus itself refuses more than 11,000 points a series (its query_range limit)
MAX_LABELS = 32
MAX_LABEL_CHARS = 256
MAX_VALUE = 1e18  # as scrape.MAX_VALUE: no gauge or rate of a node is that large
_NAME_VALUE = re.compile(r"^[A-Za-z0-9_.:\-\[\]]{1,253}$")  # an inventory node's name or address, put in a regex
_MATCHER = r'\s*[A-Za-z_][A-Za-z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\\n]|\\.)*"\s*'
_SELECTOR = re.compile(rf"^{_MATCHER}(?:,{_MATCHER})*$")

# Figure -> (family, unit, PromQL template). {sel} is the node's matchers, {r} the rate range. The node exporter's
# names: prometheus/node_exporter collector/{cpu,meminfo,netdev}_linux.go; DCGM's: NVIDIA/dcgm-exporter
# etc/default-counters.csv (DCGM_FI_DEV_SM_CLOCK, _GPU_TEMP, _POWER_USAGE, _GPU_UTIL, _FB_USED) and DCGM's
# dcgm_fields.h (DCGM_FI_DEV_CLOCK_THROTTLE_REASONS, a bit mask: max over the window > 0 means it throttled).
NODE_QUERIES: dict[str, tuple[str, str, str]] = {
    "cpu_busy_pct": ("node", "%", '100 * (1 - avg(rate(node_cpu_seconds_total{{mode="idle",{sel}}}[{r}])))'),
    "mem_used_bytes": ("node", "B",
                       "sum(node_memory_MemTotal_bytes{{{sel}}} - node_memory_MemAvailable_bytes{{{sel}}})"),
    "net_rx_bytes_per_s": ("node", "B/s", 'sum(rate(node_network_receive_bytes_total{{device!="lo",{sel}}}[{r}]))'),
    "net_tx_bytes_per_s": ("node", "B/s", 'sum(rate(node_network_transmit_bytes_total{{device!="lo",{sel}}}[{r}]))'),
    "gpu_util_pct": ("gpu", "%", "avg(DCGM_FI_DEV_GPU_UTIL{{{sel}}})"),
    "gpu_mem_used_mib": ("gpu", "MiB", "sum(DCGM_FI_DEV_FB_USED{{{sel}}})"),
    "gpu_power_w": ("gpu", "W", "sum(DCGM_FI_DEV_POWER_USAGE{{{sel}}})"),
    "gpu_temp_c": ("gpu", "C", "max(DCGM_FI_DEV_GPU_TEMP{{{sel}}})"),
    "gpu_sm_clock_mhz": ("gpu", "MHz", "avg(DCGM_FI_DEV_SM_CLOCK{{{sel}}})"),
    "gpu_throttle_reasons": ("gpu", "mask", "max(DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{sel}}})"),
}
# the engine's series, by the role its profile maps (the profile is the one place an engine's names live)
ENGINE_ROLES: dict[str, tuple[str, str, str]] = {
    "running": ("engine_running", "requests", "sum({name}{{{sel}}})"),
    "waiting": ("engine_waiting", "requests", "sum({name}{{{sel}}})"),
    "kv_usage": ("engine_kv_usage", "fraction", "avg({name}{{{sel}}})"),
}
UNITS = {**{k: v[1] for k, v in NODE_QUERIES.items()}, **{v[0]: v[1] for v in ENGINE_ROLES.values()}}


class PromAnswerError(LoadError):
    """What Prometheus answered is not a matrix of finite numbers within the bounds (the module doc)."""


class PromSource(BaseModel):
    """Where the team's Prometheus answers and how its series map to inventory nodes."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="http(s)://host:port[/prefix] of Prometheus' HTTP API")
    node_selector: str = Field(DEFAULT_SELECTOR, description="matchers of a node's node-exporter series")
    gpu_selector: str | None = Field(None, description="matchers of a node's DCGM series (None: node_selector)")
    engine_selector: str | None = Field(None, description="matchers of a node's engine series (None: node_selector)")
    step_s: float = Field(1.0, gt=0, le=300, description="query_range step: the scrape interval")
    timeout_s: float = Field(5.0, gt=0, le=60, description="each query's bound")
    remote_write: bool = Field(False, description="k6 may remote-write its metrics to this Prometheus")

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        u = urlsplit(v.strip())
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise ValueError(f"Prometheus URL {v[:200]!r} is not http(s)://host:port[/prefix]; e.g. "
                             "http://prometheus.example:9090")
        return v.strip().rstrip("/")

    @field_validator("node_selector", "gpu_selector", "engine_selector")
    @classmethod
    def _selector(cls, v: str | None) -> str | None:
        if v is not None:
            check_selector(v)
        return v

    @classmethod
    def of_connection(cls, host: str | None, port: int | None, schema: str | None, extra: dict) -> PromSource:
        """From an Airflow connection's fields: ``schema`` the URL scheme (http, https), ``host`` (may carry a
        path prefix: prom.example/prometheus), ``port``; extras: node_selector, gpu_selector, engine_selector,
        step_s, timeout_s, remote_write (anything else is refused by name)."""
        if not host:
            raise ConfigError("the Prometheus connection has no host; set it to Prometheus' host name or address")
        scheme = (schema or "http").lower()
        base, _, prefix = host.partition("/")
        url = f"{scheme}://{base}{f':{port}' if port else ''}{'/' + prefix if prefix else ''}"
        try:
            return cls(url=url, **extra)
        except ValueError as exc:
            raise ConfigError(f"the Prometheus connection's fields or extras are not valid: {exc}") from exc

    def remote_write_url(self) -> str:
        """Prometheus' remote-write receiver (--web.enable-remote-write-receiver): ``/api/v1/write``."""
        return f"{self.url}/api/v1/write"


def parse_source(value: str | dict | PromSource | None) -> PromSource | None:
    """A source from what a caller holds: a PromSource, its dict, a URL, or a JSON object; ConfigError names a bad
    one (before any stage touches a node)."""
    if value is None or isinstance(value, PromSource):
        return value
    try:
        if isinstance(value, dict):
            return PromSource(**value)
        text = value.strip()
        return PromSource(**json.loads(text)) if text.startswith("{") else PromSource(url=text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"the Prometheus source {str(value)[:200]!r} is not valid: {exc}; give a URL "
                          "(http://host:9090) or a JSON object with url, node_selector, step_s ...") from exc


def check_selector(text: str) -> str:
    """A comma-separated list of label matchers (``instance=~"..."``, ``job="node"``), templates allowed: what
    goes between a metric's braces, and nothing else (no brace, no second query)."""
    probe = text.replace("{node}", "n").replace("{address}", "a")
    if len(text) > 1000 or not _SELECTOR.match(probe):
        raise ConfigError(f"Prometheus selector {text[:200]!r} is not a list of label matchers; write e.g. "
                          f"{DEFAULT_SELECTOR!r} ({{node}} and {{address}} stand for the inventory node's)")
    return text


def _regex_literal(value: str, what: str) -> str:
    """``value`` as a literal inside a PromQL regex inside a double-quoted string."""
    if not _NAME_VALUE.match(value):
        raise ConfigError(f"node {what} {value[:80]!r} cannot be put in a Prometheus selector (letters, digits and "
                          ". : - _ [ ] only)")
    return re.escape(value).replace("\\", "\\\\")


def selector(template: str, node: str, address: str) -> str:
    """The node's matchers from a selector template (``check_selector``)."""
    check_selector(template)
    return (template.replace("{node}", _regex_literal(node, "name"))
            .replace("{address}", _regex_literal(address, "address")))


def rate_range(step_s: float) -> str:
    """The range of ``rate()``: four scrape intervals (at least 2 s), Prometheus' own rule of thumb."""
    return f"{max(2, math.ceil(4 * step_s))}s"


def queries(source: PromSource, node: str, address: str, metrics: Metrics | None = None) -> dict[str, str]:
    """Figure -> PromQL for one node: the node exporter's and DCGM's (``NODE_QUERIES``), and the engine's series
    its profile maps (``ENGINE_ROLES``); every query is aggregated to one series."""
    sels = {"node": selector(source.node_selector, node, address),
            "gpu": selector(source.gpu_selector or source.node_selector, node, address),
            "engine": selector(source.engine_selector or source.node_selector, node, address)}
    r = rate_range(source.step_s)
    out = {key: tpl.format(sel=sels[family], r=r) for key, (family, _, tpl) in NODE_QUERIES.items()}
    names = (metrics or Metrics()).names
    for role, (key, _, tpl) in ENGINE_ROLES.items():
        if role in names:
            out[key] = tpl.format(name=names[role], sel=sels["engine"])
    return out


def range_url(source: PromSource, query: str, start: datetime, end: datetime) -> str:
    params = {"query": query, "start": f"{start.timestamp():.3f}", "end": f"{end.timestamp():.3f}",
              "step": f"{source.step_s:g}s", "timeout": f"{source.timeout_s:g}s"}
    return f"{source.url}/api/v1/query_range?{urlencode(params)}"


@dataclass
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix time, value), finite values only
    dropped: int = 0  # points left out: not finite, out of range, outside the window


def _value(raw: object) -> float | None:
    """A sample's value as Prometheus sends it (a string: "1.5", "NaN", "+Inf"), None when not a finite number in
    range."""
    if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
        return None
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) and abs(v) <= MAX_VALUE else None


def read_matrix(status: int, body: str, start: float | None = None, end: float | None = None,
                slack_s: float = 0.0) -> list[Series]:
    """The series of a ``query_range`` answer, within the module doc's bounds; PromAnswerError says what is
    wrong. Points outside [start - slack_s, end + slack_s] are left out (counted in ``Series.dropped``)."""
    if len(body) > MAX_ANSWER_BYTES:
        raise PromAnswerError(f"the answer is {len(body):,} bytes, over the {MAX_ANSWER_BYTES:,}-byte bound")
    try:
        doc = json.loads(body)
    except ValueError:
        raise PromAnswerError(f"HTTP {status}: the answer is not JSON: {body[:120]!r}") from None
    if not isinstance(doc, dict):
        raise PromAnswerError(f"HTTP {status}: the answer is a JSON {type(doc).__name__}, not an object")
    if doc.get("status") != "success" or status != 200:
        raw_err = doc.get("error")
        err = raw_err if isinstance(raw_err, str) else ""
        raise PromAnswerError(f"HTTP {status}, status {str(doc.get('status'))[:40]!r}: {err[:300]}")
    data = doc.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise PromAnswerError("the answer's data is not a matrix (resultType 'matrix' with a result list)")
    result = data["result"]
    if len(result) > MAX_SERIES:
        raise PromAnswerError(f"the answer has {len(result):,} series, over the bound of {MAX_SERIES}")
    lo = -math.inf if start is None else start - slack_s
    hi = math.inf if end is None else end + slack_s
    out = []
    for item in result:
        if not isinstance(item, dict):
            raise PromAnswerError("a series of the answer is not an object")
        metric, values = item.get("metric", {}), item.get("values")
        if not isinstance(metric, dict) or not isinstance(values, list):
            raise PromAnswerError("a series has no 'metric' object or no 'values' list")
        if len(metric) > MAX_LABELS or any(not isinstance(k, str) or not isinstance(v, str) or len(k) > MAX_LABEL_CHARS
                                           or len(v) > MAX_LABEL_CHARS for k, v in metric.items()):
            raise PromAnswerError(f"a series' labels are not at most {MAX_LABELS} strings of at most "
                                  f"{MAX_LABEL_CHARS} characters")
        if len(values) > MAX_POINTS:
            raise PromAnswerError(f"a series has {len(values):,} points, over the bound of {MAX_POINTS:,}")
        s = Series(dict(metric), [])
        for p in values:
            t = _value(p[0]) if isinstance(p, list) and len(p) == 2 else None
            v = _value(p[1]) if t is not None else None
            if t is None or v is None or not lo <= t <= hi:
                s.dropped += 1
                continue
            s.points.append((t, v))
        out.append(s)
    return out


def figure(node: str, key: str, series: list[Series], query: str) -> NodeWindow:
    """One figure from the (at most one) series of its aggregated query."""
    if len(series) > 1:
        return NodeWindow(node=node, metric=key, source="prometheus", unit=UNITS.get(key, ""),
                          reason=f"prometheus: {len(series)} series for an aggregated query (expected one): {query}")
    pts = [v for _, v in series[0].points] if series else []
    dropped = series[0].dropped if series else 0
    if not pts:
        why = (f"prometheus: {dropped} points, none a finite number in the window" if dropped
               else f"prometheus: no series for {query}")
        return NodeWindow(node=node, metric=key, source="prometheus", unit=UNITS.get(key, ""), reason=why)
    return NodeWindow(node=node, metric=key, source="prometheus", unit=UNITS.get(key, ""),
                      mean=round(sum(pts) / len(pts), 6), max=round(max(pts), 6), samples=len(pts),
                      reason=f"{dropped} points left out (not finite or outside the window)" if dropped else None)


def node_windows(source: PromSource, nodes: Sequence[tuple[str, str]], start: datetime, end: datetime,
                 metrics: Metrics | None = None) -> list[NodeWindow]:
    """Every node's figures over [start, end] (``nodes``: (name, address)). A Prometheus that does not answer at all
    is asked once, not once per figure: every figure is then absent with that reason."""
    out: list[NodeWindow] = []
    down: str | None = None
    for node, address in nodes:
        for key, query in queries(source, node, address, metrics).items():
            unit = UNITS.get(key, "")
            if down is not None:
                out.append(NodeWindow(node=node, metric=key, source="prometheus", unit=unit, reason=down))
                continue
            url = range_url(source, query, start, end)
            try:
                status, body = http.request(url, timeout=source.timeout_s, limit=MAX_ANSWER_BYTES)
                series = read_matrix(status, body, start.timestamp(), end.timestamp(), source.step_s)
            except http.HTTPFailure as exc:
                if exc.status is None:
                    down = f"prometheus at {source.url} did not answer: {str(exc.body)[:200]}"
                    LOG.warning("node figures from Prometheus are absent: %s", down)
                else:
                    LOG.warning("prometheus: %s: %s", key, exc)
                out.append(NodeWindow(node=node, metric=key, source="prometheus", unit=unit,
                                      reason=down or f"prometheus: {str(exc)[:200]}"))
                continue
            except PromAnswerError as exc:
                LOG.warning("prometheus answer for %s of %s refused: %s", key, node, exc)
                out.append(NodeWindow(node=node, metric=key, source="prometheus", unit=unit,
                                      reason=f"prometheus answer refused: {exc}"))
                continue
            out.append(figure(node, key, series, query))
    return out


# what deploybench's own scrape of the engine's page measured, under the same figure names: GpuFigures field
# (mean, max) and the engine figures' role (scrape.engine_figures: <role>_mean, <role>_max)
SCRAPED_GPU = {"gpu_util_pct": ("util_mean_pct", "util_max_pct"),
               "gpu_mem_used_mib": ("mem_used_mib_mean", "mem_used_mib_max"),
               "gpu_power_w": ("power_mean_w", None)}


def scraped_windows(res: LoadResult) -> list[NodeWindow]:
    """The figures of ``res`` that deploybench scraped itself (source ``scrape``), beside which Prometheus' stand."""
    out: list[NodeWindow] = []
    for node, g in sorted(res.gpu.items()):
        for key, (mean_f, max_f) in SCRAPED_GPU.items():
            mean = getattr(g, mean_f)
            out.append(NodeWindow(node=node, metric=key, source="scrape", unit=UNITS[key], mean=mean,
                                  max=getattr(g, max_f) if max_f else None,
                                  samples=g.samples if mean is not None else 0,
                                  reason=None if mean is not None else (g.reason or "not reported by the node")))
    for node, fig in sorted(res.engine.items()):
        for role, (key, unit, _) in ENGINE_ROLES.items():
            if f"{role}_mean" not in fig:
                continue  # the profile does not map it
            mean = fig.get(f"{role}_mean")
            out.append(NodeWindow(node=node, metric=key, source="scrape", unit=unit, mean=mean,
                                  max=fig.get(f"{role}_max"), samples=int(fig.get("scrapes") or 0) if mean is not None
                                  else 0, reason=None if mean is not None else "not on the engine's page"))
    return out
