"""Model fan-out: every node ends up with a verified copy of the model, published atomically.

This first strategy is ``star``: rsync over SSH from the source node to each node,
several at once. A node writes into a staging folder, checks every file's sha256
against the source's manifest and only then renames the folder into place, so an
engine never sees a partial model. A node that already holds a verified copy of the
same manifest is skipped, so a re-run moves no bytes.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from deploybench.config import FanoutSpec
from deploybench.errors import DeploybenchError, StageFailed
from deploybench.inventory import Inventory, Node, TransportKind
from deploybench.manifest import MANIFEST_NAME, FileEntry, Manifest
from deploybench.transport import Cluster

log = logging.getLogger(__name__)


@dataclass
class NodeCopy:
    node: str
    status: str  # "copied" | "skipped" (already verified) | "source" | "failed"
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    error: str | None = None
    started_at: float = 0.0  # seconds after the stage began (for the timeline)

    @property
    def mbit_s(self) -> float:
        return self.bytes * 8 / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass
class FanoutResult:
    model: str
    manifest_digest: str
    total_bytes: int
    files: list[dict]
    source: str
    strategy: str
    nodes: list[NodeCopy] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verified_nodes(self) -> list[str]:
        return [c.node for c in self.nodes if c.verified]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verified_nodes"] = self.verified_nodes
        return d


# -- pure parts ------------------------------------------------------------------------------
def manifest_script(model_dir: str) -> str:
    """Print ``<size> <sha256> <path>`` for every file of ``model_dir`` (the manifest file excluded)."""
    d = shlex.quote(model_dir)
    return (
        f"cd {d} && find . -type f ! -name {shlex.quote(MANIFEST_NAME)} ! -name '*.tmp' -print0 | sort -z | "
        "xargs -0 -r sh -c 'for f; do printf \"%s %s %s\\n\" $(stat -c %s \"$f\") "
        "$(sha256sum \"$f\" | cut -d\" \" -f1) \"${f#./}\"; done' _"
    )


def parse_manifest_listing(text: str) -> Manifest:
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        size, digest, path = line.split(" ", 2)
        entries.append(FileEntry(path, int(size), digest))
    return Manifest(tuple(sorted(entries, key=lambda e: e.path)))


def checklist(manifest: Manifest) -> bytes:
    """The manifest as ``sha256sum -c`` input."""
    return "".join(f"{f.sha256}  {f.path}\n" for f in manifest.files).encode()


def rsync_argv(cluster: Cluster, src_dir: str, dst: Node, dst_dir: str) -> list[str]:
    """rsync from the source node's model folder into ``dst_dir`` on ``dst`` (run on the source node)."""
    inv = cluster.inventory
    argv = ["rsync", "-a", "--delete", "--partial", "--inplace", f"{src_dir.rstrip('/')}/"]
    if inv.transport is TransportKind.LOCAL:
        return argv + [f"{dst_dir.rstrip('/')}/"]
    ssh = shlex.join(cluster.ssh_command())
    return argv[:1] + ["-e", ssh] + argv[1:] + [f"{inv.ssh.user}@{dst.data_address}:{dst_dir.rstrip('/')}/"]


# -- the stage -------------------------------------------------------------------------------
def source_manifest(cluster: Cluster, source: Node, model_dir: str) -> Manifest:
    res = cluster[source].run(manifest_script(model_dir), timeout=3600)
    if not res.ok or not res.stdout.strip():
        raise StageFailed(
            f"fanout: model folder {model_dir!r} on source node {source.name} is missing or empty "
            f"({res.stderr.strip()[-200:] or 'no files'}); put the model there or choose another source_node"
        )
    m = parse_manifest_listing(res.stdout)
    cluster[source].run(
        f"cat > {shlex.quote(model_dir + '/' + MANIFEST_NAME)}", stdin=m.to_json().encode(), timeout=30
    ).check()
    return m


