"""Link tests: which pairs, in which rounds, and one iperf3 test between two nodes.

A round holds disjoint pairs, so no node is in two tests at once and every test gets the
whole of both its ends; a full mesh of N nodes takes N-1 rounds (N even) or N (N odd),
not N(N-1)/2 tests one after another. Both directions are measured in one test
(``iperf3 --bidir``) by default: on the lab's full-duplex links it gives the same figures
as two one-way tests in half the time (see the note of issue 3); ``bidir=False`` runs
``-R`` after the forward test, for hosts where the CPU cannot drive both at once.

The stage starts one iperf3 server per node for all its rounds (one SSH command per node,
in parallel), so a test costs one client run, not a server start, a client and a stop
(measured at -t 1 on the lab: 1.04 s per test against 1.36 s).
A server is started under ``timeout`` (so it ends even if this process is killed),
recorded in a pid file, restarted after a test that failed (iperf3 servers can wedge on a
half-open control connection), stopped in a ``finally``, and a later preflight sweeps any
pid file a killed run left. A port in use is skipped. ``test_link`` on its own starts and
stops a server for its one test.

A link that reads below the threshold is tested once more before it counts against its nodes
(``run_rounds``): a short test that lands in a scheduling hiccup of either host, or in TCP's slow
start on a busy one, reads low once (73 % and 70 % of nominal seen at -t 1 on a busy 2-core lab
host whose links read 86-94 % otherwise); a slow link reads low again. The link is judged by the
second measurement; the first is kept in the record (``first_ratio``).

A fast link needs more than one TCP stream: one stream on one core does not fill 100-400 GbE. A test
runs ``streams_for`` parallel streams (iperf3 -P, from the slower end's nominal speed or given), spread
over ``processes_for`` iperf3 client/server pairs on their own server ports (iperf3 before 3.16 runs
all of one process's streams on one core); the verdict is on their sum, each stream's share is kept
(``Direction.stream_mbit``), and a stream far below the others is a finding (``LinkTest.notes``): one
slow stream out of eight is a path that hashes badly, or a bad lane. Before the bandwidth test, ping
measures the idle RTT and its spread (``latency_ms``, ``jitter_ms``), judged against the spec.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shlex
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from deploybench.config import LinkMode, PreflightNetwork, PreflightSpec
from deploybench.errors import DeploybenchError
from deploybench.inventory import Inventory, Node
from deploybench.preflight.model import Direction, LinkTest, node_errors
from deploybench.transport import Cluster, alive_script, run_tag, spawn_script, stop_script

log = logging.getLogger(__name__)

IPERF_PORT = 5201
PORT_TRIES = 10  # 5201..5210: a port some other program holds is skipped
CONNECT_TIMEOUT_MS = 3000
BUSY_TRIES = 4
SLACK_S = 15.0  # beyond the test's own duration, for connecting and the final exchange
MAX_STREAMS = 128  # iperf3's own limit (-P)
STREAMS_PER_PROCESS = 8  # processes = 0: one iperf3 client/server pair per this many streams
SLOW_STREAM = 0.5  # a stream under this fraction of the median stream is a finding
END_MARK = "@@deploybench-iperf3-end@@"  # between the outputs of a test's several iperf3 clients
USER_PING_INTERVAL_S = 0.2  # iputils ping refuses a shorter interval to a user without CAP_NET_RAW


# -- how many streams and processes (pure) ----------------------------------------------------
def streams_for(nominal_mbit: float, spec: PreflightSpec) -> int:
    """Parallel TCP streams for a link of ``nominal_mbit``: ``spec.streams``, or one stream up to what one stream
    carries (``spec.stream_gbit``), else one per stream_gbit of the nominal speed and a quarter more (so that
    streams that hash onto one path, or one slow core, still leave the sum above the threshold)."""
    if spec.streams:
        return spec.streams
    per = spec.stream_gbit * 1000.0
    return 1 if nominal_mbit <= per else min(MAX_STREAMS, math.ceil(1.25 * nominal_mbit / per))


def processes_for(streams: int, spec: PreflightSpec) -> int:
    """iperf3 client/server pairs for ``streams`` streams: ``spec.processes`` or one per STREAMS_PER_PROCESS."""
    return max(1, min(streams, spec.processes or math.ceil(streams / STREAMS_PER_PROCESS)))


def split_streams(streams: int, processes: int) -> list[int]:
    """Streams of each process: as even as can be, the first ones one more."""
    base, extra = divmod(streams, processes)
    return [base + (1 if k < extra else 0) for k in range(processes)]


# -- which pairs, which rounds (pure) -------------------------------------------------------
def link_pairs(names: list[str], mode: LinkMode, source: str | None = None) -> list[tuple[str, str]]:
    """The links to test: ring (each node to the next), star (source to each), mesh (every pair).

    Every test measures both directions, so a pair appears once.
    """
    n = len(names)
    if n < 2:
        return []
    if mode is LinkMode.RING:
        return [(names[0], names[1])] if n == 2 else [(names[i], names[(i + 1) % n]) for i in range(n)]
    if mode is LinkMode.STAR:
        src = source if source in names else names[0]
        return [(src, d) for d in names if d != src]
    return [(names[i], names[j]) for i in range(n) for j in range(i + 1, n)]


def schedule_rounds(pairs: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """Group links into rounds in which no node takes part in two tests.

    A full mesh uses the circle method (N-1 rounds for even N, N for odd: the optimum);
    other shapes use greedy edge colouring (a ring: 2 or 3 rounds; a star: one per link).
    """
    nodes = list(dict.fromkeys(x for p in pairs for x in p))
    if len(nodes) > 2 and len({frozenset(p) for p in pairs}) == len(nodes) * (len(nodes) - 1) // 2:
        return circle_rounds(pairs, nodes)
    rounds: list[list[tuple[str, str]]] = []
    busy: list[set[str]] = []
    for a, b in pairs:
        for i, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[i].append((a, b))
                used.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


def circle_rounds(pairs: list[tuple[str, str]], nodes: list[str]) -> list[list[tuple[str, str]]]:
    """Round-robin tournament: fix one node, rotate the others; an odd count gets a bye."""
    wanted = {frozenset(p): p for p in pairs}
    order: list[str | None] = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(order)
    rounds = []
    for _ in range(n - 1):
        rnd = [wanted[frozenset((a, b))] for i in range(n // 2)
               if (a := order[i]) is not None and (b := order[n - 1 - i]) is not None]
        rounds.append(rnd)
        order = [order[0], order[-1], *order[1:-1]]
    return rounds


def parse_iperf3(text: str) -> dict:
    """Throughput (Mbit/s), retransmits and mean RTT (ms) from ``iperf3 -J``; with ``--bidir`` also the
    reverse direction (server to client) as ``reverse_mbit`` / ``reverse_retransmits``."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise DeploybenchError(f"iperf3 gave no JSON ({exc}): {text.strip()[-200:]!r}") from exc
    if "error" in data and not data.get("end"):
        raise DeploybenchError(f"iperf3: {data['error']}")
    end = data.get("end") or {}
    received = end.get("sum_received") or end.get("sum") or {}
    sent = end.get("sum_sent") or {}
    rtts = [s["sender"]["mean_rtt"] for s in end.get("streams", []) if (s.get("sender") or {}).get("mean_rtt")]
    # each stream's received rate; its "sender" flag says whether the client sent it (the forward direction)
    per: dict[bool, list[float]] = {True: [], False: []}
    for st in end.get("streams", []):
        rcv = st.get("receiver") or {}
        if isinstance(rcv.get("bits_per_second"), (int, float)):
            per[bool(rcv.get("sender", True))].append(round(rcv["bits_per_second"] / 1e6, 1))
    out = {
        "mbit": received.get("bits_per_second", 0.0) / 1e6,
        "retransmits": sent.get("retransmits"),
        "rtt_ms": (sum(rtts) / len(rtts) / 1000.0) if rtts else None,
        "stream_mbit": per[True],
        "reverse_stream_mbit": per[False],
    }
    if "sum_received_bidir_reverse" in end:
        out["reverse_mbit"] = end["sum_received_bidir_reverse"].get("bits_per_second", 0.0) / 1e6
        out["reverse_retransmits"] = (end.get("sum_sent_bidir_reverse") or {}).get("retransmits")
    return out


