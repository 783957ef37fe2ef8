"""Node checks: one shell script per node reports facts; pure functions judge them.

Everything a node reports comes back as ``key=value`` lines from a single SSH command,
so checking 16 nodes in parallel costs one round trip each. The judging is pure (facts
in, CheckItems out), so every verdict is unit-tested without a cluster.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import shlex
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from deploybench.config import PreflightSpec
from deploybench.errors import DeploybenchError
from deploybench.inventory import Node
from deploybench.preflight.links import sweep_script
from deploybench.preflight.model import CheckItem, NodeCheck, Status, node_errors
from deploybench.transport import Cluster

log = logging.getLogger(__name__)

GiB = 2**30
# Binaries every node needs: iperf3 for preflight, rsync and sha256sum for fan-out.
NODE_BINARIES = ("iperf3", "rsync", "sha256sum")
# The fan-out source runs rsync over ssh to every node.
SOURCE_BINARIES = ("ssh",)
GPU_QUERY = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits"]
CLOCK_PROBES = 3


@dataclass(frozen=True)
class Wanted:
    """What the later stages of this run need from every node."""

    model_root: str
    model_name: str | None = None
    engine_port: int | None = None
    binaries: tuple[str, ...] = NODE_BINARIES
    source: str | None = None
    required_bytes: int = 0  # the model's size when known in advance; 0 = measured at the source
    nic_address: str | None = None  # the address preflight's link tests use: its interface's speed, MTU, driver


def facts_script(w: Wanted, node: Node, preflight_dir: str, binaries: tuple[str, ...]) -> str:
    """The one command a node runs: stale iperf3 servers stopped, then facts as key=value lines."""
    root = shlex.quote(w.model_root)
    model = shlex.quote(f"{w.model_root}/{w.model_name}") if w.model_name else None
    lines = [
        sweep_script(preflight_dir),
        f"mkdir -p {root} 2>/dev/null",
        "echo kernel=$(uname -r)",
        "echo cpus=$(nproc)",
        "echo cpu_model=$(awk -F': *' '/^model name/{print $2; exit}' /proc/cpuinfo)",
        "echo mem_kib=$(awk '/^MemTotal:/{print $2}' /proc/meminfo)",
        f"echo free_bytes=$(df -PB1 {root} 2>/dev/null | awk 'NR==2{{print $4}}')",
        # listening TCP sockets (local address:port in hex), for the engine port check
        "echo listen=$(awk 'FNR>1 && $4==\"0A\"{print $2}' /proc/net/tcp /proc/net/tcp6 2>/dev/null | tr '\\n' ,)",
        # bash's `command -v` also names a file that is not executable: test -x as well
        *(f"p=$(command -v {shlex.quote(b)} 2>/dev/null); [ -n \"$p\" ] && [ -x \"$p\" ] || p=missing; "
          f"echo bin={shlex.quote(b)}=$p" for b in binaries),
        "echo iperf3_version=$(iperf3 --version 2>/dev/null | awk 'NR==1{print $2}')",
        *nic_lines(w.nic_address),
        # RDMA ports: device|port|rate|state|link layer (perftest's tests use them; sysfs, no tool needed)
        "for p in /sys/class/infiniband/*/ports/*; do [ -d \"$p\" ] || continue; d=${p%/ports/*}; "
        "echo \"rdma=${d##*/}|${p##*/}|$(cat $p/rate 2>/dev/null)|$(cat $p/state 2>/dev/null)|"
        "$(cat $p/link_layer 2>/dev/null)\"; done",
        "if command -v nvidia-smi >/dev/null 2>&1; then "
        f"out=$({shlex.join(GPU_QUERY)} 2>&1) && echo \"$out\" | sed 's/^/gpu=/' || "
        "echo \"gpu_error=$(echo $out | head -c 300)\"; else echo gpu_none=1; fi",
    ]
    if model:
        lines.append(
            f"if [ -d {model} ]; then echo model_bytes=$(du -sb {model} | cut -f1); else echo model_bytes=0; fi"
        )
    return "; ".join(lines) + "; true"


def nic_lines(address: str | None) -> list[str]:
    """The interface that holds ``address``: its name, speed (Mb/s, sysfs; -1 or absent on virtual links), MTU
    and driver (sysfs, else ethtool -i)."""
    if not address:
        return []
    a = shlex.quote(address)
    return [
        f"nic=$(ip -o addr show 2>/dev/null | awk -v a={a} "
        "'{split($4, x, \"/\"); if (x[1] == a) {print $2; exit}}')",
        'if [ -n "$nic" ]; then echo nic_if="$nic"; echo nic_speed=$(cat "/sys/class/net/$nic/speed" 2>/dev/null); '
        'echo nic_mtu=$(cat "/sys/class/net/$nic/mtu" 2>/dev/null); d=$(readlink "/sys/class/net/$nic/device/driver" '
        '2>/dev/null); [ -n "$d" ] || d=$(ethtool -i "$nic" 2>/dev/null | awk \'/^driver:/{print $2}\'); '
        'echo nic_driver=${d##*/}; fi',
    ]


def parse_facts(text: str) -> dict:
    """key=value lines -> dict; repeated keys (one ``gpu`` line per GPU) become lists."""
    facts: dict = {}
    for line in text.splitlines():
        if "=" not in line:
            continue
        key, value = line.split("=", 1)
        if key == "gpu":
            facts.setdefault("gpus", []).append([p.strip() for p in value.split(",")])
        elif key == "bin":
            name, _, path = value.rpartition("=")
            facts.setdefault("bins", {})[name] = path.strip()
        elif key == "mem_kib":
            facts["mem_bytes"] = _int(value) * 1024
        elif key == "rdma":
            facts.setdefault("rdma", []).append(value.strip()[:300])
        else:
            facts[key] = value.strip()
    return facts


def clock_offset(cluster: Cluster, node: Node, probes: int = CLOCK_PROBES) -> tuple[float, float]:
    """(offset_ms, uncertainty_ms) of the node's clock against ours, NTP-style: the probe with the
    shortest round trip wins, its midpoint is compared, half the round trip bounds the error."""
    samples = []
    for _ in range(max(1, probes)):
        t0 = time.time()
        res = cluster[node].run(["date", "+%s%N"], timeout=15)
        t1 = time.time()
        if not res.ok or not res.stdout.strip().isdigit():
            raise DeploybenchError(f"node {node.name}: `date +%s%N` gave {res.stdout.strip()[:60]!r} (rc {res.rc})")
        samples.append((int(res.stdout.strip()) / 1e6 - (t0 + t1) / 2 * 1e3, (t1 - t0) / 2 * 1e3))
    return min(samples, key=lambda s: s[1])


def gather(cluster: Cluster, node: Node, w: Wanted, preflight_dir: str) -> NodeCheck:
    """Run the facts script and the clock probes on ``node``; SSH errors become a failed ``ssh`` check."""
    check = NodeCheck(node.name, True)
    binaries = w.binaries + (SOURCE_BINARIES if node.name == w.source else ())
    try:
        res = cluster[node].run(facts_script(w, node, preflight_dir, binaries), timeout=60)
    except node_errors() as exc:
        check.add(CheckItem("ssh", "fail", None, str(exc)))
        return check
    if not res.ok:
        check.add(CheckItem("ssh", "fail", res.rc, f"node {node.name}: the check script exited {res.rc}: "
                                                    f"{res.stderr.strip()[-300:]}"))
        return check
    check.add(CheckItem("ssh", "pass", "host key verified", f"node {node.name}: reachable, host key verified"))
    check.facts = parse_facts(res.stdout)
    try:
        offset, unc = clock_offset(cluster, node)
        check.facts["clock_offset_ms"], check.facts["clock_uncertainty_ms"] = round(offset, 1), round(unc, 1)
    except node_errors() as exc:
        check.facts["clock_error"] = str(exc)
    return check


# -- judging (pure) --------------------------------------------------------------------------
def judge_node(check: NodeCheck, node: Node, spec: PreflightSpec, w: Wanted, model_bytes: int) -> None:
    """Add the per-node verdicts to ``check`` from its facts."""
    f = check.facts
    name = node.name
    missing = [b for b, path in f.get("bins", {}).items() if path == "missing"]
    if missing:
        check.add(CheckItem("binaries", "fail", missing, f"node {name}: {', '.join(missing)} not installed "
                            "(needed by preflight and fan-out); install it or leave the node out of the inventory"))
    else:
        check.add(CheckItem("binaries", "pass", f.get("bins"), f"node {name}: every binary present"))
    check.add(_space(name, f, spec, w, model_bytes))
    check.add(_clock(name, f, spec))
    if w.engine_port:
        check.add(_port(name, node.address, f, w.engine_port))
    check.add(_gpu(name, f, spec))
    if w.nic_address:
        check.add(_nic(node, f, w.nic_address))
    if (rdma := _rdma(node, f, spec)) is not None:
        check.add(rdma)
    check.add(
        CheckItem(
            "system",
            "pass",
            {
                "cpus": _int(f.get("cpus")),
                "mem_gib": round(_int(f.get("mem_bytes")) / GiB, 1),
                "kernel": f.get("kernel"),
            },
            f"node {name}: {f.get('cpus')} CPUs ({f.get('cpu_model') or 'unknown model'}), "
            f"{_int(f.get('mem_bytes')) / GiB:.1f} GiB memory, kernel {f.get('kernel')}",
        )
    )


def nic_facts(f: dict) -> dict[str, Any]:
    """What a node reported about the tested interface, checked: a name, numbers (speed None when the link
    does not say, as virtual links do), a driver name."""
    name = str(f.get("nic_if") or "")
    driver = str(f.get("nic_driver") or "")
    speed, mtu = _int(f.get("nic_speed")), _int(f.get("nic_mtu"))
    ok_name = re.fullmatch(r"[A-Za-z0-9_.:@-]{1,32}", name)
    return {"interface": name if ok_name else None, "speed_mbit": speed if speed > 0 else None,
            "mtu": mtu if 68 <= mtu <= 65536 else None,
            "driver": driver if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", driver) else None}


def fabric_identity(f: dict) -> dict[str, Any]:
    """The node's fabric as it enters the cluster's identity (deploybench.store.identity): the tested interface's
    speed, MTU and driver, and its RDMA ports with their rates; {} when it reported none of it."""
    from deploybench.preflight import rdma

    nic = {k: v for k, v in nic_facts(f).items() if k != "interface" and v is not None}
    ports = sorted(f"{p['device']}/{p['port']} {p['gbit'] or '?'}G {p['link_layer']}" for p in rdma.devices(f))
    return {**nic, **({"rdma": ports} if ports else {})}


def _nic(node: Node, f: dict, address: str) -> CheckItem:
    """The tested interface against the inventory: its MTU must be the inventory's (when given); a NIC that
    negotiated less than the node's nominal link speed is a warning (the link test then judges the bandwidth)."""
    nic = nic_facts(f)
    name = node.name
    if nic["interface"] is None:
        return CheckItem("nic", "warn", None, f"node {name}: no interface holds {address} (ip addr), so its speed and "
                                               "MTU are unknown")
    shown = (f"{nic['interface']}: {nic['speed_mbit'] or 'unknown'} Mb/s, MTU {nic['mtu']}, "
             f"driver {nic['driver'] or 'unknown'}")
    if node.mtu and nic["mtu"] != node.mtu:
        return CheckItem("nic", "fail", nic, f"node {name}: MTU {nic['mtu']} on {nic['interface']}, the inventory says "
                                             f"{node.mtu}; set it (ip link set {nic['interface']} mtu {node.mtu}) or "
                                             "correct the inventory's mtu")
    if nic["speed_mbit"] and nic["speed_mbit"] < node.link_mbit:
        return CheckItem("nic", "warn", nic, f"node {name}: {nic['interface']} negotiated {nic['speed_mbit']} Mb/s, "
                                             f"below the inventory's link_mbit {node.link_mbit:g} ({shown})")
    return CheckItem("nic", "pass", nic, f"node {name}: {shown}")


