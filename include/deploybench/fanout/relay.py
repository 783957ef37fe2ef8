"""The fan-out relay: the program the chain and tree strategies run on every node.

Standard library only, so a node needs nothing but a Python 3 interpreter (preflight checks
for ``python3``): the controller copies this file to the node and runs it with the
inventory's ``python``; it also runs as ``python -m deploybench.fanout.relay``.

Commands (each prints one JSON object on stdout):

``manifest DIR --cache F``
    The manifest of DIR. A file whose (device, inode, size, mtime_ns, ctime_ns) equals the
    cache's record is not hashed again: any write to a file changes its mtime and ctime, and
    ctime cannot be set back from user space, so an unchanged stat means unchanged bytes.
``inspect --final D --staging D --cache F`` (manifest on stdin)
    What this node holds: a published copy of the manifest (and which of its files are bad),
    which files are staged and verified, how many bytes of the others are staged (resume),
    and the free bytes. Good files of a published copy are hard-linked into staging, so a
    repair or an upgrade re-fetches only the files that differ.
``serve ...``
    Listen (then say so in the ``--ready`` file), accept one stream from the expected upstream
    address carrying this transfer's token;
    write every needed file into staging while hashing it, forward the same bytes to the
    downstream node as they arrive (woken for every RCVLOWAT of them), publish (atomic rename)
    when every file verified.
``send ...``
    Feed a stream (header + file slices) from a verified folder to the first node (the ``--ready``
    file appears once its token is read).

The ``--ready`` file is how the starter knows a relay started: it is written only after the
relay read its token from stdin (and, for ``serve``, listens), so whoever holds the relay's
stdin must keep it until the file appears: input that reaches a node after the command that
started the relay ended is dropped by sshd, and the relay would then exit with no token.
With ``--detach PIDFILE`` (how the controller starts it) the relay is started in the
foreground of its SSH command, reads its token there, and once ready forks: the parent records
the child in the pid file and the ready file and exits 0, the child serves in a session of its
own. The command ends when the relay is ready, or has exited (why: in its status, else at the
end of its log); ``--start-timeout`` bounds that wait.

The stream: one JSON header line ``{"token", "manifest", "files": [{path, size, sha256,
offset}]}`` then, per listed file, its bytes from ``offset`` to its end.

A relay trusts nothing its peer sends: the transfer token comes on its own stdin (never on
its command line, where any local user could read it in /proc); the manifest's digest comes
from the controller (``--expect``), and a header whose manifest does not hash to it, or that
names a file, size or digest not in it, or a path that is absolute, holds ``..``, a control
character or an empty part, is refused. Files are opened under the staging folder only, one
folder at a time without following a symbolic link (``O_NOFOLLOW``); what a stream may write
is bounded by the manifest and by the free space; ``--deadline-s`` bounds the whole serve. A
model folder holding a symbolic link is refused by ``manifest`` (a link to ~/.ssh/id_ed25519
would otherwise be sent to every node).
"""

from __future__ import annotations

import os
import stat
import sys
import time
from types import SimpleNamespace  # 0.4 ms (the parsed command line; the JSON scanner's settings)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (~2.5 ms of every relay's start)
if TYPE_CHECKING:  # annotations only
    import socket
    from typing import Any

# hashlib, shutil and socket are imported where they are used: ``inspect``, which runs on every node before and
# after each round, needs none of them when its hash cache holds every file (~6 ms of CPU fewer per start).
#
# json, socket and signal are used through their C halves (``_json``, ``_socket``, ``_signal``) where the
# interpreter has them (CPython: all of them, since 2.6 / 3.x): their Python halves import re and enum, which
# were half of a relay's start (``-X importtime``: json 13.4 ms, socket 6.0, signal 1.0; the C halves 1 ms), and
# at 48 nodes the lab starts 47 relays on its host's two cores. Elsewhere the public modules are used.
try:
    from _json import encode_basestring_ascii as _quote
    from _json import make_scanner as _make_scanner
except ImportError:  # not CPython: json itself
    _quote = _make_scanner = None  # type: ignore[assignment,misc]


