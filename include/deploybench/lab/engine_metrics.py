"""The simulated engine's Prometheus metrics, under vLLM's names, buckets and ``model_name`` label.

Hand-rolled (no prometheus_client) because the set is small and fixed and the text format is
simple; the server-metrics scraper reads a sim and a real vLLM the same way. Inter-token
latency is observed per token under both ``vllm:inter_token_latency_seconds`` and the older
``vllm:time_per_output_token_seconds``, as vLLM 0.x observed the latter.
"""

from __future__ import annotations

from bisect import bisect_left

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


class EngineMetrics:
    """Counters, gauges and histograms of one engine; the scheduler and the handlers update them."""

    def __init__(self, model_name: str) -> None:
        self.labels = f'model_name="{model_name}"'
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = 0
        self.refused = 0  # 429: the queue was full
        self.errors = 0  # 500: injected
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def render(self) -> str:
        lb = self.labels
        out = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lb}}} {self.running}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lb}}} {self.waiting}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lb}}} {self.prompt_tokens}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lb}}} {self.generation_tokens}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{finished_reason="length",{lb}}} {self.success}',
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
        return "\n".join(out) + "\n"
