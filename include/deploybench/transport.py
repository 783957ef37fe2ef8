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
from typing import TYPE_CHECKING, Any

from deploybench.errors import NodeUnreachable, TransportError

if TYPE_CHECKING:
    import paramiko

    from deploybench.inventory import Inventory, Machine

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

    def check(self) -> CommandResult:
        if self.rc != 0:
            tail = (self.stderr or self.stdout).strip()[-800:]
            raise TransportError(f"node {self.node}: `{self.command}` exited {self.rc}: {tail}")
        return self


def _as_command(cmd: Sequence[str] | str) -> str:
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


class Transport(ABC):
    """Runs commands on one node."""

    def __init__(self, node: Machine):
        self.node = node

    @abstractmethod
    def run(
        self, cmd: Sequence[str] | str, *, timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        """Run ``cmd`` (an argv list, or a shell script string) and wait for it, at most ``timeout`` s."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the connection, if any."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalTransport(Transport):
    """The loopback lab: every node is this machine, with its own address and folders."""

    def run(
        self, cmd: Sequence[str] | str, *, timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        t0 = time.monotonic()
        try:
            # No input = an empty stdin, never this process's own: under Airflow's task runner fd 0
            # is the supervisor's socket, and a command that reads stdin would wait on it for good.
            feed: dict[str, Any] = {"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}
            proc = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, **feed)
        except subprocess.TimeoutExpired as exc:
            raise TransportError(
                f"node {self.node.name}: `{_as_command(cmd)}` timed out after {timeout:.0f} s"
            ) from exc
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


# What one command's stdout (and stderr) may hold over SSH: the largest answer deploybench asks a node for is the
# fan-out manifest of a model folder (about 150 bytes a file), or nvidia-smi's CSV; a node sending more is cut off
MAX_OUTPUT = 32 << 20
# How long a command's output may still come after its exit status before the channel's end of file says it is
# whole. sshd sends the end of file a moment after the status; a command that left a process holding its output
# open (one started in the background without its own output) sends it only when that process exits.
EOF_GRACE_S = 0.2


class SSHTransport(Transport):
    """Paramiko, with RejectPolicy: a node whose key is unknown or changed is refused."""

    def __init__(self, node: Machine, params: SSHParams):
        super().__init__(node)
        self.params = params
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    def _connect(self) -> paramiko.SSHClient:
        import paramiko

        with self._lock:
            if self._client is not None and (live := self._client.get_transport()) is not None and live.is_active():
                return self._client
            p = self.params
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
            if p.known_hosts:
                try:
                    client.load_host_keys(p.known_hosts)
                except OSError as exc:
                    raise NodeUnreachable(
                        f"node {self.node.name}: cannot read known_hosts {p.known_hosts!r}: {exc}"
                    ) from exc
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
            except (TimeoutError, OSError) as exc:
                raise NodeUnreachable(
                    f"node {self.node.name} ({p.host}:{p.port}) is unreachable over SSH: {exc}"
                ) from exc
            # Small request/reply packets: without NODELAY each channel open waits ~40 ms for a delayed ACK.
            transport = client.get_transport()
            if transport is not None and isinstance(transport.sock, socket.socket):
                transport.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._client = client
            return client

    def run(
        self, cmd: Sequence[str] | str, *, timeout: float = 60.0, stdin: bytes | None = None
    ) -> CommandResult:
        command = _as_command(cmd)
        client = self._connect()
        t0 = time.monotonic()
        deadline = t0 + timeout
        transport = client.get_transport()
        if transport is None:  # closed between _connect and here
            raise NodeUnreachable(f"node {self.node.name}: the SSH connection closed before `{command[:200]}` ran")
        chan = transport.open_session(timeout=self.params.timeout)
        out, err = bytearray(), bytearray()
        status_at = 0.0
        try:
            chan.settimeout(0.2)
            chan.exec_command(command)
            if stdin:
                self._send_input(chan, command, stdin, deadline, out, err)
            try:
                chan.shutdown_write()
            except OSError:
                pass  # the channel is closed: the command ended (checked by _send_input)
            while True:
                got = self._drain(chan, out, err)
                if len(out) > MAX_OUTPUT or len(err) > MAX_OUTPUT:
                    raise TransportError(
                        f"node {self.node.name}: `{command[:200]}` wrote more than {MAX_OUTPUT >> 20} MiB to "
                        f"{'stdout' if len(out) > MAX_OUTPUT else 'stderr'}; a node's output is read up to that "
                        "bound and no further (the command was cut off); look at what it prints on the node")
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    # sshd sends the exit status when it reaps the command, and what is still in the command's
                    # pipes after it: the output is whole at the channel's end of file. A command that left a
                    # process holding its output open sends none: it is done EOF_GRACE_S after its status.
                    if chan.eof_received or chan.closed:
                        break
                    status_at = status_at or time.monotonic()
                    if time.monotonic() - status_at > EOF_GRACE_S:
                        break
                if time.monotonic() > deadline:
                    raise TransportError(f"node {self.node.name}: `{command}` timed out after {timeout:.0f} s")
                if got:
                    continue
                if chan.exit_status_ready():
                    time.sleep(0.001)  # the rest of the output, or the end of file: within a millisecond or so
                else:  # woken at once by the exit status, else every 10 ms to drain the output
                    chan.status_event.wait(0.01)
            rc = chan.recv_exit_status()
        finally:
            chan.close()
        return CommandResult(
            self.node.name,
            command,
            rc,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            time.monotonic() - t0,
        )

    @staticmethod
    def _drain(chan: paramiko.Channel, out: bytearray, err: bytearray) -> bool:
        got = False
        while chan.recv_ready():
            out += chan.recv(65536)
            got = True
        while chan.recv_stderr_ready():
            err += chan.recv_stderr(65536)
            got = True
        return got

    def _send_input(self, chan: paramiko.Channel, command: str, data: bytes, deadline: float, out: bytearray,
                    err: bytearray) -> None:
        """Send all of ``data`` to the command's stdin, reading its output meanwhile (a command that writes
        before it reads must not block us both). A command that exits before it read everything is not an
        error (its exit status tells); a channel that stalls past the deadline, or fails while the command
        still runs, is: the command would otherwise see a truncated input and could still exit 0."""
        view, sent = memoryview(data), 0
        while sent < len(data):
            if chan.exit_status_ready():
                return
            if time.monotonic() > deadline:
                raise TransportError(
                    f"node {self.node.name}: `{command[:200]}` took only {sent} of {len(data)} input bytes before its "
                    "time ran out (a stalled channel or a command that does not read its input); the command still "
                    "runs and was not given the rest")
            try:
                n = chan.send(bytes(view[sent:sent + 65536]))
            except TimeoutError:
                self._drain(chan, out, err)
                continue
            except OSError as exc:
                if self._exited(chan):
                    return
                raise TransportError(f"node {self.node.name}: `{command[:200]}`: input cut short after {sent} of "
                                     f"{len(data)} bytes, the command still runs: {exc}") from exc
            if n == 0:  # the channel was closed
                if self._exited(chan):
                    return
                raise TransportError(f"node {self.node.name}: `{command[:200]}`: the channel closed after {sent} of "
                                     f"{len(data)} input bytes without an exit status")
            sent += n
            self._drain(chan, out, err)

    @staticmethod
    def _exited(chan: paramiko.Channel, wait_s: float = 2.0) -> bool:
        """Whether the remote command has exited (its status may trail the channel's close a little)."""
        end = time.monotonic() + wait_s
        while not chan.exit_status_ready():
            if time.monotonic() > end:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def ssh_params(inventory: Inventory, node: Machine, overrides: dict[str, Any] | None = None) -> SSHParams:
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


def connect(inventory: Inventory, node: Machine, ssh_overrides: dict[str, Any] | None = None) -> Transport:
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

    def __init__(self, inventory: Inventory, ssh_overrides: dict[str, Any] | None = None, run_key: str | None = None):
        self.inventory = inventory
        self.run_key = run_key
        self._overrides = ssh_overrides
        self._transports: dict[str, Transport] = {}
        self._lock = threading.Lock()
        self._checked: set[str] = set()

    def run_dir(self, node: str | Machine) -> str:
        """``<run_root>/<node>``: where the processes a run starts on ``node`` keep their pid files, logs and
        programs. The run root is checked once per node before it is used: made 0700 if missing, else it
        must belong to the deploy user and be writable by nobody else, in folders nobody else can swap
        (a run root someone else created first could hold a planted program or pid file)."""
        name = node if isinstance(node, str) else node.name
        root = self.inventory.run_root.rstrip("/") or "/"
        if name not in self._checked:
            res = self[name].run(private_dir_argv(self.inventory.python, root), timeout=30)
            try:
                verdict = json.loads(res.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                verdict = {
                    "error": f"the check printed no verdict (exit {res.rc}): {(res.stderr or res.stdout)[-300:]}"
                }
            if not verdict.get("ok"):
                raise UnsafeFolder(
                    f"node {name}: run_root {root!r} is not safe to use: {verdict.get('error')}; remove it (after "
                    "looking at what is in it) so deploybench creates it, or set run_root in the inventory to a "
                    "folder only the deploy user can write")
            self._checked.add(name)
        return f"{root}/{name}"

    def __getitem__(self, node: str | Machine) -> Transport:
        name = node if isinstance(node, str) else node.name
        with self._lock:
            t = self._transports.get(name)
            if t is None:
                t = connect(self.inventory, self.inventory.machine(name), self._overrides)
                self._transports[name] = t
            return t

    def close(self) -> None:
        for t in self._transports.values():
            t.close()
        self._transports.clear()

    def __enter__(self) -> Cluster:
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
                 run_key: str | None = None, stdin: bool = False) -> str:
    """A shell script that starts ``argv`` detached (own session, fds closed) and records its pid.

    Used to start long-lived processes (engines, iperf3 servers) on a node through any
    transport; the caller stops them by pid file (``stop_script``, which checks the process's
    command line against ``argv`` first). The pid file names the command (``argv=<JSON list>``
    after the pid) and, with ``run_key``, its run (``run=<key>``); the process then gets
    ``DEPLOYBENCH_RUN=<key>`` in its environment, so a later run can stop exactly the processes
    of a run that died (deploybench.leftovers), and never a reused pid. ``stdin``: the process
    reads the script's own stdin (a secret it must not get on its command line), else /dev/null.
    Over SSH that input only arrives while the command still runs (sshd drops what comes after it
    ended): the caller's command must wait until the process has read it. (The fan-out relay is
    started otherwise: in the foreground of its command, detaching itself once ready, it writes a
    pid file of this format itself: fanout.relay ``--detach``.)
    """
    env = {**(env or {}), **({RUN_ENV: run_key} if run_key else {})}
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())
    logdir = shlex.quote(str(PurePosixPath(log_path).parent))
    lines = ([f"run={run_key}"] if run_key else []) + [f"argv={json.dumps(list(argv))}"]
    record = "echo $!; printf '%s\\n' " + " ".join(shlex.quote(x) for x in lines)
    # An asynchronous command's stdin is /dev/null unless redirected: fd 3 carries ours to it.
    given, keep, drop = ("exec 3<&0; ", "<&3 3<&-", "exec 3<&-; ") if stdin else ("", "< /dev/null", "")
    # Sequential mkdir first: backgrounding a whole `a && b &` list would fork a subshell,
    # record the subshell's pid, and race the pid file against the mkdir.
    return (
        f"mkdir -p {logdir} || exit 1; {exports}{given}"
        f"setsid nohup {shlex.join(argv)} > {shlex.quote(log_path)} 2>&1 {keep} & {drop}"
        f"{{ {record}; }} > {shlex.quote(pid_path)}; echo $!"
    )