def _rdma(node: Node, f: dict, spec: PreflightSpec) -> CheckItem | None:
    """RDMA ports: required (rdma = require, or an inventory rdma_device) and missing fails the node."""
    from deploybench.config import RdmaMode
    from deploybench.preflight import rdma

    if spec.rdma is RdmaMode.OFF:
        return None
    port, why = rdma.chosen(node, f)
    if port is None:
        needed = spec.rdma is RdmaMode.REQUIRE or node.rdma_device is not None
        return CheckItem("rdma", "fail" if needed else "pass", None,
                         why + ("" if not needed else "; RDMA is required (rdma_test = require, or the inventory's "
                                "rdma_device): fix the device, or set rdma_test = off"))
    return CheckItem("rdma", "pass", port, f"node {node.name}: RDMA {port['device']} port {port['port']}, "
                                            f"{port['gbit'] or 'unknown'} Gbit/s, {port['link_layer']}")


def _int(v: object) -> int:
    try:
        return int(str(v))
    except ValueError:
        return 0


def _space(name: str, f: dict, spec: PreflightSpec, w: Wanted, model_bytes: int) -> CheckItem:
    free = _int(f.get("free_bytes"))
    present = _int(f.get("model_bytes"))
    if name == w.source and w.model_name and not present:
        return CheckItem("free_space", "fail", 0, f"node {name} is the fan-out source but holds no model "
                         f"{w.model_name!r} under {w.model_root}; put the model there or choose another source_node")
    if not model_bytes:
        return CheckItem("free_space", "pass", free, f"node {name}: {free / GiB:.1f} GiB free at {w.model_root} "
                         "(model size unknown)")
    need = 0 if present >= model_bytes else int(model_bytes * (1 + spec.free_space_margin))
    text = (f"node {name}: {free / GiB:.1f} GiB free at {w.model_root}, the model needs {need / GiB:.1f} GiB "
            f"({model_bytes / GiB:.2f} GiB + {spec.free_space_margin:.0%} margin)")
    if present >= model_bytes:
        return CheckItem("free_space", "pass", free, f"node {name}: already holds the model ({present / GiB:.2f} GiB)")
    if free < need:
        return CheckItem("free_space", "fail", free, text + "; free space there or lower free_space_margin")
    return CheckItem("free_space", "pass", free, text)


