"""The cluster lease against a real PostgreSQL (a throwaway database on the embedded server).

Taking, waiting, failing fast with the holder named, expiry and take-over, renewals refused to a
run that lost the lease, break by hand, runs left for cleanup, races between many takers, and the
heartbeat: it keeps a lease alive past its TTL, and stops the main thread when the lease is broken.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from deploybench.config import LeaseSpec
from deploybench.lease import Grant, Heartbeat, Holder, LeaseBusy, LeaseLost, LeaseStore, raise_if_lost

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]

FAST = LeaseSpec(ttl_s=2, heartbeat_s=0.5, wait_s=0, on_busy="fail")


@pytest.fixture
def store(dsn) -> LeaseStore:
    return LeaseStore(dsn)


@pytest.fixture
def cluster(request) -> str:
    return f"lz-{request.node.name[:40]}"


def test_a_held_cluster_refuses_a_second_run_naming_the_holder_and_the_way_out(store, cluster):
    g = store.acquire(cluster, Holder("run-a", "deploybench_run", "ctl-1", 4242), FAST)
    assert g.info.holder == "run-a" and g.taken_over is None and g.cleanup == []
    with pytest.raises(LeaseBusy) as err:
        store.acquire(cluster, Holder("run-b"), FAST)
    msg = str(err.value)
    for part in ("run-a", "deploybench_run", "ctl-1", "4242", f"deploybench lease break {cluster}", "on_busy=fail"):
        assert part in msg
    assert err.value.info.holder == "run-a"
    # the same run taking it again (a retried task) keeps it
    again = store.acquire(cluster, Holder("run-a"), FAST)
    assert again.info.holder == "run-a" and again.info.acquired_at == g.info.acquired_at
    assert store.release(cluster, "run-a") and store.status(cluster).free
    assert not store.release(cluster, "run-a")  # twice: nothing to release


def test_wait_mode_takes_the_lease_when_the_holder_releases_it(store, cluster):
    store.acquire(cluster, Holder("run-a"), FAST)
    threading.Timer(1.0, store.release, (cluster, "run-a")).start()
    g = store.acquire(cluster, Holder("run-b"), FAST, on_busy="wait", wait_s=20, poll_s=0.1)
    assert g.info.holder == "run-b" and 0.8 <= g.waited_s < 10


def test_wait_mode_gives_up_after_wait_s(store, cluster):
    store.acquire(cluster, Holder("run-a"), LeaseSpec(ttl_s=60, heartbeat_s=1))
    t0 = time.monotonic()
    with pytest.raises(LeaseBusy, match=r"waited .*lease.wait_s=1"):
        store.acquire(cluster, Holder("run-b"), FAST, on_busy="wait", wait_s=1, poll_s=0.1)
    assert 0.9 <= time.monotonic() - t0 < 5
    assert store.status(cluster).holder == "run-a"


def test_an_expired_lease_is_taken_over_and_the_dead_run_is_left_for_cleanup(store, cluster):
    store.acquire(cluster, Holder("dead-run", host="ctl-9", pid=99), FAST)
    with pytest.raises(LeaseBusy):
        store.acquire(cluster, Holder("next-run"), FAST)
    time.sleep(FAST.ttl_s + 0.3)
    assert store.status(cluster).expired and "EXPIRED" in store.status(cluster).describe()
    g = store.acquire(cluster, Holder("next-run"), FAST)
    assert g.taken_over["run_key"] == "dead-run" and g.taken_over["host"] == "ctl-9"
    assert [c["run_key"] for c in g.cleanup] == ["dead-run"] and g.cleanup[0]["reason"] == "expired"
    with pytest.raises(LeaseLost, match="now held by run 'next-run'"):
        store.renew(cluster, "dead-run", FAST.ttl_s)  # the dead run comes back: refused
    store.cleaned(cluster, "next-run", ["dead-run"], {"killed": 3})
    assert store.status(cluster).pending_cleanup == []
    events = [(e["event"], e["run_key"]) for e in store.events(cluster)]
    assert events[:3] == [("recovered", "next-run"), ("lost", "dead-run"), ("taken_over", "next-run")]


def test_break_frees_the_lease_and_the_holder_loses_it(store, cluster):
    store.acquire(cluster, Holder("run-a"), FAST)
    was = store.break_lease(cluster, by="operator")
    assert was.holder == "run-a" and store.status(cluster).free
    assert store.status(cluster).pending_cleanup[0]["reason"] == "broken"
    with pytest.raises(LeaseLost, match="broken by hand"):
        store.renew(cluster, "run-a", 2)
    assert store.break_lease(cluster) is None  # nothing left to break
    g = store.acquire(cluster, Holder("run-b"), FAST)
    assert [c["run_key"] for c in g.cleanup] == ["run-a"]


def test_a_run_whose_teardown_failed_is_left_for_the_next_to_clean_up(store, cluster):
    store.acquire(cluster, Holder("run-a"), FAST)
    store.release(cluster, "run-a", leftovers=True)
    g = store.acquire(cluster, Holder("run-b"), FAST)
    assert g.cleanup[0]["run_key"] == "run-a" and g.cleanup[0]["reason"] == "teardown failed"


def test_many_runs_racing_for_one_cluster_get_exactly_one_lease(store, cluster):
    start = threading.Barrier(5)
    got: list[str] = []

    def take(i: int) -> None:
        start.wait()
        if isinstance(store.try_acquire(cluster, Holder(f"racer-{i}"), 30), Grant):
            got.append(f"racer-{i}")

    threads = [threading.Thread(target=take, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 1 and store.status(cluster).holder == got[0]


def test_the_heartbeat_keeps_a_lease_past_its_ttl(store, cluster):
    store.acquire(cluster, Holder("run-a"), FAST)
    with Heartbeat(store, cluster, "run-a", FAST.ttl_s, FAST.heartbeat_s, interrupt=False) as hb:
        time.sleep(FAST.ttl_s * 2)
        with pytest.raises(LeaseBusy):
            store.acquire(cluster, Holder("run-b"), FAST)
    assert hb.beats >= 4 and hb.lost is None
    time.sleep(FAST.ttl_s + 0.3)  # the heartbeat stopped: the lease expires
    assert store.acquire(cluster, Holder("run-b"), FAST).taken_over["run_key"] == "run-a"


def test_a_broken_lease_stops_the_main_thread_at_the_next_heartbeat(store, cluster):
    store.acquire(cluster, Holder("run-a"), FAST)
    threading.Timer(0.7, store.break_lease, (cluster,)).start()
    t0 = time.monotonic()
    with pytest.raises(LeaseLost, match="broken by hand"):
        with Heartbeat(store, cluster, "run-a", FAST.ttl_s, FAST.heartbeat_s):
            time.sleep(30)  # a long blocking wait (k6, an SSH command): interrupted, not waited out
    assert time.monotonic() - t0 < 0.7 + FAST.heartbeat_s + 1.5
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is gone after the run stopped
    raise_if_lost()  # outside the heartbeat nothing is raised any more


def test_the_deferrable_trigger_fires_when_the_lease_is_free_and_times_out_naming_the_holder(store, cluster, dsn,
                                                                                             monkeypatch):
    import asyncio

    from deploybench.airflow import lease as trig

    monkeypatch.setattr(trig, "_results_dsn", lambda: dsn)
    store.acquire(cluster, Holder("run-a", host="ctl-1", pid=7), LeaseSpec(ttl_s=60, heartbeat_s=1))

    async def first_event(t: trig.LeaseFreeTrigger) -> dict:
        async for ev in t.run():
            return ev.payload
        raise AssertionError("the trigger ended without an event")

    t = trig.LeaseFreeTrigger(cluster, time.time() + 1, poll_s=0.2)
    ev = asyncio.run(first_event(t))
    assert ev["status"] == "timeout" and "run-a" in ev["holder"] and "ctl-1" in ev["holder"]
    classpath, kwargs = t.serialize()
    assert classpath == "deploybench.airflow.lease.LeaseFreeTrigger" and "dsn" not in kwargs
    threading.Timer(0.8, store.release, (cluster, "run-a")).start()
    t0 = time.monotonic()
    ev = asyncio.run(first_event(trig.LeaseFreeTrigger(cluster, time.time() + 20, poll_s=0.2)))
    assert ev["status"] == "free" and 0.6 < time.monotonic() - t0 < 5
