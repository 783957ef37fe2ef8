"""Issue 30, hole 7: the engines' /metrics as an attacker serves them.

Whatever answers on an engine's port is hostile input. A real HTTP server on 127.0.0.1 serves what an
attacker would, and the project's own code reads it as a load phase does around k6: the ``Scraper`` that
``runner.run_load`` runs beside k6, ``engine_figures`` (the LoadResult's engine figures), the GPU sampler
and figures (``phases.with_gpu``) and the utilisation objective (``phases._judge_gpu``). What must hold: a
page costs a bounded amount (bytes read, points kept, time), no answer fails the phase, nothing a stage
record is written from is NaN or infinite, and a hostile utilisation never meets an objective.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deploybench import engines
from deploybench.config import SLO, LoadSpec
from deploybench.load import phases
from deploybench.load.results import Endpoint, LoadResult, SloVerdict
from deploybench.load.scrape import Scraper, engine_figures, save_series

pytestmark = pytest.mark.time_limit(60)

Answer = Callable[[http.server.BaseHTTPRequestHandler, int], None]


class _Server(http.server.ThreadingHTTPServer):
    answer: Answer
    hits = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the scraper hung up on a page it refused: what the attack is met with


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802
        n, self.server.hits = self.server.hits, self.server.hits + 1
        self.server.answer(self, n)

    def do_POST(self) -> None:  # noqa: N802  (a streamed request: its body is read and not looked at)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[_Server]:
    """A hostile engine on 127.0.0.1: set ``answer(handler, n)`` (n: the request's number, from 0)."""
    srv = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def page(body: Callable[[int], bytes], length: bool = True) -> Answer:
    """An answer 200 with ``body(n)``, its size announced in Content-Length or not (then read to the close)."""
    def answer(h: http.server.BaseHTTPRequestHandler, n: int) -> None:
        data = body(n)
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4")
        if length:
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return answer


def strict_json(obj: object) -> str:
    """What a stage record must be: JSON, where NaN and Infinity are not numbers."""
    return json.dumps(obj, allow_nan=False)


def result(**kw: object) -> LoadResult:
    """A LoadResult as run_load makes one, k6's figures left trivial."""
    return LoadResult(**{
        "requests": 10, "errors": 0, "error_rate": 0.0, "errors_by_kind": {}, "achieved_rps": 1.0, "output_tps": 1.0,
        "latency_p50_ms": 50.0, "latency_p90_ms": 90.0, "latency_p99_ms": 99.0, "latency_p999_ms": 99.9,
        "phase": "sustained", "offered_rps": 1.0, "duration_s": 10.0, "warmup_s": 0.0, "started_at": datetime.now(UTC),
        "warmup_excluded": 0, "dropped_iterations": 0, "slo_ok": True, "slo": SloVerdict(passed=True, reasons=[]),
        "nodes": [], "samples_path": "s", "warmup_samples_path": None, "summary_path": "x", "k6_exit_code": 0,
        "k6_thresholds_crossed": [], "k6_cpu_s": 0.1, "vus_pre": 1, "vus_max": 2, "tags": {}, "notes": [], **kw})


def scrape_phase(url: str) -> tuple[list[dict], dict]:
    """The scraper of one k6 run (a scrape when it starts, one when it stops) and the engine figures of its
    measured window, as run_load takes them."""
    metrics = engines.profile("vllm").metrics  # what the scrapes keep: the families the profile's map names
    sc = Scraper([Endpoint("n1", url, "m")], interval_s=60, phase="sustained", metrics=metrics)
    sc.start()
    window_start = datetime.now(UTC)
    points = sc.stop()
    return points, engine_figures(points, window_start, metrics)


# -- (a) a page too big to keep ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def page_23mb() -> bytes:
    """23 MB of /metrics: 200,001 samples of a kept family, 115 bytes a line."""
    head = 'vllm:num_requests_running{model_name="attacker",engine="%06d",pad="%s"} 1\n'
    pad = "x" * (115 - len(head % (0, "")))
    return "".join(head % (i, pad) for i in range(200_001)).encode()


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "read-to-close"])
def test_a_23_mb_page_of_200001_samples_is_refused_not_kept(engine, page_23mb, announced, caplog):
    """Issue 30, hole 7: an engine answers /metrics with a 23 MB page of 200,001 samples, its size announced
    in Content-Length or not (read until the server closes). It was read whole and every sample kept as a
    point (174 MiB for one scrape); the scrape must stay bounded in memory and points, and say so, naming the
    URL and the size."""
    assert len(page_23mb) >= 23_000_000
    engine.answer = page(lambda n: page_23mb, announced)
    sc = Scraper([Endpoint("n1", engine.url, "m")], interval_s=60, phase="sustained")
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, "deploybench"):
            sc.scrape_once()  # what the scraper's thread does every interval
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    kept = [p for p in sc.points if p["metric"] != "up"]
    assert len(kept) <= 20_000, f"one scrape kept {len(kept):,} points of a hostile page"
    assert peak < 32 << 20, f"one scrape of a hostile page took {peak / 2**20:.0f} MiB"
    assert [p["value"] for p in sc.points if p["metric"] == "up"] == [0.0]  # a refused scrape is a failed one
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"{engine.url}/metrics" in m and ("23,000,115 bytes" if announced else "bytes") in m for m in warned)


