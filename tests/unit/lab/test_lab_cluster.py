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
    # no --link-mbit: lab up measures what the host carries (lab.capacity)
    assert (defaults.name, defaults.nodes, defaults.link_mbit, defaults.mode) == ("demo", 16, None, "auto")
    assert parser.parse_args(["lab", "down", "--purge"]).purge
    assert callable(parser.parse_args(["lab", "status"]).func)


@pytest.mark.parametrize("missing", [("prometheus",), ("prometheus-node-exporter", "node_exporter"),
                                     ("prometheus", "prometheus-node-exporter", "node_exporter")])
def test_without_the_prometheus_packages_the_lab_says_it_runs_without_prometheus(monkeypatch, tmp_path, caplog,
                                                                                 missing):
    import shutil

    from deploybench.lab.naming import NetnsNames
    from deploybench.lab.state import LabFiles, LabState

    monkeypatch.setenv("DEPLOYBENCH_HOME", str(tmp_path))
    real = shutil.which
    monkeypatch.setattr(cluster.shutil, "which", lambda b, *a, **k: None if b in missing else real(b) or f"/bin/{b}")
    started = []
    monkeypatch.setattr(cluster.netns, "start_detached", lambda *a, **k: started.append(a))
    state = LabState(name="t1", mode=Mode.NETNS, subnet="10.200.1.0/24", node_count=2, link_mbit=100,
                     model_name="m", model_mb=1)
    with caplog.at_level("WARNING"):
        assert cluster._start_telemetry(NetnsNames.of("t1"), LabFiles("t1"), state) is None
    assert not started
    assert "lab t1 runs without Prometheus" in caplog.text and missing[0] in caplog.text
    assert "apt-get install prometheus prometheus-node-exporter" in caplog.text
