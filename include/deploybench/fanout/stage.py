"""The fan-out stage: manifest at the source, refuse bad input, then copy in rounds until every node verified.

1. The source's manifest is computed by the relay with its hash cache (unchanged files are
   not read again) and compared with the manifest already in the folder, if any.
2. Every target is inspected: nodes that hold a verified copy are skipped; nodes whose
   published copy has bad files need only those; partly staged files resume; the free
   space for what is still missing is checked. Bad input stops the stage here, before a
   byte is sent. For a chain, a target found empty (a first fan-out finds them all so) has
   its relay started for the chain [source, *targets] by the same SSH command; the first
   round feeds those relays when its plan is that chain, else they are stopped first.
3. Rounds: ``chain`` streams source -> n1 -> n2 -> ... (each hop writes, hashes and
   forwards as the bytes pass); ``tree`` runs doubling rounds of one-hop streams. After a
   round every receiver is inspected again (a relay that published did it itself, on its copy, and
   says so in its status; the others over SSH); nodes still incomplete (a dead upstream, a
   file that failed its hash) go again from their nearest verified neighbour, resuming
   what they already hold, up to ``1 + retries`` attempts. Dead nodes are left out; a node whose
   relay did not start is fed alone next time, so that nobody behind it waits.
4. A node that still failed is excluded or fails the run, by the preflight policy.
"""

from __future__ import annotations

import logging
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deploybench.config import FanoutSpec, FanoutStrategy, Policy
from deploybench.errors import DeploybenchError, StageFailed
from deploybench.fanout.plan import NodeState, chain_paths, tree_paths
from deploybench.fanout.relay_control import WORKERS, Prestart, Relays
from deploybench.fanout.result import FanoutResult, NodeCopy
from deploybench.manifest import MANIFEST_NAME, FileEntry, Manifest, ManifestMismatch
from deploybench.transport import Cluster

log = logging.getLogger(__name__)


def diff_manifests(declared: Manifest, actual: Manifest, limit: int = 5) -> list[str]:
    """Human lines naming the files where ``actual`` differs from ``declared``."""
    want, have = {f.path: f for f in declared.files}, {f.path: f for f in actual.files}
    out = [f"{p}: listed in the manifest ({want[p].size} bytes) but missing" for p in sorted(set(want) - set(have))]
    out += [f"{p}: present ({have[p].size} bytes) but not in the manifest" for p in sorted(set(have) - set(want))]
    for p in sorted(set(want) & set(have)):
        w, h = want[p], have[p]
        if w.size != h.size:
            out.append(f"{p}: {h.size} bytes, the manifest says {w.size}")
        elif w.sha256 != h.sha256:
            out.append(f"{p}: sha256 {h.sha256[:16]}... , the manifest says {w.sha256[:16]}...")
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def _manifest(doc: dict[str, Any]) -> Manifest:
    """A manifest from a node's answer; ManifestMismatch for a path that could leave the model folder."""
    return Manifest(tuple(FileEntry(f["path"], f["size"], f["sha256"]) for f in doc["files"]))


def source_manifest(relays: Relays, source: str, model_dir: str) -> tuple[Manifest, int]:
    """The source folder's manifest (written into it if it had none); StageFailed on bad input."""
    out = relays.manifest(source, model_dir)
    if out.get("error") == "missing":
        raise StageFailed(f"fanout: model folder {model_dir!r} does not exist on source node {source}; put the "
                          "model there, or set source_node / model_name to where it is")
    if out.get("error") == "refused":
        more = out.get("count", 0) - len(out.get("paths") or [])
        raise StageFailed(
            f"fanout: model folder {model_dir!r} on source node {source} holds what is never copied: "
            + "; ".join(out.get("paths") or []) + (f" and {more} more" if more > 0 else "")
            + ". Nothing was sent. A symbolic link would send whatever it points to (a key, a password file) to "
              "every node: replace each link by the file itself, or remove it")
    try:
        actual = _manifest(out["manifest"])
    except (ManifestMismatch, KeyError, TypeError) as exc:
        raise StageFailed(f"fanout: the manifest of {model_dir!r} on source node {source} is refused ({exc}); "
                          "nothing was sent. Rename the file to a plain relative name") from exc
    if not actual.files:
        raise StageFailed(f"fanout: model folder {model_dir!r} on source node {source} is empty; copy the model "
                          "into it, or set source_node / model_name to where it is")
    declared = out.get("declared")
    if declared is not None:
        try:
            want = _manifest(declared)
        except (KeyError, TypeError, ValueError, ManifestMismatch) as exc:
            raise StageFailed(f"fanout: {model_dir}/{MANIFEST_NAME} on {source} is not a manifest ({exc}); remove it "
                              "to re-declare the folder as it is") from exc
        if want.digest != actual.digest:
            raise StageFailed(
                f"fanout: model folder {model_dir!r} on source node {source} does not match its manifest "
                f"{want.digest[:12]}: " + "; ".join(diff_manifests(want, actual)) +
                f". Nothing was copied. Restore the file(s), or delete {MANIFEST_NAME} to declare the folder as it is")
    else:
        relays.cluster[source].run(f"cat > {shlex.quote(model_dir + '/' + MANIFEST_NAME)}",
                                   stdin=actual.to_json().encode(), timeout=30).check()
    return actual, int(out.get("hashed_bytes") or 0)


