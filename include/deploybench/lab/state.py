"""What a lab is, on disk: its state file, its folders, and the inventory it hands to the pipeline.

``lab.json`` is written before anything is built, so ``down`` knows what to remove even
after ``up`` died half-way; ``inventory.json`` is written last, when every node answers.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import sys
from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from deploybench import paths
from deploybench.inventory import Inventory, LoadGen, Node, SSHSettings, TransportKind
from deploybench.lab.naming import host_address, loadgen_name, node_address, node_name

# Netns nodes see their own model root and run folder at these shared paths (bind mounts).
SHARED_ROOT = Path("/srv/deploybench")
KEYS = "keys"  # kept by `down` so host keys (and any known_hosts copied elsewhere) survive a rebuild


class Mode(str, Enum):
    NETNS = "netns"
    LOOPBACK = "loopback"
    AUTO = "auto"


class LabState(BaseModel):
    """Everything ``down``, ``status`` and fault injection need to find a lab's parts."""

    model_config = ConfigDict(extra="forbid")

    name: str
    mode: Mode
    subnet: str
    node_count: int
    link_mbit: float
    model_name: str
    model_mb: float
    loadgen_count: int = 0  # load-generator machines, after the nodes (their addresses follow the nodes')
    link_note: str | None = None  # how ``up`` chose link_mbit when it measured the host (lab.capacity); None: asked
    prometheus: str | None = None  # the lab's Prometheus (netns mode, when installed): its URL; None: none runs

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.subnet)

    @property
    def nodes(self) -> list[str]:
        return [node_name(i) for i in range(1, self.node_count + 1)]

    @property
    def loadgens(self) -> list[str]:
        return [loadgen_name(i) for i in range(1, self.loadgen_count + 1)]

    @property
    def machines(self) -> list[str]:
        """Nodes, then load generators: each gets a namespace, an sshd and the address of its index."""
        return [*self.nodes, *self.loadgens]

    def index(self, node: str) -> int:
        from deploybench.errors import LabError

        if node not in self.machines:
            raise LabError(f"lab {self.name} has no node {node!r} (nodes: {self.nodes[0]}..{self.nodes[-1]}"
                           + (f", load generators {self.loadgens[0]}..{self.loadgens[-1]})" if self.loadgens else ")"))
        return self.machines.index(node) + 1

    def address(self, node: str) -> str:
        return node_address(self.network, self.index(node))


class LabFiles:
    """The folders and files of lab ``name`` under paths.lab_dir(name)."""

    def __init__(self, name: str):
        self.name = name
        self.root = paths.lab_dir(name)

    @property
    def state(self) -> Path:
        return self.root / "lab.json"

    @property
    def inventory(self) -> Path:
        return self.root / "inventory.json"

    @property
    def bin(self) -> Path:
        """Stand-ins for programs the nodes lack, on their PATH (deploybench.sim.stand_in.STAND_INS)."""
        return self.root / "bin"

    @property
    def keys(self) -> Path:
        return self.root / KEYS

    @property
    def user_key(self) -> Path:
        return self.root / KEYS / "id_ed25519"

    @property
    def authorized_keys(self) -> Path:
        return self.root / "authorized_keys"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def shared_root(self) -> Path:
        return SHARED_ROOT / self.name

    @property
    def shared_models(self) -> Path:
        return SHARED_ROOT / self.name / "models"

    @property
    def shared_run(self) -> Path:
        return SHARED_ROOT / self.name / "run"

    @property
    def prometheus(self) -> Path:
        """The lab's Prometheus: its config, its data (prometheus/data) and its log."""
        return self.root / "prometheus"

    def host_key(self, node: str) -> Path:
        return self.keys / f"host_{node}"

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def models(self, node: str) -> Path:
        """The node's model root as the controller sees it."""
        return self.node_dir(node) / "models"

    def run(self, node: str) -> Path:
        return self.node_dir(node) / "run"

    def read_state(self) -> LabState | None:
        try:
            return LabState.model_validate_json(self.state.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def write_state(self, state: LabState) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.state.with_suffix(".tmp")
        tmp.write_text(state.model_dump_json(indent=2) + "\n")
        tmp.replace(self.state)

    def remove(self, keep_keys: bool = True) -> None:
        if not self.root.exists():
            return
        for child in self.root.iterdir():
            if keep_keys and child.name == KEYS:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        if not keep_keys or not self.keys.exists():
            try:
                self.root.rmdir()
            except OSError:
                pass


def other_lab_subnets(name: str) -> list[ipaddress.IPv4Network]:
    """Subnets recorded by the other labs of this DEPLOYBENCH_HOME (running or not)."""
    nets = []
    for state_file in (paths.home() / "lab").glob("*/lab.json"):
        if state_file.parent.name == name:
            continue
        try:
            nets.append(ipaddress.IPv4Network(json.loads(state_file.read_text())["subnet"]))
        except (OSError, ValueError, KeyError):
            continue
    return nets


def build_inventory(state: LabState, files: LabFiles) -> Inventory:
    """The inventory the pipeline reads: same shape for both modes, only the transport differs."""
    net = state.network
    common = {
        "name": f"lab-{state.name}",
        "python": sys.executable,
        "lab": {"name": state.name, "mode": state.mode.value, "subnet": state.subnet, "dir": str(files.root),
                **({"prometheus": state.prometheus} if state.prometheus else {})},
    }
    if state.mode is Mode.NETNS:
        nodes = [Node(name=n, address=state.address(n), link_mbit=state.link_mbit) for n in state.nodes]
        return Inventory(
            loadgens=[LoadGen(name=g, address=state.address(g)) for g in state.loadgens],
            **common,
            transport=TransportKind.SSH,
            ssh=SSHSettings(user="root", port=22, key_file=str(files.user_key), known_hosts=str(files.known_hosts)),
            model_root=str(files.shared_models),
            run_root=str(files.shared_run),
            controller_address=host_address(net),
            nodes=nodes,
        )
    nodes = [
        Node(name=n, address=state.address(n), link_mbit=state.link_mbit, model_root=str(files.models(n)))
        for n in state.nodes
    ]
    # Every node has its own model root; the run root is shared, and the pipeline keeps each
    # node's pid and log files under <run_root>/<node>, as on a real cluster.
    return Inventory(
        **common,
        loadgens=[LoadGen(name=g, address=state.address(g)) for g in state.loadgens],
        transport=TransportKind.LOCAL,
        model_root=str(files.root / "nodes" / "{node}" / "models"),
        run_root=str(files.root / "run"),
        controller_address="127.0.0.1",
        nodes=nodes,
    )
