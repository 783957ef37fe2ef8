"""The cluster inventory: which nodes exist, how to reach them, what their links are worth.

An inventory is a JSON file. The lab writes one for the cluster it builds; for a real
cluster a person writes it (see README). The DAG only ever reads an inventory, so the
same DAG runs against the lab and against real GPU servers.

A run names its inventory (``inventory: demo``); the name is looked up in the inventory
folders (``$DEPLOYBENCH_INVENTORIES``, ``:``-separated; default the lab's folder,
``<home>/lab``): ``<folder>/<name>.json`` or ``<folder>/<name>/inventory.json`` (what
``deploybench lab up <name>`` writes). A path is accepted only inside those folders, so a
person who can trigger a run cannot point it at an arbitrary file.

Every value that reaches a command line is checked here: host names and addresses, the SSH
user, folders and the Python command may not look like an option (``-oProxyCommand=...``) nor
hold a control character. An invalid inventory's error names the fields, never their values
(an inventory may hold secrets).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args, overload

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deploybench import paths
from deploybench.errors import ConfigError

INVENTORIES_ENV = "DEPLOYBENCH_INVENTORIES"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
_HOST = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$"
)
USER_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@overload
def check_host(value: str) -> str: ...
@overload
def check_host(value: None) -> None: ...
def check_host(value: str | None) -> str | None:
    """A host name (RFC 1123 labels) or an IPv4/IPv6 address; anything else (``-oProxyCommand=x``, a space, a
    shell character) could be read as an option or a second argument by ssh, rsync or iperf3."""
    if value is None:
        return None
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    if not _HOST.match(value):
        raise ValueError(f"{value[:80]!r} is not a host name or an IP address (letters, digits, '-' and '.', "
                         "not starting with '-')")
    return value


@overload
def check_path(value: str, absolute: bool = True) -> str: ...
@overload
def check_path(value: None, absolute: bool = True) -> None: ...
def check_path(value: str | None, absolute: bool = True) -> str | None:
    """A folder or file on a node: absolute (or, for a command, not starting with '-'), no control character,
    no '..' part."""
    if value is None:
        return None
    if _CONTROL.search(value):
        raise ValueError("a control character is not allowed in a path")
    if absolute and not value.startswith("/"):
        raise ValueError(f"{value[:120]!r} must be an absolute path")
    if value.startswith("-"):
        raise ValueError(f"{value[:120]!r} may not start with '-' (it would be read as an option)")
    if ".." in value.split("/"):
        raise ValueError(f"{value[:120]!r} may not hold a '..' part")
    return value


class TransportKind(str, Enum):
    """How commands reach nodes: ``ssh`` for real nodes and the netns lab, ``local`` for the loopback lab."""

    SSH = "ssh"
    LOCAL = "local"


class SSHSettings(BaseModel):
    """SSH access to every node. Host keys are always verified against ``known_hosts``.

    ``conn_id`` names an Airflow SSH connection whose login/key/host-key extras take
    precedence inside Airflow tasks; the other fields serve the CLI and the lab.
    """

    model_config = ConfigDict(extra="forbid")

    user: str = Field("root", pattern=USER_PATTERN)
    port: int = Field(22, ge=1, le=65535)
    key_file: str | None = None
    known_hosts: str | None = None
    conn_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,250}$")
    connect_timeout_s: float = Field(10.0, gt=0)

    @field_validator("key_file", "known_hosts")
    @classmethod
    def _file(cls, v: str | None) -> str | None:
        return check_path(v, absolute=False)


_CURRENCY = re.compile(r"^[A-Z]{3}$")


class Price(BaseModel):
    """What one node costs per hour of use, in a currency (ISO 4217 code): the base of the cost per million output
    tokens of each load phase (deploybench.load.cost). Optional: without it the cost is absent, never 0."""

    model_config = ConfigDict(extra="forbid")

    per_node_hour: float = Field(description="price of one node for one hour, >= 0")
    currency: str = Field(description="ISO 4217 code, e.g. USD, EUR")

    @field_validator("per_node_hour", mode="before")
    @classmethod
    def _amount(cls, v: Any) -> float:
        # a JSON number only: "2.5" (a string), true (a bool), NaN or Infinity (which Python's json reads) are refused
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise ValueError(f"price per node-hour {repr(v)[:80]} is not a number >= 0; write the price of one node "
                             'for one hour as a JSON number, e.g. {"per_node_hour": 2.5, "currency": "USD"}')
        return float(v)

    @field_validator("currency", mode="before")
    @classmethod
    def _currency(cls, v: Any) -> str:
        if not isinstance(v, str) or not _CURRENCY.match(v):
            raise ValueError(f"currency {repr(v)[:40]} is not a currency code; write its three capital letters "
                             "(ISO 4217), e.g. USD or EUR")
        return v


# The simulated engine's faults an operator may put on a node (deploybench.sim.faults)
SimFault = Literal["throttle", "leak", "small_kv", "no_batching", "errors", "drift"]
FAULTS: tuple[str, ...] = get_args(SimFault)


class Machine(BaseModel):
    """What every machine of an inventory has: a name and the address its transport reaches it at."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    address: str

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return check_host(v)


