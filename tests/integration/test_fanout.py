"""Fan-out on a real netns lab: sshd, shaped links, the relay on every node, the simulated engine.

One 6-node lab for the module (tests/support/fixtures.py's netns_lab: own name and DEPLOYBENCH_HOME). Each test
starts from targets whose model roots are wiped, except where it builds on the previous copy on purpose.
Every test is bounded in time (time_limit).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deploybench import fanout, manifest
from deploybench.config import FanoutSpec, Policy
from deploybench.errors import StageFailed
from deploybench.lab import cluster
from deploybench.lab.state import LabFiles
from deploybench.transport import Cluster, SSHTransport, spawn_script, stop_script

pytestmark = [pytest.mark.integration, pytest.mark.netns, pytest.mark.time_limit(120)]
MODEL = "sim-model"
NODES = 6


@pytest.fixture(scope="module")
def lab(netns_lab):
    return netns_lab("fo", nodes=NODES, link_mbit=200, model_mb=16)


def copy_of(files: LabFiles, node: str) -> Path:
    return files.models(node) / MODEL


def flip_byte(path: Path, at: int = 1000) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def shard(m: manifest.Manifest) -> str:
    return max(m.files, key=lambda f: f.size).path


def test_clean_chain_then_a_rerun_that_moves_no_bytes(lab):
    name, inv, files = lab
    lab.wipe(inv.names[1:])
    src = manifest.Manifest.read(copy_of(files, "n01"))
    with Cluster(inv) as c:
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        assert res.strategy == "chain" and res.manifest_digest == src.digest
        assert sorted(res.verified_nodes) == inv.names and res.rounds == 1
        for n in inv.names[1:]:
            cp = res.node(n)
            assert cp.status == "copied" and cp.bytes == src.total_bytes and cp.attempts == 1, cp
            assert manifest.verify(copy_of(files, n)).digest == src.digest
            assert not (files.models(n) / ".staging" / MODEL).exists()
        # one pipelined chain: each node received from the previous one
        assert [res.node(n).upstream for n in inv.names[1:]] == [[u] for u in inv.names[:-1]]
        # relays are stopped: nothing listens on the relay port any more
        for n in inv.names:
            ss = c[n].run(["ss", "-Htln", f"sport = :{FanoutSpec().port}"], timeout=10).check()
            assert ss.stdout.strip() == "", (n, ss.stdout)

        again = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
    assert again.bytes_moved == 0 and again.rounds == 0
    assert again.source_hashed_bytes == 0  # the source's unchanged files were not hashed again
    assert {cp.status for cp in again.nodes[1:]} == {"skipped"}
    assert sorted(again.verified_nodes) == inv.names


def test_an_empty_node_is_inspected_by_the_shell_as_the_relay_would_and_a_copy_by_the_relay(lab):
    """Relays.inspect answers for a node holding nothing of the model without starting Python (the first fan-out's
    common case); the answer is the relay's own for that node; anything there (a copy, a staged file, a link by
    the model's name) goes to the relay."""
    from deploybench.fanout.relay_control import Relays
    from deploybench.fanout.stage import _manifest

    name, inv, files = lab
    lab.wipe(inv.names[1:3])
    with Cluster(inv) as c:
        relays = Relays(c, MODEL, FanoutSpec())
        m = _manifest(relays.manifest("n01", relays.final("n01"))["manifest"])
        args = ["inspect", "--final", relays.final("n02"), "--staging", relays.staging("n02"), "--cache",
                relays.cache("n02")]
        # the shell also says whether the relay program is there: when it is not, the controller installs it at
        # once (in the inspection's thread), not when the round starts the relay
        prog = files.run("n02") / relays.program("n02").split("/run/", 1)[1]
        prog.unlink(missing_ok=True)
        shell = relays.call("n02", args, stdin=m.to_json().encode(), shortcut=relays._empty_node("n02"))
        assert shell.pop("program") is False and "n02" in relays._installed and prog.is_file()
        python = relays.call("n02", args, stdin=m.to_json().encode())
        again = relays.call("n02", args, stdin=m.to_json().encode(), shortcut=relays._empty_node("n02"))
        assert again.pop("program") is True and again.pop("free_bytes") and again.pop("shell")
        assert shell.pop("shell") is True and "shell" not in python
        assert abs(shell.pop("free_bytes") - python.pop("free_bytes")) < 64 << 20
        assert shell == python == {"published": False, "bad": [], "staged": {}, "hashed_bytes": 0}
        # a partly staged file, a link named like the model: the relay answers
        staged = files.models("n02") / ".staging" / MODEL / shard(m)
        staged.parent.mkdir(parents=True)
        staged.write_bytes(b"x" * 10)
        (files.models("n03") / MODEL).symlink_to("/etc")
        try:
            assert "shell" not in relays.call("n02", args, stdin=m.to_json().encode(),
                                               shortcut=relays._empty_node("n02"))
            st = relays.inspect("n02", m)
            assert st.staged == {shard(m): 10} and not st.published
            st3 = relays.inspect("n03", m)
            assert not st3.published
        finally:
            lab.wipe(inv.names[1:3])


