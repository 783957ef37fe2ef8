"""Tiny HTTP helpers for talking to engines from the controller (health, smoke checks, metrics).

Proxies from the environment are ignored on purpose: engines are on the cluster's own
network, and a corporate proxy must never sit between the controller and a node.

What an engine answers is hostile input: every body is read at most ``limit`` bytes (past it the answer
is refused with ``BodyTooLarge``, never read whole) and within ``timeout`` seconds in all (a server that
sends a byte now and then cannot hold a reader past it); a malformed answer (a status line that is not
HTTP, a broken chunked body) is an ``HTTPFailure`` like no answer at all.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# The default bound of an answer: an engine's health, model list or smoke-check completion is a few KB.
MAX_BODY = 8 << 20
_CHUNK = 1 << 16


class HTTPFailure(Exception):
    def __init__(self, url: str, status: int | None, body: str):
        super().__init__(f"{url}: {'HTTP ' + str(status) if status else 'no answer'}: {body[:300]}")
        self.url, self.status, self.body = url, status, body


class BodyTooLarge(HTTPFailure):
    """An answer longer than the reader's bound: refused after reading at most one byte past it."""

    def __init__(self, url: str, status: int, limit: int, length: int | None):
        self.limit, self.length = limit, length
        self.size = f"{length:,} bytes" if length is not None else f"more than {limit:,} bytes"
        super().__init__(url, status, f"the answer is {self.size}, over the bound of {limit:,} bytes; not read")


def _read(resp: Any, url: str, limit: int, deadline: float, timeout: float) -> str:
    """At most ``limit`` bytes of ``resp``'s body, by ``deadline``; BodyTooLarge past the bound."""
    declared = str((resp.headers or {}).get("Content-Length") or "")
    length = int(declared) if declared.isdigit() and len(declared) < 19 else None
    if length is not None and length > limit:
        raise BodyTooLarge(url, resp.status, limit, length)
    body = bytearray()
    while chunk := resp.read1(min(_CHUNK, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            raise BodyTooLarge(url, resp.status, limit, None)
        if time.monotonic() > deadline:
            raise HTTPFailure(url, resp.status, f"the answer took longer than {timeout:g} s to read ({len(body):,} "
                                                "bytes so far); not read further")
    return body.decode(errors="replace")


def request(url: str, payload: Any | None = None, timeout: float = 10.0, limit: int = MAX_BODY) -> tuple[int, str]:
    """(status, body) of a GET (a POST of ``payload`` as JSON), the body read within the bounds (module doc)."""
    data = json.dumps(payload).encode() if payload is not None else None
    deadline = time.monotonic() + timeout
    try:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, _read(resp, url, limit, deadline, timeout)
        except urllib.error.HTTPError as exc:
            try:
                return exc.code, _read(exc, url, limit, deadline, timeout)
            finally:
                exc.close()
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise HTTPFailure(url, None, str(getattr(exc, "reason", exc)) or type(exc).__name__) from exc


def get_text(url: str, timeout: float = 10.0, limit: int = MAX_BODY) -> str:
    """The body of a GET answered 200 (HTTPFailure otherwise), read within the bounds (module doc)."""
    status, body = request(url, timeout=timeout, limit=limit)
    if status != 200:
        raise HTTPFailure(url, status, body)
    return body


def get_json(url: str, timeout: float = 10.0) -> Any:
    return json.loads(get_text(url, timeout))


def post_json(url: str, payload: Any, timeout: float = 30.0) -> Any:
    status, body = request(url, payload, timeout=timeout)
    if status != 200:
        raise HTTPFailure(url, status, body)
    return json.loads(body)


def is_up(url: str, timeout: float = 2.0) -> bool:
    try:
        return request(url, timeout=timeout)[0] == 200
    except HTTPFailure:
        return False
