"""The simulated engine's Prometheus metrics, under vLLM's names, buckets and ``model_name`` label.

Hand-rolled (no prometheus_client) because the set is small and fixed and the text format is
simple; the server-metrics scraper reads a sim and a real vLLM the same way. Inter-token
latency is observed per token under both ``vllm:inter_token_latency_seconds`` and the older
``vllm:time_per_output_token_seconds``, as vLLM 0.x observed the latter. The prefix cache's
``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total`` count prompt tokens looked up and found
(vllm/v1/metrics/loggers.py); with prefix caching off they stay 0, as vLLM's do. ``vllm:kv_cache_usage_perc`` is
the fraction (0-1) of the KV cache's blocks the running sequences hold: the blocks of their prompts and of what
they generated so far, a prompt block that several share (found in the prefix cache) counted once, as vLLM's
block pool counts them; the scheduler preempts before they would hold more (a sequence that alone does not fit
aside), so it stops at 1.

The sim has no GPU, so it exports the gauges NVIDIA's DCGM exporter would, derived from its batch
occupancy in closed form (what the load stage's GPU figures are tested against):

* ``DCGM_FI_DEV_GPU_UTIL`` (%) = 100 x running / max_num_seqs, time-averaged over the last
  ``GPU_UTIL_WINDOW_S`` (as DCGM averages over its sampling period); ``deploybench_sim_busy_slot_seconds_total``
  is the exact integral of running over time, so the mean over any interval is
  d(busy slot-seconds) / (max_num_seqs x dt);
* ``DCGM_FI_DEV_FB_USED`` (MiB) = model size + ``KV_MIB_PER_TOKEN`` x the tokens held by the running
  sequences (prompt + generated so far), rounded to whole MiB as DCGM reports;
  ``DCGM_FI_DEV_FB_FREE`` = ``GPU_MEMORY_MIB`` - used;
* ``DCGM_FI_DEV_POWER_USAGE`` (W) = ``IDLE_W`` + (``BUSY_W`` - ``IDLE_W``) x utilisation (the same windowed
  mean), and ``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`` (mJ since the engine started, a counter, as DCGM's is since
  the driver loaded) its exact integral: ``IDLE_W`` x t + (``BUSY_W`` - ``IDLE_W``) x busy slot-seconds /
  max_num_seqs; so the energy of any window is known in closed form from the occupancy;
* ``DCGM_FI_DEV_GPU_TEMP`` (C) = 35 + 45 x utilisation, ``DCGM_FI_DEV_SM_CLOCK`` (MHz) = ``SM_CLOCK_MHZ`` x the
  clock's fraction (1, or the throttle fault's), and ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` (a bitmask gauge) 0, or
  the throttle fault's reason (``deploybench.sim.faults.THROTTLE_REASON``: DCGM's SW thermal slowdown bit).
The names and units are dcgm-exporter's (etc/default-counters.csv of NVIDIA/dcgm-exporter; the throttle reasons are
DCGM field 112, DCGM_FI_DEV_CLOCK_THROTTLE_REASONS in NVIDIA/DCGM dcgmlib/dcgm_fields.h, which newer releases also
name DCGM_FI_DEV_CLOCKS_EVENT_REASONS). An engine started with ``dcgm=False`` (``--no-dcgm``: a node without DCGM)
leaves them off its page; its GPU is then read as nvidia-smi reads one (``smi_values``, the same figures under
nvidia-smi's query names, served at the engine's ``/sim/gpu`` for the lab's nvidia-smi stand-in,
deploybench.sim.nvidia_smi).

Faults (deploybench.sim.faults) show where an operator would look: ``vllm:num_preemptions_total`` (vLLM V1's
counter, vllm/v1/metrics/loggers.py) counts the scheduler's preemptions (0 on a clean engine), and
``process_resident_memory_bytes`` (what prometheus_client's process collector exports for vLLM's API server) is
the process's resident memory when it started plus ``leak_bytes_per_request`` x the requests answered: exactly
the start's on a clean engine.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right
from collections import deque

from deploybench.sim.service_model import BLOCK_TOKENS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, labels: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cum = 0
        for bound, n in zip(self.bounds, self.counts):
            cum += n
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {cum}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        out.append(f"{name}_count{{{labels}}} {self.count}")
        return out


GPU_UTIL_WINDOW_S = 1.0  # the DCGM utilisation gauge averages over this trailing window
GPU_MEMORY_MIB = 131072  # a GB10-class node: 128 GiB of (unified) memory
KV_MIB_PER_TOKEN = 0.125  # 128 KiB of KV cache per token (an 8B model in fp16)
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default: its share of the GPU's memory
GPU_LABELS = 'gpu="0",UUID="GPU-deploybench-sim",device="nvidia0",modelName="deploybench-sim"'
IDLE_W = 30.0  # the GB10-class GPU idle with a model loaded
BUSY_W = 140.0  # and every batch slot busy (DGX Spark's GB10 is a 140 W part)
SM_CLOCK_MHZ = 2000  # the simulated GPU's nominal SM clock (a throttled one runs at a fraction of it)
FALLBACK_RSS_BYTES = 64 << 20  # the resident memory reported when /proc/self/statm cannot be read


def process_rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm's second field, in pages)."""
    import os

    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return FALLBACK_RSS_BYTES


