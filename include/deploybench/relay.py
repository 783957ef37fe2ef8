"""The fan-out relay: the program the chain and tree strategies run on every node.

Standard library only, so a node needs nothing but a Python 3 interpreter (preflight checks
for ``python3``): the controller copies this file to the node and runs it with the
inventory's ``python``; it also runs as ``python -m deploybench.relay``.

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
    Accept one stream from the expected upstream address carrying this transfer's token;
    write every needed file into staging while hashing it, forward the same bytes to the
    downstream node as they arrive, publish (atomic rename) when every file verified.
``send ...``
    Feed a stream (header + file slices) from a verified folder to the first node.

The stream: one JSON header line ``{"token", "manifest", "files": [{path, size, sha256,
offset}]}`` then, per listed file, its bytes from ``offset`` to its end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import sys
import time

MANIFEST_NAME = ".deploybench-manifest.json"
CHUNK = 1 << 18
# Send buffer only; the receive buffer is left to the kernel's autotuning. A hop that both
# receives and forwards queues its ACKs upstream behind its own forwarded data: with equal
# fixed buffers the upstream's window barely covered that queue and every hop ran at ~84 %
# of the link (16-node lab, 100 Mbit/s); a small send buffer (short queue) and an autotuned
# receive window (wide enough for it) keep each hop at ~93 %, as fast as a single copy.
SOCK_BUF = 1 << 17


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
                with open(path) as f:
                    self.entries = json.load(f)
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
            json.dump(self.entries, f)
        os.replace(tmp, self.path)


def list_files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel != MANIFEST_NAME and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def manifest_doc(files: list[dict]) -> dict:
    files = sorted(files, key=lambda f: f["path"])
    canon = [{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files]
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return {"digest": hashlib.sha256(blob).hexdigest(), "files": canon}


def cmd_manifest(a: argparse.Namespace) -> dict:
    if not os.path.isdir(a.dir):
        return {"error": "missing", "dir": a.dir}
    cache = HashCache(a.cache)
    files = [{"path": p, "size": os.path.getsize(os.path.join(a.dir, p)), "sha256": cache.sha256(os.path.join(a.dir, p))}
             for p in list_files(a.dir)]
    cache.save()
    declared = None
    try:
        with open(os.path.join(a.dir, MANIFEST_NAME)) as f:
            declared = json.load(f)
    except (OSError, ValueError):
        pass
    return {"manifest": manifest_doc(files), "declared": declared, "hashed_bytes": cache.hashed_bytes,
            "free_bytes": shutil.disk_usage(a.dir).free}


# -- inspect ---------------------------------------------------------------------------------
def _published_digest(final: str) -> str | None:
    try:
        with open(os.path.join(final, MANIFEST_NAME)) as f:
            return json.load(f).get("digest")
    except (OSError, ValueError, AttributeError):
        return None


def cmd_inspect(a: argparse.Namespace) -> dict:
    m = json.load(sys.stdin)
    cache = HashCache(a.cache)
    published = _published_digest(a.final) == m["digest"]
    bad, good_final = [], {}
    if os.path.isdir(a.final):
        for f in m["files"]:
            p = os.path.join(a.final, f["path"])
            ok = os.path.isfile(p) and os.path.getsize(p) == f["size"] and cache.sha256(p) == f["sha256"]
            if ok:
                good_final[f["path"]] = p
            elif published:
                bad.append(f["path"])
    clean = published and not bad
    staged: dict = {}
    if not clean:
        for f in m["files"]:
            s = os.path.join(a.staging, f["path"])
            if os.path.isfile(s) and os.path.getsize(s) == f["size"] and cache.lookup(s) == f["sha256"]:
                staged[f["path"]] = "ok"
            elif f["path"] in good_final:  # reuse the good published file: link it into staging
                os.makedirs(os.path.dirname(s), exist_ok=True)
                if os.path.lexists(s):
                    os.unlink(s)
                os.link(good_final[f["path"]], s)
                cache.record(s, f["sha256"])
                staged[f["path"]] = "ok"
            elif os.path.isfile(s):
                staged[f["path"]] = min(os.path.getsize(s), f["size"])
    cache.save()
    root = a.final
    while root and not os.path.isdir(root):
        root = os.path.dirname(root)
    return {"published": clean, "bad": bad, "staged": staged, "free_bytes": shutil.disk_usage(root or "/").free,
            "hashed_bytes": cache.hashed_bytes}


# -- serve / send ----------------------------------------------------------------------------
def _tune(sock: socket.socket, timeout: float) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)


def _connect(addr: str, port: int, bind: str, deadline: float, timeout: float) -> socket.socket:
    last: Exception | None = None
    while time.monotonic() < deadline:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
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
    buf = bytearray()
    while not buf.endswith(b"\n"):
        b = conn.recv(65536 if len(buf) > 4096 else 1)
        if not b:
            raise OSError("stream closed inside the header")
        buf += b
        if len(buf) > limit:
            raise OSError("header too long")
    return bytes(buf)


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
                self.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None


def _accept(a: argparse.Namespace, st: dict) -> tuple[socket.socket, dict, bytes]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((a.listen, a.port))
    srv.listen(4)
    deadline = time.monotonic() + a.accept_timeout
    try:
        while True:
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                raise OSError(f"no stream from {a.upstream} within {a.accept_timeout:g} s")
            conn, peer = srv.accept()
            if peer[0] != a.upstream:
                st["refused"].append(f"{peer[0]}: not the upstream peer {a.upstream}")
                conn.close()
                continue
            _tune(conn, a.io_timeout)
            try:
                raw = _read_line(conn)
                header = json.loads(raw)
            except (OSError, ValueError) as exc:
                st["refused"].append(f"{peer[0]}: bad header ({exc})")
                conn.close()
                continue
            if header.get("token") != a.token:
                st["refused"].append(f"{peer[0]}: wrong transfer token")
                conn.close()
                continue
            return conn, header, raw
    finally:
        srv.close()


def _recv_some(conn: socket.socket, n: int, buf: bytearray):
    view = memoryview(buf)[: min(n, len(buf))]
    got = conn.recv_into(view)
    if got == 0:
        raise OSError("upstream closed the stream early")
    return view[:got]


def _receive_file(conn, f: dict, staging: str, need: bool, down: Downstream, cache: HashCache, st: dict,
                  buf: bytearray) -> None:
    path = os.path.join(staging, f["path"])
    left = f["size"] - f["offset"]
    out, h = None, None
    if need:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        out = open(path, "r+b" if os.path.exists(path) else "w+b")
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
            data = _recv_some(conn, left, buf)
            left -= len(data)
            st["bytes_received"] += len(data)
            down.send(data)
            if out is not None:
                out.write(data)
                h.update(data)
                st["bytes_written"] += len(data)
    finally:
        if out is not None:
            out.close()
    if need:
        if h.hexdigest() == f["sha256"]:
            cache.record(path, f["sha256"])
            st["files_ok"].append(f["path"])
        else:
            os.unlink(path)
            st["files_bad"].append(f["path"])


def publish(staging: str, final: str, manifest: dict) -> None:
    """Write the manifest into staging, then swap staging into place with renames."""
    tmp = os.path.join(staging, MANIFEST_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(staging, MANIFEST_NAME))
    old = final.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_status(path: str, st: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(st, f)
    os.replace(tmp, path)


def cmd_serve(a: argparse.Namespace) -> dict:
    st = {"role": "relay", "pid": os.getpid(), "started": time.time(), "first_byte": None, "finished": None,
          "bytes_received": 0, "bytes_written": 0, "resumed_bytes": 0, "files_ok": [], "files_bad": [],
          "refused": [], "upstream_error": None, "downstream_error": None, "published": False, "error": None}
    cache = HashCache(a.cache)
    down = Downstream(None)
    try:
        conn, header, raw = _accept(a, st)
        st["first_byte"] = time.time()
        if a.downstream:
            host, _, port = a.downstream.rpartition(":")
            try:
                down = Downstream(_connect(host, int(port), a.listen, time.monotonic() + a.accept_timeout,
                                           a.io_timeout))
                down.send(raw)
            except OSError as exc:
                down = Downstream(None, str(exc))
        os.makedirs(a.staging, exist_ok=True)
        buf = bytearray(CHUNK)
        try:
            for f in header["files"]:
                s = os.path.join(a.staging, f["path"])
                have = os.path.isfile(s) and os.path.getsize(s) == f["size"] and cache.lookup(s) == f["sha256"]
                _receive_file(conn, f, a.staging, not have, down, cache, st, buf)
        except OSError as exc:
            st["upstream_error"] = str(exc)
        finally:
            conn.close()
            down.close()
        st["downstream_error"] = down.error
        m = header["manifest"]
        complete = all(os.path.isfile(p) and cache.lookup(p) == f["sha256"]
                       for f in m["files"] for p in [os.path.join(a.staging, f["path"])])
        cache.save()
        if complete:
            publish(a.staging, a.final, m)
            st["published"] = True
    except OSError as exc:
        st["error"] = str(exc)
    finally:
        down.close()
        st["finished"] = time.time()
        _write_status(a.status, st)
    return st


def cmd_send(a: argparse.Namespace) -> dict:
    st = {"role": "feeder", "pid": os.getpid(), "started": time.time(), "first_byte": None, "finished": None,
          "bytes_sent": 0, "error": None}
    try:
        with open(a.plan) as f:
            header = json.load(f)
        header["token"] = a.token
        host, _, port = a.downstream.rpartition(":")
        sock = _connect(host, int(port), a.bind, time.monotonic() + a.accept_timeout, a.io_timeout)
        st["first_byte"] = time.time()
        try:
            sock.sendall(json.dumps(header, separators=(",", ":")).encode() + b"\n")
            for f in header["files"]:
                with open(os.path.join(a.dir, f["path"]), "rb") as src:
                    count = f["size"] - f["offset"]
                    if count:
                        st["bytes_sent"] += sock.sendfile(src, f["offset"], count)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(a.io_timeout)
            sock.recv(1)  # wait until the first hop closes: every byte was taken
        finally:
            sock.close()
    except OSError as exc:
        st["error"] = str(exc)
    finally:
        st["finished"] = time.time()
        _write_status(a.status, st)
    return st


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploybench-relay")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest")
    m.add_argument("dir")
    m.add_argument("--cache")
    i = sub.add_parser("inspect")
    i.add_argument("--final", required=True)
    i.add_argument("--staging", required=True)
    i.add_argument("--cache")
    for name in ("serve", "send"):
        s = sub.add_parser(name)
        s.add_argument("--token", required=True)
        s.add_argument("--status", required=True)
        s.add_argument("--io-timeout", type=float, default=15.0)
        s.add_argument("--accept-timeout", type=float, default=30.0)
        s.add_argument("--downstream", default="")
    s = sub.choices["serve"]
    s.add_argument("--listen", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--upstream", required=True)
    s.add_argument("--staging", required=True)
    s.add_argument("--final", required=True)
    s.add_argument("--cache")
    s = sub.choices["send"]
    s.add_argument("--plan", required=True)
    s.add_argument("--dir", required=True)
    s.add_argument("--bind", required=True)
    a = p.parse_args(argv)
    out = {"manifest": cmd_manifest, "inspect": cmd_inspect, "serve": cmd_serve, "send": cmd_send}[a.cmd](a)
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
