"""Netns mode: each node is a network namespace on a bridge, with its own sshd and shaped link.

This module runs the commands that ``commands`` builds. It needs root. Teardown works
from the lab's name alone (see ``naming``), so a lab whose state was lost in a crash is
still removed completely.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from deploybench.errors import LabError
from deploybench.lab import commands
from deploybench.lab.naming import NODE_IFNAME, NetnsNames

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
WORKERS = 8


def sh(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one command; on failure raise LabError with its stderr."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError as exc:
        raise LabError(f"`{argv[0]}` is not installed; the netns lab needs iproute2, openssh-server and iperf3 "
                       "(apt-get install iproute2 openssh-server iperf3 rsync), or use --mode loopback") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"`{' '.join(argv)}` timed out after {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")
    return proc


def sh_all(cmds: Iterable[Sequence[str]]) -> None:
    for argv in cmds:
        sh(argv)


def parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` over ``items`` on a few threads; the first exception is raised after all finish."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        return [f.result() for f in futures]


# -- what the machine already has --------------------------------------------------------------
def used_subnets() -> list[ipaddress.IPv4Network]:
    """IPv4 subnets the machine routes or has addresses in, so a new lab avoids them."""
    nets: list[ipaddress.IPv4Network] = []
    for entry in json.loads(sh(["ip", "-j", "-4", "addr"]).stdout or "[]"):
        for a in entry.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(sh(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default" and route.get("type", "unicast") == "unicast":
            try:
                nets.append(ipaddress.IPv4Network(dst if "/" in dst else f"{dst}/32", strict=False))
            except ValueError:
                continue
    return [n for n in nets if not n.is_loopback]


def namespaces() -> list[str]:
    out = sh(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def links() -> list[str]:
    return [entry["ifname"] for entry in json.loads(sh(["ip", "-j", "link"]).stdout or "[]")]


def lab_objects(names: NetnsNames) -> tuple[list[str], list[str]]:
    """(namespaces, interfaces) of lab ``names`` that exist now."""
    return [ns for ns in namespaces() if names.owns_namespace(ns)], [i for i in links() if names.owns_link(i)]


def check_netem() -> bool:
    """Whether the kernel has sch_netem (delay and loss need it; some VM kernels lack it)."""
    return _config_has("CONFIG_NET_SCH_NETEM")


def _config_has(option: str) -> bool:
    import gzip

    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            return any(line.startswith(f"{option}=") for line in f)
    except OSError:
        return True  # unknown: let tc decide


# -- building ----------------------------------------------------------------------------------
def create_bridge(names: NetnsNames, host_address: str, prefix: int) -> None:
    sh_all(commands.bridge_commands(names.bridge, host_address, prefix))


def create_node(names: NetnsNames, index: int, node: str, address: str, prefix: int, link_mbit: float) -> None:
    """Namespace, veth pair on the bridge, address, and the link shaped in both directions."""
    ns = names.namespace(node)
    veth = names.host_veth(index)
    sh_all(commands.link_commands(ns, names.bridge, veth, NODE_IFNAME, address, prefix))
    shape(names, index, node, link_mbit)


def shape(names: NetnsNames, index: int, node: str, mbit: float, delay_ms: float | None = None,
          loss_pct: float | None = None, flow_cap_mbit: float | None = None, icmp_kbit: float | None = None) -> None:
    """Node->bridge on the node's eth0, bridge->node on the host end: a full-duplex link of ``mbit``. Each call
    builds the link's whole tree again (its root deleted first), so any shaping replaces any other:
    commands.shape_commands (the rate, with netem for ``delay_ms``/``loss_pct``), or commands.shape_batch for
    ``flow_cap_mbit``/``icmp_kbit`` (per-flow caps, slow pings). What cannot be built is refused first."""
    if (flow_cap_mbit or icmp_kbit) and (delay_ms or loss_pct):
        raise LabError(f"node {node}: per-flow caps and slow pings do not combine with delay or loss (netem)")
    if (delay_ms or loss_pct) and not check_netem():
        raise LabError(
            f"node {node}: delay {delay_ms} ms / loss {loss_pct} % needs the kernel's netem qdisc "
            "(CONFIG_NET_SCH_NETEM), which this kernel does not have; degrade the link with mbit= only, "
            "or run the lab on a kernel with sch_netem"
        )
    for ns, dev in ((names.namespace(node), NODE_IFNAME), (None, names.host_veth(index))):
        sh(commands.delete_root(dev, ns), check=False)  # a new link has none
        if not (flow_cap_mbit or icmp_kbit):
            sh_all(commands.shape_commands(dev, mbit, ns=ns, delay_ms=delay_ms, loss_pct=loss_pct))
            continue
        proc = subprocess.run(commands.batch_argv(ns), input=commands.shape_batch(dev, mbit, flow_cap_mbit, icmp_kbit),
                              capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise LabError(f"tc -batch on {dev} failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}")


def start_sshd(ns: str, binds: dict[str, str], config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """Start the node's sshd detached (own session); it outlives this process until ``down``."""
    argv = commands.sshd_start_argv(ns, binds, str(config))
    with open(log_path, "ab") as logf:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def wait_ssh(address: str, proc: subprocess.Popen[bytes] | None, log_path: Path, timeout: float = 20.0,
             port: int = 22) -> float:
    """Wait until sshd at ``address`` sends its banner; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-600:] if log_path.exists() else ""
            raise LabError(f"sshd for {address} exited with {proc.returncode} before accepting connections: {tail}")
        try:
            with socket.create_connection((address, port), timeout=1.0) as s:
                s.settimeout(2.0)
                if s.recv(4).startswith(b"SSH-"):
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise LabError(f"sshd at {address}:{port} did not answer within {timeout:.0f} s; see {log_path}")
        time.sleep(0.05)


def start_detached(argv: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """A lab daemon (a node exporter, the lab's Prometheus) in its own session; it outlives this process until
    ``down``. Its argv names a path under the lab's folder, so ``teardown`` finds it even without its namespace."""
    with open(log_path, "ab") as logf:
        try:
            return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise LabError(f"cannot start `{argv[0]}`: {exc.strerror or exc}") from exc


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, log_path: Path, timeout: float = 20.0) -> float:
    """Wait until ``url`` answers 200 (a daemon's readiness page); returns the seconds waited. LabError when the
    process exits first or the bound passes, with the tail of its log."""
    from deploybench import http

    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-600:] if log_path.exists() else ""
            raise LabError(f"{url}: the process serving it exited with {proc.returncode}: {tail}")
        if http.is_up(url, timeout=1.0):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise LabError(f"{url} did not answer within {timeout:.0f} s; see {log_path}")
        time.sleep(0.1)