def test_a_page_of_120000_short_samples_under_the_byte_bound_is_refused(engine, caplog):
    """Issue 30, hole 7: 120,000 samples of 28 bytes (3.4 MB, under the byte bound): the number of
    samples kept per scrape must be bounded too, not only the bytes."""
    body = b"vllm:num_requests_running 1\n" * 120_000  # a family the map names (kept), 3.4 MB: under the byte bound
    engine.answer = page(lambda n: body)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, "deploybench"):
            points, figs = scrape_phase(engine.url)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(points) <= 2 * 20_001, f"two scrapes kept {len(points):,} points"
    assert peak < 32 << 20, f"two scrapes of a hostile page took {peak / 2**20:.0f} MiB"
    assert any(f"{engine.url}/metrics" in r.getMessage() and "samples" in r.getMessage() for r in caplog.records)
    strict_json(figs)


# -- (b) values that are no numbers -------------------------------------------------------------------------------
TTFT = ('vllm:time_to_first_token_seconds_bucket{{model_name="m",le="0.01"}} 0\n'
        'vllm:time_to_first_token_seconds_bucket{{model_name="m",le="0.02"}} {n}\n'
        'vllm:time_to_first_token_seconds_bucket{{model_name="m",le="+Inf"}} {n}\n'
        'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {s}\n'
        'vllm:time_to_first_token_seconds_count{{model_name="m"}} {n}\n')


def test_nan_and_infinite_values_are_left_out_and_the_phase_goes_on(engine, caplog):
    """Issue 30, hole 7: the engine's page puts NaN and +/-Inf where its counters and gauges are (an e2e
    histogram's _count NaN and _sum +Inf, a bucket +Inf, running NaN, waiting -Inf) beside a sound TTFT
    histogram. int(NaN) failed the load phase; now the bad samples are left out, the sound histogram is
    still measured, and nothing NaN or infinite is in the figures the stage record is written from."""
    def body(n: int) -> bytes:
        return (TTFT.format(n=10 * n, s=0.15 * n)
                + 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="1.0"} +Inf\n'
                + 'vllm:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} NaN\n'
                + 'vllm:e2e_request_latency_seconds_sum{model_name="m"} +Inf\n'
                + 'vllm:e2e_request_latency_seconds_count{model_name="m"} NaN\n'
                + 'vllm:num_requests_running{model_name="m"} NaN\nvllm:num_requests_waiting{model_name="m"} -Inf\n'
                ).encode()

    engine.answer = page(body)
    with caplog.at_level(logging.WARNING, "deploybench"):
        points, figs = scrape_phase(engine.url)  # raised ValueError: cannot convert float NaN to integer
    fig = figs["n1"]
    assert fig["scrapes"] == 2 and fig["ttft_count"] == 10 and fig["ttft_p50_ms"] == pytest.approx(15.0)
    assert fig["e2e_count"] is None and fig["e2e_mean_ms"] is None and fig["e2e_p99_ms"] is None  # its _count left out
    assert fig["running_max"] is None and fig["waiting_max"] is None  # absent, not NaN
    strict_json(points)
    strict_json(result(engine=figs).model_dump(mode="json"))
    assert any(f"{engine.url}/metrics: left out" in r.getMessage() for r in caplog.records)


