"""The controller's side of the relay: install it on nodes, call it, run one round of streams.

A round is a set of paths ``[feeder, node1, node2, ...]``. The relays are started detached on
every receiving node (listening on its backend address, accepting only the previous node of
the path with this round's token and the manifest digest the controller gives it), then, once
every receiver of a path listens, its feeder. The token reaches each relay on its stdin, never
on a command line or in a file name (files are named by a separate round id). A start is
confirmed, not assumed: the relay runs in the foreground of the command that starts it and
detaches itself only once it read its token (a receiver: and listens), because sshd drops input
that arrives after the command it was meant for has ended: a token sent a few milliseconds late
(a busy controller, a distant node) once left a relay without one, and the round waited for its
timeout. A relay that did not start is known at once, by node and why, and its path is not fed.
The relay program is checked against its sha256 before every run: a truncated or altered copy is replaced, never
run. It is run through a launcher (``LAUNCHER``, on the command line) that makes that check itself and runs the
program's compiled code, kept beside it, when that code is this exact source's, built by this interpreter (a file
trusted as a __pycache__ is, see LAUNCHER). The controller watches the last node of each path, collects every
node's status, and always stops every relay it started, whatever happened: a relay whose final status was read
is waited for and its round files removed by that same command (``_poll``); ``_stop`` visits every other one.
A chain's first round may find its receivers started already, with their inspection (``start_with_inspection``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import secrets
import shlex
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deploybench.config import FanoutSpec
from deploybench.errors import DeploybenchError, NodeUnreachable, TransportError
from deploybench.fanout import relay as relay_module
from deploybench.fanout.plan import NodeState, header_files
from deploybench.inventory import Node
from deploybench.manifest import Manifest
from deploybench.transport import (
    RUN_ENV,
    Cluster,
    CommandResult,
    alive_script,
    isolated,
    stop_script,
    warn_left_alone,
)

log = logging.getLogger(__name__)

POLL_S = 0.1
START_S = 15.0  # a relay that has not read its token (a receiver: and listened) by then did not start
DEAD_AFTER = 2  # consecutive failed polls (each bounded) before a node counts as dead
# Threads for per-node SSH commands. Each mostly waits on its node (a relay starting, a status), so a cap below the
# node count only queues nodes behind others: at 48 nodes a cap of 16 ran every step in three waves.
WORKERS = 64
REAP_S = 1.0  # how long the poll that read a final status waits for the relay to exit before leaving it to _stop
ROUND_FILES = ("plan.json", "status.json", "status.json.tmp", "ready", "ready.tmp")  # removed after a round
FINAL, REAPED = "@@deploybench-final@@", "@@deploybench-reaped@@"
HOLDS = "@@deploybench-holds@@"  # start_with_inspection: the node holds something of the model, nothing started


NOT_INSTALLED = 97  # exit code of a call whose relay (this version) is not on the node yet


@functools.cache
def relay_source() -> bytes:
    return Path(relay_module.__file__).read_bytes()


def relay_digest() -> str:
    return hashlib.sha256(relay_source()).hexdigest()


def relay_version() -> str:
    return relay_digest()[:12]


# How every relay command starts on a node: ``python -I -S -c LAUNCHER <program> <command> ...``. Python compiles a
# script it is given by name at every start, and not a module it imports from a __pycache__; for the relay's source
# that was 16 of a start's 32 ms of CPU (measured here: ``python -I -S relay.py --help`` against the launcher), and a
# chain starts one relay a node (at 48 nodes the lab starts 47 on its host's 2 cores). The launcher
# - checks the program's sha256 (the shell's ``sha256sum -c`` did, one more program started): anything else, a
#   missing file included, exits NOT_INSTALLED after reading its input, as the shell did, and the controller
#   installs the program;
# - runs the compiled code kept beside the program (``relay-<version>.code``) only when the file is the deploy
#   user's and writable by no one else (not followed if a link), and its header names this source's sha256, this
#   interpreter (the sha256 of sys.version: a bytecode is one Python version's) and the sha256 of the code itself
#   (a file cut short or damaged is not loaded); else it compiles the source it checked and replaces the file
#   (written whole, mode 0600, then renamed). The code file is trusted as Python trusts a __pycache__: it lies in
#   the deploy user's own run folder (0700, checked when the folder is made), and whoever can write there could
#   write the program too; its hashes catch damage and a stale file, not a forgery by the folder's owner;
# - runs the program as ``python program`` would (``__name__`` is ``"__main__"``, sys.argv from the command).
# The first line names the relay in ``ps``, and the program's path is an argument, as before.
LAUNCHER = """\
# deploybench relay {version}: the program given, if its sha256 is {short}..., from its compiled code
import sys, os, hashlib, marshal
path = sys.argv.pop(1)
try:
    with open(path, "rb") as f:
        source = f.read()
