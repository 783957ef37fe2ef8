"""``deploybench engine check``: does an engine someone already started answer as its profile says?

Run against one engine (``--url``, e.g. a new vLLM version on a GPU box) with the profile a run would use, it
checks, in about a minute, what a benchmark relies on:

- readiness (the profile's own check) and the model's listing (``/v1/models``; Triton: the model's ready path);
- a plain completion, a chat completion (OpenAI engines) or a generate (Triton, with the vLLM backend's inputs:
  the answer without the prompt, the backend's token counts), each with ``usage`` or its absence said;
- a streamed request, timed as the load's TTFT sampler times it (deploybench.load.ttft.stream_once);
- token counts that agree: the streamed request's count (from usage, the backend's counts, or the events) and
  the plain one's usage, both for the same ``max_tokens`` with ``ignore_eos``;
- every metric the profile's ``[metrics]`` map names, on the page the profile names (its port and path): present,
  or absent with the reason, and the nearest name the page does have (a renamed metric shows as one).

``check`` returns the rows; a row that is "FAIL" or "absent" is a mismatch (``mismatches``), which the command
turns into a non-zero exit. What the engine sends is read within the scraper's and the client's bounds.
"""

from __future__ import annotations

import asyncio
import difflib
import time
from dataclasses import dataclass, replace
from typing import Any

from deploybench import http
from deploybench.engines import HISTOGRAM_ROLES, EngineProfile
from deploybench.load.results import Endpoint
from deploybench.load.scrape import MetricsPageError, get_page, parse_metrics

PROMPT = "The quick brown fox jumps over the lazy dog and keeps running"
MAX_TOKENS = 8


@dataclass(frozen=True)
class Row:
    check: str
    result: str  # "ok", "FAIL", "absent", "info"
    detail: str = ""


def mismatches(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.result in ("FAIL", "absent")]


def table(rows: list[Row]) -> str:
    width = max(len(r.check) for r in rows)
    return "\n".join(f"{r.check:<{width}}  {r.result:<6}  {r.detail}".rstrip() for r in rows)


def _usage(body: Any) -> dict | None:
    u = body.get("usage") if isinstance(body, dict) else None
    return u if isinstance(u, dict) else None


def _count(v: Any) -> int | None:
    """A token count as Triton returns one (a number or a list of one)."""
    n = v[0] if isinstance(v, list) and len(v) == 1 else v
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _openai(base: str, model: str, timeout_s: float) -> tuple[list[Row], int | None]:
    rows: list[Row] = []
    try:
        listed = http.get_json(f"{base}/v1/models", timeout=timeout_s)
        ids = [m.get("id") for m in listed.get("data", []) if isinstance(m, dict)] if isinstance(listed, dict) else []
        rows.append(Row("model listed", "ok" if model in ids else "FAIL",
                        f"/v1/models lists {ids[:5]}" if model not in ids else f"/v1/models lists {model!r}"))
    except (http.HTTPFailure, ValueError) as exc:
        rows.append(Row("model listed", "FAIL", f"/v1/models: {exc}"))
    counted = None
    for kind, path, extra in (("completion", "/v1/completions", {"prompt": PROMPT}),
                              ("chat completion", "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": PROMPT}]})):
        body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
        try:
            got = http.post_json(f"{base}{path}", body, timeout=timeout_s)
        except (http.HTTPFailure, ValueError) as exc:
            rows.append(Row(kind, "FAIL", f"{path}: {exc}"))
            continue
        choice = (got.get("choices") or [{}])[0] if isinstance(got, dict) else {}
        text = choice.get("text") if kind == "completion" else (choice.get("message") or {}).get("content")
        if not isinstance(text, str) or not text:
            rows.append(Row(kind, "FAIL", f"{path} answered without text: {str(got)[:200]}"))
            continue
        u = _usage(got)
        n = _count((u or {}).get("completion_tokens"))
        if kind == "completion":
            counted = n
        rows.append(Row(kind, "ok", f"{len(text)} characters; usage: " + (
            f"{n} completion tokens, {_count(u.get('prompt_tokens'))} prompt tokens" if u else "absent")))
    return rows, counted