def merge_iperf3(parts: list[dict]) -> dict:
    """The figures of a test's several iperf3 processes as one: rates and retransmits summed, streams listed."""
    if len(parts) == 1:
        return parts[0]

    def total(key: str) -> float | None:
        vals = [p[key] for p in parts if p.get(key) is not None]
        return sum(vals) if vals else None

    rtts = [p["rtt_ms"] for p in parts if p.get("rtt_ms") is not None]
    out = {"mbit": total("mbit") or 0.0, "retransmits": total("retransmits"),
           "rtt_ms": sum(rtts) / len(rtts) if rtts else None,
           "stream_mbit": [x for p in parts for x in p.get("stream_mbit", [])],
           "reverse_stream_mbit": [x for p in parts for x in p.get("reverse_stream_mbit", [])]}
    if all("reverse_mbit" in p for p in parts):
        out["reverse_mbit"], out["reverse_retransmits"] = total("reverse_mbit"), total("reverse_retransmits")
    return out


_PING_SENT = re.compile(r"(\d+) packets transmitted, (\d+) (?:packets )?received")
_PING_RTT = re.compile(r"(?:rtt|round-trip) min/avg/max/(?:mdev|stddev) = "
                       r"([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")


def parse_ping(text: str) -> dict:
    """ping's summary (iputils: ``N packets transmitted, M received, ...`` and ``rtt min/avg/max/mdev = a/b/c/d
    ms``): sent, received, loss (fraction) and the RTT figures in ms (None when every ping was lost)."""
    sent = _PING_SENT.search(text)
    if not sent:
        raise DeploybenchError(f"ping gave no summary: {text.strip()[-200:]!r}")
    n, got = int(sent.group(1)), int(sent.group(2))
    rtt = _PING_RTT.search(text)
    figures = dict(zip(("min_ms", "avg_ms", "max_ms", "mdev_ms"), (float(x) for x in rtt.groups()))) if rtt else {}
    return {"sent": n, "received": got, "loss": round(1 - got / n, 4) if n else None,
            "min_ms": figures.get("min_ms"), "avg_ms": figures.get("avg_ms"), "max_ms": figures.get("max_ms"),
            "mdev_ms": figures.get("mdev_ms")}


