"""A small HTTP/1.1 layer for the simulated engine, on asyncio streams.

Just what an OpenAI-compatible server needs, kept cheap per request because 16 engines and
k6 share two cores: request line and headers in one ``readuntil``, keep-alive (HTTP/1.1's
default, HTTP/1.0 on request), bodies by Content-Length or chunked transfer encoding,
``Expect: 100-continue`` (curl sends it for bodies over 1 KiB), whole responses with
Content-Length, and chunked responses for SSE streams.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from deploybench.errors import DeploybenchError

MAX_BODY = 16 << 20

REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests", 431: "Request Header Fields Too Large",
    500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
}
_ERROR_TYPES = {
    400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "BadRequestError",
    429: "TooManyRequestsError", 500: "InternalServerError", 503: "ServiceUnavailableError",
}


class HttpError(DeploybenchError):
    """A request that cannot be read or served; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Request:
    method: str
    path: str
    version: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        conn = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in conn
        return "close" not in conn

    def json(self) -> object:
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, f"the request body is not valid JSON: {exc}") from exc


async def read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
    """The next request on a connection, or None when the client closed it between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise HttpError(400, "the connection closed in the middle of a request head") from exc
        return None
    except asyncio.LimitOverrunError as exc:
        raise HttpError(431, "the request head is larger than 64 KiB") from exc
    lines = head[:-4].decode("latin-1").split("\r\n")
    while lines and not lines[0]:  # tolerate stray CRLFs between requests (RFC 9112 2.2)
        lines.pop(0)
    parts = lines[0].split(" ") if lines else []
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, f"malformed request line {lines[0][:80] if lines else ''!r}")
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    path = target.split("?", 1)[0]
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        try:
            length = int(headers["content-length"])
        except ValueError as exc:
            raise HttpError(400, f"bad Content-Length {headers['content-length']!r}") from exc
        if length < 0 or length > MAX_BODY:
            raise HttpError(413, f"a body of {length} bytes; at most {MAX_BODY} are accepted")
        if length:
            body = await reader.readexactly(length)
    return Request(method, path, version, headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError as exc:
            raise HttpError(400, f"bad chunk size line {line[:40]!r}") from exc
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        total += size
        if total > MAX_BODY:
            raise HttpError(413, f"a chunked body over {MAX_BODY} bytes")
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def response(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    keep_alive: bool = True,
    extra_headers: str = "",
) -> bytes:
    """A whole HTTP/1.1 response."""
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
        f"content-type: {content_type}\r\ncontent-length: {len(body)}\r\n"
        f"{extra_headers}{'' if keep_alive else 'connection: close' + chr(13) + chr(10)}\r\n"
    )
    return head.encode("latin-1") + body


def stream_head(keep_alive: bool = True) -> bytes:
    """The head of an SSE response whose body follows in chunks (``chunk``, then ``LAST_CHUNK``)."""
    return (
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
        f"transfer-encoding: chunked\r\n{'' if keep_alive else 'connection: close' + chr(13) + chr(10)}\r\n"
    ).encode("latin-1")


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's error JSON, in both its shapes: ``{"error": {...}}`` and the older flat one."""
    err = {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}
    return json.dumps({"object": "error", **err, "error": err}, separators=(",", ":")).encode()