def holds_verified_copy(cluster: Cluster, node: Node, model_dir: str, manifest: Manifest) -> bool:
    """True when ``node`` already has this exact manifest published and every file matches."""
    d = shlex.quote(model_dir)
    res = cluster[node].run(f"cat {d}/{shlex.quote(MANIFEST_NAME)} 2>/dev/null", timeout=30)
    if not res.ok or not res.stdout.strip():
        return False
    try:
        if json.loads(res.stdout).get("digest") != manifest.digest:
            return False
    except ValueError:
        return False
    check = cluster[node].run(f"cd {d} && sha256sum -c --quiet --strict -", stdin=checklist(manifest), timeout=3600)
    return check.ok


def copy_to(cluster: Cluster, source: Node, node: Node, model: str, manifest: Manifest, t_stage: float) -> NodeCopy:
    inv: Inventory = cluster.inventory
    final = f"{inv.model_root_of(node).rstrip('/')}/{model}"
    staging = f"{inv.model_root_of(node).rstrip('/')}/.staging/{model}"
    src_dir = f"{inv.model_root_of(source).rstrip('/')}/{model}"
    t0 = time.monotonic()
    copy = NodeCopy(node.name, "failed", started_at=t0 - t_stage)
    try:
        if holds_verified_copy(cluster, node, final, manifest):
            copy.status, copy.verified = "skipped", True
            return copy
        cluster[node].run(["mkdir", "-p", staging], timeout=30).check()
        cluster[source].run(rsync_argv(cluster, src_dir, node, staging), timeout=3600).check()
        check = cluster[node].run(
            f"cd {shlex.quote(staging)} && sha256sum -c --quiet --strict -", stdin=checklist(manifest), timeout=3600
        )
        if not check.ok:
            bad = (check.stdout + check.stderr).strip().splitlines()[:5]
            raise StageFailed(f"node {node.name}: copy does not match the manifest: {'; '.join(bad)}")
        # Publish: the verified staging folder replaces the old copy in one rename.
        q_final, q_staging, q_old = shlex.quote(final), shlex.quote(staging), shlex.quote(final + ".old")
        cluster[node].run(
            f"rm -rf {q_old} && if [ -e {q_final} ]; then mv {q_final} {q_old}; fi && "
            f"mv {q_staging} {q_final} && rm -rf {q_old}",
            timeout=300,
        ).check()
        published = cluster[node].run(["cat", f"{final}/{MANIFEST_NAME}"], timeout=30)
        if not published.ok or json.loads(published.stdout or "{}").get("digest") != manifest.digest:
            raise StageFailed(f"node {node.name}: {final} does not hold manifest {manifest.digest[:12]} after publishing")
        copy.status, copy.verified, copy.bytes = "copied", True, manifest.total_bytes
    except DeploybenchError as exc:
        copy.error = str(exc)
        log.error("fanout to %s failed: %s", node.name, exc)
    finally:
        copy.seconds = time.monotonic() - t0
    return copy


def run(cluster: Cluster, names: list[str], source: str, model: str, spec: FanoutSpec) -> FanoutResult:
    """Copy ``model`` from ``source`` to every node of ``names``; raise StageFailed if any node fails."""
    t0 = time.monotonic()
    inv = cluster.inventory
    src = inv.node(source)
    src_dir = f"{inv.model_root_of(src).rstrip('/')}/{model}"
    manifest = source_manifest(cluster, src, src_dir)
    log.info("fanout: %s is %d files, %.1f MiB, manifest %s", model, len(manifest.files),
             manifest.total_bytes / 2**20, manifest.digest[:12])
    result = FanoutResult(model, manifest.digest, manifest.total_bytes, [asdict(f) for f in manifest.files],
                          source, "star")
    result.nodes.append(NodeCopy(source, "source", verified=True))
    targets = [inv.node(n) for n in names if n != source]
    with ThreadPoolExecutor(max_workers=spec.parallel) as pool:
        result.nodes.extend(pool.map(lambda n: copy_to(cluster, src, n, model, manifest, t0), targets))
    result.seconds = time.monotonic() - t0
    failed = [c for c in result.nodes if not c.verified]
    for c in result.nodes:
        log.info("fanout %s: %s %.1f MiB in %.1f s (%.0f Mbit/s)", c.node, c.status, c.bytes / 2**20, c.seconds, c.mbit_s)
    if failed:
        raise StageFailed(
            "fanout: " + "; ".join(f"{c.node}: {c.error}" for c in failed), result.to_dict()
        )
    return result