# -- scripts run on nodes (built here, quoted, tested without a cluster) ----------------------
def preflight_dir(inv: Inventory, node: str) -> str:
    return f"{inv.run_root}/{node}/preflight"


def test_address(node: Node, network: PreflightNetwork) -> str:
    return node.data_address if network is PreflightNetwork.BACKEND else node.address


def _hex_ipv4(address: str) -> str:
    """The address as /proc/net/tcp writes it (little-endian hex); '' if not IPv4."""
    parts = address.split(".")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return ""
    return "".join(f"{int(p):02X}" for p in reversed(parts))


def server_script(address: str, first_port: int, tries: int, pid_path: str, log_path: str, bound_s: float,
                  one_off: bool, run_key: str | None = None) -> str:
    """Start an iperf3 server on the first free port from ``first_port``; prints ``port=N`` once it listens.

    A port something else listens on is skipped (``busy=N``); a server that dies at start
    (lost a race for its port) is stopped and the next port tried. Exit 3: no port worked.
    """
    listening = (
        "listening() { awk -v p=\"$1\" -v a=" + shlex.quote(_hex_ipv4(address) or "-") + " "
        + shlex.quote('FNR>1 && $4=="0A" { split($2, x, ":"); if (x[2] == p && (x[1] == a || x[1] ~ /^0+$/)) f=1 }'
                      ' END { exit !f }')
        + " /proc/net/tcp /proc/net/tcp6 2>/dev/null; }; "
    )
    body = [listening]
    for port in range(first_port, first_port + tries):
        argv = ["timeout", "-k", "2", f"{bound_s:.0f}", "iperf3", "-s", "-B", address, "-p", str(port)]
        argv += ["-1"] if one_off else []
        body.append(
            f"if listening {port:04X}; then echo busy={port}; else "
            f"{spawn_script(argv, log_path, pid_path, run_key=run_key)} >/dev/null; i=0; "
            f"while [ $i -lt 60 ]; do if listening {port:04X}; then echo port={port}; exit 0; fi; "
            f"( {alive_script(pid_path)} ) || break; sleep 0.05; i=$((i+1)); done; "
            f"{stop_script(pid_path, 0.5)}; "
            f"echo failed={port}:$(tail -c 200 {shlex.quote(log_path)} 2>/dev/null | tr '\\n' ' '); fi; "
        )
    return "".join(body) + "exit 3"


