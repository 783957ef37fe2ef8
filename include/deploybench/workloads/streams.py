"""A file from outside, read under limits: the reading half of deploybench.workloads.sources.

``BoundedFile`` checks a file's size before a byte is read and counts the bytes as they are (a file may grow while
it is read), yields its lines bounded and decoded, parses JSON with every failure wrapped, and splits a top-level
JSON array into its elements in chunks, never holding more than the element being read. Every refusal is a
ConfigError that names the file, the place and the way out.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from deploybench.errors import ConfigError

MAX_LINE_BYTES = 1 << 20
CHUNK_BYTES = 1 << 16  # how much of a JSON array file is read at a time

_BOM = b"\xef\xbb\xbf"
_NL = b"\n"
_NON_WS = re.compile(rb"[^ \t\r\n]")

# the array splitter's jumps: from outside a string, past everything else (whole strings included) to the next
# bracket, brace or (at the array's own level, where it ends an element) comma, in group 1; or to a string the buffer
# does not hold the end of (group 1 is its '"'). Possessive: nothing is tried twice, a match is linear in its length
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_NEXT_TOP = re.compile(rb'(?s)(?:[^"\[\]{},]++|' + _STRING + rb')*+([\[\]{},"])')
_NEXT_NESTED = re.compile(rb'(?s)(?:[^"\[\]{}]++|' + _STRING + rb')*+([\[\]{}"])')
_INSIDE = re.compile(rb'["\\]')  # inside a string: its end, or an escape


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON knows")


def _scan(buf: bytearray, pos: int, depth: int, in_str: bool) -> tuple[int, int, bool, int]:
    """Follow an array element through ``buf`` from ``pos`` (``depth`` brackets deep, in a string or not): where it
    stopped, the depth there, whether in a string, and the byte it stopped at (at that position): a ',' or ']' at
    the array's own level (the element ends there), a '}' closing nothing, or -1 when the buffer ran out first."""
    end = len(buf)
    while pos < end:
        if in_str:
            m = _INSIDE.search(buf, pos)
            if m is None:
                return end, depth, True, -1
            if buf[m.start()] == ord("\\"):
                pos = m.start() + 2  # past the escaped byte (which may come with the next chunk)
            else:
                pos, in_str = m.end(), False
            continue
        m = (_NEXT_NESTED if depth else _NEXT_TOP).match(buf, pos)
        if m is None:  # nothing but whole strings and other bytes to the buffer's end
            return end, depth, False, -1
        at = m.start(1)
        c, pos = buf[at], at + 1
        if c == ord('"'):
            in_str = True
        elif c in b"[{":
            depth += 1
        elif depth:  # within the element, where a ',' separates its own members
            if c in b"]}":
                depth -= 1
        else:
            return at, depth, False, c
    return pos, depth, in_str, -1