# A process that exited but was not reaped yet (a zombie: nodes' init processes may reap
# late or never) counts as gone.
_ALIVE_FN = (
    'alive() { kill -0 "$1" 2>/dev/null || return 1; s=$(ps -o stat= -p "$1" 2>/dev/null) || return 0; '
    'case "$s" in Z*) return 1;; esac; return 0; }; '
)
# The pid of a pid file, if it is one a run could have started: a number above 1 that is not this shell.
_PID_FN = (
    'pidof_file() { p=$(head -n 1 "$1" 2>/dev/null); case "$p" in ""|*[!0-9]*) return 1;; esac; '
    '[ "$p" -gt 1 ] && [ "$p" != "$$" ] || return 1; echo "$p"; }; '
)
LEFT_ALONE = "deploybench: left alone:"  # what stop_script prints (on stderr) for a pid it will not signal


def _cmdline_test(argv: Sequence[str] | None) -> str:
    """Shell test: /proc/$pid/cmdline is ``argv`` (arguments compared one per line), or ``argv`` still behind the
    wrappers ``spawn_script`` starts it with (``setsid nohup argv``, then ``nohup argv``, for the moment before
    each execs the next): a stop right after a start must stop it, not leave it alone."""
    if argv is None:
        return "true"
    want = "\n".join(argv)
    ours = " || ".join(f'[ "$_cmd" = {shlex.quote(w)} ]' for w in (want, f"nohup\n{want}", f"setsid\nnohup\n{want}"))
    return f'{{ _cmd="$(tr \'\\0\' \'\\n\' < /proc/$pid/cmdline 2>/dev/null)"; {ours}; }}'


