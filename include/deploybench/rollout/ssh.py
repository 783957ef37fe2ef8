"""The ssh deployer: the engine as a supervised process (or a container) on each node.

Each engine keeps its pid file and its log under the inventory's run_root (``<run_root>/<node>/``, one
pair per run key, see ``_paths``), and gets a folder of its run's own (``work_dir``) for the files its
profile generates (Triton's model repository): the only folder of the node a container sees besides the
model root (read-only), so an engine image cannot reach the relay program, pid files or other runs'
files. It is started detached through the node's transport; stopped with TERM, then KILL after the grace
period, and only counted as stopped once its port no longer answers. Failures carry the
engine's log tail, read back from the node.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deploybench import engines, http
from deploybench.config import ContainerRuntime, RunConfig
from deploybench.errors import DeploybenchError
from deploybench.inventory import Node
from deploybench.rollout.base import Capabilities, Deployer, NodeFailure
from deploybench.transport import Cluster, alive_script, run_tag, spawn_script, stop_script, warn_left_alone

log = logging.getLogger(__name__)


class SSHDeployer(Deployer):
    backend = "ssh"
    capabilities = Capabilities(shares_deployments=True, scales_under_load=True)

    @classmethod
    def for_run(cls, cluster: Cluster, names: list[str], cfg: RunConfig, kube: Any = None) -> SSHDeployer:
        return cls(cluster, cfg)

    def __init__(self, cluster: Cluster, cfg: RunConfig):
        self.cluster = cluster
        self.cfg = cfg
        self.profile = engines.profile(cfg.engine)
        self.port = cfg.rollout.port
        self.serving: list[str] = []  # nodes whose engine this deployer started and did not stop

    def take_over(self, nodes: list[str]) -> None:
        self.serving = list(nodes)  # their pid files carry this run's tag: this deployer stops them as its own

    # -- one node ---------------------------------------------------------------------------------
    def _node(self, name: str) -> Node:
        return self.cluster.inventory.node(name)

    def work_dir(self, node: Node) -> str:
        """The engine's folder of this run, ``<run_root>/<node>/engines/<run tag>`` (the run root checked to be
        the deploy user's own before first use, Cluster.run_dir): generated files, and all a container may
        write. Its log stays outside it: a container could swap it for a link to any file of the node, which
        ``log_tail`` would then read back."""
        key = self.cluster.run_key
        return f"{self.cluster.run_dir(node.name)}/engines/{run_tag(key) if key else 'no-run'}"

    def _paths(self, node: Node) -> tuple[str, str]:
        """The engine's pid and log files: one pair per run (``engine-<run tag>.pid``), so a run only ever
        stops its own engine, and a later run can stop a dead run's by that run's key."""
        base = self.cluster.run_dir(node.name)
        key = self.cluster.run_key
        suffix = f"-{run_tag(key)}" if key else ""
        return f"{base}/engine{suffix}.pid", f"{base}/engine{suffix}.log"

    def url(self, node: Node) -> str:
        return f"http://{node.address}:{self.port}"

    def _context(self, node: Node) -> engines.LaunchContext:
        inv = self.cluster.inventory
        return engines.LaunchContext(inv, node, f"{inv.model_root_of(node).rstrip('/')}/{self.cfg.model.name}",
                                     self.cfg.model.name, self.port, self.cfg.engine, self.work_dir(node))

    def _container_name(self, node: Node) -> str:
        key = self.cluster.run_key
        return f"deploybench-{node.name}" + (f"-{run_tag(key)}" if key else "")

    def launch_argv(self, node: Node) -> list[str]:
        ctx = self._context(node)
        if self.cfg.engine.runtime is ContainerRuntime.PROCESS:
            return self.profile.command(ctx)
        return engines.container_command(self.cfg.engine, ctx, self._container_name(node))

    def start(self, name: str) -> None:
        node = self._node(name)
        try:  # all of it: an unreachable node (its run folder is checked over SSH first) fails as itself, named
            pid, logf = self._paths(node)
            t = self.cluster[node]
            self._stop_node(node)  # a leftover engine of this run (a retried task); other runs': deploybench.leftovers
            files = engines.engine_files(self.cfg.engine, self._context(node))
            if self.cfg.engine.runtime is not ContainerRuntime.PROCESS:
                t.run(["mkdir", "-p", self.work_dir(node)], timeout=30).check()  # the container's bind source
            if files:
                script, blob = engines.write_files_script(files, self.cluster.inventory.python)
                t.run(script, stdin=blob, timeout=30).check()
            env = engines.process_env(self.cfg.engine) if self.cfg.engine.runtime is ContainerRuntime.PROCESS else {}
            t.run(spawn_script(self.launch_argv(node), logf, pid, env=env, run_key=self.cluster.run_key),
                  timeout=30).check()
        except DeploybenchError as exc:
            raise NodeFailure(name, f"could not start the {self.profile.name} engine: {exc}") from exc
        log.info("%s: started %s engine on port %d", name, self.profile.name, self.port)

    def _stop_node(self, node: Node) -> None:
        pid, _ = self._paths(node)
        t = self.cluster[node]
        # only the engine this run started: the pid file must name a process whose command line is ours
        warn_left_alone(t.run(stop_script(pid, self.cfg.rollout.stop_grace_s, self.launch_argv(node)),
                              timeout=30 + self.cfg.rollout.stop_grace_s).check())
        if self.cfg.engine.runtime is not ContainerRuntime.PROCESS:
            t.run([self.cfg.engine.runtime.value, "rm", "-f", self._container_name(node)], timeout=60)
        t.run(["rm", "-rf", "--", self.work_dir(node)], timeout=60)  # this run's generated files

    def stop(self, name: str) -> None:
        """Stop the engine (TERM, then KILL after the grace period) and make sure its port no longer answers."""
        node = self._node(name)
        self._stop_node(node)
        url = self.url(node) + self.profile.health_path
        if http.is_up(url, timeout=1):
            raise DeploybenchError(f"node {name}: an engine still answers at {url} after stopping the one in "
                                   f"{self._paths(node)[0]}; stop it by hand (it was not started by this run)")

    def alive(self, name: str) -> bool:
        pid, _ = self._paths(self._node(name))
        return self.cluster[name].run(alive_script(pid, self.launch_argv(self._node(name))), timeout=15).ok

    def log_tail(self, name: str, lines: int = 20) -> str:
        _, logf = self._paths(self._node(name))
        try:
            return self.cluster[name].run(["tail", "-n", str(lines), logf], timeout=15).stdout.strip()
        except DeploybenchError as exc:
            return f"(log unavailable: {exc})"

    def wait_node(self, name: str, timeout_s: float) -> float:
        """Seconds until ``name`` passes its profile's readiness check; NodeFailure if it dies or times out."""
        t0 = time.monotonic()
        base = self.url(self._node(name))
        url = base + self.profile.health_path
        next_alive_check = t0 + 0.5
        while True:
            if self.profile.is_ready(base, self.cfg.model.name):
                return time.monotonic() - t0
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise NodeFailure(name, f"not ready at {url} after {timeout_s:g} s (rollout.ready_timeout_s)",
                                  self.log_tail(name))
            if now >= next_alive_check:
                next_alive_check = now + 0.5
                try:
                    gone = not self.alive(name)
                except DeploybenchError as exc:
                    raise NodeFailure(name, f"unreachable while waiting for its engine: {exc}") from exc
                if gone and not self.profile.is_ready(base, self.cfg.model.name):
                    raise NodeFailure(name, "the engine exited before it was ready", self.log_tail(name))
            time.sleep(0.1)

    # -- the interface -----------------------------------------------------------------------------
    def _each(self, fn, names: list[str]) -> list:
        """``fn`` on every node at once; the first NodeFailure (in node order) is raised after all finished."""
        if not names:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
            futures = [pool.submit(fn, n) for n in names]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def deploy(self, nodes: list[str]) -> None:
        self.scale(nodes)

    def scale(self, nodes: list[str]) -> None:
        new = [n for n in nodes if n not in self.serving]
        gone = [n for n in self.serving if n not in nodes]
        self.serving = [n for n in self.serving if n in nodes] + new  # a half-started node is still ours to stop
        if gone:
            self._each(self.stop, gone)
        self._each(self.start, new)

    def start_each(self, nodes: list[str]) -> dict[str, Exception]:
        new = [n for n in nodes if n not in self.serving]
        self.serving = [*self.serving, *new]  # a half-started node is still ours to stop
        if not new:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(new))) as pool:
            futures = {n: pool.submit(self.start, n) for n in new}
        return {n: e for n, f in futures.items() if isinstance(e := f.exception(), Exception)}

    def wait_ready(self, nodes: list[str], timeout_s: float) -> dict[str, float]:
        return dict(zip(nodes, self._each(lambda n: self.wait_node(n, timeout_s), nodes)))

    def endpoints(self) -> list[dict]:
        gpus = [str(i) for i in self.cfg.engine.gpu_ids()]  # the GPUs its figures are of (DCGM's label "gpu")
        return [{"node": n, "url": self.url(self._node(n)), "model": self.cfg.model.name, "gpus": gpus}
                for n in self.serving]

    def check_alive(self, nodes: list[str]) -> list[NodeFailure]:
        def one(name: str) -> NodeFailure | None:
            base = self.url(self._node(name))
            url = base + self.profile.health_path
            if self.profile.is_ready(base, self.cfg.model.name):
                return None
            try:
                running = self.alive(name)
            except DeploybenchError as exc:
                return NodeFailure(name, f"unreachable: {exc}")
            what = "the engine stopped answering" if running else "the engine exited after it was ready"
            return NodeFailure(name, f"{what} ({url})", self.log_tail(name))

        if not nodes:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
            return [f for f in pool.map(one, nodes) if f is not None]

    def rollback(self, nodes: list[str]) -> None:
        gone = [n for n in self.serving if n not in nodes]
        results = self._stop_all(gone)
        self.serving = [n for n in self.serving if n in nodes or results.get(n) != "stopped"]
        bad = {n: s for n, s in results.items() if s != "stopped"}
        if bad:
            raise DeploybenchError("rollback could not stop: " + "; ".join(f"{n}: {s}" for n, s in bad.items()))

    def _stop_all(self, names: list[str]) -> dict[str, str]:
        def one(name: str) -> tuple[str, str]:
            try:
                self.stop(name)
                return name, "stopped"
            except DeploybenchError as exc:
                return name, f"error: {exc}"

        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
            return dict(pool.map(one, names))

    def teardown(self, names: list[str] | None = None) -> dict[str, str]:
        """Stop the engine on ``names`` (default: every node this deployer started). Idempotent."""
        targets = list(names if names is not None else self.serving)
        results = self._stop_all(targets)
        self.serving = [n for n in self.serving if results.get(n, "stopped") != "stopped"]
        return results
