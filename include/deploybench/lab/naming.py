"""Names and addresses of a lab, all derived from the lab's name.

Several labs live on one machine at once (the demo, the tests, other people's tests),
and a lab must be removable after a crash that lost its state file. So every kernel
object a lab makes is named from the lab's name alone: namespaces read
``db-<lab>-nNN`` (for people), interfaces carry a short hash (Linux allows 15
characters), and the subnet is picked from the same hash, skipping any subnet that
the machine already uses.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from deploybench.errors import LabError

LAB_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
MAX_NODES = 200  # node addresses are .11 .. .210 of a /24
FIRST_HOST = 11
IFNAMSIZ = 15


def check_name(name: str) -> str:
    """A lab name is a short lowercase word, so derived names stay short and unambiguous."""
    if not LAB_NAME_RE.match(name):
        raise LabError(
            f"lab name {name!r} is not allowed: use 1-12 lowercase letters and digits starting "
            "with a letter, e.g. 'demo' or 't4a'"
        )
    return name


def check_nodes(count: int, loadgens: int = 0) -> int:
    if not 1 <= count <= MAX_NODES:
        raise LabError(f"--nodes {count} is out of range: a lab has 1 to {MAX_NODES} nodes")
    if not 0 <= loadgens <= MAX_NODES - count:
        raise LabError(f"--loadgens {loadgens} is out of range: nodes and load generators together are at most "
                       f"{MAX_NODES} machines (here {count} nodes, so 0 to {MAX_NODES - count} load generators)")
    return count


def node_name(index: int) -> str:
    """n01, n02, ... (1-based); three digits past 99."""
    return f"n{index:02d}"


def loadgen_name(index: int) -> str:
    """g01, g02, ... (1-based): the lab's load-generator machines."""
    return f"g{index:02d}"


def lab_hash(name: str) -> str:
    return hashlib.sha256(f"deploybench-lab:{name}".encode()).hexdigest()


@dataclass(frozen=True)
class NetnsNames:
    """Kernel object names of one netns lab."""

    lab: str
    tag: str  # 6 hex chars from the name's hash

    @classmethod
    def of(cls, lab: str) -> NetnsNames:
        return cls(check_name(lab), lab_hash(lab)[:6])

    @property
    def ns_prefix(self) -> str:
        return f"db-{self.lab}-"

    def namespace(self, node: str) -> str:
        return f"{self.ns_prefix}{node}"

    @property
    def bridge(self) -> str:
        return f"dbb{self.tag}"

    def host_veth(self, index: int) -> str:
        """The host end of node ``index``'s link (the node end is ``eth0`` inside its namespace)."""
        name = f"dbv{self.tag}{index:02d}"
        if len(name) > IFNAMSIZ:  # pragma: no cover - index is at most MAX_NODES
            raise LabError(f"interface name {name!r} is longer than {IFNAMSIZ} characters")
        return name

    def owns_namespace(self, ns: str) -> bool:
        return re.fullmatch(re.escape(self.ns_prefix) + r"[ng]\d{2,3}", ns) is not None

    def owns_link(self, ifname: str) -> bool:
        return ifname == self.bridge or re.fullmatch(rf"dbv{self.tag}\d{{2,3}}", ifname) is not None


NODE_IFNAME = "eth0"


def subnet_candidates(name: str, count: int = 64) -> Iterator[ipaddress.IPv4Network]:
    """10.x.y.0/24 subnets for lab ``name``, first choice first (x in 100..227 keeps clear of 10.0/16)."""
    for salt in range(count):
        h = hashlib.sha256(f"deploybench-subnet:{name}:{salt}".encode()).digest()
        yield ipaddress.IPv4Network(f"10.{100 + h[0] % 128}.{h[1]}.0/24")


def loopback_candidates(name: str, count: int = 64) -> Iterator[ipaddress.IPv4Network]:
    """127.x.y.0/24 blocks for a loopback lab (x in 2..253 keeps clear of 127.0.0.1 and 127.255)."""
    for salt in range(count):
        h = hashlib.sha256(f"deploybench-loopback:{name}:{salt}".encode()).digest()
        yield ipaddress.IPv4Network(f"127.{2 + h[0] % 252}.{h[1]}.0/24")


def pick_subnet(
    candidates: Iterable[ipaddress.IPv4Network], taken: Iterable[ipaddress.IPv4Network], what: str
) -> ipaddress.IPv4Network:
    """The first candidate that overlaps none of ``taken``."""
    taken = list(taken)
    tried = []
    for net in candidates:
        if not any(net.overlaps(t) for t in taken):
            return net
        tried.append(str(net))
    raise LabError(
        f"no free {what} subnet: all of {', '.join(tried[:4])}... overlap subnets in use "
        f"({', '.join(map(str, taken[:6]))}); remove unused labs with `deploybench lab down --name ...`"
    )


def host_address(net: ipaddress.IPv4Network) -> str:
    """The controller's address on the lab bridge (.1)."""
    return str(net.network_address + 1)


def node_address(net: ipaddress.IPv4Network, index: int) -> str:
    """Node ``index`` (1-based) gets .11, .12, ..."""
    return str(net.network_address + FIRST_HOST - 1 + index)
