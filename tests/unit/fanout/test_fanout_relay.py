"""The relay program on loopback addresses: hash cache, a two-hop pipelined stream, the upstream check."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploybench import manifest
from deploybench.fanout import relay

RELAY = [sys.executable, relay.__file__]


def call(*args: str, stdin: bytes | None = None) -> dict:
    out = subprocess.run(RELAY + list(args), input=stdin, capture_output=True, check=True, timeout=60)
    return json.loads(out.stdout)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def test_manifest_matches_python_and_the_cache_avoids_rehashing(tmp_path):
    d = tmp_path / "m"
    m = manifest.seed_model(d, total_mb=1, shards=2)
    cache = str(tmp_path / "cache.json")
    first = call("manifest", str(d), "--cache", cache)
    assert first["manifest"]["digest"] == m.digest and first["declared"]["digest"] == m.digest
    assert first["hashed_bytes"] == m.total_bytes
    assert call("manifest", str(d), "--cache", cache)["hashed_bytes"] == 0
    # same size, same content length, new bytes: the stat signature changes, the file is hashed again
    shard = d / max(m.files, key=lambda f: f.size).path
    data = bytearray(shard.read_bytes())
    data[7] ^= 1
    shard.write_bytes(bytes(data))
    again = call("manifest", str(d), "--cache", cache)
    assert again["hashed_bytes"] == len(data) and again["manifest"]["digest"] != m.digest


@pytest.mark.parametrize("shards", [2, 400])
def test_a_two_hop_stream_is_written_verified_and_published(tmp_path, wait_for, shards):
    """400 shards: a header of ~90 kB (a model of many files). Each hop reads the header line and not one byte of
    the body after it, whatever the reads return (the bytes after the newline are the first file's)."""
    src = tmp_path / "src"
    m = manifest.seed_model(src, total_mb=2, shards=shards)
    nodes = {"127.0.0.2": tmp_path / "a", "127.0.0.3": tmp_path / "b"}
    port = free_port("127.0.0.2")
    procs = []
    hops = ["127.0.0.1", *nodes]
    for i, (addr, root) in enumerate(nodes.items()):
        down = f"{hops[i + 2]}:{port}" if i + 2 < len(hops) else ""
        procs.append(subprocess.Popen(RELAY + [
            "serve", "--status", str(root) + ".status", "--listen", addr, "--port", str(port),
            "--upstream", hops[i], "--staging", str(root / ".staging" / "m"), "--final", str(root / "m"),
            "--cache", str(root / "cache.json"), "--io-timeout", "10", "--accept-timeout", "20",
            "--expect", m.digest, "--downstream", down], stdout=subprocess.DEVNULL, stdin=subprocess.PIPE))
        procs[-1].stdin.write(b"t0k\n")
        procs[-1].stdin.close()
    # an intruder from another address is turned away, and the transfer still goes through
    wait_for(lambda: f"127.0.0.2:{port} " in subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout,
             10, f"the relay listening on 127.0.0.2:{port}")
    with socket.create_connection(("127.0.0.2", port), timeout=5, source_address=("127.0.0.9", 0)) as s:
        s.settimeout(5)
        try:
            s.sendall(b'{"token": "t0k"}\n')
            assert s.recv(1) == b""  # closed on us
        except ConnectionResetError:
            pass
    plan = tmp_path / "plan.json"
    files = [{"path": f.path, "size": f.size, "sha256": f.sha256, "offset": 0} for f in m.files]
    plan.write_text(json.dumps({"manifest": json.loads(m.to_json()), "files": files}))
    sent = call("send", "--status", str(tmp_path / "send.status"), "--plan", str(plan),
                "--dir", str(src), "--bind", "127.0.0.1", "--downstream", f"127.0.0.2:{port}", stdin=b"t0k\n")
    for p in procs:
        assert p.wait(timeout=30) == 0
    assert sent["error"] is None and sent["bytes_sent"] == m.total_bytes
    for root in nodes.values():
        st = json.loads(Path(str(root) + ".status").read_text())
        assert st["published"] and st["bytes_written"] == m.total_bytes and not st["files_bad"], st
        # the relay's own inspection of what it published, in its status: the controller's verification, through
        # the cache the stream filled (nothing read twice)
        assert st["inspect"]["published"] and st["inspect"]["bad"] == [] and st["inspect"]["hashed_bytes"] == 0, st
        assert manifest.verify(root / "m").digest == m.digest
        assert not (root / ".staging" / "m").exists()
    first = json.loads(Path(str(nodes["127.0.0.2"]) + ".status").read_text())
    assert first["refused"] == ["127.0.0.9: not the upstream peer 127.0.0.1"]
    # inspect sees the published copy through the cache, without reading it again
    ins = call("inspect", "--final", str(nodes["127.0.0.3"] / "m"), "--staging", str(tmp_path / "x"),
               "--cache", str(nodes["127.0.0.3"] / "cache.json"), stdin=m.to_json().encode())
    assert ins["published"] and ins["bad"] == [] and ins["hashed_bytes"] == 0


def test_inspect_reports_bad_files_and_links_the_good_ones_into_staging(tmp_path):
    final = tmp_path / "m"
    m = manifest.seed_model(final, total_mb=1, shards=2)
    bad = max(m.files, key=lambda f: f.size).path
    with open(final / bad, "r+b") as f:
        f.write(b"X")
    staging = tmp_path / ".staging" / "m"
    ins = call("inspect", "--final", str(final), "--staging", str(staging), "--cache", str(tmp_path / "c.json"),
               stdin=m.to_json().encode())
    assert not ins["published"] and ins["bad"] == [bad]
    assert ins["staged"] == {f.path: "ok" for f in m.files if f.path != bad}
    good = next(f.path for f in m.files if f.path != bad)
    assert os.path.samefile(staging / good, final / good)  # a hard link, no bytes copied


def test_manifest_of_a_missing_folder_says_so(tmp_path):
    assert call("manifest", str(tmp_path / "nope"))["error"] == "missing"


def test_the_ready_file_means_the_token_was_read_and_the_relay_listens(tmp_path, wait_for):
    """What a start's confirmation rests on (with --detach the relay's parent writes this file, naming the child,
    before its starter's command ends)."""
    port = free_port("127.0.0.2")

    def serve(tag: str) -> tuple[subprocess.Popen, Path, Path]:
        ready, status = tmp_path / f"{tag}.ready", tmp_path / f"{tag}.status"
        proc = subprocess.Popen(RELAY + [
            "serve", "--status", str(status), "--ready", str(ready), "--listen", "127.0.0.2", "--port", str(port),
            "--upstream", "127.0.0.1", "--staging", str(tmp_path / tag / ".staging"), "--final", str(tmp_path / tag),
            "--expect", "0" * 64, "--accept-timeout", "20"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE)
        return proc, ready, status

    # no token (its input ended first, as when sshd dropped it): no ready file, no status, and it says why
    proc, ready, status = serve("none")
    _, err = proc.communicate(b"", timeout=30)
    assert proc.returncode != 0 and b"no transfer token" in err
    assert not ready.exists() and not status.exists()

    # the token: the ready file appears, and by then the relay listens (a connection is accepted at once)
    proc, ready, status = serve("ok")
    try:
        assert not ready.exists()
        proc.stdin.write(b"t0k\n")
        proc.stdin.close()
        info = json.loads(wait_for(lambda: ready.exists() and ready.read_text(), 20, "the ready file"))
        assert info == {"pid": proc.pid, "listening": f"127.0.0.2:{port}"}
        with socket.create_connection(("127.0.0.2", port), timeout=5):
            pass

        # a second relay on the same address and port cannot listen: it exits with a status saying so, never ready
        other, ready2, status2 = serve("taken")
        other.communicate(b"t0k\n", timeout=30)
        assert not ready2.exists()
        assert f"cannot listen on 127.0.0.2:{port}" in json.loads(status2.read_text())["error"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_the_command_line_is_read_as_argparse_read_it_and_a_bad_one_names_what_is_wrong(capsys):
    """The relay reads its own command line (argparse's imports cost every relay start ~7 ms of CPU on every
    node): the same options, types and defaults, and exit 2 with the reason on stderr for a bad line."""
    a = relay.parse_args(["serve", "--status", "s", "--listen", "10.0.0.2", "--port=7000", "--upstream", "10.0.0.1",
                          "--staging", "st", "--final", "f", "--expect", "ab", "--downstream", "",
                          "--io-timeout", "2.5"])
    assert (a.cmd, a.port, a.listen, a.io_timeout, a.downstream) == ("serve", 7000, "10.0.0.2", 2.5, "")
    assert (a.accept_timeout, a.deadline_s, a.cache, a.ready, a.detach, a.start_timeout) == (30.0, 3600.0, None, "",
                                                                                              "", 15.0)
    m = relay.parse_args(["manifest", "/models/x", "--cache", "c.json"])
    assert (m.cmd, m.dir, m.cache) == ("manifest", "/models/x", "c.json")
    bad = {
        ("serve", "--status", "s"): "the following options are required: --listen, --port, --upstream",
        ("inspect", "--final", "f", "--staging", "s", "--bogus", "1"): "unrecognized option --bogus for inspect",
        ("send", "--status", "s", "--plan", "p", "--dir", "d", "--bind", "b", "--io-timeout", "soon"):
            "option --io-timeout: invalid float value 'soon'",
        ("serve", "--port"): "option --port expects a value",
        ("manifest",): "manifest takes 1 argument(s) (dir), got []",
        ("copy", "x"): "unknown command 'copy' (choose from manifest, inspect, serve, send)",
        (): "a command is required",
        ("send", "--status", "s", "--downstream", "--plan=p"): "option --downstream expects a value",
    }
    for argv, why in bad.items():
        with pytest.raises(SystemExit) as exc:
            relay.parse_args(list(argv))
        assert exc.value.code == 2, argv
        assert why in capsys.readouterr().err, argv


def _serve_argv(tmp_path: Path, port: int, *more: str) -> list[str]:
    return RELAY + ["serve", "--status", str(tmp_path / "status.json"), "--ready", str(tmp_path / "ready"),
                    "--listen", "127.0.0.2", "--port", str(port), "--upstream", "127.0.0.1",
                    "--staging", str(tmp_path / "m" / ".staging"), "--final", str(tmp_path / "m"),
                    "--expect", "0" * 64, "--accept-timeout", "30", *more]


def test_a_detached_relay_returns_once_it_listens_and_its_pid_file_names_it(tmp_path, wait_for):
    """How the controller starts a relay (relay_control._spawn): in the foreground of one command, which ends when
    the relay listens. What it leaves is what transport.spawn_script leaves: a pid file naming the serving process,
    its run and its exact command line, a process in a session of its own; stop_script stops it. The pid file names
    the relay from its start, before its token came (a controller whose start command failed still stops it)."""
    from deploybench.inventory import Node
    from deploybench.transport import LocalTransport, alive_script, stop_script

    port, pid_file = free_port("127.0.0.2"), str(tmp_path / "relay.pid")
    argv = _serve_argv(tmp_path, port, "--detach", pid_file)
    # its output a pipe (not a file, as the controller gives it): the command must still end once it listens
    fg = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, "DEPLOYBENCH_RUN": "dag/run-1"})
    try:
        first = wait_for(lambda: os.path.exists(pid_file) and Path(pid_file).read_text(), 20, "the first pid file")
        assert first.splitlines() == [str(fg.pid), "run=dag/run-1", f"argv={json.dumps(argv)}"]
        _, err = fg.communicate(b"t0k\n", timeout=30)
    finally:
        fg.kill()
    assert fg.returncode == 0, err
    lines = Path(pid_file).read_text().splitlines()
    pid = int(lines[0])
    assert pid != fg.pid and lines[1:] == ["run=dag/run-1", f"argv={json.dumps(argv)}"]
    assert json.loads((tmp_path / "ready").read_text()) == {"pid": pid, "listening": f"127.0.0.2:{port}"}
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    assert [c.decode() for c in cmdline] == argv and os.getsid(pid) == pid
    assert b"DEPLOYBENCH_RUN=dag/run-1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    with socket.create_connection(("127.0.0.2", port), timeout=5):  # it listens: the command ended after that
        pass
    t = LocalTransport(Node(name="n01", address="127.0.0.1", link_mbit=1000))
    assert t.run(alive_script(pid_file, argv), timeout=10).ok
    t.run(stop_script(pid_file, 2, argv), timeout=20).check()
    wait_for(lambda: not t.run(f"kill -0 {pid}", timeout=10).ok or
             Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 10, f"relay {pid} stopped")
    assert not os.path.exists(pid_file)


def test_a_relay_whose_parent_cannot_record_it_never_serves(tmp_path, wait_for):
    """The parent of a detached relay records the child (pid file, ready file) before the child may serve: when
    that fails (here the pid file's temporary name is taken by a folder), the command fails saying so, and the
    child, unrecorded, exits without ever accepting a stream: nothing is left that no pid file names."""
    port, pid_file = free_port("127.0.0.2"), tmp_path / "relay.pid"
    argv = _serve_argv(tmp_path, port, "--detach", str(pid_file))
    fg = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: pid_file.exists(), 20, "the first pid file")
        (tmp_path / "relay.pid.tmp").mkdir()
        _, err = fg.communicate(b"t0k\n", timeout=30)
    finally:
        fg.kill()
    assert fg.returncode == 1 and b"could not record the relay" in err, err
    assert not (tmp_path / "ready").exists()
    assert pid_file.read_text().splitlines()[0] == str(fg.pid)  # still the first one: the child was never named

    def listening() -> bool:
        out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, timeout=10)
        return "127.0.0.2" in out.stdout

    wait_for(lambda: not listening(), 10, f"nothing listening on 127.0.0.2:{port}")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()


