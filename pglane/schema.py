"""The schema: where pglane's SQL and migrations live, and how a database is moved between versions.

Owns: locating ``sql/`` and ``alembic/`` (top-level folders in a checkout, ``pglane/_sql`` and
``pglane/_alembic`` inside an installed wheel), running alembic against any libpq DSN, and the check
that a database is at the version this code expects.

Invariant: only alembic migrations create or change pglane's tables; the functions, triggers and
views of ``sql/`` are applied by those migrations, in the order of ``SQL_FILES``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from .errors import SchemaError

HEAD = "0006"
SQL_FILES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql")

_PACKAGE = Path(__file__).resolve().parent


def _resource_dir(installed: str, checkout: str) -> Path:
    for candidate in (_PACKAGE / installed, _PACKAGE.parent / checkout):
        if candidate.is_dir():
            return candidate
    raise SchemaError(f"pglane's {checkout}/ folder is missing from the installation; reinstall pglane")


def sql_dir() -> Path:
    return _resource_dir("_sql", "sql")


def migrations_dir() -> Path:
    return _resource_dir("_alembic", "alembic")


# jobs.in_queue (revision 0003) is generated as status = 'queued'; a revision before 0003 applies sql/
# with the column spelled out as that test (in views, which are checked when created, it must be).
# sql/ names the column through a one-letter table alias (j.in_queue, q.in_queue); a fresh database
# migrated to each older revision proves it (tests/test_schema.py).
_IN_QUEUE = re.compile(r"\b([a-z])\.in_queue\b")


def sql_text(name: str, *, before_in_queue: bool = False) -> str:
    """The text of one file of sql/; with ``before_in_queue``, as revisions before 0003 apply it."""
    text = (sql_dir() / name).read_text(encoding="utf-8")
    return _IN_QUEUE.sub(r"\1.status = 'queued'", text) if before_in_queue else text


def _alembic_config(dsn: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config
    from sqlalchemy import create_engine, pool

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # The engine wraps a psycopg connection made from the DSN as given: no URL conversion, no escaping.
    cfg.attributes["engine"] = create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(dsn), poolclass=pool.NullPool
    )
    return cfg


def upgrade(dsn: str, revision: str = "head") -> None:
    """Migrate the database at ``dsn`` up to ``revision`` (idempotent; safe to run concurrently)."""
    from alembic import command

    command.upgrade(_alembic_config(dsn), revision)


def downgrade(dsn: str, revision: str = "base") -> None:
    """Migrate down; at ``base`` the then empty ``pglane`` schema is dropped too."""
    from alembic import command

    command.downgrade(_alembic_config(dsn), revision)
    if revision == "base":
        with psycopg.connect(dsn, autocommit=True) as conn:
            leftovers = conn.execute(
                "SELECT count(*) FROM pg_class WHERE relnamespace = 'pglane'::regnamespace"
                " AND relname NOT LIKE 'alembic_version%'"
            ).fetchone()
            if leftovers is not None and leftovers[0] == 0:
                conn.execute(sql.SQL("DROP SCHEMA pglane CASCADE"))


def current_revision(conn: psycopg.Connection[Any]) -> str | None:
    """The revision the connected database is at, or None when pglane was never migrated there."""
    cur = conn.cursor(row_factory=tuple_row)
    row = cur.execute("SELECT to_regclass('pglane.alembic_version') IS NOT NULL").fetchone()
    if row is None or not row[0]:
        return None
    version = cur.execute("SELECT version_num FROM pglane.alembic_version").fetchone()
    return None if version is None else str(version[0])


def require_current(conn: psycopg.Connection[Any]) -> None:
    """Raise SchemaError unless the database is at HEAD."""
    revision = current_revision(conn)
    if revision != HEAD:
        state = "not migrated" if revision is None else f"at revision {revision}"
        raise SchemaError(
            f"the database is {state}, this pglane needs revision {HEAD}; run: pglane migrate"
        )
