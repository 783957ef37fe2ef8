"""The cluster inventory: which nodes exist, how to reach them, what their links are worth.

An inventory is a JSON file. The lab writes one for the cluster it builds; for a real
cluster a person writes it (see README). The DAG only ever reads an inventory, so the
same DAG runs against the lab and against real GPU servers.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deploybench.errors import ConfigError


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

    user: str = "root"
    port: int = Field(22, ge=1, le=65535)
    key_file: str | None = None
    known_hosts: str | None = None
    conn_id: str | None = None
    connect_timeout_s: float = Field(10.0, gt=0)


class Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    address: str
    backend_address: str | None = None
    link_mbit: float = Field(gt=0, description="nominal link speed in Mbit/s")
    model_root: str | None = Field(None, description="overrides the inventory's model_root for this node")
    labels: dict[str, str] = Field(default_factory=dict)
    k8s_node: str | None = Field(None, description="the Kubernetes node name (kubernetes.io/hostname); default = name")

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
    # Where engine logs and pid files go on each node.
    run_root: str = "/var/tmp/deploybench"
    controller_address: str | None = None
    lab: dict[str, Any] | None = Field(None, description="set by the lab: its name and mode")
    nodes: list[Node]

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
    def _ssh_needs_hostkeys(self) -> "Inventory":
        if self.transport is TransportKind.SSH and not (self.ssh.known_hosts or self.ssh.conn_id):
            raise ValueError(
                "ssh.known_hosts is required for the ssh transport (host keys are always verified); "
                "set it to a known_hosts file or name an Airflow connection in ssh.conn_id"
            )
        return self

    # -- lookups -----------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise ConfigError(f"node {name!r} is not in inventory {self.name!r} (nodes: {', '.join(self.names)})")

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def model_root_of(self, node: Node | str) -> str:
        n = self.node(node) if isinstance(node, str) else node
        return n.model_root or self.model_root

    def subset(self, names: list[str]) -> "Inventory":
        """The same inventory restricted to ``names`` (in that order)."""
        return self.model_copy(update={"nodes": [self.node(n) for n in names]})

    # -- files -------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "Inventory":
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"inventory {str(p)!r} does not exist; start the lab with `deploybench lab up` "
                "(it writes one) or pass the path of your cluster's inventory file"
            )
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"inventory {str(p)!r} is not valid JSON: {exc}") from exc
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"inventory {str(p)!r} is invalid:\n{exc}") from exc

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2, exclude_none=True) + "\n")
        tmp.replace(p)
        return p
