"""The RDMA path between two nodes: perftest's ib_write_bw (bandwidth) and ib_write_lat (latency).

The engines' multi-node traffic (tensor or pipeline parallel over NCCL) goes over RDMA where the
nodes have it, not over the TCP path iperf3 measures. For each link whose two nodes both have an
RDMA device (the inventory's ``rdma_device``, else the node's first active port as preflight's facts
report it from /sys/class/infiniband), ``test_pair`` starts the perftest server on the destination,
runs the client on the source, and judges the average bandwidth against the slower port's rate
(sysfs ``ports/N/rate``, e.g. ``200 Gb/sec (4X HDR)``) at the run's link threshold. A pair without a
device on either end is skipped and says why.

The command lines and the parsers follow perftest's own formats (linux-rdma/perftest,
src/perftest_parameters.h: RESULT_FMT_G / REPORT_FMT for the bandwidth table with --report_gbits,
RESULT_FMT_LAT / REPORT_FMT_LAT for the latency table); the lab has no RDMA device, so they are
unit-tested against text in those formats.
"""

from __future__ import annotations

import logging
import re
import shlex
from typing import Any

from deploybench.config import PreflightSpec, RdmaMode
from deploybench.errors import DeploybenchError
from deploybench.inventory import Node
from deploybench.preflight.model import RdmaTest, node_errors
from deploybench.transport import Cluster, spawn_script, stop_script

log = logging.getLogger(__name__)

PERFTEST_PORT = 18515  # perftest's default (DEF_PORT)
DEVICE_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")
_NUM = r"[-+]?\d+(?:\.\d+)?"


