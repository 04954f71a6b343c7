"""The PostgreSQL servers the benchmark runs against, and one fresh database per system.

Owns: starting the embedded server (durable: fsync and synchronous_commit on, pg_stat_statements
preloaded, which needs one restart) or adopting a server given by DSN; creating the ``bench_*``
databases (dropped first if a previous run left them); reporting the server's version and the
settings that decide the figures. Everything stays on this machine (Unix socket).

``python -m bench.server start --bindir DIR --data DIR`` starts a throwaway cluster from any
PostgreSQL installation (e.g. the system's 15 at /usr/lib/postgresql/15/bin), tuned exactly as the
embedded one, and prints its DSN for ``python -m bench --dsn``; ``stop --data DIR`` stops it. As root
it runs the server in a user namespace like pglane.embedded does; the data directory is kept.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
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


def _create_databases(admin_dsn: str, names: Sequence[str]) -> dict[str, str]:
    dsns = {}
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name in names:
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


def tune_embedded(admin_dsn: str) -> None:
    """Durable commits and pg_stat_statements (its default track=top: PostgreSQL 15 refuses to set a
    setting of a library not loaded yet); settings in postgresql.auto.conf need the restart."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        for name, value in (
            ("shared_preload_libraries", "pg_stat_statements"),
            ("synchronous_commit", "on"),
            ("shared_buffers", "256MB"),
            ("max_wal_size", "4GB"),
            ("track_io_timing", "off"),
        ):
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))


@contextlib.contextmanager
def bench_server(dsn: str | None = None, extra: Sequence[str] = (), use_env: bool = True
                 ) -> Iterator[BenchServer]:
    """The server of ``dsn`` (else, with ``use_env``, of PGLANE_DSN) if given, else a throwaway embedded
    PostgreSQL (stopped at exit); with databases bench_NAME for DATABASES and ``extra``."""
    given = dsn or (os.environ.get("PGLANE_DSN") if use_env else None)
    names = [*DATABASES, *extra]
    if given:
        server = BenchServer(given, _enable_statements(given))
        server.dsns = _create_databases(given, names)
        yield server
        return
    from pglane.embedded import embedded_server

    with embedded_server(fsync=True) as embedded:
        tune_embedded(embedded.dsn)
        embedded.restart("fast")
        server = BenchServer(embedded.dsn, _enable_statements(embedded.dsn))
        server.dsns = _create_databases(embedded.dsn, names)
        yield server


@contextlib.contextmanager
def env_or_embedded() -> Iterator[str]:
    """PGLANE_DSN when it is set, else a throwaway embedded PostgreSQL (stopped at exit): the server of
    the modules that make their own lanes in pglane's default database (rates, contention, bench.lab)."""
    dsn = os.environ.get("PGLANE_DSN")
    if dsn:
        yield dsn
        return
    from pglane.embedded import embedded_postgres

    with embedded_postgres() as embedded:
        yield embedded


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


# ----- a throwaway cluster of another PostgreSQL installation ------------------------------------

BINDIR_FILE = "bench_bindir"  # in the data directory: which installation runs it (for stop)


def _cluster(bindir: Path, data_dir: Path) -> Any:
    """The EmbeddedServer of ``data_dir``, with pglane.pgbin pointed at ``bindir`` for this process."""
    from pglane.embedded import EmbeddedServer

    os.environ["PGLANE_PG_BINDIR"] = str(bindir)
    return EmbeddedServer(data_dir, data_dir, fsync=True)


def start_cluster(bindir: Path, data_dir: Path) -> str:
    """initdb (when new), the embedded server's tuning, start; returns the DSN. Idempotent."""
    from pglane.embedded import embedded_server

    data_dir = data_dir.absolute()
    os.environ["PGLANE_PG_BINDIR"] = str(bindir)
    server = _cluster(bindir, data_dir)
    if not server.is_running():
        if not (data_dir / "PG_VERSION").exists():
            with embedded_server(data_dir, fsync=True) as first:  # initdb, start; stopped at exit
                tune_embedded(first.dsn)
            (data_dir / BINDIR_FILE).write_text(str(bindir))
        server.start()
    return str(server.dsn)


def stop_cluster(data_dir: Path) -> None:
    data_dir = data_dir.absolute()
    try:
        bindir = Path((data_dir / BINDIR_FILE).read_text().strip())
    except OSError:
        raise SystemExit(f"{data_dir} was not started by python -m bench.server start (no {BINDIR_FILE})") from None
    _cluster(bindir, data_dir).stop("fast")


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.server", description="a throwaway cluster for the bench")
    sub = p.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="initdb if new, start, print the DSN")
    start.add_argument("--bindir", type=Path, required=True, help="PostgreSQL's bin directory (pg_ctl, initdb)")
    start.add_argument("--data", type=Path, required=True, help="data directory (short path: it holds the socket)")
    stop = sub.add_parser("stop", help="stop the cluster on this data directory")
    stop.add_argument("--data", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "start":
        print(start_cluster(args.bindir, args.data))
    else:
        stop_cluster(args.data)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
