"""Alembic environment for pglane: online runs only, against the engine pglane.schema hands over.

Invariant: every migration runs in one transaction that first takes a cluster-wide advisory lock,
so two `pglane migrate` started at once apply each revision exactly once. Alembic's own version
table lives in the ``pglane`` schema, never beside the host application's.
"""

from sqlalchemy import text

from alembic import context

MIGRATE_LOCK = (0x70676C61, 0)  # ('pgla', 0): held only for the length of a migration transaction

config = context.config
engine = config.attributes.get("engine")
if engine is None or context.is_offline_mode():
    raise SystemExit("pglane migrations run online only: use `pglane migrate` (or pglane.schema.upgrade)")

with engine.connect() as connection:
    context.configure(
        connection=connection,
        target_metadata=None,
        version_table_schema="pglane",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:a, :b)"), {"a": MIGRATE_LOCK[0], "b": 0})
        connection.execute(text("CREATE SCHEMA IF NOT EXISTS pglane"))
        context.run_migrations()
