"""The commands and files a netns lab is made of (built, never run, here)."""

import shlex

import pytest

from deploybench.lab import commands


def test_rate_is_whole_kbit():
    assert commands.rate_arg(1000) == "1000000kbit"
    assert commands.rate_arg(0.5) == "500kbit"
    with pytest.raises(ValueError):
        commands.rate_arg(0)


def test_shaping_on_the_host_end():
    cmds = commands.shape_commands("dbvabc12301", 200)
    assert cmds[0] == ["tc", "qdisc", "add", "dev", "dbvabc12301", "root", "handle", "1:", "htb", "default", "10"]
    assert cmds[1][:10] == ["tc", "class", "replace", "dev", "dbvabc12301", "parent", "1:", "classid", "1:10", "htb"]
    assert cmds[1][cmds[1].index("rate") + 1] == "200000kbit" == cmds[1][cmds[1].index("ceil") + 1]
    # a restored link has no netem left; its queue holds 5 ms of the rate (125 kB at 200 Mbit/s), at least 128 KiB
    assert cmds[2][-3:] == ["bfifo", "limit", str(2 * 65536)]
    assert commands.shape_commands("dbvabc12301", 1000)[2][-3:] == ["bfifo", "limit", "625000"]


def test_shaping_inside_a_namespace_with_delay_and_loss():
    cmds = commands.shape_commands("eth0", 50, ns="db-demo-n02", delay_ms=20, loss_pct=1.5)
    assert all(c[:3] == ["tc", "-n", "db-demo-n02"] for c in cmds)
    assert [c[3:5] for c in cmds] == [["qdisc", "add"], ["class", "replace"], ["qdisc", "replace"]]
    assert cmds[2][-5:] == ["netem", "delay", "20ms", "loss", "1.5%"]
    assert commands.delete_root("eth0", "db-demo-n02") == ["tc", "-n", "db-demo-n02", "qdisc", "del", "dev", "eth0",
                                                          "root"]  # shaping again starts from no tree


def test_link_commands_put_the_node_end_in_its_namespace():
    cmds = commands.link_commands("db-demo-n01", "dbbabc123", "dbvabc12301", "eth0", "10.1.2.11", 24)
    assert cmds[0] == ["ip", "netns", "add", "db-demo-n01"]
    assert cmds[1] == ["ip", "link", "add", "dbvabc12301", "type", "veth", "peer", "name", "eth0",
                       "netns", "db-demo-n01"]
    assert ["ip", "-n", "db-demo-n01", "addr", "add", "10.1.2.11/24", "dev", "eth0"] in cmds
    assert ["ip", "-n", "db-demo-n01", "link", "set", "lo", "up"] in cmds


def test_sshd_config_is_key_only_on_the_node_address():
    text = commands.sshd_config(address="10.1.2.11", host_key="/lab/keys/host_n01",
                                authorized_keys="/lab/authorized_keys", pid_file="/lab/nodes/n01/sshd.pid",
                                env={"DEPLOYBENCH_NODE": "n01"})
    lines = text.splitlines()
    for expected in ["ListenAddress 10.1.2.11", "HostKey /lab/keys/host_n01", "AuthorizedKeysFile /lab/authorized_keys",
                     "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
                     "PermitRootLogin prohibit-password", "UsePAM no", "StrictModes no",
                     "PidFile /lab/nodes/n01/sshd.pid"]:
        assert expected in lines
    setenv = [line for line in lines if line.startswith("SetEnv")]
    assert len(setenv) == 1  # sshd honours the first SetEnv line only
    assert f"PATH={commands.SYSTEM_PATH}" in setenv[0] and "DEPLOYBENCH_NODE=n01" in setenv[0]


def test_sshd_config_refuses_values_it_cannot_express():
    with pytest.raises(ValueError, match="HOME"):
        commands.sshd_config(address="a", host_key="k", authorized_keys="a", pid_file="p", env={"HOME": "/a b"})


def test_sshd_start_binds_the_node_folders_then_execs_sshd():
    argv = commands.sshd_start_argv("db-demo-n02", {"/lab/nodes/n02/models": "/srv/deploybench/demo/models",
                                                   "/tmp/it's": "/srv/x"}, "/lab/nodes/n02/sshd_config")
    assert argv[:9] == ["ip", "netns", "exec", "db-demo-n02", "unshare", "--mount", "--propagation", "private", "sh"]
    script = argv[-1]
    words = shlex.split(script)
    assert words[:4] == ["mount", "--bind", "/lab/nodes/n02/models", "/srv/deploybench/demo/models"]
    assert "/tmp/it's" in words  # quoted, not split
    assert words[-6:] == ["exec", commands.SSHD, "-D", "-e", "-f", "/lab/nodes/n02/sshd_config"]


def test_known_hosts_line():
    pub = "ssh-ed25519 AAAAC3Nza demo-n01\n"
    assert commands.known_hosts_line("10.1.2.11", pub) == "10.1.2.11 ssh-ed25519 AAAAC3Nza"
    assert commands.known_hosts_line("10.1.2.11", pub, port=2222) == "[10.1.2.11]:2222 ssh-ed25519 AAAAC3Nza"


def test_the_labs_prometheus_scrapes_every_nodes_exporter_and_engine_labelled_with_the_node():
    import json

    conf = json.loads(commands.prometheus_config({"n01": "10.1.2.11", "n02": "10.1.2.12"}))
    assert conf["global"]["scrape_interval"] == "1s" == conf["global"]["scrape_timeout"]
    jobs = {j["job_name"]: j["static_configs"] for j in conf["scrape_configs"]}
    assert jobs["node"] == [{"targets": ["10.1.2.11:9100"], "labels": {"node": "n01"}},
                            {"targets": ["10.1.2.12:9100"], "labels": {"node": "n02"}}]
    assert [c["targets"] for c in jobs["engine"]] == [["10.1.2.11:8000"], ["10.1.2.12:8000"]]


def test_exporters_and_prometheus_listen_on_lab_addresses_only():
    argv = commands.node_exporter_argv("/usr/bin/prometheus-node-exporter", "db-x-n01", "10.1.2.11", "/lab/n01/tf")
    assert argv[:5] == ["ip", "netns", "exec", "db-x-n01", "/usr/bin/prometheus-node-exporter"]
    assert "--web.listen-address=10.1.2.11:9100" in argv and "--collector.disable-defaults" in argv
    assert "--collector.textfile.directory=/lab/n01/tf" in argv
    p = commands.prometheus_argv("prometheus", "/lab/prometheus/p.yml", "/lab/prometheus/data", "10.1.2.1")
    assert "--web.listen-address=10.1.2.1:9090" in p and "--web.enable-remote-write-receiver" in p
    assert "--storage.tsdb.path=/lab/prometheus/data" in p
