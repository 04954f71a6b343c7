"""The client API for asyncio: the names, arguments, results and errors of `pglane.client`, taking a
``psycopg.AsyncConnection`` or a ``psycopg_pool.AsyncConnectionPool``.

Owns only the asyncio runner: each call runs the same plan of `statements` as its synchronous twin
(what is sent, checked and returned is written once, there). On a pool, every statement borrows a
connection for that statement only; `wait` holds none while it waits (the listening session is
shared by every waiter of the event loop, see `pglane.waiting`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal, TypeVar, overload

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from . import statements, timing, waiting
from .client import resolve_dsn, shape, translated
from .errors import DatabaseUnavailable, first_line
from .statements import _EMPTY, Listen, Pause, Plan, Query, Row

T = TypeVar("T")
AsyncTarget = psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any]


async def connect(dsn: str | None = None, **kwargs: Any) -> psycopg.AsyncConnection[Row]:
    """An autocommit AsyncConnection returning dict rows; DatabaseUnavailable with the cause if it fails."""
    target = resolve_dsn(dsn)
    try:
        return await psycopg.AsyncConnection.connect(target, autocommit=True, row_factory=dict_row, **kwargs)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to the database ({first_line(exc)}); check that PostgreSQL is running and that "
            "--dsn / PGLANE_DSN points at it"
        ) from None


async def _execute(conn: psycopg.AsyncConnection[Any], query: Query) -> Any:
    with translated():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(query.sql, query.params, prepare=False)  # prepare=False: see client._execute
        return shape(query, await cur.fetchall())


async def run(target: AsyncTarget, plan: Plan[T]) -> T:
    """Run a plan of `statements` on an AsyncConnection or an AsyncConnectionPool and return its value."""
    waiter: waiting.AsyncWaiter | None = None
    try:
        step = next(plan)
        while True:
            answer: Any = None
            if isinstance(step, Query):
                if isinstance(target, AsyncConnectionPool):
                    async with target.connection() as conn:
                        answer = await _execute(conn, step)
                else:
                    answer = await _execute(target, step)
            elif isinstance(step, Pause):
                if step.wake_on is not None and waiter is not None:
                    answer = await waiter.pause(step.seconds)
                else:
                    await asyncio.sleep(step.seconds)
            elif isinstance(step, Listen):
                waiter = await waiting.alisten(target, step.job_id)
            step = plan.send(answer)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        plan.close()
        if waiter is not None:
            waiter.close()


async def create_lane(
    conn: AsyncTarget,
    name: str,
    *,
    slots: int = 1,
    job_timeout: float = timing.DEFAULT_JOB_TIMEOUT,
    lease_timeout: float | None = None,
    max_attempts: int = 1,
    max_queued: int | None = None,
    waiting_grace: float = 5.0,
    max_payload_bytes: int = 1024 * 1024,
    retry_backoff: float = 2.0,
    max_result_bytes: int = 16 * 1024 * 1024,
    takeover: str = "immediate",
    rate: str | None = None,
    key_retention: float = statements.DEFAULT_KEY_RETENTION,
    group_slots: int | None = None,
    max_deferrals: int = 20,
    on_retry_later: str = "lane",
    pause_after_failures: int | None = None,
) -> int:
    """See pglane.create_lane."""
    return await run(conn, statements.create_lane(
        name, slots=slots, job_timeout=job_timeout, lease_timeout=lease_timeout, max_attempts=max_attempts,
        max_queued=max_queued, waiting_grace=waiting_grace, max_payload_bytes=max_payload_bytes,
        retry_backoff=retry_backoff, max_result_bytes=max_result_bytes, takeover=takeover, rate=rate,
        key_retention=key_retention, group_slots=group_slots, max_deferrals=max_deferrals,
        on_retry_later=on_retry_later, pause_after_failures=pause_after_failures))


async def set_lane(conn: AsyncTarget, name: str, **settings: Any) -> str:
    """Change a lane while its workers run (pglane lane set): slots, job_timeout, lease_timeout (seconds),
    max_attempts, max_queued (None: unbounded), rate ('10/s'; None: unlimited), takeover, waiting_grace,
    retry_backoff, max_payload_bytes, max_result_bytes, key_retention, group_slots. Validated as create_lane is;
    nothing changes
    when any is refused. Returns what changed, and what it means for running workers."""
    return await run(conn, statements.set_lane(name, settings))


async def pause_lane(conn: AsyncTarget, name: str, *, for_seconds: float | None = None, until: datetime | None = None,
               reason: str | None = None) -> str:
    """Pause a lane (pglane lane pause): it accepts jobs and starts none, for ``for_seconds``, until
    ``until``, or (neither) until resumed; calls in flight finish. Returns what it did."""
    return await run(conn, statements.pause_lane(name, for_seconds=for_seconds, until=until, reason=reason))


async def resume_lane(conn: AsyncTarget, name: str) -> str:
    """End a lane's pause now, whatever paused it (pglane lane resume); its workers wake at once."""
    return await run(conn, statements.resume_lane(name))


