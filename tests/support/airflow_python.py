"""Code run in a fresh interpreter with Airflow's test environment and this checkout's plugins: how the
pages' tests load the plugin the way Airflow's api-server does (tests/integration/test_webapp*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
# a fresh interpreter that imports Airflow and builds its app: 80 s was passed on a slower machine of this kind in the
# parallel part (6 workers on 2 cores); the tests' own time_limit is the bound for a hang
SUBPROCESS_TIMEOUT_S = 160


def fresh_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter with Airflow's test environment; it prints one JSON line last."""
    full_env = {**os.environ, "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS), **env}
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                         text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
