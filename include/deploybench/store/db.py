"""Which results database, and opening it: DSN resolution, engines, migrations.

DSN resolution, first match wins:

1. the ``dsn`` argument — inside Airflow the store task passes the URI of its Postgres
   connection (``PostgresHook(...).get_uri()``); this module never imports Airflow;
2. the environment variable ``DEPLOYBENCH_DSN``;
3. the embedded PostgreSQL (``deploybench.store.embedded``), started on demand.

Every DSN is normalised to SQLAlchemy's ``postgresql+psycopg://`` (psycopg 3), so
``postgres://`` and ``postgresql://`` URIs from other tools work unchanged.

``open_store`` is the one way in: it resolves, creates (or reuses) the engine and runs
the Alembic migrations up to head before anything reads or writes. Migrations run in
one transaction under an advisory lock, so concurrent first opens are safe.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from deploybench.store.errors import StoreError
from deploybench.store.models import VERSION_TABLE

log = logging.getLogger(__name__)

ENV_DSN = "DEPLOYBENCH_DSN"
DRIVER = "postgresql+psycopg"
MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# pg_advisory_xact_lock key for migrations: any constant, the same in every process ("dbnc" in ASCII)
_MIGRATION_LOCK = 0x64626E63

DsnSource = Literal["argument", "env", "embedded"]


@dataclass(frozen=True)
class ResolvedDsn:
    dsn: str
    source: DsnSource


def normalize_dsn(dsn: str) -> str:
    """Return ``dsn`` as a ``postgresql+psycopg://`` URL; StoreError if it is not a PostgreSQL URL."""
    try:
        url = make_url(dsn.strip())
    except ArgumentError as exc:
        raise StoreError(
            f"results DSN {redact(dsn)!r} is not a database URL; expected "
            f"postgresql+psycopg://user:password@host:5432/dbname"
        ) from exc
    backend = url.drivername.split("+", 1)[0]
    if backend not in ("postgresql", "postgres"):
        raise StoreError(
            f"results DSN {redact(dsn)!r} is a {backend!r} URL; the results store needs PostgreSQL "
            f"(postgresql+psycopg://user:password@host:5432/dbname)"
        )
    if not url.database:
        raise StoreError(f"results DSN {redact(dsn)!r} names no database; add /dbname to it")
    return url.set(drivername=DRIVER).render_as_string(hide_password=False)


def redact(dsn: str) -> str:
    """The DSN with its password masked, for logs and messages."""
    try:
        return make_url(dsn).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable DSN>"


def resolve_dsn(dsn: str | None = None, *, start_embedded: bool = True) -> ResolvedDsn:
    """The results DSN by the rules in this module's docstring.

    With ``start_embedded=False`` a missing DSN is an error instead of a server start
    (for callers that must not spawn processes, e.g. a web page)."""
    if dsn:
        return ResolvedDsn(normalize_dsn(dsn), "argument")
    env = os.environ.get(ENV_DSN, "").strip()
    if env:
        return ResolvedDsn(normalize_dsn(env), "env")
    if not start_embedded:
        raise StoreError(
            f"no results DSN: pass one, set {ENV_DSN}, or run `deploybench store dsn` to start the embedded PostgreSQL"
        )
    from deploybench.store import embedded

    return ResolvedDsn(embedded.ensure_running(), "embedded")


_engines: dict[str, Engine] = {}
_migrated: set[str] = set()
_lock = threading.Lock()


def get_engine(dsn: str) -> Engine:
    """One engine per DSN per process (engines pool connections; creating one per call would leak them)."""
    dsn = normalize_dsn(dsn)
    with _lock:
        engine = _engines.get(dsn)
        if engine is None:
            engine = create_engine(
                dsn,
                pool_pre_ping=True,
                pool_size=2,
                max_overflow=4,
                connect_args={"connect_timeout": 10, "application_name": "deploybench"},
            )
            _engines[dsn] = engine
        return engine


def dispose_engines() -> None:
    """Close every pooled connection (tests dropping their database; a forked child)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _migrated.clear()


def _alembic_config():  # -> alembic.config.Config
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("path_separator", "os")
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config()).get_current_head()
    if head is None:
        raise StoreError(f"no migrations found in {MIGRATIONS_DIR}; the package is incomplete")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, None if it was never migrated."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def migrate(target: Engine | str) -> str:
    """Upgrade the database to the newest migration (a no-op when it is there); returns the revision."""
    from alembic import command

    engine = get_engine(target) if isinstance(target, str) else target
    cfg = _alembic_config()
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)  # a line per plugin, every open
    try:
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    except SQLAlchemyError as exc:
        raise StoreError(f"migrating the results database {redact(str(engine.url))} failed: {exc}") from exc
    revision = current_revision(engine)
    log.debug("results database %s at revision %s", redact(str(engine.url)), revision)
    return revision or ""


def open_store(target: Engine | str | None = None) -> Engine:
    """The engine of the results database, migrated to head (once per database per process)."""
    if isinstance(target, Engine):
        engine = target
    else:
        resolved = resolve_dsn(target)
        engine = get_engine(resolved.dsn)
        log.debug("results database %s (from %s)", redact(resolved.dsn), resolved.source)
    key = engine.url.render_as_string(hide_password=False)
    if key not in _migrated:
        migrate(engine)
        with _lock:
            _migrated.add(key)
    return engine
