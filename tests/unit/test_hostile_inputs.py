"""Hostile inputs (issue 15), without a cluster: an inventory whose values look like options, a run pointed
at a file outside the inventory folders, a huge load rate, a target URL that is not the run's, a pid file
that names pid 1 or someone else's process, a relay stream header that names paths outside its folder.

The lab-side attacks (a relay on a node, a planted run folder, a stalled SSH channel, a symlink in the
model folder, publishing next to ``x.old``) are in tests/integration/test_hostile_lab.py; a killed task
with k6 running and the embedded PostgreSQL in tests/integration/test_hostile_local.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploybench import params, paths
from deploybench.config import LoadSpec, RunConfig
from deploybench.errors import ConfigError
from deploybench.fanout import relay
from deploybench.fanout.star import rsync_argv
from deploybench.inventory import Inventory
from deploybench.load.phases import TARGETS_ENV, targets
from deploybench.load.results import Endpoint
from deploybench.manifest import FileEntry
from deploybench.transport import LEFT_ALONE, Cluster, spawn_script, stop_script

SECRET = "hunter2-do-not-print"


def write_inventory(path: Path, **node: str) -> Path:
    data = {"name": "evil", "transport": "ssh",
            "ssh": {"user": "root", "known_hosts": "/etc/ssh/ssh_known_hosts", "password": SECRET},
            "nodes": [{"name": "n01", "address": "10.0.0.1", "link_mbit": 100, **node}]}
    path.write_text(json.dumps(data))
    return path


# -- 3: inventory values ---------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("address", "-oProxyCommand=touch /tmp/pwned"),
    ("backend_address", "-oProxyCommand=sh"),
    ("address", "n01;reboot"),
    ("k8s_node", "--all"),
])
def test_an_option_shaped_address_is_refused_and_no_secret_is_echoed(tmp_path, field, value):
    inv = write_inventory(tmp_path / "evil.json", **{field: value})
    with pytest.raises(ConfigError) as exc:
        Inventory.load(inv)
    msg = str(exc.value)
    assert f"nodes.0.{field}" in msg and "not a host name" in msg
    assert "ssh.password" in msg  # the unknown key is named ...
    assert SECRET not in msg  # ... its value never


@pytest.mark.parametrize("patch", [
    {"ssh": {"user": "-oProxyCommand=touch /tmp/pwned", "known_hosts": "/k"}},
    {"ssh": {"user": "root", "known_hosts": "-oUserKnownHostsFile=/dev/null"}},
    {"run_root": "-rf"}, {"run_root": "relative/run"}, {"model_root": "/srv/../etc"},
    {"python": "-c"}, {"controller_address": "-x"},
])
def test_option_shaped_users_paths_and_commands_are_refused(patch):
    base = {"name": "i", "ssh": {"known_hosts": "/k"}, "nodes": [{"name": "n01", "address": "n01", "link_mbit": 1}]}
    with pytest.raises(Exception) as exc:
        Inventory.model_validate({**base, **patch})
    assert "validation error" in str(exc.value)


def test_a_plain_inventory_is_accepted_and_rsync_ends_its_options_before_operands(tmp_path):
    inv = Inventory.model_validate({"name": "i", "ssh": {"user": "deploy", "known_hosts": "/k"}, "nodes": [
        {"name": "n01", "address": "gpu-01.example.org", "link_mbit": 1},
        {"name": "n02", "address": "fd00::2", "backend_address": "10.1.0.2", "link_mbit": 1}]})
    argv = rsync_argv(Cluster(inv), "/m/x", inv.node("n02"), "/m/.staging/x")
    assert argv[argv.index("--") + 1:] == ["/m/x/", "deploy@10.1.0.2:/m/.staging/x/"]


# -- 3: the inventory field of a run ---------------------------------------------------------------
def test_the_inventory_field_takes_names_and_paths_inside_the_folders_only(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_INVENTORIES", str(tmp_path / "inventories"))
    (tmp_path / "inventories").mkdir()
    write_inventory(tmp_path / "inventories" / "prod.json")
    for bad in ("/etc/passwd", str(tmp_path / "elsewhere.json"), str(tmp_path / "inventories" / ".." / "x.json"),
                "../prod", "prod\n", "-x"):
        with pytest.raises(ConfigError) as exc:
            params.to_config({"inventory": bad})
        assert "inventory" in str(exc.value), bad
    assert "outside the inventory folders" in str(pytest.raises(ConfigError, params.to_config,
                                                                 {"inventory": "/etc/shadow"}).value)
    assert params.to_config({"inventory": "prod"}).inventory == "prod"
    inside = str(tmp_path / "inventories" / "prod.json")
    assert params.to_config({"inventory": inside}).inventory == inside
    # the run loads a name from the folder, and its error names fields, not the secret
    with pytest.raises(ConfigError) as exc:
        Inventory.load("prod")
    assert "ssh.password" in str(exc.value) and SECRET not in str(exc.value)


def test_the_default_is_the_demo_labs_name_and_lab_paths_still_work(monkeypatch):
    monkeypatch.delenv("DEPLOYBENCH_INVENTORIES", raising=False)
    assert params.defaults()["inventory"] == "demo"
    lab_path = str(paths.lab_dir("lh-some-lab") / "inventory.json")
    assert RunConfig.parse({"inventory": lab_path}).inventory == lab_path
    with pytest.raises(ConfigError, match="does not exist"):
        Inventory.load("lh-no-such-lab")


# -- 4: load limits --------------------------------------------------------------------------------
def test_a_huge_load_rate_is_refused_before_k6_is_sized():
    with pytest.raises(ConfigError) as exc:
        params.to_config({"load_rate": 100000})
    assert "load_rate=100000" in str(exc.value) and "k6_max_vus" in str(exc.value)


def test_target_url_must_be_the_runs_own_endpoint_or_allowed(monkeypatch):
    eps = [Endpoint("n01", "http://10.0.0.1:8000", "m"), Endpoint("n02", "http://10.0.0.2:8000", "m")]
    monkeypatch.delenv(TARGETS_ENV, raising=False)
    for url in ("http://169.254.169.254/latest/meta-data", "http://10.0.0.1:22/", "https://victim.example/"):
        with pytest.raises(ConfigError) as exc:
            targets(eps, LoadSpec(target_url=url))
        assert TARGETS_ENV in str(exc.value) and url[:30] in str(exc.value)
    load, scrape = targets(eps, LoadSpec(target_url="http://10.0.0.2:8000/v1"))
    assert [e.url for e in load] == ["http://10.0.0.2:8000/v1"] and scrape == eps
    monkeypatch.setenv(TARGETS_ENV, "http://lb.internal:8080, https://svc.example")
    assert targets(eps, LoadSpec(target_url="http://LB.internal:8080/"))[0][0].url == "http://LB.internal:8080/"
    assert targets(eps, LoadSpec(target_url="https://svc.example/x"))[0][0].node == "lb"
    with pytest.raises(ConfigError):
        targets(eps, LoadSpec(target_url="http://lb.internal:8081/"))


# -- 2: pid files ----------------------------------------------------------------------------------
def test_stop_leaves_pid_1_and_someone_elses_process_alone(tmp_path, wait_for):
    """The attack: write 1 (kill -TERM -1 would signal every process) or another process's pid into the pid
    file of what a run started. Both are left alone, with a warning line; the real one is stopped."""
    argv = ["sleep", "301"]
    other = subprocess.Popen(["sleep", "302"], start_new_session=True)
    try:
        for i, planted in enumerate(["1", str(other.pid), "-1", "$(reboot)"]):
            pid_file = tmp_path / f"p{i}.pid"
            pid_file.write_text(planted + "\n")
            res = subprocess.run(["sh", "-c", stop_script(str(pid_file), 0.2, argv)], capture_output=True, text=True,
                                 timeout=20)
            assert res.returncode == 0 and res.stderr.startswith(LEFT_ALONE), (planted, res.stderr)
            assert pid_file.exists()
        assert other.poll() is None  # still running
        script = spawn_script(argv, str(tmp_path / "ours.log"), str(tmp_path / "ours.pid"))
        ours = int(subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10).stdout.split()[-1])
        res = subprocess.run(["sh", "-c", stop_script(str(tmp_path / "ours.pid"), 1, argv)], capture_output=True,
                             text=True, timeout=20)
        assert res.stderr == "" and not (tmp_path / "ours.pid").exists()
        wait_for(lambda: not Path(f"/proc/{ours}").exists() or "Z" in Path(f"/proc/{ours}/stat").read_text().split()[2],
                 5, f"our process {ours} stopped")
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait()


# -- 1: the relay's header check, on loopback ------------------------------------------------------
def _entry(path: str, data: bytes) -> dict:
    return {"path": path, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("path", ["../escape", "/etc/cron.d/x", "a/../../b", "a//b", "./a", "a\nb", "", "a\\..\\b",
                                  relay.MANIFEST_NAME])
def test_unsafe_paths_never_make_a_manifest(path):
    assert relay.path_problem(path)
    with pytest.raises(ConfigError.__mro__[1]):  # DeploybenchError (ManifestMismatch)
        FileEntry(path, 1, "0" * 64)


def test_a_header_naming_files_outside_the_manifest_is_refused():
    good = [_entry("config.json", b"{}"), _entry("w/shard.bin", b"x" * 10)]
    digest = relay.manifest_doc(good)["digest"]
    header = {"manifest": relay.manifest_doc(good), "files": [{**good[1], "offset": 0}]}
    assert relay.header_problem(header, digest, 1 << 30) is None
    bad_files = [
        [{**_entry("../../root/.ssh/authorized_keys", b"k"), "offset": 0}],
        [{**good[1], "size": 1 << 40, "offset": 0}],
        [{**good[1], "offset": -5}], [{**good[1], "offset": 11}],
        [{**good[1], "offset": 0}, {**good[1], "offset": 0}],
    ]
    for files in bad_files:
        assert relay.header_problem({**header, "files": files}, digest, 1 << 30), files
    evil = [*good, _entry("../x", b"1")]
    assert "'..'" in relay.header_problem({"manifest": {"files": evil}, "files": []}, digest, 1 << 30)
    other = [_entry("config.json", b"{ }")]
    assert "not the expected" in relay.header_problem({"manifest": relay.manifest_doc(other), "files": []},
                                                      digest, 1 << 30)
    assert "free" in relay.header_problem(header, digest, 5)


def test_open_under_follows_no_symbolic_link(tmp_path):
    (tmp_path / "staging").mkdir()
    outside = tmp_path / "victim"
    outside.write_text("intact")
    (tmp_path / "staging" / "f").symlink_to(outside)
    (tmp_path / "staging" / "d").symlink_to(tmp_path)
    for rel in ("f", "d/victim"):
        with pytest.raises(OSError):
            relay.open_under(str(tmp_path / "staging"), rel, write=True)
    assert outside.read_text() == "intact"
    fd = relay.open_under(str(tmp_path / "staging"), "new/dir/file", write=True)
    os.close(fd)
    assert (tmp_path / "staging" / "new" / "dir" / "file").is_file()


def test_the_relay_takes_its_token_from_stdin_not_its_command_line(tmp_path):
    res = subprocess.run([sys.executable, relay.__file__, "send", "--status", str(tmp_path / "s"), "--plan", "x",
                          "--dir", "x", "--bind", "127.0.0.1"], input=b"", capture_output=True, timeout=30)
    assert res.returncode != 0 and b"no transfer token on stdin" in res.stderr
    res = subprocess.run([sys.executable, relay.__file__, "send", "--token", "t"], capture_output=True, timeout=30)
    assert res.returncode == 2  # there is no --token option any more
