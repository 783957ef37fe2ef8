"""One cluster, one run: a lease per cluster in the results database.

A benchmark is only worth its numbers if nothing else ran on the cluster meanwhile, and two
runs on one cluster kill each other's engines. So every run, however it was started (the DAG,
``deploybench run``, a schedule, a matrix cell), takes the cluster's lease before anything
touches a node, renews it while it works (``Heartbeat``), and releases it at the end.

The lease is one row per cluster (the inventory's name) in ``cluster_leases`` (migration 0003):
the holder's run key, DAG, host and pid, when it took the lease, its last heartbeat, and when
the lease expires without one. Every time is the database's clock (``now()``), so controllers
with skewed clocks agree. Taking the lease is one transaction holding the row lock
(``SELECT ... FOR UPDATE`` after an ``INSERT ... ON CONFLICT DO NOTHING`` that makes sure the row
exists), so two runs starting together cannot both get it.

A holder whose heartbeat stopped (its controller died) keeps the row until the lease expires;
the next run to take it then finds the dead run in ``pending_cleanup`` and first stops what the
dead run left on the nodes (``deploybench.leftovers``, by the dead run's own records), then
proceeds. A lease broken by hand (``deploybench lease break CLUSTER``) and a run whose teardown
failed land in ``pending_cleanup`` too. ``lease_events`` keeps what happened, with what was
cleaned.

Waiting runs are served first come, first served. A run that will wait for a busy cluster
(``on_busy=wait``) takes a place in ``lease_waiters`` (migration 0005) and keeps it by polling;
a free lease goes only to the waiter that came first, so a run that has just released the lease
(the next date of a backfill, the next cell of another matrix) cannot take it again ahead of a run
that was already waiting. A waiter that stops polling for ``WAITER_STALE_S`` (cancelled, its
triggerer gone) loses its place. A holder's own run and a hand-over bypass the queue.

Handing over (``hand_over``): the cells of a config matrix that share one deployment pass the
lease from one to the next by name, so nothing outside the matrix slips in between and the next
cell neither waits for nor steals it. The engines the giver left running are listed in
``pending_cleanup`` as *kept* for the taker (``kept_by``): the taker does not clean them up when it
takes its lease; they become ordinary leftovers whenever the lease ends otherwise (the taker's
lease expires or is broken, or it releases with leftovers), so a matrix that dies half-way leaves
nothing running that nobody will stop.

This module never imports Airflow; the DAG's deferrable wait is
``deploybench.airflow.lease``.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.sql.expression import bindparam

from deploybench.config import LeaseSpec, OnBusy
from deploybench.errors import DeploybenchError
from deploybench.store.errors import StoreError

log = logging.getLogger(__name__)

BREAK_HINT = "deploybench lease break {cluster}"
INTERRUPT_SIGNAL = signal.SIGUSR1
# a waiting run that has not polled for this long loses its place in the queue: longer than any poll
# (Airflow's trigger polls every 2 s; the blocking wait at most every 5 s) plus the time a fired trigger's
# task takes to resume on a busy scheduler; a cancelled waiter delays the next one by at most this much
WAITER_STALE_S = 60.0


class LeaseError(DeploybenchError):
    """The cluster's lease could not be taken, kept or read."""


class LeaseBusy(LeaseError):
    """Another run holds the cluster (fail-fast mode, or the wait ran out)."""

    def __init__(self, message: str, info: LeaseInfo):
        super().__init__(message)
        self.info = info


class LeaseLost(LeaseError):
    """The lease this run held was broken by hand or taken by another run: stop working on the cluster."""


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60} s" if s < 7200 else f"{s // 3600} h {s % 3600 // 60} min"


@dataclass(frozen=True)
class Holder:
    """Who takes a lease: the run key, and where the run works (for people reading ``lease status``)."""

    run_key: str
    dag_id: str = "cli"
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)


