"""Time to first token and inter-token latency, measured by a client that reads the stream as it comes.

k6's HTTP client buffers a whole response, and ``timings.waiting`` is the time to the response headers,
which a streaming server (vLLM, Triton, any FastAPI/uvicorn ``StreamingResponse``) sends at once: it is
not the time to the first token (measured here with k6 1.1: ``waiting`` 0.7 ms, first token at 300 ms; k6
has no SSE support built in). So beside k6 a small asyncio client sends a share of the offered load itself
(``ttft_sample_rps``, open model: requests start on schedule whatever the server does), always streamed,
and times each SSE event as it arrives:

* ``ttft_ms``: from the request's start (before connecting) to the first event that carries text;
* ``itl_ms``: the gaps between consecutive text events (one token per event for vLLM and Triton);
* ``latency_ms``: to the end of the stream, as for k6's requests;
* ``output_tokens``: the server's ``usage`` when the stream carries one, else the text events counted
  (``tokens_from`` says which). Headers sent long before the first token change nothing: TTFT is
  timed from the first event that carries text, never from the headers.

Its rows join k6's in the phase's samples (``ttft_ms`` set marks them), and its rate is taken off k6's,
so the offered rate is the sum. It speaks OpenAI completions and chat (``stream_options.include_usage``)
and Triton's ``generate_stream``; HTTP/1.1 with keep-alive connections (as k6's), plain ``asyncio``
(uvloop when installed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from deploybench.config import LoadSpec
from deploybench.load.results import Endpoint

if TYPE_CHECKING:
    from deploybench.workloads import Plan

LOG = logging.getLogger(__name__)

WORDS = ("the of and to in is it you that he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more").split()
MAX_HEAD = 64 << 10


def make_prompt(rng: random.Random, spec: LoadSpec) -> tuple[str, int, int]:
    """(text, prompt tokens, max_tokens): lengths spread like k6's prompt set (lib/prompts.js)."""
    tokens = max(1, round(spec.prompt_tokens * (0.5 + rng.random())))
    out = max(1, round(spec.output_tokens * (1 - spec.output_spread + 2 * spec.output_spread * rng.random())))
    return " ".join(rng.choice(WORDS) for _ in range(tokens)), tokens, out


