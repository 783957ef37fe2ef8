"""Handing the cluster lease from one matrix cell to the next, against a real PostgreSQL.

The cells of a config matrix that share a deployment pass the lease on by name (``LeaseStore.hand_over``)
with the engines kept running for the taker. The taker gets it at once, without cleaning those engines
up; nobody else can take it meanwhile; and whenever the lease ends otherwise - the taker never comes
(expiry), a person breaks it, the taker releases with leftovers - the kept engines become ordinary
leftovers for the next run to stop.
"""

from __future__ import annotations

import time

import pytest

from deploybench.config import LeaseSpec
from deploybench.lease import Holder, LeaseBusy, LeaseStore

pytestmark = [pytest.mark.integration, pytest.mark.time_limit(60)]

FAST = LeaseSpec(ttl_s=2, heartbeat_s=0.5, wait_s=0, on_busy="fail")


@pytest.fixture(scope="module")
def store(dsn):
    return LeaseStore(dsn)


@pytest.fixture
def cluster(request) -> str:
    return f"lh-{request.node.name[:40]}"


def test_the_next_cell_gets_the_lease_at_once_and_does_not_clean_up_the_kept_engines(store, cluster):
    store.acquire(cluster, Holder("c01"), FAST)
    assert store.hand_over(cluster, "c01", "c02", ["c01"], ttl_s=30)
    info = store.status(cluster)
    assert info.holder == "c02" and info.kept == [{"run_key": "c01", "reason": "kept running by c01 for c02",
                                                    "kept_by": "c02"}]
    assert "engines of run 'c01' kept running for it" in info.describe()
    with pytest.raises(LeaseBusy, match="leased by run 'c02'"):  # nothing outside the matrix slips in between
        store.acquire(cluster, Holder("outsider"), FAST)
    g = store.acquire(cluster, Holder("c02"), FAST)
    assert g.cleanup == [] and g.taken_over is None
    # c02 keeps them for c03 in turn: still one kept entry, now for c03
    assert store.hand_over(cluster, "c02", "c03", ["c01"], ttl_s=30)
    assert [(p["run_key"], p["kept_by"]) for p in store.status(cluster).kept] == [("c01", "c03")]
    assert store.acquire(cluster, Holder("c03"), FAST).cleanup == []
    # the last cell stops them and releases cleanly: nothing is left pending
    assert store.release(cluster, "c03")
    assert store.status(cluster).free and store.status(cluster).pending_cleanup == []
    released = [e["detail"] for e in store.events(cluster) if e["event"] == "released"]
    assert [d.get("handed_over_to") for d in released] == [None, "c03", "c02"]  # newest first


def test_only_the_holder_can_hand_over(store, cluster):
    store.acquire(cluster, Holder("c01"), FAST)
    assert not store.hand_over(cluster, "someone-else", "c02", ["someone-else"], ttl_s=30)
    assert store.status(cluster).holder == "c01" and store.status(cluster).kept == []


def test_a_taker_that_never_comes_leaves_the_kept_engines_to_the_next_run(store, cluster):
    store.acquire(cluster, Holder("c01"), FAST)
    store.hand_over(cluster, "c01", "c02", ["c01"], ttl_s=FAST.ttl_s)
    time.sleep(FAST.ttl_s + 0.3)
    g = store.acquire(cluster, Holder("next-run"), FAST)
    assert g.taken_over["run_key"] == "c02"
    assert sorted(c["run_key"] for c in g.cleanup) == ["c01", "c02"]
    assert all("kept_by" not in c for c in g.cleanup)


def test_broken_or_dirty_release_turns_kept_engines_into_leftovers(store, cluster):
    store.acquire(cluster, Holder("c01"), FAST)
    store.hand_over(cluster, "c01", "c02", ["c01"], ttl_s=30)
    store.break_lease(cluster, by="operator")
    assert sorted(p["run_key"] for p in store.status(cluster).pending_cleanup) == ["c01", "c02"]
    assert store.status(cluster).kept == []
    g = store.acquire(cluster, Holder("r"), FAST)
    store.cleaned(cluster, "r", [c["run_key"] for c in g.cleanup], {})

    store.hand_over(cluster, "r", "c02", ["r"], ttl_s=30)
    store.acquire(cluster, Holder("c02"), FAST)
    store.release(cluster, "c02", leftovers=True)  # its teardown failed: it may not have stopped them
    pending = store.status(cluster).pending_cleanup
    assert sorted(p["run_key"] for p in pending) == ["c02", "r"] and all("kept_by" not in p for p in pending)
