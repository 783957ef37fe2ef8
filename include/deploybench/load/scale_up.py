"""Scale-up under load: the spike phase starts on a few engines and the deployer adds the others while it runs.

``ScaleUp`` serves k6's target list on a loopback page (``serve``; run.js re-reads it, ``DB_TARGETS_URL``: k6
cannot re-read a file after its init stage, and consecutive k6 runs would leave gaps in the schedule at each
change). k6's first read of the page marks its scenario's start; ``after_s`` later (the warm-up and the spike's
lead: the spike's start) a thread asks the run's Deployer to start the engine on each added node on its own
(``start_each``: a node that cannot start fails alone, named), waits for each started node's readiness check
(``wait_serving``: the rollout's readiness check; on Kubernetes the new pod's own address, which k6 is given) on
its own, and puts each in the list once it passes; the page says ``final`` once
every added node is in or failed, and run.js stops re-reading it. ``finish`` (and ``restore``) cancel a spike still
to come (an Event the thread waits on) and join the thread; ``finish`` gives, per added node, the time from the
spike's start to its engine serving (health OK) within the phase, or its error. ``restore`` starts the stopped
engines itself when nothing was asked yet (the phase failed or ended before the spike).

The deployer is asked on this machine's clock; the times are from the spike's start as k6 scheduled it (its
first read of the page + ``after_s``), so the k6 set-up before the first iteration does not count.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from deploybench.errors import DeploybenchError
from deploybench.load.results import Endpoint

if TYPE_CHECKING:
    from deploybench.rollout.base import Deployer

LOG = logging.getLogger(__name__)
JOIN_MARGIN_S = 30.0  # past the ready timeout, how long finish()/restore() wait for the starter thread
PAGE_IDLE_S = 30.0  # the target page closes a keep-alive connection idle this long


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
        self._stop = threading.Event()  # set by finish()/restore(): the spike is not asked for any more
        self._after_s = 0.0
        self._scraped: list[Endpoint] = []  # the phase's scrape list (follow): an added engine's new address goes in

    def follow(self, scraped: list[Endpoint]) -> list[Endpoint]:
        """``scraped``, the list the phase's scraper reads at each scrape (deploybench.load.scrape): an added engine
        that serves at a new address (a new pod) replaces its entry there, so its /metrics are read from it."""
        self._scraped = scraped
        return scraped

    @property
    def added(self) -> list[str]:
        return [e.node for e in self.more]

    def targets(self) -> dict[str, Any]:
        """What the page says: k6's targets now, and ``final`` once every added engine is in them or has failed (or
        the scale-up was cancelled): run.js stops re-reading the page then."""
        with self._lock:
            done = len(set(self._serving) | set(self._errors)) >= len(self.more) or self._stop.is_set()
            return {"targets": [{"node": e.node, "url": e.url, "model": e.model} for e in self._targets],
                    "final": done}

    # -- the page k6 reads --------------------------------------------------------------------------
    def serve(self, initial: list[Endpoint], after_s: float) -> str:
        """Start the target page on 127.0.0.1 (an ephemeral port); its URL. ``after_s``: from k6's first read to
        the spike's start, when the deployer is asked."""
        if [e.node for e in initial] != self.first:
            raise ValueError(f"scale-up: k6 starts on {[e.node for e in initial]}, the plan on {self.first}")
        self._after_s = after_s
        owner = self

        class Page(BaseHTTPRequestHandler):
            # keep-alive: each VU re-reads the page over its one connection, not a new TCP connection and thread
            protocol_version = "HTTP/1.1"
            timeout = PAGE_IDLE_S  # an idle connection is closed (a VU that stopped re-reading)

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
            if self._first_read is not None or self._stop.is_set():
                return
            self._first_read = time.monotonic()
            self._spike_at = self._first_read + self._after_s
            self._thread = threading.Thread(target=self._grow, name="scale-up", daemon=True)
            self._thread.start()

    # -- the deployer ----------------------------------------------------------------------------------
    def _grow(self) -> None:
        if self._stop.wait(max(0.0, (self._spike_at or 0.0) - time.monotonic())):
            return  # finished or restored before the spike: nothing is asked (restore starts them itself)
        with self._lock:  # restore() sets the event, then reads _asked_at under this lock: one of the two asks
            if self._stop.is_set():
                return
            self._asked_at = time.monotonic()
        LOG.info("scale-up: the spike started; starting engines on %s", ", ".join(self.added))
        try:
            failed = self.deployer.start_each(self.added)
        except Exception as exc:  # noqa: BLE001 - the backend could not even try: every added node, named
            failed = dict.fromkeys(self.added, exc)
        for n, err in failed.items():
            LOG.error("scale-up: %s: %s", n, err)
            self._fail(n, err)
        started = [e for e in self.more if e.node not in failed]
        if started:
            with ThreadPoolExecutor(max_workers=len(started)) as pool:
                list(pool.map(self._wait_one, started))

    def _fail(self, node: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.setdefault(node, f"{type(exc).__name__}: {exc}"[:2000])

    def _wait_one(self, ep: Endpoint) -> None:
        try:
            got = self.deployer.wait_serving(ep.node, self.ready_timeout_s)
            if got is not None and got.get("url") != ep.url:  # a new pod: k6 sends to its own address
                ep = replace(ep, url=str(got["url"]), pod=str(got.get("pod") or ""),
                             metrics_url=self.deployer.profile.metrics.url(str(got["url"])))
        except Exception as exc:  # noqa: BLE001 - NodeFailure and the transport's errors: this node's, recorded
            self._fail(ep.node, exc)
            return
        with self._lock:
            self._serving[ep.node] = time.monotonic()
            self._targets.append(ep)
            for i, s in enumerate(self._scraped):
                if s.node == ep.node and s != ep:
                    self._scraped[i] = ep  # one item assignment: the scraper's loop sees the old or the new one
        LOG.info("scale-up: %s serving; k6's targets now %s", ep.node, [e.node for e in self._targets])

    def cancel(self) -> None:
        """No spike from now on, and no start under way once this returns (bounded): what the deployer undoes after
        the phase (``settle``) is not done beside a start still running."""
        self._cancel()

    def _cancel(self) -> None:
        """No spike from now on; wait (bounded) for a start already asked to finish, so nothing starts after."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(self.ready_timeout_s + JOIN_MARGIN_S)
            if t.is_alive():
                LOG.error("scale-up: the starter thread is still waiting for the deployer after %.0f s",
                          self.ready_timeout_s + JOIN_MARGIN_S)

    def finish(self) -> dict[str, Any]:
        """Stop the page, wait (bounded) for the starter; what happened, times from the spike's start. An engine
        ready only after the phase (k6) ended did not serve within it."""
        ended = time.monotonic()
        self._cancel()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        spike = self._spike_at
        rel = lambda t: round(t - spike, 3) if t is not None and spike is not None else None  # noqa: E731
        added = []
        for n in self.added:
            err = self._errors.get(n)
            at = self._serving.get(n)
            if self._asked_at is None and err is None:
                err = ("k6 never read its target list: the spike did not start" if spike is None else
                       "the phase ended before the spike's start: no engine was asked")
            elif at is not None and at > ended and err is None:
                err = f"serving {at - ended:.1f} s after the phase ended: not serving within the phase"
                at = None
            elif at is None and err is None:
                err = f"not serving by the phase's end (ready timeout {self.ready_timeout_s:g} s)"
            added.append({"node": n, "serving_s": rel(at), "error": err})
        ok = [a["serving_s"] for a in added if a["serving_s"] is not None]
        return {"nodes_before": list(self.first), "nodes_after": [*self.first, *(a["node"] for a in added
                                                                               if a["serving_s"] is not None)],
                "deployer_asked_s": rel(self._asked_at), "added": added,
                "all_serving_s": max(ok) if len(ok) == len(added) and ok else None,
                "all_serving_reason": None if len(ok) == len(added) else "an added engine never served (its error)"}

    def restore(self) -> None:
        """Every engine serving again when the spike never asked for them (the phase failed or ended before it: k6
        did not start, or failed in the warm-up); a no-op once they were asked. Cancels a spike still to come first,
        so nothing starts after this returns. Raises the deployer's error, naming the node."""
        self._cancel()
        with self._lock:
            if self._asked_at is not None:
                return
            self._asked_at = time.monotonic()  # asked now, by restore: a second call is a no-op
        LOG.warning("scale-up: the spike never started; starting the engines it stopped again: %s", self.added)
        failed = self.deployer.start_each(self.added)
        if failed:
            raise DeploybenchError("scale-up: the engines stopped for the spike could not start again: " + "; ".join(
                f"{n}: {e}" for n, e in failed.items())[:2000])
        self.deployer.wait_ready(self.added, self.ready_timeout_s)


# -- the engines serving after a scale-up (kubernetes: new pods at new addresses) ---------------------------
LIVE_ENDPOINTS = "endpoints.json"  # in the run's load/ folder: read by every later phase before the rollout's
MAX_LIVE_BYTES = 1 * 2**20


class LiveEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")
    node: str = Field(min_length=1, max_length=253)
    url: str = Field(pattern=r"^http://[^\s/?#]+$", max_length=300)  # as the deployer makes it: scheme, host, port
    model: str = Field(max_length=500)
    pod: str | None = Field(default=None, max_length=253)


class LiveEndpoints(BaseModel):
    """The endpoints the deployer said were serving after a scale-up phase, for the rollout they came from (the
    rollout record's ``started_at``: a re-deploy makes this record stale, and it is then not read)."""

    model_config = ConfigDict(extra="forbid")
    rollout_started_at: str
    endpoints: list[LiveEndpoint] = Field(min_length=1, max_length=10_000)


def write_live(load_dir: Path, rollout_started_at: str, endpoints: list[dict[str, Any]]) -> Path:
    """Record ``endpoints`` (the deployer's ``endpoints()``) as the engines the later phases load."""
    rec = LiveEndpoints(rollout_started_at=rollout_started_at,
                        endpoints=[LiveEndpoint.model_validate(e) for e in endpoints])
    load_dir.mkdir(parents=True, exist_ok=True)
    path = load_dir / LIVE_ENDPOINTS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(rec.model_dump_json(indent=1))
    tmp.replace(path)
    return path


def read_live(load_dir: Path, rollout_started_at: str) -> list[dict[str, Any]] | None:
    """The endpoints a scale-up phase recorded for this rollout; None when there is no record or it is of another
    rollout. A record that is not one is an error naming the file and the way out."""
    path = load_dir / LIVE_ENDPOINTS
    if not path.is_file():
        return None
    try:
        if path.stat().st_size > MAX_LIVE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, over {MAX_LIVE_BYTES}")
        rec = LiveEndpoints.model_validate_json(path.read_bytes())
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise DeploybenchError(f"load: {path} is not a record of the engines serving after the scale-up ({exc}"[:1500]
                               + "); delete it to load the rollout's endpoints") from exc
    if rec.rollout_started_at != rollout_started_at:
        return None
    return [e.model_dump(exclude_none=True) for e in rec.endpoints]