def request_body(api: str, model: str, text: str, max_tokens: int, prefix: str = "",
                 history: list[dict[str, str]] | None = None) -> tuple[str, bytes]:
    """(path, JSON body) of one streamed request; the prompt is ``prefix`` (a workload's shared prefix: the chat's
    system message, as k6/lib/requests.js sends it), a conversation's ``history`` (its earlier turns and answers,
    chat messages), then ``text``; without chat, the same parts joined by spaces (k6/lib/prompts.js turnPrompt)."""
    if api != "chat" and (prefix or history):
        text = " ".join(x for x in (prefix, *(m["content"] for m in history or []), text) if x)
    if api == "triton":  # as k6's (k6/lib/requests.js tritonBody): the vLLM backend's inputs and parameters
        body: dict[str, Any] = {"text_input": text, "stream": True, "exclude_input_in_output": True,
                                "return_num_input_tokens": True, "return_num_output_tokens": True,
                                "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
        return f"/v2/models/{quote(model, safe='')}/generate_stream", json.dumps(body).encode()
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = ([{"role": "system", "content": prefix}] if prefix else []) + list(history or []) + [
            {"role": "user", "content": text}]
        return "/v1/chat/completions", json.dumps(body).encode()
    body["prompt"] = text
    return "/v1/completions", json.dumps(body).encode()


def event_text(data: str) -> tuple[str, dict | None]:
    """(text carried, usage) of one SSE ``data:`` payload; ('', None) for [DONE] or an unreadable one."""
    try:
        evt = json.loads(data)
    except ValueError:
        return "", None
    if not isinstance(evt, dict):
        return "", None
    if "text_output" in evt:  # Triton: each response counts its own new tokens (return_num_output_tokens)
        counts = {"prompt_tokens": _one(evt.get("num_input_tokens")),
                  "output_delta": _one(evt.get("num_output_tokens"))}
        return str(evt["text_output"] or ""), _usage(counts)
    choices = evt.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    piece = choice.get("text")
    if piece is None:
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else None
    return str(piece or ""), _usage(evt.get("usage"))


MAX_USAGE_TOKENS = 100_000_000  # a count past this (or not a whole number) is not a count the engine could mean


def _one(v: object) -> object:
    """A one-element tensor in Triton's JSON: a number, or a list of one."""
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def _usage(usage: object) -> dict | None:
    """The token counts of a stream's ``usage`` that are whole numbers in range; None when none is (a server's
    event is hostile input: a list, a string, NaN or 1e400 there must not fail the sampler)."""
    if not isinstance(usage, dict):
        return None
    got = {k: v for k in ("prompt_tokens", "completion_tokens", "output_delta")
           if isinstance(v := usage.get(k), int) and not isinstance(v, bool) and 0 <= v <= MAX_USAGE_TOKENS}
    return got or None


class _Stream:
    """Feeds body bytes, yields SSE data payloads line by line (CRLF or LF)."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[str]:
        self.buf += data
        out = []
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                out.append(line[5:].strip().decode("utf-8", "replace"))
        return out


async def _body_parts(reader: asyncio.StreamReader, headers: dict[str, str]):
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the end
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    else:
        left = int(headers.get("content-length", "-1"))
        while left != 0:
            part = await reader.read(65536 if left < 0 else min(left, 65536))
            if not part:
                return
            left -= len(part) if left > 0 else 0
            yield part


def _reusable(headers: dict[str, str]) -> bool:
    """The body had a known end and the server keeps the connection open."""
    framed = "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers
    return framed and "close" not in headers.get("connection", "").lower()


MAX_ANSWER_CHARS = 256 << 10  # of an answer kept as a conversation's history: a server's words are hostile input


async def stream_once(ep: Endpoint, api: str, text: str, prompt_tokens: int, max_tokens: int,
                      timeout_s: float, pool: list | None = None, prefix: str = "",
                      history: list[dict[str, str]] | None = None, answer: list[str] | None = None) -> dict:
    """One streamed request; a row of the samples (times in ms, ``ts`` in epoch ms).

    ``pool`` holds idle keep-alive connections to ``ep`` (as k6 and real clients keep them): one is
    taken if there is one, and given back after a complete answer; else a new one is opened. ``history``: a
    conversation's earlier messages, sent before ``text``; ``answer``, when given, receives the answer's text
    (at most ``MAX_ANSWER_CHARS``), for the conversation's next turn."""
    ts, t0 = time.time() * 1000.0, time.perf_counter()
    row = {"ts": ts, "node": ep.node, "status": 0, "error_kind": None, "latency_ms": None, "ttft_ms": None,
           "prompt_tokens": prompt_tokens, "output_tokens": 0, "itl_ms": None}
    url = urlsplit(ep.url)
    base = url.path.rstrip("/")  # an endpoint behind a path (a load balancer's /lb): the API's paths go under it
    path, body = request_body(api, ep.model, text, max_tokens, prefix, history)
    kept = 0
    writer, keep = None, False
    try:
        async with asyncio.timeout(timeout_s):
            head = None
            while pool:  # an idle connection may have been closed by the server meanwhile: then a new one
                reader, writer = pool.pop()
                try:
                    head = await _send(reader, writer, url.netloc, base + path, body)
                    break
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    writer = None
            if head is None:
                reader, writer = await asyncio.open_connection(url.hostname, url.port or 80, limit=MAX_HEAD)
                head = await _send(reader, writer, url.netloc, base + path, body)
            status = row["status"] = int(head[0].split(" ")[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            if not 200 <= status < 300:
                row["error_kind"] = f"http_{status}"
                return row
            sse, times, usage, done, deltas = _Stream(), [], None, False, None
            async for part in _body_parts(reader, headers):
                now = time.perf_counter()
                for data in sse.feed(part):
                    if data == "[DONE]":
                        done = True
                        continue
                    text_out, u = event_text(data)
                    if u and "output_delta" in u:  # a hostile server's many counts stay a count it could mean
                        deltas = min(MAX_USAGE_TOKENS, (deltas or 0) + u.pop("output_delta"))
                    usage = u or usage
                    if text_out:
                        times.append(now)
                        if answer is not None and kept < MAX_ANSWER_CHARS:
                            answer.append(text_out[:MAX_ANSWER_CHARS - kept])
                            kept += len(answer[-1])
            end = time.perf_counter()
            row["latency_ms"] = (end - t0) * 1000.0
            if not times:
                row["error_kind"] = "bad_response"
            elif api != "triton" and not done:
                row["error_kind"] = "stream_incomplete"
            else:
                keep = _reusable(headers)
                row["ttft_ms"] = (times[0] - t0) * 1000.0
                row["itl_ms"] = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
                # servers such as llama.cpp's send no usage in a stream: then the text events are the count
                counted = int((usage or {}).get("completion_tokens") or deltas or 0)
                row["output_tokens"] = counted or len(times)
                row["tokens_from"] = "usage" if counted else "stream"
                row["prompt_tokens"] = int((usage or {}).get("prompt_tokens") or prompt_tokens)
    except TimeoutError:
        row["error_kind"] = "timeout"
    except ConnectionRefusedError:
        row["error_kind"] = "connection_refused"
    except (ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError):
        row["error_kind"] = "connection_reset"
    except (OSError, ValueError, IndexError, asyncio.LimitOverrunError) as exc:
        row["error_kind"] = "network"
        LOG.debug("sampler request to %s failed: %r", ep.url, exc)
    finally:
        if writer is not None:
            if keep and pool is not None:
                pool.append((reader, writer))
            else:
                writer.close()
        if row["latency_ms"] is None:
            row["latency_ms"] = (time.perf_counter() - t0) * 1000.0
    return row


async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, path: str,
                body: bytes) -> list[str]:
    """Write one request, read the response head: its lines."""
    writer.write((f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode("latin-1") + body)
    await writer.drain()
    return (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")


class TtftSampler:
    """Sends ``rate`` streamed requests/s round-robin over ``endpoints`` for ``duration_s``, in a thread.

    A conversation workload's plan is sent as conversations, as k6 sends it: each one's turns in order on one
    endpoint, every turn after its think time with the conversation so far (its earlier turns and the answers the
    server streamed), so TTFT is measured by turn index (rows carry ``turn``); conversations start at ``rate``
    divided by the plan's mean turns, so its requests come at ``rate``. No turn starts after ``stop()``.

    ``start()`` returns at once; ``stop()`` stops the schedule, lets requests in flight finish (each is
    bounded by ``spec.request_timeout_s``) and returns the rows."""

    def __init__(self, endpoints: list[Endpoint], spec: LoadSpec, api: str, rate: float, duration_s: float,
                 seed: int = 0, plan: Plan | None = None) -> None:
        self.endpoints, self.spec, self.api = endpoints, spec, api
        self.rate, self.duration_s = rate, duration_s
        self.rng = random.Random(seed + 7919)
        # the workload's plan: the sampler sends its requests from the plan's end backwards (k6 from its start),
        # so its prompts have the workload's lengths and shared prefixes
        self.plan = plan
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:  # uvloop when installed: less time per event, so the timestamps sit closer to the bytes
            import uvloop

            runner: Callable[[Coroutine[Any, Any, None]], None] = uvloop.run
        except ImportError:
            runner = asyncio.run
        self._thread = threading.Thread(target=lambda: runner(self._main()), name="ttft-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> list[dict]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.spec.request_timeout_s + 10)
            if self._thread.is_alive():
                LOG.warning("the TTFT sampler did not stop within %.0f s; its rows so far are kept",
                            self.spec.request_timeout_s + 10)
        return list(self.rows)

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks, i = set(), 0
        pools: dict[str, list] = {}
        talks = self.plan is not None and bool(self.plan.more) and len(self.plan) > 0
        every = (self.plan.requests() / len(self.plan)) / self.rate if talks and self.plan else 1 / self.rate
        while not self._stop.is_set():
            due = t0 + i * every
            if due - t0 >= self.duration_s:
                break
            await asyncio.sleep(max(0.0, due - loop.time()) if due > loop.time() else 0)
            if self._stop.is_set():
                break
            ep = self.endpoints[i % len(self.endpoints)]
            pool = pools.setdefault(ep.node, [])
            if talks and self.plan is not None:
                task = loop.create_task(self._conversation(ep, (len(self.plan) - 1 - i) % len(self.plan), pool))
            else:
                if self.plan is not None and len(self.plan):
                    prefix, text, ptoks, out = self.plan.prompt(len(self.plan) - 1 - i, self.rng)
                else:
                    prefix, (text, ptoks, out) = "", make_prompt(self.rng, self.spec)
                task = loop.create_task(self._one(ep, text, ptoks, out, pool, prefix))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if tasks:
            await asyncio.wait(tasks, timeout=self.spec.request_timeout_s + 5)
        for idle in pools.values():
            for _, writer in idle:
                writer.close()

    async def _one(self, ep: Endpoint, text: str, ptoks: int, out: int, pool: list, prefix: str) -> None:
        self.rows.append(await stream_once(ep, self.api, text, ptoks, out, self.spec.request_timeout_s, pool, prefix))

    async def _conversation(self, ep: Endpoint, i: int, pool: list) -> None:
        """Conversation ``i`` of the plan, turn after turn on ``ep``; a failed turn ends it (as in k6/run.js)."""
        assert self.plan is not None
        prefix, text, ptoks, out = self.plan.prompt(i, self.rng)
        history: list[dict[str, str]] = []
        turn, think_ms = 0, 0.0
        later = [(int(own), int(o), float(think), int(t)) for own, o, think, t in (self.plan.more or [])[i] or []]
        while True:
            if think_ms > 0:
                await asyncio.sleep(think_ms / 1000.0)
            if self._stop.is_set():
                return
            answer: list[str] = []
            row = await stream_once(ep, self.api, text, ptoks, out, self.spec.request_timeout_s, pool, prefix,
                                    history, answer)
            row["turn"], row["conv"] = turn, i
            self.rows.append(row)
            if row["error_kind"] is not None or turn >= len(later):
                return
            history += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(answer)}]
            own, out, think_ms, t = later[turn]
            turn += 1
            text = self.plan.texts[t] if t >= 0 else " ".join(
                WORDS[int(self.rng.random() * len(WORDS))] for _ in range(own))
            ptoks = row["prompt_tokens"] + row["output_tokens"] + own  # the conversation so far, as the engine counted
