"""The cluster lease in Airflow: a task that takes it, and a trigger that waits for it.

``AcquireLease`` takes the lease of the run's cluster (``deploybench.pipeline.acquire_lease``:
cleaning up after a dead holder first). When another run holds the cluster and the run's
``lease.on_busy`` is ``wait``, it takes a place among the runs waiting for the cluster and defers
to ``LeaseFreeTrigger``, which keeps that place by polling from the triggerer, so a waiting run
holds no worker slot; when the lease frees (or expires) and no run that came earlier waits, the
task resumes and tries again, until ``lease.wait_s`` has passed. With ``on_busy=fail`` it fails at
once, naming the holder.
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
    """Fires when it is ``run_key``'s turn for ``cluster``'s lease (free or expired, and no run that came
    earlier waits; it keeps the run's place among the waiters meanwhile), or at ``deadline`` (epoch seconds).
    Without ``run_key`` (a trigger serialized before the queue): when the lease is free or expired."""

    def __init__(self, cluster: str, deadline: float, poll_s: float = POLL_S, run_key: str | None = None,
                 dag_id: str | None = None):
        super().__init__()
        self.cluster, self.deadline, self.poll_s = cluster, deadline, poll_s
        self.run_key, self.dag_id = run_key, dag_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # no DSN here: trigger kwargs are stored in Airflow's database; the connection is read at run time
        return (f"{type(self).__module__}.{type(self).__name__}",
                {"cluster": self.cluster, "deadline": self.deadline, "poll_s": self.poll_s, "run_key": self.run_key,
                 "dag_id": self.dag_id})

    def _read(self, store: Any) -> Any:
        if self.run_key is None:
            return store.status(self.cluster)
        return store.keep_place(self.cluster, self.run_key, self.dag_id)

    def _turn(self, info: Any) -> bool:
        if info is None:
            return True
        return info.turn_of(self.run_key) if self.run_key is not None else info.free or info.expired

    async def run(self):
        from asgiref.sync import sync_to_async

        from deploybench.lease import LeaseStore
        from deploybench.store.errors import StoreError

        store = LeaseStore(await sync_to_async(_results_dsn)())
        while True:
            try:
                info = await asyncio.to_thread(self._read, store)
            except (StoreError, SQLAlchemyError, OSError) as exc:  # PostgreSQL restarting: ask again later
                log.warning("lease of cluster %s unreadable (%s); asking again in %.0f s", self.cluster, exc,
                            self.poll_s)
                await asyncio.sleep(self.poll_s)
                continue
            if self._turn(info):
                yield TriggerEvent({"status": "free", "cluster": self.cluster})
                return
            if time.time() >= self.deadline:
                yield TriggerEvent({"status": "timeout", "cluster": self.cluster,
                                    "holder": info.describe(self.run_key)})
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
        from deploybench.airflow.stages import run_folder, run_key

        with run_folder(run_key(context)):  # run.json and the lease's record, on whichever worker has them
            return self._take_here(context, deadline)

    def _take_here(self, context: Any, deadline: float | None) -> dict:
        from deploybench import pipeline
        from deploybench.airflow.stages import kube, run_key, ssh
        from deploybench.config import OnBusy
        from deploybench.lease import LeaseBusy
        from deploybench.run import Run

        key = run_key(context)
        dag_id = context["dag"].dag_id
        spec = Run.open(key).cfg.lease
        waits = spec.on_busy is OnBusy.WAIT
        try:
            # one try here (on_busy=fail); a run that waits keeps its place in the queue while deferred
            return pipeline.acquire_lease(key, on_busy=OnBusy.FAIL.value, dsn=_results_dsn(), dag_id=dag_id,
                                          ssh_overrides=ssh(key), kube=kube(key), queue=waits)
        except LeaseBusy as busy:
            if not waits:
                raise
            deadline = deadline if deadline is not None else time.time() + spec.wait_s
            if time.time() >= deadline:
                _leave_queue(busy.info.cluster, key)
                raise LeaseBusy(f"waited lease.wait_s={spec.wait_s:g} s for the cluster: {busy}", busy.info) from busy
            log.info("%s; deferring until its turn (at most %.0f s more)", busy.info.describe(key),
                     deadline - time.time())
            self.defer(trigger=LeaseFreeTrigger(busy.info.cluster, deadline, self.poll_s, run_key=key, dag_id=dag_id),
                       method_name="resume", kwargs={"deadline": deadline})  # raises TaskDeferred: the slot is freed


def _leave_queue(cluster: str, key: str) -> None:
    """Give up the run's place among the waiters; it is dropped after WAITER_STALE_S anyway, so a failure here
    only delays the next waiter."""
    from deploybench.lease import LeaseStore
    from deploybench.store.errors import StoreError

    try:
        LeaseStore(_results_dsn()).leave_queue(cluster, key)
    except (StoreError, SQLAlchemyError, OSError) as exc:
        log.warning("could not leave the queue of cluster %s (%s); the place lapses by itself", cluster, exc)