def _clock(name: str, f: dict, spec: PreflightSpec) -> CheckItem:
    if "clock_offset_ms" not in f:
        return CheckItem("clock", "warn", None, f"node {name}: clock offset not measured: {f.get('clock_error')}")
    off, unc = f["clock_offset_ms"], f["clock_uncertainty_ms"]
    limit = spec.max_clock_offset_ms
    text = f"node {name}: clock offset {off:+.0f} ms (+/- {unc:.0f} ms) against the controller, limit {limit:g} ms"
    if abs(off) - unc > limit:
        return CheckItem("clock", "fail", off, text + "; synchronise the clocks (chrony/NTP)")
    if abs(off) + unc > limit:
        return CheckItem("clock", "warn", off, text + " (within the measuring error of the limit)")
    return CheckItem("clock", "pass", off, text)


def listening(listen: str) -> list[tuple[str, int]]:
    """(address, port) of every listening socket from /proc/net/tcp{,6} hex fields ("0100007F:1F40")."""
    out = []
    for item in filter(None, listen.split(",")):
        addr_hex, _, port_hex = item.partition(":")
        try:
            port = int(port_hex, 16)
            raw = bytes.fromhex(addr_hex)
        except ValueError:
            continue
        if len(raw) == 4:
            addr = str(ipaddress.IPv4Address(raw[::-1]))
        else:  # four little-endian 32-bit words
            v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            addr = str(v6.ipv4_mapped or v6)
        out.append((addr, port))
    return out