def sweep_script(directory: str) -> str:
    """Stop iperf3 servers a killed earlier run left (their pid files in ``directory``), then drop the files.

    A pid is only signalled while its command line still names iperf3, so a reused pid is never hit.
    """
    d = shlex.quote(directory)
    return (
        f"for f in {d}/iperf3-*.pid; do [ -f \"$f\" ] || continue; pid=$(head -n 1 \"$f\"); "
        "case \"$(tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null)\" in "
        "\"timeout \"*\" iperf3 \"*|iperf3\\ *|*/iperf3\\ *) "
        "kill -TERM -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null; sleep 0.2; "
        "kill -KILL -$pid 2>/dev/null; kill -KILL $pid 2>/dev/null; echo swept=$pid;; esac; rm -f \"$f\"; done"
    )


def client_argv(address: str, bind: str, port: int, seconds: float, mode: str, *, streams: int = 1, omit_s: int = 0,
                zerocopy: bool = False, core: int | None = None) -> list[str]:
    """iperf3 client under ``timeout``; mode: 'bidir', 'forward' or 'reverse'. ``streams``: -P; ``omit_s``: -O (the
    ramp-up left out, the test runs that much longer); ``zerocopy``: -Z; ``core``: -A core,core (client and
    server of this process on that core)."""
    argv = ["timeout", "-k", "2", f"{seconds + omit_s + SLACK_S:.0f}", "iperf3", "-c", address, "-B", bind,
            "-p", str(port), "-t", f"{seconds:g}", "-J", "--connect-timeout", str(CONNECT_TIMEOUT_MS)]
    argv += ["-P", str(streams)] if streams > 1 else []
    argv += ["-O", str(omit_s)] if omit_s else []
    argv += ["-Z"] if zerocopy else []
    argv += ["-A", f"{core},{core}"] if core is not None else []
    return argv + {"bidir": ["--bidir"], "forward": [], "reverse": ["-R"]}[mode]


def clients_script(argvs: list[list[str]]) -> str:
    """Several iperf3 clients at once (one per server port); prints each one's output then ``rc=N`` and END_MARK,
    in order. The outputs go to a private temporary folder, removed at the end."""
    started = " ".join(f'( {shlex.join(a)} > "$d/{k}" 2>&1; echo $? > "$d/{k}.rc" ) &' for k, a in enumerate(argvs))
    shown = [f'cat "$d/{k}"; echo; echo rc=$(cat "$d/{k}.rc"); echo {END_MARK}' for k in range(len(argvs))]
    return "; ".join(["d=$(mktemp -d) || exit 3", f"{started} wait", *shown, 'rm -rf "$d"'])


def split_outputs(text: str) -> list[tuple[int, str]]:
    """clients_script's output: (rc, output) per client, in order."""
    out = []
    for chunk in text.split(END_MARK)[:-1]:
        body, _, rc = chunk.rstrip().rpartition("\nrc=")
        out.append((int(rc) if rc.strip().lstrip("-").isdigit() else -1, body.strip()))
    return out


def ping_argv(address: str, bind: str, count: int, interval_s: float) -> list[str]:
    """ping's summary of ``count`` echoes from ``bind`` to ``address``, bounded in time."""
    bound = count * max(interval_s, 0.002) + 5
    return ["timeout", "-k", "2", f"{bound:.0f}", "ping", "-n", "-q", "-c", str(count), "-i", f"{interval_s:g}",
            "-W", "1", "-I", bind, address]


# -- one test -----------------------------------------------------------------------------------
def start_server(cluster: Cluster, node: Node, network: PreflightNetwork, pid: str, logf: str, bound_s: float,
                 one_off: bool = False, first_port: int = IPERF_PORT) -> tuple[int | None, str | None]:
    """Start an iperf3 server on ``node`` on the first free port from ``first_port``: (port, None), or (None, why)."""
    srv = cluster[node].run(server_script(test_address(node, network), first_port, PORT_TRIES, pid, logf, bound_s,
                                          one_off=one_off, run_key=cluster.run_key), timeout=30)
    found = dict(line.split("=", 1) for line in srv.stdout.splitlines() if "=" in line)
    if "port" not in found or not found["port"].strip().isdigit():
        return None, (f"no iperf3 server could start on {node.name} (ports {first_port}-{first_port + PORT_TRIES - 1}"
                      f"): {srv.stdout.strip()[-300:]} {srv.stderr.strip()[-200:]}")
    port = int(found["port"])
    if not first_port <= port < first_port + PORT_TRIES:
        return None, f"node {node.name}: the iperf3 server script reported port {port}, outside the ports it tried"
    if port != first_port:
        log.info("node %s: port %d in use, iperf3 server on %d", node.name, first_port, port)
    return port, None


