"""What a fan-out reports: one NodeCopy per node, and the model artifact it copied.

The shapes are read by the report and the store (nodes[].{node,status,bytes,seconds,
verified,started_at}); fields are only ever added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from pydantic import ConfigDict

# how a stage record is read back into these classes (deploybench.records): a key they do not declare is refused
_READ = ConfigDict(extra="forbid")
# what to_dict adds beside the fields (derived: not read back)
DERIVED = ("verified_nodes", "bytes_moved")
NODE_DERIVED = ("mbit_s",)


@dataclass
class NodeCopy:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    node: str
    # "copied" | "repaired" (only bad files re-fetched) | "skipped" (already verified) | "source"
    # | "failed" | "excluded" (refused before the copy, under the exclude policy)
    status: str
    bytes: int = 0  # bytes this node wrote (its own copy; relayed bytes are not counted)
    seconds: float = 0.0
    verified: bool = False
    error: str | None = None
    started_at: float = 0.0  # seconds after the stage began (for the timeline)
    strategy: str = ""
    attempts: int = 0
    repairs: list[dict] = field(default_factory=list)  # {file, from, reason}
    resumed_bytes: int = 0  # bytes already on the node from an interrupted transfer, not sent again
    relayed_bytes: int = 0  # bytes this node received and forwarded for others
    upstream: list[str] = field(default_factory=list)  # the node it got data from, per attempt

    @property
    def mbit_s(self) -> float:
        return self.bytes * 8 / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class FanoutResult:
    __pydantic_config__: ClassVar[ConfigDict] = _READ

    model: str
    manifest_digest: str
    total_bytes: int
    files: list[dict]
    source: str
    strategy: str
    nodes: list[NodeCopy] = field(default_factory=list)
    seconds: float = 0.0
    source_hashed_bytes: int = 0  # bytes the source re-hashed for its manifest (0 when its cache was valid)
    rounds: int = 0

    @property
    def verified_nodes(self) -> list[str]:
        return [c.node for c in self.nodes if c.verified]

    @property
    def bytes_moved(self) -> int:
        return sum(c.bytes for c in self.nodes)

    def node(self, name: str) -> NodeCopy:
        return next(c for c in self.nodes if c.node == name)

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, nd in zip(self.nodes, d["nodes"]):
            nd["mbit_s"] = round(c.mbit_s, 1)
        d["verified_nodes"] = self.verified_nodes
        d["bytes_moved"] = self.bytes_moved
        return d
