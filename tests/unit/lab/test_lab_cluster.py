"""Mode choice and argument checks of the lab, without building one."""

import pytest

from deploybench.errors import LabError
from deploybench.lab import cluster
from deploybench.lab.state import Mode


@pytest.mark.parametrize("root, asked, got", [(True, "auto", Mode.NETNS), (False, "auto", Mode.LOOPBACK),
                                               (True, "loopback", Mode.LOOPBACK), (False, "loopback", Mode.LOOPBACK),
                                               (True, Mode.NETNS, Mode.NETNS)])
def test_mode(monkeypatch, root, asked, got):
    monkeypatch.setattr(cluster, "is_root", lambda: root)
    assert cluster.resolve_mode(asked) is got


def test_netns_without_root_names_the_way_out(monkeypatch):
    monkeypatch.setattr(cluster, "is_root", lambda: False)
    with pytest.raises(LabError, match="--mode loopback"):
        cluster.resolve_mode("netns")
    with pytest.raises(LabError, match="'vm'"):
        cluster.resolve_mode("vm")


@pytest.mark.parametrize("kwargs, match", [({"nodes": 0}, "--nodes 0"), ({"link_mbit": 0}, "--link-mbit 0"),
                                           ({"name": "No"}, "'No'")])
def test_up_checks_arguments_before_touching_anything(tmp_path, monkeypatch, kwargs, match):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    with pytest.raises(LabError, match=match):
        cluster.up(**{"name": "demo", **kwargs})
    assert not (tmp_path / "lab").exists()


def test_faults_need_a_netns_lab(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    with pytest.raises(LabError, match="lab up --name gone"):
        cluster.set_link("gone", "n01", mbit=10)
    with pytest.raises(LabError, match="lab up --name gone"):
        cluster.kill_node("gone", "n01")


def test_cli_registers_up_down_status():
    from deploybench.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["lab", "up", "--name", "t4a", "--nodes", "3", "--link-mbit", "200", "--mode", "loopback"])
    assert (args.name, args.nodes, args.link_mbit, args.mode, args.model_mb) == ("t4a", 3, 200.0, "loopback", 64.0)
    assert callable(args.func)
    defaults = parser.parse_args(["lab", "up"])
    assert (defaults.name, defaults.nodes, defaults.link_mbit, defaults.mode) == ("demo", 16, 500.0, "auto")
    assert parser.parse_args(["lab", "down", "--purge"]).purge
    assert callable(parser.parse_args(["lab", "status"]).func)
