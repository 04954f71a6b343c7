"""The schema: where pglane's SQL and migrations live, and how a database is moved between versions.

Owns: locating ``sql/`` and ``alembic/`` (top-level folders in a checkout, ``pglane/_sql`` and
``pglane/_alembic`` inside an installed wheel), running alembic against any libpq DSN, and the check
that a database is at the version this code expects (alembic's head: never a number kept by hand).

Invariants: only alembic migrations create or change pglane's objects. sql/ holds one file per
capability (each function, view and trigger in exactly one), and roles.sql, the three roles' whole
privilege set. What a revision installs never changes once written: a revision applies only the
sql/ files it changes (its ``APPLIES``; roles.sql among them when it changes a grant), and reads each
through ``sql_text``, which gives a frozen copy (``alembic/frozen/<revision>/<file>``) when a later
revision has changed that file since or the file has left sql/. So sql/ always holds the newest text
of each file, and a revision that changes a file freezes, in the same commit, the previous text of
only that file, under the revision that last applied it (tests/test_schema.py fails otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from .errors import SchemaError, first_line, translate

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


def sql_text(name: str, revision: str) -> str:
    """The text of sql/``name`` as ``revision`` installs it: its frozen copy if one exists, else sql/."""
    frozen = migrations_dir() / "frozen" / revision / name
    return (frozen if frozen.is_file() else sql_dir() / name).read_text(encoding="utf-8")


def apply_sql(revision: str, names: Iterable[str]) -> None:
    """Run, inside a migration, the sql/ files ``names`` as ``revision`` installs them, in that order;
    then take EXECUTE on every pglane function away from PUBLIC, which PostgreSQL grants to each new
    function (a per-schema ALTER DEFAULT PRIVILEGES cannot revoke it). Grants to pglane's roles stay."""
    from alembic import op

    for name in names:
        op.execute(sql_text(name, revision))
    op.execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pglane FROM PUBLIC")


_REVISION_LINE = re.compile(r"""^(down_revision|revision)\s*(?::[^=]*)?=\s*(?:None|(["'])([^"']+)\2)\s*$""",
                            re.MULTILINE)


@functools.cache
def revisions() -> dict[str, str | None]:
    """Every revision this pglane ships and the one it revises (None for the first), read from the
    ``revision = "..."`` and ``down_revision = ...`` lines of alembic/versions/*.py: no alembic import
    (SQLAlchemy and alembic cost more start-up than the rest of a command). A test checks that the
    head found here is alembic's own."""
    found: dict[str, str | None] = {}
    for path in sorted((migrations_dir() / "versions").glob("*.py")):
        lines = {m.group(1): m.group(3) for m in _REVISION_LINE.finditer(path.read_text(encoding="utf-8"))}
        if lines.get("revision"):
            found[str(lines["revision"])] = lines.get("down_revision")
    return found


@functools.cache
def head() -> str:
    """The revision this pglane's migrations end at: the one no other revision revises."""
    known = revisions()
    heads = sorted(set(known) - {down for down in known.values() if down is not None})
    if len(heads) != 1:
        raise SchemaError(f"pglane's migrations have {len(heads)} head revisions ({', '.join(heads) or 'none'});"
                          " reinstall pglane")
    return heads[0]


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
    """Migrate the database at ``dsn`` up to ``revision`` (idempotent; safe to run concurrently). A
    database at an older revision is upgraded; one at a revision this pglane does not know (a newer
    pglane migrated it) is refused with SchemaError. The database's refusals come back unwrapped: a
    PglaneError (PGL11: the role lacks CREATEROLE) or the psycopg error, never SQLAlchemy's wrapper."""
    from alembic import command

    _refuse_unknown_revision(dsn)
    with _unwrapped(dsn):
        command.upgrade(_alembic_config(dsn), revision)


def _refuse_unknown_revision(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        at = current_revision(conn)
    if at is not None and at not in revisions():
        raise SchemaError(f"the database is at revision {at}, newer than this pglane knows (its newest is {head()}):"
                          " a newer pglane migrated it; upgrade pglane (pip install -U pglane) and run it again")


@contextlib.contextmanager
def _unwrapped(dsn: str) -> Iterator[None]:
    """SQLAlchemy's DBAPIError as the database's own error (translated when it is pglane's); alembic's
    unknown revision as SchemaError; a missing CREATE on the database as what to grant."""
    from alembic.util.exc import CommandError
    from sqlalchemy.exc import DBAPIError

    try:
        yield
    except DBAPIError as exc:
        orig = exc.orig
        if not isinstance(orig, psycopg.Error):
            raise
        if orig.sqlstate == "42501" and "CREATE SCHEMA" in str(exc.statement or "").upper():
            raise SchemaError(_create_schema_refused(dsn)) from None
        mapped = translate(orig)
        raise (mapped if mapped is not None else orig) from None
    except CommandError as exc:
        if "Can't locate revision" not in str(exc):
            raise
        raise SchemaError(f"{first_line(exc)}: the database was migrated by a newer pglane; upgrade pglane"
                          " (pip install -U pglane) and run it again") from None


def _create_schema_refused(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_database(), current_user").fetchone()
    db, role = (str(v) for v in row) if row is not None else ("<database>", "<role>")
    return (f"role {role} may not create schema pglane in database {db}; have an administrator run: "
            f"GRANT CREATE ON DATABASE {sql.Identifier(db).as_string()} TO {sql.Identifier(role).as_string()};"
            " then run pglane migrate again")


def downgrade(dsn: str, revision: str = "base") -> None:
    """Migrate down; at ``base`` the then empty ``pglane`` schema is dropped too."""
    from alembic import command

    with _unwrapped(dsn):
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
    """Raise SchemaError unless the database is at the head revision."""
    revision = current_revision(conn)
    if revision is not None and revision not in revisions():
        raise SchemaError(f"the database is at revision {revision}, newer than this pglane knows (its newest is "
                          f"{head()}): a newer pglane migrated it; upgrade pglane (pip install -U pglane)")
    if revision != head():
        state = "not migrated" if revision is None else f"at revision {revision}"
        raise SchemaError(
            f"the database is {state}, this pglane needs revision {head()}; run: pglane migrate"
        )
