"""The one HTML toolkit (``deploybench.report.html``): it stays the only escaper and table builder in the
library (an AST scan), its number formatters, and every page and report escaping a hostile string from a
node or the store exactly once (never raw, never twice)."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from starlette.testclient import TestClient

from deploybench.report import compare_html, run_html
from deploybench.report.html import esc, fmt, fmt_change, fmt_num, fmt_p, fmt_pct, fmt_util, table
from deploybench.store import StageRow
from deploybench.web import app as webapp
from deploybench.web import compare_page, history_page, matrix_page
from deploybench.web import markup as html_view
from deploybench.web.access import AllowAll
from tests.support.run_folders import make_run_folder
from tests.unit.web.test_webapp import make_phase, make_run, stored  # the builders of the page tests
from tests.unit.web.test_webapp_pages import _comparison, _history_view

LIBRARY = Path(__file__).resolve().parents[3] / "include" / "deploybench"
TOOLKIT = LIBRARY / "report" / "html.py"
ROOT = "/deploybench"
# every character the escaper must turn into an entity: < > ' " &
HOSTILE = "<script>alert('x')</script>\"&"
DOUBLE = ("&amp;lt;", "&amp;gt;", "&amp;#x27;", "&amp;quot;", "&amp;amp;")


def assert_escaped_once(doc: str, hostile: str = HOSTILE) -> None:
    assert hostile not in doc and "<script" not in doc.lower()  # never raw
    assert esc(hostile) in doc  # shown, escaped
    twice = [d for d in DOUBLE if d in doc]
    assert not twice, f"escaped twice: {twice} near {doc[max(0, doc.find(twice[0]) - 80):][:200]!r}"


# -- one toolkit -----------------------------------------------------------------------------
ESCAPE_MODULES = {"html", "markupsafe", "xml.sax.saxutils", "saxutils", "cgi", "jinja2"}
ESCAPER_NAME = re.compile(r"^_*(esc|escape|h|quote_html|html_quote)$|escape", re.I)
TABLE_MARKUP = re.compile(r"<(table|thead|tbody|tr|td|th)[\s>/]", re.I)
ENTITY = re.compile(r"&(lt|gt|quot|amp|#x27|#39);")


def violations(source: str, where: str) -> list[str]:
    """What in ``source`` escapes HTML or builds a table outside the toolkit (empty: nothing)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if a.name in ESCAPE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "") in ESCAPE_MODULES:
            found.append(f"{where}:{node.lineno} imports from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr == "escape" and isinstance(node.value, ast.Name) \
                and node.value.id in ESCAPE_MODULES | {"Markup"}:
            found.append(f"{where}:{node.lineno} calls {node.value.id}.escape")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ESCAPER_NAME.search(node.name):
            found.append(f"{where}:{node.lineno} defines an escaper {node.name}()")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if TABLE_MARKUP.search(node.value):
                found.append(f"{where}:{node.lineno} writes table markup {node.value[:40]!r}")
            if ENTITY.search(node.value):
                found.append(f"{where}:{node.lineno} writes an entity by hand {node.value[:40]!r}")
    return found


def test_the_scan_finds_each_kind_of_home_made_escaper_and_table():
    """The scanner is not vacuous: each way of escaping or building a table by hand is caught."""
    for snippet in ("import html\nhtml.escape(x)", "from markupsafe import escape", "import markupsafe",
                    "from xml.sax.saxutils import escape", "def esc(v):\n    return v",
                    "def _html_escape(v):\n    return v", "x = '<table>' + rows", "x = f'<td class=n>{v}</td>'",
                    "x = s.replace('<', '&lt;')", "x = '<tr>'"):
        assert violations(snippet, "snippet"), snippet
    for fine in ("import re\nre.escape(x)", "from urllib.parse import quote", "x = '<the headline>'",
                 "from deploybench.report.html import esc, table\ny = table(['a'], [[esc(1)]])",
                 "import shlex\nshlex.quote(x)"):
        assert not violations(fine, "snippet"), fine
    assert violations(TOOLKIT.read_text(), "toolkit")  # the toolkit itself is what the scan looks for


def test_no_module_outside_the_toolkit_escapes_html_or_builds_a_table():
    """The library, the DAG files and the Airflow plugin."""
    repo = LIBRARY.parents[1]
    files = sorted(p for d in (LIBRARY, repo / "dags", repo / "plugins") for p in d.rglob("*.py") if p != TOOLKIT)
    assert len(files) > 50 and LIBRARY / "web" / "markup.py" in files and repo / "dags" in {p.parent for p in files}
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(repo)))]
    assert not found, "escape and build tables with deploybench.report.html (esc, table, Html):\n" + "\n".join(found)


