"""The library's layers (DESIGN.md, "Target layout (round 2)"): reading top-down, each layer imports only
the layers under it. Every import in include/deploybench counts, also one inside a function (the library
imports lazily a lot) or under TYPE_CHECKING; an import within one layer is fine. An upward import that
today's code already has is listed in UPWARD with why, so a new one fails here, and so does one that is
gone (delete its entry)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "include" / "deploybench"
ROOT = "deploybench"

# Top to bottom. A module belongs to the layer of the longest prefix naming it (deploybench.airflow.home is
# "airflow", deploybench.airflow.stages is "commands"); "deploybench" names only the package's __init__, so
# a new top-level module is in no layer until it is placed here.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # what a person or a DAG starts: the `deploybench` command, and the Airflow task functions that only DAG
    # files, the triggerer and the plugin import (deploybench/airflow/__init__.py)
    ("commands", ("deploybench.cli", "deploybench.airflow")),
    # the two other ways to drive runs (DESIGN.md, "Three ways to drive a run"): a config matrix, and the
    # scheduled regression benchmarks with their verdict
    ("matrix, regression", ("deploybench.matrix", "deploybench.regression")),
    # one run, stage by stage: the loop, and the registry of stage objects it runs
    ("pipeline", ("deploybench.pipeline", "deploybench.stages")),
    ("web", ("deploybench.web",)),
    # the design's airflow/: connections -> library objects, the local Airflow home
    ("airflow", ("deploybench.airflow.connections", "deploybench.airflow.home")),
    ("report, analyse", ("deploybench.report", "deploybench.analyse")),
    # the results store, and the cluster's lease: a row of the results database
    ("store", ("deploybench.store", "deploybench.lease")),
    # the stage packages, and what a run leaves on the nodes (found and stopped by the rollout's backends)
    ("stages", ("deploybench.rollout", "deploybench.preflight", "deploybench.fanout", "deploybench.load",
                "deploybench.leftovers")),
    ("lab, sim", ("deploybench.lab", "deploybench.sim")),
    ("run", ("deploybench.run",)),
    ("records", ("deploybench.records",)),
    ("base", ("deploybench", "deploybench.config", "deploybench.inventory", "deploybench.params", "deploybench.presets",
              "deploybench.manifest", "deploybench.transport", "deploybench.engines", "deploybench.paths",
              "deploybench.errors", "deploybench.http", "deploybench.policy", "deploybench.timeouts",
              "deploybench.workloads")),
]

# (importer, imported): why today's code imports upward. Remove an entry with the import it names.
UPWARD: dict[tuple[str, str], str] = {
    ("deploybench.stages", "deploybench.matrix.planned"):
        "validate refuses a run claiming a matrix cell's run id or deployment section that the plan did not write",
    ("deploybench.stages", "deploybench.matrix.deployment"):
        "preflight decides once whether a matrix cell adopts the rollout an earlier cell kept (Context.adoption); "
        "teardown keeps it for the next cell",
    ("deploybench.web.compare_page", "deploybench.cli.analyse"):
        "the compare page parses tags and times with the CLI's parse_tag/parse_when",
    ("deploybench.web.matrix_page", "deploybench.matrix.result"):
        "the matrix page reads a matrix's cells through the matrix's own reader (matrix.result.cells_table)",
    ("deploybench.sim.engine", "deploybench.cli.engine"):
        "the simulated engine's main() parses its options with the `deploybench engine serve` parser",
    ("deploybench.sim.triton", "deploybench.cli.engine"):
        "the lab's tritonserver builds the simulated engine's options with the `deploybench engine serve` parser",
    ("deploybench.sim.local", "deploybench.load"):
        "LocalEngines.start returns load.Endpoint (the engines a load test drives)",
    ("deploybench.run", "deploybench.lease"):
        "the recorder stops a stage under the lease when the heartbeat found it lost (lease.raise_if_lost)",
    ("deploybench.manifest", "deploybench.fanout.relay"):
        "a manifest entry is checked by the relay's rule (the relay is a stdlib-only program run on nodes)",
    ("deploybench.records", "deploybench.fanout.result"): "a stage's typed result lives in its stage package",
    ("deploybench.records", "deploybench.load.probe"): "a stage's typed result lives in its stage package",
    ("deploybench.records", "deploybench.load.results"): "a stage's typed result lives in its stage package",
    ("deploybench.records", "deploybench.preflight.model"): "a stage's typed result lives in its stage package",
    ("deploybench.records", "deploybench.rollout.base"): "a stage's typed result lives in its stage package",
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(LIBRARY.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_name(p): p for p in sorted(LIBRARY.rglob("*.py")) if "migrations" not in p.parts}


def _module_of(name: str) -> str:
    """The library module ``name`` is, or is in (a name imported from a module)."""
    while name not in modules() and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports(path: Path) -> dict[str, int]:
    """The library modules ``path`` imports, anywhere in it, with the line of the first import of each."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from deploybench.x import y`: y is a module of x, or a name in x
            targets = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: a relative import; the library imports absolutely")
        else:
            continue
        for target in targets:
            if target == "deploybench" or target.startswith("deploybench."):
                found.setdefault(_module_of(target), node.lineno)
    return found


