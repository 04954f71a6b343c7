"""The client: connect, create lanes, enqueue, inspect, retry, cancel, recover and wait.

Owns the synchronous public API used by applications, the CLI and the demo, and the runner that
executes `statements`' plans on a ``psycopg.Connection`` or a ``psycopg_pool.ConnectionPool``
(`pglane.aio` is the same API, running the same plans on asyncio). Every statement is one short
transaction on a connection in autocommit (on a pool: a connection borrowed for that statement
only, committed when it goes back) that runs a function or view of sql/; database errors come back as
PglaneError through errors.translate (by SQLSTATE or constraint name, never by message text).

To add a call: write its plan in `statements` (what it sends, checks and returns), then one function
here and one in `aio` with the same signature that run it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal, TypeVar, overload

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from . import queries, statements, timing, waiting
from .errors import ConfigurationError, DatabaseUnavailable, PglaneError, first_line, translate
from .statements import _EMPTY, Listen, Pause, Plan, Query, Row, payload_json

__all__ = ["Row", "Target", "connect", "payload_json", "resolve_dsn", "run", "translated"]

T = TypeVar("T")
# What every call takes: a connection (its own rows' type does not matter: rows come back as dicts),
# or a pool to borrow one from for each statement.
Target = psycopg.Connection[Any] | ConnectionPool[Any]


def resolve_dsn(dsn: str | None) -> str:
    """The DSN to use: the argument, else $PGLANE_DSN; a clear error when there is none."""
    import os

    value = dsn or os.environ.get("PGLANE_DSN")
    if not value:
        raise ConfigurationError(
            "no database given: pass --dsn 'postgresql://user@host/db' or set PGLANE_DSN"
            " (or run `pglane server start` for a local one, or `pglane demo`)"
        )
    return value


def connect(dsn: str | None = None, **kwargs: Any) -> psycopg.Connection[Row]:
    """An autocommit connection returning dict rows; DatabaseUnavailable with the cause if it fails."""
    target = resolve_dsn(dsn)
    try:
        return psycopg.connect(target, autocommit=True, row_factory=dict_row, **kwargs)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(
            f"cannot connect to the database ({first_line(exc)}); check that PostgreSQL is running and that "
            "--dsn / PGLANE_DSN points at it"
        ) from None


@contextmanager
def translated() -> Iterator[None]:
    """Re-raise pglane's own database errors as PglaneError subclasses."""
    try:
        yield
    except psycopg.Error as exc:
        mapped = translate(exc)
        if mapped is None:
            raise
        raise mapped from None


def shape(query: Query, rows: list[Row]) -> Any:
    """A query's answer from its fetched rows (see statements.Query)."""
    if query.rows == "all":
        return rows
    if not rows:
        if query.rows == "optional":
            return None
        raise PglaneError("the database returned no row")  # every "one" query returns exactly one row
    return rows[0]


# Every statement runs with prepare=False, never as a server-side prepared statement: producers and
# operators may connect through a transaction-mode pooler (PgBouncer), where a statement psycopg
# prepared on one server session is missing on the next ("prepared statement "_pg3_0" does not exist").
def _execute(conn: psycopg.Connection[Any], query: Query) -> Any:
    with translated():
        cur = conn.cursor(row_factory=dict_row)
        cur.execute(query.sql, query.params, prepare=False)
        return shape(query, cur.fetchall())


def run(target: Target, plan: Plan[T]) -> T:
    """Run a plan of `statements` on a connection or a pool and return its value."""
    waiter: waiting.Waiter | None = None
    try:
        step = next(plan)
        while True:
            answer: Any = None
            if isinstance(step, Query):
                if isinstance(target, ConnectionPool):
                    with target.connection() as conn:
                        answer = _execute(conn, step)
                else:
                    answer = _execute(target, step)
            elif isinstance(step, Pause):
                if step.wake_on is not None and waiter is not None:
                    answer = waiter.pause(step.seconds)
                else:
                    time.sleep(step.seconds)
            elif isinstance(step, Listen):
                waiter = waiting.listen(target, step.job_id)
            step = plan.send(answer)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        plan.close()
        if waiter is not None:
            waiter.close()


