"""The ``star`` strategy: rsync over SSH from the source to every node — the seeds' method.

Kept as the baseline the benchmark compares with, and as the fallback that needs no relay
on the targets (only rsync and sha256sum). A node receives into its staging folder (rsync
``--partial`` resumes an interrupted file), is checked with ``sha256sum -c`` — a second read
of what was written, the cost of this baseline — and renamed into place only when every
file matched. A node already holding a verified copy of the manifest is skipped.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
from concurrent.futures import ThreadPoolExecutor

from deploybench.config import FanoutSpec, Policy
from deploybench.errors import DeploybenchError, StageFailed
from deploybench.fanout.relay import old_name
from deploybench.fanout.relay_control import Relays
from deploybench.fanout.result import FanoutResult, NodeCopy
from deploybench.inventory import Inventory, Node, TransportKind
from deploybench.manifest import MANIFEST_NAME, FileEntry, Manifest
from deploybench.transport import Cluster

log = logging.getLogger(__name__)


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
    # "--" ends the options: no operand is read as one (the inventory's values are validated too)
    argv = ["rsync", "-a", "--delete", "--partial", "--inplace", f"--exclude={MANIFEST_NAME}", "--",
            f"{src_dir.rstrip('/')}/"]
    if inv.transport is TransportKind.LOCAL:
        return argv + [f"{dst_dir.rstrip('/')}/"]
    ssh = shlex.join(cluster.ssh_command())
    return argv[:1] + ["-e", ssh] + argv[1:] + [f"{inv.ssh.user}@{dst.data_address}:{dst_dir.rstrip('/')}/"]


# -- the stage -------------------------------------------------------------------------------
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


def free_bytes(cluster: Cluster, node: Node) -> int:
    root = shlex.quote(cluster.inventory.model_root_of(node))
    res = cluster[node].run(f"mkdir -p {root} && df -PB1 {root} | awk 'NR==2{{print $4}}'", timeout=30).check()
    return int(res.stdout.strip() or 0)


def copy_to(cluster: Cluster, source: Node, node: Node, model: str, manifest: Manifest, t_stage: float) -> NodeCopy:
    inv: Inventory = cluster.inventory
    final = f"{inv.model_root_of(node).rstrip('/')}/{model}"
    staging = f"{inv.model_root_of(node).rstrip('/')}/.staging/{model}"
    src_dir = f"{inv.model_root_of(source).rstrip('/')}/{model}"
    t0 = time.monotonic()
    copy = NodeCopy(node.name, "failed", started_at=t0 - t_stage, strategy="star", attempts=1,
                    upstream=[source.name])
    try:
        cluster[node].run(["mkdir", "-p", staging], timeout=30).check()
        cluster[source].run(rsync_argv(cluster, src_dir, node, staging), timeout=3600).check()
        check = cluster[node].run(
            f"cd {shlex.quote(staging)} && sha256sum -c --quiet --strict -", stdin=checklist(manifest), timeout=3600
        )
        if not check.ok:
            bad = (check.stdout + check.stderr).strip().splitlines()[:5]
            raise StageFailed(f"node {node.name}: copy does not match the manifest: {'; '.join(bad)}")
        # Publish: the verified staging folder, with the manifest, replaces the old copy by renames.
        cluster[node].run(f"cat > {shlex.quote(staging + '/' + MANIFEST_NAME)}", stdin=manifest.to_json().encode(),
                          timeout=30).check()
        q_final, q_staging, q_old = shlex.quote(final), shlex.quote(staging), shlex.quote(old_name(final))
        cluster[node].run(
            f"rm -rf -- {q_old} && if [ -e {q_final} ]; then mv -T -- {q_final} {q_old}; fi && "
            f"mv -T -- {q_staging} {q_final} && rm -rf -- {q_old}",
            timeout=300,
        ).check()
        published = cluster[node].run(["cat", f"{final}/{MANIFEST_NAME}"], timeout=30)
        if not published.ok or json.loads(published.stdout or "{}").get("digest") != manifest.digest:
            raise StageFailed(
                f"node {node.name}: {final} does not hold manifest {manifest.digest[:12]} after publishing"
            )
        copy.status, copy.verified, copy.bytes = "copied", True, manifest.total_bytes
    except DeploybenchError as exc:
        copy.error = str(exc)
        log.error("fanout to %s failed: %s", node.name, exc)
    finally:
        copy.seconds = time.monotonic() - t0
    return copy


def run_star(cluster: Cluster, names: list[str], source: str, model: str, spec: FanoutSpec,
             policy: Policy = Policy.ABORT, min_nodes: int = 1) -> FanoutResult:
    """Copy ``model`` from ``source`` to every node of ``names`` with rsync, ``spec.parallel`` at a time."""
    from deploybench.fanout.stage import source_manifest

    t0 = time.monotonic()
    inv = cluster.inventory
    src = inv.node(source)
    relays = Relays(cluster, model, spec)
    manifest, hashed = source_manifest(relays, source, relays.final(source))
    result = FanoutResult(model, manifest.digest, manifest.total_bytes,
                          [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files],
                          source, "star", source_hashed_bytes=hashed, rounds=1)
    result.nodes.append(NodeCopy(source, "source", verified=True, strategy="star"))
    targets = [inv.node(n) for n in names if n != source]
    held = {}
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(targets)))) as pool:
        for n, ok in zip(targets, pool.map(lambda n: holds_verified_copy(cluster, n, relays.final(n.name), manifest),
                                           targets)):
            held[n.name] = ok
        spaces = dict(zip([n.name for n in targets], pool.map(lambda n: free_bytes(cluster, n), targets)))
    short = {n: f for n, f in spaces.items() if not held[n] and f < manifest.total_bytes}
    if short:
        raise StageFailed("fanout: not enough free space, nothing was copied: " + "; ".join(
            f"{n}: {f / 2**30:.2f} GiB free under {inv.model_root_of(n)}, the model needs "
            f"{manifest.total_bytes / 2**30:.2f} GiB" for n, f in short.items()), result.to_dict())
    todo = [n for n in targets if not held[n.name]]
    result.nodes += [NodeCopy(n, "skipped", verified=True, strategy="star") for n, ok in held.items() if ok]
    with ThreadPoolExecutor(max_workers=spec.parallel) as pool:
        result.nodes.extend(pool.map(lambda n: copy_to(cluster, src, n, model, manifest, t0), todo))
    order = {n: i for i, n in enumerate(names)}
    result.nodes.sort(key=lambda c: order.get(c.node, -1) if c.node != source else -1)
    result.seconds = time.monotonic() - t0
    failed = [c for c in result.nodes if not c.verified]
    for c in result.nodes:
        log.info(
            "fanout %s: %s %.1f MiB in %.1f s (%.0f Mbit/s)",
            c.node,
            c.status,
            c.bytes / 2**20,
            c.seconds,
            c.mbit_s,
        )
    if failed and (policy is Policy.ABORT or len(result.verified_nodes) < min_nodes):
        raise StageFailed("fanout: " + "; ".join(f"{c.node}: {c.error}" for c in failed), result.to_dict())
    return result