def port_taken(listen: str, address: str, port: int) -> bool:
    """Whether something listens on ``port`` at ``address`` or at a wildcard address."""
    return any(p == port and a in (address, "0.0.0.0", "::") for a, p in listening(listen))


def _port(name: str, address: str, f: dict, port: int) -> CheckItem:
    if port_taken(f.get("listen", ""), address, port):
        return CheckItem("engine_port", "fail", port, f"node {name}: port {port} is already in use at {address}; "
                         "stop what listens there (a stale engine?) or choose another port")
    return CheckItem("engine_port", "pass", port, f"node {name}: port {port} is free")


def _gpu(name: str, f: dict, spec: PreflightSpec) -> CheckItem:
    gpus = f.get("gpus") or []
    if gpus:
        models = Counter(g[0] for g in gpus)
        summary: dict[str, Any] = {
            "count": len(gpus), "models": sorted(models), "drivers": sorted({g[1] for g in gpus if len(g) > 1}),
            "memory_mib": sorted({g[2] for g in gpus if len(g) > 2})}
        return CheckItem(
            "gpu",
            "pass",
            summary,
            f"node {name}: {len(gpus)} GPU(s) "
            + ", ".join(f"{n}x {m}" for m, n in models.items())
            + f", driver {', '.join(summary['drivers'])}",
        )
    status: Status = "fail" if spec.require_gpu else "pass"
    why = f"nvidia-smi failed: {f['gpu_error']}" if f.get("gpu_error") else "nvidia-smi is not installed"
    tail = "; require_gpu is on" if spec.require_gpu else " (require_gpu is off, so this is only reported)"
    return CheckItem("gpu", status, None, f"node {name}: no GPU ({why}){tail}")