class Servers:
    """iperf3 servers on each node for a whole set of rounds (``count[node]`` of them, on their own ports, for a
    test's several processes); each node is in one test at a time."""

    def __init__(self, cluster: Cluster, network: PreflightNetwork, bound_s: float,
                 count: dict[str, int] | None = None):
        self.cluster, self.network, self.bound_s = cluster, network, bound_s
        self.count = count or {}
        self.ports: dict[str, list[int]] = {}
        self.errors: dict[str, str] = {}

    def _files(self, name: str, k: int = 0) -> tuple[str, str]:
        d = preflight_dir(self.cluster.inventory, name)
        key = self.cluster.run_key
        suffix = (f"-{run_tag(key)}" if key else "") + (f"-{k}" if k else "")  # one server per node per run (and k)
        return f"{d}/iperf3-server{suffix}.pid", f"{d}/iperf3-server{suffix}.log"

    def start(self, name: str) -> None:
        self.ports.pop(name, None)
        self.errors.pop(name, None)
        ports: list[int] = []
        try:
            for k in range(max(1, self.count.get(name, 1))):
                port, err = start_server(self.cluster, self.cluster.inventory.node(name), self.network,
                                         *self._files(name, k), self.bound_s,
                                         first_port=ports[-1] + 1 if ports else IPERF_PORT)
                if port is None:
                    break
                ports.append(port)
        except node_errors() as exc:
            err = str(exc)
        if len(ports) < max(1, self.count.get(name, 1)):
            self.errors[name] = err or "no port"
        self.ports[name] = ports
        if not ports:
            self.ports.pop(name)

    def restart(self, name: str) -> None:
        self.stop(name)
        self.start(name)

    def stop(self, name: str) -> None:
        try:
            for k in range(max(1, self.count.get(name, 1))):
                self.cluster[name].run(stop_script(self._files(name, k)[0], 1), timeout=15)
        except node_errors() as exc:
            log.warning("node %s: could not stop the iperf3 server (it ends by itself within its timeout): %s",
                        name, exc)
        self.ports.pop(name, None)

    def start_all(self, names: list[str]) -> None:
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
            list(pool.map(self.start, names))

    def stop_all(self) -> None:
        names = list(self.ports)
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(names) or 1))) as pool:
            list(pool.map(self.stop, names))


def test_link(cluster: Cluster, src: Node, dst: Node, rnd: int, seconds: float, threshold: float, *,
              bidir: bool = True, network: PreflightNetwork = PreflightNetwork.BACKEND,
              server: Servers | None = None, spec: PreflightSpec | None = None) -> LinkTest:
    """One link test between src (client) and dst (server): ping (RTT and jitter), then iperf3 both directions,
    with the streams and processes ``spec`` gives for the link's nominal speed (streams_for, processes_for).

    Never raises for a node or network problem: the error goes into the LinkTest. Without
    ``server``, servers are started on dst for this test and stopped whatever happened; with
    it, dst's servers from ``server`` are used (the caller restarts them after a failure).
    """
    spec = spec or PreflightSpec(iperf_seconds=seconds, link_threshold=threshold, bidir=bidir, network=network)
    inv = cluster.inventory
    nominal = min(src.link_mbit, dst.link_mbit)
    lt = LinkTest(src.name, dst.name, rnd, nominal, threshold=threshold)
    streams = streams_for(nominal, spec)
    procs = processes_for(streams, spec)
    lt.streams, lt.processes = streams, procs
    d = preflight_dir(inv, dst.name)
    own_files = [(f"{d}/iperf3-{src.name}-{dst.name}{f'-{k}' if k else ''}.pid",
                  f"{d}/iperf3-{src.name}-{dst.name}{f'-{k}' if k else ''}.log") for k in range(procs)]
    to, bind = test_address(dst, network), test_address(src, network)
    modes = ["bidir"] if bidir else ["forward", "reverse"]
    t0 = time.monotonic()
    own = server is None
    started: list[int] = []
    try:
        if spec.ping_count:
            _ping(cluster, src, to, bind, spec, lt)
        if server is None:
            err = None
            for pid, logf in own_files:
                port, err = start_server(cluster, dst, network, pid, logf,
                                         len(modes) * (seconds + spec.omit_s + SLACK_S) + 10, one_off=bidir,
                                         first_port=started[-1] + 1 if started else IPERF_PORT)
                if port is None:
                    break
                started.append(port)
            ports = started
        else:
            ports, err = server.ports.get(dst.name, []), server.errors.get(dst.name, f"no iperf3 server on {dst.name}")
        if len(ports) < procs:
            lt.error = err or f"{len(ports)} iperf3 servers on {dst.name}, {procs} needed"
            return lt
        lt.port = ports[0]
        figures = {}
        for mode in modes:
            got = _clients(cluster, src, to, bind, ports[:procs], split_streams(streams, procs), seconds, mode, spec)
            if isinstance(got, str):
                lt.error = got
                return lt
            figures[mode] = got
        _fill(lt, figures, threshold)
        _judge_latency(lt, spec)
    except node_errors() as exc:
        lt.error = str(exc)
    finally:
        try:
            # A one-off server whose test completed has ended by itself (the stage's final sweep
            # checks); any other outcome stops it here, at once.
            if own and not (bidir and lt.directions):
                for pid, _ in own_files[:len(started)]:
                    cluster[dst].run(stop_script(pid, 1), timeout=15)
        except node_errors() as exc:
            log.warning("node %s: could not stop the iperf3 server (it ends by itself within its timeout): %s",
                        dst.name, exc)
        lt.seconds = round(time.monotonic() - t0, 3)
    return lt


