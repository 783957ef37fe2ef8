"""ScaleUp's own logic: per-node starts and failures, cancellation before the spike, the page k6 re-reads, and times
capped at the phase's end. The deployer is a stand-in recording what it was asked (the real one, on the netns lab,
is tests/integration/test_spike_lab.py); the page is the real HTTP server, read over real loopback sockets."""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest

from deploybench.errors import DeploybenchError
from deploybench.load.results import Endpoint
from deploybench.load.scale_up import ScaleUp
from deploybench.rollout.base import NodeFailure

EPS = [Endpoint(f"n{i}", f"http://127.0.0.{i}:9", "m") for i in (1, 2, 3)]


class Recorder:
    """The Deployer calls ScaleUp makes: start_each and wait_ready (through wait_serving), recorded with their time;
    ``bad`` nodes fail to start, ``late`` ones become ready only after ``late_s``."""

    def __init__(self, bad: tuple[str, ...] = (), late: tuple[str, ...] = (), late_s: float = 0.0):
        self.bad, self.late, self.late_s = bad, late, late_s
        self.started: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def start_each(self, nodes: list[str]) -> dict[str, Exception]:
        with self.lock:
            self.started += [(n, time.monotonic()) for n in nodes if n not in self.bad]
        return {n: NodeFailure(n, "could not start the sim engine: exit 1") for n in nodes if n in self.bad}

    def wait_ready(self, nodes: list[str], timeout_s: float) -> dict[str, float]:
        for n in nodes:
            if n not in {s for s, _ in self.started}:
                raise NodeFailure(n, "not started")
            if n in self.late:
                time.sleep(self.late_s)
        return dict.fromkeys(nodes, 0.0)

    def settle(self) -> None:
        """As the base Deployer's: nothing (the ssh backend leaves no autoscaler behind)."""

    def wait_serving(self, node: str, timeout_s: float) -> None:
        """As the base Deployer's: the rollout's readiness check, the endpoint the rollout recorded (None)."""
        self.wait_ready([node], timeout_s)


def _get(url: str, conn: http.client.HTTPConnection | None = None) -> tuple[dict, http.client.HTTPConnection]:
    u = urlsplit(url)
    conn = conn or http.client.HTTPConnection(u.hostname, u.port, timeout=5)
    conn.request("GET", u.path)
    resp = conn.getresponse()
    assert resp.status == 200
    return json.loads(resp.read()), conn