def gpu_signature(check: NodeCheck) -> tuple | None:
    item = next((c for c in check.checks if c.name == "gpu"), None)
    if item is None or not isinstance(item.value, dict):
        return None
    v = item.value
    return (v["count"], tuple(v["models"]), tuple(v["drivers"]), tuple(v["memory_mib"]))


def consistency(checks: list[NodeCheck], spec: PreflightSpec) -> list[str]:
    """Differences between nodes that should be alike. The odd ones out (against the majority) get a
    ``consistency`` check: GPU differences fail them when require_gpu is on, anything else warns."""
    findings = []
    reached = [c for c in checks if c.reachable]
    aspects = {
        "GPUs (count, model, driver, memory)": (gpu_signature, spec.require_gpu),
        "kernel": (lambda c: c.facts.get("kernel"), False),
        "CPU count": (lambda c: c.facts.get("cpus"), False),
        "memory": (lambda c: round(_int(c.facts.get("mem_bytes")) / GiB), False),
        "MTU of the tested interface": (lambda c: nic_facts(c.facts)["mtu"], False),
    }
    for label, (key, fails) in aspects.items():
        values = {c.node: key(c) for c in reached}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        usual, _ = counts.most_common(1)[0]
        odd = {n: v for n, v in values.items() if v != usual}
        text = (f"nodes differ in {label}: most have {_show(usual)}; "
                + ", ".join(f"{n} has {_show(v)}" for n, v in odd.items()))
        findings.append(text)
        for c in reached:
            if c.node in odd:
                c.add(
                    CheckItem(
                        "consistency",
                        "fail" if fails else "warn",
                        _show(odd[c.node]),
                        f"node {c.node}: {text}",
                    )
                )
    return findings


def _show(v: object) -> str:
    if v is None:
        return "no GPU"
    if isinstance(v, tuple) and len(v) == 4:
        return f"{v[0]}x {'/'.join(v[1])}, driver {'/'.join(v[2])}, {'/'.join(v[3])} MiB"
    return str(v)
