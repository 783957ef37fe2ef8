"""Per-run pid files and the leftover cleaner, on real processes of this machine (the local transport).

A run's pid files name the run and the command; the cleaner stops exactly the processes of the
dead run whose command line still matches, and leaves alone pid 1, a reused pid, and another
run's processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploybench import leftovers
from deploybench.inventory import Inventory
from deploybench.transport import (
    RUN_ENV,
    Cluster,
    LocalTransport,
    alive_script,
    run_tag,
    spawn_script,
    stop_script,
)

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while _alive(pid) and time.monotonic() - t0 < s:
        time.sleep(0.05)
    return not _alive(pid)


@pytest.fixture
def inv(tmp_path) -> Inventory:
    return Inventory.model_validate({"name": "lz-unit", "transport": "local", "run_root": str(tmp_path / "run"),
                                     "python": sys.executable,
                                     "nodes": [{"name": "n01", "address": "127.0.0.1", "link_mbit": 1000}]})


@pytest.fixture
def spawned():
    pids: list[int] = []
    yield pids
    for p in pids:
        try:
            os.killpg(p, 9)
        except OSError:
            pass


def _spawn(inv: Inventory, run_key: str | None, name: str, spawned: list[int], argv=SLEEP) -> tuple[int, Path]:
    root = Path(inv.run_root) / "n01" / "engine"
    pid_file = root / f"{name}.pid"
    t = LocalTransport(inv.nodes[0])
    out = t.run(spawn_script(argv, str(root / f"{name}.log"), str(pid_file), run_key=run_key), timeout=10).check()
    pid = int(out.stdout.split()[-1])
    spawned.append(pid)
    return pid, pid_file


def test_a_pid_file_names_its_run_and_command_and_the_process_carries_the_run_key(inv, spawned):
    pid, pid_file = _spawn(inv, "run/A 1", "engine", spawned)
    lines = pid_file.read_text().splitlines()
    assert lines[0] == str(pid) and lines[1] == "run=run/A 1" and json.loads(lines[2].split("=", 1)[1]) == SLEEP
    for _ in range(50):  # the exec of nohup -> python happens just after the spawn returns
        if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in SLEEP]:
            break
        time.sleep(0.02)
    assert f"{RUN_ENV}=run/A 1".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    t = LocalTransport(inv.nodes[0])
    assert t.run(alive_script(str(pid_file))).ok  # the readers take the first line
    t.run(stop_script(str(pid_file), 1), timeout=10).check()
    assert _wait_gone(pid) and not pid_file.exists()


def test_run_tag_is_file_safe_and_tells_keys_apart():
    a, b = run_tag("deploybench_run__manual__2026-12-03T07:00:00+00:00"), run_tag("x/y z")
    assert "/" not in a + b and ":" not in a and " " not in b
    assert run_tag("k1") != run_tag("k2") and run_tag("k1") == run_tag("k1")


def test_the_cleaner_stops_only_the_dead_runs_processes(inv, spawned, wait_for):
    dead, dead_file = _spawn(inv, "dead-run", "engine-dead", spawned)
    child_argv = ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(300)' & wait"]
    dead_group, _ = _spawn(inv, "dead-run", "relay-dead", spawned, argv=child_argv)
    alive_run, alive_file = _spawn(inv, "live-run", "engine-live", spawned)
    def both_started() -> list[str]:
        kids = subprocess.run(["pgrep", "-g", str(dead_group)], capture_output=True, text=True).stdout.split()
        return kids if len(kids) >= 2 else []

    kids = wait_for(both_started, 5, f"sh and its python child in group {dead_group}")
    with Cluster(inv) as c:
        found = leftovers.clean_nodes(c, "dead-run", grace_s=1)["n01"]
    assert sorted(f["action"] for f in found) == ["killed", "killed"]
    assert _wait_gone(dead) and all(_wait_gone(int(k)) for k in kids), "the whole process group is stopped"
    assert _alive(alive_run) and alive_file.exists(), "another run's engine is not touched"
    assert not dead_file.exists()


def test_pid_1_a_reused_pid_and_a_vanished_process_are_left_alone(inv, spawned, tmp_path):
    root = Path(inv.run_root) / "n01" / "preflight"
    root.mkdir(parents=True)
    (root / "init.pid").write_text(f"1\nrun=dead\nargv={json.dumps(['/sbin/init'])}\n")
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    spawned.append(other.pid)
    # the pid file names a command the pid no longer runs (the pid was reused by `sleep 300`)
    (root / "iperf3-server.pid").write_text(f"{other.pid}\nrun=dead\nargv={json.dumps(['iperf3', '-s'])}\n")
    gone = subprocess.Popen(["true"])
    gone.wait()
    (root / "gone.pid").write_text(f"{gone.pid}\nrun=dead\nargv={json.dumps(['true'])}\n")
    with Cluster(inv) as c:
        found = {Path(f["file"]).name: f for f in leftovers.clean_nodes(c, "dead", grace_s=1)["n01"]}
    assert found["init.pid"]["action"] == "left alone" and "pid 1" in found["init.pid"]["why"]
    assert found["iperf3-server.pid"]["action"] == "left alone" and "not the recorded command" in \
        found["iperf3-server.pid"]["why"]
    assert found["gone.pid"]["action"] == "gone"
    assert _alive(other.pid), "a process that only reuses the pid survives"
    other.kill()
    other.wait()


def test_the_controller_side_stops_a_dead_runs_k6_by_its_run_folder(spawned, monkeypatch, tmp_path):
    from deploybench import paths

    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path / "home"))
    folder = paths.run_dir("dead-cli") / "load"
    folder.mkdir(parents=True)
    argv = [sys.executable, "-c", "import time; time.sleep(300)", "k6-stand-in"]
    proc = subprocess.Popen(argv, start_new_session=True)
    spawned.append(proc.pid)
    (folder / "sustained.k6.pid").write_text(f"{proc.pid}\nargv={json.dumps(argv)}\n")
    time.sleep(0.2)
    found = leftovers.clean_controller("dead-cli", grace_s=1)
    assert [f["action"] for f in found] == ["killed"]
    proc.wait(timeout=5)
    assert "k6 pid" in leftovers.describe({"controller": found, "nodes": {}})


def test_the_cleaner_also_stops_a_dead_runs_k6_on_the_load_generators(tmp_path, spawned):
    """A dead run's k6 keeps sending its share of the phase on a load generator: the cleaner looks there too, by
    default, at the pid file deploybench.load.loadgen leaves under <run_root>/<generator>/load/."""
    inv = Inventory.model_validate({"name": "lz-unit", "transport": "local", "run_root": str(tmp_path / "run"),
                                    "python": sys.executable,
                                    "nodes": [{"name": "n01", "address": "127.0.0.1", "link_mbit": 1000}],
                                    "loadgens": [{"name": "g01", "address": "127.0.0.2"}]})
    folder = tmp_path / "run" / "g01" / "load" / "sustained"
    t = LocalTransport(inv.loadgens[0])
    out = t.run(spawn_script(SLEEP, str(folder / "k6.log"), str(folder / "k6.pid"), run_key="dead-run"),
                timeout=10).check()
    pid = int(out.stdout.split()[-1])
    spawned.append(pid)
    with Cluster(inv) as c:
        found = leftovers.clean_nodes(c, "dead-run", grace_s=1)
    assert [f["action"] for f in found["g01"]] == ["killed"] and found["n01"] == []
    assert _wait_gone(pid) and not (folder / "k6.pid").exists()
