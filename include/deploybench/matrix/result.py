"""The end of a matrix: what each cell came to, the comparison of the cells, its report, the verdict.

``conclude`` reads each cell's stored run (a skipped cell counts with the run that measured it),
compares them with ``deploybench.analyse.compare`` (figures, best configuration meeting the SLO,
Pareto front, and every other cell's change against the best one with its p-value), stores
the comparison with the matrix in its parameters (``params["matrix"]``: the matrix key, every
cell with its run, status, deployment group and ``rollout_run`` - the run whose rollout it ran on,
read from the cell's stored rollout stage - and ``shared_rollouts``: rollout run -> the cells that
ran on it), and writes the HTML report into the matrix's run folder. ``verdict`` raises naming the failed
cells, so the matrix run fails when a cell did.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from deploybench import paths
from deploybench.errors import StageFailed
from deploybench.report.html import Html, document, esc, table

log = logging.getLogger(__name__)

REUSE_NOTE = ("cells of one deployment group run one after another on one rollout: the first deploys, each next "
              "one adopts its engines (checked still running the recorded command and answering) and reuses its "
              "preflight (nodes, links) and fan-out (model verified on every node) while they are at most the "
              "matrix's reuse_s old (default 900 s); its preflight, fanout and rollout stages say 'reused from "
              "run X (age N s)'. The last cell of a group, or the matrix's cleanup, stops the engines")


def _statuses(target: Any, keys: list[str]) -> dict[str, tuple[str, str]]:
    """run key -> (status, configuration fingerprint) of the stored runs."""
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Run

    if not keys:
        return {}
    with open_store(target).connect() as conn:
        rows = conn.execute(select(Run.run_key, Run.status, Run.fingerprint).where(Run.run_key.in_(keys))).all()
    return {k: (s, f) for k, s, f in rows}


def _rollout_runs(target: Any, keys: list[str]) -> dict[str, str]:
    """run key -> the run whose rollout it used (itself, or the one its stored rollout stage says it reused)."""
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import StageResult

    if not keys:
        return {}
    with open_store(target).connect() as conn:
        rows = conn.execute(select(StageResult.run_key, StageResult.summary)
                            .where(StageResult.run_key.in_(keys), StageResult.stage == "rollout")).all()
    out = {}
    for key, summary in rows:
        reused = ((summary or {}).get("result") or {}).get("reused") if isinstance(summary, dict) else None
        src = reused.get("from") if isinstance(reused, dict) else None
        out[key] = src if isinstance(src, str) and src else key
    return out


def outcome(target: Any, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cell: id, label, action, run key, deployment, status (success | failed | not stored | skipped |
    not as planned: a stored run whose fingerprint is not the plan's), the run whose rollout it ran on, and why."""
    cells = plan["cells"]
    stored = _statuses(target, [c["run_key"] for c in cells])
    rollouts = _rollout_runs(target, [c["run_key"] for c in cells if c["action"] == "run"])
    rows = []
    for c in cells:
        status, fingerprint = stored.get(c["run_key"], ("not stored", None))
        reason = c["reason"]
        if fingerprint is not None and c.get("fingerprint") and fingerprint != c["fingerprint"]:
            # a run stored under the cell's key is not the configuration the plan made (a planted run): it is not
            # this cell's result, and it is left out of the comparison
            status = "not as planned"
            reason = (f"the stored run {c['run_key']} has configuration fingerprint {fingerprint[:12]}, the plan "
                      f"{c['fingerprint'][:12]}: not this cell's result, left out of the comparison")
        elif c["action"] == "skip":
            status = "skipped"
        rows.append({"cell_id": c["cell_id"], "label": c["label"], "action": c["action"], "run_key": c["run_key"],
                     "deployment": c["deployment"], "status": status,
                     "stored": c["run_key"] in stored and status != "not as planned",
                     "reason": reason, "rollout_run": rollouts.get(c["run_key"], "")})
    return rows