async def lanes(conn: AsyncTarget) -> list[Row]:
    return await run(conn, statements.lanes())


@overload
async def enqueue(conn: AsyncTarget, lane: str, payload: Any = ..., *, key: str | None = ...,
                  run_after: datetime | None = ..., if_full: Literal["error"] = ..., cost: int = ...,
            group: str | None = ..., priority: int = ..., job_timeout: float | None = ...) -> int: ...
@overload
async def enqueue(conn: AsyncTarget, lane: str, payload: Any = ..., *, key: str | None = ...,
                  run_after: datetime | None = ..., if_full: Literal["skip"], cost: int = ...,
            group: str | None = ..., priority: int = ..., job_timeout: float | None = ...) -> int | None: ...
async def enqueue(
    conn: AsyncTarget,
    lane: str,
    payload: Any = _EMPTY,
    *,
    key: str | None = None,
    run_after: datetime | None = None,
    if_full: Literal["error", "skip"] = "error",
    cost: int = 1,
    group: str | None = None,
    priority: int = 0,
    job_timeout: float | None = None,
) -> int | None:
    """See pglane.enqueue."""
    return await run(conn, statements.enqueue(lane, payload, key=key, run_after=run_after, if_full=if_full,
                                                 cost=cost, group=group, priority=priority,
                                                 job_timeout=job_timeout))


async def lane_status(conn: AsyncTarget) -> list[Row]:
    return await run(conn, statements.lane_status())


async def job_status(conn: AsyncTarget, job_id: int) -> Row:
    return await run(conn, statements.job_status(job_id))


async def jobs(conn: AsyncTarget, *, lane: str | None = None, status: str | None = None,
               limit: int | None = 50, group: str | None = None) -> list[Row]:
    return await run(conn, statements.jobs(lane=lane, status=status, limit=limit, group=group))


async def group_status(conn: AsyncTarget, lane: str, limit: int | None = 20) -> list[Row]:
    """See pglane.group_status."""
    return await run(conn, statements.group_status(lane, limit))


async def attempts(conn: AsyncTarget, job_id: int) -> list[Row]:
    return await run(conn, statements.attempts(job_id))


async def result(conn: AsyncTarget, job_id: int) -> Any:
    return await run(conn, statements.result(job_id))


async def retry(conn: AsyncTarget, job_id: int) -> bool:
    return await run(conn, statements.retry(job_id))


async def cancel(conn: AsyncTarget, job_id: int) -> bool:
    return await run(conn, statements.cancel(job_id))


async def recover(conn: AsyncTarget, lane: str | None = None) -> int:
    return await run(conn, statements.recover(lane))


async def release_lease(conn: AsyncTarget, attempt_id: int) -> bool:
    return await run(conn, statements.release_lease(attempt_id))


async def prune(conn: AsyncTarget, older_than: float, *, lane: str | None = None,
                include_failed: bool = False, batch: int | None = None,
                progress: Callable[[int], object] | None = None) -> int:
    """See pglane.prune."""
    return await run(conn, statements.prune(older_than, lane=lane, include_failed=include_failed, batch=batch,
                                            progress=progress))


async def prunable(conn: AsyncTarget, older_than: float, *, lane: str | None = None,
                   include_failed: bool = False) -> int:
    return await run(conn, statements.prunable(older_than, lane=lane, include_failed=include_failed))


async def stuck_attempts(conn: AsyncTarget, lane: str | None = None) -> list[Row]:
    return await run(conn, statements.stuck_attempts(lane))


async def terminate_stuck(conn: AsyncTarget, lane: str | None = None, *, wait: float = 10.0) -> int:
    return await run(conn, statements.terminate_stuck(lane, wait=wait))


async def wait(conn: AsyncTarget, job_id: int, timeout: float | None = None, *,
               poll_interval: float = statements.DEFAULT_POLL_INTERVAL) -> Any:
    """See pglane.wait: the job's stored result once it is done; JobFailed, JobCancelled, JobPruned,
    UnknownJob or WaitTimeout otherwise. Holds no connection while it waits."""
    return await run(conn, statements.wait(job_id, timeout=timeout, poll_interval=poll_interval))
