"""The protocols shared by every system that runs as its own consumer process (pglane, procrastinate,
pgqueuer, floor_listen): drain throughput, wake latency and cost per job.

Throughput: the consumer is started on an empty queue and waited for until it has settled (all its
sessions idle for 0.3 s: started, listening, found nothing); then N jobs are inserted in one
transaction with the system's own batch API. The clock starts when that commit returns (time.time())
and stops at the system's own record of its last completion (the database's now() of the completing
transaction, same wall clock): process start-up is excluded, the wake-up is included.

Wake latency: every system's consumer runs at once, idle and listening, each on its own database;
jobs are enqueued one at a time (one commit each, through the system's own enqueue call), 25-35 ms
apart whichever system they go to, after 3 untimed warm-up jobs per system, in rounds of one job per
system in a shuffled order: machine noise at any moment falls on all systems alike.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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
    sessions_like: str = "%"  # application_name (LIKE) of its consumers' sessions on its database

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


def dbname(system: RealSystem) -> str:
    return f"bench_{system.db}"


DRAIN_POLL_S = 0.25


def wait_drained(conn: psycopg.Connection[Any], system: RealSystem, proc: Any, timeout: float) -> int:
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
            procs.wait_settled(admin, dbname(system), proc)
            t0 = system.bulk_enqueue(dsn, n)
            wait_drained(conn, system, proc, timeout)
            row = conn.execute(system.finished_sql).fetchone()
    assert row is not None and row[0] is not None
    elapsed = float(row[0]) - t0
    return n / elapsed


WARMUP_BASE = 1_000_000  # payload n of untimed warm-up jobs
WAKE_GAP_S = (0.025, 0.035)  # spacing between two enqueues, whichever systems they go to


def _stamps(logs: Path, system: RealSystem) -> Path:
    return logs / f"{system.name}.wake.stamps"


async def _produce(systems: Sequence[RealSystem], dsns: dict[str, str], count: int, label: str,
                   logs: Path) -> dict[str, dict[int, float]]:
    """Enqueue WAKE_WARMUP untimed jobs to every system and wait for them to start (first-job
    effects: lazy imports, plan caches); then ``count`` rounds, each one timed job per system in a
    shuffled order, every enqueue 25-35 ms after the previous one (to any system)."""
    committed: dict[str, dict[int, float]] = {s.name: {} for s in systems}
    rng = random.Random(7)
    async with contextlib.AsyncExitStack() as stack:
        puts = {s.name: await stack.enter_async_context(s.producer(dsns[s.name])) for s in systems}
        for i in range(WAKE_WARMUP):
            for s in systems:
                await puts[s.name](WARMUP_BASE + i)
                await asyncio.sleep(0.03)
        deadline = time.monotonic() + 30.0
        while (any(len(procs.read_stamps(_stamps(logs, s))) < WAKE_WARMUP for s in systems)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.01)
        order = list(systems)
        for n in range(count):
            rng.shuffle(order)
            for s in order:
                await asyncio.sleep(rng.uniform(*WAKE_GAP_S))
                await puts[s.name](n)
                committed[s.name][n] = time.time()
            if n % 10 == 0:
                progress(f"{label} {n}/{count}")
    return committed


def _stamped(path: Path, count: int) -> Callable[[], bool]:
    return lambda: len(procs.read_stamps(path)) >= count


def wake(server: BenchServer, systems: Sequence[RealSystem], count: int, logs: Path, label: str
         ) -> dict[str, list[float]]:
    """Seconds from enqueue commit to handler start of ``count`` jobs per system: every system's
    consumer runs at once, idle and listening on its own database, and the jobs go round-robin in a
    shuffled order, so that the machine's noise at any moment falls on all systems alike."""
    dsns = {s.name: server.dsn(s.db) for s in systems}
    assert len({s.db for s in systems}) == len(systems), "each consumer needs its own database"
    with contextlib.ExitStack() as stack:
        admin = stack.enter_context(_admin(server))
        started: dict[str, Any] = {}
        for s in systems:
            _stamps(logs, s).unlink(missing_ok=True)
            with psycopg.connect(dsns[s.name], autocommit=True) as conn:
                s.reset(conn)
        quiesce(server.admin_dsn)
        for s in systems:
            args, env = s.worker(dsns[s.name], "stamp")
            env = {**env, "BENCH_STAMPS": str(_stamps(logs, s))}
            started[s.name] = stack.enter_context(procs.running(args, logs / f"{s.name}.log", env))
        for s in systems:
            procs.wait_settled(admin, dbname(s), started[s.name])
        committed = asyncio.run(_produce(systems, dsns, count, label, logs))
        for s in systems:
            wait_until(_stamped(_stamps(logs, s), count + WAKE_WARMUP), 30.0, f"{s.name} wake stamps")
    samples = {}
    for s in systems:
        stamps = procs.read_stamps(_stamps(logs, s))
        samples[s.name] = [stamps[n] - committed[s.name][n] for n in range(count)]
    return samples


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
    db = dbname(system)
    args, env = system.worker(dsn, "noop")

    def drain(count: int) -> Callable[[], int]:
        def run() -> int:
            with psycopg.connect(dsn, autocommit=True) as conn:
                probes = 0
                with procs.running(args, logs / f"{system.name}.log", env) as proc:
                    with _admin(server) as admin:
                        procs.wait_settled(admin, db, proc, timeout=180.0)
                    probes = wait_drained(conn, system, proc, 120.0)
            return probes

        return run

    with psycopg.connect(dsn, autocommit=True) as conn:
        system.reset(conn)
    empty = measure_cost(server, db, drain(0))
    system.bulk_enqueue(dsn, n)
    loaded = measure_cost(server, db, drain(n))
    return per_job(loaded, empty, n, server.statements)