def shared_rollouts(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """rollout run -> the cells (ids) that ran on it, for rollouts more than one cell used."""
    out: dict[str, list[str]] = {}
    for r in rows:
        if r.get("rollout_run"):
            out.setdefault(r["rollout_run"], []).append(r["cell_id"])
    return {k: v for k, v in out.items() if len(v) > 1}


def conclude(target: Any, plan: dict[str, Any], out_dir: Path | None = None) -> dict[str, Any]:
    """Compare the matrix's cells, store the comparison, write its report; returns what the matrix came to."""
    from deploybench.analyse.compare import compare, curves, save_comparison
    from deploybench.report.compare_html import sections
    from deploybench.store.query import RunFilter

    rows = outcome(target, plan)
    keys = list(dict.fromkeys(r["run_key"] for r in rows if r["stored"]))
    failed = [r for r in rows if r["status"] not in ("success", "skipped")]
    result: dict[str, Any] = {"matrix_key": plan["matrix_key"], "cells": rows, "failed": failed,
                              "comparison_id": None, "best": [], "report": None, "run_keys": keys}
    if not keys:
        log.warning("matrix %s: no cell has a stored run; nothing to compare", plan["matrix_key"])
        return result
    cmp = compare(target, RunFilter(run_keys=tuple(keys)), save=False)
    first = next((k for k in cmp.best.values() if k), None)
    group = _group_of(cmp, first) if first else None
    if first and group is not None and len(cmp.groups.get(group, [])) > 1:
        # every other cell against the best, with p-values from the per-request samples
        cmp = compare(target, RunFilter(run_keys=tuple(keys)), baseline=first, save=False)
    by_key = {r["run_key"]: r for r in rows}
    cmp.params["matrix"] = {
        "key": plan["matrix_key"], "deployments": plan["deployments"], "reuse": REUSE_NOTE,
        "shared_rollouts": shared_rollouts(rows),
        "cells": [{k: r[k] for k in ("cell_id", "label", "run_key", "status", "deployment", "reason", "rollout_run")}
                  for r in rows]}
    cmp.id = save_comparison(target, cmp)
    best = [{"group": g, "run_key": k, "cell_id": by_key[k]["cell_id"], "label": by_key[k]["label"]}
            for g, k in cmp.best.items() if k]
    path = Path(out_dir or paths.run_dir(plan["matrix_key"])) / "comparison.html"
    label = {r["run_key"]: f"{r['cell_id']} {r['label']}" for r in rows}
    named = ", ".join(f"{b['cell_id']} {b['label']}" for b in best)
    body = [f"<h1>deploybench matrix <code>{esc(plan['matrix_key'])}</code></h1>",
            f"<p>comparison #{cmp.id} &middot; {len(rows)} cells &middot; "
            + (f"best meeting the SLO: <b class='success'>{esc(named)}</b>" if best
               else "<b class='failed'>no cell meets the SLO</b>") + "</p>",
            cells_table(rows), f"<p class='note'>Deployments: {esc(REUSE_NOTE)}.</p>",
            *sections(cmp, curves(target, keys), run_link=lambda k, t: Html(esc(label.get(k, t))))]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(document(f"deploybench matrix {plan['matrix_key']}", body))
    tmp.replace(path)
    result.update(comparison_id=cmp.id, best=best, report=str(path))
    return result


def _group_of(cmp: Any, run_key: str) -> str | None:
    return next((g for g, keys in cmp.groups.items() if run_key in keys), None)


def cells_table(rows: list[dict[str, Any]], run_link: Any = None) -> str:
    """The cells: id, label, deployment group, status, run (linked when ``run_link(key)`` is given), why."""
    def run(r: dict[str, Any]) -> Any:
        return run_link(r["run_key"]) if run_link and r["stored"] else r["run_key"]

    ids = {r["run_key"]: r["cell_id"] for r in rows}

    def rollout(r: dict[str, Any]) -> str:
        src = r.get("rollout_run") or ""
        return "" if not src else "its own" if src == r["run_key"] else f"{ids.get(src, src)}'s (shared)"

    return table(["cell", "configuration", "deployment", "rollout", "status", "run", "note"],
                 [[r["cell_id"], r["label"], r["deployment"], rollout(r), Html(f"<span class='{_cls(r['status'])}'>"
                   f"{esc(r['status'])}</span>"), run(r), r["reason"]] for r in rows])


def _cls(status: str) -> str:
    return {"success": "success", "skipped": "note"}.get(status, "failed")


def summary(result: dict[str, Any]) -> str:
    """What the compare task's log says: every cell's outcome and the best one."""
    lines = [f"matrix {result['matrix_key']}: " + ", ".join(
        f"{n} {s}" for s, n in _count(r["status"] for r in result["cells"]).items())]
    for r in result["cells"]:
        shared = r.get("rollout_run") and r["rollout_run"] != r["run_key"]
        lines.append(f"  {r['cell_id']:7} {r['status']:10} {r['deployment']}  {r['label']}  {r['run_key']}"
                     + (f"  (on the rollout of {r['rollout_run']})" if shared else "")
                     + (f"  - {r['reason']}" if r["reason"] else ""))
    for b in result["best"]:
        lines.append(f"best configuration meeting the SLO: {b['cell_id']} {b['label']} (run {b['run_key']})")
    if result["run_keys"] and not result["best"]:
        lines.append("no cell meets the SLO")
    if result["comparison_id"]:
        lines.append(f"comparison #{result['comparison_id']} stored; report {result['report']}")
    return "\n".join(lines)


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def verdict(result: dict[str, Any]) -> str:
    """The matrix's verdict: StageFailed naming every failed cell, else the summary."""
    if result["failed"]:
        raise StageFailed(f"matrix {result['matrix_key']}: {len(result['failed'])} of {len(result['cells'])} cells "
                          "failed: " + "; ".join(f"{r['cell_id']} ({r['label']}): {r['status']}, run {r['run_key']}"
                                                 for r in result["failed"]))
    return summary(result)