def _clients(cluster: Cluster, src: Node, to: str, bind: str, ports: list[int], shares: list[int], seconds: float,
             mode: str, spec: PreflightSpec) -> dict | str:
    """One direction mode of a test from its iperf3 clients (one per port): the merged figures, or why not."""
    argvs = [client_argv(to, bind, port, seconds, mode, streams=n, omit_s=spec.omit_s, zerocopy=spec.zerocopy,
                         core=k if spec.affinity else None) for k, (port, n) in enumerate(zip(ports, shares))]
    bound = seconds + spec.omit_s + SLACK_S + 10
    for attempt in range(BUSY_TRIES):
        if len(argvs) == 1:
            res = cluster[src].run(argvs[0], timeout=bound)
            outs = [(res.rc, res.stdout if res.stdout.strip() else res.stdout + res.stderr)]
            ok = res.ok
        else:
            res = cluster[src].run(clients_script(argvs), timeout=bound)
            outs = split_outputs(res.stdout)
            ok = res.ok and len(outs) == len(argvs) and all(rc == 0 for rc, _ in outs)
        # A server still closing its previous test answers "busy": ask again shortly.
        errors = [_iperf_error(out, "") for rc, out in outs if rc != 0] or ([] if ok else [res.stderr.strip()[-200:]])
        if ok or not any("busy" in e for e in errors) or attempt == BUSY_TRIES - 1:
            break
        time.sleep(0.2 * (attempt + 1))
    if not ok:
        return f"iperf3 {mode} test failed (rc {res.rc}): {'; '.join(errors) or 'no output'}"
    return merge_iperf3([parse_iperf3(out) for _, out in outs])


def _ping(cluster: Cluster, src: Node, to: str, bind: str, spec: PreflightSpec, lt: LinkTest) -> None:
    """RTT and jitter of the idle link (ping before the bandwidth test loads it); a missing ping is a note."""
    interval = spec.ping_interval_s
    res = cluster[src].run(ping_argv(to, bind, spec.ping_count, interval), timeout=spec.ping_count * interval + 15)
    if "minimal interval allowed" in res.stdout + res.stderr and interval < USER_PING_INTERVAL_S:
        interval = USER_PING_INTERVAL_S  # not root on the node: ping's own floor for users
        lt.notes.append(f"{src.name}: ping as a user may not send faster than every {interval:g} s; pinged at that")
        res = cluster[src].run(ping_argv(to, bind, spec.ping_count, interval), timeout=spec.ping_count * interval + 15)
    if res.rc in (126, 127) or "not found" in res.stderr:
        lt.notes.append(f"{src.name}: ping is not installed, so RTT and jitter were not measured "
                        "(install iputils-ping)")
        return
    try:
        got = parse_ping(res.stdout)
    except DeploybenchError as exc:
        lt.notes.append(f"{src.name} -> {to}: {exc} {res.stderr.strip()[-200:]}")
        return
    lt.latency_ms, lt.jitter_ms, lt.ping_loss = got["avg_ms"], got["mdev_ms"], got["loss"]


