"""The project's one HTML toolkit: the reports (``report.run_html``, ``report.compare_html``, the
matrix report) and the results pages (``deploybench.web``) build their markup from it.

One escaper (``esc``), one table builder (``table``), one document frame (``document``) and one
family of number formatters (``fmt_num`` and its named uses: ``fmt_ms``, ``fmt_pct``,
``fmt_change``, ``fmt_p``, ``fmt_util``; ``fmt`` is a table cell's default). A cell is escaped
unless it is ``Html`` (markup the caller built from escaped parts), so a value from a node or the
store can never turn into markup by accident, and is escaped exactly once.
tests/unit/report/test_html_toolkit.py fails when a module elsewhere escapes or builds a table itself.

It lives in ``report/`` because the pages already render the reports' own sections (the comparison
and history sections) and so depend on ``report`` anyway; it imports nothing but the standard
library, so the Airflow layer (notifications) may use it too.
"""

from __future__ import annotations

import html
import math
import numbers
from collections.abc import Iterable
from datetime import UTC, datetime
from decimal import Decimal
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


def _missing(value: Any) -> bool:
    """None, NaN and infinities (Python or numpy numbers alike) are not a figure."""
    return value is None or (isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
                             and not math.isfinite(float(value)))


def fmt_num(value: Any, digits: int = 2, missing: str = "n/a") -> str:
    """Thousands separated, ``digits`` decimals for a non-integer; ``missing`` for None, NaN and inf.
    Booleans and text are shown as they are (a bool is not the number 1)."""
    if isinstance(value, Decimal):  # a PostgreSQL numeric
        value = float(value)
    if _missing(value):
        return missing
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    return f"{float(value):,.{digits}f}"


def fmt(v: Any) -> str:
    """A table cell's default: numbers by ``fmt_num`` (two decimals), missing values blank."""
    return fmt_num(v, 2, missing="")


def fmt_ms(value: Any) -> str:
    """A latency in milliseconds; None (no request succeeded) is 'n/a'."""
    return fmt_num(value, 1)


def fmt_pct(rate: Any, digits: int = 2, missing: str = "n/a") -> str:
    """A fraction as a percentage (0.0123 -> '1.23%'); None and NaN are ``missing``."""
    return missing if _missing(rate) else f"{float(rate):.{digits}%}"


def fmt_change(rel: Any, missing: str = "n/a") -> str:
    """A relative change, signed, one decimal (0.21 -> '+21.0%')."""
    return missing if _missing(rel) else f"{float(rel):+.1%}"


def fmt_p(p: Any) -> str:
    """A p-value with three significant digits (1e-40 stays readable); None and NaN are 'n/a'."""
    return "n/a" if _missing(p) else f"{float(p):.3g}"


def fmt_util(pct: Any) -> str:
    """A GPU utilisation in %; None is 'absent' (not measured: never shown as 0)."""
    return "absent" if _missing(pct) else fmt_num(float(pct), 1)


def fmt_money(value: Any, currency: Any) -> str:
    """A cost with its currency code ("0.0123 USD"); None is 'absent' (not priced: never shown as 0)."""
    if _missing(value):
        return "absent"
    return f"{float(value):.4g} {currency if isinstance(currency, str) else '?'}"


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


def document(title: str, parts: Iterable[str] | str, css: str = STYLE, nav: str = "") -> str:
    """A whole self-contained HTML document (inline CSS, no script, no external asset): the reports'
    and the pages' one frame. ``parts`` is markup; ``nav`` markup put before it."""
    body = parts if isinstance(parts, str) else "\n".join(parts)
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width,initial-scale=1'>"
            f"<title>{esc(title)}</title><style>{css}</style></head><body>{nav}{body}</body></html>")
