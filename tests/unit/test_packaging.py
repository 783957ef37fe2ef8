"""pyproject.toml against the tree: the library's imports are declared dependencies, the declared ones are
used and installed, and package-data names exactly the data files the package needs (a wheel built from
the project must hold what an editable install happens to find)."""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "include" / "deploybench"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(reqs: list[str]) -> dict[str, Requirement]:
    return {_norm(r.name): r for r in map(Requirement, reqs)}


CORE = _declared(PROJECT["dependencies"])
EXTRAS = {extra: _declared(reqs) for extra, reqs in PROJECT.get("optional-dependencies", {}).items()}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Inside a ``try`` whose handler catches ImportError: the module works without the package."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for h in node.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
    return False


def third_party_imports() -> list[tuple[str, str, bool]]:
    """(module imported, file relative to include/, guarded) for every import of another project."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top == "deploybench" or top in sys.stdlib_module_names:
                    continue
                found.append((module, str(path.relative_to(PACKAGE.parent)), _guarded(node, parents)))
    return found


def distributions_of(module: str) -> set[str]:
    """The distributions that may provide ``module`` (Airflow's providers share the ``airflow`` namespace)."""
    parts = module.split(".")
    if parts[0] == "airflow":
        if len(parts) > 2 and parts[1] == "providers":
            return {_norm("apache-airflow-providers-" + "-".join(parts[2:2 + n])) for n in (1, 2)}
        return {"apache-airflow"}
    return {_norm(d) for d in _top_level().get(parts[0], [])} or {_norm(parts[0])}


@functools.cache
def _top_level() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())  # reads every installed distribution: once


IMPORTS = third_party_imports()


def test_the_scan_sees_the_imports_it_should():
    """A guard for the scan itself: a known import of each kind is found, with its guard."""
    seen = {(m, f): g for m, f, g in IMPORTS}
    assert seen[("pydantic", "deploybench/config.py")] is False
    assert seen[("uvloop", "deploybench/sim/engine.py")] is True
    assert any(m.startswith("airflow.providers.ssh") for m, _, _ in IMPORTS)


def test_every_library_import_is_a_declared_dependency():
    """Plain imports need a core dependency. The Airflow layer may use the ``airflow`` extra, and an
    import guarded by ``except ImportError`` may come from any extra."""
    missing = []
    for module, file, guarded in IMPORTS:
        dists = distributions_of(module)
        allowed = set(CORE)
        if module.split(".")[0] in ("airflow", "asgiref") or "/airflow/" in file or "airflow_" in file:
            allowed |= set(EXTRAS.get("airflow", {}))
        if guarded:
            allowed |= {d for reqs in EXTRAS.values() for d in reqs}
        if not dists & allowed:
            missing.append(f"{file}: import {module} (from {sorted(dists)})")
    assert not missing, "declare these in pyproject.toml:\n" + "\n".join(missing)


def test_every_core_dependency_is_imported_by_the_library():
    used = set().union(*(distributions_of(m) for m, _, _ in IMPORTS))
    assert set(CORE) - used == set(), "declared in [project] dependencies but imported nowhere under include/"


@pytest.mark.parametrize("req", [*CORE.values(), *EXTRAS.get("airflow", {}).values()], ids=str)
def test_the_installed_environment_satisfies_the_declaration(req: Requirement):
    """.ci/bootstrap installs requirements.txt, then the project with --no-deps: the pinned set must cover
    pyproject's dependencies, at versions they accept."""
    version = metadata.version(req.name)
    assert req.specifier.contains(version, prereleases=True), f"{req.name} {version} does not meet {req}"


def test_package_data_names_files_that_exist_and_every_data_file_is_named():
    patterns = SETUPTOOLS["package-data"]["deploybench"]
    files = [p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    for pattern in patterns:
        assert fnmatch.filter(files, pattern), f"package-data {pattern!r} matches no file under include/deploybench"
    in_packages = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                   if (p.parent / "__init__.py").exists()}
    unnamed = [f for f in files
               if f not in in_packages and not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not unnamed, f"data files a wheel would leave out (add them to package-data): {unnamed}"
