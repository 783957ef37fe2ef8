"""The embedded lab cluster: ``up``, ``down``, ``status``, and link/node faults.

A lab is a small real cluster on this machine. In netns mode (root) every node is a
network namespace on a bridge with its own address, sshd, private model root and a
tc-shaped link; in loopback mode every node is a 127.x.y.z address with its own folders,
reached through the local transport. Either way ``up`` writes an inventory, and the
pipeline never needs to know which mode it runs on.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deploybench import manifest
from deploybench.config import ModelSpec
from deploybench.errors import DeploybenchError, LabError
from deploybench.inventory import Inventory
from deploybench.lab import capacity, commands, netns
from deploybench.lab.naming import (
    NetnsNames,
    check_name,
    check_nodes,
    host_address,
    loopback_candidates,
    pick_subnet,
    subnet_candidates,
)
from deploybench.lab.state import LabFiles, LabState, Mode, build_inventory, other_lab_subnets
from deploybench.transport import connect

log = logging.getLogger(__name__)

# the most a lab's link is shaped to; without --link-mbit, lab up measures what the host carries (lab.capacity)
DEFAULT_LINK_MBIT = capacity.DEFAULT_LINK_MBIT
DEFAULT_MODEL_MB = 64.0
SSHD_WAIT_S = 20.0
TELEMETRY_WAIT_S = 20.0  # a node exporter answers in well under a second, Prometheus in one or two
LOCK_PATH = Path("/run/lock/deploybench-lab.lock")


@dataclass(frozen=True)
class NodeStatus:
    name: str
    address: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class LabStatus:
    name: str
    mode: Mode
    subnet: str
    link_mbit: float
    nodes: list[NodeStatus]
    inventory: Path
    prometheus: str | None = None
    link_note: str | None = None  # how lab up chose the link speed, when it measured the host

    @property
    def healthy(self) -> bool:
        return bool(self.nodes) and all(n.ok for n in self.nodes)


def is_root() -> bool:
    return os.geteuid() == 0


def resolve_mode(mode: Mode | str) -> Mode:
    try:
        m = Mode(mode)
    except ValueError as exc:
        raise LabError(f"lab mode {mode!r} is unknown; use netns, loopback or auto") from exc
    if m is Mode.AUTO:
        return Mode.NETNS if is_root() else Mode.LOOPBACK
    if m is Mode.NETNS and not is_root():
        raise LabError("netns mode needs root (network namespaces, tc, sshd); run as root or use --mode loopback")
    return m


@contextmanager
def _machine_lock() -> Iterator[None]:
    """Serialises subnet choice and bridge creation between labs started at the same time."""
    path = LOCK_PATH if os.access(LOCK_PATH.parent, os.W_OK) else Path("/tmp/deploybench-lab.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# -- up ----------------------------------------------------------------------------------------
def up(
    name: str = "demo",
    nodes: int = 16,
    link_mbit: float | None = None,
    mode: Mode | str = Mode.AUTO,
    model_mb: float = DEFAULT_MODEL_MB,
    model_name: str | None = None,
    loadgens: int = 0,
) -> Inventory:
    """Build lab ``name`` (or find it running) and return its inventory, also saved as inventory.json.
    ``loadgens`` more machines (g01...) get a namespace and an sshd each like nodes, and serve nothing: the inventory
    lists them as its load generators. ``link_mbit`` None: the links get what this host carries when preflight's
    largest round runs (measured here, at most DEFAULT_LINK_MBIT; lab.capacity), said in the log and the state."""
    check_name(name)
    check_nodes(nodes, loadgens)
    if link_mbit is not None and not (0 < link_mbit < float("inf")):
        raise LabError(f"--link-mbit {link_mbit} must be a positive number of Mbit/s (leave it out to have the lab "
                       f"measure what this host carries, at most {DEFAULT_LINK_MBIT:g})")
    m = resolve_mode(mode)
    files = LabFiles(name)
    old = files.read_state()
    if old is not None and files.inventory.exists() and _running(old, files):
        wanted = (m, nodes, old.link_mbit if link_mbit is None else float(link_mbit), loadgens)
        if (old.mode, old.node_count, old.link_mbit, old.loadgen_count) != wanted:
            log.warning(
                "lab %s is already running with %s nodes at %g Mbit/s in %s mode (asked: %s nodes at %g Mbit/s, %s); "
                "keeping it - run `deploybench lab down --name %s` first to rebuild",
                name, old.node_count, old.link_mbit, old.mode.value, nodes, link_mbit or old.link_mbit, m.value, name,
            )
        else:
            log.info("lab %s is already running (%d nodes); nothing to do", name, old.node_count)
        return Inventory.load(files.inventory)
    if old is not None or files.root.exists() or (is_root() and any(netns.lab_objects(NetnsNames.of(name)))):
        log.info("lab %s: removing what a previous run left", name)
        down(name)
    t0 = time.monotonic()
    model_name = model_name or ModelSpec().name
    try:
        if m is Mode.NETNS:
            state = _up_netns(name, nodes, link_mbit, model_name, model_mb, files, loadgens)
        else:
            state = _up_loopback(name, nodes, link_mbit, model_name, model_mb, files, loadgens)
        _seed(files, state)
        inventory = build_inventory(state, files)
        inventory.save(files.inventory)
    except BaseException:
        log.error("lab %s: up failed; removing what was built", name)
        try:
            down(name)
        except DeploybenchError as exc:
            log.error("lab %s: cleanup after the failed up also failed: %s", name, exc)
        raise
    if state.link_note:
        log.info("lab %s: %s", name, state.link_note)
    log.info("lab %s up: %d %s nodes%s in %s, %.1f s; inventory %s", name, nodes, m.value,
             f" and {loadgens} load generators" if loadgens else "", state.subnet, time.monotonic() - t0,
             files.inventory)
    return inventory


def _up_netns(name: str, count: int, asked_mbit: float | None, model_name: str, model_mb: float,
              files: LabFiles, loadgens: int = 0) -> LabState:
    # asked for none: shaped far above any lab speed until the probe measured what the host carries
    link_mbit = capacity.PROBE_MBIT if asked_mbit is None else asked_mbit
    names = NetnsNames.of(name)
    files.root.mkdir(parents=True, exist_ok=True)
    with _machine_lock():
        taken = netns.used_subnets() + other_lab_subnets(name)
        net = pick_subnet(subnet_candidates(name), taken, "lab")
        state = LabState(name=name, mode=Mode.NETNS, subnet=str(net), node_count=count, link_mbit=link_mbit,
                         model_name=model_name, model_mb=model_mb, loadgen_count=loadgens)
        files.write_state(state)
        netns.create_bridge(names, host_address(net), net.prefixlen)

    files.keys.mkdir(parents=True, exist_ok=True)
    netns.ssh_keygen(files.user_key, f"deploybench-lab-{name}")
    files.authorized_keys.write_text(files.user_key.with_suffix(".pub").read_text())
    indexed = list(enumerate(state.machines, start=1))

    def build(item: tuple[int, str]) -> None:
        i, node = item
        netns.ssh_keygen(files.host_key(node), f"{name}-{node}")
        netns.create_node(names, i, node, state.address(node), net.prefixlen, link_mbit)
        for d in (files.models(node), files.run(node)):
            d.mkdir(parents=True, exist_ok=True)

    netns.parallel(build, indexed)
    if asked_mbit is None:
        def shape(mbit: float) -> None:
            netns.parallel(lambda item: netns.shape(names, item[0], item[1], mbit), indexed)

        state = _measured_links(state, files, lambda n: ("ip", "netns", "exec", names.namespace(n)), shape)
        if state.link_mbit != link_mbit:  # one node: the ceiling (the other case left the links at what it chose)
            shape(state.link_mbit)
    files.known_hosts.write_text("".join(
        commands.known_hosts_line(state.address(n), files.host_key(n).with_suffix(".pub").read_text()) + "\n"
        for n in state.machines
    ))
    for d in (files.shared_models, files.shared_run):
        d.mkdir(parents=True, exist_ok=True)
    write_stand_ins(files.bin)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    procs = {node: _start_node_sshd(names, files, state, node) for node in state.machines}
    waited = netns.parallel(
        lambda node: netns.wait_ssh(state.address(node), procs[node], files.node_dir(node) / "sshd.log", SSHD_WAIT_S),
        state.machines,
    )
    log.debug("lab %s: slowest sshd answered after %.2f s", name, max(waited))
    url = _start_telemetry(names, files, state)
    if url:
        state = state.model_copy(update={"prometheus": url})
        files.write_state(state)
    return state


def _node_exporter_binary() -> str | None:
    return next((found for b in commands.NODE_EXPORTER_BINARIES if (found := shutil.which(b))), None)


def _start_node_exporter(names: NetnsNames, files: LabFiles, state: LabState, node: str, binary: str
                         ) -> subprocess.Popen[bytes]:
    textfiles = files.node_dir(node) / "textfile"
    textfiles.mkdir(parents=True, exist_ok=True)
    return netns.start_detached(
        commands.node_exporter_argv(binary, names.namespace(node), state.address(node), str(textfiles)),
        files.node_dir(node) / "node-exporter.log")


def _start_telemetry(names: NetnsNames, files: LabFiles, state: LabState) -> str | None:
    """A node exporter in every node and one Prometheus on the controller's lab address scraping them and the
    engines' port (commands.prometheus_config); its URL, or None (with a warning) when they are not installed:
    the lab then runs without Prometheus."""
    exporter, server = _node_exporter_binary(), shutil.which("prometheus")
    if not exporter or not server:
        log.warning("lab %s runs without Prometheus: %s not installed (apt-get install prometheus "
                    "prometheus-node-exporter)", state.name,
                    " and ".join(w for w, b in (("prometheus", server), ("prometheus-node-exporter", exporter))
                                 if not b))
        return None
    procs = {node: _start_node_exporter(names, files, state, node, exporter) for node in state.nodes}
    netns.parallel(lambda node: netns.wait_http(
        f"http://{state.address(node)}:{commands.NODE_EXPORTER_PORT}/metrics", procs[node],
        files.node_dir(node) / "node-exporter.log", TELEMETRY_WAIT_S), state.nodes)
    folder = files.prometheus
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(commands.prometheus_config({n: state.address(n) for n in state.nodes}))
    address = host_address(state.network)
    proc = netns.start_detached(commands.prometheus_argv(server, str(config), str(folder / "data"), address),
                                folder / "prometheus.log")
    url = f"http://{address}:{commands.PROMETHEUS_PORT}"
    waited = netns.wait_http(f"{url}/-/ready", proc, folder / "prometheus.log", TELEMETRY_WAIT_S)
    log.info("lab %s: Prometheus at %s (ready after %.1f s) scrapes %d node exporters and the engines' port %d "
             "every %d s", state.name, url, waited, len(state.nodes), commands.ENGINE_PORT, commands.SCRAPE_INTERVAL_S)
    return url


def stop_prometheus(name: str) -> None:
    """Stop lab ``name``'s Prometheus only (its exporters go on): what a run sees when the team's Prometheus dies."""
    files = LabFiles(check_name(name))
    netns.kill_pids(netns.pids_mentioning(f"{files.prometheus}/"))


def write_stand_ins(folder: Path) -> None:
    """The scripts of the programs the lab's nodes lack (deploybench.sim.stand_in.STAND_INS: ``tritonserver``,
    ``nvidia-smi``) in ``folder`` (the lab's bin/, on the nodes' PATH after the system's folders, so a real one
    installed wins)."""
    import shlex

    from deploybench.sim.stand_in import STAND_INS

    folder.mkdir(parents=True, exist_ok=True)
    for program, module in STAND_INS.items():
        script = folder / program
        script.write_text(f"#!/bin/sh\n# the lab's stand-in for {program}: {module}\n"
                          f"exec {shlex.quote(sys.executable)} -I -m deploybench.sim.stand_in {program} \"$@\"\n")
        script.chmod(0o755)


def _node_env(name: str, node: str) -> dict[str, str]:
    from deploybench import paths

    stand_ins = str(LabFiles(name).bin)
    env = {  # (sshd's SetEnv takes no spaces: a home with one has no stand-ins)
        "PATH": f"{commands.SYSTEM_PATH}:{Path(sys.executable).parent}" + (f":{stand_ins}" * (" " not in stand_ins)),
        "DEPLOYBENCH_LAB": name,
        "DEPLOYBENCH_NODE": node,
    }
    gpus = LabFiles(name).node_dir(node) / "gpus"  # where its simulated engines list their GPUs for nvidia-smi
    if " " not in str(gpus):
        from deploybench.sim.nvidia_smi import GPU_DIR_ENV

        gpus.mkdir(parents=True, exist_ok=True)
        env[GPU_DIR_ENV] = str(gpus)
    home = str(paths.home())
    if " " not in home:
        env["DEPLOYBENCH_HOME"] = home
    return env


def _start_node_sshd(names: NetnsNames, files: LabFiles, state: LabState, node: str) -> subprocess.Popen[bytes]:
    nd = files.node_dir(node)
    config = nd / "sshd_config"
    try:
        text = commands.sshd_config(
            address=state.address(node), host_key=str(files.host_key(node)),
            authorized_keys=str(files.authorized_keys), pid_file=str(nd / "sshd.pid"), env=_node_env(state.name, node),
        )
    except ValueError as exc:
        raise LabError(f"lab {state.name}: cannot write sshd_config for {node}: {exc}") from exc
    config.write_text(text)
    binds = {str(files.models(node)): str(files.shared_models), str(files.run(node)): str(files.shared_run)}
    # A lab node is a fresh machine: the controller's shell start-up file (bash sources
    # ~/.bashrc for every SSH command; here it ran `pyenv init`, ~100 ms per command) is
    # hidden behind an empty one in the node's mount namespace.
    bashrc = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".bashrc"
    if bashrc.is_file():
        empty = nd / "bashrc"
        empty.write_text("")
        binds[str(empty)] = str(bashrc)
    return netns.start_sshd(names.namespace(node), binds, config, nd / "sshd.log")


def _up_loopback(name: str, count: int, asked_mbit: float | None, model_name: str, model_mb: float,
                 files: LabFiles, loadgens: int = 0) -> LabState:
    link_mbit = DEFAULT_LINK_MBIT if asked_mbit is None else asked_mbit
    net = pick_subnet(loopback_candidates(name), other_lab_subnets(name), "loopback")
    state = LabState(name=name, mode=Mode.LOOPBACK, subnet=str(net), node_count=count, link_mbit=link_mbit,
                     model_name=model_name, model_mb=model_mb, loadgen_count=loadgens)
    files.write_state(state)
    for node in state.nodes:
        files.models(node).mkdir(parents=True, exist_ok=True)
    (files.root / "run").mkdir(exist_ok=True)
    return _measured_links(state, files, lambda n: ()) if asked_mbit is None else state


def _measured_links(state: LabState, files: LabFiles, prefix: Callable[[str], tuple[str, ...]],
                    shape: Callable[[float], None] | None = None) -> LabState:
    """``state`` with the link speed this host carries for preflight's largest round (lab.capacity), saved.
    ``shape(mbit)`` shapes every link (netns): the chosen speed is then checked by the same round, shaped."""
    pairs = capacity.probe_pairs(state.nodes)
    if not pairs or shutil.which("iperf3") is None:  # one node: no link is ever tested
        note = None if not pairs else (f"links {DEFAULT_LINK_MBIT:g} Mbit/s, not measured: iperf3 is not installed "
                                       "(apt-get install iperf3; preflight needs it too)")
        if note:
            log.warning("lab %s: %s", state.name, note)
        state = state.model_copy(update={"link_mbit": DEFAULT_LINK_MBIT, "link_note": note})
        files.write_state(state)
        return state
    ends = [(capacity.Endpoint(prefix(a), state.address(a)), capacity.Endpoint(prefix(b), state.address(b)))
            for a, b in pairs]
    found = capacity.choose(capacity.measure(ends), len(pairs), DEFAULT_LINK_MBIT)
    if shape is not None:
        found = capacity.settle(found, lambda: capacity.measure(ends), shape)
    state = state.model_copy(update={"link_mbit": found.link_mbit, "link_note": found.note})
    files.write_state(state)
    return state


def _seed(files: LabFiles, state: LabState) -> None:
    """The synthetic model on the first node, the fan-out source (kept if already valid)."""
    target = files.models(state.nodes[0]) / state.model_name
    try:
        manifest.verify(target)
        log.info("lab %s: model %s already on %s", state.name, state.model_name, state.nodes[0])
        return
    except (manifest.ManifestMismatch, OSError):
        shutil.rmtree(target, ignore_errors=True)
    t0 = time.monotonic()
    m = manifest.seed_model(target, total_mb=state.model_mb)
    log.info("lab %s: seeded %s on %s (%.0f MB, %.1f s)", state.name, state.model_name, state.nodes[0],
             m.total_bytes / 1e6, time.monotonic() - t0)


# -- down / status -----------------------------------------------------------------------------
def down(name: str, purge: bool = False) -> None:
    """Remove everything lab ``name`` made; the user and host keys stay unless ``purge``. Idempotent."""
    check_name(name)
    files = LabFiles(name)
    state = files.read_state()
    if is_root():
        netns.teardown(NetnsNames.of(name), files.root, files.shared_root)
    elif state is not None and state.mode is Mode.NETNS:
        raise LabError(
            f"lab {name} runs in netns mode; removing it needs root (sudo deploybench lab down --name {name})"
        )
    else:
        pids = netns.pids_mentioning(f"{files.root}/nodes/")
        if pids:
            netns.kill_pids(pids)
    files.remove(keep_keys=not purge)
    log.info("lab %s down", name)


def _running(state: LabState, files: LabFiles) -> bool:
    if state.mode is Mode.LOOPBACK:
        return all(files.models(n).is_dir() for n in state.nodes)
    if not is_root():
        return False
    nss, _ = netns.lab_objects(NetnsNames.of(state.name))
    if len(nss) != len(state.machines):
        return False
    try:
        netns.parallel(lambda n: netns.wait_ssh(state.address(n), None, files.node_dir(n) / "sshd.log", 2.0),
                       state.machines)
    except LabError:
        return False
    return True


def load_inventory(name: str) -> Inventory:
    files = LabFiles(check_name(name))
    if not files.inventory.exists():
        raise LabError(f"lab {name} is not up (no {files.inventory}); start it with `deploybench lab up --name {name}`")
    return Inventory.load(files.inventory)


def status(name: str, timeout: float = 5.0) -> LabStatus:
    """Every node (and load generator) and whether it answers a command through the inventory's transport."""
    inv = load_inventory(name)
    files = LabFiles(name)
    state = files.read_state()
    if state is None:
        raise LabError(f"lab {name}: {files.state} is missing or invalid; run `deploybench lab down --name {name}`")

    def probe(node_name: str) -> NodeStatus:
        node = inv.machine(node_name)
        root = inv.model_root_of(node_name) if node_name in inv.names else "/"  # a load generator has no model
        try:
            with connect(inv, node, {"timeout": timeout}) as t:
                r = t.run(["test", "-d", root], timeout=timeout)
            ok = r.ok
            detail = "answers" if ok else f"model root {root} missing"
        except DeploybenchError as exc:
            ok, detail = False, str(exc)
        return NodeStatus(node.name, node.address, ok, detail)

    nodes = netns.parallel(probe, [*inv.names, *inv.loadgen_names])  # load generators answer like nodes
    return LabStatus(name, state.mode, state.subnet, state.link_mbit, nodes, files.inventory, state.prometheus,
                     state.link_note)


