"""The protocols shared by every system that runs as its own consumer process (pglane, procrastinate,
pgqueuer, floor_listen): drain throughput, wake latency and cost per job.

Throughput: the consumer is started on an empty queue and waited for until it has settled (all its
sessions idle for 0.3 s: started, listening, found nothing); then N jobs are inserted in one
transaction with the system's own batch API. The clock starts when that commit returns (time.time())
and stops at the system's own record of its last completion (the database's now() of the completing
transaction, same wall clock): process start-up is excluded, the wake-up is included.

Wake latency: the consumer is idle and listening; jobs are enqueued one at a time (one commit each,
through the system's own enqueue call), 25-35 ms apart, after 3 untimed warm-up jobs, in chunks:
each system's samples come from several consumer runs interleaved with the other systems' runs, so
machine noise hits all alike.
Latency = the handler's time.time() at its first line (a stamp line) minus the producer's
time.time() right after its enqueue call returned. The producer's clock is read after the commit's
reply, so the figure slightly under-states commit→start by at most one reply's trip; the same bias
applies to every system. Before each run: CHECKPOINT and no autovacuum worker running.

Cost per job: N jobs are preloaded with no consumer running; counters are read; the consumer is
started, waited for until drained, stopped, and all its sessions gone (so their statistics are
flushed); counters are read again. The same protocol with zero jobs gives the fixed start/stop cost,
which is subtracted. Counters: WAL bytes (pg_current_wal_lsn); commits (pg_stat_database.xact_commit
of the system's database: every transaction, read-only ones included); write commits (the delta of
the next transaction id: transactions that wrote, each one a WAL flush under synchronous_commit);
round trips (top-level statements counted by pg_stat_statements on that database). The harness's own
drain probes (one autocommit read each) are subtracted from commits and statements.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, LiteralString

import psycopg

from . import procs
from .server import BenchServer, quiesce
from .stats import BenchTimeout, progress, wait_until

Put = Callable[[int], Awaitable[None]]


def sql_producer(dsn: str, statement: LiteralString, params: Callable[[int], tuple[Any, ...]]
                 ) -> AbstractAsyncContextManager[Put]:
    """A producer that enqueues job n with one autocommitted ``statement`` on its own connection."""
    @contextlib.asynccontextmanager
    async def context() -> AsyncIterator[Put]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            async def put(n: int) -> None:
                await conn.execute(statement, params(n))

            yield put

    return context()
WAKE_WARMUP = 3


class RealSystem(abc.ABC):
    name: str
    db: str  # key of BenchServer.dsns
    remaining_sql: str  # one row with one column: jobs not finished yet
    finished_sql: str  # one row with one column: epoch seconds of the last completion

    @abc.abstractmethod
    def setup(self, dsn: str) -> None: ...

    @abc.abstractmethod
    def reset(self, conn: psycopg.Connection[Any]) -> None:
        """Empty the system's tables."""

    @abc.abstractmethod
    def worker(self, dsn: str, handler: str) -> tuple[list[str], dict[str, str]]:
        """Arguments for ``python`` and extra environment of one consumer; handler is noop or stamp."""

    @abc.abstractmethod
    def bulk_enqueue(self, dsn: str, n: int) -> float:
        """Insert jobs with payload n = 0..n-1 in one transaction; time.time() right after its commit."""

    @abc.abstractmethod
    def producer(self, dsn: str) -> AbstractAsyncContextManager[Put]:
        """An async context giving ``put(n)``: enqueue one job (one commit) and return after the commit."""

    def remaining(self, conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(self.remaining_sql).fetchone()
        return int(row[0]) if row else 0


def _admin(server: BenchServer) -> psycopg.Connection[Any]:
    return psycopg.connect(server.admin_dsn, autocommit=True)


def _dbname(system: RealSystem) -> str:
    return f"bench_{system.db}"


DRAIN_POLL_S = 0.25


def _wait_drained(conn: psycopg.Connection[Any], system: RealSystem, proc: Any, timeout: float) -> int:
    """Poll until nothing remains; returns how many probes ran. Every 0.25 s: the end time comes from
    the database (the last finished_at), so a coarse poll loses no accuracy, while a fine one took CPU
    from the worker being measured on a 2-core machine."""
    probes = 0
    deadline = time.monotonic() + timeout
    while True:
        probes += 1
        if system.remaining(conn) == 0:
            return probes
        if proc.poll() is not None:
            raise BenchTimeout(f"{system.name} worker exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise BenchTimeout(f"{system.name} did not drain within {timeout:g}s")
        time.sleep(DRAIN_POLL_S)


def throughput(server: BenchServer, system: RealSystem, n: int, logs: Path, timeout: float = 120.0) -> float:
    """Jobs per second of one drain of n no-op jobs (see the module doc)."""
    dsn = server.dsn(system.db)
    args, env = system.worker(dsn, "noop")
    with _admin(server) as admin, psycopg.connect(dsn, autocommit=True) as conn:
        system.reset(conn)
        with procs.running(args, logs / f"{system.name}.log", env) as proc:
            procs.wait_settled(admin, _dbname(system), proc)
            t0 = system.bulk_enqueue(dsn, n)
            _wait_drained(conn, system, proc, timeout)
            row = conn.execute(system.finished_sql).fetchone()
    assert row is not None and row[0] is not None
    elapsed = float(row[0]) - t0
    return n / elapsed


WARMUP_BASE = 1_000_000  # payload n of untimed warm-up jobs


async def _produce(system: RealSystem, dsn: str, count: int, label: str, stamps: Path) -> dict[int, float]:
    """Enqueue WAKE_WARMUP untimed jobs and wait for the consumer to start them (first-job effects:
    lazy imports, plan caches), then ``count`` timed jobs spaced 25-35 ms apart."""
    committed: dict[int, float] = {}
    rng = random.Random(7)
    async with system.producer(dsn) as put:
        for i in range(WAKE_WARMUP):
            await put(WARMUP_BASE + i)
            await asyncio.sleep(0.03)
        deadline = time.monotonic() + 30.0
        while len(procs.read_stamps(stamps)) < WAKE_WARMUP and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for n in range(count):
            await asyncio.sleep(0.025 + rng.random() * 0.01)
            await put(n)
            committed[n] = time.time()
            if n % 20 == 0:
                progress(f"{label} {n}/{count}")
    return committed


def wake(server: BenchServer, system: RealSystem, count: int, logs: Path, label: str) -> list[float]:
    """Seconds from enqueue commit to handler start of ``count`` jobs spaced apart, one consumer run."""
    dsn = server.dsn(system.db)
    stamps_file = logs / f"{system.name}.wake.stamps"
    stamps_file.unlink(missing_ok=True)
    args, env = system.worker(dsn, "stamp")
    env = {**env, "BENCH_STAMPS": str(stamps_file)}
    with _admin(server) as admin, psycopg.connect(dsn, autocommit=True) as conn:
        system.reset(conn)
        quiesce(server.admin_dsn)
        with procs.running(args, logs / f"{system.name}.log", env) as proc:
            procs.wait_settled(admin, _dbname(system), proc)
            committed = asyncio.run(_produce(system, dsn, count, label, stamps_file))
            wait_until(lambda: len(procs.read_stamps(stamps_file)) >= count + WAKE_WARMUP, 30.0,
                       f"{system.name} wake stamps")
    started = procs.read_stamps(stamps_file)
    return [started[n] - committed[n] for n in range(count)]


# ----- cost per job ----------------------------------------------------------------------------

def counters(admin: psycopg.Connection[Any], dbname: str, statements: bool) -> dict[str, float]:
    """WAL position, commits of dbname, the next transaction id (its delta counts the transactions that
    wrote: each one a WAL flush under synchronous_commit), top-level statements on dbname."""
    row = admin.execute(
        "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, xact_commit,"
        " pg_snapshot_xmax(pg_current_snapshot())::text::bigint FROM pg_stat_database WHERE datname = %s",
        (dbname,),
    ).fetchone()
    assert row is not None
    calls = 0.0
    if statements:
        found = admin.execute(
            "SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = %s",
            (dbname,),
        ).fetchone()
        calls = float(found[0]) if found else 0.0
    return {"wal": float(row[0]), "commits": float(row[1]), "xids": float(row[2]), "statements": calls}


def _flush_stats(admin: psycopg.Connection[Any], dbname: str) -> None:
    procs.wait_no_backends(admin, dbname)
    time.sleep(0.1)  # exiting backends flush their statistics on the way out


def measure_cost(server: BenchServer, dbname: str, run: Callable[[], int]) -> dict[str, float]:
    """Counter deltas around ``run()``, which returns how many harness probes it made on dbname
    (each an autocommit statement: one commit and one tagged statement)."""
    with _admin(server) as admin:
        _flush_stats(admin, dbname)
        before = counters(admin, dbname, server.statements)
        probes = run()
        _flush_stats(admin, dbname)
        after = counters(admin, dbname, server.statements)
    delta = {key: after[key] - before[key] for key in before}
    delta["commits"] -= probes
    delta["statements"] -= probes if server.statements else 0
    return delta


def per_job(loaded: dict[str, float], empty: dict[str, float], n: int, statements: bool) -> dict[str, Any]:
    result: dict[str, Any] = {
        "wal_bytes_per_job": (loaded["wal"] - empty["wal"]) / n,
        "commits_per_job": (loaded["commits"] - empty["commits"]) / n,
        "write_commits_per_job": (loaded["xids"] - empty["xids"]) / n,
        "round_trips_per_job": (loaded["statements"] - empty["statements"]) / n if statements else None,
        "jobs": n,
    }
    return result


def cost(server: BenchServer, system: RealSystem, n: int, logs: Path) -> dict[str, Any]:
    """Cost per job of draining n preloaded no-op jobs through the system's real consumer."""
    dsn = server.dsn(system.db)
    dbname = _dbname(system)
    args, env = system.worker(dsn, "noop")

    def drain(count: int) -> Callable[[], int]:
        def run() -> int:
            with psycopg.connect(dsn, autocommit=True) as conn:
                probes = 0
                with procs.running(args, logs / f"{system.name}.log", env) as proc:
                    with _admin(server) as admin:
                        procs.wait_settled(admin, dbname, proc, timeout=180.0)
                    probes = _wait_drained(conn, system, proc, 120.0)
            return probes

        return run

    with psycopg.connect(dsn, autocommit=True) as conn:
        system.reset(conn)
    empty = measure_cost(server, dbname, drain(0))
    system.bulk_enqueue(dsn, n)
    loaded = measure_cost(server, dbname, drain(n))
    return per_job(loaded, empty, n, server.statements)
