"""The findings section of the report and the run page: evidence and advice shown, escaped; a clean run says so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np

from deploybench.report.findings_html import CLEAN, findings_section
from deploybench.report.html import esc
from deploybench.store.facts import FindingRow
from deploybench.store.rows import StoredRun
from deploybench.web.markup import render_run_page
from tests.support import store_fixtures as fx

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def _throttled(node: str | None = "n2") -> FindingRow:
    return FindingRow(rule="gpu_throttled", node=node, metric="DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", phase="sustained",
                      window_start=T0, window_end=T0 + timedelta(seconds=20), observed=32.0, expected=0.0,
                      evidence="DCGM reported clock slowdown reasons 0x20, SM clock 1000 MHz <b>",
                      advice="check its temperature and cooling")


def test_a_finding_shows_its_node_window_numbers_evidence_and_advice_escaped():
    html = findings_section([_throttled(), _throttled(None)])
    assert "<h2>Findings</h2>" in html and "gpu_throttled" in html and "<td>n2</td>" in html
    assert "<td>cluster</td>" in html  # a cluster-wide finding names no node
    assert "sustained 2026-12-06 12:00:00 UTC + 20 s" in html and "<td>32</td><td>0</td>" in html
    assert "SM clock 1000 MHz &lt;b&gt;" in html and "<b>" not in html  # evidence is text, never markup
    assert "check its temperature and cooling" in html and "No findings" not in html


def test_a_clean_run_says_no_findings_and_a_run_without_load_says_why():
    assert esc(CLEAN) in findings_section([]) and "No findings" in CLEAN
    assert "Not judged: the rules read the sustained phase" in findings_section([], analysed=False)


def test_the_run_page_shows_the_stored_findings():
    run = fx.run_record("deploybench_run/f1", fx.config())
    stored = StoredRun(run=run, stages=[], phases=[], sample_count=0, created_at=T0, updated_at=T0,
                       findings=[_throttled()])
    page = render_run_page(stored, "/deploybench", None)
    assert "<h2>Findings</h2>" in page and "gpu_throttled" in page and "0x20" in page
    clean = render_run_page(stored.model_copy(update={"findings": []}), "/deploybench", None)
    assert "<h2>Findings</h2>" in clean and "Not judged" in clean  # no sustained phase stored: nothing judged
    sustained = fx.phase_from(fx.samples(20, 250, np.random.default_rng(1)), 20)
    clean = render_run_page(stored.model_copy(update={"findings": [], "phases": sustained}), "/deploybench", None)
    assert "No findings" in clean and "Not judged" not in clean