class Occupancy:
    """The integral over time of the number of running sequences (a step function), and its mean over
    a trailing window. ``set`` is called whenever the count changes; marks older than the window go."""

    __slots__ = ("t0", "marks")

    def __init__(self, now: float) -> None:
        self.t0 = now
        self.marks: deque = deque([(now, 0.0, 0)])  # (time, slot-seconds up to it, running from it on)

    def set(self, running: int, now: float) -> None:
        t, area, n = self.marks[-1]
        self.marks.append((now, area + n * max(0.0, now - t), running))
        while len(self.marks) > 2 and self.marks[1][0] < now - 2 * GPU_UTIL_WINDOW_S:
            self.marks.popleft()

    def area(self, at: float) -> float:
        """Slot-seconds from the start up to ``at`` (``at`` within the kept marks, or later)."""
        marks = self.marks
        i = max(0, bisect_right(marks, at, key=lambda m: m[0]) - 1)
        t, area, n = marks[i]
        return area + n * max(0.0, at - t)

    def mean(self, now: float, window: float) -> float:
        """Mean number running over ``[now - window, now]`` (since the start, if that is later)."""
        start = max(now - window, self.t0, self.marks[0][0])
        return (self.area(now) - self.area(start)) / (now - start) if now > start else float(self.marks[-1][2])


