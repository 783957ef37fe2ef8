"""The relay's launcher (fanout.relay_control.LAUNCHER): how every relay command starts on a node. Run here as the
controller runs it there, ``python -I -S -c LAUNCHER <program> <command> ...``, on a program in a temporary folder."""

from __future__ import annotations

import hashlib
import json
import marshal
import subprocess
import sys
from pathlib import Path

import pytest

from deploybench.fanout import relay_control
from deploybench.fanout.relay_control import NOT_INSTALLED, launcher, relay_source, relay_version


@pytest.fixture
def program(tmp_path: Path) -> Path:
    p = tmp_path / f"relay-{relay_version()}.py"
    p.write_bytes(relay_source())
    return p


def launch(program: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", "-c", launcher(), str(program), *args], input=stdin,
                          capture_output=True, timeout=30)


def code_file(program: Path) -> Path:
    return program.with_suffix(".code")


def header(program: Path, body: bytes, version: str = sys.version) -> bytes:
    """What the launcher writes before the code: the source's sha256, the interpreter's, the code's."""
    digests = [hashlib.sha256(x).hexdigest() for x in (program.read_bytes(), version.encode(), body)]
    return " ".join(digests).encode() + b"\n"


def test_the_program_runs_and_its_compiled_code_is_kept_and_used(program, tmp_path):
    first = launch(program, "manifest", str(tmp_path / "none"))
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {"error": "missing", "dir": str(tmp_path / "none")}
    kept = code_file(program).read_bytes()
    head, _, body = kept.partition(b"\n")
    assert kept == header(program, body) + body
    assert marshal.loads(body).co_filename == str(program)
    # the kept code is what runs: code with a valid header that says something else is run in its place (the
    # launcher trusts its folder as Python trusts a __pycache__: the node's run folder, the deploy user's own)
    marker = tmp_path / "ran"
    other = marshal.dumps(compile(f"open({str(marker)!r}, 'w').write('kept code')", str(program), "exec"))
    code_file(program).write_bytes(header(program, other) + other)
    assert launch(program, "--help").returncode == 0 and marker.read_text() == "kept code"


@pytest.mark.parametrize("spoil", ["body changed", "cut short", "another interpreter", "another source", "garbage",
                                   "empty", "writable by others", "a link"])
def test_kept_code_that_is_not_this_source_s_for_this_interpreter_is_not_run_but_replaced(program, tmp_path, spoil):
    marker = tmp_path / "ran"
    evil = marshal.dumps(compile(f"open({str(marker)!r}, 'w').write('spoiled')", str(program), "exec"))
    assert launch(program, "--help").returncode == 0
    good = code_file(program).read_bytes()
    _, _, body = good.partition(b"\n")
    spoiled = {
        "body changed": header(program, body) + evil,
        "cut short": good[: len(good) // 2],
        "another interpreter": header(program, evil, version=sys.version + " (another build)") + evil,
        "another source": b" ".join([hashlib.sha256(b"print('x')\n").hexdigest().encode(),
                                     *header(program, evil).split(b" ")[1:]]) + evil,
        "garbage": b"\x00\xff" * 100,
        "empty": b"",
        "writable by others": header(program, evil) + evil,  # a valid file, but another user could have written it
        "a link": header(program, evil) + evil,  # a valid file, reached through a link
    }[spoil]
    if spoil == "a link":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.write_bytes(spoiled)
        code_file(program).unlink()
        code_file(program).symlink_to(elsewhere)
    else:
        code_file(program).write_bytes(spoiled)
    if spoil == "writable by others":
        code_file(program).chmod(0o666)
    res = launch(program, "--help")
    assert res.returncode == 0 and res.stdout.startswith(b"usage: deploybench-relay"), res.stderr
    assert not marker.exists()
    assert code_file(program).read_bytes() == good  # compiled again from the checked source, and kept
    assert not code_file(program).is_symlink() and code_file(program).stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["altered", "missing", "cut short"])
def test_a_program_that_is_not_this_version_s_is_not_run_and_its_input_is_read(program, tmp_path, damage):
    """Exit NOT_INSTALLED (the controller installs the program, then runs it again), nothing of the program run,
    and stdin read to its end first (the controller's input never meets a closed channel)."""
    marker = tmp_path / "ran"
    assert launch(program, "--help").returncode == 0  # its kept code is there: it must not run either
    if damage == "missing":
        program.unlink()
    else:
        text = program.read_bytes()[: 4000 if damage == "cut short" else None]
        program.write_bytes(text + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode())
    big = b"x" * (4 << 20)  # more than a pipe holds: a launcher that exits without reading it breaks the pipe
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", launcher(), str(program), "--help"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    try:
        proc.stdin.write(big)  # BrokenPipeError if the launcher exited without reading it (communicate hides that)
        proc.stdin.close()
    finally:
        proc.wait(timeout=30)
    out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    assert proc.returncode == NOT_INSTALLED, err
    assert out == b"" and not marker.exists()


def test_the_launcher_names_the_relay_and_its_version_first(program):
    """``ps`` shows the command line's start: the launcher's first line names the relay and its version."""
    first = launcher().splitlines()[0]
    assert first.startswith("# deploybench relay ") and relay_version() in first
    assert relay_control.relay_digest() in launcher()