def ssh_keygen(path: Path, comment: str) -> None:
    if path.exists() and path.with_suffix(".pub").exists():
        return
    path.unlink(missing_ok=True)
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)])


# -- tearing down ------------------------------------------------------------------------------
def kill_pids(pids: Iterable[int], grace_s: float = 2.0) -> int:
    """TERM, then KILL after ``grace_s``; never this process. Returns how many were signalled."""
    me = os.getpid()
    pids = [p for p in set(pids) if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.05)
        if not alive:
            break
        pids = alive
    return len(pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def namespace_pids(ns: str) -> list[int]:
    proc = sh(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def pids_mentioning(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (sshd of a lab whose namespace is gone)."""
    found = []
    needle = text.encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def teardown(names: NetnsNames, lab_dir: Path, shared_root: Path) -> None:
    """Remove every process, namespace and interface of the lab. Safe to repeat."""
    nss, ifs = lab_objects(names)
    pids = [p for ns in nss for p in namespace_pids(ns)]
    pids += pids_mentioning(f"{lab_dir}/nodes/") + pids_mentioning(f"{lab_dir}/prometheus/")
    if pids:
        log.info("lab %s: stopping %d processes", names.lab, len(pids))
        kill_pids(pids)
    # Deleting the host end removes the pair at once; deleting a namespace frees its
    # interfaces only later, and a quick rebuild would then hit "File exists".
    for ifname in ifs:
        if ifname != names.bridge:
            sh(["ip", "link", "del", ifname], check=False)
    for ns in nss:
        sh(["ip", "netns", "del", ns], check=False)
    if names.bridge in ifs:
        sh(["ip", "link", "del", names.bridge], check=False)
    deadline = time.monotonic() + 10
    while True:
        nss, ifs = lab_objects(names)
        if not nss and not ifs:
            break
        if time.monotonic() > deadline:
            raise LabError(f"lab {names.lab}: {nss + ifs} still exist after teardown; remove them with "
                           "`ip netns del` / `ip link del` and run `deploybench lab down` again")
        time.sleep(0.1)
    remove_shared_root(shared_root)


def remove_shared_root(root: Path) -> None:
    """The shared model/run paths are bind targets only inside node mount namespaces; on the host
    they are empty directories. Unmount defensively (a crash cannot leave host mounts, but a
    hand-made one would block removal), then remove the empty folders."""
    with open("/proc/self/mountinfo") as f:
        mounted = [line.split()[4] for line in f]
    for target in sorted((m for m in mounted if m == str(root) or m.startswith(f"{root}/")), reverse=True):
        sh(["umount", "-l", target], check=False)
    if not root.is_dir():
        return
    for child in root.iterdir():
        try:
            child.rmdir()
        except OSError:
            log.warning("lab mount point %s is not empty; leaving it", child)
    try:
        root.rmdir()
    except OSError:
        pass
