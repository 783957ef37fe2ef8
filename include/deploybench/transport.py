"""How a command reaches a node: over SSH (real nodes, the netns lab) or locally (loopback lab).

A transport runs an argument list (quoted with ``shlex`` on the way to a remote
shell, never concatenated) or a shell script the caller built with ``shlex.quote``.
Host keys are always checked against the inventory's known_hosts: an unknown or
changed key is refused, never accepted silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shlex
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from deploybench.errors import NodeUnreachable, TransportError

if TYPE_CHECKING:
    import paramiko

    from deploybench.inventory import Inventory, Node

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandResult:
    node: str
    command: str
    rc: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def check(self) -> "CommandResult":
        if self.rc != 0:
            tail = (self.stderr or self.stdout).strip()[-800:]
            raise TransportError(f"node {self.node}: `{self.command}` exited {self.rc}: {tail}")
        return self


def _as_command(cmd: Sequence[str] | str) -> str:
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


class Transport(ABC):
    """Runs commands on one node."""

    def __init__(self, node: "Node"):
        self.node = node

    @abstractmethod
    def run(
        self, cmd: Sequence[str] | str, *, timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Run ``cmd`` (an argv list, or a shell script string) and wait for it, at most ``timeout`` s."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection, if any."""

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalTransport(Transport):
    """The loopback lab: every node is this machine, with its own address and folders."""

    def run(self, cmd, *, timeout=60.0, stdin=None):
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TransportError(f"node {self.node.name}: `{_as_command(cmd)}` timed out after {timeout:.0f} s") from exc
        except FileNotFoundError as exc:
            return CommandResult(self.node.name, _as_command(cmd), 127, "", str(exc), time.monotonic() - t0)
        return CommandResult(
            self.node.name,
            _as_command(cmd),
            proc.returncode,
            proc.stdout.decode(errors="replace"),
            proc.stderr.decode(errors="replace"),
            time.monotonic() - t0,
        )


@dataclass(frozen=True)
class SSHParams:
    """Everything needed to open an SSH session to one node."""

    host: str
    port: int
    user: str
    key_file: str | None
    known_hosts: str | None
    host_key: str | None = None  # "ssh-ed25519 AAAA..." from an Airflow connection's extras
    timeout: float = 10.0


class SSHTransport(Transport):
    """Paramiko, with RejectPolicy: a node whose key is unknown or changed is refused."""

    def __init__(self, node: "Node", params: SSHParams):
        super().__init__(node)
        self.params = params
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    def _connect(self) -> "paramiko.SSHClient":
        import paramiko

        with self._lock:
            if self._client is not None and self._client.get_transport() and self._client.get_transport().is_active():
                return self._client
            p = self.params
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
            if p.known_hosts:
                try:
                    client.load_host_keys(p.known_hosts)
                except OSError as exc:
                    raise NodeUnreachable(f"node {self.node.name}: cannot read known_hosts {p.known_hosts!r}: {exc}") from exc
            if p.host_key:
                key_type, _, blob = p.host_key.strip().partition(" ")
                key = paramiko.PKey.from_type_string(key_type, __import__("base64").b64decode(blob.split()[0]))
                name = p.host if p.port == 22 else f"[{p.host}]:{p.port}"
                client.get_host_keys().add(name, key.get_name(), key)
            try:
                client.connect(
                    p.host,
                    port=p.port,
                    username=p.user,
                    key_filename=p.key_file,
                    timeout=p.timeout,
                    banner_timeout=p.timeout,
                    auth_timeout=p.timeout,
                    allow_agent=False,
                    look_for_keys=p.key_file is None,
                )
            except paramiko.BadHostKeyException as exc:
                raise NodeUnreachable(
                    f"node {self.node.name} ({p.host}:{p.port}): host key CHANGED, refusing to connect "
                    f"(got {exc.key.get_name()} {exc.key.get_base64()[:24]}..., expected the one in "
                    f"{p.known_hosts or 'the connection extras'}); if the change is legitimate, update known_hosts"
                ) from exc
            except paramiko.SSHException as exc:
                raise NodeUnreachable(
                    f"node {self.node.name} ({p.host}:{p.port}): SSH refused: {exc}; check that its host key is in "
                    f"{p.known_hosts or 'the connection extras'} and that user {p.user!r} accepts key {p.key_file}"
                ) from exc
            except (OSError, socket.timeout) as exc:
                raise NodeUnreachable(f"node {self.node.name} ({p.host}:{p.port}) is unreachable over SSH: {exc}") from exc
            # Small request/reply packets: without NODELAY each channel open waits ~40 ms for a delayed ACK.
            client.get_transport().sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._client = client
            return client

    def run(self, cmd, *, timeout=60.0, stdin=None):
        command = _as_command(cmd)
        client = self._connect()
        t0 = time.monotonic()
        chan = client.get_transport().open_session(timeout=self.params.timeout)
        try:
            chan.settimeout(1.0)
            chan.exec_command(command)
            try:
                if stdin:
                    chan.sendall(stdin)
                chan.shutdown_write()
            except OSError:
                pass  # the command ended without reading all its input: its exit status tells the rest
            out, err = bytearray(), bytearray()
            deadline = t0 + timeout
            while True:
                got = False
                while chan.recv_ready():
                    out += chan.recv(65536)
                    got = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    got = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if time.monotonic() > deadline:
                    raise TransportError(f"node {self.node.name}: `{command}` timed out after {timeout:.0f} s")
                if not got:
                    time.sleep(0.01)
            rc = chan.recv_exit_status()
        finally:
            chan.close()
        return CommandResult(
            self.node.name, command, rc, out.decode(errors="replace"), err.decode(errors="replace"), time.monotonic() - t0
        )

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def ssh_params(inventory: "Inventory", node: "Node", overrides: dict | None = None) -> SSHParams:
    """SSH parameters for ``node``; ``overrides`` (from an Airflow connection) win over the inventory."""
    s = inventory.ssh
    o = overrides or {}
    return SSHParams(
        host=node.address,
        port=int(o.get("port") or s.port),
        user=o.get("user") or s.user,
        key_file=o.get("key_file") or s.key_file,
        known_hosts=o.get("known_hosts") or s.known_hosts,
        host_key=o.get("host_key"),
        timeout=float(o.get("timeout") or s.connect_timeout_s),
    )


