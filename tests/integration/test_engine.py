"""The simulated engine as a real process on 127.0.0.1: its HTTP surface, its start-up check, its capacity."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from deploybench import engines
from deploybench.load import Endpoint
from deploybench.load.scrape import Scraper, engine_figures
from deploybench.manifest import seed_model
from deploybench.sim.service_model import (
    ServiceParams,
    capacity,
    chat_prompt,
    count_tokens,
    expected_completion,
)

pytestmark = pytest.mark.integration

READY_RE = re.compile(r"ready on http://127\.0\.0\.1:(\d+)")


class Engine:
    """One engine subprocess; stderr goes to a file that the tests read."""

    def __init__(self, model_dir: Path, log: Path, *flags: str) -> None:
        self.log = log
        with open(log, "w") as err:  # the child writes to its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deploybench.sim.engine", "--host", "127.0.0.1", "--port", "0",
                 "--model-dir", str(model_dir), "--served-model-name", "sim-test", *flags],
                stdout=subprocess.DEVNULL, stderr=err,
            )
        self.port = 0

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_ready(self, timeout: float = 15) -> Engine:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = READY_RE.search(self.stderr())
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"engine exited with {self.proc.returncode}: {self.stderr()}")
            time.sleep(0.02)
        raise AssertionError(f"engine not ready in {timeout} s: {self.stderr()}")

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 10):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.getheader("content-type") or "", resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict, timeout: float = 10) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body, timeout)
        return status, json.loads(raw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sim-model")
    seed_model(d, total_mb=2, shards=2, seed=1)
    return d


@pytest.fixture
def start(model_dir, tmp_path):
    engines: list[Engine] = []

    def _start(*flags: str, model: Path | None = None, ready: bool = True) -> Engine:
        e = Engine(model or model_dir, tmp_path / f"engine{len(engines)}.log", *flags)
        engines.append(e)
        return e.wait_ready() if ready else e

    yield _start
    for e in engines:
        e.stop()


FAST = ("--max-num-seqs", "4", "--decode-base-ms", "2", "--decode-per-seq-ms", "0.5", "--prefill-per-token-ms", "0.01",
        "--seed", "7")


def read_sse(engine: Engine, path: str, body: dict) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=10)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    assert resp.getheader("transfer-encoding") == "chunked"
    text = resp.read().decode()  # http.client undoes the chunked encoding
    conn.close()
    events = text.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), text[:500]
    return [e[len("data: "):] for e in events[:-1]]


def test_completions_whole_and_streamed(start):
    e = start(*FAST)
    prompt = "Tell me about the lab cluster, please."
    status, body = e.post("/v1/completions", {"model": "sim-test", "prompt": prompt, "max_tokens": 12})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_completion(prompt, 12, seed=7)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": count_tokens(prompt), "completion_tokens": 12,
                             "total_tokens": count_tokens(prompt) + 12}

    events = read_sse(e, "/v1/completions", {"model": "sim-test", "prompt": prompt, "max_tokens": 9, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(x) for x in events[:-1]]
    tokens, usage = chunks[:-1], chunks[-1]
    assert len(tokens) == 9
    assert "".join(c["choices"][0]["text"] for c in tokens) == expected_completion(prompt, 9, seed=7)
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 8 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 9

    events = read_sse(e, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "stream": True})
    assert len(events) == 6 and events[-1] == "[DONE]" and "usage" not in events[-2]


def test_chat_whole_and_streamed(start):
    e = start(*FAST)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is a canary?"}]
    status, body = e.post("/v1/chat/completions", {"model": "sim-test", "messages": messages, "max_tokens": 7})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == expected_completion(chat_prompt(messages), 7, seed=7)
    assert body["usage"]["prompt_tokens"] == count_tokens("be brief What is a canary?")
    events = read_sse(e, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    chunks = [json.loads(x) for x in events[:-1]]
    assert len(chunks) == 7 and events[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == expected_completion(
        chat_prompt(messages), 6, seed=7)
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}


def test_max_model_len_caps_the_output(start):
    e = start(*FAST, "--max-model-len", "20")
    status, body = e.post("/v1/completions", {"prompt": " ".join(["w"] * 15), "max_tokens": 50})
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    status, body = e.post("/v1/completions", {"prompt": " ".join(["w"] * 25), "max_tokens": 5})
    assert status == 400 and "maximum context length is 20" in body["error"]["message"]


def test_models_health_errors_and_keep_alive(start):
    e = start(*FAST)
    status, _, raw = e.request("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["sim-test"]
    for path in ("/health", "/v2/health/ready", "/v2/health/live"):
        assert e.request("GET", path)[0] == 200
    status, body = e.post("/v1/completions", {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["code"] == 404 and "other" in body["message"]
    for bad in ({"prompt": "x", "max_tokens": 0}, {"prompt": 3}, {"prompt": "x", "stream": "yes"},
                ["not", "a", "dict"]):
        status, body = e.post("/v1/completions", bad)
        assert status == 400 and body["object"] == "error", bad
    status, _, raw = e.request("POST", "/v1/completions", None)
    assert status == 400
    assert e.request("GET", "/v1/completions")[0] == 405
    assert e.request("GET", "/nope")[0] == 404
    # one keep-alive connection, many requests, including a streamed one
    conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
    for stream in (False, True, False):
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", "max_tokens": 3, "stream": stream}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read()
    conn.close()


@pytest.mark.quiet  # the busy-slot integral is wall time in the batch: a neighbour's CPU lengthens it
def test_metrics_move(start, model_dir):
    e = start(*FAST)

    def scrape() -> dict[str, float]:
        status, ctype, raw = e.request("GET", "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        out = {}
        for line in raw.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    label = '{model_name="sim-test"}'
    before = scrape()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert name + label in before, name
    assert 'vllm:request_success_total{finished_reason="length",model_name="sim-test"}' in before
    assert e.post("/v1/completions", {"prompt": "one two three", "max_tokens": 10})[0] == 200
    read_sse(e, "/v1/completions", {"prompt": "four five", "max_tokens": 4, "stream": True})
    after = scrape()

    def delta(name: str) -> float:
        key = name if "{" in name else name + label
        return after[key] - before[key]

    assert delta('vllm:request_success_total{finished_reason="length",model_name="sim-test"}') == 2
    assert delta("vllm:prompt_tokens_total") == 5
    assert delta("vllm:generation_tokens_total") == 14
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 12
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert after['vllm:e2e_request_latency_seconds_bucket{model_name="sim-test",le="+Inf"}'] == 2
    # the DCGM-named gauges (issue 17): idle before and after, the model's memory alone; the busy-slot
    # integral grew by exactly the two requests' time in the batch, each alone: O x (2 + 0.5) ms + prefill
    gpu = 'gpu="0",UUID="GPU-deploybench-sim",device="nvidia0",modelName="deploybench-sim"'
    model_mib = round(sum(f.stat().st_size for f in model_dir.iterdir() if not f.name.startswith(".")) / 2**20)
    for snap in (before, after):
        assert snap[f"DCGM_FI_DEV_FB_USED{{{gpu}}}"] == model_mib
        assert snap[f"DCGM_FI_DEV_FB_FREE{{{gpu}}}"] == 131072 - model_mib
    assert before[f"DCGM_FI_DEV_GPU_UTIL{{{gpu}}}"] == 0.0
    assert delta("deploybench_sim_busy_slot_seconds_total") == pytest.approx(
        (10 * 2.5 + 0.01 * 3 + 4 * 2.5 + 0.01 * 2) / 1000, abs=0.004)


def scrape(engine: Engine) -> dict[str, float]:
    """The engine's /metrics page: sample (with its labels) -> value."""
    status, _, raw = engine.request("GET", "/metrics")
    assert status == 200
    return {name: float(value) for name, value in (
        line.rsplit(" ", 1) for line in raw.decode().splitlines() if line and not line.startswith("#"))}


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_counters_are_the_closed_forms(start, caching):
    """Requests that share a system prompt of 50 tokens (3 full blocks): with prefix caching (the default), every
    one after the first finds 48 tokens cached, chat and completions alike (the same tokens); the same prompt of
    exactly 2 blocks sent twice hits 1 block, its last always computed. Without it, the counters stay at 0."""
    e = start(*FAST, *(() if caching else ("--no-enable-prefix-caching",)))
    label = '{model_name="sim-test"}'
    queries, hits = f"vllm:prefix_cache_queries_total{label}", f"vllm:prefix_cache_hits_total{label}"
    profile = engines.profile("sim").metrics  # the load stage's scraper reads the figures by the profile's map
    scraper = Scraper([Endpoint("n1", f"http://127.0.0.1:{e.port}", "sim-test")], 1.0, "p", metrics=profile)
    scraper.scrape_once()
    before = scrape(e)
    assert before[queries] == before[hits] == 0 and before[f"vllm:kv_cache_usage_perc{label}"] == 0
    system = " ".join(f"rule{i}" for i in range(50))
    prompts = []
    for i in range(4):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i} what is a canary?"}]
        status, body = e.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3})
        assert status == 200
        prompts.append(body["usage"]["prompt_tokens"])
    for i in range(3):
        body = {"prompt": f"{system} c{i} and a rollout", "max_tokens": 3}
        if i == 2:
            read_sse(e, "/v1/completions", {**body, "stream": True})
        else:
            assert e.post("/v1/completions", body)[0] == 200
        prompts.append(count_tokens(body["prompt"]))
    two_blocks = " ".join(f"b{i}" for i in range(32))
    for _ in range(2):
        assert e.post("/v1/completions", {"prompt": two_blocks, "max_tokens": 2})[0] == 200
    prompts += [32, 32]
    assert prompts[:4] == [56] * 4 and prompts[4:7] == [54] * 3
    after = scrape(e)
    assert after[f"vllm:prompt_tokens_total{label}"] - before[f"vllm:prompt_tokens_total{label}"] == sum(prompts)
    scraper.scrape_once()
    first = datetime.fromisoformat(scraper.points[0]["ts"])  # the window: from the first scrape to the last
    fig = engine_figures(scraper.points, first, profile)["n1"]
    if caching:
        assert after[queries] - before[queries] == sum(prompts)
        assert after[hits] - before[hits] == 6 * 48 + 16  # 6 of 7 find the system prompt's 3 blocks; then 1 of 2
        assert fig["prefix_hit_rate"] == pytest.approx((6 * 48 + 16) / sum(prompts))
    else:
        assert after[queries] == after[hits] == 0  # exported all the same, as vLLM does: the hit rate is none
        assert fig["prefix_queries"] == 0 and fig["prefix_hit_rate"] is None
    assert after[f"vllm:kv_cache_usage_perc{label}"] == 0  # idle again: no running sequence holds a block