def layer_of(module: str) -> int:
    """The index in LAYERS (0 = top) of ``module``'s layer."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            within = module == prefix or (prefix != ROOT and module.startswith(prefix + "."))
            if within and (best is None or len(prefix) > best[0]):
                best = (len(prefix), i)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best[1]


def upward_imports() -> dict[tuple[str, str], str]:
    """Every import of a layer above the importer's: (importer, imported) -> where and what."""
    found = {}
    for name, path in modules().items():
        for target, line in imports(path).items():
            if layer_of(target) < layer_of(name):
                found[(name, target)] = (f"{path.relative_to(LIBRARY.parents[1])}:{line}: {name} "
                                         f"({LAYERS[layer_of(name)][0]}) imports {target} "
                                         f"({LAYERS[layer_of(target)][0]})")
    return found


def test_every_module_has_a_layer():
    assert len(modules()) > 100 and "deploybench.fanout.relay" in modules()
    for name in modules():
        layer_of(name)


def test_the_layer_map_names_what_exists():
    """A prefix in LAYERS names a module or package of the library (a rename leaves no dead entry)."""
    names = set(modules())
    missing = [p for _, prefixes in LAYERS for p in prefixes if p not in names]
    assert not missing, f"LAYERS names what the library does not have: {missing}"


def test_imports_reach_only_the_layers_below():
    new = {edge: what for edge, what in upward_imports().items() if edge not in UPWARD}
    assert not new, ("an import of a layer above (DESIGN.md, Target layout; tests/unit/test_layers.py):\n"
                     + "\n".join(sorted(new.values()))
                     + "\nmove the code down a layer (or the imported code down), or, for a known debt, list it in "
                       "UPWARD with why")


def test_every_listed_upward_import_still_exists():
    stale = sorted(set(UPWARD) - set(upward_imports()))
    assert not stale, ("these upward imports are gone: delete their entries from UPWARD in "
                       f"tests/unit/test_layers.py: {stale}")


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    """The scan finds lazy imports and TYPE_CHECKING ones, and resolves a name imported from a package."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from deploybench.records import StageRecord\n"
                   "def f():\n    from deploybench.store import db, write_run\n    import deploybench.lab.cluster\n")
    assert imports(src) == {"deploybench.records": 3, "deploybench.store.db": 5, "deploybench.store": 5,
                            "deploybench.lab.cluster": 6}
    assert layer_of("deploybench.airflow.stages") < layer_of("deploybench.pipeline") < layer_of(
        "deploybench.airflow.home") < layer_of("deploybench.store.db") < layer_of("deploybench.config")