def connect(inventory: "Inventory", node: "Node", ssh_overrides: dict | None = None) -> Transport:
    """The transport for ``node`` as the inventory describes it (connections open lazily)."""
    from deploybench.inventory import TransportKind

    if inventory.transport is TransportKind.LOCAL:
        return LocalTransport(node)
    return SSHTransport(node, ssh_params(inventory, node, ssh_overrides))


class Cluster:
    """One transport per node, opened on first use and closed together.

    ``with Cluster(inv) as c: c[node].run([...])``

    ``run_key`` names the run that works on the cluster through this object: the processes it
    starts on nodes carry it (``spawn_script(run_key=...)``, ``run_tag``), so they can be told
    apart from another run's. None: a caller outside a run (tests, one-off tools).
    """

    def __init__(self, inventory: "Inventory", ssh_overrides: dict | None = None, run_key: str | None = None):
        self.inventory = inventory
        self.run_key = run_key
        self._overrides = ssh_overrides
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()

    def __getitem__(self, node: "str | Node") -> Transport:
        name = node if isinstance(node, str) else node.name
        with self._lock:
            t = self._transports.get(name)
            if t is None:
                t = connect(self.inventory, self.inventory.node(name), self._overrides)
                self._transports[name] = t
            return t

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ssh_command(self) -> list[str]:
        """The ``ssh`` argv a node uses to reach another node (for rsync -e), host keys verified."""
        s = self.inventory.ssh
        argv = ["ssh", "-p", str(s.port), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        if s.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={s.known_hosts}"]
        if s.key_file:
            argv += ["-i", s.key_file, "-o", "IdentitiesOnly=yes"]
        return argv


RUN_ENV = "DEPLOYBENCH_RUN"  # set in every process a run starts on a node: /proc/<pid>/environ names the run


def run_tag(run_key: str) -> str:
    """A file-name-safe tag of ``run_key`` for per-run pid and log files on nodes (readable prefix + digest)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_key)[:40]
    return f"{safe}-{hashlib.sha256(run_key.encode()).hexdigest()[:8]}"


def spawn_script(argv: Sequence[str], log_path: str, pid_path: str, env: dict[str, str] | None = None,
                 run_key: str | None = None) -> str:
    """A shell script that starts ``argv`` detached (own session, fds closed) and records its pid.

    Used to start long-lived processes (engines, iperf3 servers, relays) on a node through any
    transport; the caller stops them by pid file. With ``run_key`` the pid file names its run
    and its command (lines ``run=<key>`` and ``argv=<JSON list>`` after the pid) and the process
    gets ``DEPLOYBENCH_RUN=<key>`` in its environment, so a later run can stop exactly the
    processes of a run that died (deploybench.leftovers), and never a reused pid.
    """
    env = {**(env or {}), **({RUN_ENV: run_key} if run_key else {})}
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
    logdir = shlex.quote(str(PurePosixPath(log_path).parent))
    record = "echo $!" + (f"; printf '%s\\n' {shlex.quote('run=' + run_key)} "
                          f"{shlex.quote('argv=' + json.dumps(list(argv)))}" if run_key else "")
    # Sequential mkdir first: backgrounding a whole `a && b &` list would fork a subshell,
    # record the subshell's pid, and race the pid file against the mkdir.
    return (
        f"mkdir -p {logdir} || exit 1; {exports}"
        f"setsid nohup {shlex.join(argv)} > {shlex.quote(log_path)} 2>&1 < /dev/null & "
        f"{{ {record}; }} > {shlex.quote(pid_path)}; echo $!"
    )


# A process that exited but was not reaped yet (a zombie: nodes' init processes may reap
# late or never) counts as gone.
_ALIVE_FN = (
    'alive() { kill -0 "$1" 2>/dev/null || return 1; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 0; '
    'case "$s" in Z*) return 1;; esac; return 0; }; '
)


def alive_script(pid_path: str) -> str:
    """Exit 0 when the process recorded in ``pid_path`` is running (zombies excluded)."""
    q = shlex.quote(pid_path)
    return f"{_ALIVE_FN}[ -f {q} ] && alive $(head -n 1 {q})"


def stop_script(pid_path: str, grace_s: float = 5.0) -> str:
    """Stop the process (group) recorded in ``pid_path``: TERM, wait ``grace_s``, then KILL. Idempotent."""
    q = shlex.quote(pid_path)
    ticks = max(1, int(grace_s * 10))
    return (
        f"{_ALIVE_FN}if [ -f {q} ]; then pid=$(head -n 1 {q}); "
        f"kill -TERM -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null; "
        f"i=0; while alive $pid && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; "
        f"kill -KILL -$pid 2>/dev/null; kill -KILL $pid 2>/dev/null; rm -f {q}; fi; true"
    )
