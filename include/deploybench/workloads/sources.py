"""Datasets and traces, read as hostile input, for the workloads.

A workload may take its requests from a file somebody downloaded: a dataset of conversations (what is asked, and how
long the answers were) or a timed trace (when each request came, how long it was, which blocks of its prompt it
shared with others). Such a file is input from outside: it may be huge (ShareGPT_V3_unfiltered_cleaned_split.json is
a single 650 MB JSON array), cut short, in another encoding, or hold one malformed record among a hundred thousand.
So everything here is read streaming under limits (the file's size, a line's or a record's size, a trace's rows),
every record is checked as it passes (a bad one anywhere refuses the file, sampled or not), and every refusal is a
ConfigError naming the file, the line and the way out; no json or Unicode exception gets out un-wrapped.

Datasets (``read_dataset``) come as ``jsonl`` (``{"prompt": ...}`` or chat ``{"messages": [...]}`` per line) or
``sharegpt`` (``{"conversations": [{"from": ..., "value": ...}, ...]}``, one record per line or the canonical single
JSON array, split into its elements by a small incremental scanner, never loaded whole). A sample of them is kept by
reservoir sampling, so memory follows the sample, not the file. Traces (``read_trace``) come as ``mooncake`` (the
FAST'25 Mooncake trace's JSONL, with the hash ids of its prompts' 512-token blocks) or ``azure`` (the Azure LLM
inference trace's CSV). Pure: no Airflow, no network. The reading under limits (sizes, lines, JSON, the array
splitter) is deploybench.workloads.streams; in the array form the line limit (max_line_bytes) bounds each record.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from deploybench.errors import ConfigError
from deploybench.workloads.streams import MAX_LINE_BYTES, BoundedFile

# deploybench.workloads.MAX_TOKENS (tests/unit/test_workload_sources.py checks they agree); not imported, so that
# the package's __init__ may import this module
MAX_TOKENS = 1_048_576
MAX_HASH_ID = 2**63  # a Mooncake hash id fits a signed 64-bit integer
MAX_TIMESTAMP_MS = 2**53  # a Mooncake timestamp is exact as a float below it (285,000 years of ms)

DatasetFormat = Literal["jsonl", "sharegpt"]
TraceFormat = Literal["mooncake", "azure"]
DATASET_FORMATS: tuple[str, ...] = ("jsonl", "sharegpt")
TRACE_FORMATS: tuple[str, ...] = ("mooncake", "azure")

# the simulated engine's tokenizer (deploybench.sim.service_model._TOKEN_RE, count_tokens): words and single marks
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")

# who speaks in a record: ShareGPT's "from" (V3 has the chatbots' names too) and a chat record's "role"
SHAREGPT_FROM: Mapping[str, str] = {
    **dict.fromkeys(("human", "user"), "user"),
    "system": "system",
    **dict.fromkeys(("gpt", "assistant", "chatgpt", "bing", "bard"), "assistant"),
}
CHAT_ROLES: Mapping[str, str] = {"system": "system", "user": "user", "assistant": "assistant"}
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

_AZURE_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,9}))?")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Turn:
    """One user message of a record and the length of the answer that followed it in the dataset (tokens by
    ``approx_tokens``, or the record's own ``output_tokens``; None when the record has no answer to it)."""

    user: str
    answer_tokens: int | None


@dataclass(frozen=True)
class Conversation:
    """One record of a dataset: its user messages in order, and its system prompt if any."""

    turns: tuple[Turn, ...]
    system: str = ""


@dataclass(frozen=True)
class TraceRow:
    """One request of a timed trace: when it came (ms after the trace's first row), its prompt's and answer's
    lengths in tokens, and the hash ids of its prompt's blocks (identical ids: identical blocks; () when unknown)."""

    at_ms: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class DatasetStats:
    """What reading a dataset saw, for the run's notes. ``largest_line_bytes``: the longest line, or for the JSON
    array form the largest record (the unit the line limit applies to there)."""

    records_read: int
    records_kept: int
    bytes_read: int
    largest_line_bytes: int


def approx_tokens(text: str) -> int:
    """The simulated engine's token count of ``text``: its words and single punctuation marks."""
    return len(_TOKEN_RE.findall(text))


class _Bad(Exception):
    """A record's fault (``what``) and the way out (``fix``); the reader adds the file and the place."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.what, self.fix = what, fix


def _show(value: Any) -> str:
    """A value from the file, quoted and cut short: it may be a megabyte long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)[:60]
    return text if len(text) <= 60 else text[:57] + "..."