def _judge_latency(lt: LinkTest, spec: PreflightSpec) -> None:
    """RTT, jitter and lost pings against the spec: each one over its bound fails the link, saying so."""
    if lt.ping_loss:
        lt.problems.append(f"{lt.ping_loss:.0%} of the pings {lt.src} -> {lt.dst} were lost (where ICMP is filtered "
                           "on purpose, ping_count = 0 leaves RTT and jitter out)")
    if lt.latency_ms is not None and lt.latency_ms > spec.max_rtt_ms:
        lt.problems.append(f"RTT {lt.latency_ms:.3g} ms, above the largest allowed {spec.max_rtt_ms:g} ms "
                           "(max_rtt_ms)")
    if lt.jitter_ms is not None and lt.jitter_ms > spec.max_jitter_ms:
        lt.problems.append(f"jitter (RTT mdev) {lt.jitter_ms:.3g} ms, above the largest allowed "
                           f"{spec.max_jitter_ms:g} ms (max_jitter_ms)")
    if lt.problems:
        lt.ok = False


def _iperf_error(stdout: str, stderr: str) -> str:
    try:
        return str(json.loads(stdout).get("error"))
    except ValueError:
        return (stdout + stderr).strip()[-200:] or "no output"


def _fill(lt: LinkTest, figures: dict[str, dict], threshold: float) -> None:
    if "bidir" in figures:
        f = figures["bidir"]
        fwd = (f["mbit"], f["retransmits"], f.get("stream_mbit", []))
        rev = (f.get("reverse_mbit"), f.get("reverse_retransmits"), f.get("reverse_stream_mbit", []))
        lt.rtt_ms = f["rtt_ms"]
    else:
        f, r = figures["forward"], figures["reverse"]
        fwd = (f["mbit"], f["retransmits"], f.get("stream_mbit", []))
        rev = (r["mbit"], r["retransmits"], r.get("reverse_stream_mbit", []))
        lt.rtt_ms = f["rtt_ms"] if f["rtt_ms"] is not None else r["rtt_ms"]
    lt.directions = [Direction(lt.src, lt.dst, round(fwd[0], 1), round(fwd[0] / lt.nominal_mbit, 4), fwd[1],
                               fwd[2] if len(fwd[2]) > 1 else [])]
    if rev[0] is not None:
        lt.directions.append(Direction(lt.dst, lt.src, round(rev[0], 1), round(rev[0] / lt.nominal_mbit, 4), rev[1],
                                       rev[2] if len(rev[2]) > 1 else []))
    for x in lt.directions:
        if len(x.stream_mbit) > 1 and (mid := statistics.median(x.stream_mbit)) > 0:
            low = [i for i, v in enumerate(x.stream_mbit) if v < SLOW_STREAM * mid]
            if low:
                lt.notes.append(f"{x.src} -> {x.dst}: {len(low)} of {len(x.stream_mbit)} streams carried under "
                                f"{SLOW_STREAM:.0%} of the median stream ({mid:.0f} Mbit/s): "
                                + ", ".join(f"stream {i + 1} {x.stream_mbit[i]:.0f} Mbit/s" for i in low))
    slow = min(lt.directions, key=lambda x: x.mbit)
    lt.mbit, lt.ratio = slow.mbit, slow.ratio
    retrans = [x.retransmits for x in lt.directions if x.retransmits is not None]
    lt.retransmits = sum(retrans) if retrans else None
    lt.ok = all(x.ratio >= threshold for x in lt.directions)