# -- faults (netns mode) -----------------------------------------------------------------------
def _netns_state(name: str) -> tuple[LabState, LabFiles]:
    files = LabFiles(check_name(name))
    state = files.read_state()
    if state is None:
        raise LabError(f"lab {name} is not up; start it with `deploybench lab up --name {name}`")
    if state.mode is not Mode.NETNS:
        raise LabError(f"lab {name} runs in {state.mode.value} mode; link and node faults need netns mode (root)")
    return state, files


def set_link(name: str, node: str, mbit: float | None = None, delay_ms: float | None = None,
             loss_pct: float | None = None, flow_cap_mbit: float | None = None, icmp_kbit: float | None = None) -> None:
    """Degrade (or, with no arguments, restore) ``node``'s link in both directions.

    ``mbit`` replaces the shaped rate (the inventory keeps the nominal one, so preflight
    sees the shortfall); ``delay_ms``/``loss_pct`` need the kernel's netem qdisc.
    ``flow_cap_mbit`` caps each TCP flow of the iperf3 ports (a fast link: one stream cannot fill
    it, several can); ``icmp_kbit`` shapes pings to a crawl (added RTT and jitter, without netem).
    """
    for what, v in (("flow_cap_mbit", flow_cap_mbit), ("icmp_kbit", icmp_kbit)):
        if v is not None and v <= 0:
            raise LabError(f"set_link {node}: {what}={v} must be positive (leave it out for none)")
    state, _ = _netns_state(name)
    if mbit is not None and mbit <= 0:
        raise LabError(f"set_link {node}: mbit={mbit} must be positive (use kill_node to cut the link)")
    if loss_pct is not None and not 0 <= loss_pct <= 100:
        raise LabError(f"set_link {node}: loss_pct={loss_pct} must be between 0 and 100")
    netns.shape(NetnsNames.of(name), state.index(node), node, mbit or state.link_mbit, delay_ms, loss_pct,
                flow_cap_mbit=flow_cap_mbit, icmp_kbit=icmp_kbit)
    log.info("lab %s: link of %s set to %g Mbit/s, delay %s ms, loss %s %%%s%s", name, node,
             mbit or state.link_mbit, delay_ms or 0, loss_pct or 0,
             f", each iperf3 flow capped at {flow_cap_mbit:g} Mbit/s" if flow_cap_mbit else "",
             f", pings shaped to {icmp_kbit:g} kbit/s" if icmp_kbit else "")


