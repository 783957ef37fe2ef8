"""What a dead run left running, found by that run's own records, and stopped.

A run whose controller was killed (SIGKILL, a lost worker) leaves its detached processes behind:
engines on the nodes, fan-out relays, iperf3 servers, k6 on the controller, and with the
kubernetes backend its Deployments and Services. The run that takes the cluster over from it
(``deploybench.lease``: an expired or broken lease) cleans them up first, by the dead run's key:

- every process a run starts on a node has a pid file under ``<run_root>/<node>/`` that names
  the pid, the run key (``run=``) and the command (``argv=``, JSON), and the process has
  ``DEPLOYBENCH_RUN=<key>`` in its environment (``transport.spawn_script(run_key=...)``). A
  pid is only signalled while ``/proc/<pid>/cmdline`` is still exactly that command and its
  environment (when readable) names that run; pid 1, this script's own pids and a pid that now
  runs something else are left alone, with a warning. A process group leader (everything a run
  starts is one, under ``setsid``) is stopped with its group: TERM, then KILL after a grace.
- an engine in a container (``docker|podman run --name ...``) is removed by that name too;
- k6 runs on the controller; its pid file (``*.k6.pid``, same format) is in the dead run's folder. On the
  inventory's load generators (deploybench.load.loadgen) it runs as a node's process does, with a pid file
  under ``<run_root>/<generator>/load/``;
- Kubernetes objects carry the label ``deploybench/run`` (``rollout.manifests.run_label``).

One small Python script does the node side (nodes have Python: preflight requires it), so the
same code checks the controller's k6 files.
"""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from deploybench import paths
from deploybench.errors import DeploybenchError
from deploybench.inventory import Inventory
from deploybench.transport import RUN_ENV, Cluster, isolated

log = logging.getLogger(__name__)

# argv: <folder to search> <run key> <grace s> <1: every pid file there belongs to the run (its own folder)>
NODE_SCRIPT = r'''
import json, os, signal, sys, time
root, key, grace, whole = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "1"
marker = ("%s=%s" % (sys.argv[5], key)).encode()
mine = {os.getpid(), os.getppid(), 0, 1}
def alive(pid):
    try:
        return open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
def drop(path):
    try:
        os.remove(path)
    except OSError:
        pass
out = []
for d, _, files in os.walk(root):
    for f in sorted(files):
        if not f.endswith(".pid"):
            continue
        path = os.path.join(d, f)
        try:
            lines = open(path).read().splitlines()
        except OSError:
            continue
        meta = dict(l.split("=", 1) for l in lines[1:] if "=" in l)
        if not whole and meta.get("run") != key:
            continue
        rec = {"file": path, "pid": None, "command": "", "action": "", "why": ""}
        out.append(rec)
        try:
            pid = int(lines[0].strip())
        except (ValueError, IndexError):
            rec.update(action="left alone", why="the pid file holds no pid")
            continue
        rec["pid"] = pid
        try:
            argv = json.loads(meta["argv"]) if "argv" in meta else None
        except ValueError:
            argv = None
        rec["command"] = " ".join(argv or [])[:300]
        if pid in mine or pid <= 1:
            rec.update(action="left alone", why="pid %d is not a process a run starts" % pid)
            continue
        if not alive(pid):
            rec["action"] = "gone"
            drop(path)
            continue
        try:
            cmd = [c.decode(errors="replace") for c in open("/proc/%d/cmdline" % pid, "rb").read().split(b"\0")[:-1]]
        except OSError:
            cmd = None
        if argv is None or cmd != argv:
            rec.update(action="left alone", why="pid %d runs %r, not the recorded command (a reused pid, or an old "
                       "pid file without its command)" % (pid, " ".join(cmd or [])[:200]))
            continue
        try:
            env = open("/proc/%d/environ" % pid, "rb").read().split(b"\0")
        except OSError:
            env = None
        if env is not None and "run" in meta and marker not in env:
            rec.update(action="left alone", why="pid %d does not carry %s in its environment" % (pid, marker.decode()))
            continue
        try:
            group = os.getpgid(pid) == pid
        except OSError:
            group = False
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 3.0)):
            try:
                os.killpg(pid, sig) if group else os.kill(pid, sig)
            except ProcessLookupError:
                break
            t = time.monotonic()
            while alive(pid) and time.monotonic() - t < wait:
                time.sleep(0.05)
            if not alive(pid):
                break
        if alive(pid):
            rec.update(action="still running", why="TERM and KILL did not stop it")
        else:
            rec["action"] = "killed"
            drop(path)
        if os.path.basename(argv[0]) in ("docker", "podman") and argv[1:2] == ["run"] and "--name" in argv:
            # the engine ran in a container: its client is gone, the container is not
            import subprocess
            name = argv[argv.index("--name") + 1]
            rm = subprocess.run([argv[0], "rm", "-f", name], capture_output=True, text=True)
            rec["container"] = name + (" removed" if rm.returncode == 0 else ": " + rm.stderr.strip()[-200:])
print(json.dumps(out))
'''


def node_root(inv: Inventory, node: str) -> str:
    """Where a run's pid files are on ``node``: every process a run starts there keeps one below it."""
    return f"{inv.run_root.rstrip('/')}/{node}"


def _argv(python: str, root: str, run_key: str, grace_s: float, whole: bool) -> list[str]:
    return [*isolated(python), "-c", NODE_SCRIPT, root, run_key, f"{grace_s:g}", "1" if whole else "0", RUN_ENV]


