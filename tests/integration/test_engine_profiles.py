"""Engine quirks against a small HTTP server on loopback that has them (issue 17): readiness by model list
with its own timeout while /v1/models hangs, readiness by a tiny completion, no /health; a stream whose
headers come long before the first token and that carries no usage (TTFT from the first text event,
tokens counted from the stream and said so); a server with no /metrics scraped as absent, not zero."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploybench import engines
from deploybench.load.results import Endpoint
from deploybench.load.ttft import stream_once

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]

HEADERS_FIRST_S = 0.4  # the quirky server sends its headers, then waits this long before the first token
TOKENS = 5


class Quirky(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    models_hang = threading.Event()  # set: GET /v1/models waits (as llama.cpp's while it generates)
    released = threading.Event()

    def log_message(self, *args):
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            if self.models_hang.is_set():
                self.released.wait(10)
            return self._json(200, {"object": "list", "data": [{"id": "quirky-model", "object": "model"}]})
        self._json(404, {"detail": "Not Found"})  # no /health, no /metrics

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not body.get("stream"):
            return self._json(200, {"choices": [{"text": "x"}]})  # no usage either
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        time.sleep(HEADERS_FIRST_S)

        def chunk(b: bytes) -> None:
            self.wfile.write(f"{len(b):x}\r\n".encode() + b + b"\r\n")
            self.wfile.flush()

        chunk(b'data: {"choices":[{"text":""}]}\n\n')  # a role/empty event: not a token
        for i in range(TOKENS):
            chunk(f'data: {{"choices":[{{"text":"t{i} "}}]}}\n\n'.encode())
            time.sleep(0.01)
        chunk(b"data: [DONE]\n\n")
        chunk(b"")


@pytest.fixture()
def server():
    Quirky.models_hang.clear()
    Quirky.released.clear()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Quirky)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    Quirky.released.set()
    srv.shutdown()
    srv.server_close()


def test_readiness_by_model_list_with_its_own_timeout(server):
    prof = engines.profile("llamacpp")  # readiness: GET /v1/models listing the served name
    assert prof.is_ready(server, "quirky-model")
    assert not prof.is_ready(server, "another-model")
    assert not engines.profile("vllm").is_ready(server, "quirky-model")  # /health answers 404 here
    Quirky.models_hang.set()
    assert not prof.is_ready(server, "quirky-model", timeout_s=0.5)  # /v1/models hangs: not ready, no hang
    assert not Quirky.released.is_set()  # the answer came while the server still held the request


def test_readiness_by_a_tiny_completion(server, tmp_path, monkeypatch):
    (tmp_path / "tiny.toml").write_text('name = "tiny"\ncommand = ["x"]\n[readiness]\nkind = "completion"\n'
                                        'path = "/v1/completions"\ntimeout_s = 3\n')
    monkeypatch.setenv(engines.PROFILE_ENV, str(tmp_path))
    assert engines.profile("tiny").is_ready(server, "quirky-model")
    assert not engines.profile("tiny").is_ready("http://127.0.0.1:9", "quirky-model")


def test_headers_long_before_the_first_token_and_no_usage_in_the_stream(server):
    ep = Endpoint("n1", server, "quirky-model")
    row = asyncio.run(stream_once(ep, "completions", "hello there", 2, 16, timeout_s=10))
    assert row["error_kind"] is None and row["status"] == 200
    assert row["ttft_ms"] >= HEADERS_FIRST_S * 1000  # the first text event, not the headers
    assert row["output_tokens"] == TOKENS and row["tokens_from"] == "stream"
    assert len(row["itl_ms"]) == TOKENS - 1


def test_no_metrics_endpoint_is_absent_not_zero(server):
    from deploybench.load.scrape import Scraper, engine_figures

    sc = Scraper([Endpoint("n1", server, "quirky-model")], interval_s=0.2, phase="sustained")
    sc.start()
    time.sleep(0.5)
    points = sc.stop()
    assert points and all(p["metric"] == "up" and p["value"] == 0.0 for p in points)
    fig = engine_figures(points)["n1"]
    assert fig["scrapes"] == 0 and fig["scrape_errors"] == len(points)
    assert not any(k.startswith(("ttft", "e2e", "itl", "running", "waiting")) for k in fig)  # absent, not 0
