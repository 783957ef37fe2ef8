"""The commands and files a netns lab is made of, as pure functions.

Everything here only builds argument lists and file contents; nothing runs. That keeps
the shape of a lab (links, shaping, sshd settings) testable without root, and keeps
every external command an argument list.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

SSHD = "/usr/sbin/sshd"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# One HTB class per link: its quantum only matters between classes, but the default
# (rate / r2q) overflows at Gbit rates and makes tc warn.
HTB_QUANTUM = 60000
# The plain leaf's queue, in bytes: LEAF_QUEUE_MS of the link's rate, at least LEAF_QUEUE_MIN (two 64 KiB GSO
# segments). It was a pfifo of 1000 packets, and a veth's packets are GSO segments of up to 64 KiB: tens of MB,
# a quarter of a second at 120 Mbit/s. A 1-second iperf3 (preflight's iperf_seconds=1) then read 79-90 % of a
# 120 Mbit/s link and 52-88 % of a 50 Mbit/s one on an idle 8-node lab; with this queue 93-94 % and 89-93 %
# (500 Mbit/s: 94 % either way). Slower links are what a large lab gets on a small host (lab.capacity).
LEAF_QUEUE_MS = 5.0
LEAF_QUEUE_MIN = 2 * 65536


def _tc(ns: str | None) -> list[str]:
    return ["tc", "-n", ns] if ns else ["tc"]


def _ip(ns: str | None) -> list[str]:
    return ["ip", "-n", ns] if ns else ["ip"]


def rate_arg(mbit: float) -> str:
    """tc rate for ``mbit`` Mbit/s, in whole kbit so fractional speeds survive."""
    if mbit <= 0:
        raise ValueError(f"link speed {mbit} Mbit/s must be positive")
    return f"{round(mbit * 1000)}kbit"


def shape_commands(
    dev: str,
    mbit: float,
    *,
    ns: str | None = None,
    delay_ms: float | None = None,
    loss_pct: float | None = None,
) -> list[list[str]]:
    """Egress shaping of ``dev`` (whose root qdisc was deleted first: ``delete_root``): an HTB root, a class at
    ``mbit``, and a netem leaf for delay/loss. Without delay or loss the leaf is a plain FIFO (``leaf_queue``), so
    a degraded link can be restored.
    """
    tc = _tc(ns)
    rate = rate_arg(mbit)
    cmds = [tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"]]
    cmds.append(tc + ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                      "rate", rate, "ceil", rate, "quantum", str(HTB_QUANTUM)])
    leaf = tc + ["qdisc", "replace", "dev", dev, "parent", "1:10", "handle", "10:"]
    if delay_ms or loss_pct:
        netem = ["netem"]
        if delay_ms:
            netem += ["delay", f"{delay_ms:g}ms"]
        if loss_pct:
            netem += ["loss", f"{loss_pct:g}%"]
        cmds.append(leaf + netem)
    else:
        cmds.append(leaf + leaf_queue(mbit))
    return cmds


def leaf_queue(mbit: float) -> list[str]:
    """The plain leaf of a link shaped to ``mbit``: a byte-limited FIFO of LEAF_QUEUE_MS at that rate."""
    return ["bfifo", "limit", str(max(LEAF_QUEUE_MIN, round(mbit * 1e6 / 8 * LEAF_QUEUE_MS / 1000)))]


# Per-flow caps (a fast link emulated: one TCP stream cannot fill it, several can): TCP flows to or from the
# iperf3 ports (5200-5215: preflight's servers take 5201 upward) go to one of FLOW_BUCKETS HTB classes by bits
# 1-5 of their other port (Linux hands out connect()'s ephemeral ports in steps of 2, so bit 0 rarely varies);
# each class is capped at the per-flow rate, all of them together at the link's. This kernel has neither fq
# (its flow_max_rate) nor netem, so HTB with u32 filters stands in.
IPERF_PORTS = (0x1450, 0xFFF0)  # 5200-5215
FLOW_BUCKETS = 32  # flows of a test that land in one bucket share its cap, as flows hashed onto one path do
FLOW_BITS = 0x3E


def shape_batch(dev: str, mbit: float, flow_cap_mbit: float | None = None, icmp_kbit: float | None = None) -> str:
    """``tc -batch`` text for an HTB tree on ``dev`` (after ``delete_root``): the link at ``mbit``;
    TCP flows of the iperf3 ports capped at ``flow_cap_mbit`` each (one class per bucket); ICMP shaped to
    ``icmp_kbit`` (a slow path for pings: each waits for the ones before it, so RTT and its spread grow, the
    delay a shaped or policed path adds, without netem). Everything else: class 1:10 at the link's rate."""
    link, q = rate_arg(mbit), str(HTB_QUANTUM)
    lines = [f"qdisc add dev {dev} root handle 1: htb default 10",
             f"class add dev {dev} parent 1: classid 1:1 htb rate {link} ceil {link} quantum {q}",
             f"class add dev {dev} parent 1:1 classid 1:10 htb rate {link} ceil {link} quantum {q}",
             f"qdisc add dev {dev} parent 1:10 handle 10: pfifo limit 1000"]
    if flow_cap_mbit:
        cap = rate_arg(min(flow_cap_mbit, mbit))
        share = rate_arg(max(0.001, mbit / (FLOW_BUCKETS + 1)))
        base, mask = IPERF_PORTS
        for b in range(FLOW_BUCKETS):
            cid = f"{0x100 + b:x}"
            lines += [f"class add dev {dev} parent 1:1 classid 1:{cid} htb rate {share} ceil {cap} quantum {q}",
                      f"qdisc add dev {dev} parent 1:{cid} handle {cid}: pfifo limit 1000"]
            bits = f"0x{b << 1:x}"
            tcp = "match ip protocol 6 0xff"
            lines += [f"filter add dev {dev} parent 1: protocol ip prio 1 u32 {tcp} match ip dport {base:#x} {mask:#x} "
                      f"match ip sport {bits} {FLOW_BITS:#x} flowid 1:{cid}",
                      f"filter add dev {dev} parent 1: protocol ip prio 1 u32 {tcp} match ip sport {base:#x} {mask:#x} "
                      f"match ip dport {bits} {FLOW_BITS:#x} flowid 1:{cid}"]
    if icmp_kbit:
        rate = f"{max(1, round(icmp_kbit))}kbit"
        lines += [f"class add dev {dev} parent 1:1 classid 1:20 htb rate {rate} ceil {rate} "
                  "burst 100b cburst 100b quantum 1514",
                  f"qdisc add dev {dev} parent 1:20 handle 20: pfifo limit 1000",
                  f"filter add dev {dev} parent 1: protocol ip prio 2 u32 match ip protocol 1 0xff flowid 1:20"]
    return "\n".join(lines) + "\n"