def alive_script(pid_path: str, argv: Sequence[str] | None = None) -> str:
    """Exit 0 when the process recorded in ``pid_path`` is running (zombies excluded), and, with ``argv``,
    still runs that command (a reused pid is not our process)."""
    q = shlex.quote(pid_path)
    return f"{_ALIVE_FN}{_PID_FN}pid=$(pidof_file {q}) && alive $pid && {_cmdline_test(argv)}"


def stop_script(pid_path: str, grace_s: float = 5.0, argv: Sequence[str] | None = None) -> str:
    """Stop the process (group) recorded in ``pid_path``: TERM, wait ``grace_s``, then KILL. Idempotent.

    A pid file is a file on a node, not a proof: a pid that is not a number above 1 (``1`` would make
    ``kill -1`` signal every process), or, with ``argv``, a live pid whose command line is not ``argv``
    (a reused pid, a planted file) is left alone: a line starting with ``LEFT_ALONE`` on stderr says so
    (``stop_pid`` logs it as a warning), and the pid file stays for a person to look at."""
    q = shlex.quote(pid_path)
    ticks = max(1, int(grace_s * 10))
    return (
        f"{_ALIVE_FN}{_PID_FN}if [ -f {q} ]; then "
        f"if ! pid=$(pidof_file {q}); then printf '%s %s holds no pid a run starts (%s)\\n' {shlex.quote(LEFT_ALONE)} "
        f"{q} \"$(head -c 40 {q} | head -n 1)\" >&2; "
        f"elif alive $pid && ! {_cmdline_test(argv)}; then "
        f"printf '%s pid %s of %s runs %s, not the command deploybench started\\n' {shlex.quote(LEFT_ALONE)} "
        f"\"$pid\" {q} \"$(tr '\\0' ' ' < /proc/$pid/cmdline 2>/dev/null | head -c 200)\" >&2; "
        f"else kill -TERM -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null; "
        f"i=0; while alive $pid && [ $i -lt {ticks} ]; do sleep 0.1; i=$((i+1)); done; "
        f"kill -KILL -$pid 2>/dev/null; kill -KILL $pid 2>/dev/null; rm -f {q}; fi; fi; true"
    )