def _tokens(value: Any, name: str) -> int:
    """A token count from the file: an integer (not a bool, not 5.0) from 1 to MAX_TOKENS."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Bad(
            f"{name} = {_show(value)} is not a positive integer", f"give {name} as a whole number of tokens"
        )
    if value > MAX_TOKENS:
        raise _Bad(f"{name} = {value} is above {MAX_TOKENS}", f"no request is that long; fix {name}")
    return value


def _text(value: Any, name: str) -> str:
    """A message's text: a string, and one that UTF-8 can carry (JSON's \\ud800 escape alone makes a string that
    any later encode would fail on)."""
    if not isinstance(value, str):
        raise _Bad(f"{name} is {_show(value)}, not a string", "give the text as a string")
    if m := _SURROGATE.search(value):
        raise _Bad(
            f"{name} holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at character {m.start()}",
            "fix or drop the record: no request can carry it",
        )
    return value


# -- datasets -------------------------------------------------------------------------------------------------------
# a record as read: its system prompt and each turn's user text with the answer's texts (counted only when the record
# enters the sample: tokenizing every answer of a 650 MB file would be most of the reading) or its given token count
_Answer = int | tuple[str, ...]
_Raw = tuple[str, tuple[tuple[str, _Answer], ...]]


def _dialogue(
    items: Any, key: str, role_key: str, text_key: str, roles: Mapping[str, str]
) -> tuple[str, list[tuple[str, _Answer]]]:
    """A list of messages: the system prompt (system messages joined) and (user text, answer texts) per user
    message. An answer before the first user message answers nothing a replay sends, and is left out."""
    if not isinstance(items, list):
        raise _Bad(f"{key} is {_show(items)}, not a list", f"give {key} as a list of messages")
    system: list[str] = []
    turns: list[tuple[str, list[str]]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _Bad(
                f"{key}[{i}] is {_show(item)}, not an object",
                f"give each message as {{{role_key}, {text_key}}}",
            )
        role = item.get(role_key)
        if not isinstance(role, str) or role not in roles:
            raise _Bad(
                f"{key}[{i}].{role_key} = {_show(role)} is not one of {', '.join(roles)}",
                "fix or drop that message",
            )
        text = _text(item.get(text_key), f"{key}[{i}].{text_key}")
        if roles[role] == "system":
            system.append(text)
        elif roles[role] == "user":
            turns.append((text, []))
        elif turns:
            turns[-1][1].append(text)
    return "\n\n".join(system), [(u, tuple(a)) for u, a in turns]


def _jsonl_record(obj: Any) -> _Raw:
    if not isinstance(obj, dict):
        raise _Bad(
            f"is {_show(obj)}, not a JSON object", 'give each line as {"prompt": ...} or {"messages": [...]}'
        )
    explicit = _tokens(obj["output_tokens"], "output_tokens") if "output_tokens" in obj else None
    if "prompt" in obj and "messages" in obj:
        raise _Bad("has both prompt and messages", "keep one of them")
    if "prompt" in obj:
        return "", ((_text(obj["prompt"], "prompt"), explicit if explicit is not None else ()),)
    if "messages" not in obj:
        hint = " (it has conversations: read the file as sharegpt)" if "conversations" in obj else ""
        raise _Bad(
            f"has neither prompt nor messages{hint}",
            'give each line as {"prompt": ...} or {"messages": [...]}',
        )
    system, turns = _dialogue(obj["messages"], "messages", "role", "content", CHAT_ROLES)
    if not turns:
        raise _Bad("has no user message", "drop the record: there is nothing to send")
    if explicit is not None:
        turns[-1] = (turns[-1][0], explicit)
    return system, tuple(turns)


def _sharegpt_record(obj: Any) -> _Raw:
    if not isinstance(obj, dict):
        raise _Bad(f"is {_show(obj)}, not a JSON object", 'give each record as {"conversations": [...]}')
    if "conversations" not in obj:
        raise _Bad(
            "lacks conversations", 'give each record as {"conversations": [{"from": ..., "value": ...}]}'
        )
    system, turns = _dialogue(obj["conversations"], "conversations", "from", "value", SHAREGPT_FROM)
    if not turns:
        raise _Bad("no human turn", "drop the record from the file: there is nothing to send")
    return system, tuple(turns)


def _conversation(raw: _Raw) -> Conversation:
    system, turns = raw
    return Conversation(
        tuple(Turn(u, a if isinstance(a, int) else sum(map(approx_tokens, a)) or None) for u, a in turns),
        system,
    )


def _dataset_records(src: BoundedFile, array: bool) -> Iterator[tuple[str, Any]]:
    """(where, JSON value) of each record: "record N (line L)"."""
    if array:
        for number, line, data in src.array():
            where = f"record {number} (line {line})"
            yield where, src.parse(src.decode(data, where, line), where, line)
    else:
        for number, (line, text) in enumerate(src.lines(), 1):
            yield f"record {number} (line {line})", src.parse(text, f"line {line}")


def read_dataset(
    path: str | os.PathLike[str],
    fmt: DatasetFormat,
    *,
    sample: int,
    seed: int,
    max_bytes: int,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> tuple[list[Conversation], DatasetStats]:
    """``sample`` records of a dataset file (all of them if it has fewer), in the file's order, and what reading
    saw. The sample is a reservoir (Algorithm R, from ``seed``): memory follows ``sample``, not the file; every
    record is checked as it streams by, so a bad one refuses the file wherever it is."""
    if fmt not in DATASET_FORMATS:
        raise ConfigError(f"dataset {path}: format {fmt!r} is not one of {', '.join(DATASET_FORMATS)}")
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ConfigError(f"dataset {path}: sample = {sample!r}; keep at least 1 record")
    check = _jsonl_record if fmt == "jsonl" else _sharegpt_record
    rng = random.Random(seed)
    kept: list[tuple[int, Conversation]] = []
    seen = 0
    with BoundedFile(path, "dataset", max_bytes, max_line_bytes) as src:
        head = src.first_byte()
        if head == b"[" and fmt != "sharegpt":
            raise src.refuse(
                "is a JSON array, not JSON lines", "read it as sharegpt, or write one record per line"
            )
        for where, obj in _dataset_records(src, head == b"["):
            try:
                raw = check(obj)
            except _Bad as bad:
                raise src.refuse(f"{where}: {bad.what}", bad.fix) from None
            if seen < sample:
                kept.append((seen, _conversation(raw)))
            elif (j := rng.randrange(seen + 1)) < sample:
                kept[j] = (seen, _conversation(raw))
            seen += 1
        if not seen:
            raise src.refuse("has no records", f"name a {fmt} file with records in it")
        kept.sort(key=lambda k: k[0])
        stats = DatasetStats(seen, len(kept), src.bytes_read, src.largest)
    return [conv for _, conv in kept], stats


# -- traces ---------------------------------------------------------------------------------------------------------
def _mooncake_row(obj: Any, block_tokens: int) -> tuple[float | int, int, int, tuple[int, ...]]:
    if not isinstance(obj, dict):
        raise _Bad(f"is {_show(obj)}, not a JSON object", "give each row as {timestamp, input_length, ...}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise _Bad(f"lacks {key}", "give each row timestamp, input_length, output_length and hash_ids")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts < MAX_TIMESTAMP_MS:
        raise _Bad(
            f"timestamp = {_show(ts)} is not a time in ms (from 0 to 2**53)", "give it in milliseconds"
        )
    n_in = _tokens(obj["input_length"], "input_length")
    n_out = _tokens(obj["output_length"], "output_length")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise _Bad(f"hash_ids is {_show(ids)}, not a list", "give the prompt's block hash ids as a list")
    if len(ids) != (blocks := math.ceil(n_in / block_tokens)):
        raise _Bad(
            f"{len(ids)} hash_ids for input_length {n_in}: {blocks} blocks of {block_tokens} tokens",
            f"one hash id per {block_tokens}-token block of the prompt (block_tokens)",
        )
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < MAX_HASH_ID:
            raise _Bad(f"hash_ids[{i}] = {_show(h)} is not an integer from 0 to 2**63 - 1", "fix the hash id")
    return ts, n_in, n_out, tuple(ids)


def _azure_time(text: str) -> int:
    """'2023-11-16 18:15:46.6805900' (UTC; up to 9 fractional digits, which datetime.fromisoformat does not take on
    every Python) in ns since the epoch."""
    m = _AZURE_TIME.fullmatch(text.strip())
    try:
        if m is None:
            raise ValueError("not YYYY-MM-DD HH:MM:SS[.fraction]")
        y, mo, d, h, mi, sec = (int(g) for g in m.groups()[:6])
        whole = datetime(y, mo, d, h, mi, sec, tzinfo=UTC)
    except ValueError as exc:
        raise _Bad(
            f"TIMESTAMP {_show(text)} is not a time: {exc}", "give it as 2023-11-16 18:15:46.6805900"
        ) from None
    return (whole - _EPOCH) // timedelta(seconds=1) * 1_000_000_000 + int((m.group(7) or "").ljust(9, "0"))


def _azure_count(text: str, name: str) -> int:
    text = text.strip()
    if not text.isdigit() or not text.isascii() or len(text) > 9:
        raise _Bad(
            f"{name} = {_show(text)} is not a positive integer", f"give {name} as a whole number of tokens"
        )
    return _tokens(int(text), name)


def _azure_row(text: str) -> tuple[int, int, int, tuple[int, ...]]:
    fields = text.split(",")
    if len(fields) != len(AZURE_HEADER):
        raise _Bad(f"has {len(fields)} fields, not {len(AZURE_HEADER)}", f"give {','.join(AZURE_HEADER)}")
    n_in, n_out = _azure_count(fields[1], "ContextTokens"), _azure_count(fields[2], "GeneratedTokens")
    return _azure_time(fields[0]), n_in, n_out, ()


def _trace_rows(src: BoundedFile, fmt: str, block_tokens: int) -> Iterator[tuple[int, Any]]:
    """(line, (time, input tokens, output tokens, hash ids)) of each row; time in ms (mooncake) or ns (azure)."""
    lines = src.lines()
    if fmt == "azure":
        for line, text in lines:
            if tuple(c.strip() for c in text.split(",")) != AZURE_HEADER:
                raise src.refuse(
                    f"line {line}: the header is {_show(text)}, not {','.join(AZURE_HEADER)}",
                    "an Azure LLM inference trace starts with that header",
                )
            break
    for line, text in lines:
        try:
            if fmt == "mooncake":
                yield line, _mooncake_row(src.parse(text, f"line {line}"), block_tokens)
            else:
                yield line, _azure_row(text)
        except _Bad as bad:
            raise src.refuse(f"line {line}: {bad.what}", bad.fix) from None


def read_trace(
    path: str | os.PathLike[str],
    fmt: TraceFormat,
    *,
    max_bytes: int,
    max_rows: int = 1_000_000,
    block_tokens: int = 512,
) -> list[TraceRow]:
    """A timed trace's rows, in order, ``at_ms`` from the first row. A row earlier than the one before it is
    refused (a replay sends in file order); so is a trace of more than ``max_rows`` rows."""
    if fmt not in TRACE_FORMATS:
        raise ConfigError(f"trace {path}: format {fmt!r} is not one of {', '.join(TRACE_FORMATS)}")
    if block_tokens < 1 or max_rows < 1:
        raise ConfigError(
            f"trace {path}: block_tokens = {block_tokens}, max_rows = {max_rows}; both are at least 1"
        )
    per_ms = 1 if fmt == "mooncake" else 1_000_000
    rows: list[TraceRow] = []
    with BoundedFile(path, "trace", max_bytes, MAX_LINE_BYTES) as src:
        first = prev = 0
        for line, (t, n_in, n_out, ids) in _trace_rows(src, fmt, block_tokens):
            if not rows:
                first = prev = t
            elif t < prev:
                raise src.refuse(
                    f"timestamps go backwards at line {line}: {(t - first) / per_ms} ms after "
                    f"{(prev - first) / per_ms} ms",
                    "sort the trace by time",
                )
            if len(rows) == max_rows:
                raise src.refuse(
                    f"has more than {max_rows} rows (max_rows)", "cut the trace, or raise max_rows"
                )
            rows.append(TraceRow((t - first) / per_ms, n_in, n_out, ids))
            prev = t
        if not rows:
            raise src.refuse("has no rows", f"name a {fmt} trace with rows in it")
    return rows