def delete_root(dev: str, ns: str | None = None) -> list[str]:
    """Delete ``dev``'s root qdisc and the tree under it (fails, harmlessly, on a link that has none)."""
    return _tc(ns) + ["qdisc", "del", "dev", dev, "root"]


def batch_argv(ns: str | None) -> list[str]:
    """``tc -batch -`` (commands on stdin), in namespace ``ns``."""
    return _tc(ns) + ["-batch", "-"]


def link_commands(ns: str, bridge: str, host_veth: str, node_if: str, address: str, prefix: int) -> list[list[str]]:
    """Create node namespace ``ns`` and wire it to ``bridge`` with its own address."""
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_veth, "type", "veth", "peer", "name", node_if, "netns", ns],
        ["ip", "link", "set", host_veth, "master", bridge, "up"],
        _ip(ns) + ["addr", "add", f"{address}/{prefix}", "dev", node_if],
        _ip(ns) + ["link", "set", node_if, "up"],
        _ip(ns) + ["link", "set", "lo", "up"],
    ]


def bridge_commands(bridge: str, host_address: str, prefix: int) -> list[list[str]]:
    return [
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "addr", "add", f"{host_address}/{prefix}", "dev", bridge],
        ["ip", "link", "set", bridge, "up"],
    ]


def sshd_config(
    *,
    address: str,
    host_key: str,
    authorized_keys: str,
    pid_file: str,
    env: Mapping[str, str] | None = None,
    port: int = 22,
) -> str:
    """sshd_config of one lab node: its own address and host key, the lab's user key only.

    ``SetEnv`` gives commands run over SSH the system PATH (iperf3, rsync, sha256sum)
    whatever the controller's environment was.
    """
    lines = [
        f"ListenAddress {address}",
        f"Port {port}",
        f"HostKey {host_key}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "UsePAM no",
        "StrictModes no",
        f"PidFile {pid_file}",
        "PrintMotd no",
        "UseDNS no",
        # fan-out, preflight and the engines open many sessions at once
        "MaxSessions 64",
        "MaxStartups 64:30:128",
        "Subsystem sftp internal-sftp",
    ]
    env = {"PATH": SYSTEM_PATH, **(env or {})}
    for key, value in env.items():
        if any(c in value for c in ' "\n'):
            raise ValueError(f"SetEnv value for {key} must not contain spaces, quotes or newlines: {value!r}")
    # sshd keeps the first SetEnv line only: all variables go on one.
    lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines) + "\n"


