"""What preflight measures, as plain dataclasses (stored as JSON with the run).

The field names other stages read are kept stable: ``links[].{src, dst, mbit, ratio,
nominal_mbit, ok, error}`` for the report's table and matrix, ``healthy`` for fan-out.
Everything else is added beside them. Records are read back into these same classes
(deploybench.records: pydantic validates them, ``_READ`` refuses a key they do not declare).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Literal, cast

from pydantic import ConfigDict

Status = Literal["pass", "warn", "fail"]
_READ = ConfigDict(extra="forbid")  # how a stage record is read back into these classes (deploybench.records)


def node_errors() -> tuple[type[BaseException], ...]:
    """What talking to one node can raise: ours, the OS's, and paramiko's own (a channel refused
    mid-session is not wrapped by the transport). One node's trouble must never crash the stage."""
    from deploybench.errors import DeploybenchError

    try:
        from paramiko import SSHException
    except ImportError:  # the local transport needs no paramiko
        return (DeploybenchError, OSError, EOFError)
    return (DeploybenchError, OSError, EOFError, SSHException)
_RANK = {"pass": 0, "warn": 1, "fail": 2}


def worst_status(statuses: list[str]) -> Status:
    return cast(Status, max(statuses, key=_RANK.__getitem__, default="pass"))


@dataclass
class CheckItem:
    """One check on one node: its verdict, the measured value, and a sentence for people."""

    __pydantic_config__: ClassVar[ConfigDict] = _READ

    name: str
    status: Status
    value: object = None
    detail: str = ""


@dataclass
class NodeCheck:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    node: str
    ok: bool
    reasons: list[str] = field(default_factory=list)  # why it failed (one sentence per failed check)
    facts: dict[str, Any] = field(default_factory=dict)  # what the node reported, raw
    status: Status = "pass"
    warnings: list[str] = field(default_factory=list)
    checks: list[CheckItem] = field(default_factory=list)

    def add(self, item: CheckItem) -> None:
        """Record a check; a failure makes the node fail, a warning is kept beside it."""
        self.checks.append(item)
        if item.status == "fail":
            self.reasons.append(item.detail)
        elif item.status == "warn":
            self.warnings.append(item.detail)
        self.status = worst_status([c.status for c in self.checks])
        self.ok = self.status != "fail"

    @property
    def reachable(self) -> bool:
        return any(c.name == "ssh" and c.status == "pass" for c in self.checks)

    def can_run_iperf3(self) -> bool:
        return self.reachable and self.facts.get("bins", {}).get("iperf3", "missing") != "missing"


@dataclass
class Direction:
    """One direction of a link test: a cell of the bandwidth matrix."""

    __pydantic_config__: ClassVar[ConfigDict] = _READ

    src: str
    dst: str
    mbit: float
    ratio: float
    retransmits: int | None = None
    stream_mbit: list[float] = field(default_factory=list)  # each TCP stream's share (iperf3 -P), in stream order


@dataclass
class LinkTest:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    src: str
    dst: str
    round: int
    nominal_mbit: float
    mbit: float | None = None  # the slower direction (what the link can be relied on for)
    ratio: float | None = None  # mbit / nominal_mbit
    retransmits: int | None = None  # both directions together
    rtt_ms: float | None = None
    ok: bool = False
    error: str | None = None
    threshold: float | None = None
    directions: list[Direction] = field(default_factory=list)
    port: int | None = None
    seconds: float | None = None  # wall time of the whole test, server start to stop (both tests when retested)
    # a first measurement below the threshold, when the link was tested again (links.run_rounds): its ratio
    first_ratio: float | None = None
    streams: int | None = None  # TCP streams each way (iperf3 -P, over every process of the test)
    processes: int | None = None  # iperf3 client/server pairs, each on its own server port
    latency_ms: float | None = None  # ping over the tested network before the bandwidth test: mean RTT
    jitter_ms: float | None = None  # ping's mdev: the RTT's spread
    ping_loss: float | None = None  # fraction of the pings lost
    problems: list[str] = field(default_factory=list)  # why the link fails besides its bandwidth (RTT, jitter)
    notes: list[str] = field(default_factory=list)  # findings that do not fail it (one slow stream of several)
    rdma: RdmaTest | None = None  # the RDMA path (ib_write_bw, ib_write_lat), or why it was not tested


@dataclass
class RdmaTest:
    """perftest between the two nodes of a link: bandwidth against the slower HCA port's rate, and latency."""

    __pydantic_config__: ClassVar[ConfigDict] = _READ

    status: Literal["pass", "fail", "skipped", "error"]
    reason: str = ""
    devices: list[str] = field(default_factory=list)  # [src device, dst device]
    nominal_gbit: float | None = None  # the slower port's rate (sysfs ports/N/rate)
    gbit: float | None = None  # ib_write_bw's BW average
    peak_gbit: float | None = None
    ratio: float | None = None
    lat_typical_us: float | None = None  # ib_write_lat's t_typical
    lat_p99_us: float | None = None


@dataclass
class PreflightResult:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    nodes: list[NodeCheck]
    links: list[LinkTest]
    healthy: list[str]
    excluded: dict[str, str]
    decision: str
    seconds: float
    policy: str = "abort"
    link_mode: str = "ring"
    threshold: float = 0.9
    rounds: int = 0
    findings: list[str] = field(default_factory=list)  # cluster-wide: inconsistencies between nodes
    worst_links: list[str] = field(default_factory=list)  # the weakest directions, worst first, in words
    matrix: dict[str, dict[str, float]] = field(default_factory=dict)  # src -> dst -> ratio of nominal

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