class EngineMetrics:
    """Counters, gauges and histograms of one engine; the scheduler and the handlers update them."""

    def __init__(self, model_name: str, slots: int = 1, model_bytes: int = 0, kv_blocks: int = 0, *,
                 clock_fraction: float = 1.0, leak_bytes_per_request: int = 0, dcgm: bool = True) -> None:
        from deploybench.sim.faults import THROTTLE_REASON

        self.labels = f'model_name="{model_name}"'
        self.dcgm = dcgm  # DCGM's gauges on the page (False: a node without DCGM, see the module doc)
        self.clock_fraction = clock_fraction
        self.throttle_reasons = THROTTLE_REASON if clock_fraction < 1.0 else 0
        self.leak_bytes_per_request = leak_bytes_per_request
        self.base_rss = process_rss_bytes()  # read once: the figure moves only by the leak (a closed form)
        self.answered = 0  # inference requests answered (200 or injected 500)
        self.preemptions = 0  # the scheduler's
        self.slots = max(1, slots)
        self.model_mib = model_bytes / 2**20
        self.occupancy = Occupancy(time.monotonic())
        self.started = self.occupancy.t0  # the energy counter counts from here
        self.kv_tokens = 0  # tokens held by the running sequences
        self.kv_blocks = kv_blocks  # the KV cache's size, in blocks (0: none, the usage reads 0)
        self._running: list = []  # the running sequences, for the KV usage (reckoned when scraped)
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, the tokens found there
        self.success = 0
        self.refused = 0  # 429: the queue was full
        self.errors = 0  # 500: injected
        self.failure = 0  # Triton's nv_inference_request_failure: every request not answered 200
        # cumulative microseconds, as Triton counts them (deploybench.sim.triton): waiting for a batch slot, from
        # admission to the last token, and the whole request
        self.queue_us = 0.0
        self.compute_us = 0.0
        self.request_us = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.queue = Histogram(E2E_BUCKETS)  # waiting for a batch slot (vLLM's request_queue_time_seconds)

    def batch(self, running: list, waiting: int, now: float | None = None) -> None:
        """The scheduler's state changed: ``running`` sequences (with ``prompt_tokens``/``generated``)."""
        self.running, self.waiting = len(running), waiting
        self._running = running
        self.kv_tokens = sum(s.prompt_tokens + s.generated for s in running)
        self.occupancy.set(self.running, time.monotonic() if now is None else now)

    def resident_bytes(self) -> int:
        """The resident memory reported: the start's, plus the leak fault's bytes per answered request."""
        return self.base_rss + self.leak_bytes_per_request * self.answered

    def kv_usage(self) -> float:
        """The fraction of the KV cache's blocks the running sequences hold (see the module doc)."""
        if not self.kv_blocks:
            return 0.0
        seqs = self._running
        shared = set().union(*(s.blocks for s in seqs))  # full prompt blocks, by hash: one copy each
        own = sum(-(-(s.prompt_tokens + s.generated) // BLOCK_TOKENS) - len(s.blocks) for s in seqs)
        return min(1.0, (len(shared) + own) / self.kv_blocks)

    def gpu_state(self, now: float | None = None) -> tuple[float, int, float, float]:
        """(utilisation %, memory used MiB, power W, energy mJ since the start) at ``now`` (see the module doc)."""
        now = time.monotonic() if now is None else now
        util = 100.0 * self.occupancy.mean(now, GPU_UTIL_WINDOW_S) / self.slots
        used = round(self.model_mib + KV_MIB_PER_TOKEN * self.kv_tokens)
        power = IDLE_W + (BUSY_W - IDLE_W) * util / 100.0
        energy_mj = 1000.0 * (IDLE_W * (now - self.started)
                              + (BUSY_W - IDLE_W) * self.occupancy.area(now) / self.slots)
        return util, used, power, energy_mj

    def smi_values(self, now: float | None = None) -> dict[str, float | str]:
        """The GPU as nvidia-smi's query fields read it (``nvidia-smi --help-query-gpu``): the same figures as the
        DCGM gauges, utilisation in whole % and memory in MiB as nvidia-smi prints them, power to 0.01 W."""
        util, used, power, _ = self.gpu_state(now)
        return {"utilization.gpu": round(util), "memory.used": used, "memory.total": GPU_MEMORY_MIB,
                "power.draw": round(power, 2), "clocks.sm": round(SM_CLOCK_MHZ * self.clock_fraction),
                "temperature.gpu": round(35 + 45 * util / 100.0), "name": "deploybench-sim",
                "driver_version": "deploybench-sim"}

    def gpu_lines(self, now: float | None = None) -> list[str]:
        """The DCGM-named gauges (see the module doc); without DCGM only the sim's own busy-slot counter."""
        now = time.monotonic() if now is None else now
        busy = ["# HELP deploybench_sim_busy_slot_seconds_total Integral of running sequences over time.",
                "# TYPE deploybench_sim_busy_slot_seconds_total counter",
                f"deploybench_sim_busy_slot_seconds_total{{{self.labels}}} {self.occupancy.area(now):.6f}"]
        if not self.dcgm:
            return busy
        util, used, power, energy_mj = self.gpu_state(now)
        g = GPU_LABELS
        return [
            "# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).", "# TYPE DCGM_FI_DEV_POWER_USAGE gauge",
            f"DCGM_FI_DEV_POWER_USAGE{{{g}}} {power:.3f}",
            "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot (in mJ).",
            "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter",
            f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{g}}} {energy_mj:.0f}",
            "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).", "# TYPE DCGM_FI_DEV_GPU_TEMP gauge",
            f"DCGM_FI_DEV_GPU_TEMP{{{g}}} {35 + 45 * util / 100.0:.0f}",
            "# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).", "# TYPE DCGM_FI_DEV_SM_CLOCK gauge",
            f"DCGM_FI_DEV_SM_CLOCK{{{g}}} {SM_CLOCK_MHZ * self.clock_fraction:.0f}",
            "# HELP DCGM_FI_DEV_CLOCK_THROTTLE_REASONS Throttling reasons (bitmask).",
            "# TYPE DCGM_FI_DEV_CLOCK_THROTTLE_REASONS gauge",
            f"DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{{{g}}} {self.throttle_reasons}",
            "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge",
            f"DCGM_FI_DEV_GPU_UTIL{{{g}}} {util:.3f}",
            "# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).", "# TYPE DCGM_FI_DEV_FB_USED gauge",
            f"DCGM_FI_DEV_FB_USED{{{g}}} {used}",
            "# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).", "# TYPE DCGM_FI_DEV_FB_FREE gauge",
            f"DCGM_FI_DEV_FB_FREE{{{g}}} {GPU_MEMORY_MIB - used}",
            *busy,
        ]

    def render(self) -> str:
        lb = self.labels
        out = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lb}}} {self.running}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lb}}} {self.waiting}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lb}}} {self.kv_usage():.6f}",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{lb}}} {self.prefix_queries}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{lb}}} {self.prefix_hits}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lb}}} {self.prompt_tokens}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lb}}} {self.generation_tokens}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{finished_reason="length",{lb}}} {self.success}',
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{lb}}} {self.preemptions}",
            "# HELP process_resident_memory_bytes Resident memory size in bytes.",
            "# TYPE process_resident_memory_bytes gauge",
            f"process_resident_memory_bytes {self.resident_bytes()}",
            "# HELP deploybench_sim_requests_refused_total Requests refused with 429 because the queue was full.",
            "# TYPE deploybench_sim_requests_refused_total counter",
            f"deploybench_sim_requests_refused_total{{{lb}}} {self.refused}",
            "# HELP deploybench_sim_requests_failed_total Requests answered 500 by the error_rate knob.",
            "# TYPE deploybench_sim_requests_failed_total counter",
            f"deploybench_sim_requests_failed_total{{{lb}}} {self.errors}",
        ]
        out += self.ttft.render("vllm:time_to_first_token_seconds", lb, "Histogram of time to first token in seconds.")
        out += self.itl.render("vllm:inter_token_latency_seconds", lb, "Histogram of inter-token latency in seconds.")
        out += self.itl.render(
            "vllm:time_per_output_token_seconds", lb, "Histogram of time per output token in seconds."
        )
        out += self.e2e.render(
            "vllm:e2e_request_latency_seconds", lb, "Histogram of end to end request latency in seconds."
        )
        out += self.queue.render("vllm:request_queue_time_seconds", lb,
                                 "Histogram of time spent in WAITING phase for request.")
        out += self.gpu_lines()
        return "\n".join(out) + "\n"