# -- what a node has (from preflight's facts: ``rdma=<dev>|<port>|<rate>|<state>|<link layer>`` lines) --------
def devices(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The node's RDMA ports as facts_script reported them: device, port, rate (Gbit/s), state, link layer.
    What a node sends is checked: a device name that is not a plain name, or a rate that is not a number,
    is left out."""
    out = []
    for line in facts.get("rdma") or []:
        parts = [p.strip() for p in str(line).split("|")]
        if len(parts) != 5 or not DEVICE_PATTERN.match(parts[0]) or not parts[1].isdigit():
            continue
        rate = _RATE.match(parts[2])
        out.append({"device": parts[0], "port": int(parts[1]), "gbit": float(rate.group(1)) if rate else None,
                    "state": parts[3][:40], "link_layer": parts[4][:40]})
    return out


def chosen(node: Node, facts: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The port this node's RDMA test uses: the inventory's device (its first active port), else the first
    active port of any device; (None, why) when there is none."""
    ports = devices(facts)
    if not ports:
        return None, f"{node.name} has no RDMA device (/sys/class/infiniband is empty or absent)"
    if node.rdma_device:
        mine = [p for p in ports if p["device"] == node.rdma_device]
        if not mine:
            return None, (f"{node.name}: the inventory's rdma_device {node.rdma_device!r} is not there (it has "
                          f"{', '.join(sorted({p['device'] for p in ports}))})")
        ports = mine
    active = [p for p in ports if "ACTIVE" in p["state"].upper()]
    if not active:
        states = ", ".join("{device}/{port} {state}".format(**p) for p in ports)
        return None, f"{node.name}: no RDMA port is ACTIVE ({states})"
    return active[0], ""


# -- command lines (perftest's options) ----------------------------------------------------------------------
def bw_argv(device: str, ib_port: int, port: int, seconds: int, server: str | None = None) -> list[str]:
    """ib_write_bw for ``seconds`` (-D) reporting Gbit/s; ``server``: the client's target (None: the server)."""
    argv = ["ib_write_bw", "-d", device, "-i", str(ib_port), "-p", str(port), "-D", str(seconds),
            "--report_gbits", "-F"]
    return argv + ([server] if server else [])


def lat_argv(device: str, ib_port: int, port: int, iterations: int = 1000, server: str | None = None) -> list[str]:
    """ib_write_lat of ``iterations`` 2-byte writes (-n): t_typical and the 99th percentile."""
    argv = ["ib_write_lat", "-d", device, "-i", str(ib_port), "-p", str(port), "-n", str(iterations), "-F"]
    return argv + ([server] if server else [])


# -- parsers ------------------------------------------------------------------------------------------------
def _table(text: str, header_has: str) -> tuple[list[str], list[float]]:
    """The header line that contains ``header_has`` and the numbers of the first result line after it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if header_has in line:
            for row in lines[i + 1:]:
                nums = re.findall(_NUM, row)
                if row.strip() and not row.strip().startswith("-") and len(nums) >= 3:
                    return line.split(), [float(x) for x in nums]
            break
    raise DeploybenchError(f"no {header_has!r} result in perftest's output: {text.strip()[-300:]!r}")


def parse_bw(text: str) -> dict[str, float]:
    """ib_write_bw --report_gbits: ``#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec] MsgRate[Mpps]``."""
    if "BW average[MB/sec]" in text:
        raise DeploybenchError("ib_write_bw reported MB/sec: run it with --report_gbits")
    _, nums = _table(text, "BW average[Gb/sec]")
    if len(nums) < 5:
        raise DeploybenchError(f"ib_write_bw's result line has {len(nums)} numbers, 5 expected")
    return {"bytes": nums[0], "iterations": nums[1], "peak_gbit": nums[2], "gbit": nums[3], "mpps": nums[4]}


def parse_lat(text: str) -> dict[str, float]:
    """ib_write_lat: ``#bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%`` (usec)."""
    _, nums = _table(text, "t_typical[usec]")
    if len(nums) < 9:
        raise DeploybenchError(f"ib_write_lat's result line has {len(nums)} numbers, 9 expected")
    keys = ("bytes", "iterations", "min_us", "max_us", "typical_us", "avg_us", "stdev_us", "p99_us", "p999_us")
    return dict(zip(keys, nums[:9]))


# -- one pair -------------------------------------------------------------------------------------------------
def plan(spec: PreflightSpec, src: Node, dst: Node, facts: dict[str, dict]
         ) -> tuple[tuple[dict, dict] | None, RdmaTest | None]:
    """What the RDMA test of a link does: (the two ports, None) to test them, or (None, the record that says
    why not: rdma off, or a node without a usable device)."""
    if spec.rdma is RdmaMode.OFF:
        return None, None
    a, why_a = chosen(src, facts.get(src.name) or {})
    b, why_b = chosen(dst, facts.get(dst.name) or {})
    if a is None or b is None:
        return None, RdmaTest("skipped", "; ".join(w for w in (why_a, why_b) if w))
    return (a, b), None


def test_pair(cluster: Cluster, src: Node, dst: Node, ports: tuple[dict, dict], spec: PreflightSpec,
              server_address: str, run_dir: str) -> RdmaTest:
    """ib_write_bw then ib_write_lat from ``src`` to ``dst``; never raises for a node's trouble (status error)."""
    a, b = ports
    rates = [p["gbit"] for p in (a, b) if p.get("gbit")]
    rec = RdmaTest("error", devices=[a["device"], b["device"]], nominal_gbit=min(rates) if rates else None)
    try:
        bw = _client_server(cluster, src, dst, bw_argv(b["device"], b["port"], PERFTEST_PORT, spec.rdma_seconds),
                            bw_argv(a["device"], a["port"], PERFTEST_PORT, spec.rdma_seconds, server_address),
                            spec.rdma_seconds + 30, f"{run_dir}/ib_write_bw")
        got = parse_bw(bw)
        rec.gbit, rec.peak_gbit = got["gbit"], got["peak_gbit"]
        lat = _client_server(cluster, src, dst, lat_argv(b["device"], b["port"], PERFTEST_PORT + 1),
                             lat_argv(a["device"], a["port"], PERFTEST_PORT + 1, server=server_address), 60,
                             f"{run_dir}/ib_write_lat")
        got_lat = parse_lat(lat)
        rec.lat_typical_us, rec.lat_p99_us = got_lat["typical_us"], got_lat["p99_us"]
    except node_errors() as exc:  # DeploybenchError among them
        rec.reason = str(exc)[:500]
        return rec
    judge(rec, spec.link_threshold)
    return rec


def judge(rec: RdmaTest, threshold: float) -> None:
    """Pass when the average bandwidth reaches ``threshold`` of the slower port's rate (unknown rate: pass,
    with the reason saying nothing was compared)."""
    if rec.gbit is None:
        return
    if not rec.nominal_gbit:
        rec.status, rec.reason = "pass", "the ports' rate is unknown: the bandwidth is recorded, not judged"
        return
    rec.ratio = round(rec.gbit / rec.nominal_gbit, 4)
    ok = rec.ratio >= threshold
    rec.status = "pass" if ok else "fail"
    rec.reason = (f"ib_write_bw {rec.gbit:g} Gbit/s, {rec.ratio:.0%} of the ports' {rec.nominal_gbit:g} Gbit/s"
                  + ("" if ok else f", below the threshold {threshold:.0%}"))


def _client_server(cluster: Cluster, src: Node, dst: Node, server_argv: list[str], client_argv: list[str],
                   bound_s: float, files: str) -> str:
    """Start the perftest server on ``dst`` (bounded by ``timeout``, in a pid file), run the client on ``src``,
    stop the server whatever happened; the client's output."""
    pid, logf = f"{files}.pid", f"{files}.log"
    argv = ["timeout", "-k", "2", f"{bound_s:.0f}", *server_argv]
    cluster[dst].run(f"{spawn_script(argv, logf, pid, run_key=cluster.run_key)} >/dev/null; sleep 0.5", timeout=30)
    try:
        res = cluster[src].run(["timeout", "-k", "2", f"{bound_s:.0f}", *client_argv], timeout=bound_s + 10)
        if not res.ok:
            raise DeploybenchError(f"{shlex.join(client_argv[:1])} on {src.name} failed (rc {res.rc}): "
                                   f"{(res.stdout + res.stderr).strip()[-300:]}")
        return res.stdout
    finally:
        try:
            cluster[dst].run(stop_script(pid, 1), timeout=15)
        except node_errors() as exc:
            log.warning("node %s: could not stop the perftest server (it ends within its timeout): %s", dst.name, exc)