def _encode(o: object, sort_keys: bool, sep: tuple[str, str], out: list) -> None:
    if isinstance(o, str):
        out.append(_quote(o))
    elif o is None or o is True or o is False:
        out.append("null" if o is None else "true" if o else "false")
    elif isinstance(o, int):
        out.append(int.__repr__(o))
    elif isinstance(o, float):
        # as json.dumps: repr, and NaN / Infinity for what has no JSON number (allow_nan)
        out.append(float.__repr__(o) if o == o and o not in (float("inf"), float("-inf")) else
                   "NaN" if o != o else "Infinity" if o > 0 else "-Infinity")
    elif isinstance(o, (list, tuple)):
        out.append("[")
        for i, v in enumerate(o):
            if i:
                out.append(sep[0])
            _encode(v, sort_keys, sep, out)
        out.append("]")
    elif isinstance(o, dict):
        out.append("{")
        for i, k in enumerate(sorted(o) if sort_keys else o):
            if not isinstance(k, str):
                raise TypeError(f"keys must be str, not {type(k).__name__}")
            out.append((sep[0] if i else "") + _quote(k) + sep[1])
            _encode(o[k], sort_keys, sep, out)
        out.append("}")
    else:
        raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def dumps(o: object, sort_keys: bool = False, separators: tuple[str, str] = (",", ":")) -> str:
    """``json.dumps(o, sort_keys=sort_keys, separators=separators)``: the same text, byte for byte (ASCII, the
    strings quoted by json's own C encoder), for what the relay writes: dicts with str keys, lists, str, int,
    float, bool, None."""
    if _quote is None:
        import json
        return json.dumps(o, sort_keys=sort_keys, separators=separators)
    out: list = []
    _encode(o, sort_keys, separators, out)
    return "".join(out)


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``: one JSON value, with json's own C scanner; ValueError for anything else (trailing
    data included). Bytes are UTF-8."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8-sig")
    if _make_scanner is None:
        import json
        return json.loads(text)
    ws = " \t\n\r"
    start = len(text) - len(text.lstrip(ws))
    # the settings json's own decoder gives its scanner (json.decoder.JSONDecoder)
    settings = SimpleNamespace(strict=True, object_hook=None, object_pairs_hook=None, parse_float=float,
                               parse_int=int, parse_constant=float, memo={})
    scan = _make_scanner(settings)  # type: ignore[arg-type]
    try:
        value, end = scan(text, start)
    except StopIteration as exc:
        raise ValueError(f"not JSON at character {exc.value}") from None
    if text[end:].strip(ws):
        raise ValueError(f"extra data at character {end}")
    return value


def load_file(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return loads(f.read())


def _net() -> Any:
    """``_socket`` (the C half of socket: the same constants and socket type, without enum), else socket."""
    try:
        import _socket
        return _socket
    except ImportError:
        import socket
        return socket


def _signals() -> Any:
    """``_signal`` (the C half of signal), else signal."""
    try:
        import _signal  # type: ignore[import-not-found]  # (no stub: typeshed has signal's)
        return _signal
    except ImportError:
        import signal
        return signal

MANIFEST_NAME = ".deploybench-manifest.json"
MAX_PATH = 4096
_HEX = set("0123456789abcdef")
CHUNK = 1 << 18
# A relay is woken once at least this much of its stream has arrived (SO_RCVLOWAT), not for every
# segment: a link paced by a shaper or a switch delivers one MTU at a time, and a relay that moved
# each one (recv, send, write, hash) spent 3.5 % of a core per 25 Mbit/s. It delays each hop by the
# time the link takes to bring that much (10 ms at 25 Mbit/s, 0.3 ms at 1 Gbit/s). 48-node lab, 25
# Mbit/s, bench/fanout.py, one run each (publishing without fsync in all): the machine 85 % busy during
# the chain and its transfer 1.14x one copy without it; 16 KiB: 71 %, 1.12x; 32 KiB: 64 %, 1.10x;
# 64 KiB: 53 %, 1.14x (the hops' delay shows). A read that times out takes what waits (_recv_waiting).
RCVLOWAT = 32 << 10
# Socket buffers are left to the kernel's autotuning. A hop that both receives and forwards
# queues its ACKs upstream behind its own forwarded data, so its receive window must cover that
# queue: equal fixed buffers ran every hop at ~84 % of the link (16-node lab, 100 Mbit/s). A
# fixed 128 KiB send buffer with an autotuned receive window did better, but a hop then holds
# little to ride out its downstream's hiccups: in bench/fanout.py (16 nodes, 100 Mbit/s, the two
# alternated in one session) the chain's transfer took 1.09-1.10x one copy with it and 1.07x
# with both autotuned (48 nodes at 25 Mbit/s: no difference).


# -- hash cache ------------------------------------------------------------------------------
def _key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}"