class _Fanout:
    def __init__(self, cluster: Cluster, names: list[str], source: str, model: str, spec: FanoutSpec,
                 policy: Policy, min_nodes: int):
        self.cluster, self.inv, self.spec = cluster, cluster.inventory, spec
        self.source, self.model, self.policy, self.min_nodes = source, model, policy, min_nodes
        self.order = [source] + [n for n in names if n != source]
        self.targets = self.order[1:]
        self.relays = Relays(cluster, model, spec)
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.copies = {n: NodeCopy(n, "failed", strategy=spec.strategy.value) for n in self.targets}
        self.states: dict[str, NodeState] = {}
        self.verified = {source}
        self.failed_files: dict[str, set[str]] = {}
        self.last_problem: dict[str, str] = {}
        self.not_started: set[str] = set()  # nodes whose relay did not start: fed alone, the chain goes around them

    # -- before anything is sent -------------------------------------------------------------
    def inspect(self, nodes: list[str], manifest: Manifest) -> dict[str, str]:
        """Refresh ``states``; returns the nodes that could not be inspected, with the reason."""
        def one(n: str) -> tuple[str, NodeState | str]:
            try:
                return n, self.relays.inspect(n, manifest)
            except DeploybenchError as exc:
                return n, str(exc)

        errors = {}
        with ThreadPoolExecutor(max_workers=max(1, min(WORKERS, len(nodes)))) as pool:
            for n, st in pool.map(one, nodes):
                if isinstance(st, str):
                    errors[n] = st
                else:
                    self.states[n] = st
        return errors

    def states_from_status(self, statuses: dict[str, dict[str, Any]]) -> set[str]:
        """Take the inspection a relay put in its status (``serve`` after publishing); the nodes whose status held
        one that reads as an inspection. Text from a node: one that does not parse is inspected over SSH."""
        told = set()
        for n, st in statuses.items():
            doc = st.get("inspect")
            if not isinstance(doc, dict) or doc.get("error") is not None:
                continue
            try:
                self.states[n] = NodeState.from_inspect(n, doc)
            except (TypeError, ValueError):
                continue
            told.add(n)
        return told

    def refuse_or_exclude(self, problems: dict[str, str], what: str) -> None:
        if not problems:
            return
        lines = "\n  ".join(f"{n}: {why}" for n, why in problems.items())
        if self.policy is Policy.ABORT:
            raise StageFailed(f"fanout: {what}, nothing was copied:\n  {lines}\n(policy abort; with policy exclude "
                              f"these nodes are left out)", self.result.to_dict())
        for n, why in problems.items():
            c = self.copies[n]
            c.status, c.error = "excluded", why
        log.warning("fanout: excluding %s: %s", ", ".join(problems), lines)

    # -- rounds ------------------------------------------------------------------------------
    def pending(self) -> list[str]:
        return [n for n in self.targets if n not in self.verified and self.copies[n].status not in ("excluded",)
                and not self.copies[n].error]

    def paths(self, pending: list[str]) -> list[list[str]]:
        if self.spec.strategy is FanoutStrategy.TREE:
            holders = [n for n in self.order if n in self.verified]
            return tree_paths(holders, pending)
        repair_only = {n for n in pending if self.states[n].bad or n in self.not_started}
        return chain_paths(self.order, self.verified, pending, repair_only)

    def account(self, node: str, st: dict[str, Any], manifest: Manifest) -> None:
        c = self.copies[node]
        if st.get("not_fed"):  # another node's relay did not start: nothing was tried for this one
            log.warning("fanout: %s waits for the next round: %s", node, st.get("error"))
            return
        c.attempts += 1
        c.upstream.append(st.get("upstream_node", ""))
        if st.get("first_byte"):
            start = st["first_byte"] - self.wall0
            c.started_at = start if c.attempts == 1 or not c.seconds else min(c.started_at, start)
        if st.get("finished") and st.get("first_byte"):
            c.seconds = max(c.seconds, st["finished"] - self.wall0 - c.started_at)
        c.bytes += int(st.get("bytes_written") or 0)
        c.relayed_bytes += max(0, int(st.get("bytes_received") or 0) - int(st.get("bytes_written") or 0))
        c.resumed_bytes += int(st.get("resumed_bytes") or 0)
        feeder = st.get("upstream_node", "")
        for f in st.get("files_ok") or []:
            if f in self.failed_files.get(node, set()):
                c.repairs.append({"file": f, "from": feeder, "reason": "sha256 mismatch in an earlier transfer"})
                self.failed_files[node].discard(f)
            elif f in self.states[node].bad:
                c.repairs.append({"file": f, "from": feeder, "reason": "published copy failed its sha256 check"})
        for f in st.get("files_bad") or []:
            self.failed_files.setdefault(node, set()).add(f)
        if "dead" in st:
            c.error = f"node lost during the transfer: {st['dead']}"
        if st.get("not_started"):
            self.not_started.add(node)
        problems: list[str] = [st[k] for k in ("error", "upstream_error", "downstream_error") if st.get(k)]
        if st.get("files_bad"):
            problems.append(f"sha256 mismatch in {', '.join(st['files_bad'])} (re-fetched next attempt)")
        if st.get("refused"):
            log.warning("node %s refused connections: %s", node, "; ".join(st["refused"]))
        if problems:
            log.warning("fanout attempt %d on %s: %s", c.attempts, node, "; ".join(problems))
            self.last_problem[node] = "; ".join(problems)

    def run(self) -> FanoutResult:
        spec = self.spec
        src_dir = self.relays.final(self.source)
        manifest, hashed = source_manifest(self.relays, self.source, src_dir)
        log.info("fanout: %s is %d files, %.1f MiB, manifest %s (source re-hashed %.1f MiB)", self.model,
                 len(manifest.files), manifest.total_bytes / 2**20, manifest.digest[:12], hashed / 2**20)
        self.result = FanoutResult(self.model, manifest.digest, manifest.total_bytes,
                                   [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files],
                                   self.source, spec.strategy.value, source_hashed_bytes=hashed)
        self.result.nodes = [NodeCopy(self.source, "source", verified=True, strategy=spec.strategy.value)]
        self.result.nodes += [self.copies[n] for n in self.targets]

        deadline = self.t0 + spec.timeout_s
        t_inspect = time.monotonic()
        pre: Prestart | None = None
        if spec.strategy is FanoutStrategy.CHAIN and self.targets:
            # the chain a first fan-out feeds (every target empty) is started with the inspection
            pre = self.relays.start_with_inspection([self.source, *self.targets], manifest, deadline)
        try:
            return self._rounds(manifest, deadline, t_inspect, pre)
        finally:
            if pre is not None and pre.started:  # not fed (bad input refused, another plan, a failure)
                self.relays.stop(pre)

    def _rounds(self, manifest: Manifest, deadline: float, t_inspect: float, pre: Prestart | None) -> FanoutResult:
        spec = self.spec
        if pre is None:
            unreachable = self.inspect(self.targets, manifest)
        else:
            unreachable = dict(pre.errors)
            for n, answer in pre.answers.items():
                try:
                    self.states[n] = NodeState.from_inspect(n, answer)
                except (TypeError, ValueError) as exc:
                    unreachable[n] = f"node {n}: inspect printed a result that is not one ({exc})"
        log.debug("fanout: %d targets inspected in %.2f s%s", len(self.targets), time.monotonic() - t_inspect,
                  f", {len(pre.ready)} relays started with it" if pre else "")
        self.refuse_or_exclude(unreachable, "nodes could not be inspected")
        short = {}
        for n, st in self.states.items():
            need = st.bytes_needed(manifest)
            if need > st.free_bytes:
                short[n] = (f"{st.free_bytes / 2**30:.2f} GiB free under {self.inv.model_root_of(n)}, the model "
                            f"{self.model} ({manifest.digest[:12]}) needs {need / 2**30:.2f} GiB more; free space "
                            "or choose another model_root")
        self.refuse_or_exclude(short, "not enough free space")
        for n, st in self.states.items():
            if st.published and self.copies[n].status != "excluded":
                c = self.copies[n]
                c.status, c.verified = "skipped", True
                self.verified.add(n)
        repair_nodes = {n for n, st in self.states.items() if st.bad}

        while (pending := self.pending()) and time.monotonic() < deadline:
            runnable = [n for n in pending if self.copies[n].attempts < 1 + spec.retries]
            for n in set(pending) - set(runnable):
                c = self.copies[n]
                c.error = f"not verified after {c.attempts} attempts: {self.last_problem.get(n, 'incomplete')}"
            if not runnable:
                break
            paths = self.paths(runnable)
            self.result.rounds += 1
            log.info("fanout round %d: %s", self.result.rounds, " | ".join("->".join(p) for p in paths))
            feed = pre if pre is not None and pre.fits(paths) else None
            if pre is not None and feed is None:
                why = ("; ".join(f"{n}: {pre.not_started.get(n, 'it holds part of the model')}"
                                 for n in pre.path[1:] if n not in pre.ready) if paths == [pre.path] else
                       "the round feeds other paths (a node holds the model or a part of it, or is left out)")
                log.info("fanout: the relays started with the inspection are stopped, then started again for the "
                         "round: %s", why)
                self.relays.stop(pre)
            pre = None
            statuses = self.relays.run_round(paths, manifest, self.states, deadline, prestarted=feed)
            for n, status in statuses.items():
                self.account(n, status, manifest)
            alive = [n for n, status in statuses.items() if "dead" not in status]
            # a relay that published says what ``inspect`` would (it ran the same check in-process, on the copy it
            # just published, against the manifest the controller gave it); the others are inspected over SSH
            told = self.states_from_status({n: statuses[n] for n in alive})
            lost = self.inspect([n for n in alive if n not in told], manifest)
            for n, why in lost.items():
                self.copies[n].error = f"could not be inspected after the transfer: {why}"
            for n in alive:
                if n in self.states and self.states[n].published and n not in lost:
                    c = self.copies[n]
                    c.verified, c.error = True, None
                    c.status = "repaired" if n in repair_nodes and c.bytes < manifest.total_bytes else "copied"
                    self.verified.add(n)
        for n in self.pending():
            self.copies[n].error = (
                self.copies[n].error or f"not verified before the fan-out timeout ({spec.timeout_s:g} s)"
            )
        self.result.seconds = time.monotonic() - self.t0
        return self.finish()

    def finish(self) -> FanoutResult:
        res = self.result
        for c in res.nodes:
            if not c.verified and c.status not in ("excluded",):
                c.status = "failed"
            log.info("fanout %s: %s %.1f MiB in %.1f s (%.0f Mbit/s)%s", c.node, c.status, c.bytes / 2**20,
                     c.seconds, c.mbit_s, f" - {c.error}" if c.error else "")
        bad = [c for c in res.nodes if not c.verified]
        if bad:
            lines = "; ".join(f"{c.node}: {c.error}" for c in bad)
            if self.policy is Policy.ABORT:
                raise StageFailed(f"fanout: {len(bad)} node(s) hold no verified copy (policy abort): {lines}",
                                  res.to_dict())
            if len(res.verified_nodes) < self.min_nodes:
                raise StageFailed(f"fanout: only {len(res.verified_nodes)} nodes verified, min_nodes={self.min_nodes}: "
                                  f"{lines}", res.to_dict())
            log.warning("fanout: continuing without %s (policy exclude)", ", ".join(c.node for c in bad))
        return res


def run_relay(cluster: Cluster, names: list[str], source: str, model: str, spec: FanoutSpec,
              policy: Policy = Policy.ABORT, min_nodes: int = 1) -> FanoutResult:
    return _Fanout(cluster, names, source, model, spec, policy, min_nodes).run()

