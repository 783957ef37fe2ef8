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
"""

from __future__ import annotations

import json
import logging
import shlex
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
    out = {
        "mbit": received.get("bits_per_second", 0.0) / 1e6,
        "retransmits": sent.get("retransmits"),
        "rtt_ms": (sum(rtts) / len(rtts) / 1000.0) if rtts else None,
    }
    if "sum_received_bidir_reverse" in end:
        out["reverse_mbit"] = end["sum_received_bidir_reverse"].get("bits_per_second", 0.0) / 1e6
        out["reverse_retransmits"] = (end.get("sum_sent_bidir_reverse") or {}).get("retransmits")
    return out


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


def client_argv(address: str, bind: str, port: int, seconds: float, mode: str) -> list[str]:
    """iperf3 client under ``timeout``; mode: 'bidir', 'forward' or 'reverse'."""
    argv = ["timeout", "-k", "2", f"{seconds + SLACK_S:.0f}", "iperf3", "-c", address, "-B", bind,
            "-p", str(port), "-t", f"{seconds:g}", "-J", "--connect-timeout", str(CONNECT_TIMEOUT_MS)]
    return argv + {"bidir": ["--bidir"], "forward": [], "reverse": ["-R"]}[mode]


# -- one test -----------------------------------------------------------------------------------
def start_server(cluster: Cluster, node: Node, network: PreflightNetwork, pid: str, logf: str, bound_s: float,
                 one_off: bool = False) -> tuple[int | None, str | None]:
    """Start an iperf3 server on ``node``: (port, None), or (None, why not)."""
    srv = cluster[node].run(server_script(test_address(node, network), IPERF_PORT, PORT_TRIES, pid, logf, bound_s,
                                          one_off=one_off, run_key=cluster.run_key), timeout=30)
    found = dict(line.split("=", 1) for line in srv.stdout.splitlines() if "=" in line)
    if "port" not in found:
        return None, (f"no iperf3 server could start on {node.name} (ports {IPERF_PORT}-{IPERF_PORT + PORT_TRIES - 1}"
                      f"): {srv.stdout.strip()[-300:]} {srv.stderr.strip()[-200:]}")
    port = int(found["port"])
    if port != IPERF_PORT:
        log.info("node %s: port %d in use, iperf3 server on %d", node.name, IPERF_PORT, port)
    return port, None


class Servers:
    """One iperf3 server per node for a whole set of rounds; each node is in one test at a time."""

    def __init__(self, cluster: Cluster, network: PreflightNetwork, bound_s: float):
        self.cluster, self.network, self.bound_s = cluster, network, bound_s
        self.ports: dict[str, int] = {}
        self.errors: dict[str, str] = {}

    def _files(self, name: str) -> tuple[str, str]:
        d = preflight_dir(self.cluster.inventory, name)
        key = self.cluster.run_key
        suffix = f"-{run_tag(key)}" if key else ""  # one server per node per run
        return f"{d}/iperf3-server{suffix}.pid", f"{d}/iperf3-server{suffix}.log"

    def start(self, name: str) -> None:
        self.ports.pop(name, None)
        self.errors.pop(name, None)
        try:
            port, err = start_server(self.cluster, self.cluster.inventory.node(name), self.network,
                                     *self._files(name), self.bound_s)
        except node_errors() as exc:
            port, err = None, str(exc)
        if port is None:
            self.errors[name] = err or "no port"
        else:
            self.ports[name] = port

    def restart(self, name: str) -> None:
        self.stop(name)
        self.start(name)

    def stop(self, name: str) -> None:
        try:
            self.cluster[name].run(stop_script(self._files(name)[0], 1), timeout=15)
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
              server: Servers | None = None) -> LinkTest:
    """One iperf3 test between src (client) and dst (server), both directions.

    Never raises for a node or network problem: the error goes into the LinkTest. Without
    ``server``, a server is started on dst for this test and stopped whatever happened; with
    it, dst's server from ``server`` is used (the caller restarts it after a failure).
    """
    inv = cluster.inventory
    nominal = min(src.link_mbit, dst.link_mbit)
    lt = LinkTest(src.name, dst.name, rnd, nominal, threshold=threshold)
    d = preflight_dir(inv, dst.name)
    pid, logf = f"{d}/iperf3-{src.name}-{dst.name}.pid", f"{d}/iperf3-{src.name}-{dst.name}.log"
    to, bind = test_address(dst, network), test_address(src, network)
    modes = ["bidir"] if bidir else ["forward", "reverse"]
    t0 = time.monotonic()
    own = server is None
    try:
        if server is None:
            port, err = start_server(cluster, dst, network, pid, logf, len(modes) * (seconds + SLACK_S) + 10,
                                     one_off=bidir)
        else:
            port, err = server.ports.get(dst.name), server.errors.get(dst.name, f"no iperf3 server on {dst.name}")
        if port is None:
            lt.error = err
            return lt
        lt.port = port
        figures = {}
        for mode in modes:
            for attempt in range(BUSY_TRIES):
                res = cluster[src].run(client_argv(to, bind, lt.port, seconds, mode), timeout=seconds + SLACK_S + 10)
                # A server still closing its previous test answers "busy": ask again shortly.
                if res.ok or "busy" not in _iperf_error(res.stdout, res.stderr) or attempt == BUSY_TRIES - 1:
                    break
                time.sleep(0.2 * (attempt + 1))
            if not res.ok:
                lt.error = f"iperf3 {mode} test failed (rc {res.rc}): {_iperf_error(res.stdout, res.stderr)}"
                return lt
            figures[mode] = parse_iperf3(res.stdout)
        _fill(lt, figures, threshold)
    except node_errors() as exc:
        lt.error = str(exc)
    finally:
        try:
            # A one-off server whose test completed has ended by itself (the stage's final sweep
            # checks); any other outcome stops it here, at once.
            if own and not (bidir and lt.directions):
                cluster[dst].run(stop_script(pid, 1), timeout=15)
        except node_errors() as exc:
            log.warning("node %s: could not stop the iperf3 server (it ends by itself within its timeout): %s",
                        dst.name, exc)
        lt.seconds = round(time.monotonic() - t0, 3)
    return lt


def _iperf_error(stdout: str, stderr: str) -> str:
    try:
        return str(json.loads(stdout).get("error"))
    except ValueError:
        return (stdout + stderr).strip()[-200:] or "no output"


def _fill(lt: LinkTest, figures: dict[str, dict], threshold: float) -> None:
    if "bidir" in figures:
        f = figures["bidir"]
        fwd, rev = (f["mbit"], f["retransmits"]), (f.get("reverse_mbit"), f.get("reverse_retransmits"))
        lt.rtt_ms = f["rtt_ms"]
    else:
        f, r = figures["forward"], figures["reverse"]
        fwd, rev = (f["mbit"], f["retransmits"]), (r["mbit"], r["retransmits"])
        lt.rtt_ms = f["rtt_ms"] if f["rtt_ms"] is not None else r["rtt_ms"]
    lt.directions = [Direction(lt.src, lt.dst, round(fwd[0], 1), round(fwd[0] / lt.nominal_mbit, 4), fwd[1])]
    if rev[0] is not None:
        lt.directions.append(Direction(lt.dst, lt.src, round(rev[0], 1), round(rev[0] / lt.nominal_mbit, 4), rev[1]))
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
    per_test = (1 if spec.bidir else 2) * (spec.iperf_seconds + SLACK_S)
    servers = Servers(cluster, spec.network, bound_s=len(rounds) * per_test + 60)

    def measure(i: int, pair: tuple[str, str]) -> LinkTest:
        lt = test_link(cluster, inv.node(pair[0]), inv.node(pair[1]), i, spec.iperf_seconds, spec.link_threshold,
                       bidir=spec.bidir, network=spec.network, server=servers)
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
                 "" if lt.ok else " BELOW THRESHOLD",
                 f" (retested: the first test read {100 * lt.first_ratio:.0f}%)" if lt.first_ratio is not None else "")


test_link.__test__ = False  # type: ignore[attr-defined]  # a library function, not a pytest test
