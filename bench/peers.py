"""The peers: procrastinate and pgqueuer, each with its own schema in its own database, driven
through their public APIs only.

procrastinate: App + PsycopgConnector; one async task ``noop(n)``; the worker is
  ``app.run_worker_async(concurrency=1, listen_notify=True)``, stopped by SIGTERM (its own handler).
  Jobs are deferred with ``batch_defer_async`` (bulk) or ``defer_async`` (one).
pgqueuer: QueueManager over one asyncpg connection; entrypoint ``noop`` with concurrency_limit=1,
  ``run(batch_size=1)``; SIGTERM sets its shutdown event. Jobs go in with ``Queries.enqueue``
  (a list of N in one statement, or one).

Each worker runs as ``python -m bench.peers {procrastinate|pgqueuer} DSN``; its task stamps the start
of job n when BENCH_STAMPS is set.

What each sends the server per job, read from the installed release (``procrastinate_job_sql``,
``pgqueuer_job_sql``), is what bench.costs counts in a single-user backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import asyncpg
import procrastinate
import psycopg
from pgqueuer import Job, QueueManager
from pgqueuer.queries import EntrypointExecutionParameter, Queries
from pgqueuer.types import QueueEntrypoint, QueueManagerId
from psycopg.conninfo import conninfo_to_dict

from .procs import stamp
from .real import Put, RealSystem

ENTRYPOINT = "noop"
CONCURRENCY_LIMIT = 1  # pgqueuer's entrypoint: one job at a time, as one slot of a lane


async def _asyncpg(dsn: str) -> asyncpg.Connection:
    """asyncpg takes URLs or keywords, not libpq key=value strings."""
    params = conninfo_to_dict(dsn)
    return await asyncpg.connect(host=params.get("host"), port=int(params.get("port") or 5432),
                                 user=params.get("user"), password=params.get("password"),
                                 database=params.get("dbname"))


# ----- procrastinate ---------------------------------------------------------------------------

def procrastinate_app(dsn: str) -> procrastinate.App:
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name=ENTRYPOINT)
    async def noop(n: int = -1) -> None:
        stamp(n)

    return app


async def _procrastinate_worker(dsn: str) -> None:
    app = procrastinate_app(dsn)
    async with app.open_async():
        await app.run_worker_async(concurrency=1, wait=True, listen_notify=True, install_signal_handlers=True,
                                   fetch_job_polling_interval=5.0, delete_jobs="never")


class Procrastinate(RealSystem):
    name = "procrastinate"
    db = "procrastinate"

    def __init__(self, db: str = "procrastinate") -> None:
        self.db = db  # several slot counts run at once, each in a database of its own
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    finished_sql = ("SELECT extract(epoch FROM max(at))::float8 FROM procrastinate_events"
                    " WHERE type IN ('succeeded', 'failed')")

    def setup(self, dsn: str) -> None:
        async def apply() -> None:
            app = procrastinate_app(dsn)
            async with app.open_async():
                await app.schema_manager.apply_schema_async()

        asyncio.run(apply())

    def reset(self, conn: psycopg.Connection[Any]) -> None:
        # not procrastinate_workers: a standing worker's row must stay (its jobs refer to it)
        conn.execute("TRUNCATE procrastinate_events, procrastinate_periodic_defers, procrastinate_jobs")

    def worker(self, dsn: str, handler: str) -> tuple[list[str], dict[str, str]]:
        return ["-m", "bench.peers", "procrastinate", dsn], {}

    def bulk_enqueue(self, dsn: str, n: int) -> float:
        async def defer() -> float:
            app = procrastinate_app(dsn)
            async with app.open_async():
                jobs: list[dict[str, Any]] = [{"n": i} for i in range(n)]
                await app.tasks[ENTRYPOINT].batch_defer_async(*jobs)
                return time.time()

        return asyncio.run(defer())

    def producer(self, dsn: str) -> AbstractAsyncContextManager[Put]:
        @contextlib.asynccontextmanager
        async def context() -> AsyncIterator[Put]:
            app = procrastinate_app(dsn)
            async with app.open_async():
                task = app.tasks[ENTRYPOINT]

                async def put(n: int) -> None:
                    await task.defer_async(n=n)

                yield put

        return context()


# ----- pgqueuer --------------------------------------------------------------------------------

async def _pgqueuer_worker(dsn: str) -> None:
    conn = await _asyncpg(dsn)
    qm = QueueManager(Queries.from_asyncpg_connection(conn))

    @qm.entrypoint(ENTRYPOINT, concurrency_limit=CONCURRENCY_LIMIT)
    async def noop(job: Job) -> None:
        stamp(int(json.loads(job.payload or b"{}").get("n", -1)))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, qm.shutdown.set)
    try:
        await qm.run(batch_size=1, dequeue_timeout=timedelta(seconds=5))
    finally:
        await conn.close()


class Pgqueuer(RealSystem):
    name = "pgqueuer"
    db = "pgqueuer"

    def __init__(self, db: str = "pgqueuer") -> None:
        self.db = db  # several slot counts run at once, each in a database of its own
    remaining_sql = "SELECT count(*) FROM pgqueuer"
    finished_sql = "SELECT extract(epoch FROM max(created))::float8 FROM pgqueuer_log WHERE status <> 'queued'"

    def setup(self, dsn: str) -> None:
        async def install() -> None:
            conn = await _asyncpg(dsn)
            try:
                await Queries.from_asyncpg_connection(conn).install()
            finally:
                await conn.close()

        asyncio.run(install())

    def reset(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")

    def worker(self, dsn: str, handler: str) -> tuple[list[str], dict[str, str]]:
        return ["-m", "bench.peers", "pgqueuer", dsn], {}

    def bulk_enqueue(self, dsn: str, n: int) -> float:
        async def enqueue() -> float:
            conn = await _asyncpg(dsn)
            try:
                payloads: list[bytes | None] = [json.dumps({"n": i}).encode() for i in range(n)]
                await Queries.from_asyncpg_connection(conn).enqueue([ENTRYPOINT] * n, payloads, [0] * n)
                return time.time()
            finally:
                await conn.close()

        return asyncio.run(enqueue())

    def producer(self, dsn: str) -> AbstractAsyncContextManager[Put]:
        @contextlib.asynccontextmanager
        async def context() -> AsyncIterator[Put]:
            conn = await _asyncpg(dsn)
            try:
                queries = Queries.from_asyncpg_connection(conn)

                async def put(n: int) -> None:
                    await queries.enqueue(ENTRYPOINT, json.dumps({"n": n}).encode())

                yield put
            finally:
                await conn.close()

        return context()


# ----- what each peer sends per job ------------------------------------------------------------

def procrastinate_job_sql() -> tuple[str, str]:
    """procrastinate's fetch and finish statements as its worker sends them (psycopg placeholders
    ``%(name)s``): the installed release's queries.sql, read by its own loader."""
    from procrastinate import sql as procrastinate_sql

    return procrastinate_sql.queries["fetch_job"], procrastinate_sql.queries["finish_job"]