@dataclass(frozen=True)
class LeaseInfo:
    """A cluster's lease row as read at ``now`` (the database's clock)."""

    cluster: str
    holder: str | None
    dag_id: str | None
    host: str | None
    pid: int | None
    acquired_at: datetime | None
    heartbeat_at: datetime | None
    expires_at: datetime | None
    ttl_s: float | None
    pending_cleanup: list[dict[str, Any]]
    now: datetime
    # the runs waiting for the cluster, first come first: {"run_key", "dag_id", "since", "seen_at"}
    waiting: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: Any, waiting: list[dict[str, Any]] | None = None) -> LeaseInfo:
        m = row._mapping
        return cls(m["cluster"], m["holder"], m["dag_id"], m["host"], m["pid"], m["acquired_at"], m["heartbeat_at"],
                   m["expires_at"], m["ttl_s"], list(m["pending_cleanup"] or []), m["db_now"], list(waiting or []))

    @property
    def free(self) -> bool:
        return self.holder is None

    @property
    def expired(self) -> bool:
        return self.holder is not None and self.expires_at is not None and self.expires_at <= self.now

    def _since(self, t: datetime | None) -> float | None:
        return None if t is None else (self.now - t).total_seconds()

    @property
    def age_s(self) -> float | None:
        return self._since(self.acquired_at)

    @property
    def heartbeat_age_s(self) -> float | None:
        return self._since(self.heartbeat_at)

    @property
    def expires_in_s(self) -> float | None:
        return None if self.expires_at is None else (self.expires_at - self.now).total_seconds()

    @property
    def next_in_line(self) -> str | None:
        """The run the lease goes to when it frees (the waiter that came first), if any waits."""
        return self.waiting[0]["run_key"] if self.waiting else None

    def turn_of(self, run_key: str) -> bool:
        """Whether ``run_key`` would get the lease now: it holds it, or the lease is free (or expired) and no
        run that came before it is waiting."""
        if self.holder == run_key:
            return True
        return (self.free or self.expired) and self.next_in_line in (None, run_key)

    def _queue(self, run_key: str | None = None) -> str:
        ahead = [w for w in self.waiting if w["run_key"] != run_key]
        if not ahead:
            return ""
        first = ahead[0]
        more = f" and {len(ahead) - 1} more" if len(ahead) > 1 else ""
        return (f"; run {first['run_key']!r} (DAG {first['dag_id']}) has waited {_age(self._since(first['since']))} "
                f"and goes first{more}")

    def describe(self, run_key: str | None = None) -> str:
        """One line for people: who holds the cluster, where, for how long, and who waits (ahead of
        ``run_key``, when it is a waiting run that asks)."""
        return self._holder() + self._queue(run_key)

    @property
    def kept(self) -> list[dict[str, Any]]:
        """Deployments left running for the holder (``hand_over``), not leftovers while it holds the lease."""
        return [p for p in self.pending_cleanup if p.get("kept_by")]

    def _holder(self) -> str:
        if self.free:
            pending = f"; leftovers of {', '.join(p['run_key'] for p in self.pending_cleanup)} are cleaned up by " \
                      "the next run" if self.pending_cleanup else ""
            return f"cluster {self.cluster!r} is free{pending}"
        kept = "".join(f"; engines of run {p['run_key']!r} kept running for it" for p in self.kept
                       if p["kept_by"] == self.holder)
        state = (f"EXPIRED {_age(-(self.expires_in_s or 0))} ago (its holder stopped renewing it; the next run "
                 "takes it over and cleans up)" if self.expired else f"expires in {_age(self.expires_in_s)} "
                 "without a heartbeat")
        return (f"cluster {self.cluster!r} is leased by run {self.holder!r} (DAG {self.dag_id}, host {self.host}, "
                f"pid {self.pid}) for {_age(self.age_s)}, last heartbeat {_age(self.heartbeat_age_s)} ago, {state}"
                f"{kept}")

    def to_dict(self) -> dict[str, Any]:
        return {"cluster": self.cluster, "holder": self.holder, "dag_id": self.dag_id, "host": self.host,
                "pid": self.pid, "acquired_at": self.acquired_at, "heartbeat_at": self.heartbeat_at,
                "expires_at": self.expires_at, "ttl_s": self.ttl_s, "age_s": self.age_s,
                "heartbeat_age_s": self.heartbeat_age_s, "expired": self.expired,
                "pending_cleanup": self.pending_cleanup,
                "waiting": [{**w, "waited_s": self._since(w["since"])} for w in self.waiting]}