def kill_node(name: str, node: str) -> None:
    """Crash ``node``: every process in its namespace is killed and its link goes down."""
    state, _ = _netns_state(name)
    names = NetnsNames.of(name)
    netns.kill_pids(netns.namespace_pids(names.namespace(node)), grace_s=1.0)
    netns.sh(["ip", "link", "set", names.host_veth(state.index(node)), "down"])
    log.info("lab %s: node %s killed", name, node)


def start_node(name: str, node: str) -> None:
    """Bring a killed node back: link up, sshd started, wait until it answers."""
    state, files = _netns_state(name)
    names = NetnsNames.of(name)
    netns.sh(["ip", "link", "set", names.host_veth(state.index(node)), "up"])
    if not netns.namespace_pids(names.namespace(node)):
        proc = _start_node_sshd(names, files, state, node)
        netns.wait_ssh(state.address(node), proc, files.node_dir(node) / "sshd.log", SSHD_WAIT_S)
        exporter = _node_exporter_binary()
        if state.prometheus and exporter:
            got = _start_node_exporter(names, files, state, node, exporter)
            netns.wait_http(f"http://{state.address(node)}:{commands.NODE_EXPORTER_PORT}/metrics", got,
                            files.node_dir(node) / "node-exporter.log", TELEMETRY_WAIT_S)
    log.info("lab %s: node %s started", name, node)


def hide_binary(name: str, node: str, binary: str) -> None:
    """Make ``binary`` (e.g. iperf3) unusable on ``node`` only: an empty, non-executable file is
    bind-mounted over it inside the node's private mount namespace. ``show_binary`` undoes it."""
    _, files = _netns_state(name)
    path = shutil.which(binary) or binary
    blank = files.root / "hidden-binary"
    blank.touch(mode=0o644)
    netns.sh(["nsenter", "-t", _sshd_pid(files, node), "-m", "--", "mount", "--bind", str(blank), path])
    log.info("lab %s: %s hidden on %s", name, path, node)


def show_binary(name: str, node: str, binary: str) -> None:
    """Undo ``hide_binary`` (idempotent)."""
    _, files = _netns_state(name)
    path = shutil.which(binary) or binary
    netns.sh(["nsenter", "-t", _sshd_pid(files, node), "-m", "--", "umount", path], check=False)


def _sshd_pid(files: LabFiles, node: str) -> str:
    try:
        return files.node_dir(node).joinpath("sshd.pid").read_text().strip()
    except OSError as exc:
        raise LabError(f"lab {files.name}: node {node} has no running sshd ({exc}); start it with start_node") from exc