class LoadGen(Machine):
    """A load-generator machine: it serves nothing, it runs k6 for its execution segment of each load phase
    (deploybench.load.loadgen). Reached through the run's transport exactly as nodes are."""

    k6: str = Field("k6", description="the k6 command on the machine (on its PATH, or a path)")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("k6")
    @classmethod
    def _k6(cls, v: str) -> str:
        return check_path(v, absolute=False)


class Node(Machine):
    backend_address: str | None = None
    link_mbit: float = Field(gt=0, description="nominal link speed in Mbit/s")
    mtu: int | None = Field(None, ge=68, le=65536, description="the tested interface's MTU; preflight checks it")
    rdma_device: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                                    description="the RDMA device (e.g. mlx5_0) for preflight's RDMA test; "
                                                "default: the node's first one")
    model_root: str | None = Field(None, description="overrides the inventory's model_root for this node")
    labels: dict[str, str] = Field(default_factory=dict)
    k8s_node: str | None = Field(None, description="the Kubernetes node name (kubernetes.io/hostname); default = name")
    price: Price | None = Field(None, description="overrides the inventory's price for this node")
    sim_fault: SimFault | None = Field(None, description="a fault of the simulated engine on this node only "
                                                         "(deploybench.sim.faults: lab runs and the diagnosis "
                                                         "benchmark); the operator's, never the trigger form's")
    sim_dcgm: bool = Field(True, description="the simulated engine on this node exports DCGM's gauges on its /metrics; "
                                             "false: a node without DCGM, whose GPU only nvidia-smi reads (the lab's "
                                             "nvidia-smi stand-in, deploybench.sim.nvidia_smi); the operator's")

    @field_validator("backend_address", "k8s_node")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return check_host(v)

    @field_validator("model_root")
    @classmethod
    def _root(cls, v: str | None) -> str | None:
        return check_path(v)

    @property
    def kubernetes_name(self) -> str:
        """The name the kubernetes backend pins pods to (node affinity on kubernetes.io/hostname)."""
        return self.k8s_node or self.name

    @property
    def data_address(self) -> str:
        """The address for bulk traffic (iperf3, model copies): the backend network when there is one."""
        return self.backend_address or self.address