def create_lane(
    conn: Target,
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
    """Create a lane and return its id. With no lease_timeout, it is 10 % longer than job_timeout.
    ``key_retention``: seconds a pruned job's idempotency key is remembered (30 days). ``group_slots``:
    at most this many jobs of one group run at once, cluster-wide (None: no limit)."""
    return run(conn, statements.create_lane(
        name, slots=slots, job_timeout=job_timeout, lease_timeout=lease_timeout, max_attempts=max_attempts,
        max_queued=max_queued, waiting_grace=waiting_grace, max_payload_bytes=max_payload_bytes,
        retry_backoff=retry_backoff, max_result_bytes=max_result_bytes, takeover=takeover, rate=rate,
        key_retention=key_retention, group_slots=group_slots, max_deferrals=max_deferrals,
        on_retry_later=on_retry_later, pause_after_failures=pause_after_failures))


def set_lane(conn: Target, name: str, **settings: Any) -> str:
    """Change a lane while its workers run (pglane lane set): slots, job_timeout, lease_timeout (seconds),
    max_attempts, max_queued (None: unbounded), rate ('10/s'; None: unlimited), takeover, waiting_grace,
    retry_backoff, max_payload_bytes, max_result_bytes, key_retention, group_slots (None: no limit). Validated as
    create_lane is; nothing changes
    when any is refused. Returns what changed, and what it means for running workers."""
    return run(conn, statements.set_lane(name, settings))


def pause_lane(conn: Target, name: str, *, for_seconds: float | None = None, until: datetime | None = None,
               reason: str | None = None) -> str:
    """Pause a lane (pglane lane pause): it accepts jobs and starts none, for ``for_seconds``, until
    ``until``, or (neither) until resumed; calls in flight finish. Returns what it did."""
    return run(conn, statements.pause_lane(name, for_seconds=for_seconds, until=until, reason=reason))


def resume_lane(conn: Target, name: str) -> str:
    """End a lane's pause now, whatever paused it (pglane lane resume); its workers wake at once."""
    return run(conn, statements.resume_lane(name))


def lanes(conn: Target) -> list[Row]:
    return run(conn, statements.lanes())


@overload
def enqueue(conn: Target, lane: str, payload: Any = ..., *, key: str | None = ...,
            run_after: datetime | None = ..., if_full: Literal["error"] = ..., cost: int = ...,
            group: str | None = ..., priority: int = ..., job_timeout: float | None = ...) -> int: ...
@overload
def enqueue(conn: Target, lane: str, payload: Any = ..., *, key: str | None = ...,
            run_after: datetime | None = ..., if_full: Literal["skip"], cost: int = ...,
            group: str | None = ..., priority: int = ..., job_timeout: float | None = ...) -> int | None: ...
def enqueue(
    conn: Target,
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
    """Add a job and return its id; the same key returns the existing job (see pglane.enqueue). A
    payload is a JSON object or array; given none, it is ``{}``; ``None`` is refused like any scalar.
    On a full bounded lane: LaneFull (``if_full="error"``), or None with nothing written and no error
    in the server's log (``if_full="skip"``: for producers that retry anyway). ``cost`` (at least 1)
    is what the job's start counts against its lane's rate limit; more than the rate allows is refused.
    ``group`` (at most 255 characters) is the tenant the job belongs to: its lane's ``group_slots``
    limits how many of a group run at once, and groups are served in turn. ``priority``: a higher one
    starts first (default 0). ``job_timeout``: the job's own call timeout in seconds, at most its lane's
    (refused above it, nothing written)."""
    return run(conn, statements.enqueue(lane, payload, key=key, run_after=run_after, if_full=if_full,
                                                 cost=cost, group=group, priority=priority,
                                                 job_timeout=job_timeout))


def lane_status(conn: Target) -> list[Row]:
    return run(conn, statements.lane_status())


def job_status(conn: Target, job_id: int) -> Row:
    return run(conn, statements.job_status(job_id))


def jobs(conn: Target, *, lane: str | None = None, status: str | None = None, limit: int | None = 50,
         group: str | None = None) -> list[Row]:
    """Jobs as `pglane jobs` lists them (queued ones first, in service order); limit None: all of them."""
    return run(conn, statements.jobs(lane=lane, status=status, limit=limit, group=group))


def group_status(conn: Target, lane: str, limit: int | None = 20) -> list[Row]:
    """A lane's groups, the deepest queue first: queued, running, oldest wait, served last (limit None: all)."""
    return run(conn, statements.group_status(lane, limit))


def iter_jobs(conn: psycopg.Connection[Any], *, lane: str | None = None, status: str | None = None,
              limit: int | None = None, batch: int = 1000, group: str | None = None) -> Iterator[Row]:
    """The rows of jobs(), fetched `batch` at a time through a server-side cursor, so that listing
    100,000 jobs never holds them all in memory. The cursor lives in a transaction of its own on
    `conn` (one snapshot for the whole listing), which ends when the iteration does."""
    with translated(), conn.transaction(), conn.cursor("pglane_jobs", row_factory=dict_row) as cur:
        cur.itersize = batch
        cur.execute(queries.JOBS, {"lane": lane, "status": status, "limit": limit, "group": group})
        yield from cur


def attempts(conn: Target, job_id: int) -> list[Row]:
    return run(conn, statements.attempts(job_id))


def result(conn: Target, job_id: int) -> Any:
    return run(conn, statements.result(job_id))


def retry(conn: Target, job_id: int) -> bool:
    return run(conn, statements.retry(job_id))


def cancel(conn: Target, job_id: int) -> bool:
    return run(conn, statements.cancel(job_id))


def recover(conn: Target, lane: str | None = None) -> int:
    return run(conn, statements.recover(lane))


def release_lease(conn: Target, attempt_id: int) -> bool:
    """A person who knows the worker of lost attempt ``attempt_id`` is stopped ends a strict lane's wait
    for its lease (recorded on the attempt, who and when); InvalidTransition if there is no such wait."""
    return run(conn, statements.release_lease(attempt_id))


def prune(conn: Target, older_than: float, *, lane: str | None = None,
          include_failed: bool = False, batch: int | None = None,
          progress: Callable[[int], object] | None = None, forget_keys: bool = False) -> int:
    """Delete finished jobs older than ``older_than`` seconds (failed ones only if asked); returns how many.
    With ``batch``, in steps of at most that many jobs, each in its own short transaction (the
    connection must be in autocommit), ``progress`` called with the total so far after each: it may
    be interrupted at any step and run again. A pruned job's idempotency key is remembered for its
    lane's key retention (30 days by default): the same key then raises JobPruned, never runs again;
    ``forget_keys`` forgets the keys of the jobs finished before the cut, pruned now or earlier (the same
    key then makes a new job)."""
    return run(conn, statements.prune(older_than, lane=lane, include_failed=include_failed, batch=batch,
                                      progress=progress, forget_keys=forget_keys))


def prunable(conn: Target, older_than: float, *, lane: str | None = None,
             include_failed: bool = False) -> int:
    """How many jobs prune() would delete now (one read of the history)."""
    return run(conn, statements.prunable(older_than, lane=lane, include_failed=include_failed))


def stuck_attempts(conn: Target, lane: str | None = None) -> list[Row]:
    return run(conn, statements.stuck_attempts(lane))


def terminate_stuck(conn: Target, lane: str | None = None, *, wait: float = 10.0) -> int:
    """End the sessions of attempts past their lease whose worker is still connected (a person's
    decision, see `pglane recover --terminate-stuck`) and wait until they are gone, so that the
    following recover() finds the evidence. Returns how many sessions were ended."""
    return run(conn, statements.terminate_stuck(lane, wait=wait))


def wait(conn: Target, job_id: int, timeout: float | None = None, *,
         poll_interval: float = statements.DEFAULT_POLL_INTERVAL) -> Any:
    """Wait until job ``job_id`` is finished and return its stored result (``None`` waits as long as
    it takes). Raises JobFailed (``last_error``, the attempt, ``next_safe_action``), JobCancelled,
    JobPruned (finished, then deleted by a prune), UnknownJob, or WaitTimeout (saying where the job
    is: queued at position P, or running since T; the job goes on).

    Woken by a notification when the job finishes, through one listening session per process and
    database shared by every waiter (`pglane.waiting`); ``poll_interval`` is the backup poll, so that a
    lost notification costs at most that long. On a pool, each status read borrows a connection for
    that read only."""
    return run(conn, statements.wait(job_id, timeout=timeout, poll_interval=poll_interval))
