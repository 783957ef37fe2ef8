"""The load stage's typed results: what one k6 run (a phase, or one step of the capacity search) measured.

Every latency figure names where it comes from (``LoadResult.sources``): ``client`` figures are
measured by deploybench's own load generators on every request they sent, ``engine`` figures are read
from the engine's Prometheus histograms. ``model_dump(mode="json")`` is what goes to XCom, the stage
record and the results store; fields are only ever added, so older readers keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel, Field

from deploybench.errors import DeploybenchError


class LoadError(DeploybenchError):
    """k6 could not run the phase: a script error, a crash, a missing binary, an overrun, unreadable output."""


class EndpointNotReady(LoadError):
    """An endpoint did not answer its readiness path when k6's setup() checked it."""


@dataclass(frozen=True)
class Endpoint:
    """One serving endpoint: the node it runs on, its base URL (http://10.0.0.11:8000), its model name, and its
    Prometheus page ("": ``<url>/metrics``; an engine profile may name another port and path: Triton's 8002)."""

    node: str
    url: str
    model: str
    metrics_url: str = ""
    gpus: tuple[str, ...] = ()  # the GPUs the engine was given (DCGM's "gpu" label); (): every GPU the node reports
    pod: str = ""  # on Kubernetes: its pod (the DCGM exporter's "pod" label says which GPUs are the pod's)
    host: str = ""  # where the node's own exporters answer (its address); "": the URL's host

    @classmethod
    def of(cls, e: dict, metrics_url: str = "", host: str = "") -> Endpoint:
        """An endpoint as a rollout records it ({"node", "url", "model"}, "gpus" on the ssh backend, "pod" on
        Kubernetes); values that are not what they should be are left out (a record is a file on disk)."""
        gpus = e.get("gpus")
        pod = e.get("pod")
        return cls(str(e["node"]), str(e["url"]), str(e["model"]), metrics_url,
                   tuple(str(g) for g in gpus if isinstance(g, (str, int)))[:64] if isinstance(gpus, list) else (),
                   pod if isinstance(pod, str) else "", host)

    def has_gpu(self, labels: dict) -> bool:
        """Whether a GPU series with ``labels`` is one of this engine's GPUs."""
        if self.pod:
            return labels.get("pod") == self.pod
        return not self.gpus or str(labels.get("gpu", "0")) in self.gpus

    @property
    def page(self) -> str:
        return self.metrics_url or f"{self.url.rstrip('/')}/metrics"


class Figures(BaseModel):
    """What a phase (or a window, or a node) measured over its measured window (warm-up excluded).

    ``requests``/``errors``/latencies are over requests *started* in the window; ``achieved_rps`` and
    ``goodput_rps`` count requests *answered* in the window (so a server that falls behind shows as
    achieved < offered even though the open-model client keeps sending on time)."""

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
    ttft_p50_ms: float | None = None  # client: the SSE sampler's streamed requests (see ttft.py)
    ttft_p99_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p999_ms: float | None = None
    ttft_samples: int = 0
    itl_p50_ms: float | None = None  # client: gaps between the sampler's streamed tokens
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_p999_ms: float | None = None
    sent_rps: float = 0.0  # requests started per second (what the client offered, as it managed)
    goodput_rps: float = 0.0  # answered in the window, succeeded, within the SLO's latency limits
    goodput_ratio: float | None = None  # goodput / requests answered in the window
    lag_p50_ms: float | None = None  # schedule lag of k6's requests: start - when it was due
    lag_p99_ms: float | None = None
    lag_max_ms: float | None = None
    # added with the keep-up judgement (issue 17): what answered counts alone cannot see (figures.py)
    in_flight_start: int | None = None  # requests sent and not yet answered at the window's start (None: not
    in_flight_end: int | None = None  # ... at its end                        measured, an older record)
    kept_up: int | None = None  # requests started in the window answered (successfully) by its end + a grace
    latency_open_p99_ms: float | None = None  # P99 over every request started, failed ones at their give-up time


class GpuFigures(BaseModel):
    """One node's GPUs over a measured window (``deploybench.load.gpu``): utilisation and memory as the
    node's DCGM exporter or ``nvidia-smi`` reported them. ``source`` None: not measured (``reason`` says
    why) - absent, never zero."""

    source: str | None = None  # "dcgm" (the engine's or an exporter's /metrics) | "nvidia-smi"
    reason: str | None = None
    gpus: int = 0
    samples: int = 0
    util_mean_pct: float | None = None  # mean over the samples in the window of the mean over the GPUs
    util_min_pct: float | None = None
    util_max_pct: float | None = None
    mem_used_mib_mean: float | None = None  # summed over the node's GPUs
    mem_used_mib_max: float | None = None
    mem_total_mib: float | None = None
    # the engine's GPUs' power, summed (from DCGM's energy counter, else its power gauge; None: not reported),
    # and the energy of the measured window (that power x the window's length)
    power_mean_w: float | None = None
    power_source: str | None = None
    energy_j: float | None = None
    # added with the findings (issue 29): the SM clock (mean over the samples of the mean over the GPUs, and its
    # lowest), and DCGM's clock-throttle reasons seen in the window (the bitwise OR of every sample; None: not reported)
    sm_clock_mhz_mean: float | None = None
    sm_clock_mhz_min: float | None = None
    throttle_reasons: int | None = None