# -- the formatters --------------------------------------------------------------------------
def test_numbers_format_alike_whatever_their_type_and_missing_is_named():
    assert fmt_num(1234.5678) == fmt_num(np.float64(1234.5678)) == fmt_num(Decimal("1234.5678")) == "1,234.57"
    assert fmt_num(1234) == fmt_num(np.int64(1234)) == "1,234"
    assert fmt_num(None) == fmt_num(np.nan) == fmt_num(np.float32("inf")) == "n/a"
    assert fmt_num(True) == "True" and fmt_num("text") == "text"
    assert fmt(None) == fmt(float("nan")) == "" and fmt(2.5) == "2.50" and fmt(12000) == "12,000"
    assert fmt_pct(0.0123) == "1.23%" and fmt_pct(np.nan) == "n/a"
    assert fmt_change(0.21) == "+21.0%" and fmt_change(-0.05) == "-5.0%" and fmt_change(None, "") == ""
    assert fmt_p(1e-40) == "1e-40" and fmt_p(0.04567) == "0.0457" and fmt_p(None) == fmt_p(np.nan) == "n/a"
    assert fmt_util(None) == "absent" and fmt_util(np.float64(87.25)) == "87.2" and fmt_util(87) == "87.0"


def test_table_escapes_cells_and_classes_once():
    doc = table([HOSTILE], [[HOSTILE, 1.5, None]], [HOSTILE])
    assert_escaped_once(doc)
    assert "<td>1.50</td><td></td>" in doc


# -- every page and report, with a hostile run key, node name and error ----------------------
def test_run_list_and_run_page_escape_once():
    run = make_run(HOSTILE, fingerprint=HOSTILE, tags={HOSTILE: HOSTILE}, dag_id=HOSTILE,
                   config={"engine": {"profile": HOSTILE}}, inventory=HOSTILE)
    stage = StageRow(stage="load", status="failed", seconds=1.5, summary={"summary": HOSTILE}, error=HOSTILE)
    listing = html_view.render_run_list([html_view.RunRow(run, make_phase(phase=HOSTILE))], ROOT,
                                        fingerprint=HOSTILE, note=HOSTILE)
    page = html_view.render_run_page(stored(run, [make_phase(node=HOSTILE)], [stage]), ROOT, f"/r/{HOSTILE}")
    for doc in (listing, page):
        assert_escaped_once(doc)
    assert page.count(esc(HOSTILE)) >= 8  # key, DAG, inventory, engine, tags, summary, error, node


def test_comparison_page_and_report_escape_once():
    cmp = _comparison(HOSTILE)
    cmp.params["filter"] = HOSTILE
    view = compare_page.ComparisonView(cmp, {}, note=HOSTILE)
    doc = compare_page.render(view, compare_page.CompareQuery(runs=tuple(cmp.run_keys()), baseline=HOSTILE), ROOT,
                              error=HOSTILE)
    assert_escaped_once(doc)
    assert_escaped_once(compare_html.render(cmp))


def test_history_page_escapes_once():
    view = _history_view()
    view.runs.loc[3, "run_key"] = HOSTILE
    view.runs["exclude_reason"] = view.runs["exclude_reason"].map(lambda r: r and HOSTILE)
    for column in ("dag_id", "model", "cluster", "engine"):
        view.runs[column] = HOSTILE
    view.note = HOSTILE
    assert_escaped_once(history_page.render(view, ROOT))


def test_matrix_page_escapes_once():
    cell = {"cell_id": HOSTILE, "label": HOSTILE, "run_key": HOSTILE, "status": HOSTILE, "deployment": HOSTILE,
            "reason": HOSTILE, "rollout_run": HOSTILE}
    found = {"id": HOSTILE, "run_keys": [HOSTILE], "baseline": HOSTILE, "result": {"best": {"w": HOSTILE}},
             "params": {"matrix": {"key": HOSTILE, "cells": [cell], "reuse": HOSTILE}}}
    assert_escaped_once(matrix_page.render(found, ROOT, AllowAll()))


def test_error_page_escapes_the_message_once(monkeypatch):
    monkeypatch.setattr(webapp.store, "load_run", lambda target, key: None)
    parent = FastAPI()
    parent.mount(ROOT, webapp.create_app(dsn="postgresql+psycopg://ok@127.0.0.1/x"))
    with TestClient(parent) as c:  # in-process: no socket, no database
        r = c.get(f"{ROOT}/runs/{html_view.run_href('', HOSTILE)[len('/runs/'):]}")
    assert r.status_code == 404 and "no run" in r.text
    assert "<script" not in r.text and "&lt;script&gt;alert(\\&#x27;x\\&#x27;)" in r.text
    assert not [d for d in DOUBLE if d in r.text]


def test_run_report_escapes_once(tmp_path):
    """A hostile run key, node name, stage summary and error in the run folder: the report escapes each once."""
    from deploybench.records import StageRecord
    from deploybench.run import read_record, save_record

    run = replace(make_run_folder(tmp_path), key=HOSTILE, nodes=["n1", HOSTILE])
    for stage, edit in (("preflight", lambda r: (r.update(decision=HOSTILE), r["links"][0].update(src=HOSTILE,
                                                                                                  error=HOSTILE))),
                        ("fanout", lambda r: r["nodes"][0].update(node=HOSTILE, error=HOSTILE))):
        rec = read_record(tmp_path, stage)
        assert rec is not None and isinstance(rec.result, dict)
        edit(rec.result)
        save_record(tmp_path, rec)
    save_record(tmp_path, StageRecord(stage="rollout", status="failed", started_at="2026-12-02T10:00:00+00:00",
                                       seconds=1.0, summary=HOSTILE, error=HOSTILE))
    doc = run_html.render(run)
    assert_escaped_once(doc)
    assert doc.count(esc(HOSTILE)) >= 7  # key (heading, title), decision, link src and error, node, error, summary