@dataclass(frozen=True)
class Grant:
    """A lease taken: by whom, after how long, and which dead runs' leftovers the taker must clean up first."""

    info: LeaseInfo
    waited_s: float
    taken_over: dict[str, Any] | None  # the expired holder this run replaced, if any
    cleanup: list[dict[str, Any]]  # entries of pending_cleanup: {"run_key", "reason", "host", "pid", ...}


_COLUMNS = ("cluster, holder, dag_id, host, pid, acquired_at, heartbeat_at, expires_at, ttl_s, pending_cleanup, "
            "now() AS db_now")


class LeaseStore:
    """The lease table of one results database (``dsn``: as ``deploybench.store.db.resolve_dsn``)."""

    def __init__(self, dsn: str | Engine | None = None):
        self._dsn = dsn
        self._engine: Engine | None = dsn if isinstance(dsn, Engine) else None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            from deploybench.store import db

            self._engine = db.open_store(self._dsn)
        return self._engine

    # -- reading -------------------------------------------------------------------------------------
    def status(self, cluster: str) -> LeaseInfo | None:
        """The lease of ``cluster`` with the runs waiting for it; None if no run ever took it."""
        with self._tx() as conn:
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c"),
                               {"c": cluster}).first()
            return LeaseInfo.from_row(row, self._waiting(conn, cluster)) if row else None

    def all(self) -> list[LeaseInfo]:
        with self._tx() as conn:
            rows = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases ORDER BY cluster")).all()
            return [LeaseInfo.from_row(r, self._waiting(conn, r.cluster)) for r in rows]

    def events(self, cluster: str | None = None, run_key: str | None = None, limit: int = 20) -> list[dict[str, Any]]:
        """The newest lease events, newest first (of one cluster and/or one run)."""
        where = " AND ".join(w for w, v in (("cluster = :c", cluster), ("run_key = :r", run_key)) if v) or "true"
        with self._tx() as conn:
            rows = conn.execute(text(f"SELECT id, cluster, event, run_key, detail, at FROM lease_events WHERE {where} "
                                     "ORDER BY id DESC LIMIT :n"), {"c": cluster, "r": run_key, "n": limit}).all()
        return [dict(r._mapping) for r in rows]

    # -- taking and keeping ------------------------------------------------------------------------------
    def try_acquire(self, cluster: str, holder: Holder, ttl_s: float, *, queue: bool = False) -> Grant | LeaseInfo:
        """Take the lease if it is ours, or free (or expired) with no earlier run waiting for it: a Grant;
        else the LeaseInfo that says who holds it and who waits. ``queue``: the caller will wait, so it takes
        (or keeps) its place among the waiters; a Grant ends its wait."""
        with self._tx() as conn:
            conn.execute(text("INSERT INTO cluster_leases (cluster) VALUES (:c) ON CONFLICT (cluster) DO NOTHING"),
                         {"c": cluster})
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c FOR UPDATE"),
                               {"c": cluster}).one()
            conn.execute(text("DELETE FROM lease_waiters WHERE cluster = :c AND seen_at < now() - "
                              "make_interval(secs => :stale)"), {"c": cluster, "stale": WAITER_STALE_S})
            cur = LeaseInfo.from_row(row, self._waiting(conn, cluster))
            if not cur.turn_of(holder.run_key):
                if queue:
                    self._keep_place(conn, cluster, holder.run_key, holder.dag_id)
                    cur = LeaseInfo.from_row(row, self._waiting(conn, cluster))
                return cur
            conn.execute(text("DELETE FROM lease_waiters WHERE cluster = :c AND run_key = :r"),
                         {"c": cluster, "r": holder.run_key})
            # what was kept running for the taker stays kept; kept for anyone else is a leftover now
            pending = [p if p.get("kept_by") == holder.run_key else _leftover(p) for p in cur.pending_cleanup]
            taken_over = None
            if cur.holder is not None and cur.holder != holder.run_key:
                taken_over = {"run_key": cur.holder, "reason": "expired", "dag_id": cur.dag_id, "host": cur.host,
                              "pid": cur.pid, "heartbeat_at": str(cur.heartbeat_at),
                              "acquired_at": str(cur.acquired_at)}
                if all(p.get("run_key") != cur.holder for p in pending):
                    pending.append(taken_over)
            row = conn.execute(text(
                "UPDATE cluster_leases SET holder = :h, dag_id = :d, host = :host, pid = :pid, "
                "acquired_at = CASE WHEN holder = :h THEN acquired_at ELSE now() END, heartbeat_at = now(), "
                "expires_at = now() + make_interval(secs => :ttl), ttl_s = :ttl, pending_cleanup = :p, "
                f"updated_at = now() WHERE cluster = :c RETURNING {_COLUMNS}").bindparams(bindparam("p", type_=JSONB)),
                {"c": cluster, "h": holder.run_key, "d": holder.dag_id, "host": holder.host, "pid": holder.pid,
                 "ttl": float(ttl_s), "p": pending}).one()
            info = LeaseInfo.from_row(row)
            if cur.holder != holder.run_key:
                self._event(conn, cluster, "taken_over" if taken_over else "acquired", holder.run_key,
                            {"dag_id": holder.dag_id, "host": holder.host, "pid": holder.pid, "ttl_s": ttl_s,
                             "taken_over": taken_over, "pending_cleanup": pending})
        if taken_over:
            log.warning("cluster %s: took over the lease of run %s (no heartbeat since %s, host %s pid %s)", cluster,
                        taken_over["run_key"], taken_over["heartbeat_at"], taken_over["host"], taken_over["pid"])
        return Grant(info, 0.0, taken_over, [p for p in pending if not p.get("kept_by")])

    def acquire(self, cluster: str, holder: Holder, spec: LeaseSpec, *, wait_s: float | None = None,
                on_busy: OnBusy | str | None = None, poll_s: float | None = None, queue: bool | None = None
                ) -> Grant:
        """Take the lease of ``cluster``: at once, or (``on_busy=wait``) polling, in its turn among the waiting
        runs, for at most ``wait_s``; LeaseBusy names the holder, its host, pid and age, who waits first, and
        the way out. ``queue`` (default: when waiting here) keeps a place among the waiters; the Airflow task
        passes it with ``on_busy=fail`` because it waits deferred, and keeps the place from its trigger."""
        wait_s = spec.wait_s if wait_s is None else float(wait_s)
        mode = OnBusy(on_busy or spec.on_busy)
        queue = mode is OnBusy.WAIT if queue is None else queue
        poll = poll_s if poll_s is not None else min(5.0, max(0.2, wait_s / 50))
        t0 = time.monotonic()
        announced = False
        while True:
            got = self.try_acquire(cluster, holder, spec.ttl_s, queue=queue)
            if isinstance(got, Grant):
                waited = round(time.monotonic() - t0, 3)
                log.info("cluster %s: lease taken by run %s after %.1f s", cluster, holder.run_key, waited)
                return Grant(got.info, waited, got.taken_over, got.cleanup)
            waited = time.monotonic() - t0
            if mode is OnBusy.FAIL or waited >= wait_s:
                how = ("lease.on_busy=fail" if mode is OnBusy.FAIL
                       else f"waited {_age(waited)}, lease.wait_s={wait_s:g}")
                if mode is OnBusy.WAIT:
                    self.leave_queue(cluster, holder.run_key)
                if got.free or got.expired:  # its turn has not come: earlier runs wait
                    way_out = (f"the earlier runs go first; wait longer (lease.on_busy=wait, lease.wait_s), and see "
                               f"the queue with `deploybench lease status {cluster}`")
                else:
                    way_out = (f"let that run finish (or wait longer: lease.on_busy=wait, lease.wait_s); if it is "
                               f"dead, its lease expires {_age(got.expires_in_s)} from now, or break it now: "
                               f"`{BREAK_HINT.format(cluster=cluster)}`")
                raise LeaseBusy(f"{got.describe(holder.run_key)} ({how}). To run: {way_out}", got)
            if not announced:
                log.info("%s; waiting up to %s for it", got.describe(holder.run_key), _age(wait_s))
                announced = True
            time.sleep(min(poll, max(0.05, wait_s - waited)))

    def keep_place(self, cluster: str, run_key: str, dag_id: str | None = None) -> LeaseInfo | None:
        """A waiting run's poll: take or keep its place among the waiters, and read the lease (None: no run
        ever took it). ``info.turn_of(run_key)`` says whether to try now."""
        with self._tx() as conn:
            self._keep_place(conn, cluster, run_key, dag_id)
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c"),
                               {"c": cluster}).first()
            return LeaseInfo.from_row(row, self._waiting(conn, cluster)) if row else None

    def leave_queue(self, cluster: str, run_key: str) -> None:
        """A run that stops waiting gives up its place (a stale place is dropped anyway after WAITER_STALE_S)."""
        with self._tx() as conn:
            conn.execute(text("DELETE FROM lease_waiters WHERE cluster = :c AND run_key = :r"),
                         {"c": cluster, "r": run_key})

    def renew(self, cluster: str, run_key: str, ttl_s: float, host: str | None = None, pid: int | None = None
              ) -> LeaseInfo:
        """The heartbeat: push the expiry ``ttl_s`` ahead. LeaseLost when the row no longer names this run."""
        with self._tx() as conn:
            row = conn.execute(text(
                "UPDATE cluster_leases SET heartbeat_at = now(), expires_at = now() + make_interval(secs => :ttl), "
                "ttl_s = :ttl, host = COALESCE(:host, host), pid = COALESCE(:pid, pid), updated_at = now() "
                f"WHERE cluster = :c AND holder = :h RETURNING {_COLUMNS}"),
                {"c": cluster, "h": run_key, "ttl": float(ttl_s), "host": host, "pid": pid}).first()
            if row is not None:
                return LeaseInfo.from_row(row)
            now = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c"),
                               {"c": cluster}).first()
            info = LeaseInfo.from_row(now) if now else None
            why = ("it was broken by hand and is free now" if info is None or info.free
                   else f"it is now held by run {info.holder!r} (host {info.host}, pid {info.pid}) since "
                        f"{_age(info.age_s)} ago")
            self._event(conn, cluster, "lost", run_key, {"now": info.to_dict() if info else None})
        raise LeaseLost(f"run {run_key!r} lost the lease of cluster {cluster!r}: {why}. It stops here and tears "
                        f"down its own engines; start it again once the cluster is free (`deploybench lease status "
                        f"{cluster}`)")

    def release(self, cluster: str, run_key: str, leftovers: bool = False, detail: dict | None = None) -> bool:
        """Free the lease if ``run_key`` holds it (True). ``leftovers``: this run may have left processes
        behind (its teardown failed), so the next run cleans up after it."""
        with self._tx() as conn:
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c FOR UPDATE"),
                               {"c": cluster}).first()
            cur = LeaseInfo.from_row(row) if row else None
            if cur is None or cur.holder != run_key:
                log.warning("run %s does not hold the lease of cluster %s (%s); nothing to release", run_key, cluster,
                            cur.describe() if cur else "no lease row")
                return False
            dirty = [{"run_key": run_key, "reason": "teardown failed", "host": cur.host, "pid": cur.pid}]
            # a deployment kept for this run: it stopped it (clean release) or it is a leftover now
            others = [p for p in cur.pending_cleanup if p.get("kept_by") != run_key]
            kept = [_leftover(p) for p in cur.pending_cleanup if p.get("kept_by") == run_key]
            pending = [_leftover(p) for p in others] + (dirty + kept if leftovers else [])
            conn.execute(text(
                "UPDATE cluster_leases SET holder = NULL, dag_id = NULL, host = NULL, pid = NULL, acquired_at = NULL, "
                "heartbeat_at = NULL, expires_at = NULL, ttl_s = NULL, pending_cleanup = :p, updated_at = now() "
                "WHERE cluster = :c").bindparams(bindparam("p", type_=JSONB)), {"c": cluster, "p": pending})
            self._event(conn, cluster, "released", run_key, {"held_s": cur.age_s, "leftovers": leftovers,
                                                             **(detail or {})})
        log.info("cluster %s: lease released by run %s after %s", cluster, run_key, _age(cur.age_s))
        return True

    def hand_over(self, cluster: str, run_key: str, to: str, kept: list[str], ttl_s: float,
                  detail: dict | None = None) -> bool:
        """Pass the lease ``run_key`` holds to run ``to`` (the next cell of a shared deployment), with the runs
        in ``kept`` whose engines stay up for it. ``to`` then holds it (``try_acquire`` grants it at once); if
        it never comes, the lease expires ``ttl_s`` from now and the next taker cleans up the kept engines.
        False (nothing changed) when ``run_key`` does not hold the lease."""
        with self._tx() as conn:
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c FOR UPDATE"),
                               {"c": cluster}).first()
            cur = LeaseInfo.from_row(row) if row else None
            if cur is None or cur.holder != run_key:
                log.warning("run %s cannot hand the lease of cluster %s to %s: %s", run_key, cluster, to,
                            cur.describe() if cur else "no lease row")
                return False
            handed = [{"run_key": k, "reason": f"kept running by {run_key} for {to}", "kept_by": to} for k in kept]
            pending = [p for p in cur.pending_cleanup if p.get("kept_by") != run_key
                       and p.get("run_key") not in kept] + handed
            conn.execute(text(
                "UPDATE cluster_leases SET holder = :to, host = NULL, pid = NULL, acquired_at = now(), "
                "heartbeat_at = now(), expires_at = now() + make_interval(secs => :ttl), ttl_s = :ttl, "
                "pending_cleanup = :p, updated_at = now() WHERE cluster = :c").bindparams(bindparam("p", type_=JSONB)),
                {"c": cluster, "to": to, "ttl": float(ttl_s), "p": pending})
            # a 'released' event naming the taker (the event names are a check constraint of migration 0003)
            self._event(conn, cluster, "released", run_key, {"handed_over_to": to, "kept": kept, "held_s": cur.age_s,
                                                             **(detail or {})})
        log.info("cluster %s: lease handed over by run %s to run %s (engines of %s kept running)", cluster, run_key,
                 to, ", ".join(kept) or "no run")
        return True

    def break_lease(self, cluster: str, by: str | None = None) -> LeaseInfo | None:
        """Free the lease whoever holds it (an operator's way out); the holder stops at its next heartbeat and
        its leftovers are cleaned up by the next run. Returns the lease as it was (None: it was free)."""
        by = by or f"{getpass.getuser()}@{socket.gethostname()}"
        with self._tx() as conn:
            row = conn.execute(text(f"SELECT {_COLUMNS} FROM cluster_leases WHERE cluster = :c FOR UPDATE"),
                               {"c": cluster}).first()
            cur = LeaseInfo.from_row(row) if row else None
            if cur is None or cur.free:
                return None
            pending = [_leftover(p) for p in cur.pending_cleanup]
            if all(p.get("run_key") != cur.holder for p in pending):
                pending.append({"run_key": cur.holder, "reason": "broken", "dag_id": cur.dag_id, "host": cur.host,
                                "pid": cur.pid, "heartbeat_at": str(cur.heartbeat_at)})
            conn.execute(text(
                "UPDATE cluster_leases SET holder = NULL, dag_id = NULL, host = NULL, pid = NULL, acquired_at = NULL, "
                "heartbeat_at = NULL, expires_at = NULL, ttl_s = NULL, pending_cleanup = :p, updated_at = now() "
                "WHERE cluster = :c").bindparams(bindparam("p", type_=JSONB)), {"c": cluster, "p": pending})
            self._event(conn, cluster, "broken", cur.holder, {"by": by, "was": cur.to_dict()})
        log.warning("cluster %s: lease of run %s broken by %s", cluster, cur.holder, by)
        return cur

    def cleaned(self, cluster: str, run_key: str, done: list[str], detail: dict[str, Any]) -> None:
        """Record that ``run_key`` cleaned up after the runs ``done`` (they leave ``pending_cleanup``)."""
        with self._tx() as conn:
            row = conn.execute(text("SELECT pending_cleanup FROM cluster_leases WHERE cluster = :c FOR UPDATE"),
                               {"c": cluster}).first()
            pending = [p for p in (row[0] if row else []) if p.get("run_key") not in set(done)]
            conn.execute(text("UPDATE cluster_leases SET pending_cleanup = :p, updated_at = now() WHERE cluster = :c")
                         .bindparams(bindparam("p", type_=JSONB)), {"c": cluster, "p": pending})
            self._event(conn, cluster, "recovered", run_key, detail)

    # -- plumbing ------------------------------------------------------------------------------------------
    @staticmethod
    def _waiting(conn: Any, cluster: str) -> list[dict[str, Any]]:
        """The live waiters of ``cluster``, first come first (ties by run key, so every reader agrees)."""
        rows = conn.execute(text(
            "SELECT run_key, dag_id, since, seen_at FROM lease_waiters WHERE cluster = :c AND seen_at >= now() - "
            "make_interval(secs => :stale) ORDER BY since, run_key"), {"c": cluster, "stale": WAITER_STALE_S}).all()
        return [dict(r._mapping) for r in rows]

    @staticmethod
    def _keep_place(conn: Any, cluster: str, run_key: str, dag_id: str | None) -> None:
        conn.execute(text(
            "INSERT INTO lease_waiters (cluster, run_key, dag_id) VALUES (:c, :r, :d) ON CONFLICT (cluster, run_key) "
            "DO UPDATE SET seen_at = now(), since = CASE WHEN lease_waiters.seen_at < now() - "
            "make_interval(secs => :stale) THEN now() ELSE lease_waiters.since END"),
            {"c": cluster, "r": run_key, "d": dag_id, "stale": WAITER_STALE_S})

    @contextlib.contextmanager
    def _tx(self) -> Iterator[Any]:
        try:
            with self.engine.begin() as conn:
                yield conn
        except SQLAlchemyError as exc:
            from deploybench.store.db import redact

            raise StoreError(f"lease table in {redact(str(self.engine.url))}: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0]}") from exc

    @staticmethod
    def _event(conn: Any, cluster: str, event: str, run_key: str | None, detail: dict[str, Any]) -> None:
        conn.execute(text("INSERT INTO lease_events (cluster, event, run_key, detail) VALUES (:c, :e, :r, :d)")
                     .bindparams(bindparam("d", type_=JSONB)),
                     {"c": cluster, "e": event, "r": run_key, "d": _jsonable(detail)})


