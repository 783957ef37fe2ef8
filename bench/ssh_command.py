"""The cost of one SSH command through deploybench's transport, woken by the exit status against 10-ms polls.

    sudo .venv/bin/python bench/ssh_command.py [--commands 200]

Every stage talks to nodes in SSH commands (a status poll, a relay start, an inspection), many of them one
after the other. SSHTransport.run waits for a command's end on the channel's exit-status event; it used to
look every 10 ms (a sleep between drains), which made the shortest command cost its 10-ms tick on this
machine whatever the node's answer took. Both are run here side by side on a 2-node netns lab, alternated in
rounds: ``true`` and a status-poll-sized command (``cat`` of a small file), each timed per command (wall) and
by the machine's busy time (CPU, all processes: the controller, sshd and the shell on the node). The old wait is
the same transport with a channel whose exit-status event only sleeps out its timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import paramiko

from deploybench.lab import cluster
from deploybench.transport import Cluster


class _Ticking(threading.Event):
    """An exit-status event that a bounded wait does not end early: the former ``time.sleep(0.01)``."""

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return super().wait()
        time.sleep(timeout)
        return self.is_set()


def _busy() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user..steal (guest time is counted in user already)
    return sum(v) - v[3] - v[4]


def _measure(c: Cluster, node: str, cmd: str, want: str, n: int, ticking: bool) -> tuple[float, float]:
    init = paramiko.Channel.__init__

    def ticking_init(self: paramiko.Channel, chanid: int) -> None:
        init(self, chanid)
        self.status_event = _Ticking()

    if ticking:
        paramiko.Channel.__init__ = ticking_init  # type: ignore[method-assign]
    try:
        k0, t0 = _busy(), time.monotonic()
        for _ in range(n):
            out = c[node].run(cmd, timeout=10).check().stdout
            if out != want:  # a command cut short is no faster command
                raise SystemExit(f"`{cmd}` answered {out!r}, not {want!r}")
        wall, cpu = time.monotonic() - t0, (_busy() - k0) / os.sysconf("SC_CLK_TCK")
    finally:
        paramiko.Channel.__init__ = init  # type: ignore[method-assign]
    return wall / n * 1000, cpu / n * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commands", type=int, default=200, help="commands per kind and variant (default %(default)s)")
    p.add_argument("--name", default="sshbench", help="lab name (default %(default)s)")
    a = p.parse_args()
    if a.commands < 3:
        p.error(f"--commands {a.commands}: at least 3 (three rounds)")
    if os.geteuid() != 0:
        print("the netns lab needs root", file=sys.stderr)
        return 2
    inv = cluster.up(a.name, nodes=2, link_mbit=100, mode="netns", model_mb=1)
    rows: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    try:
        cluster.stop_prometheus(a.name)
        node = inv.names[1]
        with Cluster(inv) as c:
            status = '{"running": true}\n'
            c[node].run("cat > /tmp/.sshbench-status", stdin=status.encode(), timeout=10).check()
            kinds = {"true": ("true", ""), "status poll": ("cat /tmp/.sshbench-status", status)}
            for _ in range(3):  # rounds, the two variants alternated
                for kind, (cmd, want) in kinds.items():
                    for ticking in (False, True):
                        rows.setdefault((kind, ticking), []).append(
                            _measure(c, node, cmd, want, a.commands // 3, ticking))
            c[node].run("rm -f /tmp/.sshbench-status", timeout=10)
    finally:
        cluster.down(a.name)
    print(f"\none SSH command through SSHTransport.run, 2-node netns lab, {os.cpu_count()} cores "
          f"({a.commands // 3 * 3} commands per row)")
    print(f"{'command':12} {'wait':22} {'wall ms':>8} {'cpu ms':>7}")
    med = {}
    for (kind, ticking), vals in rows.items():
        wall = sorted(w for w, _ in vals)[len(vals) // 2]
        cpu = sorted(c for _, c in vals)[len(vals) // 2]
        med[(kind, ticking)] = wall
        print(f"{kind:12} {'10-ms polls (before)' if ticking else 'exit-status event':22} {wall:>8.1f} {cpu:>7.1f}")
    now, before = med[("status poll", False)], med[("status poll", True)]
    print(f"ssh: a status poll in {now:.1f} ms (woken by the exit status) vs {before:.1f} ms (10-ms polls): "
          f"{before / now:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
