"""Tiny HTTP helpers for talking to engines from the controller (health, smoke checks, metrics).

Proxies from the environment are ignored on purpose: engines are on the cluster's own
network, and a corporate proxy must never sit between the controller and a node.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HTTPFailure(Exception):
    def __init__(self, url: str, status: int | None, body: str):
        super().__init__(f"{url}: {'HTTP ' + str(status) if status else 'no answer'}: {body[:300]}")
        self.url, self.status, self.body = url, status, body


def request(url: str, payload: Any | None = None, timeout: float = 10.0) -> tuple[int, str]:
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        raise HTTPFailure(url, None, str(getattr(exc, "reason", exc))) from exc


def get_json(url: str, timeout: float = 10.0) -> Any:
    status, body = request(url, timeout=timeout)
    if status != 200:
        raise HTTPFailure(url, status, body)
    return json.loads(body)


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
