"""Alembic environment of the results store.

``deploybench.store.db.migrate`` runs the upgrade programmatically and hands over an
open connection (``config.attributes["connection"]``) inside a transaction that holds
an advisory lock, so two processes opening the store at once migrate one after the
other. Run from the command line (``alembic -c .../alembic.ini ...``, for writing a
new revision), the DSN comes from DEPLOYBENCH_DSN.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool

from deploybench.store.models import VERSION_TABLE, Base

config = context.config
target_metadata = Base.metadata


def _configure(**kw) -> None:
    context.configure(
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        compare_type=True,
        compare_server_default=True,
        **kw,
    )


def run_offline() -> None:
    _configure(url=os.environ.get("DEPLOYBENCH_DSN", "postgresql+psycopg://"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    dsn = os.environ.get("DEPLOYBENCH_DSN")
    if not dsn:
        raise SystemExit("set DEPLOYBENCH_DSN to the results database (see `deploybench store dsn`)")
    engine = create_engine(dsn, poolclass=pool.NullPool)
    with engine.connect() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