def test_a_detached_relay_not_ready_within_its_start_timeout_exits_saying_so(tmp_path):
    """A token that never comes (its starter holds stdin open and writes nothing): the relay does not wait for
    good in its starter's command; it exits within --start-timeout with a status saying why, never ready, its pid
    file naming the process that exited (nothing to stop). With no token at all it exits at once, saying so."""
    port, pid_file = free_port("127.0.0.2"), tmp_path / "relay.pid"
    argv = _serve_argv(tmp_path, port, "--detach", str(pid_file), "--start-timeout", "0.5")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
        proc.stdin.close()
    assert proc.returncode == 3
    assert "not ready within --start-timeout 0.5 s" in json.loads((tmp_path / "status.json").read_text())["error"]
    assert not (tmp_path / "ready").exists() and pid_file.read_text().splitlines()[0] == str(proc.pid)
    gone = subprocess.run(argv, input=b"", capture_output=True, timeout=30)
    assert gone.returncode != 0 and b"no transfer token" in gone.stderr and not (tmp_path / "ready").exists()


def test_a_relay_is_woken_by_a_batch_of_its_stream_and_at_once_by_its_end():
    """The stream's socket wakes the relay once RCVLOWAT bytes wait (not for each segment a paced link brings),
    and its end wakes it at once with fewer: the last bytes of a stream are never held back. Fewer bytes that
    wait past --io-timeout are read, not taken for a stalled upstream (the mark may delay a read, never fail
    it), and the relay then reads every segment; with no byte at all the read times out, as without the mark."""
    buf, far = bytearray(relay.CHUNK), float("inf")
    with socket.create_server(("127.0.0.1", 0)) as srv:
        sender = socket.create_connection(srv.getsockname(), timeout=5)
        conn, _ = srv.accept()
    with conn, sender:
        relay._batch_reads(conn)
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == relay.RCVLOWAT
        conn.settimeout(0.3)  # as the relay reads it: with a timeout (--io-timeout)
        sender.sendall(b"a" * 1000)
        with pytest.raises(TimeoutError):  # 1000 bytes wait, fewer than RCVLOWAT: the kernel does not wake it
            conn.recv(1 << 20)
        sender.sendall(b"b" * relay.RCVLOWAT)
        got = bytes(relay._recv_some(conn, 1 << 20, buf, far))
        assert len(got) >= relay.RCVLOWAT and got.startswith(b"a" * 1000)
        rest = relay.RCVLOWAT + 1000 - len(got)
        sender.sendall(b"c" * 10)
        # 10 (+ rest) bytes wait past the io timeout: read all the same, and the mark is dropped
        assert bytes(relay._recv_some(conn, 1 << 20, buf, far)) == b"b" * rest + b"c" * 10
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1 and conn.gettimeout() == 0.3
        with pytest.raises(TimeoutError, match="no byte from upstream in 0.3 s"):
            relay._recv_some(conn, 1 << 20, buf, far)

    with socket.create_server(("127.0.0.1", 0)) as srv:
        sender = socket.create_connection(srv.getsockname(), timeout=5)
        conn, _ = srv.accept()
    with conn, sender:
        relay._batch_reads(conn)
        conn.settimeout(5)
        sender.sendall(b"d" * 10)
        sender.shutdown(socket.SHUT_WR)  # the end of the stream, 10 bytes left: woken at once, not after 5 s
        assert bytes(relay._recv_some(conn, 1 << 20, buf, far)) == b"d" * 10
        assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == relay.RCVLOWAT  # no timeout was needed
        with pytest.raises(OSError, match="upstream closed the stream early"):
            relay._recv_some(conn, 1 << 20, buf, far)