def _sig(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class HashCache:
    """sha256 of files by inode, valid while size, mtime and ctime are unchanged."""

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict = {}
        self.hashed_bytes = 0
        if path:
            try:
                self.entries = load_file(path)
                if not isinstance(self.entries, dict):
                    self.entries = {}
            except (OSError, ValueError):
                self.entries = {}

    def lookup(self, path: str) -> str | None:
        st = os.stat(path)
        e = self.entries.get(_key(st))
        return e[1] if e and e[0] == _sig(st) else None

    def record(self, path: str, digest: str) -> None:
        st = os.stat(path)
        self.entries[_key(st)] = [_sig(st), digest]

    def sha256(self, path: str) -> str:
        import hashlib
        digest = self.lookup(path)
        if digest is None:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    self.hashed_bytes += len(chunk)
            digest = h.hexdigest()
            self.record(path, digest)
        return digest

    def save(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(dumps(self.entries))
        os.replace(tmp, self.path)


def path_problem(path: object) -> str | None:
    """Why ``path`` may not name a file of a model folder (None: it may): relative, ``/``-separated,
    no empty, ``.`` or ``..`` part, no control character, not the manifest itself."""
    if not isinstance(path, str) or not path:
        return "not a non-empty string"
    if len(path) > MAX_PATH:
        return f"longer than {MAX_PATH} characters"
    if path.startswith("/"):
        return "an absolute path"
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        return "a control character in it"
    if "\\" in path:
        return "a backslash in it"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "an empty, '.' or '..' part"
    if path == MANIFEST_NAME:
        return "the manifest's own name"
    return None


def entry_problem(f: object) -> str | None:
    """Why ``f`` is not a manifest entry ``{path, size, sha256}`` (None: it is)."""
    if not isinstance(f, dict):
        return "not an object"
    why = path_problem(f.get("path"))
    if why:
        return f"path {str(f.get('path'))[:200]!r}: {why}"
    size, digest = f.get("size"), f.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"{f['path']}: size {size!r} is not a byte count"
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _HEX:
        return f"{f['path']}: sha256 {str(digest)[:80]!r} is not a hex digest"
    return None


def list_files(root: str) -> tuple[list[str], list[str]]:
    """(regular files, refused entries) under ``root``: a symbolic link (to a file or a folder), a
    device, a fifo or a name that is not a safe path is refused, never followed nor listed."""
    out, refused = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in list(dirnames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                refused.append(f"{os.path.relpath(full, root)} -> {os.readlink(full)} (a symbolic link)")
                dirnames.remove(name)
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel == MANIFEST_NAME or rel.endswith(".tmp"):
                continue
            st = os.lstat(full)
            if stat.S_ISLNK(st.st_mode):
                refused.append(f"{rel} -> {os.readlink(full)} (a symbolic link)")
            elif not stat.S_ISREG(st.st_mode):
                refused.append(f"{rel} (not a regular file)")
            elif path_problem(rel):
                refused.append(f"{rel!r} ({path_problem(rel)})")
            else:
                out.append(rel)
    return sorted(out), refused


def open_under(root: str, rel: str, write: bool) -> int:
    """A file descriptor for ``root/rel``, opened one folder at a time with ``O_NOFOLLOW``: no symbolic
    link is followed, so nothing outside ``root`` is ever opened. ``write`` creates it and its folders."""
    why = path_problem(rel)
    if why:
        raise OSError(f"refused path {rel[:200]!r}: {why}")
    nofollow = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    parts = rel.split("/")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | nofollow)
    try:
        for part in parts[:-1]:
            if write:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | nofollow, dir_fd=fd)
            os.close(fd)
            fd = nxt
        flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
        out = os.open(parts[-1], flags | nofollow, 0o644, dir_fd=fd)
    finally:
        os.close(fd)
    real = os.path.realpath(f"/proc/self/fd/{out}")
    top = os.path.realpath(root)
    if os.path.isdir("/proc/self/fd") and not real.startswith(top.rstrip("/") + "/"):
        os.close(out)
        raise OSError(f"refused path {rel[:200]!r}: it resolves to {real}, outside {top}")
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(f"refused path {rel[:200]!r}: not a regular file")
    return out


def regular_file(path: str) -> bool:
    """A regular file, not a symbolic link to one."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def manifest_doc(files: list[dict]) -> dict:
    import hashlib
    files = sorted(files, key=lambda f: f["path"])
    canon = [{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files]
    blob = dumps(canon, sort_keys=True).encode()
    return {"digest": hashlib.sha256(blob).hexdigest(), "files": canon}


def cmd_manifest(a: Args) -> dict:
    if not os.path.isdir(a.dir):
        return {"error": "missing", "dir": a.dir}
    if os.path.islink(a.dir.rstrip("/")):
        return {"error": "refused", "dir": a.dir, "paths": [f"{a.dir} -> {os.readlink(a.dir.rstrip('/'))} (the "
                                                             "model folder is a symbolic link)"]}
    names, refused = list_files(a.dir)
    if refused:
        return {"error": "refused", "dir": a.dir, "paths": refused[:20], "count": len(refused)}
    cache = HashCache(a.cache)
    files = [
        {
            "path": p,
            "size": os.path.getsize(os.path.join(a.dir, p)),
            "sha256": cache.sha256(os.path.join(a.dir, p)),
        }
        for p in names
    ]
    cache.save()
    declared = None
    try:
        declared = load_file(os.path.join(a.dir, MANIFEST_NAME))
    except (OSError, ValueError):
        pass
    return {"manifest": manifest_doc(files), "declared": declared, "hashed_bytes": cache.hashed_bytes,
            "free_bytes": _free_bytes(a.dir)}


# -- inspect ---------------------------------------------------------------------------------
def _published_digest(final: str) -> str | None:
    try:
        return load_file(os.path.join(final, MANIFEST_NAME)).get("digest")
    except (OSError, ValueError, AttributeError):
        return None


def cmd_inspect(a: Args) -> dict:
    return inspect_folder(loads(sys.stdin.read()), a.final, a.staging, a.cache)


def inspect_folder(m: dict, final: str, staging: str, cache_path: str | None) -> dict:
    """``inspect``'s answer for manifest ``m``; ``serve`` also runs it on the copy it just published, so the
    controller reads the verification in the relay's status instead of starting one more program per node."""
    bad_entries = [why for f in m["files"] if (why := entry_problem(f))]
    if bad_entries:
        return {"error": "refused", "paths": bad_entries[:20]}
    cache = HashCache(cache_path)
    published = _published_digest(final) == m["digest"]
    bad, good_final = [], {}
    if os.path.isdir(final):
        for f in m["files"]:
            p = os.path.join(final, f["path"])
            ok = regular_file(p) and os.path.getsize(p) == f["size"] and cache.sha256(p) == f["sha256"]
            if ok:
                good_final[f["path"]] = p
            elif published:
                bad.append(f["path"])
    clean = published and not bad
    staged: dict = {}
    if not clean:
        for f in m["files"]:
            s = os.path.join(staging, f["path"])
            if regular_file(s) and os.path.getsize(s) == f["size"] and cache.lookup(s) == f["sha256"]:
                staged[f["path"]] = "ok"
            elif f["path"] in good_final:  # reuse the good published file: link it into staging
                os.makedirs(os.path.dirname(s), exist_ok=True)
                if os.path.lexists(s):
                    os.unlink(s)
                os.link(good_final[f["path"]], s)
                cache.record(s, f["sha256"])
                staged[f["path"]] = "ok"
            elif regular_file(s):
                staged[f["path"]] = min(os.path.getsize(s), f["size"])
    cache.save()
    root = final
    while root and not os.path.isdir(root):
        root = os.path.dirname(root)
    return {"published": clean, "bad": bad, "staged": staged, "free_bytes": _free_bytes(root or "/"),
            "hashed_bytes": cache.hashed_bytes}


# -- serve / send ----------------------------------------------------------------------------
def _tune(sock: socket.socket, timeout: float) -> None:
    net = _net()
    sock.setsockopt(net.IPPROTO_TCP, net.TCP_NODELAY, 1)
    sock.settimeout(timeout)


def _connect(addr: str, port: int, bind: str, deadline: float, timeout: float, net: Any = None) -> socket.socket:
    """A connected TCP socket of ``net`` (a module with socket's API: _net() unless given), retried until
    ``deadline``."""
    net = net or _net()
    last: Exception | None = None
    while time.monotonic() < deadline:
        s = net.socket(net.AF_INET, net.SOCK_STREAM)
        try:
            _tune(s, timeout)
            s.bind((bind, 0))
            s.connect((addr, port))
            return s
        except OSError as exc:
            s.close()
            last = exc
            time.sleep(0.05)
    raise OSError(f"cannot connect to {addr}:{port}: {last}")


def _read_line(conn: socket.socket, limit: int = 64 << 20) -> bytes:
    """The stream's header line, and not one byte of the body behind it: what the socket holds is peeked
    (MSG_PEEK) and only the bytes up to the newline are taken. A few calls whatever the header's size: read
    a byte at a time (as it once was, for its first 4 kB) the header of a 6-file model cost each hop of a
    chain ~9 ms, and a 48-node chain's last node its first byte 0.45 s after its first. (Past 4 kB it then
    read 64 kB at a time, which took the first file's bytes into the header: a model of more than about 30
    files could not be streamed.)"""
    peek = _net().MSG_PEEK
    buf = bytearray()
    while True:
        seen = conn.recv(65536, peek)
        if not seen:
            raise OSError("stream closed inside the header")
        end = seen.find(b"\n")
        buf += conn.recv(len(seen) if end < 0 else end + 1)  # bytes already held: recv returns them all
        if buf.endswith(b"\n"):
            return bytes(buf)
        if len(buf) > limit:
            raise OSError("header too long")


class Downstream:
    """The next hop; on the first error forwarding stops and this node still keeps its own copy."""

    def __init__(self, sock: socket.socket | None, error: str | None = None):
        self.sock, self.error, self.sent = sock, error, 0

    def send(self, data) -> None:
        if self.sock is None:
            return
        try:
            self.sock.sendall(data)
            self.sent += len(data)
        except OSError as exc:
            self.error = f"forwarding failed after {self.sent} bytes: {exc}"
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(_net().SHUT_WR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None


def header_problem(header: object, expect: str, free_bytes: int, held=lambda f: False) -> str | None:
    """Why a stream's header may not be written (None: it may). The manifest must hash to ``expect`` (the
    digest the controller gave this relay); every file must be one of the manifest's, with its size and
    digest, sent once, from an offset inside it; the bytes it carries for files this node does not hold
    yet (``held``) must fit in ``free_bytes``."""
    if not isinstance(header, dict) or not isinstance(header.get("manifest"), dict):
        return "no manifest in the header"
    entries = header["manifest"].get("files")
    if not isinstance(entries, list):
        return "the manifest has no file list"
    for f in entries:
        why = entry_problem(f)
        if why:
            return f"manifest entry {why}"
    digest = manifest_doc(entries)["digest"]
    if digest != expect:
        return f"manifest {digest[:12]} is not the expected {expect[:12]}"
    known = {f["path"]: f for f in entries}
    files, seen, total = header.get("files"), set(), 0
    if not isinstance(files, list):
        return "no file list in the header"
    for f in files:
        if not isinstance(f, dict) or f.get("path") not in known:
            return f"file {str(f.get('path') if isinstance(f, dict) else f)[:200]!r} is not in the manifest"
        m = known[f["path"]]
        if f.get("size") != m["size"] or f.get("sha256") != m["sha256"]:
            return f"file {f['path']!r}: size or sha256 differs from the manifest's"
        off = f.get("offset")
        if not isinstance(off, int) or isinstance(off, bool) or not 0 <= off <= m["size"]:
            return f"file {f['path']!r}: offset {off!r} is outside 0..{m['size']}"
        if f["path"] in seen:
            return f"file {f['path']!r} is listed twice"
        seen.add(f["path"])
        total += 0 if held(m) else m["size"] - off
    if total > free_bytes:
        return f"the stream carries {total} bytes, only {free_bytes} are free"
    return None


def _free_bytes(path: str) -> int:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or "/")  # what shutil.disk_usage(path).free says, without importing shutil
    return st.f_bavail * st.f_frsize


def _held(staging: str, cache: HashCache):
    """Whether a manifest file is already staged and verified on this node (it is forwarded, not written)."""
    def held(f: dict) -> bool:
        p = os.path.join(staging, f["path"])
        return regular_file(p) and os.path.getsize(p) == f["size"] and cache.lookup(p) == f["sha256"]

    return held


def _ready(a: Args, **facts: Any) -> None:
    """Tell the starter this relay started (``--ready``): written whole (rename), after the token was read; with
    ``--detach`` the relay then goes on in the background."""
    if a.detach:
        _detach(a, facts)
    elif a.ready:
        _write_status(a.ready, {"pid": os.getpid(), **facts})


def _accept_one(srv: Any) -> tuple[Any, Any]:
    """``srv.accept()``: with ``_socket``'s type, whose accept gives the new descriptor, as socket.accept does."""
    if hasattr(srv, "accept"):
        return srv.accept()
    fd, peer = srv._accept()
    return type(srv)(srv.family, srv.type, srv.proto, fd), peer


def _listen(a: Args) -> socket.socket:
    net = _net()
    srv = net.socket(net.AF_INET, net.SOCK_STREAM)
    try:
        srv.setsockopt(net.SOL_SOCKET, net.SO_REUSEADDR, 1)
        srv.bind((a.listen, a.port))
        srv.listen(4)
    except OSError as exc:
        srv.close()
        raise OSError(f"cannot listen on {a.listen}:{a.port}: {exc}") from exc
    return srv


def _accept(a: Args, srv: socket.socket, st: dict, cache: HashCache) -> tuple[socket.socket, dict, bytes]:
    deadline = min(time.monotonic() + a.accept_timeout, a.deadline_at)
    try:
        while True:
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                bound = (f"{a.accept_timeout:g} s" if deadline < a.deadline_at else
                         "the transfer's deadline (--deadline-s)")
                raise OSError(f"no stream from {a.upstream} within {bound}")
            try:
                conn, peer = _accept_one(srv)
            except TimeoutError:
                continue  # the deadline's check above says whose stream did not come
            if peer[0] != a.upstream:
                st["refused"].append(f"{peer[0]}: not the upstream peer {a.upstream}")
                conn.close()
                continue
            _tune(conn, a.io_timeout)
            try:
                raw = _read_line(conn)
                header = loads(raw)
            except (OSError, ValueError) as exc:
                st["refused"].append(f"{peer[0]}: bad header ({exc})")
                conn.close()
                continue
            if not isinstance(header, dict) or header.get("token") != a.token:
                st["refused"].append(f"{peer[0]}: wrong transfer token")
                conn.close()
                continue
            why = header_problem(header, a.expect, _free_bytes(a.staging), _held(a.staging, cache))
            if why:
                st["refused"].append(f"{peer[0]}: refused header: {why}")
                conn.close()
                continue
            return conn, header, raw
    finally:
        srv.close()


def _batch_reads(conn: socket.socket) -> None:
    """Wake on RCVLOWAT bytes, not on each segment (the stream's end still wakes at once); where the system
    does not have the option, as before."""
    net = _net()
    try:
        conn.setsockopt(net.SOL_SOCKET, net.SO_RCVLOWAT, RCVLOWAT)
    except (OSError, AttributeError):
        pass


def _recv_waiting(conn: socket.socket, view: memoryview) -> int:
    """After a read timed out (``--io-timeout``): the bytes that wait, fewer than RCVLOWAT (a stream trickling
    in, or a kernel that does not wake at the mark as it should), and from then on a read for every segment,
    as without the mark; the timeout again if none wait. The mark may delay a read, never fail one."""
    net = _net()
    timeout = conn.gettimeout()
    conn.settimeout(0)  # a plain non-blocking read: Python's timed read would wait for the mark again
    try:
        got = conn.recv_into(view)
    except BlockingIOError:
        raise TimeoutError(f"no byte from upstream in {timeout:g} s (--io-timeout)") from None
    finally:
        conn.settimeout(timeout)
    try:
        conn.setsockopt(net.SOL_SOCKET, net.SO_RCVLOWAT, 1)
    except OSError:
        pass
    return got


def _recv_some(conn: socket.socket, n: int, buf: bytearray, deadline_at: float):
    if time.monotonic() > deadline_at:
        raise OSError("the transfer passed its deadline (--deadline-s)")
    view = memoryview(buf)[: min(n, len(buf))]
    try:
        got = conn.recv_into(view)
    except TimeoutError:
        got = _recv_waiting(conn, view)
    if got == 0:
        raise OSError("upstream closed the stream early")
    return view[:got]


def _receive_file(conn, f: dict, staging: str, need: bool, down: Downstream, cache: HashCache, st: dict,
                  buf: bytearray, deadline_at: float) -> None:
    import hashlib
    path = os.path.join(staging, f["path"])
    left = f["size"] - f["offset"]
    out, h = None, None
    if need:
        out = os.fdopen(open_under(staging, f["path"], write=True), "r+b")
        h = hashlib.sha256()
        # resume: hash the prefix already on disk, drop anything past the offset
        out.truncate(f["offset"])
        out.seek(0)
        prefix = f["offset"]
        while prefix > 0:
            chunk = out.read(min(prefix, 1 << 20))
            if not chunk:
                break
            h.update(chunk)
            prefix -= len(chunk)
        out.seek(f["offset"])
        st["resumed_bytes"] += f["offset"]
    try:
        while left > 0:
            data = _recv_some(conn, left, buf, deadline_at)
            left -= len(data)
            st["bytes_received"] += len(data)
            down.send(data)
            if out is not None and h is not None:
                out.write(data)
                h.update(data)
                st["bytes_written"] += len(data)
    finally:
        if out is not None:
            out.close()
    if h is not None:
        if h.hexdigest() == f["sha256"]:
            cache.record(path, f["sha256"])
            st["files_ok"].append(f["path"])
        else:
            os.unlink(path)
            st["files_bad"].append(f["path"])


def old_name(final: str) -> str:
    """Where the previous copy of ``final`` waits while the new one is renamed in: a dot name, which no
    model name can be (model names start with a letter or digit), so publishing ``x`` never touches a
    model called ``x.old``."""
    parent, name = os.path.split(final.rstrip("/"))
    return os.path.join(parent, f".{name}.deploybench-old")


def publish(staging: str, final: str, manifest: dict) -> None:
    """Write the manifest into staging, then swap staging into place with renames.

    Nothing is flushed to disk (fsync): what makes a copy trusted is the check every run makes before
    using it (``inspect``: each file's size and sha256 against the manifest the controller holds), not
    the disk's state after a crash: a manifest lost or cut short reads as "not published" and the files
    still good are reused. The manifest's fsync was all the stage had, and it cost what a journal commit
    costs: with ext4's ordered data it waits for the data of the files written before it (on a real node
    the model's, still in its page cache), and on the lab's one shared disk for every node's. Measured on
    a 16-node lab (128 MiB, 100 Mbit/s): publishing took 0.2 s after one copy and 0.4-1.6 s per node
    after a chain."""
    import shutil
    tmp = os.path.join(staging, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        f.write(dumps(manifest))
    os.replace(tmp, os.path.join(staging, MANIFEST_NAME))
    old = old_name(final)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_status(path: str, st: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps(st))
    os.replace(tmp, path)


def cmd_serve(a: Args) -> dict:
    st: dict[str, Any] = {
          "role": "relay", "pid": os.getpid(), "started": time.time(), "first_byte": None, "finished": None,
          "bytes_received": 0, "bytes_written": 0, "resumed_bytes": 0, "files_ok": [], "files_bad": [],
          "refused": [], "upstream_error": None, "downstream_error": None, "published": False, "error": None}
    cache = HashCache(a.cache)
    down = Downstream(None)
    try:
        import hashlib  # noqa: F401 - now, while every relay starts, not on the chain's path (the header's digest)
        os.makedirs(a.staging, exist_ok=True)
        srv = _listen(a)
        _ready(a, listening=f"{a.listen}:{a.port}")
        st["pid"] = os.getpid()  # with --detach, the child's
        conn, header, raw = _accept(a, srv, st, cache)
        st["first_byte"] = time.time()
        _batch_reads(conn)
        if a.downstream:
            host, _, port = a.downstream.rpartition(":")
            try:
                down = Downstream(_connect(host, int(port), a.listen, min(time.monotonic() + a.accept_timeout,
                                                                          a.deadline_at), a.io_timeout))
                down.send(raw)
            except OSError as exc:
                down = Downstream(None, str(exc))
        buf = bytearray(CHUNK)
        try:
            for f in header["files"]:
                s = os.path.join(a.staging, f["path"])
                have = regular_file(s) and os.path.getsize(s) == f["size"] and cache.lookup(s) == f["sha256"]
                _receive_file(conn, f, a.staging, not have, down, cache, st, buf, a.deadline_at)
        except OSError as exc:
            st["upstream_error"] = str(exc)
        finally:
            conn.close()
            down.close()
        st["downstream_error"] = down.error
        m = header["manifest"]
        complete = all(regular_file(p) and cache.lookup(p) == f["sha256"]
                       for f in m["files"] for p in [os.path.join(a.staging, f["path"])])
        cache.save()
        if complete:
            publish(a.staging, a.final, m)
            st["published"] = True
            # the published copy checked as ``inspect`` checks it (sizes, each file's sha256 by the cache the
            # stream just filled), in this process: no further program start on the node to verify it
            try:
                st["inspect"] = inspect_folder(m, a.final, a.staging, a.cache)
            except (OSError, ValueError, KeyError, TypeError):
                pass  # the controller inspects this node itself
    except OSError as exc:
        st["error"] = str(exc)
    finally:
        _end_start_bound(a)
        down.close()
        st["finished"] = time.time()
        _write_status(a.status, st)
    return st


def cmd_send(a: Args) -> dict:
    import socket
    st: dict[str, Any] = {
          "role": "feeder", "pid": os.getpid(), "started": time.time(), "first_byte": None, "finished": None,
          "bytes_sent": 0, "error": None}
    try:
        _ready(a)
        st["pid"] = os.getpid()
        header = load_file(a.plan)
        why = next((w for f in header["manifest"]["files"] if (w := entry_problem(f))), None)
        if why:
            raise OSError(f"refused plan: manifest entry {why}")
        header["token"] = a.token
        host, _, port = a.downstream.rpartition(":")
        sock = _connect(host, int(port), a.bind, min(time.monotonic() + a.accept_timeout, a.deadline_at),
                        a.io_timeout, socket)  # socket's own: its sendfile (one feeder a chain, not a relay a node)
        st["first_byte"] = time.time()
        try:
            sock.sendall(dumps(header).encode() + b"\n")
            for f in header["files"]:
                with os.fdopen(open_under(a.dir, f["path"], write=False), "rb") as src:
                    count = f["size"] - f["offset"]
                    if count:
                        if time.monotonic() > a.deadline_at:
                            raise OSError("the transfer passed its deadline (--deadline-s)")
                        st["bytes_sent"] += sock.sendfile(src, f["offset"], count)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(a.io_timeout)
            sock.recv(1)  # wait until the first hop closes: every byte was taken
        finally:
            sock.close()
    except OSError as exc:
        st["error"] = str(exc)
    finally:
        _end_start_bound(a)
        st["finished"] = time.time()
        _write_status(a.status, st)
    return st


def _token_from_stdin() -> str:
    """The transfer token: the first line of stdin (not an argument: /proc/<pid>/cmdline is public).
    stdin is then pointed at /dev/null, so the relay holds no pipe of the command that started it."""
    token = sys.stdin.readline().strip()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if not token:
        raise SystemExit("deploybench-relay: no transfer token on stdin (the controller writes it there)")
    return token


class Args(SimpleNamespace):
    """A parsed command line: one attribute per option (``--io-timeout`` is ``io_timeout``), and ``cmd``."""


REQUIRED = object()
_STREAM: dict[str, tuple[Any, Any]] = {
    "status": (str, REQUIRED), "io-timeout": (float, 15.0), "accept-timeout": (float, 30.0),
    "deadline-s": (float, 3600.0),  # the whole transfer ends within this
    "downstream": (str, ""),
    "ready": (str, ""),  # written once the relay read its token (serve: and listens)
    "detach": (str, ""),  # a pid file: once ready, the relay goes on in the background (see _detach)
    "start-timeout": (float, 15.0),  # with --detach: ready within this, else it exits saying so
}
# command -> (its options: name -> (type, default), its positional arguments)
COMMANDS: dict[str, tuple[dict[str, tuple[Any, Any]], tuple[str, ...]]] = {
    "manifest": ({"cache": (str, None)}, ("dir",)),
    "inspect": ({"final": (str, REQUIRED), "staging": (str, REQUIRED), "cache": (str, None)}, ()),
    "serve": ({**_STREAM, "listen": (str, REQUIRED), "port": (int, REQUIRED), "upstream": (str, REQUIRED),
               "staging": (str, REQUIRED), "final": (str, REQUIRED), "cache": (str, None),
               "expect": (str, REQUIRED)}, ()),  # expect: the manifest digest the controller expects
    "send": ({**_STREAM, "plan": (str, REQUIRED), "dir": (str, REQUIRED), "bind": (str, REQUIRED)}, ()),
}
USAGE = "usage: deploybench-relay {manifest,inspect,serve,send} [--option value ...]"


def parse_args(argv: list[str]) -> Args:
    """The command line, as argparse would read it for these commands (``--name value`` or ``--name=value``).
    Not argparse: its imports (re, gettext, locale, shutil) cost ~7 ms of CPU at every relay's start, on every
    node, and at 48 nodes those starts share the controller host's cores in the lab. A bad line exits 2 naming
    what is wrong, as argparse does."""
    def bad(why: str) -> SystemExit:
        sys.stderr.write(f"{USAGE}\ndeploybench-relay: error: {why}\n")
        return SystemExit(2)

    if not argv:
        raise bad("a command is required")
    if "-h" in argv or "--help" in argv:
        sys.stdout.write(f"{USAGE}\n")
        raise SystemExit(0)
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        raise bad(f"unknown command {cmd!r} (choose from {', '.join(COMMANDS)})")
    options, positional = COMMANDS[cmd]
    values: dict[str, Any] = {}
    given: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--"):
            given.append(arg)
            i += 1
            continue
        name, eq, text = arg[2:].partition("=")
        if name not in options:
            raise bad(f"unrecognized option --{name} for {cmd}")
        if not eq:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                raise bad(f"option --{name} expects a value")
            text, i = rest[i + 1], i + 1
        kind = options[name][0]
        try:
            values[name] = kind(text)
        except ValueError:
            raise bad(f"option --{name}: invalid {kind.__name__} value {text!r}") from None
        i += 1
    if len(given) != len(positional):
        raise bad(f"{cmd} takes {len(positional)} argument(s) ({' '.join(positional) or 'none'}), got {given!r}")
    missing = [f"--{n}" for n, (_, default) in options.items() if default is REQUIRED and n not in values]
    if missing:
        raise bad(f"{cmd}: the following options are required: {', '.join(missing)}")
    out = {n.replace("-", "_"): values.get(n, default) for n, (_, default) in options.items()}
    return Args(cmd=cmd, **out, **dict(zip(positional, given)))


def _start_bound(a: Args) -> None:
    """With ``--detach``: from its start the pid file names this process (a controller that gave up on the start
    command still stops it by that file), and the relay exits, with a status saying why, if it is not ready within
    ``--start-timeout`` (a token that never comes): its starter waits for it in the foreground. A system call that
    never returns (a hung mount) is not interrupted: there the controller's own bound on the command is the last."""
    if not a.detach:
        return
    signal = _signals()
    _write_pid_file(a.detach, os.getpid())
    what = "its token read, the staging folder made, listening" if a.cmd == "serve" else "its token read"

    def expired(signum: int, frame: object) -> None:
        try:
            _write_status(a.status, {"error": f"not ready within --start-timeout {a.start_timeout:g} s ({what})",
                                     "finished": time.time()})
        finally:
            os._exit(3)

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, a.start_timeout))