def _no_relay_left(c: Cluster, inv, name: str) -> None:
    """Nothing listens on the relay port in any node's namespace, and no relay of this lab runs (the lab's nodes
    are this machine's processes; a relay's command line holds its program's path, under the lab's folder)."""
    for n in inv.names:
        ss = c[n].run(["ss", "-Htln", f"sport = :{FanoutSpec().port}"], timeout=10).check()
        assert ss.stdout.strip() == "", (n, ss.stdout)
    ours = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"deploybench relay" in cmd and f"/{name}/".encode() in cmd:
            ours.append(cmd[:200])
    assert ours == []


def test_a_first_chain_starts_each_relay_with_its_inspection(lab, monkeypatch):
    """Every target empty (a first fan-out): one SSH command a target inspects it and starts its relay for the
    chain; the round then starts only the feeder, and the relays' inspection after publishing needs no other."""
    from deploybench.fanout.relay_control import Relays

    name, inv, files = lab
    lab.wipe(inv.names[1:])
    spawned, inspected = [], []
    spawn, inspect = Relays._spawn, Relays.inspect
    monkeypatch.setattr(Relays, "_spawn", lambda self, node, *a: spawned.append(node) or spawn(self, node, *a))
    monkeypatch.setattr(Relays, "inspect", lambda self, node, m: inspected.append(node) or inspect(self, node, m))
    with Cluster(inv) as c:
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        assert sorted(res.verified_nodes) == inv.names and res.rounds == 1
        assert [res.node(n).upstream for n in inv.names[1:]] == [[u] for u in inv.names[:-1]]
        assert spawned == ["n01"] and inspected == []
        _no_relay_left(c, inv, name)


def test_relays_started_with_the_inspection_for_another_plan_are_stopped_and_the_chain_started_again(lab,
                                                                                                    monkeypatch):
    """One target holds the model already (it is skipped), so the chain the relays were started for is not the
    round's: they are stopped and the round starts its own; nothing is left running."""
    from deploybench.fanout.relay_control import Relays

    name, inv, files = lab
    stopped = []
    stop = Relays.stop
    monkeypatch.setattr(Relays, "stop", lambda self, pre: stopped.append(len(pre.started)) or stop(self, pre))
    with Cluster(inv) as c:
        if not copy_of(files, "n04").is_dir():
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        lab.wipe([n for n in inv.names[1:] if n != "n04"])
        stopped.clear()
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        assert stopped == [4]  # n02, n03, n05, n06 were started for n01->...->n06, then stopped
        assert sorted(res.verified_nodes) == inv.names and res.rounds == 1
        assert res.node("n04").status == "skipped"
        assert [res.node(n).upstream for n in ("n02", "n03", "n05", "n06")] == [["n01"], ["n02"], ["n03"], ["n05"]]
        for n in inv.names[1:]:
            assert not (files.models(n) / ".staging" / MODEL).exists(), n
        _no_relay_left(c, inv, name)


def test_a_failure_while_relays_start_with_the_inspection_stops_them_and_leaves_nothing(lab, monkeypatch):
    """One node's start fails with an error that is not deploybench's own (paramiko raises its own types): the
    node is named as not inspected (policy abort: the stage fails before a byte is sent), and the relays started
    on the others are stopped, their staging folders removed."""
    from deploybench.fanout.relay_control import Relays

    name, inv, files = lab
    lab.wipe(inv.names[1:])
    test = Relays._empty_test

    def broken(self, node):
        if node == "n04":
            raise RuntimeError("the channel broke")
        return test(self, node)

    monkeypatch.setattr(Relays, "_empty_test", broken)
    with Cluster(inv) as c:
        with pytest.raises(StageFailed, match=r"(?s)could not be inspected.*n04.*the channel broke"):
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        _no_relay_left(c, inv, name)
    for n in inv.names[1:]:
        assert not (files.models(n) / ".staging").exists(), n


