"""k6/lib checked inside the real k6 (no server): config, prompt set, request builders, SSE parsing."""

from __future__ import annotations

import os
import subprocess

import pytest

from deploybench.load import find_k6
from deploybench.paths import k6_dir


def test_k6_lib_checks_pass():
    try:
        k6 = find_k6()
    except Exception as exc:  # noqa: BLE001 - no k6 here: nothing to check
        pytest.skip(str(exc))
    from deploybench.workloads import block_text

    # the trace's block words must be the same in k6 and in Python (the TTFT sampler's requests share blocks)
    env = {"PATH": os.environ.get("PATH", ""), "K6_NO_USAGE_REPORT": "true",
           "DB_TEST_BLOCK_TEXT": block_text([3, 11], 600, 512, 987654321)}
    proc = subprocess.run(
        [k6, "run", "--no-color", "--address", "", str(k6_dir() / "tests" / "lib.test.js")],
        capture_output=True, text=True, timeout=60, env=env,
    )
    failed = [line.strip() for line in proc.stdout.splitlines() if "✗" in line]
    assert proc.returncode == 0, f"k6 exit {proc.returncode}; failed checks: {failed}\n{proc.stderr[-2000:]}"
