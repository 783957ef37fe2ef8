"""The results page of a matrix run (``GET /dag-runs/<matrix dag>/<run id>``, the "Benchmark results" tab).

A matrix DAG run stores no run of its own: what it leaves is the comparison its ``compare`` task
saved, with the matrix in ``params["matrix"]`` (``deploybench.matrix.result``). This page shows it:
heading "Matrix <key>", the best cell meeting the SLO, the cells (configuration, deployment group,
status, run linked to its page, why skipped), the note on what cells of one deployment share, and a
link to the full comparison page of the cells' runs (``/compare?run=...&baseline=<best>``: figures,
curves, Pareto front, every cell against the best with p-values).

Only for a user who may read the matrix DAG; a cell's run is linked only if the user may read it.
"""

from __future__ import annotations

from typing import Any

from deploybench.matrix.result import cells_table
from deploybench.report.html import Html, esc
from deploybench.web.access import ReadAccess
from deploybench.web.markup import compare_href, link, page, run_href

RUN_DAG_ID = "deploybench_run"


def load(target: Any, matrix_key: str) -> dict[str, Any] | None:
    """The newest comparison a matrix run stored (id, run keys, params, result), or None."""
    from sqlalchemy import select

    from deploybench.store.db import open_store
    from deploybench.store.models import Comparison

    query = (select(Comparison.id, Comparison.run_keys, Comparison.params, Comparison.result,
                    Comparison.baseline_run_key)
             .where(Comparison.params["matrix"]["key"].astext == matrix_key)
             .order_by(Comparison.id.desc()).limit(1))
    with open_store(target).connect() as conn:
        row = conn.execute(query).first()
    return None if row is None else {"id": row[0], "run_keys": row[1], "params": row[2], "result": row[3],
                                     "baseline": row[4]}


def render(found: dict[str, Any], root: str, access: ReadAccess) -> str:
    matrix = found["params"]["matrix"]
    cells = [{**c, "stored": c["status"] not in ("not stored",)} for c in matrix["cells"]]
    readable = access.may_read_dag(RUN_DAG_ID)

    def run_link(key: str) -> Html:
        return link(run_href(root, key), key, code=True) if readable else Html(f"<code>{esc(key)}</code>")

    by_key = {c["run_key"]: c for c in cells}
    best = [by_key[k] for k in (found["result"].get("best") or {}).values() if k in by_key]
    head = ("Best configuration meeting the SLO: <b class='success'>"
            + ", ".join(f"{esc(c['cell_id'])} {esc(c['label'])}" for c in best) + "</b>") if best else \
        "Best configuration meeting the SLO: <b class='failed'>none meets the SLO</b>"
    counts: dict[str, int] = {}
    for c in cells:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    compare = compare_href(root, run=list(found["run_keys"]), baseline=found["baseline"])
    body = (
        f"<h1>Matrix <code>{esc(matrix['key'])}</code></h1>"
        f"<p>{len(cells)} cells: {esc(', '.join(f'{n} {s}' for s, n in counts.items()))} &middot; "
        f"comparison #{esc(found['id'])} &middot; "
        f"{link(compare, 'open the comparison of the cells')}</p>"
        f"<p class='best-run'>{head}</p>"
        f"<h2>Cells</h2>{cells_table(cells, run_link)}"
        f"<p class='note'>Deployments: {esc(matrix.get('reuse', ''))}.</p>"
    )
    return page(f"deploybench matrix {matrix['key']}", body, root)