except OSError:
    source = b""
digest = hashlib.sha256(source).hexdigest()
if digest != "{digest}":
    sys.stdin.buffer.read()
    sys.exit({not_installed})
key = (digest + " " + hashlib.sha256(sys.version.encode()).hexdigest() + " ").encode()
cached, code = path[:-3] + ".code", None
try:
    with open(os.open(cached, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            head, _, body = f.read().partition(b"\\n")
            if head == key + hashlib.sha256(body).hexdigest().encode():
                code = marshal.loads(body)
except (OSError, ValueError, EOFError, TypeError):
    pass
if code is None:
    code = compile(source, path, "exec")
    body = marshal.dumps(code)
    tmp = "%s.%d.tmp" % (cached, os.getpid())
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
            f.write(key + hashlib.sha256(body).hexdigest().encode() + b"\\n" + body)
        os.replace(tmp, cached)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
sys.argv[0], source, body = path, None, None
exec(code, {{"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}})
"""


@functools.cache
def launcher() -> str:
    return LAUNCHER.format(version=relay_version(), digest=relay_digest(), short=relay_digest()[:16],
                           not_installed=NOT_INSTALLED)


class Prestart:
    """The receivers of one path started with their inspection (``Relays.start_with_inspection``)."""

    def __init__(self, path: list[str], rid: str, token: str):
        self.path, self.rid, self.token = path, rid, token
        self.answers: dict[str, dict] = {}  # node -> what inspect answered
        self.errors: dict[str, str] = {}  # node -> why it could not be inspected
        self.ready: set[str] = set()  # nodes whose relay listens
        self.not_started: dict[str, str] = {}  # node -> why its relay did not start
        self.started: list[tuple[str, str, list[str]]] = []  # (node, round id, argv): for _stop

    def fits(self, paths: list[list[str]]) -> bool:
        """The round ``paths`` is this path, and every receiver of it listens."""
        return paths == [self.path] and self.ready == set(self.path[1:])


class Relays:
    """Paths and calls of the relay on every node of one fan-out."""

    def __init__(self, cluster: Cluster, model: str, spec: FanoutSpec):
        self._dead: dict[str, str] = {}
        self._reaped: set[tuple[str, str]] = set()  # (node, round id): relays whose poll saw them exit, files removed
        self.cluster = cluster
        self.inv = cluster.inventory
        self.model = model
        self.spec = spec
        self._installed: set[str] = set()

    # -- where things are on a node ----------------------------------------------------------
    def workdir(self, node: str) -> str:
        return f"{self.cluster.run_dir(node)}/fanout"

    def program(self, node: str) -> str:
        """Named by its content: a node that holds this version is not sent it again, run after run."""
        return f"{self.workdir(node)}/relay-{relay_version()}.py"

    def final(self, node: str) -> str:
        return f"{self.inv.model_root_of(node).rstrip('/')}/{self.model}"

    def staging(self, node: str) -> str:
        return f"{self.inv.model_root_of(node).rstrip('/')}/.staging/{self.model}"

    def cache(self, node: str) -> str:
        """The node's hash cache (see relay.HashCache), beside the model folders, never inside them."""
        return f"{self.inv.model_root_of(node).rstrip('/')}/.deploybench/{self.model}.hashes.json"

    # -- calls -------------------------------------------------------------------------------
    def install(self, node: str) -> None:
        if node in self._installed:
            return
        wd, prog = shlex.quote(self.workdir(node)), shlex.quote(self.program(node))
        tmp = shlex.quote(f"{self.program(node)}.tmp")
        check = shlex.quote(f"{relay_digest()}  {self.program(node)}.tmp")
        res = self.cluster[node].run(
            f"mkdir -p {wd} && cat > {tmp} && {{ printf '%s\\n' {check} | sha256sum -c --status -; }} && "
            f"rm -f {wd}/relay.py {wd}/relay-*.py {wd}/relay-*.code {wd}/relay-*.code.*.tmp && mv {tmp} {prog} && "
            # compiled now (its code file written), not at the node's first relay start; --help runs nothing else
            f"{{ {shlex.join(self.launch(node))} --help > /dev/null 2>&1 || true; }}", stdin=relay_source(),
            timeout=30)
        if not res.ok:
            raise TransportError(f"node {node}: could not install the relay program in {self.workdir(node)} (exit "
                                 f"{res.rc}: {res.stderr.strip()[-300:]}); its sha256 must be {relay_digest()[:16]}... "
                                 "after the copy; check free space and sha256sum on the node")
        self._installed.add(node)

    def _run_installed(self, node: str, script: str, stdin: bytes | None, timeout: float) -> CommandResult:
        """Run ``script``, which runs the relay through the launcher; when that exits NOT_INSTALLED (the program
        missing, or not this version's: gone or changed since the controller last saw it, or never seen, as after
        an empty node's inspection by the shell), install the program and run ``script`` once more."""
        res = self.cluster[node].run(script, stdin=stdin, timeout=timeout)
        if res.rc == NOT_INSTALLED:
            self._installed.discard(node)
            self.install(node)
            res = self.cluster[node].run(script, stdin=stdin, timeout=timeout)
            if res.rc == NOT_INSTALLED:
                raise TransportError(f"node {node}: the relay program {self.program(node)} does not have sha256 "
                                     f"{relay_digest()[:16]}... even after it was installed again; not run")
        return res

    def call(self, node: str, args: list[str], stdin: bytes | None = None, timeout: float = 3600,
             shortcut: str = "") -> dict:
        """Run the relay's ``args`` on ``node``: one SSH command when this relay version is there already.
        ``shortcut``: shell that may answer instead of the relay (and exit), run first; an answer of its own
        (``"shell": true``) says in ``"program"`` whether the relay program's file is there."""
        # Not installed (or not this exact program): the launcher reads stdin before it exits, so sending the input
        # never meets a closed channel; then the program is installed, and run only once its hash checks.
        res = self._run_installed(node, f"{shortcut}exec {shlex.join([*self.launch(node), *args])}", stdin, timeout)
        if not res.ok:
            raise TransportError(f"node {node}: relay {args[0]} failed (exit {res.rc}): {res.stderr.strip()[-400:]}; "
                                 f"preflight requires python3 on every node (inventory python: {self.inv.python})")
        try:
            out = json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise TransportError(f"node {node}: relay {args[0]} printed no result: {res.stdout[-200:]!r}") from exc
        if not (isinstance(out, dict) and out.get("shell")) or out.get("program"):
            self._installed.add(node)  # the shell's answer ran no program: it says whether one is there
        else:  # none there: installed now, in the caller's thread (the inspection's pool), not at the round's start
            self._installed.discard(node)
            self.install(node)
        return out

    def manifest(self, node: str, model_dir: str) -> dict:
        return self.call(node, ["manifest", model_dir, "--cache", self.cache(node)])

    def inspect(self, node: str, manifest: Manifest) -> NodeState:
        data = self.call(node, self._inspect_args(node), stdin=manifest.to_json().encode(),
                         shortcut=self._empty_node(node))
        return NodeState.from_inspect(node, data)

    def _empty_node(self, node: str) -> str:
        """Shell that answers ``inspect`` for a node holding nothing of the model (no final folder, no staging,
        nor a link by either name; a model root that is a real folder): what the relay would answer there, with
        the free space as it computes it (f_bavail x f_frsize: ``stat -f`` %a x %S), without starting Python.
        A first fan-out finds every target so: at 48 nodes the relay's start was ~1 s of the stage's 4 s of
        fixed cost. Anything else (a copy to verify, staged files to resume) goes to the relay. The answer also
        says whether the relay program's file is there (``program``): one that is not is installed before the
        relay starts; one that is there is checked (sha256) by the launcher as it starts."""
        empty, answer = self._empty_test(node)
        return f"if {empty}; then cat > /dev/null; {answer}; exit 0; fi; "

    def _empty_test(self, node: str) -> tuple[str, str]:
        """(a shell test true on a node that holds nothing of the model, the shell that then prints the answer
        ``inspect`` would print there); see ``_empty_node``."""
        root = self.inv.model_root_of(node).rstrip("/") or "/"
        r, f, s = (shlex.quote(x) for x in (root, self.final(node), self.staging(node)))
        nothing = f"[ -d {r} ] && [ ! -L {r} ] && ! [ -e {f} -o -L {f} -o -e {s} -o -L {s} ]"
        answer = ('{"published": false, "bad": [], "staged": {}, "free_bytes": %s, "hashed_bytes": 0, '
                  '"shell": true, "program": %s}\n')
        prog = shlex.quote(self.program(node))
        return (f"{nothing} && set -- $(stat -f -c '%a %S' {r} 2>/dev/null) && [ $# -eq 2 ]",
                f"p=false; [ ! -f {prog} ] || p=true; printf {shlex.quote(answer)} $(($1 * $2)) $p")

    def _inspect_args(self, node: str) -> list[str]:
        return ["inspect", "--final", self.final(node), "--staging", self.staging(node), "--cache", self.cache(node)]

    # -- the first round's receivers, started with their inspection -------------------------------
    def start_with_inspection(self, path: list[str], manifest: Manifest, deadline: float) -> Prestart:
        """Inspect every receiver of ``path`` and, on each that the shell finds holding nothing of the model (a
        first fan-out finds every target so), start its relay for this path in the same SSH command; a node
        that holds something is inspected by the relay, as ``inspect`` does (its own command, without the start's
        bound: it may hash a whole copy), and nothing is started there. The stage feeds this path as its first
        round when the plan it makes from the inspection is this path and every relay of it started
        (``Prestart.fits``); otherwise it stops them (``stop``). At 48 nodes this is one SSH command a node fewer
        before the first byte (the inspection took 0.19-0.24 s of the lab's 2 cores). Whatever happens here,
        relays it started are either in the returned record or stopped."""
        pre = Prestart(path, secrets.token_hex(6), secrets.token_hex(16))
        stdin = f"{pre.token}\n".encode()

        def one(i: int) -> None:
            node, argv = path[i + 1], None
            try:
                command = self._serve_argv(self.launch(node), path, i, pre.rid, manifest, deadline,
                                           accept_extra=START_S + 30)
                start, command = self._start_script(node, pre.rid, command)
                empty, answer = self._empty_test(node)
                script = f"if {empty}; then {answer}; {start}; else echo {HOLDS}; fi"
                argv = command
                res = self._run_installed(node, script, stdin, START_S + 30)
                lines = res.stdout.splitlines()
                if lines[:1] == [HOLDS]:
                    argv = None  # nothing was started there
                    pre.answers[node] = self.call(node, self._inspect_args(node), stdin=manifest.to_json().encode())
                    return
                answered = json.loads(lines[0]) if lines else None
                if not isinstance(answered, dict) or not answered.get("shell"):
                    raise TransportError(f"node {node}: the inspection printed no answer (exit {res.rc}): "
                                         f"{(res.stderr or res.stdout).strip()[-300:]!r}")
            except NodeUnreachable as exc:
                pre.errors[node] = str(exc)  # no command reaches it: neither a start nor a stop
                return
            except Exception as exc:  # noqa: BLE001 - paramiko's own types too: the node is named, the rest goes on
                if argv is not None:
                    pre.started.append((node, pre.rid, argv))  # it may have started: stopped with the others
                pre.errors[node] = str(exc) if isinstance(exc, DeploybenchError) else f"node {node}: {exc!r}"
                return
            pre.answers[node] = answered
            pre.started.append((node, pre.rid, argv))
            why = self._verdict(node, pre.rid, res)
            if why is None:
                pre.ready.add(node)
                self._installed.add(node)
            else:
                pre.not_started[node] = why

        receivers = range(len(path) - 1)
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(WORKERS, len(receivers)))) as pool:
                list(pool.map(one, receivers))
        except BaseException:
            self.stop(pre)
            raise
        return pre

    def stop(self, pre: Prestart) -> None:
        """Stop the relays ``start_with_inspection`` started, when the stage does not feed them (bad input refused,
        another plan, a failure), and remove the staging folder each made on a node that held nothing of the model
        (``rmdir``: only if empty, as a relay that was never fed leaves it): a refused fan-out leaves no trace."""
        def made(node: str) -> str:
            staging = self.staging(node)
            return f"rmdir {shlex.quote(staging)} {shlex.quote(staging.rsplit('/', 1)[0])} 2>/dev/null; true"

        self._stop(pre.started, then=made)
        pre.started.clear()

    # -- one round ---------------------------------------------------------------------------
    def run_round(self, paths: list[list[str]], manifest: Manifest, states: dict[str, NodeState],
                  deadline: float, prestarted: Prestart | None = None) -> dict[str, dict]:
        """Stream to every path at once; returns each receiver's status (``{"dead": why}`` for a lost node,
        ``{"error": ...}`` for a relay that ended without one, ``"not_started"`` for a relay that did not start,
        ``"not_fed"`` for a node of a path that was not fed because of another). Every relay started here is
        stopped. ``prestarted``: the receivers of ``paths`` (its one path) listen already, started with their
        inspection; they are stopped here too."""
        jobs = []  # (round id, path)
        self._dead = {}
        started: list[tuple[str, str, list[str]]] = []
        try:
            listeners, feeders = [], []  # (node, round id, token, argv)
            if prestarted is not None:
                started += prestarted.started
                prestarted.started.clear()
                if not prestarted.fits(paths):
                    raise ValueError(f"the receivers started are for {'->'.join(prestarted.path)}, not {paths}")
            tp = time.monotonic()
            for path in paths:
                # the token authenticates the stream and travels on stdin only; the id names the files
                token, rid = secrets.token_hex(16), secrets.token_hex(6)
                if prestarted is not None:
                    token, rid = prestarted.token, prestarted.rid
                feeder, receivers = path[0], path[1:]
                header = {"manifest": json.loads(manifest.to_json()),
                          "files": header_files(manifest, [states[n] for n in receivers])}
                self.install(feeder)
                self.cluster[feeder].run(f"cat > {shlex.quote(self._file(feeder, rid, 'plan.json'))}",
                                         stdin=json.dumps(header).encode(), timeout=30).check()
                for i, node in enumerate(receivers if prestarted is None else []):
                    listeners.append((node, rid, token, self._serve_argv(self._common(node), path, i, rid, manifest,
                                                                          deadline)))
                first = self.inv.node(receivers[0])
                argv = self._common(feeder) + [
                    "send", "--plan", self._file(feeder, rid, "plan.json"), "--dir", self.final(feeder),
                    "--bind", self.inv.node(feeder).data_address] + self._timeouts(rid, feeder, first, deadline)
                feeders.append((feeder, rid, token, argv))
                jobs.append((rid, path))
            t0 = time.monotonic()
            log.debug("round: %d plan(s) written in %.2f s", len(feeders), t0 - tp)
            # every receiver listens before any feeder connects; a path with a relay that did not start is not fed
            failed = self._start(listeners, started)
            tl = time.monotonic()
            failed.update(self._start([f for f in feeders if not any(r == f[1] for r, _ in failed)], started))
            t1 = time.monotonic()
            log.debug("round: %d receivers listening %.2f s after the plan was written, feeders %.2f s later",
                      len(listeners), tl - t0, t1 - tl)
            out = self._watch([(rid, path) for rid, path in jobs if not any(r == rid for r, _ in failed)], deadline)
            out.update(self._not_started([(rid, path) for rid, path in jobs if any(r == rid for r, _ in failed)],
                                         failed))
            self._dead.update({n: st["dead"] for (_, n), st in failed.items() if "dead" in st})
            log.debug("round: %d relays started in %.2f s, streams done after %.2f s", len(started), t1 - t0,
                      time.monotonic() - t1)
            return out
        finally:
            t2 = time.monotonic()
            self._stop(started)
            log.debug("round: relays stopped in %.2f s", time.monotonic() - t2)

    def _serve_argv(self, start: list[str], path: list[str], i: int, rid: str, manifest: Manifest,
                    deadline: float, accept_extra: float = 0.0) -> list[str]:
        """The command of the ``i``-th receiver of ``path`` (``path[i + 1]``), after ``start`` (``launch``).
        ``accept_extra``: seconds more to wait for the upstream (relays started before the round's other starts)."""
        node, up = path[i + 1], self.inv.node(path[i])
        down = self.inv.node(path[i + 2]) if i + 2 < len(path) else None
        return start + [
            "serve", "--listen", self.inv.node(node).data_address, "--port", str(self.spec.port),
            "--upstream", up.data_address, "--staging", self.staging(node), "--final", self.final(node),
            "--cache", self.cache(node), "--expect", manifest.digest] + self._timeouts(rid, node, down, deadline,
                                                                                       accept_extra)

    def _file(self, node: str, rid: str, what: str) -> str:
        return f"{self.workdir(node)}/{rid}.{what}"

    def _common(self, node: str) -> list[str]:
        self.install(node)
        return self.launch(node)

    def launch(self, node: str) -> list[str]:
        """The argv start of a relay command on ``node``: its interpreter, the launcher, the program."""
        return [*self._python(), "-c", launcher(), self.program(node)]

    def _python(self) -> list[str]:
        """The relay's interpreter: isolated, and without ``site`` (-S): the relay needs the standard library only,
        and site's path set-up is ~2 ms of every one of the two or three relay starts per node and round."""
        return [*isolated(self.inv.python), "-S"]

    def _timeouts(self, rid: str, node: str, down: Node | None, deadline: float,
                  accept_extra: float = 0.0) -> list[str]:
        left = max(1.0, deadline - time.monotonic())
        return [
            "--status",
            self._file(node, rid, "status.json"),
            "--io-timeout",
            f"{self.spec.io_timeout_s:g}",
            "--accept-timeout",
            f"{max(30.0, self.spec.io_timeout_s) + accept_extra:g}",
            "--deadline-s",
            f"{left:.0f}",
            "--downstream",
            f"{down.data_address}:{self.spec.port}" if down else "",
            "--ready",
            self._file(node, rid, "ready"),
        ]

    def _start(self, spawns: list[tuple[str, str, str, list[str]]],
               started: list[tuple[str, str, list[str]]]) -> dict[tuple[str, str], dict]:
        """Start relays at once; returns ``{(round id, node): status}`` for each that did not start
        (``{"dead": why}`` for a node that no longer answers, else ``{"error": why, "not_started": True}``)."""
        def one(s: tuple[str, str, str, list[str]]) -> tuple[tuple[str, str], dict | None]:
            node, rid, token, argv = s
            try:
                why = self._spawn(node, rid, token, argv, started)
            except NodeUnreachable as exc:
                return (rid, node), {"dead": str(exc)}
            if why is None:
                return (rid, node), None
            log.warning("node %s: the relay did not start: %s", node, why)
            return (rid, node), {"error": f"node {node}: the relay did not start: {why}", "not_started": True}

        if not spawns:
            return {}
        with ThreadPoolExecutor(max_workers=min(WORKERS, len(spawns))) as pool:
            return {key: st for key, st in pool.map(one, spawns) if st is not None}

    def _spawn(self, node: str, rid: str, token: str, argv: list[str], started: list) -> str | None:
        """Start one relay, its token on stdin, and return once it is ready (it read its token; a receiver also
        listens), at most START_S. None when it is; else why not, from its status or log (text from the node: only
        ever shown). A command that fails here leaves the relay to ``_stop``: its pid file names it from its start.

        The relay runs in the foreground of this command and detaches itself once ready (relay ``--detach``):
        it holds the command, and so its own stdin, until it has read its token (sshd drops input that arrives
        after the command has ended: a relay given no token exits without a status), and the command ends the
        moment it listens. Started detached by a shell instead (setsid, nohup, a loop of sleeps waiting for its
        ready file) a start cost three more programs and up to a 100-ms tick of the wait on every node."""
        script, argv = self._start_script(node, rid, argv)
        started.append((node, rid, argv))
        try:
            res = self._run_installed(node, script, f"{token}\n".encode(), START_S + 30)
        except NodeUnreachable:
            raise
        except TransportError as exc:
            return str(exc)
        return self._verdict(node, rid, res)

    def _start_script(self, node: str, rid: str, argv: list[str]) -> tuple[str, list[str]]:
        """(the shell that starts the relay ``argv`` detached and prints READY, or GONE and why; the relay's
        whole command line as it runs, for ``_stop``). See ``_spawn``."""
        ready, status, logq = (shlex.quote(self._file(node, rid, x)) for x in ("ready", "status.json", "log"))
        argv = [*argv, "--detach", self._file(node, rid, "pid"), "--start-timeout", f"{START_S:g}"]
        run = f"export {RUN_ENV}={shlex.quote(self.cluster.run_key)}; " if self.cluster.run_key else ""
        wd = shlex.quote(self.workdir(node))
        # the launcher exits NOT_INSTALLED, and starts nothing, when the program is not this version's
        script = (f"[ -d {wd} ] || mkdir -p {wd} || exit 1; {run}{shlex.join(argv)} > {logq} 2>&1; "
                  f"[ $? -ne {NOT_INSTALLED} ] || exit {NOT_INSTALLED}; "
                  f"if [ -e {ready} ]; then echo READY; else echo GONE; cat {status} 2>/dev/null || "
                  f"tail -c 1000 {logq}; fi")
        return script, argv

    def _verdict(self, node: str, rid: str, res: CommandResult) -> str | None:
        """None for a start command that says its relay is ready; else why it is not."""
        lines = res.stdout.splitlines()
        verdict = next((i for i, line in enumerate(lines) if line in ("READY", "GONE")), None)
        if res.rc != 0 or verdict is None:
            return f"the start command exited {res.rc} without a verdict: {(res.stderr or res.stdout).strip()[-300:]}"
        if lines[verdict] == "READY":
            return None
        return (f"it exited before it was ready: {_exit_reason(chr(10).join(lines[verdict + 1:]))} "
                f"(log {self._file(node, rid, 'log')})")

    def _not_started(self, jobs: list[tuple[str, list[str]]], failed: dict[tuple[str, str], dict]
                     ) -> dict[str, dict]:
        """Statuses of the paths that were not fed: the node whose relay did not start says why, the others
        name it; when that node is a receiver, the others were not tried at all (``not_fed``: no attempt of
        theirs is spent; the next round feeds that node alone)."""
        out: dict[str, dict] = {}
        for rid, path in jobs:
            culprit = next(n for n in path if (rid, n) in failed)
            cause = failed[(rid, culprit)]
            cause_text = cause.get("dead") or cause.get("error")
            for i, n in enumerate(path[1:], start=1):
                st = dict(failed.get((rid, n)) or {
                    "error": f"node {n}: nothing was sent on {'->'.join(path)}: {cause_text}",
                    "not_fed": culprit != path[0]})
                st["feeder"], st["upstream_node"] = path[0], path[i - 1]
                out[n] = st
        return out

    def _poll(self, node: str, rid: str) -> dict:
        """The relay's status (``running``, ``gone``, or what it wrote when it ended). A final status is read in the
        same command that waits (at most REAP_S, by the shell's own reads of /proc) for the relay to exit and then
        removes the round's files: such a relay is not visited again by ``_stop`` (one SSH command fewer per relay
        and round). One still there after REAP_S, or a pid file that holds no pid, is left to ``_stop``."""
        s, pid = shlex.quote(self._file(node, rid, "status.json")), self._file(node, rid, "pid")
        files = " ".join(shlex.quote(self._file(node, rid, x)) for x in ROUND_FILES)
        gone = "! { read -r st < /proc/$p/stat; } 2>/dev/null || case \"$st\" in *') '[ZX]' '*) true;; *) false;; esac"
        reap = (f"p=; {{ read -r p < {shlex.quote(pid)}; }} 2>/dev/null; case \"$p\" in ''|*[!0-9]*|0|1) p=;; esac; "
                f"i=0; while [ -n \"$p\" ] && [ $i -lt {int(REAP_S / 0.05)} ] && ! {{ {gone}; }}; do sleep 0.05; "
                f"i=$((i+1)); done; if [ -n \"$p\" ] && {{ {gone}; }}; then rm -f {files} {shlex.quote(pid)}; "
                f"echo {REAPED}; fi")
        final = f"cat {s}; echo; echo {FINAL}; {reap}"
        res = self.cluster[node].run(
            # the status file is checked again after the liveness test: the relay may write it and exit between the two
            f"if [ -f {s} ]; then {final}; elif {alive_script(pid)}; then echo '{{\"running\": true}}'; "
            f"elif [ -f {s} ]; then {final}; else echo '{{\"gone\": true}}'; fi", timeout=5 + REAP_S).check()
        # the last marker is this command's own (a status file that holds the marker text leaves its JSON broken)
        text, marker, rest = res.stdout.rpartition(f"\n{FINAL}\n")
        if not marker:
            text = rest
        if marker and REAPED in rest.split():
            self._reaped.add((node, rid))
        return json.loads(text)

    def _watch(self, jobs: list[tuple[str, list[str]]], deadline: float) -> dict[str, dict]:
        """Watch the last node of every path until it is done (the others finish with it), then collect all."""
        out: dict[tuple[str, str], dict] = {}
        misses: dict[str, int] = {}
        dead: dict[str, str] = {}

        def unresolved(tails_only: bool) -> list[tuple[str, str]]:
            todo = []
            for rid, path in jobs:
                nodes = [n for n in path if (rid, n) not in out and n not in dead]
                todo += [(nodes[-1], rid)] if tails_only and nodes and nodes[-1] == path[-1] else []
                todo += [] if tails_only else [(n, rid) for n in nodes]
            return todo

        def poll(item: tuple[str, str]) -> None:
            node, rid = item
            try:
                st = self._poll(node, rid)
                misses[node] = 0
            except NodeUnreachable as exc:
                dead[node] = str(exc)
                return
            except Exception as exc:  # noqa: BLE001 - paramiko raises its own types for a half-dead link
                misses[node] = misses.get(node, 0) + 1
                if misses[node] >= DEAD_AFTER:
                    dead[node] = f"node {node} stopped answering: {exc}"
                return
            if st.get("gone"):
                out[(rid, node)] = {"error": f"node {node}: the relay ended without a status "
                                               f"(see {self._file(node, rid, 'log')})"}
            elif not st.get("running"):
                out[(rid, node)] = st

        with ThreadPoolExecutor(max_workers=min(WORKERS, max(1, sum(len(p) for _, p in jobs)))) as pool:
            for tails_only in (True, False):
                tw = time.monotonic()
                while todo := unresolved(tails_only):
                    if time.monotonic() > deadline:
                        for node, rid in todo:
                            out[(rid, node)] = {"error": f"node {node}: transfer timed out "
                                                           f"(fanout timeout_s={self.spec.timeout_s:g})"}
                        break
                    list(pool.map(poll, todo))
                    if unresolved(tails_only):
                        time.sleep(POLL_S)
                log.debug("round: %s in %.2f s", "the last nodes done" if tails_only else "every status read",
                          time.monotonic() - tw)
        result: dict[str, dict] = {}
        for rid, path in jobs:
            for n in path[1:]:
                result[n] = {"dead": dead[n]} if n in dead else out.get((rid, n), {})
                result[n]["feeder"] = path[0]
                result[n]["upstream_node"] = path[path.index(n) - 1]
            fst = out.get((rid, path[0])) or {}
            if fst.get("error"):
                log.warning("feeder %s of %s: %s", path[0], "->".join(path), fst["error"])
        self._dead = dead
        return result

    def _stop(self, started: list[tuple[str, str, list[str]]], then: Callable[[str], str] | None = None) -> None:
        """Stop every relay of ``started`` not reaped yet; ``then``: shell run after, by node."""
        dead = self._dead

        def stop(item: tuple[str, str, list[str]]) -> None:
            node, rid, argv = item
            if node in dead or (node, rid) in self._reaped:
                return
            try:
                pid, wd = self._file(node, rid, "pid"), self.workdir(node)
                rm = " ".join(shlex.quote(f"{wd}/{rid}.{x}") for x in ROUND_FILES)
                more = f"; {then(node)}" if then else ""
                warn_left_alone(self.cluster[node].run(stop_script(pid, 2, argv) + f"; rm -f {rm}{more}",
                                                       timeout=15))
            except DeploybenchError as exc:
                log.warning("node %s: could not stop relay %s: %s", node, rid, exc)

        if started:
            with ThreadPoolExecutor(max_workers=min(WORKERS, len(started))) as pool:
                list(pool.map(stop, started))


def _exit_reason(text: str) -> str:
    """What a relay that exited at start said: its status's error, else the end of its log; one line, bounded."""
    try:
        st = json.loads(text)
    except ValueError:
        st = None
    if isinstance(st, dict):
        text = str(st.get("error") or st.get("upstream_error") or text)
    text = " ".join(text.split())
    return (text[-300:] if text else "no status, an empty log")