JSON_SAMPLES = [
    {"manifest": {"digest": "ab" * 32, "files": [{"path": "shard-00.bin", "size": 1 << 40, "sha256": "0" * 64}]}},
    {"z": 1, "a": [1.5, -0.0, 1e300, 2.5e-310, True, False, None], "m": {"é✓\u2028": "tab\tquote\"back\\slash\x01"}},
    ["\U0001F600 emoji", "", [], {}, [[[]]], -(10 ** 30), 0.1 + 0.2],
    {"started": 1733560000.123456, "error": None, "refused": ["127.0.0.9: wrong transfer token"], "pid": 4242},
]


@pytest.mark.parametrize("c_halves", [True, False], ids=["_json", "json"])
def test_the_relay_s_json_is_json_s_text_both_ways(monkeypatch, c_halves):
    """The relay writes and reads JSON without the json module (its start's imports: ``relay.dumps``,
    ``relay.loads``): the text is json.dumps' byte for byte (the manifest's digest hashes it), what it reads is
    what json.loads reads, and what json.loads refuses it refuses. Without the C halves, json itself."""
    if not c_halves:
        monkeypatch.setattr(relay, "_quote", None)
        monkeypatch.setattr(relay, "_make_scanner", None)
    for value in JSON_SAMPLES:
        for sort_keys in (False, True):
            for sep in ((",", ":"), (", ", ": ")):
                text = relay.dumps(value, sort_keys=sort_keys, separators=sep)
                assert text == json.dumps(value, sort_keys=sort_keys, separators=sep)
        for text in (json.dumps(value), json.dumps(value, indent=1, ensure_ascii=False), f" \n{json.dumps(value)}\t"):
            assert relay.loads(text) == json.loads(text) and relay.loads(text.encode()) == json.loads(text)
    assert str(relay.dumps(float("nan"))) == "NaN" and relay.dumps([float("-inf")]) == "[-Infinity]"
    for bad in ('{"a": 1} x', '{"a": 1,}', "", "[1, 2", '{"a": "\x01"}', b"\xff\xfe{}", "{'a': 1}"):
        with pytest.raises(ValueError):
            relay.loads(bad)
    with pytest.raises(TypeError):
        relay.dumps({"a": object()})