def test_corrupt_or_missing_shard_stops_start_up(tmp_path, start):
    model = tmp_path / "model"
    seed_model(model, total_mb=1, shards=2, seed=2)
    shard = model / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    e = start(*FAST, model=model, ready=False)
    assert e.proc.wait(15) != 0
    assert "model-00002-of-00002.safetensors" in e.stderr() and "sha256" in e.stderr()
    assert "ready on" not in e.stderr()

    (model / "model-00001-of-00002.safetensors").unlink()
    e = start(*FAST, model=model, ready=False)
    assert e.proc.wait(15) != 0 and "model-00001-of-00002.safetensors: missing" in e.stderr()


def test_queue_full_is_refused_with_429(start):
    e = start("--max-num-seqs", "1", "--queue-limit", "1", "--decode-base-ms", "100")
    held = []
    for _ in range(2):  # one running, one waiting, each about 5 s: they hold the engine while we probe
        conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 50}))
        held.append(conn)
    time.sleep(0.3)
    t0 = time.monotonic()
    status, body = e.post("/v1/completions", {"prompt": "x", "max_tokens": 50})
    assert status == 429 and time.monotonic() - t0 < 1.0
    assert "max_num_seqs + queue_limit" in body["error"]["message"]
    for conn in held:
        conn.close()