def _parse(text: str) -> list[dict[str, Any]]:
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise DeploybenchError(f"the leftover cleaner printed no result: {text[-300:]!r}") from exc


def clean_nodes(cluster: Cluster, run_key: str, nodes: list[str] | None = None, grace_s: float = 2.0
                ) -> dict[str, list[dict[str, Any]] | str]:
    """Stop the processes of ``run_key`` on every node (default: all of the inventory's, and its load generators,
    where a dead run's k6 may still send its share of a phase); per node, what was found (``action``: killed, gone,
    left alone, still running), or the error that kept it from looking."""
    inv = cluster.inventory
    names = nodes or [*inv.names, *inv.loadgen_names]

    def one(name: str) -> tuple[str, list[dict[str, Any]] | str]:
        try:
            res = cluster[name].run(shlex.join(_argv(inv.python, node_root(inv, name), run_key, grace_s, False)),
                                    timeout=60 + 4 * grace_s)
            res.check()
            found = _parse(res.stdout)
        except DeploybenchError as exc:
            log.warning("node %s: could not clean up after run %s: %s", name, run_key, exc)
            return name, f"error: {exc}"
        for f in found:
            level = logging.WARNING if f["action"] in ("left alone", "still running") else logging.INFO
            log.log(level, "node %s: leftover of run %s: %s pid %s (%s)%s", name, run_key, f["action"], f["pid"],
                    f["command"][:120], f" - {f['why']}" if f["why"] else "")
        return name, found

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
        return dict(pool.map(one, names))


def clean_controller(run_key: str, grace_s: float = 2.0) -> list[dict[str, Any]]:
    """Stop the dead run's k6 (and any other process it recorded in its run folder) on this machine."""
    folder = paths.run_dir(run_key)
    proc = subprocess.run(_argv(sys.executable, str(folder), run_key, grace_s, True), capture_output=True, text=True,
                          timeout=60 + 4 * grace_s, check=False)
    if proc.returncode != 0:
        raise DeploybenchError(f"cleaning up after run {run_key} in {folder} failed: {proc.stderr.strip()[-300:]}")
    found = _parse(proc.stdout)
    for f in found:
        log.log(logging.WARNING if f["action"] in ("left alone", "still running") else logging.INFO,
                "controller: leftover of run %s: %s pid %s (%s)%s", run_key, f["action"], f["pid"],
                f["command"][:120], f" - {f['why']}" if f["why"] else "")
    return found


def clean(inventory: Inventory, run_key: str, *, ssh_overrides: dict | None = None, kube: Any = None,
          namespace: str | None = None, grace_s: float = 2.0) -> dict[str, Any]:
    """Everything ``run_key`` left: on every node, on the controller, in Kubernetes (with ``kube``).

    Returns ``{"run_key", "nodes": {node: [found...] | "error: ..."}, "controller": [...],
    "kubernetes": {object: status}, "killed": n, "left_alone": n, "errors": [...], "seconds"}``.
    """
    t0 = time.monotonic()
    errors: list[str] = []
    with Cluster(inventory, ssh_overrides, run_key=None) as cluster:
        nodes = clean_nodes(cluster, run_key, grace_s=grace_s)
    errors += [f"{n}: {v}" for n, v in nodes.items() if isinstance(v, str)]
    try:
        controller = clean_controller(run_key, grace_s)
    except (DeploybenchError, OSError, subprocess.SubprocessError) as exc:
        controller = []
        errors.append(f"controller: {exc}")
    k8s: dict[str, str] = {}
    if kube is not None and namespace:
        from deploybench.rollout.kubernetes import delete_run_objects

        k8s = delete_run_objects(kube, namespace, run_key)
        errors += [f"{k}: {v}" for k, v in k8s.items() if v.startswith("error")]
    found = [f for v in nodes.values() if isinstance(v, list) for f in v] + controller
    out = {
        "run_key": run_key, "nodes": {n: v for n, v in nodes.items() if v}, "controller": controller,
        "kubernetes": k8s,
        "killed": sum(f["action"] == "killed" for f in found) + sum(v == "deleted" for v in k8s.values()),
        "left_alone": sum(f["action"] in ("left alone", "still running") for f in found),
        "errors": errors, "seconds": round(time.monotonic() - t0, 3),
    }
    log.info("cleaned up after run %s in %.1f s: %d processes/objects stopped, %d left alone, %d errors", run_key,
             out["seconds"], out["killed"], out["left_alone"], len(errors))
    return out


def describe(cleaned: dict[str, Any]) -> str:
    """One line: what was stopped where."""
    parts = []
    for node, found in sorted(cleaned.get("nodes", {}).items()):
        if isinstance(found, str):
            parts.append(f"{node}: {found}")
            continue
        killed = [f for f in found if f["action"] == "killed"]
        if killed:
            parts.append(f"{node}: " + ", ".join(_what(f) for f in killed))
    k6 = [f for f in cleaned.get("controller", []) if f["action"] == "killed"]
    if k6:
        parts.append("controller: " + ", ".join(_what(f) for f in k6))
    deleted = [k for k, v in cleaned.get("kubernetes", {}).items() if v == "deleted"]
    if deleted:
        parts.append("kubernetes: " + ", ".join(deleted))
    return "; ".join(parts) or "nothing was left running"


def _what(found: dict[str, Any]) -> str:
    name = found["file"].rsplit("/", 1)[-1]
    kind = ("engine" if name.startswith("engine") else "iperf3" if name.startswith("iperf3")
            else "k6" if name.endswith(".k6.pid") else "relay" if "/fanout/" in found["file"] else name)
    return f"{kind} pid {found['pid']}"
