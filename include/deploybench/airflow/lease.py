"""The cluster lease in Airflow: a task that takes it, and a trigger that waits for it.

``AcquireLease`` takes the lease of the run's cluster (``deploybench.pipeline.acquire_lease``:
cleaning up after a dead holder first). When another run holds the cluster and the run's
``lease.on_busy`` is ``wait``, it defers to ``LeaseFreeTrigger``, which polls the lease row from
the triggerer, so a waiting run holds no worker slot; when the lease frees (or expires) the task
resumes and tries again, until ``lease.wait_s`` has passed. With ``on_busy=fail`` it fails at once,
naming the holder.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

# how often a waiting run reads its cluster's lease row (one indexed read), so how long a freed lease can stay
# unnoticed; at 5 s a backfill of 12 runs on one cluster spent some 30 s between holders
POLL_S = 2.0


def _results_dsn() -> str | None:
    from deploybench.airflow.connections import results_dsn

    return results_dsn()


class LeaseFreeTrigger(BaseTrigger):
    """Fires when ``cluster``'s lease is free or expired, or at ``deadline`` (epoch seconds)."""

    def __init__(self, cluster: str, deadline: float, poll_s: float = POLL_S):
        super().__init__()
        self.cluster, self.deadline, self.poll_s = cluster, deadline, poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # no DSN here: trigger kwargs are stored in Airflow's database; the connection is read at run time
        return (f"{type(self).__module__}.{type(self).__name__}",
                {"cluster": self.cluster, "deadline": self.deadline, "poll_s": self.poll_s})

    async def run(self):
        from asgiref.sync import sync_to_async

        from deploybench.lease import LeaseStore
        from deploybench.store.errors import StoreError

        store = LeaseStore(await sync_to_async(_results_dsn)())
        while True:
            try:
                info = await asyncio.to_thread(store.status, self.cluster)
            except (StoreError, SQLAlchemyError, OSError) as exc:  # PostgreSQL restarting: ask again later
                log.warning("lease of cluster %s unreadable (%s); asking again in %.0f s", self.cluster, exc,
                            self.poll_s)
                await asyncio.sleep(self.poll_s)
                continue
            if info is None or info.free or info.expired:
                yield TriggerEvent({"status": "free", "cluster": self.cluster})
                return
            if time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "cluster": self.cluster, "holder": info.describe()})
                return
            await asyncio.sleep(self.poll_s)


class AcquireLease(BaseOperator):
    """Take the run's cluster lease; wait for it deferred (``lease.on_busy=wait``) or fail naming the holder."""

    ui_color = "#e8d9f5"

    def __init__(self, *, poll_s: float = POLL_S, **kwargs: Any):
        super().__init__(**kwargs)
        self.poll_s = poll_s

    def execute(self, context: Any) -> dict:
        return self._take(context, deadline=None)

    def resume(self, context: Any, event: dict | None = None, deadline: float | None = None) -> dict:
        log.info("lease trigger fired: %s", event)
        return self._take(context, deadline=deadline)

    def _take(self, context: Any, deadline: float | None) -> dict:
        from deploybench import pipeline
        from deploybench.airflow.stages import kube, run_key, ssh
        from deploybench.config import OnBusy
        from deploybench.lease import LeaseBusy
        from deploybench.run import Run

        key = run_key(context)
        try:
            return pipeline.acquire_lease(key, on_busy=OnBusy.FAIL.value, dsn=_results_dsn(),
                                          dag_id=context["dag"].dag_id, ssh_overrides=ssh(key), kube=kube(key))
        except LeaseBusy as busy:
            spec = Run.open(key).cfg.lease
            if spec.on_busy is OnBusy.FAIL:
                raise
            deadline = deadline if deadline is not None else time.time() + spec.wait_s
            if time.time() >= deadline:
                raise LeaseBusy(f"waited lease.wait_s={spec.wait_s:g} s for the cluster: {busy}", busy.info) from busy
            log.info("%s; deferring until it is free (at most %.0f s more)", busy.info.describe(),
                     deadline - time.time())
            self.defer(trigger=LeaseFreeTrigger(busy.info.cluster, deadline, self.poll_s), method_name="resume",
                       kwargs={"deadline": deadline})  # raises TaskDeferred: the worker slot is given back