def sshd_start_argv(ns: str, binds: Mapping[str, str], config: str) -> list[str]:
    """Start sshd inside ``ns`` in a private mount namespace where each ``source -> target`` is bind-mounted.

    Everything started through that sshd inherits both namespaces: the node's address
    and the node's own model root at the path every node shares.
    """
    mounts = " && ".join(f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}" for src, dst in binds.items())
    script = (
        f"{mounts} && exec {SSHD} -D -e -f {shlex.quote(config)}"
        if mounts
        else f"exec {SSHD} -D -e -f {shlex.quote(config)}"
    )
    return ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def known_hosts_line(address: str, public_key: str, port: int = 22) -> str:
    """A known_hosts entry for ``address`` from an OpenSSH public key line ("ssh-ed25519 AAAA... comment")."""
    key_type, blob = public_key.split()[:2]
    host = address if port == 22 else f"[{address}]:{port}"
    return f"{host} {key_type} {blob}"


# -- the lab's telemetry: a node exporter per node, one Prometheus on the controller ------------------------------
NODE_EXPORTER_PORT = 9100  # the node exporter's registered default port
PROMETHEUS_PORT = 9090
# The engine's port the lab's Prometheus scrapes on every node: the rollout's default port (config.RolloutSpec.port);
# a run on another port is not scraped by the lab's Prometheus (its own scrape of the engines goes on).
ENGINE_PORT = 8000
SCRAPE_INTERVAL_S = 1
# Debian's package names the node exporter's binary prometheus-node-exporter; upstream's is node_exporter
NODE_EXPORTER_BINARIES = ("prometheus-node-exporter", "node_exporter")
# The collectors a lab node needs (CPU, memory, network, load) and the textfile collector (a node's own .prom
# files); the rest are off, so 16 exporters stay light on a 2-core machine.
NODE_COLLECTORS = ("cpu", "meminfo", "netdev", "loadavg", "textfile")


def node_exporter_argv(binary: str, ns: str, address: str, textfile_dir: str,
                       port: int = NODE_EXPORTER_PORT) -> list[str]:
    """A node exporter inside node namespace ``ns``, on the node's lab address only (its /proc/net/dev is the
    namespace's: the node's own link)."""
    return ["ip", "netns", "exec", ns, binary, f"--web.listen-address={address}:{port}",
            "--collector.disable-defaults", *(f"--collector.{c}" for c in NODE_COLLECTORS),
            f"--collector.textfile.directory={textfile_dir}"]


def prometheus_config(nodes: Mapping[str, str], interval_s: float = SCRAPE_INTERVAL_S,
                      engine_port: int = ENGINE_PORT, exporter_port: int = NODE_EXPORTER_PORT) -> str:
    """prometheus.yml of a lab: every node's exporter (job ``node``) and engine page (job ``engine``), each target
    labelled with its inventory node (``node``). JSON is YAML, and needs no YAML writer."""
    import json

    def job(name: str, port: int) -> dict[str, object]:
        return {"job_name": name, "static_configs": [
            {"targets": [f"{address}:{port}"], "labels": {"node": node}} for node, address in nodes.items()]}

    interval = f"{interval_s:g}s"
    return json.dumps({"global": {"scrape_interval": interval, "scrape_timeout": interval,
                                  "evaluation_interval": interval},
                       "scrape_configs": [job("node", exporter_port), job("engine", engine_port)]}, indent=1) + "\n"


def prometheus_argv(binary: str, config: str, data_dir: str, address: str, port: int = PROMETHEUS_PORT) -> list[str]:
    """The lab's Prometheus: on the controller's lab address only, its data under the lab's folder, kept a day at
    most, with the remote-write receiver on (k6's ``experimental-prometheus-rw`` output writes there)."""
    return [binary, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
            f"--web.listen-address={address}:{port}",
            "--storage.tsdb.retention.time=1d", "--web.enable-remote-write-receiver", "--log.level=warn"]