def _end_start_bound(a: Args) -> None:
    """The start bound no longer applies (the relay is ready, or ends with a status of its own). The signal is
    ignored before the timer is stopped: one already caught then runs no handler later (over a status being
    written, or in the child after the fork)."""
    if a.detach:
        signal = _signals()
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)


def _write_pid_file(path: str, pid: int) -> None:
    """A pid file as ``transport.spawn_script`` writes one: the pid, ``run=`` (DEPLOYBENCH_RUN), ``argv=`` this
    process's command line as /proc shows it (decoded as deploybench.leftovers decodes it), written whole."""
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = [x.decode(errors="replace") for x in f.read().split(b"\0")[:-1]]
    run = os.environ.get("DEPLOYBENCH_RUN")
    lines = [str(pid)] + ([f"run={run}"] if run else []) + [f"argv={dumps(cmdline, separators=(', ', ': '))}"]
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _detach(a: Args, facts: dict) -> None:
    """Go on in the background, once ready (``--detach PIDFILE``): fork; the parent records the child in the pid
    file and the ready file and exits 0; the child, in a session of its own, serves, but only once the parent
    says it recorded it (a byte on a pipe: a parent that failed or died leaves it an end of file, and it exits
    unrecorded, never serving with no pid file to stop it by). Its starter (one SSH command) so learns that the
    relay listens when that command returns: no polling for the ready file, and no setsid, nohup or sleep
    started on the node."""
    _end_start_bound(a)
    sys.stdout.flush()
    sys.stderr.flush()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(w)
        os.setsid()
        # output that is not a file (a pipe, the SSH channel itself) would keep the starter's command open until
        # the transfer ends: the status file says what happened, so such output goes nowhere
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.dup2(null, fd)
        os.close(null)
        recorded = os.read(r, 1) == b"1"
        os.close(r)
        if not recorded:
            os._exit(1)
        return
    os.close(r)
    code = 1
    try:
        _write_pid_file(a.detach, child)
        if a.ready:
            _write_status(a.ready, {"pid": child, **facts})
        os.write(w, b"1")
        code = 0
    except BaseException as exc:  # noqa: BLE001 - whatever it was, the child must not serve unrecorded
        sys.stderr.write(f"deploybench-relay: could not record the relay (pid {child}) in {a.detach}: {exc!r}\n")
    finally:
        os._exit(code)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if a.cmd in ("serve", "send"):
        _start_bound(a)
        a.token = _token_from_stdin()
        a.deadline_at = time.monotonic() + a.deadline_s
    out = {"manifest": cmd_manifest, "inspect": cmd_inspect, "serve": cmd_serve, "send": cmd_send}[a.cmd](a)
    sys.stdout.write(dumps(out))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
