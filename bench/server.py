"""The PostgreSQL the benchmark runs against, and one fresh database per system.

Owns: starting the embedded server (durable: fsync and synchronous_commit on, pg_stat_statements
preloaded, which needs one restart) or adopting the server named by PGLANE_DSN; creating the
``bench_*`` databases (dropped first if a previous run left them); reporting the server's version
and the settings that decide the figures. Everything stays on this machine (Unix socket).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

DATABASES = ("pglane", "procrastinate", "pgqueuer", "floor", "contract")
REPORTED_SETTINGS = (
    "synchronous_commit", "fsync", "full_page_writes", "wal_sync_method", "shared_buffers", "work_mem",
    "max_wal_size", "checkpoint_timeout", "autovacuum", "shared_preload_libraries", "jit",
)


@dataclass
class BenchServer:
    """Where the benchmark's databases live: ``dsn(name)`` is the DSN of database ``bench_<name>``."""

    admin_dsn: str
    statements: bool = False  # pg_stat_statements is loaded and created in the admin database
    dsns: dict[str, str] = field(default_factory=dict)

    def dsn(self, name: str) -> str:
        return self.dsns[name]


def with_db(dsn: str, dbname: str) -> str:
    params: dict[str, Any] = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


def _create_databases(admin_dsn: str) -> dict[str, str]:
    dsns = {}
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in DATABASES:
            db = sql.Identifier(f"bench_{name}")
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(db))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(db))
            dsns[name] = with_db(admin_dsn, f"bench_{name}")
    return dsns


def _enable_statements(admin_dsn: str) -> bool:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        except psycopg.Error:
            return False
    return True


def _tune_embedded(admin_dsn: str) -> None:
    """Durable commits and pg_stat_statements; settings in postgresql.auto.conf need the restart."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name, value in (
            ("shared_preload_libraries", "pg_stat_statements"),
            ("pg_stat_statements.track", "top"),
            ("synchronous_commit", "on"),
            ("shared_buffers", "256MB"),
            ("max_wal_size", "4GB"),
            ("track_io_timing", "off"),
        ):
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


@contextlib.contextmanager
def bench_server() -> Iterator[BenchServer]:
    """The server of PGLANE_DSN if set, else a throwaway embedded PostgreSQL (stopped at exit)."""
    given = os.environ.get("PGLANE_DSN")
    if given:
        server = BenchServer(given, _enable_statements(given))
        server.dsns = _create_databases(given)
        yield server
        return
    from pglane.embedded import embedded_server

    with embedded_server(fsync=True) as embedded:
        _tune_embedded(embedded.dsn)
        embedded.restart("fast")
        server = BenchServer(embedded.dsn, _enable_statements(embedded.dsn))
        server.dsns = _create_databases(embedded.dsn)
        yield server


def postgres_info(admin_dsn: str) -> dict[str, Any]:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()
        rows = conn.execute(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)", (list(REPORTED_SETTINGS),)
        ).fetchall()
    settings = {str(name): str(value) for name, value in rows}
    return {"version": version[0] if version else "?", "settings": settings, "cpus": os.cpu_count()}


def quiesce(admin_dsn: str, timeout: float = 20.0) -> None:
    """Let background work settle before a latency measurement: a CHECKPOINT (so its writes are not
    in the samples) and a bounded wait until no autovacuum worker is running."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        with contextlib.suppress(psycopg.Error):  # needs superuser or pg_checkpoint; skip otherwise
            conn.execute("CHECKPOINT")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'").fetchone()
            if row is None or row[0] == 0:
                return
            time.sleep(0.1)
