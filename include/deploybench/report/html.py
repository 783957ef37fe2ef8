"""Small HTML building blocks shared by the reports and the results pages (``deploybench.web.markup``).

The one escaper, the number formatters and the one table builder of the project live here.
A cell is escaped unless it is ``Html`` (markup the caller built from escaped parts), so a
value from the store can never turn into markup by accident.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:1150px;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0;font-size:90%}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}td:first-child,th:first-child{text-align:left}"
    ".failed,.worse,.regression{color:#b00}.success,.better,.improvement{color:#070}"
    "pre{background:#f6f6f6;padding:.5em;white-space:pre-wrap}figure{margin:1em 0}svg{max-width:100%;height:auto}"
    "tr.best td{background:#eef8ee}.note{color:#666;font-size:90%}"
)


class Html(str):
    """Markup that is already safe (built from ``esc``-aped parts): ``table`` inserts it as it is."""


def esc(value: Any) -> str:
    """HTML-escaped text of a value (quotes too, so it is safe inside attributes); None is empty."""
    return html.escape("" if value is None else str(value), quote=True)


def fmt(v: Any) -> str:
    """A report cell: floats with two decimals and thousands separated, missing values blank."""
    if v is None:
        return ""
    if isinstance(v, float):
        if v != v:
            return ""
        return f"{v:,.2f}"
    return str(v)


def fmt_num(value: float | None, digits: int = 2) -> str:
    """Thousands separated, ``digits`` decimals for floats; None and NaN are 'n/a'."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def fmt_ms(value: float | None) -> str:
    """A latency in milliseconds; None (no request succeeded) is 'n/a'."""
    return fmt_num(value, 1)


def fmt_pct(rate: float | None) -> str:
    return "n/a" if rate is None or rate != rate else f"{rate:.2%}"


def fmt_util(pct: float | None) -> str:
    """A GPU utilisation in %; None is 'absent' (not measured: never shown as 0)."""
    return "absent" if pct is None or pct != pct else f"{pct:.1f}"


def fmt_time(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cell(value: Any) -> str:
    return value if isinstance(value, Html) else esc(fmt(value))


def table(
    headers: Iterable[str],
    rows: Iterable[Iterable[Any]],
    row_class: Iterable[str] | None = None,
    numeric_from: int | None = None,
) -> str:
    """A table; each cell is escaped (after ``fmt``) unless it is ``Html``. ``row_class`` gives each row a
    CSS class ("" for none); columns from ``numeric_from`` on are right-aligned (class ``n``)."""

    def attr(i: int) -> str:
        return " class=n" if numeric_from is not None and i >= numeric_from else ""

    head = "".join(f"<th{attr(i)}>{_cell(h)}</th>" for i, h in enumerate(headers))
    classes = list(row_class) if row_class is not None else None
    body = "".join(
        (f"<tr class='{esc(classes[i])}'>" if classes and classes[i] else "<tr>")
        + "".join(f"<td{attr(j)}>{_cell(c)}</td>" for j, c in enumerate(r))
        + "</tr>"
        for i, r in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure(svg: str, caption: str) -> str:
    if not svg:
        return f"<p class='note'>{esc(caption)}: no data.</p>"
    return f"<figure>{svg}<figcaption>{esc(caption)}</figcaption></figure>"


def document(title: str, parts: list[str]) -> str:
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + esc(title) + "</title><style>" + STYLE
            + "</style></head><body>" + "\n".join(parts) + "</body></html>")
