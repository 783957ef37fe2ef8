"""Hostile nodes (issue 15), attacked on a real 3-node netns lab (sshd, the relay, the run folder).

- 1: a relay on n02 receives crafted headers (paths out of staging, files not in the manifest, another
  manifest, a wrong token) from its upstream address and writes nothing; a symlink planted in its
  staging folder is not written through; its token is on no command line and in no file name;
  a model folder with a symlink in it (to a "key") is refused before a byte is sent;
- 2: a run root someone else created (0777, another owner, a planted relay program) is refused and the
  planted program never runs; an altered relay program is replaced, not run; an engine pid file holding
  1 or another process's pid is left alone, with a warning;
- 6: a stalled SSH channel delivers all of its input or fails, never a truncated input with exit 0;
- 8: publishing ``sim-model`` leaves a model named ``sim-model.old`` intact (chain and star).

Every test is bounded in time (time_limit); the lab is brought down at the end (netns_lab).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deploybench import fanout, manifest
from deploybench.config import FanoutSpec, FanoutStrategy, RunConfig
from deploybench.errors import StageFailed, TransportError
from deploybench.fanout.relay_control import Relays, relay_digest
from deploybench.rollout.ssh import SSHDeployer
from deploybench.transport import Cluster, UnsafeFolder, spawn_script, stop_script

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.time_limit(90)]
MODEL = "sim-model"
PORT = 7479


@pytest.fixture(scope="module")
def lab(netns_lab):
    return netns_lab("lh", nodes=3, link_mbit=400, model_mb=2)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- 1: the relay --------------------------------------------------------------------------------------
def start_relay(c: Cluster, relays: Relays, node: str, upstream: str, expect: str, token: str, tag: str) -> dict:
    inv = c.inventory
    wd = relays.workdir(node)
    argv = [inv.python, relays.program(node), "serve", "--listen", inv.node(node).address, "--port", str(PORT),
            "--upstream", upstream, "--staging", relays.staging(node), "--final", relays.final(node),
            "--cache", relays.cache(node), "--expect", expect, "--status", f"{wd}/{tag}.status.json",
            "--io-timeout", "5", "--accept-timeout", "20", "--deadline-s", "40", "--ready", f"{wd}/{tag}.ready"]
    relays.install(node)
    # the command holds the relay's stdin until the relay has read its token and listens (sshd drops input
    # that arrives after its command ended; fanout.relay_control waits the same way)
    ready = f"{wd}/{tag}.ready"
    wait = f"i=0; while [ ! -e {ready} ] && [ $i -lt 150 ]; do sleep 0.1; i=$((i+1)); done; [ -e {ready} ]"
    c[node].run(spawn_script(argv, f"{wd}/{tag}.log", f"{wd}/{tag}.pid", stdin=True) + "; " + wait,
                stdin=f"{token}\n".encode(), timeout=30).check()
    return {"argv": argv, "pid": f"{wd}/{tag}.pid", "status": f"{wd}/{tag}.status.json"}


def connect_from(address: str, source: str) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection((address, PORT), timeout=5, source_address=(source, 0))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def send(address: str, source: str, header: dict, body: bytes = b"") -> None:
    with connect_from(address, source) as s:
        try:
            s.sendall(json.dumps(header).encode() + b"\n" + body)
            s.shutdown(socket.SHUT_WR)
            s.recv(1)
        except OSError:
            pass  # the relay hung up on us


def wait_status(c: Cluster, node: str, path: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = c[node].run(["cat", path], timeout=10)
        if res.ok and res.stdout.strip():
            return json.loads(res.stdout)
        time.sleep(0.2)
    raise AssertionError(f"no status at {path}")


def test_a_relay_refuses_crafted_headers_and_writes_nothing_outside_staging(lab, tmp_path):
    name, inv, files = lab
    lab.wipe(["n02"])
    src = files.models("n01") / MODEL
    m = manifest.Manifest.read(src)
    doc = json.loads(m.to_json())
    token = secrets.token_hex(16)
    marker = f"/tmp/{name}-pwned"
    payload = b"pwned\n"
    with Cluster(inv) as c:
        relays = Relays(c, MODEL, FanoutSpec())
        up = inv.controller_address
        r = start_relay(c, relays, "n02", up, m.digest, token, "attack")
        addr = inv.node("n02").address
        evil = {"path": f"../../../../../../..{marker}", "size": len(payload), "sha256": sha(payload), "offset": 0}
        absolute = {**evil, "path": marker}
        shard = max(m.files, key=lambda f: f.size)
        attempts = [
            {"token": token, "manifest": doc, "files": [evil]},                             # not in the manifest
            {"token": token, "manifest": {"files": [evil]}, "files": [evil]},               # a manifest of its own
            {"token": token, "manifest": {"files": [absolute]}, "files": [absolute]},       # an absolute path
            {"token": token, "manifest": doc,                                               # more bytes than listed
             "files": [{"path": shard.path, "size": shard.size * 1000, "sha256": shard.sha256, "offset": 0}]},
            {"token": "wrong", "manifest": doc, "files": [evil]},
        ]
        for header in attempts:
            send(addr, up, header, payload)
        # the token is on no command line, in no file name
        pid = int(c["n02"].run(["head", "-n", "1", r["pid"]], timeout=10).check().stdout)
        cmdline = c["n02"].run(["cat", f"/proc/{pid}/cmdline"], timeout=10).check().stdout
        assert "serve" in cmdline and token not in cmdline
        assert token not in c["n02"].run(["ls", "-R", relays.workdir("n02")], timeout=10).check().stdout
        # the real stream still goes through after the attempts
        header = {"token": token, "manifest": doc,
                  "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "offset": 0} for f in m.files]}
        send(addr, up, header, b"".join((src / f.path).read_bytes() for f in m.files))
        st = wait_status(c, "n02", r["status"])
        c["n02"].run(stop_script(r["pid"], 1, r["argv"]), timeout=15)
    assert not os.path.exists(marker) and not (files.models("n02") / ".." / "pwned").exists()
    refused = " | ".join(st["refused"])
    assert len(st["refused"]) == len(attempts), refused
    assert "is not in the manifest" in refused and "'..'" in refused and "an absolute path" in refused
    assert "differs from the manifest" in refused and "wrong transfer token" in refused
    assert st["published"] and manifest.verify(files.models("n02") / MODEL).digest == m.digest


def test_a_symlink_planted_in_staging_is_not_written_through(lab):
    name, inv, files = lab
    lab.wipe(["n02"])
    src = files.models("n01") / MODEL
    m = manifest.Manifest.read(src)
    victim = Path(f"/tmp/{name}-victim")
    victim.write_text("intact\n")
    target = min(m.files, key=lambda f: f.size)
    staging = files.models("n02") / ".staging" / MODEL
    staging.mkdir(parents=True)
    (staging / target.path).symlink_to(victim)
    token = secrets.token_hex(16)
    try:
        with Cluster(inv) as c:
            relays = Relays(c, MODEL, FanoutSpec())
            r = start_relay(c, relays, "n02", inv.controller_address, m.digest, token, "link")
            header = {"token": token, "manifest": json.loads(m.to_json()),
                      "files": [{"path": target.path, "size": target.size, "sha256": target.sha256, "offset": 0}]}
            send(inv.node("n02").address, inv.controller_address, header, (src / target.path).read_bytes())
            st = wait_status(c, "n02", r["status"])
            c["n02"].run(stop_script(r["pid"], 1, r["argv"]), timeout=15)
        assert victim.read_text() == "intact\n"
        assert not st["published"] and "symbolic link" in (st["upstream_error"] or "") + (st["error"] or ""), st
    finally:
        victim.unlink()


def test_a_symlink_in_the_model_folder_is_refused_before_anything_is_sent(lab, tmp_path):
    name, inv, files = lab
    lab.wipe(["n02", "n03"])
    key = tmp_path / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY----- not really\n")
    src = files.models("n01") / MODEL
    (src / "tokenizer_extra.json").symlink_to(key)
    (src / "more").symlink_to(tmp_path)
    # no manifest in the folder: the stage declares the folder as it finds it (a first copy of a new model)
    declared = (src / manifest.MANIFEST_NAME).read_bytes()
    (src / manifest.MANIFEST_NAME).unlink()
    try:
        with Cluster(inv) as c, pytest.raises(StageFailed) as exc:
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
    finally:
        (src / "tokenizer_extra.json").unlink()
        (src / "more").unlink()
        (src / manifest.MANIFEST_NAME).write_bytes(declared)
    msg = str(exc.value)
    assert "tokenizer_extra.json ->" in msg and "more ->" in msg and "symbolic link" in msg
    for n in ("n02", "n03"):
        assert not (files.models(n) / MODEL).exists()
        assert not list(files.models(n).rglob("tokenizer_extra.json"))


# -- 2: the run folder, the program, pid files -------------------------------------------------------
def test_a_run_root_created_by_someone_else_is_refused_and_its_planted_program_never_runs(lab):
    name, inv, files = lab
    lab.wipe(["n02", "n03"])
    run2 = files.run("n02")  # what n02 sees as its run_root
    marker = Path(f"/tmp/{name}-planted-ran")
    saved = run2.stat()
    with Cluster(inv) as c:
        program = Relays(c, MODEL, FanoutSpec()).program("n01").rsplit("/", 1)[-1]
    fan = run2 / "n02" / "fanout"
    fan.mkdir(parents=True, exist_ok=True)
    (fan / program).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    os.chown(run2, 65534, 65534)
    os.chmod(run2, 0o777)
    try:
        with Cluster(inv) as c, pytest.raises(StageFailed) as exc:
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        assert not marker.exists()
        msg = str(exc.value)
        assert "n02" in msg and "run_root" in msg and "owned by uid 65534" in msg
        with Cluster(inv) as c, pytest.raises(UnsafeFolder):
            c.run_dir("n02")
    finally:
        os.chown(run2, saved.st_uid, saved.st_gid)
        os.chmod(run2, 0o700)
        shutil.rmtree(fan)
        marker.unlink(missing_ok=True)


def test_an_altered_relay_program_is_replaced_not_run(lab):
    name, inv, files = lab
    marker = Path(f"/tmp/{name}-altered-ran")
    with Cluster(inv) as c:
        relays = Relays(c, MODEL, FanoutSpec())
        relays.install("n02")
        prog = files.run("n02") / relays.program("n02").split("/run/", 1)[1]
        assert prog.is_file()
        # a copy cut short (a stalled transfer) with something else appended
        prog.write_bytes(prog.read_bytes()[:4000] + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode())
    with Cluster(inv) as c:  # a later task: it does not know the program was installed before
        out = Relays(c, MODEL, FanoutSpec()).call("n02", ["manifest", f"{inv.model_root}/{MODEL}"])
    assert ("manifest" in out or out.get("error") == "missing") and not marker.exists()  # the genuine program ran
    assert sha(prog.read_bytes()) == relay_digest()


def test_a_relay_program_altered_after_the_inspection_is_replaced_and_the_relay_started(lab):
    """An empty node's inspection runs no program (the shell answers, saying the program's file is there); a file
    altered there is found by the launcher as the relay starts: the program is installed again, the relay started,
    and the altered program never runs. Its compiled code is kept beside it for the next start."""
    name, inv, files = lab
    marker = Path(f"/tmp/{name}-altered-at-start-ran")
    lab.wipe(["n02", "n03"])
    with Cluster(inv) as c:
        relays = Relays(c, MODEL, FanoutSpec())
        relays.install("n03")
        prog = files.run("n03") / relays.program("n03").split("/run/", 1)[1]
        assert prog.with_suffix(".code").is_file()  # compiled at install
        prog.write_bytes(prog.read_bytes()[:4000] + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode())
    with Cluster(inv) as c:
        res = fanout.run(c, ["n01", "n02", "n03"], "n01", MODEL, FanoutSpec())
    assert all(n.verified for n in res.nodes) and not marker.exists()
    assert sha(prog.read_bytes()) == relay_digest()


def test_an_engine_pid_file_holding_pid_1_or_another_process_is_left_alone(lab, caplog):
    name, inv, files = lab
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    pid_file = files.run("n02") / "n02" / "engine.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    cfg = RunConfig.parse({"inventory": "x", "rollout": {"port": 8479, "stop_grace_s": 0.5}})
    try:
        for planted in ("1", str(other.pid)):
            pid_file.write_text(f"{planted}\nargv=[\"sleep\", \"300\"]\n")
            with Cluster(inv) as c, caplog.at_level(logging.WARNING, logger="deploybench.transport"):
                dep = SSHDeployer(c, cfg)
                assert dep.teardown(["n02"]) == {"n02": "stopped"}
            assert other.poll() is None, f"planted pid {planted}: the other process was killed"
            assert pid_file.exists()
            assert any("left alone" in r.getMessage() and planted in r.getMessage() for r in caplog.records)
            caplog.clear()
    finally:
        other.kill()
        other.wait()
        pid_file.unlink(missing_ok=True)


# -- 6: SSH input --------------------------------------------------------------------------------------
def test_a_stalled_channel_delivers_all_its_input_or_fails(lab):
    name, inv, files = lab
    data = secrets.token_bytes(1 << 20) * 8
    with Cluster(inv) as c:
        # the command reads nothing for 2.5 s: the channel's window fills and sending stalls
        res = c["n02"].run("sleep 2.5; sha256sum", stdin=data, timeout=60)
        assert res.ok and res.stdout.split()[0] == sha(data), res
        # a command that never reads and outlives its time is an error naming the bytes sent, not exit 0
        with pytest.raises(TransportError, match=r"took only \d+ of 8388608 input bytes"):
            c["n02"].run("sleep 30", stdin=data, timeout=3)
        # a command that exits without reading is not an error: its status says what happened
        assert c["n02"].run("exit 4", stdin=data, timeout=20).rc == 4


def test_a_node_that_prints_without_end_is_cut_off_at_the_output_bound(lab, wait_for):
    """Issue 30, hole 7: what a node prints (nvidia-smi's CSV, a relay's answer) is read up to a bound, never
    whole into the controller's memory: a command that writes without end fails naming the bound."""
    from deploybench.transport import MAX_OUTPUT

    name, inv, files = lab
    with Cluster(inv) as c:
        with pytest.raises(TransportError, match=rf"wrote more than {MAX_OUTPUT >> 20} MiB to stdout"):
            c["n02"].run("yes deploybench", timeout=60)
        assert c["n02"].run("echo still answering", timeout=10).stdout.strip() == "still answering"
        wait_for(lambda: c["n02"].run(["pgrep", "-x", "yes"], timeout=10).rc == 1, 10, "the cut-off command gone")


# -- 8: publish ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", [FanoutStrategy.CHAIN, FanoutStrategy.STAR])
def test_publishing_a_model_leaves_a_model_named_like_its_old_copy_alone(lab, strategy):
    name, inv, files = lab
    lab.wipe(["n02", "n03"])
    old = {n: manifest.seed_model(files.models(n) / f"{MODEL}.old", total_mb=0.25, shards=1, seed=7)
           for n in ("n02", "n03")}
    with Cluster(inv) as c:
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(strategy=strategy))
        assert sorted(res.verified_nodes) == inv.names
        # a second publish over an existing copy (a flipped byte forces the rename of the old copy)
        shard = max(manifest.Manifest.read(files.models("n02") / MODEL).files, key=lambda f: f.size)
        with open(files.models("n02") / MODEL / shard.path, "r+b") as f:
            f.write(b"\0")
        fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(strategy=strategy))
    for n in ("n02", "n03"):
        assert manifest.verify(files.models(n) / f"{MODEL}.old").digest == old[n].digest
        assert manifest.verify(files.models(n) / MODEL).digest == res.manifest_digest
        assert not [p for p in files.models(n).iterdir() if p.name.startswith(f".{MODEL}")]