def _leftover(entry: dict[str, Any]) -> dict[str, Any]:
    """A pending entry as an ordinary leftover (no longer kept for a run)."""
    return {k: v for k, v in entry.items() if k != "kept_by"}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, datetime):
        return obj.isoformat()
    return obj


# -- the heartbeat -----------------------------------------------------------------------------------------
_current: Heartbeat | None = None  # the heartbeat of the run working in this process, for raise_if_lost()


def raise_if_lost() -> None:
    """LeaseLost if the heartbeat running in this process found the lease gone (checked at each work stage)."""
    hb = _current
    if hb is not None and hb.lost:
        raise LeaseLost(hb.lost)


class Heartbeat:
    """Keeps a lease alive from a background thread while the ``with`` body works on the cluster.

    Every ``interval_s`` it renews the lease. A failed renewal (PostgreSQL restarting, a network
    blip) is logged and retried at the next beat: SQLAlchemy's pool reconnects once the server
    answers again, and only a row that no longer names this run ends the run. Then ``lost``
    holds the reason, ``raise_if_lost()`` raises it at the next stage, and, when the ``with``
    was entered in the main thread, the main thread is interrupted at once (SIGUSR1, whose
    handler raises LeaseLost wherever the run is: a k6 wait, an SSH command, a sleep), so the
    run stops within one beat and its ``finally`` tears down its own engines. A lease whose
    heartbeat stops (this process died) expires ``ttl_s`` after the last beat.
    """

    def __init__(self, store: LeaseStore, cluster: str, run_key: str, ttl_s: float, interval_s: float,
                 interrupt: bool = True):
        self.store, self.cluster, self.run_key = store, cluster, run_key
        self.ttl_s, self.interval_s, self.interrupt = float(ttl_s), float(interval_s), interrupt
        self.lost: str | None = None
        self.beats = 0
        self.failures = 0  # renewals that could not reach the database
        self.reconnects = 0  # times a renewal succeeded after failures
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main: int | None = None
        self._old_handler: Any = None
        self._armed = False

    def __enter__(self) -> Heartbeat:
        global _current
        if self.interrupt and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(INTERRUPT_SIGNAL) in (signal.SIG_DFL, None):
            self._old_handler = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
            self._main = threading.get_ident()
            self._armed = True
        self._thread = threading.Thread(target=self._loop, name=f"lease-heartbeat-{self.cluster}", daemon=True)
        self._thread.start()
        _current = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        global _current
        self._disarm()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 15)
        if _current is self:
            _current = None

    def _disarm(self) -> None:
        if self._armed:
            self._armed = False
            signal.signal(INTERRUPT_SIGNAL, self._old_handler if self._old_handler is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._armed and self.lost:
            self._disarm()  # once: the teardown that follows must not be interrupted again
            raise LeaseLost(self.lost)

    def check(self) -> None:
        if self.lost:
            raise LeaseLost(self.lost)

    def _loop(self) -> None:
        pid, host = os.getpid(), socket.gethostname()
        failing = False
        while not self._stop.wait(self.interval_s):
            try:
                self.store.renew(self.cluster, self.run_key, self.ttl_s, host=host, pid=pid)
            except LeaseLost as exc:
                self.lost = str(exc)
                log.error("%s", exc)
                if self._armed and self._main is not None:
                    signal.pthread_kill(self._main, INTERRUPT_SIGNAL)
                return
            except (StoreError, SQLAlchemyError, OSError) as exc:
                self.failures += 1
                failing = True
                log.warning("cluster %s: lease heartbeat of run %s failed (%s); retrying in %.0f s", self.cluster,
                            self.run_key, exc, self.interval_s)
                continue
            if failing:
                failing = False
                self.reconnects += 1
                log.info("cluster %s: lease heartbeat of run %s renewed again (reconnected after %d failed renewals)",
                         self.cluster, self.run_key, self.failures)
            self.beats += 1


@contextlib.contextmanager
def held(store: LeaseStore, cluster: str, run_key: str, spec: LeaseSpec, interrupt: bool = True
         ) -> Iterator[Heartbeat]:
    """``with held(...) as hb:`` - the heartbeat of a lease this process holds (see Heartbeat)."""
    with Heartbeat(store, cluster, run_key, spec.ttl_s, spec.heartbeat_s, interrupt=interrupt) as hb:
        yield hb
