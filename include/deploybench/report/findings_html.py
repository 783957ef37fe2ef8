"""The findings section of the run report and of the results pages' run page (deploybench.analyse.findings).

One table, a row per finding: the rule, the node (the cluster when None), the metric, the window, the numbers
(observed against expected or a threshold), the evidence and what to do; "No findings" on a clean run. It takes
anything with a finding's fields (the analysis's ``Finding``, the store's ``FindingRow``), so the report, read
from the run folder, and the run page, read from the store, show the same thing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deploybench.analyse.findings import ANALYSED_PHASES
from deploybench.report.html import esc, fmt_num, fmt_time, table

CLEAN = "No findings: no rule of the runbook's troubleshooting table fired on this run."


def _window(f: Any) -> str:
    span = ""
    if f.window_start is not None and f.window_end is not None:
        span = f" {fmt_time(f.window_start)} + {(f.window_end - f.window_start).total_seconds():.0f} s"
    return f"{f.phase}{f' step {f.step}' if f.step else ''}{span}"


def findings_section(findings: Iterable[Any], analysed: bool = True) -> str:
    """The section's HTML; ``analysed`` False: the run has no phase the rules judge (ANALYSED_PHASES), so no
    finding says nothing: the section says so rather than "no findings"."""
    rows = list(findings)
    head = "<h2>Findings</h2>"
    if not rows:
        said = CLEAN if analysed else (f"Not judged: the rules read the {' and '.join(ANALYSED_PHASES)} phase, "
                                       "which this run has no result of.")
        return head + f"<p class='findings-none'>{esc(said)}</p>"
    # words read left to right (the report's tables align right for figures); the evidence and advice get room
    style = ("<style>.findings td,.findings th{text-align:left;vertical-align:top}"
             ".findings td:nth-child(7),.findings td:nth-child(8){min-width:18em}</style>")
    return head + style + "<div class='findings'>" + table(
        ["rule", "node", "metric", "window", "observed", "expected / threshold", "evidence", "what to do"],
        [[f.rule, f.node or "cluster", f.metric, _window(f), _n(f.observed), _n(f.expected), f.evidence, f.advice]
         for f in rows]) + "</div>"


def _n(value: float | None) -> str:
    """Four significant digits (a bitmask and a byte count alike), "absent" when not measured."""
    return "absent" if value is None else f"{value:.4g}" if abs(value) < 1e4 else fmt_num(value, 0)