def _until(pred, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


def test_a_node_that_cannot_start_fails_alone_and_the_others_join_the_targets():
    dep = Recorder(bad=("n2",))
    up = ScaleUp(dep, ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    url = up.serve(EPS[:1], after_s=0.0)
    page, conn = _get(url)
    assert [t["node"] for t in page["targets"]] == ["n1"]
    _until(lambda: len(up.targets()["targets"]) == 2)
    page, _ = _get(url, conn)  # the same keep-alive connection (HTTP/1.1)
    assert [t["node"] for t in page["targets"]] == ["n1", "n3"] and page["final"] is True
    got = up.finish()
    by = {a["node"]: a for a in got["added"]}
    assert "n2" in by["n2"]["error"] and "could not start" in by["n2"]["error"] and by["n2"]["serving_s"] is None
    assert by["n3"]["error"] is None and by["n3"]["serving_s"] is not None
    assert got["nodes_after"] == ["n1", "n3"] and got["all_serving_s"] is None
    up.restore()  # asked at the spike: nothing more to start
    assert [n for n, _ in dep.started] == ["n3"]


def test_the_page_is_not_final_while_an_added_engine_is_on_its_way():
    dep = Recorder(late=("n3",), late_s=0.5)
    up = ScaleUp(dep, ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    url = up.serve(EPS[:1], after_s=0.0)
    _get(url)
    _until(lambda: len(up.targets()["targets"]) == 2)  # n2 in, n3 still starting
    assert up.targets()["final"] is False
    _until(lambda: up.targets()["final"])
    assert [t["node"] for t in up.targets()["targets"]] == ["n1", "n2", "n3"]
    got = up.finish()
    assert got["all_serving_s"] is not None and got["all_serving_s"] >= 0.4


def test_restore_before_the_spike_cancels_it_and_starts_the_stopped_engines_itself():
    """k6 read the page (its scenario started) but failed in the warm-up: the spike, planned 30 s later, never asks;
    restore() starts the engines at once and returns with the starter thread gone."""
    dep = Recorder()
    up = ScaleUp(dep, ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    _get(up.serve(EPS[:1], after_s=30.0))
    t0 = time.monotonic()
    got = up.finish()
    up.restore()
    assert time.monotonic() - t0 < 10  # not the 30 s the spike was planned at
    assert up._thread is not None and not up._thread.is_alive()
    assert sorted(n for n, _ in dep.started) == ["n2", "n3"]  # once, by restore
    assert all("spike" in a["error"] for a in got["added"]) and got["nodes_after"] == ["n1"]
    time.sleep(0.2)
    assert len(dep.started) == 2  # nothing started after restore returned
    up.restore()
    assert len(dep.started) == 2  # a second restore is a no-op


def test_restore_names_a_node_that_cannot_start_again():
    up = ScaleUp(Recorder(bad=("n3",)), ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    with pytest.raises(DeploybenchError) as exc:
        up.restore()  # k6 never read the page
    assert "n3" in str(exc.value) and "n2" not in str(exc.value)


def test_an_engine_ready_only_after_the_phase_ended_did_not_serve_within_it():
    dep = Recorder(late=("n2", "n3"), late_s=0.4)
    up = ScaleUp(dep, ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    _get(up.serve(EPS[:1], after_s=0.0))
    _until(lambda: len(dep.started) == 2)
    got = up.finish()  # the phase ends while both are still becoming ready; finish waits for them
    assert got["nodes_after"] == ["n1"] and got["all_serving_s"] is None
    assert all(a["serving_s"] is None and "after the phase ended" in a["error"] for a in got["added"])


def test_a_scale_up_spike_takes_its_share_of_a_probed_base_and_scrapes_every_node(tmp_path, monkeypatch):
    """Probed on 3 nodes, starting on 1: the base is a third of the sustained rate; every node is scraped and priced
    (run_phase stops at the spike's k6 run, which this test replaces to see what it was given)."""
    from deploybench.config import SLO, LoadSpec
    from deploybench.load import phases, spike

    seen: dict = {}

    class Stop(Exception):
        pass

    def fake_run(endpoints, spec, slo, out_dir, cap, **kw):
        seen.update(endpoints=[e.node for e in endpoints], cap=cap, **kw)
        raise Stop

    monkeypatch.setattr(spike, "run", fake_run)
    (tmp_path / "probe.result.json").write_text(json.dumps(
        {"phase": "probe", "status": "success", "analysis": {"capacity_rps": 30.0}}))
    up = ScaleUp(Recorder(), ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    spec = LoadSpec(phases=["probe", "spike"], scrape_interval_s=0)
    with pytest.raises(Stop):
        phases.run_phase("spike", EPS[:1], spec, SLO(), tmp_path, grow=up)
    assert seen["endpoints"] == ["n1"] and seen["cap"] == 30.0
    assert seen["base_share"] == pytest.approx(1 / 3)
    assert [e.node for e in seen["scrape_endpoints"]] == ["n1", "n2", "n3"]
    # a typed load_rate (no probe) is the user's: as typed
    (tmp_path / "probe.result.json").unlink()
    with pytest.raises(Stop):
        phases.run_phase("spike", EPS[:1], LoadSpec(phases=["spike"], rate=12, scrape_interval_s=0), SLO(), tmp_path,
                         grow=up)
    assert seen["base_share"] == 1.0 and seen["cap"] == 12


def test_a_restore_error_after_the_phase_failed_is_chained_never_put_in_its_place():
    from deploybench.errors import StageFailed
    from deploybench.load.results import LoadError
    from deploybench.stages import Load

    up = ScaleUp(Recorder(bad=("n2",)), ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    original = LoadError("k6 failed in the warm-up")
    Load._restore(up, original)  # logs, does not raise: the caller re-raises the original
    assert original.__context__ is not None and "n2" in str(original.__context__)
    assert any("could not serve again" in n and "n2" in n for n in original.__notes__)
    # without an error of the phase's own, the restore error is the stage's, named
    with pytest.raises(StageFailed, match="n2"):
        Load._restore(ScaleUp(Recorder(bad=("n2",)), ["n1"], EPS, ready_timeout_s=5), None)  # type: ignore[arg-type]
    Load._restore(None, None)  # not scaling up: nothing to do


def test_restore_after_a_failed_phase_waits_for_a_start_under_way_before_settling():
    """The phase failed while the starter thread was inside start_each (kubernetes: applying the spike's autoscaler):
    settle (deleting it, patching the replicas) must come after that call, not beside it, or it leaves an autoscaler
    applied after its deletion."""
    from deploybench.stages import Load

    order: list[str] = []
    began = threading.Event()

    class Slow(Recorder):
        def start_each(self, nodes: list[str]) -> dict[str, Exception]:
            order.append("start_each")
            began.set()
            time.sleep(0.5)
            got = super().start_each(nodes)
            order.append("start_each done")
            return got

        def settle(self) -> None:
            order.append("settle")

    up = ScaleUp(Slow(), ["n1"], EPS, ready_timeout_s=5)  # type: ignore[arg-type]
    url = up.serve([EPS[0]], after_s=0.0)
    _get(url)
    assert began.wait(5)
    Load._restore(up, RuntimeError("k6 exited 99 in the spike"))
    assert order == ["start_each", "start_each done", "settle"]
