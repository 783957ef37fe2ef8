"""The inventory a lab hands to the pipeline, for both modes (no lab is built here)."""

import sys

import pytest

from deploybench.errors import LabError
from deploybench.inventory import Inventory, TransportKind
from deploybench.lab.state import LabFiles, LabState, Mode, build_inventory, other_lab_subnets


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    return tmp_path


def state(mode, name="demo", nodes=3):
    return LabState(name=name, mode=mode, subnet="10.120.7.0/24" if mode is Mode.NETNS else "127.9.8.0/24",
                    node_count=nodes, link_mbit=500, model_name="sim-model", model_mb=8)


def test_netns_inventory_shares_paths_and_verifies_host_keys(home):
    files = LabFiles("demo")
    inv = build_inventory(state(Mode.NETNS), files)
    assert inv.transport is TransportKind.SSH
    assert inv.names == ["n01", "n02", "n03"]
    assert [n.address for n in inv.nodes] == ["10.120.7.11", "10.120.7.12", "10.120.7.13"]
    assert inv.controller_address == "10.120.7.1"
    assert inv.model_root == "/srv/deploybench/demo/models" == inv.model_root_of("n03")
    assert inv.run_root == "/srv/deploybench/demo/run"  # bind-mounted per node, like the model root
    assert inv.ssh.known_hosts == str(home / "lab" / "demo" / "known_hosts")
    assert inv.ssh.key_file == str(home / "lab" / "demo" / "keys" / "id_ed25519")
    assert inv.python == sys.executable
    assert inv.lab == {"name": "demo", "mode": "netns", "subnet": "10.120.7.0/24", "dir": str(files.root)}
    # round trip through the file the CLI writes
    assert Inventory.load(inv.save(files.inventory)) == inv


def test_loopback_inventory_gives_every_node_its_own_folders(home):
    inv = build_inventory(state(Mode.LOOPBACK), LabFiles("demo"))
    assert inv.transport is TransportKind.LOCAL
    assert [n.address for n in inv.nodes] == ["127.9.8.11", "127.9.8.12", "127.9.8.13"]
    roots = {inv.model_root_of(n) for n in inv.names}
    assert len(roots) == 3
    assert inv.run_root == str(home / "lab" / "demo" / "run")  # the pipeline adds /<node>
    assert inv.model_root_of("n02") == str(home / "lab" / "demo" / "nodes" / "n02" / "models")


def test_unknown_node_names_the_range():
    with pytest.raises(LabError, match="n01..n03"):
        state(Mode.NETNS).index("n04")


def test_state_round_trip_and_remove_keeps_keys(home):
    files = LabFiles("demo")
    files.write_state(state(Mode.NETNS))
    files.keys.mkdir()
    (files.keys / "id_ed25519").write_text("key")
    files.models("n01").mkdir(parents=True)
    assert files.read_state() == state(Mode.NETNS)
    files.remove(keep_keys=True)
    assert [p.name for p in files.root.iterdir()] == ["keys"]
    files.remove(keep_keys=False)
    assert not files.root.exists()
    files.remove()  # twice is fine


def test_other_labs_subnets_are_avoided(home):
    LabFiles("a").write_state(state(Mode.NETNS, name="a"))
    LabFiles("b").write_state(state(Mode.LOOPBACK, name="b"))
    assert sorted(map(str, other_lab_subnets("a"))) == ["127.9.8.0/24"]