def test_a_flipped_byte_is_detected_and_repaired_from_a_neighbour(lab):
    name, inv, files = lab
    src = manifest.Manifest.read(copy_of(files, "n01"))
    with Cluster(inv) as c:
        if not all(copy_of(files, n).is_dir() for n in inv.names):
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        victim = shard(src)
        flip_byte(copy_of(files, "n04") / victim)
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
    cp = res.node("n04")
    assert cp.status == "repaired" and cp.verified
    assert cp.repairs == [{"file": victim, "from": "n03", "reason": "published copy failed its sha256 check"}]
    assert cp.bytes == next(f.size for f in src.files if f.path == victim)  # only the bad file moved
    assert res.bytes_moved == cp.bytes
    manifest.verify(copy_of(files, "n04"))


def test_an_engine_refuses_a_tampered_copy(lab):
    name, inv, files = lab
    with Cluster(inv) as c:
        if not copy_of(files, "n05").is_dir():
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        m = manifest.Manifest.read(copy_of(files, "n05"))
        victim = shard(m)
        flip_byte(copy_of(files, "n05") / victim, at=5)
        r = c["n05"].run([inv.python, "-m", "deploybench.sim.engine", "--model-dir", f"{inv.model_root}/{MODEL}",
                          "--host", inv.node("n05").address, "--port", "0"], timeout=60)
        assert r.rc == 2, (r.rc, r.stderr[-500:])
        assert victim in r.stderr
        # an intact copy starts: the same check passes on n06 (exits only when killed, so just verify)
        manifest.verify(copy_of(files, "n06"))
        fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())  # and the fan-out repairs it
    manifest.verify(copy_of(files, "n05"))


def test_a_node_killed_mid_chain_is_routed_around_and_the_rest_finish(lab):
    name, inv, files = lab
    lab.wipe(inv.names[1:])
    for n in inv.names:
        cluster.set_link(name, n, mbit=40)  # 16 MiB take ~3.5 s per hop: time to kill n03 half-way
    try:
        staged = files.models("n06") / ".staging" / MODEL

        def kill_when_half_way():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done = sum(p.stat().st_size for p in staged.glob("*") if p.is_file()) if staged.is_dir() else 0
                if done > 4 << 20:
                    cluster.kill_node(name, "n03")
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_when_half_way)
        killer.start()
        with Cluster(inv) as c:
            res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(io_timeout_s=5), policy=Policy.EXCLUDE)
        killer.join()
    finally:
        for n in inv.names:
            cluster.set_link(name, n)
        cluster.start_node(name, "n03")
    assert sorted(res.verified_nodes) == ["n01", "n02", "n04", "n05", "n06"]
    dead = res.node("n03")
    assert dead.status == "failed" and not dead.verified and "n03" in (dead.error or "")
    # the second attempt went from n02, the verified node before the gap, and resumed
    assert res.node("n04").upstream == ["n03", "n02"]
    assert res.node("n04").resumed_bytes > 0
    for n in ("n04", "n05", "n06"):
        manifest.verify(copy_of(files, n))
    with Cluster(inv) as c, pytest.raises(StageFailed, match="n03"):
        lab.wipe(["n03"])
        cluster.kill_node(name, "n03")
        try:
            fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(io_timeout_s=5))  # policy abort
        finally:
            cluster.start_node(name, "n03")


def test_a_relay_whose_token_reaches_its_node_late_still_starts(lab, monkeypatch):
    """sshd drops input that arrives after its command ended. The command that starts a relay used to end a few
    milliseconds after forking it, so a token sent a little late (a busy controller: 1 fresh-lab fan-out in 6 in
    the suite) left the relay with none; it exited without a status and the round waited for its timeout. Every
    input to n04 is held back here for longer than that command used to live (in the controller: this kernel has
    no netem to delay n04's link instead): the relay must still start."""
    name, inv, files = lab
    lab.wipe(inv.names[1:])
    src = manifest.Manifest.read(copy_of(files, "n01"))
    send_input = SSHTransport._send_input

    def late(self, chan, command, data, *args, **kwargs):
        if self.node.name == "n04":
            time.sleep(0.5)
        return send_input(self, chan, command, data, *args, **kwargs)

    monkeypatch.setattr(SSHTransport, "_send_input", late)
    with Cluster(inv) as c:
        res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(timeout_s=60))
    assert res.rounds == 1 and sorted(res.verified_nodes) == inv.names
    assert [res.node(n).upstream for n in inv.names[1:]] == [[u] for u in inv.names[:-1]]
    assert all(res.node(n).bytes == src.total_bytes for n in inv.names[1:])


