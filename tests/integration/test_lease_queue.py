"""Runs waiting for a cluster are served first come, first served (real PostgreSQL, a throwaway database).

Before the queue, a freed lease went to whoever asked first. A waiting run learns that the lease
is free only at its next poll (every 2 s from Airflow's trigger, up to 5 s in the blocking wait),
and a deferred task must then be resumed; a run that asks in between (a script's next
``deploybench run``, the next date of the backfill that just released it) took the cluster ahead
of a run that had been waiting all along, and could keep it from that run until its
``lease.wait_s`` ran out. These tests take places the way the two waiting paths do: the blocking
wait of ``deploybench run`` (``acquire`` with ``on_busy=wait``) and the Airflow task's single try
followed by its trigger (``try_acquire(queue=True)``, then ``keep_place`` polls).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import pytest

from deploybench import lease as lease_mod
from deploybench.config import LeaseSpec
from deploybench.lease import Grant, Holder, LeaseBusy, LeaseStore

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]

FAIL = LeaseSpec(ttl_s=30, heartbeat_s=1, wait_s=0, on_busy="fail")
WAIT = LeaseSpec(ttl_s=30, heartbeat_s=1, wait_s=20, on_busy="wait")


@pytest.fixture
def store(dsn) -> LeaseStore:
    return LeaseStore(dsn)


@pytest.fixture
def cluster(request) -> str:
    return f"lq-{request.node.name[:40]}"


def _wait_until(cond, timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        time.sleep(0.05)


def test_a_freed_lease_goes_to_the_run_that_waited_not_to_the_releasing_dags_next_run(store, cluster):
    store.acquire(cluster, Holder("steady/2026-03-01", "steady"), FAIL)
    # the other benchmark's run finds the cluster busy and waits deferred: one try that takes a place, then polls
    got = store.try_acquire(cluster, Holder("slowed/2026-03-01", "slowed"), 30, queue=True)
    assert not isinstance(got, Grant) and got.holder == "steady/2026-03-01"
    assert [w["run_key"] for w in got.waiting] == ["slowed/2026-03-01"] and got.waiting[0]["dag_id"] == "slowed"
    assert store.release(cluster, "steady/2026-03-01")
    # the releasing DAG's next date asks first: the lease is free, but it is not its turn
    with pytest.raises(LeaseBusy) as err:
        store.acquire(cluster, Holder("steady/2026-03-02", "steady"), FAIL, queue=True)
    msg = str(err.value)
    assert "is free" in msg and "'slowed/2026-03-01'" in msg and "goes first" in msg, msg
    assert f"deploybench lease status {cluster}" in msg and "lease break" not in msg, msg
    info = store.status(cluster)
    assert info.free and info.next_in_line == "slowed/2026-03-01"
    assert [w["run_key"] for w in info.waiting] == ["slowed/2026-03-01", "steady/2026-03-02"]
    assert info.turn_of("slowed/2026-03-01") and not info.turn_of("steady/2026-03-02")
    g = store.acquire(cluster, Holder("slowed/2026-03-01", "slowed"), FAIL, queue=True)
    assert g.info.holder == "slowed/2026-03-01"
    # taking the lease ends the wait: the next in line is the run that queued behind it
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["steady/2026-03-02"]


def test_blocking_waiters_get_the_cluster_in_the_order_they_came(store, cluster):
    store.acquire(cluster, Holder("holder"), FAIL)
    order: list[str] = []
    errors: list[BaseException] = []

    def wait_then_hold(key: str) -> None:
        try:
            store.acquire(cluster, Holder(key), WAIT, poll_s=0.05)
            order.append(key)
            time.sleep(0.2)  # holds the cluster briefly, as a run would
            store.release(cluster, key)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = []
    for key in ("w1", "w2", "w3", "w4"):
        t = threading.Thread(target=wait_then_hold, args=(key,))
        t.start()
        threads.append(t)
        # the next one comes only once this one holds its place
        _wait_until(lambda k=key: k in [w["run_key"] for w in store.status(cluster).waiting])
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["w1", "w2", "w3", "w4"]
    store.release(cluster, "holder")
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert order == ["w1", "w2", "w3", "w4"]
    info = store.status(cluster)
    assert info.free and info.waiting == []


def test_a_waiter_that_stops_polling_loses_its_place(store, cluster, monkeypatch):
    monkeypatch.setattr(lease_mod, "WAITER_STALE_S", 0.5)
    store.acquire(cluster, Holder("holder"), FAIL)
    store.keep_place(cluster, "cancelled-run", "d")  # its trigger polled once, then the run was cancelled
    assert store.status(cluster).next_in_line == "cancelled-run"
    store.release(cluster, "holder")
    with pytest.raises(LeaseBusy, match="cancelled-run"):
        store.acquire(cluster, Holder("newcomer"), FAIL)
    time.sleep(0.7)  # past WAITER_STALE_S without a poll
    assert store.status(cluster).waiting == []
    assert store.acquire(cluster, Holder("newcomer"), FAIL).info.holder == "newcomer"
    # a place that lapsed is taken again at the back of the queue, not where it was
    store.keep_place(cluster, "second", "d")
    time.sleep(0.1)
    store.keep_place(cluster, "cancelled-run", "d")
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["second", "cancelled-run"]


def test_a_run_that_gives_up_waiting_leaves_the_queue(store, cluster):
    store.acquire(cluster, Holder("holder"), FAIL)
    with pytest.raises(LeaseBusy, match=r"waited .*lease.wait_s=0.3"):
        store.acquire(cluster, Holder("impatient"), WAIT, wait_s=0.3, poll_s=0.05)
    assert store.status(cluster).waiting == []
    # fail mode never takes a place
    with pytest.raises(LeaseBusy):
        store.acquire(cluster, Holder("fail-fast"), FAIL)
    assert store.status(cluster).waiting == []


def test_the_holder_and_a_hand_over_are_not_held_up_by_the_queue(store, cluster):
    store.acquire(cluster, Holder("c01"), FAIL)
    store.keep_place(cluster, "outsider", "regression")
    # the holder's retried task keeps its lease
    assert store.acquire(cluster, Holder("c01"), FAIL).info.holder == "c01"
    # a matrix cell hands its deployment to the next cell by name: the waiting outsider does not slip in between
    assert store.hand_over(cluster, "c01", "c02", kept=["c01"], ttl_s=30)
    with pytest.raises(LeaseBusy):
        store.acquire(cluster, Holder("outsider"), FAIL, queue=True)
    assert store.acquire(cluster, Holder("c02"), FAIL).info.holder == "c02"
    store.release(cluster, "c02")
    # once the matrix lets go, the outsider is first
    with pytest.raises(LeaseBusy, match="'outsider'"):
        store.acquire(cluster, Holder("c03"), FAIL)
    assert store.acquire(cluster, Holder("outsider"), FAIL).info.holder == "outsider"


def test_the_trigger_keeps_its_runs_place_and_fires_only_in_its_turn(store, cluster, dsn, monkeypatch):
    from deploybench.airflow import lease as trig

    monkeypatch.setattr(trig, "_results_dsn", lambda: dsn)
    store.acquire(cluster, Holder("holder"), FAIL)
    store.keep_place(cluster, "earlier", "d1")
    store.release(cluster, "holder")

    async def first_event(t: trig.LeaseFreeTrigger) -> dict:
        async for ev in t.run():
            return ev.payload
        raise AssertionError("the trigger ended without an event")

    # the lease is free, but an earlier run waits: the later run's trigger does not fire, it times out
    later = trig.LeaseFreeTrigger(cluster, time.time() + 1, poll_s=0.2, run_key="later", dag_id="d2")
    ev = asyncio.run(first_event(later))
    assert ev["status"] == "timeout" and "'earlier'" in ev["holder"] and "goes first" in ev["holder"], ev
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["earlier", "later"]  # it polled: its place
    assert later.serialize()[1]["run_key"] == "later"
    # the earlier run takes the lease and lets it go: now it is the later run's turn
    threading.Timer(0.5, lambda: (store.acquire(cluster, Holder("earlier"), FAIL),
                                  store.release(cluster, "earlier"))).start()
    t0 = time.monotonic()
    ev = asyncio.run(first_event(trig.LeaseFreeTrigger(cluster, time.time() + 20, poll_s=0.2, run_key="later")))
    assert ev["status"] == "free" and 0.3 < time.monotonic() - t0 < 5


def test_lease_status_lists_the_waiting_runs_in_order(store, cluster, dsn, capsys):
    from deploybench.cli.lease import cmd_status

    store.acquire(cluster, Holder("holder", "bench"), FAIL)
    store.keep_place(cluster, "first", "regression")
    store.keep_place(cluster, "second", "matrix")
    assert cmd_status(argparse.Namespace(cluster=cluster, events=0, json=False, dsn=dsn)) == 0
    out = capsys.readouterr().out
    assert "'first' (DAG regression)" in out and "goes first and 1 more" in out, out
    assert out.index("waiting 1: run first") < out.index("waiting 2: run second"), out
