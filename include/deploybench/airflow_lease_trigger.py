"""A deferrable wait for a cluster's lease: the DAG's way to wait without holding a worker slot.

A task that finds the cluster leased (``pipeline.acquire_lease(..., on_busy="fail")`` raised
``LeaseBusy``) defers to ``LeaseFreeTrigger``; the triggerer polls the lease table and fires when
the lease is free, expired (its holder died: the taker cleans up after it), or already held by
this run. The task then resumes and calls ``acquire_lease`` again, which takes the lease (or, if
another run won the race, defers again). A typical task body::

    from deploybench.airflow_lease_trigger import LeaseFreeTrigger
    from deploybench.lease import LeaseBusy

    try:
        return pipeline.acquire_lease(key, on_busy="fail", dsn=dsn)
    except LeaseBusy as exc:
        raise TaskDeferred(trigger=LeaseFreeTrigger(exc.info.cluster, key, timeout_s=wait_left),
                           method_name="resume")  # resume() calls acquire_lease again

The trigger reads the results database through the ``deploybench_results`` connection when it
exists (resolved in the triggerer, so no credential is serialised into the trigger row), else
through ``DEPLOYBENCH_DSN`` or the embedded PostgreSQL. Airflow is imported here only, never by
the library.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

log = logging.getLogger(__name__)


def lease_state(cluster: str, run_key: str, dsn: str | None) -> dict[str, Any]:
    """One poll: ``{"free": bool, "why": str, "holder": {...} | None}`` (blocking; run in a thread)."""
    from deploybench.lease import LeaseStore, _jsonable

    info = LeaseStore(dsn).status(cluster)
    if info is None or info.free:
        return {"free": True, "why": "free", "holder": None}
    holder = _jsonable(info.to_dict())
    if info.holder == run_key:
        return {"free": True, "why": "already held by this run", "holder": holder}
    if info.expired:
        return {"free": True, "why": "expired", "holder": holder}
    return {"free": False, "why": info.describe(), "holder": holder}


def _results_dsn() -> str | None:
    try:
        from deploybench.airflow_glue import results_dsn

        return results_dsn()
    except Exception as exc:  # noqa: BLE001 - no connection table reachable: fall back to the store's own rules
        log.debug("no results connection (%s); using DEPLOYBENCH_DSN or the embedded PostgreSQL", exc)
        return None


class LeaseFreeTrigger(BaseTrigger):
    """Fires ``{"status": "free", ...}`` once ``cluster``'s lease can be taken by ``run_key``, or
    ``{"status": "timeout", ...}`` after ``timeout_s`` with the holder named. Polls every ``poll_s``."""

    def __init__(self, cluster: str, run_key: str, poll_s: float = 5.0, timeout_s: float = 3600.0,
                 started_at: float | None = None):
        super().__init__()
        self.cluster, self.run_key = cluster, run_key
        self.poll_s, self.timeout_s = float(poll_s), float(timeout_s)
        self.started_at = started_at if started_at is not None else time.time()

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"cluster": self.cluster, "run_key": self.run_key, "poll_s": self.poll_s,
                 "timeout_s": self.timeout_s, "started_at": self.started_at})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        dsn = await asyncio.to_thread(_results_dsn)
        last: dict[str, Any] = {}
        while True:
            try:
                last = await asyncio.to_thread(lease_state, self.cluster, self.run_key, dsn)
            except Exception as exc:  # noqa: BLE001 - the database restarting: keep polling until the timeout
                log.warning("cluster %s: cannot read the lease (%s); polling again in %.0f s", self.cluster, exc,
                            self.poll_s)
                last = {"free": False, "why": f"lease unreadable: {exc}", "holder": last.get("holder")}
            waited = time.time() - self.started_at
            if last.get("free"):
                yield TriggerEvent({"status": "free", "cluster": self.cluster, "run_key": self.run_key,
                                    "why": last["why"], "waited_s": round(waited, 1)})
                return
            if waited >= self.timeout_s:
                yield TriggerEvent({"status": "timeout", "cluster": self.cluster, "run_key": self.run_key,
                                    "why": last.get("why", ""), "holder": last.get("holder"),
                                    "waited_s": round(waited, 1)})
                return
            await asyncio.sleep(min(self.poll_s, max(0.1, self.timeout_s - waited)))
