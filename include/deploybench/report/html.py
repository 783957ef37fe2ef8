"""Small HTML building blocks shared by the run and comparison reports."""

from __future__ import annotations

import html
from typing import Any, Iterable

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1150px;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0;font-size:90%}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child,th:first-child{text-align:left}"
    ".failed,.worse,.regression{color:#b00}.success,.better,.improvement{color:#070}"
    "pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}figure{margin:1em 0}svg{max-width:100%;height:auto}"
    "tr.best td{background:#eef8ee}.note{color:#666;font-size:90%}"
)


def esc(v: Any) -> str:
    return html.escape(str(v))


def fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:
            return ""
        return f"{v:,.2f}"
    return str(v)


def table(headers: Iterable[str], rows: Iterable[Iterable[Any]], row_class: Iterable[str] | None = None) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    classes = list(row_class) if row_class is not None else None
    body = "".join(
        (f"<tr class='{esc(classes[i])}'>" if classes and classes[i] else "<tr>")
        + "".join(f"<td>{esc(fmt(c))}</td>" for c in r) + "</tr>"
        for i, r in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure(svg: str, caption: str) -> str:
    if not svg:
        return f"<p class='note'>{esc(caption)}: no data.</p>"
    return f"<figure>{svg}<figcaption>{esc(caption)}</figcaption></figure>"


def document(title: str, parts: list[str]) -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + esc(title) + "</title><style>" + STYLE
            + "</style></head><body>" + "\n".join(parts) + "</body></html>")