def _triton(base: str, model: str, timeout_s: float) -> tuple[list[Row], int | None]:
    rows: list[Row] = []
    ok = http.is_up(f"{base}/v2/models/{model}/ready", timeout=timeout_s)
    rows.append(Row("model ready", "ok" if ok else "FAIL", f"GET /v2/models/{model}/ready"
                    + ("" if ok else " did not answer 200")))
    body = {"text_input": PROMPT, "stream": False, "exclude_input_in_output": True, "return_num_output_tokens": True,
            "return_num_input_tokens": True, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0,
                                                            "ignore_eos": True}}
    try:
        got = http.post_json(f"{base}/v2/models/{model}/generate", body, timeout=timeout_s)
    except (http.HTTPFailure, ValueError) as exc:
        rows.append(Row("generate", "FAIL", f"/v2/models/{model}/generate: {exc}"))
        return rows, None
    text = got.get("text_output") if isinstance(got, dict) else None
    n = _count(got.get("num_output_tokens")) if isinstance(got, dict) else None
    if not isinstance(text, str) or not text:
        rows.append(Row("generate", "FAIL", f"no text_output: {str(got)[:200]}"))
    elif text.startswith(PROMPT):
        rows.append(Row("generate", "FAIL", "the answer starts with the prompt: exclude_input_in_output was ignored"))
    else:
        rows.append(Row("generate", "ok", f"{len(text)} characters; token counts: "
                        + (f"{n} output, {_count(got.get('num_input_tokens'))} input" if n is not None
                           else "absent (a backend without return_num_output_tokens)")))
    return rows, n


def _stream(prof: EngineProfile, base: str, model: str, timeout_s: float) -> tuple[Row, int | None]:
    from deploybench.load.ttft import stream_once

    api = "triton" if prof.api == "triton" else "completions"
    row = asyncio.run(stream_once(Endpoint("engine", base, model), api, PROMPT, len(PROMPT.split()), MAX_TOKENS,
                                  timeout_s))
    if row["error_kind"]:
        return Row("stream", "FAIL", f"{row['error_kind']} (HTTP {row['status']})"), None
    source = {"usage": "the server's count", "stream": "the events (no usage sent)"}.get(str(row.get("tokens_from")),
                                                                                          "?")
    return Row("stream", "ok", f"TTFT {row['ttft_ms']:.1f} ms, {row['output_tokens']} tokens from {source}, "
               f"{row['latency_ms']:.1f} ms in all"), int(row["output_tokens"])


def _metric_rows(prof: EngineProfile, base: str, timeout_s: float, metrics_port: int | None) -> list[Row]:
    names = prof.metrics.names
    if not names:
        return [Row("metrics page", "info", "the profile maps no metrics: a run has no engine figures")]
    where = prof.metrics if metrics_port is None else replace(prof.metrics, port=metrics_port)
    url = where.url(base)
    try:
        samples = parse_metrics(get_page(url, timeout_s), ("",))
    except (MetricsPageError, http.HTTPFailure) as exc:
        return [Row("metrics page", "FAIL", f"{exc} (the profile's [metrics] port and path; --metrics-port)"),
                *(Row(f"metric {role}", "absent", f"{name}: no page") for role, name in names.items())]
    present = {n for n, _, _ in samples}
    rows = [Row("metrics page", "ok", f"{url}: {len(samples)} samples")]
    for role, name in names.items():
        forms = (f"{name}_count", f"{name}_bucket") if role in HISTOGRAM_ROLES else (name, f"{name}_total")
        if any(f in present for f in forms):
            rows.append(Row(f"metric {role}", "ok", name))
            continue
        families = sorted({n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in present})
        near = difflib.get_close_matches(name, families, n=1, cutoff=0.6)
        rows.append(Row(f"metric {role}", "absent", f"{name}: not on {url}" + (
            f" (nearest there: {near[0]})" if near else f" ({len(families)} families there)")))
    return rows


def check(prof: EngineProfile, base_url: str, model: str, timeout_s: float = 30.0,
          metrics_port: int | None = None) -> list[Row]:
    """The rows of the check (module doc) of the engine at ``base_url`` serving ``model`` with profile ``prof``;
    ``metrics_port`` for an engine started with another metrics port than its profile's."""
    base = base_url.rstrip("/")
    t0 = time.monotonic()
    ready = prof.is_ready(base, model, timeout_s)
    rows = [Row("readiness", "ok" if ready else "FAIL",
                f"{prof.readiness.kind} check at {prof.readiness.path}" + ("" if ready else ": not ready"))]
    got, plain = (_triton if prof.api == "triton" else _openai)(base, model, timeout_s)
    rows += got
    stream_row, streamed = _stream(prof, base, model, timeout_s)
    rows.append(stream_row)
    if plain is not None and streamed is not None:
        same = plain == streamed
        rows.append(Row("token counts agree", "ok" if same else "FAIL",
                        f"plain {plain}, streamed {streamed}" + ("" if same else f" (asked for {MAX_TOKENS})")))
    else:
        rows.append(Row("token counts agree", "info", "not compared: "
                        + ("the plain answer has no count" if plain is None else "the stream failed")))
    rows += _metric_rows(prof, base, timeout_s, metrics_port)
    rows.append(Row("time", "info", f"{time.monotonic() - t0:.1f} s"))
    return rows