class NodeWindow(BaseModel):
    """One node's figure over one load window (a phase's measured window, or one probe step's) from one source:
    ``prometheus`` (the team's Prometheus, ``query_range``: deploybench.load.prom) or ``scrape`` (deploybench's own
    scrape of the engine's /metrics). ``mean``/``max`` None: absent, ``reason`` says why (never 0)."""

    node: str
    metric: str  # cpu_busy_pct, mem_used_bytes, net_rx_bytes_per_s, gpu_util_pct, engine_running ... (prom.UNITS)
    source: str
    unit: str = ""
    mean: float | None = None
    max: float | None = None
    samples: int = 0
    reason: str | None = None


class NodeFigures(Figures):
    node: str
    gpu_util_pct: float | None = None  # GpuFigures.util_mean_pct of the node (None: not measured)
    gpu_mem_used_mib: float | None = None
    # added with the findings (issue 29): the node's engine over the measured window, from its /metrics
    # (``scrape.engine_figures``, by the roles of the engine profile's map; None: not mapped or not on its page)
    running_max: float | None = None  # requests in the batch, the most in one scrape
    waiting_mean: float | None = None  # requests queued, mean over the scrapes
    kv_usage_mean: float | None = None  # KV cache in use (0-1), mean over the scrapes
    preemptions: float | None = None  # sequences preempted in the window (a counter's increase)
    resident_memory_growth_bytes: float | None = None  # the engine process's resident memory, end less start
    batch_mean: float | None = None  # Triton: inferences / executions (the mean batch)
    inferences: float | None = None  # Triton: inferences in the window


class TurnFigures(BaseModel):
    """One turn index of a conversation workload's measured requests: how many, their latency, their prompt (which
    grows with the conversation) and TTFT where the sampler measured it (it sends whole conversations, as k6 does)."""

    turn: int
    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    prompt_tokens_mean: float | None
    ttft_p99_ms: float | None = None
    ttft_samples: int = 0


class WindowFigures(Figures):
    """Figures of one time window of a phase (``start_s`` after the measured window's start)."""

    start_s: float
    duration_s: float
    offered_rps: float
    dropped_iterations: int = 0


class SloVerdict(BaseModel):
    passed: bool
    reasons: list[str]


class GeneratorFigures(BaseModel):
    """One load generator's share of a phase split by execution segments (deploybench.load.loadgen), over the
    measured window: what it sent, at what rate, how late against the schedule, what it dropped, and its clock's
    offset to the controller's as measured before the phase (None: not measured)."""

    name: str
    segment: str
    requests: int
    rps: float
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    dropped_iterations: int
    clock_offset_ms: float | None = None
    clock_rtt_ms: float | None = None
    k6_exit_code: int = 0
    k6_cpu_s: float | None = None


class LoadResult(Figures):
    """One k6 run's result (a phase, or one probe step)."""

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
    # added with the phases (issue 6); defaults keep older stage records readable
    step: int = 0
    k6_rps: float = 0.0  # the part of offered_rps k6 sent (the rest: the TTFT sampler)
    ttft_sample_rps: float = 0.0
    stages: list[tuple[float, float]] = Field(default_factory=list)  # a ramp: (target rate, seconds)
    windows: list[WindowFigures] = Field(default_factory=list)
    # conversations: figures by turn index (0 the first), the later turns carrying the conversation so far
    turns: list[TurnFigures] = Field(default_factory=list)
    # lengths in tokens, what the workload asked for beside what was sent and answered: {"prompt"|"output":
    # {"asked"|"served": {n, mean, p50, p90, p99, max}}} ("served": the engine's usage where it sent one)
    lengths: dict = Field(default_factory=dict)
    engine: dict = Field(default_factory=dict)  # per node: figures from the engine's /metrics (scrape.py)
    metrics_path: str | None = None  # the scraped /metrics series (NDJSON, see scrape.py)
    sources: dict[str, str] = Field(default_factory=dict)
    # added with GPU utilisation (issue 17)
    gpu: dict[str, GpuFigures] = Field(default_factory=dict)  # per node
    gpu_util_pct: float | None = None  # mean over the nodes that report one (None: no node does)
    # the GPUs' energy over the measured window, summed over the nodes, and per answer and per output token (None
    # unless every node reported its power: a partial sum would flatter the configuration)
    energy_j: float | None = None
    energy_per_request_j: float | None = None
    energy_per_output_token_j: float | None = None
    # several load generators (issue 31): each one's share; empty when the controller alone sent the load
    generators: list[GeneratorFigures] = Field(default_factory=list)
    gpu_series_path: str | None = None  # GPU samples taken beside the engine's /metrics (exporter, nvidia-smi)
    # the serving nodes' price over the measured window per million output tokens (deploybench.load.cost); None
    # when a serving node has no price in the inventory or no token was answered (the reason: sources["cost"])
    cost_per_million_output_tokens: float | None = None
    cost_currency: str | None = None
    cost_per_hour: float | None = None  # the serving nodes' prices together
    # added with Prometheus as a source (issue 29): per node, per figure and source, over the measured window; empty
    # unless a Prometheus source was given (then the scraped figures it can be compared with are listed too)
    node_windows: list[NodeWindow] = Field(default_factory=list)
    # dropped iterations (k6 out of VUs) in named spans of the measured window a phase asked for (run_load's
    # ``spans``: the spike phase's "lead", "spike", "recovery"); empty when it asked for none
    dropped_in: dict[str, int] = Field(default_factory=dict)