def test_a_non_numeric_le_leaves_its_bucket_out_and_the_phase_goes_on(engine):
    """Issue 30, hole 7: an inter-token latency histogram with buckets le="fast" and le="NaN" beside its
    sound ones. sorted(key=float) raised ValueError and failed the load phase; now those buckets are left
    out and the histogram is measured from the others."""
    def body(n: int) -> bytes:
        return (TTFT.format(n=10 * n, s=0.15 * n)
                + f'vllm:inter_token_latency_seconds_bucket{{model_name="m",le="0.05"}} {5 * n}\n'
                + f'vllm:inter_token_latency_seconds_bucket{{model_name="m",le="fast"}} {7 * n}\n'
                + f'vllm:inter_token_latency_seconds_bucket{{model_name="m",le="NaN"}} {8 * n}\n'
                + f'vllm:inter_token_latency_seconds_bucket{{model_name="m",le="+Inf"}} {10 * n}\n'
                + f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {0.6 * n}\n'
                + f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {10 * n}\n').encode()

    engine.answer = page(body)
    _, figs = scrape_phase(engine.url)  # raised ValueError: could not convert string to float: 'fast'
    fig = figs["n1"]
    assert fig["itl_count"] == 10 and fig["itl_mean_ms"] == pytest.approx(60.0)
    assert fig["itl_p50_ms"] == pytest.approx(50.0) and fig["ttft_p50_ms"] == pytest.approx(15.0)
    strict_json(result(engine=figs).model_dump(mode="json"))


# -- (c) a GPU utilisation that is no utilisation --------------------------------------------------------------
@pytest.mark.parametrize("util", ["NaN", "1e9"])
def test_a_hostile_gpu_utilisation_is_not_measured_and_never_meets_the_objective(engine, tmp_path: Path, util):
    """Issue 30, hole 7: the engine's own page reports DCGM_FI_DEV_GPU_UTIL as NaN or 1e9 % (and its memory
    used as NaN or -5 MiB). NaN < 80 is False, so the utilisation objective passed and NaN went into the
    stage record; 1e9 % passed it too. Now the node's utilisation is absent, the objective not measured, so
    not met, and the record is strict JSON."""
    used = "NaN" if util == "NaN" else "-5"
    body = (f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-x"}} {util}\nDCGM_FI_DEV_FB_USED{{gpu="0"}} {used}\n'
            'DCGM_FI_DEV_FB_FREE{gpu="0"} 1000\nvllm:num_requests_running{model_name="m"} 1\n').encode()
    engine.answer = page(lambda n: body)
    ep, spec = Endpoint("n1", engine.url, "m"), LoadSpec(scrape_interval_s=0.2)

    def run() -> LoadResult:  # one k6 run as run_load makes it, k6 left out: the scraper beside it, its series
        t0 = datetime.now(UTC) - timedelta(seconds=1)
        sc = Scraper([ep], spec.scrape_interval_s, "sustained")
        sc.start()
        time.sleep(0.5)
        points = sc.stop()
        path = save_series(points, tmp_path / "sustained.metrics.jsonl.gz")
        return result(started_at=t0, duration_s=(datetime.now(UTC) - t0).total_seconds() + 1,
                      engine=engine_figures(points, t0), metrics_path=str(path))

    res = phases._judge_gpu(phases.with_gpu(run, [ep], spec, tmp_path, "sustained"), SLO(min_gpu_util_pct=80))
    assert not res.slo.passed and not res.slo_ok, f"the objective was met by {res.gpu['n1']}"
    assert any(r.startswith("node n1: GPU utilisation not measured") for r in res.slo.reasons), res.slo.reasons
    assert res.gpu["n1"].util_mean_pct is None and res.gpu_util_pct is None, res.gpu["n1"]
    assert res.gpu["n1"].mem_used_mib_mean is None
    strict_json(res.model_dump(mode="json"))


# -- an answer that is no page at all ---------------------------------------------------------------------------
def test_an_answer_that_is_not_http_is_a_failed_scrape_not_a_failed_phase(engine):
    """Issue 30, hole 7: what listens on the engine's port answers /metrics with an SSH banner, no HTTP status
    line. http.client's BadStatusLine is no OSError: it escaped the scraper and failed the load phase; now
    the scrape is a failed one (up 0) and the phase goes on."""
    engine.answer = lambda h, n: h.wfile.write(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")
    points, figs = scrape_phase(engine.url)
    assert [p["value"] for p in points] == [0.0, 0.0]
    assert figs["n1"] == {"scrapes": 0, "scrape_errors": 2}


def test_a_page_sent_a_byte_at_a_time_holds_the_scraper_no_longer_than_its_timeout(engine):
    """Issue 30, hole 7: the engine sends its page one byte every 50 ms for 30 s. The socket timeout bounds
    each read only, so the scraper was held for the whole 30 s (every interval, and again when k6 was done);
    now the whole read is bounded by the scraper's timeout (1 s here)."""
    def dribble(h: http.server.BaseHTTPRequestHandler, n: int) -> None:
        h.send_response(200)
        h.end_headers()
        for _ in range(600):
            h.wfile.write(b"#")
            time.sleep(0.05)

    engine.answer = dribble
    sc = Scraper([Endpoint("n1", engine.url, "m")], interval_s=1.0, phase="sustained")
    t0 = time.monotonic()
    sc.scrape_once()
    assert time.monotonic() - t0 < 5, f"one scrape took {time.monotonic() - t0:.1f} s"
    assert [p["value"] for p in sc.points] == [0.0]


@pytest.mark.parametrize("payload", [
    '{"choices": "x"}', '{"choices": [7]}', '{"choices": [{"delta": "y"}]}', '{"choices": [], "usage": [1, 2]}',
    '{"choices": [], "usage": {"completion_tokens": "many"}}', '{"choices": [], "usage": {"completion_tokens": 1e400}}',
    '{"text_output": "z", "usage": "all"}',
])
def test_a_hostile_stream_event_is_read_without_failing_the_sampler(payload):
    """Issue 30, hole 7: a streamed event whose ``choices``, ``delta`` or ``usage`` has another shape (a string, a
    list, a count that is no whole number) must not fail the TTFT sampler, and never counts as tokens."""
    from deploybench.load.ttft import event_text

    text, usage = event_text(payload)
    assert isinstance(text, str) and usage is None


def test_tritons_per_response_token_counts_stay_a_count_the_engine_could_mean(engine):
    """Issue 28: a Triton stream's token count is the sum of each response's ``num_output_tokens``; a hostile
    server sending the largest count each event allows, event after event, must not make the sum past what any
    engine could mean (``MAX_USAGE_TOKENS``), nor fail the sampler."""
    import asyncio

    from deploybench.load.ttft import MAX_USAGE_TOKENS, stream_once

    event = b'data: {"text_output": "x", "num_output_tokens": [%d]}\n\n' % MAX_USAGE_TOKENS
    engine.answer = page(lambda n: event * 5, length=False)
    row = asyncio.run(stream_once(Endpoint("n1", engine.url, "m"), "triton", "hi", 1, 4, timeout_s=5))
    assert row["error_kind"] is None and row["output_tokens"] == MAX_USAGE_TOKENS, row