def run_rounds(cluster: Cluster, rounds: list[list[tuple[str, str]]], spec: PreflightSpec,
               concurrent: bool = True) -> list[LinkTest]:
    """Run the planned rounds; the result is in plan order, each test tagged with its round.

    No node is ever in two tests at once. Rounds are not separated by barriers: every node
    takes its tests in round order, and a test starts as soon as both its nodes have finished
    their earlier ones, so one slow test holds up only what depends on its two nodes. (Starting
    any test whose two nodes happen to be free lets a later round's test overtake and delay an
    earlier one by a whole test; measured on 16 nodes at -t 2: 37.9 s against 32 s in order.)
    ``concurrent=False`` runs the tests one after another (the benchmark's baseline).
    """
    inv = cluster.inventory
    plan = [(i, pair) for i, rnd in enumerate(rounds) for pair in rnd]
    if not plan:
        return []
    per_test = (1 if spec.bidir else 2) * (spec.iperf_seconds + spec.omit_s + SLACK_S) \
        + spec.ping_count * spec.ping_interval_s
    count: dict[str, int] = {}
    for _, (a, b) in plan:  # servers on each node: as many as its most demanding test's processes
        n = processes_for(streams_for(min(inv.node(a).link_mbit, inv.node(b).link_mbit), spec), spec)
        count[b] = max(count.get(b, 1), n)
    servers = Servers(cluster, spec.network, bound_s=len(rounds) * per_test + 60, count=count)

    def measure(i: int, pair: tuple[str, str]) -> LinkTest:
        lt = test_link(cluster, inv.node(pair[0]), inv.node(pair[1]), i, spec.iperf_seconds, spec.link_threshold,
                       bidir=spec.bidir, network=spec.network, server=servers, spec=spec)
        if lt.error and pair[1] in servers.ports:
            servers.restart(pair[1])  # still holding both nodes: no test uses it meanwhile
        return lt

    def one(i: int, pair: tuple[str, str]) -> LinkTest:
        lt = measure(i, pair)
        if not (lt.ok or lt.error):  # a low reading, not an error (that says why it could not measure)
            log.info("round %d: link %s <-> %s read %.0f%% of nominal, below the threshold %.0f%%: testing it again",
                     i, pair[0], pair[1], 100 * (lt.ratio or 0), 100 * spec.link_threshold)
            again = measure(i, pair)
            if not again.error:  # a second test that could not measure leaves the first reading standing
                again.first_ratio, again.seconds = lt.ratio, round((lt.seconds or 0) + (again.seconds or 0), 3)
                lt = again
        _log(lt)
        return lt

    servers.start_all(list(dict.fromkeys(b for _, (_, b) in plan)))
    try:
        if not concurrent:
            return [one(i, pair) for i, pair in plan]
        return _concurrent(plan, rounds, one)
    finally:
        servers.stop_all()


def _concurrent(plan: list, rounds: list, one) -> list[LinkTest]:
    """Each node takes its tests in round order; a test starts once it is next for both its nodes."""
    results: dict[int, LinkTest] = {}
    pending = list(range(len(plan)))
    queue: dict[str, list[int]] = {}
    for k, (_, pair) in enumerate(plan):
        for node in pair:
            queue.setdefault(node, []).append(k)
    running: dict[Future, int] = {}
    with ThreadPoolExecutor(max_workers=max(len(r) for r in rounds)) as pool:
        while pending or running:
            for k in list(pending):
                i, (a, b) = plan[k]
                if queue[a][0] == k and queue[b][0] == k:
                    pending.remove(k)
                    running[pool.submit(one, i, (a, b))] = k
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                k = running.pop(fut)
                for node in plan[k][1]:
                    queue[node].pop(0)
                results[k] = fut.result()
    return [results[k] for k in range(len(plan))]


def _log(lt: LinkTest) -> None:
    if lt.error:
        log.warning("round %d: link %s <-> %s: %s", lt.round, lt.src, lt.dst, lt.error)
    else:
        log.info("round %d: link %s <-> %s: %s Mbit/s (%.0f%% of %g Mbit/s)%s%s", lt.round, lt.src, lt.dst,
                 " / ".join(f"{x.mbit:.0f}" for x in lt.directions), 100 * (lt.ratio or 0), lt.nominal_mbit,
                 " BELOW THRESHOLD" if (lt.ratio or 0) < (lt.threshold or 0) else "",
                 f" (retested: the first test read {100 * lt.first_ratio:.0f}%)" if lt.first_ratio is not None else "")
        if lt.streams and lt.streams > 1:
            log.info("round %d: link %s <-> %s: %d streams in %d iperf3 processes", lt.round, lt.src, lt.dst,
                     lt.streams, lt.processes or 1)
        if lt.latency_ms is not None:
            log.info("round %d: link %s <-> %s: RTT %.3g ms, jitter %.3g ms", lt.round, lt.src, lt.dst, lt.latency_ms,
                     lt.jitter_ms or 0.0)
        for text in lt.problems:
            log.warning("round %d: link %s <-> %s FAILS: %s", lt.round, lt.src, lt.dst, text)
        for text in lt.notes:
            log.info("round %d: link %s <-> %s: %s", lt.round, lt.src, lt.dst, text)


test_link.__test__ = False  # type: ignore[attr-defined]  # a library function, not a pytest test
