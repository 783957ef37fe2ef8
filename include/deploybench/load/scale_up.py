"""Scale-up under load: the spike phase starts on a few engines and the deployer adds the others while it runs.

``ScaleUp`` serves k6's target list on a loopback page (``serve``; run.js re-reads it, ``DB_TARGETS_URL``: k6
cannot re-read a file after its init stage, and consecutive k6 runs would leave gaps in the schedule at each
change). k6's first read of the page marks its scenario's start; ``after_s`` later (the warm-up and the spike's
lead: the spike's start) a thread asks the run's Deployer (the same ``scale`` and ``wait_ready`` the rollout uses:
deploybench.rollout) to run the engine on every node, waits for each added node's readiness check on its own, and
puts each in the list once it passes. ``finish`` stops the page and gives, per added node, the time from the
spike's start to its engine serving (health OK), or its error.

The deployer is asked on this machine's clock; the times are from the spike's start as k6 scheduled it (its
first read of the page + ``after_s``), so the k6 set-up before the first iteration does not count.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from deploybench.load.results import Endpoint

if TYPE_CHECKING:
    from deploybench.rollout.base import Deployer

LOG = logging.getLogger(__name__)
JOIN_MARGIN_S = 30.0  # past the ready timeout, how long finish() waits for the starter thread


class ScaleUp:
    """Grow from ``first`` (serving) to ``first`` + ``added`` engines at the spike's start (module doc).

    ``endpoints`` are every node's Endpoint (those of ``added`` once serving: the same URL the rollout recorded)."""

    def __init__(self, deployer: Deployer, first: list[str], endpoints: list[Endpoint], ready_timeout_s: float):
        by_node = {e.node: e for e in endpoints}
        missing = [n for n in first if n not in by_node]
        if missing or not first:
            raise ValueError(f"scale-up: the first nodes {first} must be among the endpoints {sorted(by_node)}")
        self.deployer, self.first, self.ready_timeout_s = deployer, list(first), ready_timeout_s
        self.more = [e for e in endpoints if e.node not in first]
        self._targets = [by_node[n] for n in first]
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._first_read: float | None = None
        self._spike_at: float | None = None
        self._asked_at: float | None = None
        self._serving: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self._after_s = 0.0

    @property
    def added(self) -> list[str]:
        return [e.node for e in self.more]

    def targets(self) -> list[dict[str, str]]:
        with self._lock:
            return [{"node": e.node, "url": e.url, "model": e.model} for e in self._targets]

    # -- the page k6 reads --------------------------------------------------------------------------
    def serve(self, initial: list[Endpoint], after_s: float) -> str:
        """Start the target page on 127.0.0.1 (an ephemeral port); its URL. ``after_s``: from k6's first read to
        the spike's start, when the deployer is asked."""
        if [e.node for e in initial] != self.first:
            raise ValueError(f"scale-up: k6 starts on {[e.node for e in initial]}, the plan on {self.first}")
        self._after_s = after_s
        owner = self

        class Page(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/targets":
                    self.send_error(404)
                    return
                owner._seen()
                body = json.dumps(owner.targets()).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="scale-up-page", daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}/targets"

    def _seen(self) -> None:
        with self._lock:
            if self._first_read is not None:
                return
            self._first_read = time.monotonic()
            self._spike_at = self._first_read + self._after_s
        self._thread = threading.Thread(target=self._grow, name="scale-up", daemon=True)
        self._thread.start()

    # -- the deployer ----------------------------------------------------------------------------------
    def _grow(self) -> None:
        time.sleep(max(0.0, (self._spike_at or 0.0) - time.monotonic()))
        self._asked_at = time.monotonic()
        names = [*self.first, *self.added]
        LOG.info("scale-up: the spike started; starting engines on %s", ", ".join(self.added))
        try:
            self.deployer.scale(names)
        except Exception as exc:  # a node that cannot start: named in the result, the others still waited for
            LOG.error("scale-up: %s", exc)
            for n in self.added:
                self._errors.setdefault(n, f"{type(exc).__name__}: {exc}"[:2000])
        with ThreadPoolExecutor(max_workers=max(1, len(self.more))) as pool:
            pool.map(self._wait_one, [e for e in self.more if e.node not in self._errors])

    def _wait_one(self, ep: Endpoint) -> None:
        try:
            self.deployer.wait_ready([ep.node], self.ready_timeout_s)
        except Exception as exc:
            self._errors[ep.node] = f"{type(exc).__name__}: {exc}"[:2000]
            return
        with self._lock:
            self._serving[ep.node] = time.monotonic()
            self._targets.append(ep)
        LOG.info("scale-up: %s serving; k6's targets now %s", ep.node, [e.node for e in self._targets])

    def finish(self) -> dict[str, Any]:
        """Stop the page, wait (bounded) for the starter; what happened, times from the spike's start."""
        if self._thread is not None:
            self._thread.join(self.ready_timeout_s + JOIN_MARGIN_S)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        spike = self._spike_at
        rel = lambda t: round(t - spike, 3) if t is not None and spike is not None else None  # noqa: E731
        added = []
        for n in self.added:
            err = self._errors.get(n)
            if spike is None and err is None:
                err = "k6 never read its target list: the spike did not start"
            elif n not in self._serving and err is None:
                err = f"not serving by the phase's end (ready timeout {self.ready_timeout_s:g} s)"
            added.append({"node": n, "serving_s": rel(self._serving.get(n)), "error": err})
        ok = [a["serving_s"] for a in added if a["serving_s"] is not None]
        return {"nodes_before": list(self.first), "nodes_after": [*self.first, *(a["node"] for a in added
                                                                               if a["serving_s"] is not None)],
                "deployer_asked_s": rel(self._asked_at), "added": added,
                "all_serving_s": max(ok) if len(ok) == len(added) and ok else None,
                "all_serving_reason": None if len(ok) == len(added) else "an added engine never served (its error)"}

    def restore(self) -> None:
        """Every engine serving again when the spike never asked for them (the phase failed before it: k6 did not
        start, or aborted); a no-op once the spike started. Raises the deployer's error, naming the node."""
        if self._first_read is not None:
            return
        LOG.warning("scale-up: the spike never started; starting the engines it stopped again: %s", self.added)
        self.deployer.scale([*self.first, *self.added])
        self.deployer.wait_ready(self.added, self.ready_timeout_s)
