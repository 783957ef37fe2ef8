"""The OpenAI-compatible request and response shapes of the simulated engine, as vLLM answers them.

What the sim reads from a request: ``model`` (optional; another name is a 404), ``prompt``
(completions: a string, a one-string list, or a list of token ids) or ``messages`` (chat),
``max_tokens`` (chat: also ``max_completion_tokens``; default 16), ``n`` (only 1), ``stream``,
``stream_options.include_usage``. Sampling fields (temperature, ignore_eos, ...) are accepted
and ignored: the sim always generates exactly ``min(max_tokens, max_model_len - prompt
tokens)`` tokens and reports ``finish_reason: "length"``.

A stream is one SSE event per token (the chat stream's first event also carries
``role: "assistant"``, so events = tokens), then a usage event with ``choices: []`` when
``include_usage`` is set, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from deploybench.sim.server import (
    LAST_CHUNK,
    HttpError,
    Request,
    chunk,
    error_body,
    response,
    stream_head,
)
from deploybench.sim.service_model import TokenStream, chain_hashes, chat_prompt, tokenize

if TYPE_CHECKING:
    from deploybench.sim.engine import EngineServer

log = logging.getLogger("deploybench.sim.engine")

DEFAULT_MAX_TOKENS = 16
_DUMPS = json.JSONEncoder(separators=(",", ":")).encode


class _Parsed:
    __slots__ = ("prompt", "prompt_tokens", "blocks", "output_tokens", "stream", "include_usage", "tokens")

    def __init__(self, prompt: str, prompt_tokens: int, blocks: tuple[int, ...], output_tokens: int, stream: bool,
                 include_usage: bool, tokens: list[str] | None = None) -> None:
        self.prompt = prompt
        self.prompt_tokens = prompt_tokens
        self.blocks = blocks  # the prompt's block hashes for the prefix cache; () when it is off
        self.tokens = tokens  # the prompt's tokens when the cache is on: the answer's blocks continue their chain
        self.output_tokens = output_tokens
        self.stream = stream
        self.include_usage = include_usage


class OpenAIApi:
    """Answers /v1/completions and /v1/chat/completions for one ``EngineServer``."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.name = server.opts.served_model_name
        self.seed = server.opts.seed
        self.max_model_len = server.opts.max_model_len
        # hashed only when the cache is on: the CPU is shared by many engines and the load generator
        self.caching = server.prefix_caching

    def models_body(self) -> bytes:
        card = {
            "id": self.name, "object": "model", "created": self.server._created, "owned_by": "vllm",
            "root": self.server.opts.model_dir, "parent": None, "max_model_len": self.max_model_len, "permission": [],
        }
        return _DUMPS({"object": "list", "data": [card]}).encode()

    async def handle(self, kind: str, req: Request, writer: asyncio.StreamWriter) -> bool:
        """Answer one inference request; False when the connection must close."""
        server, keep = self.server, req.keep_alive
        try:
            p = self._parse(kind, req.json())
        except HttpError as exc:
            writer.write(response(exc.status, error_body(exc.status, str(exc)), keep_alive=keep))
            await writer.drain()
            return True
        if server.inject_error():
            server.metrics.errors += 1
            writer.write(response(500, error_body(500, "injected error (error_rate knob of the simulated engine)"),
                                  keep_alive=keep))
            await writer.drain()
            server.count_answer()
            return True
        job = server.engine.submit(p.prompt_tokens, p.output_tokens, p.blocks)
        if job is None:
            server.metrics.refused += 1
            o = server.opts
            msg = (f"the engine is full: {o.params.max_num_seqs} running and {o.params.queue_limit} waiting "
                   f"(max_num_seqs + queue_limit); retry later or lower the rate")
            writer.write(response(429, error_body(429, msg), keep_alive=keep, extra_headers="retry-after: 1\r\n"))
            await writer.drain()
            return True
        rid = server.next_id("chatcmpl" if kind == "chat" else "cmpl")
        tokens = TokenStream(p.prompt, self.seed)
        try:
            if p.stream:
                await self._stream(kind, rid, p, job, tokens, writer, keep)
            else:
                await server.engine.wait(job, p.output_tokens)
                text = "".join(tokens.token(i) for i in range(p.output_tokens))
                writer.write(response(200, self._whole(kind, rid, p, text), keep_alive=keep))
                await writer.drain()
        except BaseException:
            server.engine.cancel(job)
            raise
        if p.tokens is not None:  # the answer's full blocks are cached too (a conversation's next turn finds them)
            server.engine.cache_answer(p.tokens, [tokens.token(i)[1:] for i in range(p.output_tokens)])
        server.metrics.success += 1
        server.count_answer()
        return True

    # -- parsing ---------------------------------------------------------------------------------
    def _parse(self, kind: str, body: Any) -> _Parsed:
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.name:
            raise HttpError(404, f"The model `{model}` does not exist.")
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
            ):
                raise HttpError(400, "`messages` must be a non-empty list of objects with a `role`")
            prompt = chat_prompt(messages)
            tokens = tokenize(prompt)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt, tokens = _completion_prompt(body.get("prompt"))
            max_tokens = body.get("max_tokens")
        prompt_tokens = len(tokens)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise HttpError(400, f"max_tokens must be an integer >= 1 (got {max_tokens!r})")
        n = body.get("n", 1)
        if n != 1:
            raise HttpError(400, f"n={n!r}: the simulated engine answers one choice per request (n=1)")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, f"stream must be true or false (got {stream!r})")
        opts = body.get("stream_options")
        if opts is not None and (not stream or not isinstance(opts, dict)):
            raise HttpError(400, "Stream options can only be defined when `stream=True`.")
        if prompt_tokens >= self.max_model_len:
            raise HttpError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{prompt_tokens} input tokens. Please reduce the length of the input messages.",
            )
        out = min(max_tokens, self.max_model_len - prompt_tokens)
        blocks = chain_hashes(tokens) if self.caching else ()
        return _Parsed(prompt, prompt_tokens, blocks, out, stream, bool(opts and opts.get("include_usage")),
                       tokens if self.caching else None)

    # -- answers ---------------------------------------------------------------------------------
    def _usage(self, p: _Parsed) -> dict:
        return {"prompt_tokens": p.prompt_tokens, "total_tokens": p.prompt_tokens + p.output_tokens,
                "completion_tokens": p.output_tokens}

    def _whole(self, kind: str, rid: str, p: _Parsed, text: str) -> bytes:
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            obj = "text_completion"
        return _DUMPS({"id": rid, "object": obj, "created": self.server._created, "model": self.name,
                       "choices": [choice], "usage": self._usage(p)}).encode()

    async def _stream(self, kind, rid, p: _Parsed, job, tokens: TokenStream, writer, keep: bool) -> None:
        engine = self.server.engine
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = f'data: {{"id":"{rid}","object":"{obj}","created":{self.server._created},"model":{_DUMPS(self.name)},'
        if kind == "chat":
            first = head + '"choices":[{"index":0,"delta":{"role":"assistant","content":"'
            middle = head + '"choices":[{"index":0,"delta":{"content":"'
            tail = '"},"logprobs":null,"finish_reason":%s}]}\n\n'
        else:
            first = middle = head + '"choices":[{"index":0,"text":"'
            tail = '","logprobs":null,"finish_reason":%s,"stop_reason":null}]}\n\n'
        writer.write(stream_head(keep))
        total, sent = p.output_tokens, 0
        while sent < total:
            got = await engine.wait(job, sent + 1)
            parts = []
            for i in range(sent, got):
                # vocabulary words are plain ASCII: no JSON escaping needed
                pre = first if i == 0 else middle
                finish = '"length"' if i == total - 1 else "null"
                parts.append(chunk((pre + tokens.token(i) + tail % finish).encode()))
            sent = got
            writer.write(b"".join(parts))
            await writer.drain()
        end = b""
        if p.include_usage:
            end = chunk((head + '"choices":[],"usage":' + _DUMPS(self._usage(p)) + "}\n\n").encode())
        writer.write(end + chunk(b"data: [DONE]\n\n") + LAST_CHUNK)
        await writer.drain()


def _completion_prompt(prompt: Any) -> tuple[str, list[str]]:
    """(text, its tokens) of a completions ``prompt``: a string, [string], [token ids] or [[token ids]]
    (a token id is one token: its digits)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, tokenize(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = [str(t) for t in prompt]
        return " ".join(ids), ids
    raise HttpError(400, "`prompt` must be a string or a list of token ids (one prompt per request)")
