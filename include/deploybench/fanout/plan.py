"""Pure planning: what each node still needs, who feeds whom, which bytes go on the wire.

Nothing here touches a node, so routing around failures and resuming are tested without
a cluster.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from deploybench.manifest import Manifest


@dataclass
class NodeState:
    """What ``relay inspect`` found on a node."""

    name: str
    published: bool = False  # holds this manifest, every file verified
    bad: list[str] = field(default_factory=list)  # files of its published copy that no longer match
    staged: dict[str, str | int] = field(default_factory=dict)  # path -> "ok" | bytes already staged
    free_bytes: int = 0

    @classmethod
    def from_inspect(cls, name: str, data: dict[str, Any]) -> NodeState:
        return cls(name, bool(data.get("published")), list(data.get("bad") or []), dict(data.get("staged") or {}),
                   int(data.get("free_bytes") or 0))

    @property
    def complete(self) -> bool:
        return self.published

    def needs(self, manifest: Manifest) -> dict[str, int]:
        """Files this node lacks -> bytes of each already staged (where a resumed transfer starts)."""
        if self.published:
            return {}
        out = {}
        for f in manifest.files:
            have = self.staged.get(f.path)
            if have != "ok":
                out[f.path] = min(int(have or 0), f.size)
        return out

    def bytes_needed(self, manifest: Manifest) -> int:
        sizes = {f.path: f.size for f in manifest.files}
        return sum(sizes[p] - done for p, done in self.needs(manifest).items())


def header_files(manifest: Manifest, receivers: list[NodeState]) -> list[dict[str, Any]]:
    """The files a stream carries to ``receivers``: each file some receiver lacks, from the smallest
    offset any of them already holds (the others re-hash their longer prefix and drop the rest)."""
    out = []
    needs = [r.needs(manifest) for r in receivers]
    for f in manifest.files:
        offsets = [n[f.path] for n in needs if f.path in n]
        if offsets:
            out.append({"path": f.path, "size": f.size, "sha256": f.sha256, "offset": min(offsets)})
    return out


def chain_paths(order: list[str], verified: set[str], pending: list[str],
                repair_only: AbstractSet[str] = frozenset()) -> list[list[str]]:
    """Paths ``[feeder, node, node, ...]`` for one chain round.

    Nodes in ``repair_only`` (those that only need a few files of an otherwise verified copy, and
    those whose relay did not start last time, so that they hold up nobody behind them) get a
    one-hop path from their nearest verified neighbour; the others form one chain, in ``order``, fed by the
    nearest verified node before the first of them (the source on a first run; after a
    failure, the node just upstream of the gap, so the chain routes around a dead node).
    """
    paths = [[neighbour(order, verified, n), n] for n in order if n in repair_only and n in pending]
    rest = [n for n in order if n in pending and n not in repair_only]
    if rest:
        paths.append([neighbour(order, verified, rest[0]), *rest])
    return paths


def neighbour(order: list[str], verified: set[str], node: str) -> str:
    """The nearest verified node before ``node`` in ``order`` (wrapping round); order[0] is the source."""
    i = order.index(node)
    for k in range(1, len(order)):
        cand = order[(i - k) % len(order)]
        if cand in verified:
            return cand
    return order[0]


def tree_paths(holders: list[str], pending: list[str]) -> list[list[str]]:
    """One doubling round: every node that holds the model feeds one node that does not."""
    return [[h, n] for h, n in zip(holders, pending)]
