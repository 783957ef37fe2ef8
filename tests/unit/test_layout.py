"""The package imports in any order: each module of include/deploybench imported first, in a process
where no other deploybench module is loaded yet, so an import cycle that only one order reveals (the
fan-out relay's move once made ``deploybench lab`` fail while the unit tests passed) fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "include" / "deploybench"

SCRIPT = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "deploybench" or m.startswith("deploybench.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def modules() -> list[str]:
    names = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__" or "migrations" in parts:
            continue  # runs on import / Alembic's env, loaded by Alembic itself
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


def test_every_module_imports_first():
    names = modules()
    assert "deploybench.fanout.relay" in names and "deploybench.sim.engine" in names
    r = subprocess.run([sys.executable, "-c", SCRIPT, *names], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"modules that fail when imported first:\n{r.stdout}{r.stderr[-2000:]}"


def test_the_library_does_not_import_airflow():
    """Outside deploybench.airflow, importing any module leaves Airflow unloaded (STYLE: the library is
    free of Airflow at import time)."""
    names = [n for n in modules() if not n.startswith("deploybench.airflow.") or n == "deploybench.airflow.home"]
    script = ("import importlib, sys\n"
              f"for n in {names!r}: importlib.import_module(n)\n"
              "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.'))[:5])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"Airflow imported by the library: {r.stdout}"