class Inventory(BaseModel):
    """Nodes plus the settings shared by all of them."""

    model_config = ConfigDict(extra="forbid")

    name: str
    transport: TransportKind = TransportKind.SSH
    ssh: SSHSettings = Field(default_factory=SSHSettings)
    model_root: str = "/srv/deploybench/models"
    # The command that runs Python on a node (the simulated engine needs it); the lab
    # sets it to the controller's venv, which every lab node sees.
    python: str = "python3"
    # Where engine logs, pid files and the relay program go on each node: the deploy user's own
    # folder, checked before use (transport.Cluster.run_dir). Not under a world-writable folder
    # such as /var/tmp, where another user could create it first.
    run_root: str = "/var/lib/deploybench/run"
    controller_address: str | None = None
    lab: dict[str, Any] | None = Field(None, description="set by the lab: its name and mode")
    # the price of a node-hour, for every node without its own (optional: the cost per token is absent without it)
    price: Price | None = None
    nodes: list[Node]
    # load-generator machines: with none, the controller alone offers each load phase
    loadgens: list[LoadGen] = Field(default_factory=list)

    @field_validator("controller_address")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        return check_host(v)

    @field_validator("model_root", "run_root")
    @classmethod
    def _root(cls, v: str) -> str:
        return check_path(v)

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        return check_path(v, absolute=False)

    @field_validator("nodes")
    @classmethod
    def _unique(cls, nodes: list[Node]) -> list[Node]:
        if not nodes:
            raise ValueError("an inventory needs at least one node")
        seen: set[str] = set()
        for n in nodes:
            if n.name in seen:
                raise ValueError(f"node name {n.name!r} appears twice")
            seen.add(n.name)
        return nodes

    @model_validator(mode="after")
    def _unique_machines(self) -> Inventory:
        seen = {n.name for n in self.nodes}
        for g in self.loadgens:
            if g.name in seen:
                raise ValueError(f"load generator name {g.name!r} appears twice or is also a node's name")
            seen.add(g.name)
        return self

    @model_validator(mode="after")
    def _ssh_needs_hostkeys(self) -> Inventory:
        if self.transport is TransportKind.SSH and not (self.ssh.known_hosts or self.ssh.conn_id):
            raise ValueError(
                "ssh.known_hosts is required for the ssh transport (host keys are always verified); "
                "set it to a known_hosts file or name an Airflow connection in ssh.conn_id"
            )
        return self

    @model_validator(mode="after")
    def _one_currency(self) -> Inventory:
        # the cost of a phase sums its nodes' prices: they must be in one currency
        priced = [("price", self.price), *((f"node {n.name}", n.price) for n in self.nodes)]
        seen = {p.currency: where for where, p in priced if p is not None}
        if len(seen) > 1:
            listed = ", ".join(f"{c} ({w})" for c, w in seen.items())
            raise ValueError(f"prices in more than one currency: {listed}; a phase's cost adds its nodes' prices, so "
                             "give every price in one currency")
        return self

    def price_of(self, node: Node | str) -> Price | None:
        """The node's price per hour: its own, else the inventory's; None when neither is set."""
        n = self.node(node) if isinstance(node, str) else node
        return n.price or self.price

    # -- lookups -----------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"node {name!r} is not in inventory {self.name!r} (nodes: {', '.join(self.names)})")

    def machine(self, name: str) -> Node | LoadGen:
        """A node or a load generator, by name (what a transport connects to)."""
        machines: list[Node | LoadGen] = [*self.nodes, *self.loadgens]
        for m in machines:
            if m.name == name:
                return m
        raise ConfigError(f"{name!r} is neither a node nor a load generator of inventory {self.name!r} (nodes: "
                          f"{', '.join(self.names)}; load generators: {', '.join(self.loadgen_names) or 'none'})")

    @property
    def loadgen_names(self) -> list[str]:
        return [g.name for g in self.loadgens]

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def model_root_of(self, node: Node | str) -> str:
        n = self.node(node) if isinstance(node, str) else node
        return n.model_root or self.model_root

    def subset(self, names: list[str]) -> Inventory:
        """The same inventory restricted to ``names`` (in that order)."""
        return self.model_copy(update={"nodes": [self.node(n) for n in names]})

    # -- files -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> Inventory:
        """The inventory at ``path``, or, for a bare name (no ``/``), the one of that name in the inventory
        folders (``resolve``)."""
        p = resolve(path) if isinstance(path, str) and "/" not in path else Path(path)
        if not p.is_file():
            raise ConfigError(
                f"inventory {str(path)!r} does not exist (looked for {str(p)!r}); start the lab with `deploybench "
                f"lab up` (it writes one) or put your cluster's inventory in {folders_text()}"
            )
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"inventory {str(p)!r} is not valid JSON: {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"inventory {str(p)!r} is invalid:\n  {describe_errors(exc)}") from exc

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2, exclude_none=True) + "\n")
        tmp.replace(p)
        return p


def describe_errors(exc: ValidationError) -> str:
    """One line per error: the field and what is wrong, never the value that was there (an inventory may
    hold a password or a token; our own validators name non-secret values such as an address)."""
    lines = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "inventory"
        lines.append(f"{loc}: {err['msg'].removeprefix('Value error, ')}")
    return "\n  ".join(lines)


# -- where inventories are ------------------------------------------------------------------------
def folders() -> list[Path]:
    """The inventory folders: ``$DEPLOYBENCH_INVENTORIES`` (``:``-separated), else ``<home>/lab``."""
    env = os.environ.get(INVENTORIES_ENV, "")
    found = [Path(p) for p in env.split(os.pathsep) if p.strip()]
    return found or [paths.home() / "lab"]


def folders_text() -> str:
    where = ", ".join(str(f) for f in folders())
    return f"{where} (${INVENTORIES_ENV})" if os.environ.get(INVENTORIES_ENV) else f"{where} (the lab's; set " \
        f"${INVENTORIES_ENV} for your own)"


def resolve(ref: str) -> Path:
    """The file of the inventory ``ref``: a name (``<folder>/<name>.json`` or ``<folder>/<name>/inventory.json``,
    the first that exists, in folder order), or a path inside an inventory folder. ConfigError otherwise."""
    if _CONTROL.search(ref):
        raise ConfigError("inventory: a control character is not allowed; give the name of an inventory")
    if "/" not in ref:
        if not _NAME.match(ref):
            raise ConfigError(f"inventory {ref[:80]!r} is not an inventory name (letters, digits, '_', '.', '-'); "
                              f"inventories are looked up in {folders_text()}")
        candidates = [c for f in folders() for c in (f / ref / "inventory.json", f / f"{ref}.json")]
        return next((c for c in candidates if c.is_file()), candidates[0])
    p = Path(ref).resolve()
    for f in folders():
        if p.is_relative_to(f.resolve()):
            return p
    raise ConfigError(f"inventory {ref[:200]!r} is outside the inventory folders {folders_text()}; give the name "
                      "of an inventory in them (e.g. 'demo' for the lab of `deploybench lab up demo`), or add its "
                      f"folder to ${INVENTORIES_ENV}")