class _Recorder:
    """A pgqueuer driver that keeps what it is asked to send and answers nothing."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...]]] = []

    async def fetch(self, query: str, *args: Any) -> list[Any]:
        self.sent.append((query, args))
        return []

    async def execute(self, query: str, *args: Any) -> str:
        self.sent.append((query, args))
        return ""


def pgqueuer_job_sql(queue_manager_id: uuid.UUID, job_id: int) -> list[tuple[str, tuple[Any, ...]]]:
    """pgqueuer's dequeue and completion statements (``$n`` placeholders) and their arguments, as its
    QueueManager sends them for the bench's worker (entrypoint noop, concurrency_limit 1, batch_size 1,
    run()'s own defaults for the rest), with job ``job_id`` completed: its Queries, over a driver that
    records."""
    recorder = _Recorder()
    queries = Queries(recorder)  # type: ignore[arg-type]
    run = inspect.signature(QueueManager.run).parameters

    async def send() -> None:
        await queries.dequeue(batch_size=1, entrypoints={
            QueueEntrypoint(ENTRYPOINT): EntrypointExecutionParameter(concurrency_limit=CONCURRENCY_LIMIT)},
            queue_manager_id=QueueManagerId(queue_manager_id),
            global_concurrency_limit=run["max_concurrent_tasks"].default or None,
            heartbeat_timeout=run["heartbeat_timeout"].default)
        await queries.log_jobs([(SimpleNamespace(id=job_id), "successful", None)])  # type: ignore[list-item]

    asyncio.run(send())
    return recorder.sent


if __name__ == "__main__":
    WORKERS = {"procrastinate": _procrastinate_worker, "pgqueuer": _pgqueuer_worker}
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit("usage: python -m bench.peers {procrastinate|pgqueuer} DSN")
    asyncio.run(WORKERS[sys.argv[1]](sys.argv[2]))
