"""The cluster lease against a real PostgreSQL (a throwaway database on the embedded server).

Taking, waiting, failing fast with the holder named, expiry and take-over, renewals refused to a
run that lost the lease, break by hand, runs left for cleanup, races between many takers, and the
heartbeat: it keeps a lease alive past its TTL, and stops the main thread when the lease is broken.

Then the queue: runs waiting for a cluster are served first come, first served. Before it, a freed
lease went to whoever asked first. A waiting run learns that the lease is free only at its next
poll (every 2 s from Airflow's trigger, up to 5 s in the blocking wait), and a deferred task must
then be resumed; a run that asks in between (a script's next ``deploybench run``, the next date of
the backfill that just released it) took the cluster ahead of a run that had been waiting all
along, and could keep it from that run until its ``lease.wait_s`` ran out. The queue tests take
places the way the two waiting paths do: the blocking wait of ``deploybench run`` (``acquire`` with
``on_busy=wait``) and the Airflow task's single try followed by its trigger
(``try_acquire(queue=True)``, then ``keep_place`` polls).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time

import pytest

from deploybench import lease as lease_mod
from deploybench.config import LeaseSpec
from deploybench.lease import Grant, Heartbeat, Holder, LeaseBusy, LeaseLost, LeaseStore, raise_if_lost

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]

FAST = LeaseSpec(ttl_s=2, heartbeat_s=0.5, wait_s=0, on_busy="fail")
HELD = LeaseSpec(ttl_s=30, heartbeat_s=1, wait_s=0, on_busy="fail")  # the queue tests: held without a heartbeat
WAITING = LeaseSpec(ttl_s=30, heartbeat_s=1, wait_s=20, on_busy="wait")


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
    from deploybench.airflow import lease as trig

    monkeypatch.setattr(trig, "_results_dsn", lambda: dsn)
    store.acquire(cluster, Holder("run-a", host="ctl-1", pid=7), LeaseSpec(ttl_s=60, heartbeat_s=1))

    t = trig.LeaseFreeTrigger(cluster, time.time() + 1, poll_s=0.2)
    ev = asyncio.run(_first_event(t))
    assert ev["status"] == "timeout" and "run-a" in ev["holder"] and "ctl-1" in ev["holder"]
    classpath, kwargs = t.serialize()
    assert classpath == "deploybench.airflow.lease.LeaseFreeTrigger" and "dsn" not in kwargs
    threading.Timer(0.8, store.release, (cluster, "run-a")).start()
    t0 = time.monotonic()
    ev = asyncio.run(_first_event(trig.LeaseFreeTrigger(cluster, time.time() + 20, poll_s=0.2)))
    assert ev["status"] == "free" and 0.6 < time.monotonic() - t0 < 5


async def _first_event(trigger) -> dict:
    async for ev in trigger.run():
        return ev.payload
    raise AssertionError("the trigger ended without an event")


# -- the queue: first come, first served ------------------------------------------------------------
def test_a_freed_lease_goes_to_the_run_that_waited_not_to_the_releasing_dags_next_run(store, cluster):
    store.acquire(cluster, Holder("steady/2026-03-01", "steady"), HELD)
    # the other benchmark's run finds the cluster busy and waits deferred: one try that takes a place, then polls
    got = store.try_acquire(cluster, Holder("slowed/2026-03-01", "slowed"), 30, queue=True)
    assert not isinstance(got, Grant) and got.holder == "steady/2026-03-01"
    assert [w["run_key"] for w in got.waiting] == ["slowed/2026-03-01"] and got.waiting[0]["dag_id"] == "slowed"
    assert store.release(cluster, "steady/2026-03-01")
    # the releasing DAG's next date asks first: the lease is free, but it is not its turn
    with pytest.raises(LeaseBusy) as err:
        store.acquire(cluster, Holder("steady/2026-03-02", "steady"), HELD, queue=True)
    msg = str(err.value)
    assert "is free" in msg and "'slowed/2026-03-01'" in msg and "goes first" in msg, msg
    assert f"deploybench lease status {cluster}" in msg and "lease break" not in msg, msg
    info = store.status(cluster)
    assert info.free and info.next_in_line == "slowed/2026-03-01"
    assert [w["run_key"] for w in info.waiting] == ["slowed/2026-03-01", "steady/2026-03-02"]
    assert info.turn_of("slowed/2026-03-01") and not info.turn_of("steady/2026-03-02")
    g = store.acquire(cluster, Holder("slowed/2026-03-01", "slowed"), HELD, queue=True)
    assert g.info.holder == "slowed/2026-03-01"
    # taking the lease ends the wait: the next in line is the run that queued behind it
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["steady/2026-03-02"]


def test_blocking_waiters_get_the_cluster_in_the_order_they_came(store, cluster, wait_for):
    store.acquire(cluster, Holder("holder"), HELD)
    order: list[str] = []
    errors: list[BaseException] = []

    def wait_then_hold(key: str) -> None:
        try:
            store.acquire(cluster, Holder(key), WAITING, poll_s=0.05)
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
        wait_for(lambda k=key: k in [w["run_key"] for w in store.status(cluster).waiting], 10, f"{key} waits")
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
    store.acquire(cluster, Holder("holder"), HELD)
    store.keep_place(cluster, "cancelled-run", "d")  # its trigger polled once, then the run was cancelled
    assert store.status(cluster).next_in_line == "cancelled-run"
    store.release(cluster, "holder")
    with pytest.raises(LeaseBusy, match="cancelled-run"):
        store.acquire(cluster, Holder("newcomer"), HELD)
    time.sleep(0.7)  # past WAITER_STALE_S without a poll
    assert store.status(cluster).waiting == []
    assert store.acquire(cluster, Holder("newcomer"), HELD).info.holder == "newcomer"
    # a place that lapsed is taken again at the back of the queue, not where it was
    store.keep_place(cluster, "second", "d")
    time.sleep(0.1)
    store.keep_place(cluster, "cancelled-run", "d")
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["second", "cancelled-run"]


def test_a_run_that_gives_up_waiting_leaves_the_queue(store, cluster):
    store.acquire(cluster, Holder("holder"), HELD)
    with pytest.raises(LeaseBusy, match=r"waited .*lease.wait_s=0.3"):
        store.acquire(cluster, Holder("impatient"), WAITING, wait_s=0.3, poll_s=0.05)
    assert store.status(cluster).waiting == []
    # fail mode never takes a place
    with pytest.raises(LeaseBusy):
        store.acquire(cluster, Holder("fail-fast"), HELD)
    assert store.status(cluster).waiting == []


def test_the_holder_and_a_hand_over_are_not_held_up_by_the_queue(store, cluster):
    store.acquire(cluster, Holder("c01"), HELD)
    store.keep_place(cluster, "outsider", "regression")
    # the holder's retried task keeps its lease
    assert store.acquire(cluster, Holder("c01"), HELD).info.holder == "c01"
    # a matrix cell hands its deployment to the next cell by name: the waiting outsider does not slip in between
    assert store.hand_over(cluster, "c01", "c02", kept=["c01"], ttl_s=30)
    with pytest.raises(LeaseBusy):
        store.acquire(cluster, Holder("outsider"), HELD, queue=True)
    assert store.acquire(cluster, Holder("c02"), HELD).info.holder == "c02"
    store.release(cluster, "c02")
    # once the matrix lets go, the outsider is first
    with pytest.raises(LeaseBusy, match="'outsider'"):
        store.acquire(cluster, Holder("c03"), HELD)
    assert store.acquire(cluster, Holder("outsider"), HELD).info.holder == "outsider"


def test_the_trigger_keeps_its_runs_place_and_fires_only_in_its_turn(store, cluster, dsn, monkeypatch):
    from deploybench.airflow import lease as trig

    monkeypatch.setattr(trig, "_results_dsn", lambda: dsn)
    store.acquire(cluster, Holder("holder"), HELD)
    store.keep_place(cluster, "earlier", "d1")
    store.release(cluster, "holder")

    # the lease is free, but an earlier run waits: the later run's trigger does not fire, it times out
    later = trig.LeaseFreeTrigger(cluster, time.time() + 1, poll_s=0.2, run_key="later", dag_id="d2")
    ev = asyncio.run(_first_event(later))
    assert ev["status"] == "timeout" and "'earlier'" in ev["holder"] and "goes first" in ev["holder"], ev
    assert [w["run_key"] for w in store.status(cluster).waiting] == ["earlier", "later"]  # it polled: its place
    assert later.serialize()[1]["run_key"] == "later"
    # the earlier run takes the lease and lets it go: now it is the later run's turn
    threading.Timer(0.5, lambda: (store.acquire(cluster, Holder("earlier"), HELD),
                                  store.release(cluster, "earlier"))).start()
    t0 = time.monotonic()
    ev = asyncio.run(_first_event(trig.LeaseFreeTrigger(cluster, time.time() + 20, poll_s=0.2, run_key="later")))
    assert ev["status"] == "free" and 0.3 < time.monotonic() - t0 < 5


def test_lease_status_lists_the_waiting_runs_in_order(store, cluster, dsn, capsys):
    from deploybench.cli.lease import cmd_status

    store.acquire(cluster, Holder("holder", "bench"), HELD)
    store.keep_place(cluster, "first", "regression")
    store.keep_place(cluster, "second", "matrix")
    assert cmd_status(argparse.Namespace(cluster=cluster, events=0, json=False, dsn=dsn)) == 0
    out = capsys.readouterr().out
    assert "'first' (DAG regression)" in out and "goes first and 1 more" in out, out
    assert out.index("waiting 1: run first") < out.index("waiting 2: run second"), out
