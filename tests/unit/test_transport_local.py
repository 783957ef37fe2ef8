"""spawn_script/stop_script through the local transport: real processes, started detached and stopped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploybench.errors import TransportError
from deploybench.inventory import Node
from deploybench.transport import LocalTransport, spawn_script, stop_script


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def t():
    return LocalTransport(Node(name="n01", address="127.0.0.1", link_mbit=1000))


def test_spawn_then_stop_kills_the_process_group(t, tmp_path, wait_for):
    pid_file, log_file = str(tmp_path / "x.pid"), str(tmp_path / "logs" / "x.log")
    # a parent that starts a child: stopping must take both
    res = t.run(spawn_script(["sh", "-c", "sleep 300 & echo child $!; wait"], log_file, pid_file), timeout=10).check()
    pid = int(res.stdout.split()[-1])
    wait_for(lambda: os.path.exists(log_file) and "child" in Path(log_file).read_text(), 5, "the child's pid logged")
    child = int(Path(log_file).read_text().split()[-1])
    assert _alive(pid) and _alive(child)
    t.run(stop_script(pid_file, grace_s=2), timeout=10).check()
    wait_for(lambda: not _alive(pid) and not _alive(child), 5, f"parent {pid} and child {child} gone")
    assert not os.path.exists(pid_file)
    # idempotent: a second stop finds nothing and succeeds
    assert t.run(stop_script(pid_file), timeout=10).ok


def test_stop_escalates_to_kill_after_grace(t, tmp_path, wait_for):
    pid_file = str(tmp_path / "stubborn.pid")
    res = t.run(spawn_script(["sh", "-c", "trap '' TERM; while true; do sleep 0.1; done"], str(tmp_path / "s.log"),
                             pid_file), timeout=10).check()
    pid = int(res.stdout.split()[-1])
    # its loop has started (a `sleep` child), so the trap is set: TERM alone cannot stop it
    wait_for(lambda: subprocess.run(["pgrep", "-P", str(pid)], capture_output=True).returncode == 0, 5,
             f"the loop of {pid} running")
    t.run(stop_script(pid_file, grace_s=0.5), timeout=10).check()
    wait_for(lambda: not _alive(pid), 5, f"{pid} killed after the grace period")


def test_arguments_are_quoted_not_interpreted(t, tmp_path):
    evil = f"x; touch {tmp_path}/pwned"
    res = t.run(["echo", evil], timeout=5).check()
    assert res.stdout.strip() == evil
    assert not (tmp_path / "pwned").exists()


def test_timeout_and_missing_binary(t):
    with pytest.raises(TransportError, match="timed out"):
        t.run(["sleep", "5"], timeout=0.3)
    assert t.run(["definitely-not-a-binary-xyz"], timeout=5).rc == 127


def test_a_zombie_counts_as_gone(t, tmp_path, wait_for):
    """Nodes whose init reaps late leave zombies; stop and alive must not wait on them."""
    import subprocess

    from deploybench.transport import alive_script

    # `sleep 0.1` exits at once and is never reaped: its parent exec'd into `sleep 30`.
    parent = subprocess.Popen(["sh", "-c", "sleep 0.1 & echo $!; exec sleep 30"], stdout=subprocess.PIPE, text=True)
    try:
        zombie = int(parent.stdout.readline())
        wait_for(lambda: Path(f"/proc/{zombie}/stat").read_text().split(")")[-1].split()[0] == "Z", 5,
                 f"{zombie} a zombie")
        pid_file = tmp_path / "z.pid"
        pid_file.write_text(str(zombie))
        assert not t.run(alive_script(str(pid_file)), timeout=5).ok
        pid_file.write_text(str(parent.pid))
        assert t.run(alive_script(str(pid_file)), timeout=5).ok
        # TERM turns the parent into a zombie too (this test has not reaped it yet): with a grace
        # period of 120 s, a stop that waited on the zombie would hit the 20 s timeout.
        t.run(stop_script(str(pid_file), grace_s=120), timeout=20).check()
        assert parent.poll() is not None
    finally:
        parent.kill()
        parent.wait()


def test_a_command_without_input_reads_an_empty_stdin_not_ours(tmp_path):
    """Under Airflow's task runner fd 0 is the supervisor's socket: a command that reads stdin
    (the relay's `cat > /dev/null` guard) must see end-of-file, not wait on whatever fd 0 is.
    Here fd 0 of the calling process is a pipe nobody writes to or closes."""
    script = (
        "from deploybench.inventory import Node\n"
        "from deploybench.transport import LocalTransport\n"
        "t = LocalTransport(Node(name='n01', address='127.0.0.1', link_mbit=1000))\n"
        "r = t.run('cat; echo read-to-end', timeout=10)\n"
        "print(r.rc, r.stdout.strip())\n"
    )
    r_fd, w_fd = os.pipe()  # the write end stays open in this process: a reader of r_fd would block
    try:
        proc = subprocess.run([sys.executable, "-c", script], stdin=r_fd, capture_output=True, text=True,
                              timeout=30, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [str(Path(__file__).resolve().parents[2] / "include"),
                                   os.environ.get("PYTHONPATH", "")])})
    finally:
        os.close(r_fd)
        os.close(w_fd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "read-to-end"], proc.stdout