def test_error_rate_and_crash_after(start):
    e = start(*FAST, "--error-rate", "1")
    status, body = e.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    e = start(*FAST, "--crash-after", "2")
    assert e.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    assert e.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    assert e.proc.wait(5) == 3 and "crash_after=2" in e.stderr()


# -- capacity: the measured saturation rate against the closed form ---------------------------------


async def _drive(port: int, rate: float, seconds: float, body: bytes) -> list[tuple[float, float, int]]:
    """Open-loop load at ``rate`` requests/s over a pool of keep-alive connections: (sent, done, status)."""
    loop = asyncio.get_running_loop()
    pool: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    results: list[tuple[float, float, int]] = []
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    async def one(sent: float) -> None:
        reader, writer = pool.pop() if pool else await asyncio.open_connection("127.0.0.1", port)
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        await reader.readexactly(length)
        results.append((sent, loop.time(), int(head.split(b" ", 2)[1])))
        pool.append((reader, writer))

    start = loop.time()
    tasks = []
    for i in range(int(rate * seconds)):
        at = start + i / rate
        await asyncio.sleep(max(0.0, at - loop.time()))
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    for _, writer in pool:
        writer.close()
    return [(s - start, d - start, st) for s, d, st in results]


@pytest.mark.quiet
def test_saturation_throughput_matches_the_closed_form(start):
    b, base, per_seq, prefill, prompt_tokens, out = 8, 5.0, 1.0, 0.05, 40, 16
    e = start("--max-num-seqs", str(b), "--decode-base-ms", str(base), "--decode-per-seq-ms", str(per_seq),
              "--prefill-per-token-ms", str(prefill), "--queue-limit", "32")
    cap = capacity(ServiceParams(b, base, per_seq, prefill, 32), prompt_tokens, out)
    assert 25 < cap.requests_per_s < 40  # 16*(5/8+1) + 0.05*40 = 28 ms per request: 35.7 requests/s
    body = json.dumps({"prompt": " ".join(["word"] * prompt_tokens), "max_tokens": out}).encode()
    seconds, warmup = 10.0, 2.0
    results = asyncio.run(_drive(e.port, 2 * cap.requests_per_s, seconds, body))
    ok = [done for sent, done, status in results if status == 200]
    refused = [1 for *_, status in results if status == 429]
    assert len(ok) + len(refused) == len(results) and refused  # saturated: some were turned away
    window = [d for d in ok if warmup <= d <= seconds]
    measured = len(window) / (seconds - warmup)
    print(f"closed form {cap.requests_per_s:.2f} requests/s, measured {measured:.2f} requests/s "
          f"({100 * (measured / cap.requests_per_s - 1):+.1f} %), {len(refused)} refused")
    assert measured == pytest.approx(cap.requests_per_s, rel=0.15)