class BoundedFile:
    """One file opened under a workload's limits (``max_bytes`` the whole, ``max_line_bytes`` a line or an array
    element); ``kind`` ("dataset", "trace") starts every message. Use it as a context manager."""

    def __init__(self, path: str | os.PathLike[str], kind: str, max_bytes: int, max_line_bytes: int) -> None:
        self.path, self.kind = Path(path), kind
        self.max_bytes, self.max_line_bytes = max_bytes, max_line_bytes
        self.bytes_read = 0
        self.largest = 0  # the longest line, or array element, seen

    def refuse(self, what: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.kind} {self.path}: {what}; {fix}")

    def __enter__(self) -> BoundedFile:
        try:
            st = os.stat(self.path)  # before open: opening a FIFO would wait for a writer
            if not stat.S_ISREG(st.st_mode):
                raise self.refuse("is not a regular file", f"name the {self.kind} file itself")
            self.fh = open(self.path, "rb")  # noqa: SIM115 (closed by __exit__)
        except OSError as exc:
            raise self.refuse(f"cannot read it: {exc.strerror or exc}", "check the path") from exc
        if st.st_size > self.max_bytes:
            self.fh.close()
            raise self.refuse(
                f"is {st.st_size} bytes, above the workload's limit of {self.max_bytes} "
                f"(max_bytes = {self.max_bytes})",
                "raise max_bytes in the workload, or cut the file down",
            )
        if st.st_size == 0:
            self.fh.close()
            raise self.refuse("is empty", f"name a {self.kind} file with records in it")
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.fh.close()

    def _read(self, n: int) -> bytes:
        data = self.fh.read(n)
        self._count(len(data))
        return data

    def _count(self, n: int) -> None:
        self.bytes_read += n
        if self.bytes_read > self.max_bytes:
            raise self.refuse(
                f"grew past the workload's limit of {self.max_bytes} bytes while being read (max_bytes)",
                "read a copy that is not being written to",
            )

    def first_byte(self) -> bytes:
        """The first byte that is not whitespace (nor a UTF-8 byte-order mark), or b"" if there is none; the file
        is read from its start again afterwards."""
        head, start = b"", True
        while block := self._read(max(CHUNK_BYTES, 4096)):
            if start and block.startswith(_BOM):
                block = block[len(_BOM) :]
            start = False
            if m := _NON_WS.search(block):
                head = block[m.start() : m.start() + 1]
                break
        self.fh.seek(0)
        self.bytes_read = 0
        return head

    def lines(self) -> Iterator[tuple[int, str]]:
        """(line number from 1, text) of each line that is not blank, decoded; too long or not UTF-8 refused."""
        number = 0
        while raw := self.fh.readline(self.max_line_bytes + 2):  # the line, its \r\n, and one byte to tell
            number += 1
            self._count(len(raw))
            body = raw[:-1] if raw.endswith(b"\n") else raw
            body = body[:-1] if body.endswith(b"\r") else body
            if number == 1 and body.startswith(_BOM):
                body = body[len(_BOM) :]
            if len(body) > self.max_line_bytes:
                raise self.refuse(
                    f"line {number} is longer than {self.max_line_bytes} bytes (max_line_bytes)",
                    "one record per line; raise max_line_bytes only if a record really is that long",
                )
            self.largest = max(self.largest, len(body))
            text = self.decode(body, f"line {number}")
            if text.strip():
                yield number, text

    def decode(self, data: bytes, where: str, first_line: int = 0) -> str:
        """``data`` as UTF-8; ``first_line`` (an array element's) lets the message name the bad byte's line."""
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            at = f" (line {first_line + data.count(_NL, 0, exc.start)})" if first_line else ""
            raise self.refuse(
                f"{where} is not UTF-8: byte {exc.start + 1}{at} is {data[exc.start : exc.start + 1]!r}",
                "convert the file to UTF-8 (iconv -t UTF-8)",
            ) from exc

    def parse(self, text: str, where: str, first_line: int = 0) -> Any:
        """One JSON value. NaN, Infinity, integers past Python's digit limit and nesting past its recursion limit
        are refused with the rest; ``first_line`` (an array element's) makes the position a line of the file."""
        fix = "fix or remove that record"
        try:
            return json.loads(text, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            at = (
                f"line {first_line + exc.lineno - 1}, column {exc.colno}"
                if first_line
                else f"column {exc.colno}"
            )
            raise self.refuse(f"{where} is not valid JSON: {exc.msg} at {at}", fix) from exc
        except (ValueError, RecursionError) as exc:
            msg = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise self.refuse(f"{where} is not valid JSON: {msg}", fix) from exc

    def array(self) -> Iterator[tuple[int, int, bytes]]:
        """(record number from 1, the line it starts on, its bytes) of each element of a top-level JSON array.

        Read in chunks of CHUNK_BYTES: a scanner follows strings, escapes and bracket depth to find where each
        element ends (a regular expression jumps to the next bracket, brace or comma outside a string, so the bulk
        of the text is skipped at C speed; a string cut by the chunk's end is followed byte-wise, past its
        escapes, into the next); what is read is dropped once per chunk, and an element longer than
        max_line_bytes is refused before it is whole. UTF-8 needs no decoding to be split: every byte of a
        multi-byte character is above 0x7F, so none looks like a quote or a bracket. The elements themselves are
        checked by the JSON parser, not here."""
        buf = bytearray(self._read(max(CHUNK_BYTES, len(_BOM))))
        if buf.startswith(_BOM):
            del buf[: len(_BOM)]
        state = "open"  # open (before '['), start (an element or ']' next), item (in one), after (past ']')
        number = depth = start = start_line = 0
        in_str = False
        line, line_pos = 1, 0  # the line buf[line_pos] is on
        pos = 0
        eof = False
        while True:
            while pos < len(buf):
                if state != "item":
                    m = _NON_WS.search(buf, pos)
                    if m is None:
                        pos = len(buf)
                        break
                    pos = m.start()
                    line, line_pos = line + buf.count(_NL, line_pos, pos), pos
                    c = buf[pos]
                    if state == "open" and c == ord("["):
                        state, pos = "start", pos + 1
                    elif state == "start" and c == ord("]"):
                        if number:
                            raise self.refuse(
                                f"line {line}: a ',' before the array's ']'", "remove that comma"
                            )
                        state, pos = "after", pos + 1
                    elif state == "start":
                        number, start, depth, in_str, state = number + 1, pos, 0, False, "item"
                        start_line = line
                    else:
                        where = (
                            "before the array's '['" if state == "open" else "after the array's closing ']'"
                        )
                        raise self.refuse(
                            f"line {line}: {chr(c)!r} {where}", "a JSON array file holds one array"
                        )
                else:
                    pos, depth, in_str, c = _scan(buf, pos, depth, in_str)
                    if c < 0:
                        break
                    if c == ord("}"):
                        raise self.refuse(
                            f"record {number} (line {start_line}) is not valid JSON: a '}}' closes nothing",
                            "fix or remove that record",
                        )
                    yield number, start_line, self._element(buf, start, pos, number, start_line)
                    state, pos = "start" if c == ord(",") else "after", pos + 1
                    line, line_pos = start_line + buf.count(_NL, start, pos), pos
            if state == "item" and len(buf) - start > self.max_line_bytes:
                raise self._too_big(number, start_line)
            if eof:
                break
            keep = start if state == "item" else min(pos, len(buf))
            line += buf.count(_NL, line_pos, keep)
            del buf[:keep]
            pos, start, line_pos = pos - keep, start - keep if state == "item" else 0, 0
            chunk = self._read(CHUNK_BYTES)
            eof = not chunk
            buf += chunk
        if state != "after":
            where = (
                f"inside record {number} (line {start_line})" if state == "item" else "before the array's ']'"
            )
            raise self.refuse(f"ends {where}: the file is cut short", "download it again, or close the array")

    def _element(self, buf: bytearray, start: int, end: int, number: int, start_line: int) -> bytes:
        if end - start > self.max_line_bytes:
            raise self._too_big(number, start_line)
        self.largest = max(self.largest, end - start)
        return bytes(buf[start:end])

    def _too_big(self, number: int, start_line: int) -> ConfigError:
        return self.refuse(
            f"record {number} (line {start_line}) is longer than {self.max_line_bytes} bytes (max_line_bytes)",
            "raise max_line_bytes only if a record really is that long",
        )