def test_a_relay_that_cannot_start_is_named_at_once_and_the_chain_goes_around_it(lab, wait_for):
    """Another process holds the relay's port on n04: its relay cannot listen. The controller knows it when it
    starts the round (not after the round's timeout), feeds nothing through n04, says which node and why, and
    the next round feeds n04 alone so that n05 and n06 are not held up behind it."""
    name, inv, files = lab
    lab.wipe(inv.names[1:])
    src = manifest.Manifest.read(copy_of(files, "n01"))
    port, addr = FanoutSpec().port, inv.node("n04").data_address
    squatter = [inv.python, "-c", "import socket, time; s = socket.socket(); "
                f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(({addr!r}, {port})); s.listen(); "
                "time.sleep(300)"]
    with Cluster(inv) as c:
        pid = f"{c.run_dir('n04')}/squatter.pid"
        c["n04"].run(spawn_script(squatter, f"{c.run_dir('n04')}/squatter.log", pid), timeout=30).check()
        try:
            wait_for(lambda: c["n04"].run(["ss", "-Htln", f"sport = :{port}"], timeout=10).stdout.strip(), 20,
                     f"a squatter listening on n04:{port}")
            res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(), policy=Policy.EXCLUDE)
        finally:
            c["n04"].run(stop_script(pid, 1, squatter), timeout=30).check()
    assert sorted(res.verified_nodes) == ["n01", "n02", "n03", "n05", "n06"]
    stuck = res.node("n04")
    assert stuck.status == "failed" and stuck.attempts == 1 + FanoutSpec().retries, stuck
    assert "the relay did not start" in stuck.error and f"cannot listen on {addr}:{port}" in stuck.error, stuck
    # round 1 fed nobody (n04 could not listen) and spent nobody else's attempt; round 2 fed n04 alone from the
    # source and the chain n01->n02->n03->n05->n06 around it; round 3 fed n04 alone from n03
    assert res.rounds == 3
    assert stuck.upstream == ["n03", "n01", "n03"]
    assert [res.node(n).upstream for n in ("n02", "n03", "n05", "n06")] == [["n01"], ["n02"], ["n03"], ["n05"]]
    assert all(res.node(n).bytes == src.total_bytes for n in ("n02", "n03", "n05", "n06"))


def test_tree_and_star_verify_every_node(lab):
    name, inv, files = lab
    src = manifest.Manifest.read(copy_of(files, "n01"))
    with Cluster(inv) as c:
        for strategy in ("tree", "star"):
            lab.wipe(inv.names[1:])
            res = fanout.run(c, inv.names, "n01", MODEL, FanoutSpec(strategy=strategy))
            assert sorted(res.verified_nodes) == inv.names, strategy
            assert all(manifest.verify(copy_of(files, n)).digest == src.digest for n in inv.names[1:])
            if strategy == "tree":  # doubling: 1, 2, then the last 2 of 5 targets
                assert res.rounds == 3
                assert res.node("n02").upstream == ["n01"] and res.node("n03").upstream == ["n01"]
                assert res.node("n04").upstream == ["n02"]


def test_bad_input_is_refused_before_anything_is_copied(lab):
    name, inv, files = lab
    lab.wipe(inv.names[1:])
    with Cluster(inv) as c:
        with pytest.raises(StageFailed, match=r"no-such-model.*does not exist on source node n01"):
            fanout.run(c, inv.names, "n01", "no-such-model", FanoutSpec())
        (files.models("n01") / "empty-model").mkdir()
        with pytest.raises(StageFailed, match=r"empty-model.*is empty"):
            fanout.run(c, inv.names, "n01", "empty-model", FanoutSpec())
        src = copy_of(files, "n01")
        m = manifest.Manifest.read(src)
        victim = shard(m)
        backup = (src / victim).read_bytes()
        flip_byte(src / victim)
        try:
            with pytest.raises(StageFailed, match=rf"does not match its manifest.*{victim}.*sha256"):
                fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        finally:
            (src / victim).write_bytes(backup)
        # a node whose model root has too little space: a 1 MiB tmpfs over n04's model root
        root = inv.model_root
        c["n04"].run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", root], timeout=10).check()
        try:
            with pytest.raises(StageFailed, match=r"n04: 0\.00 GiB free under .*needs 0\.02 GiB"):
                fanout.run(c, inv.names, "n01", MODEL, FanoutSpec())
        finally:
            c["n04"].run(["umount", root], timeout=10).check()
        # nothing reached any target
        for n in inv.names[1:]:
            assert not copy_of(files, n).exists() and not (files.models(n) / ".staging" / MODEL).exists()