def warn_left_alone(res: CommandResult) -> CommandResult:
    """Log, as a warning, every pid a ``stop_script`` run left alone."""
    for line in res.stderr.splitlines():
        if line.startswith(LEFT_ALONE):
            log.warning("node %s: %s", res.node, line.removeprefix("deploybench: "))
    return res


# -- the run folder -------------------------------------------------------------------------------
# argv: <folder>. Prints {"ok": true} or {"error": why}. Makes the folder (0700) if missing.
PRIVATE_DIR_SCRIPT = r'''
import json, os, stat, sys
d, uid = sys.argv[1], os.geteuid()
def bad(why):
    print(json.dumps({"error": why})); sys.exit(0)
if not d.startswith("/"):
    bad("%r is not an absolute path" % d)
def ancestors():
    path = "/"
    for part in [p for p in d.split("/") if p]:
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, uid):
                bad("%s is a symbolic link owned by uid %d" % (path, st.st_uid))
            continue
        if st.st_uid not in (0, uid):
            bad("%s is owned by uid %d, neither root nor the deploy user (uid %d)" % (path, st.st_uid, uid))
        if path != os.path.normpath(d) and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            bad("%s is writable by other users (mode %o) and not sticky" % (path, stat.S_IMODE(st.st_mode)))
ancestors()
try:
    os.makedirs(d, mode=0o700, exist_ok=True)
except OSError as exc:
    bad("cannot create %s as uid %d: %s" % (d, uid, exc.strerror))
ancestors()  # again: a folder someone else made between the check and the makedirs
real = os.path.realpath(d)
st = os.stat(real)
if not stat.S_ISDIR(st.st_mode):
    bad("%s is not a folder" % real)
if st.st_uid != uid:
    bad("%s is owned by uid %d, not the deploy user (uid %d): another user may have created it first"
        % (real, st.st_uid, uid))
if st.st_mode & 0o022:
    bad("%s is writable by other users (mode %o): what is in it may have been planted"
        % (real, stat.S_IMODE(st.st_mode)))
if stat.S_IMODE(st.st_mode) != 0o700:
    os.chmod(real, 0o700)
print(json.dumps({"ok": True}))
'''


class UnsafeFolder(TransportError):
    """A node's run folder is not the deploy user's own (owner, mode, a planted link)."""


def isolated(python: str) -> list[str]:
    """The argv start of every Python program deploybench runs on a node: the inventory's python with ``-I``
    (isolated mode: neither the script's folder nor the working directory on sys.path, no PYTHON* variables, no
    user site), so a module planted beside a program or in the login folder (``argparse.py``) is never imported
    in place of the standard library's."""
    return [python, "-I"]


def private_dir_argv(python: str, folder: str) -> list[str]:
    return [*isolated(python), "-c", PRIVATE_DIR_SCRIPT, folder]