def test_a_serving_relay_starts_without_json_re_enum_or_socket(tmp_path):
    """What a relay's start imports, as the controller starts it (``-I -S``): the C halves of json, socket and
    signal, not their Python halves, whose re and enum were half of every relay's start (47 starts share the lab's
    two cores at 48 nodes). A serve that waits 1 s for a stream that never comes: listening, its start bound armed
    (--detach), its status written."""
    port = free_port("127.0.0.2")
    status = tmp_path / "status.json"
    proc = subprocess.run([sys.executable, "-I", "-S", "-X", "importtime", relay.__file__, "serve", "--status",
                           str(status), "--listen", "127.0.0.2", "--port", str(port), "--upstream", "127.0.0.1",
                           "--staging", str(tmp_path / "m" / ".staging"), "--final", str(tmp_path / "m"),
                           "--expect", "0" * 64, "--accept-timeout", "1", "--detach", str(tmp_path / "relay.pid"),
                           "--ready", str(tmp_path / "ready")], input=b"t0k\n", capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the detached child serves on: its end is its status, naming the upstream that sent nothing within 1 s (it
    # said "timed out", the accept's own error, until this test)
    end = time.monotonic() + 30
    while not status.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert "no stream from 127.0.0.1" in json.loads(status.read_text())["error"]
    imported = {line.split("|")[2].strip() for line in proc.stderr.decode().splitlines() if line.count("|") == 2}
    assert {"_json", "_socket", "hashlib"} <= imported, sorted(imported)  # (_signal: imported by every start)
    assert not imported & {"json", "re", "enum", "socket", "signal", "selectors", "typing"}, sorted(imported)
