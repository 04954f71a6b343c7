"""The client: connect, create lanes, enqueue, inspect, retry, cancel and recover.

Owns the synchronous public API used by applications, the CLI and the demo. Every call is one short
transaction that runs a function or view of sql/; database errors come back as PglaneError through
errors.translate (by SQLSTATE or constraint name, never by message text).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal, LiteralString, overload

import psycopg
from psycopg.rows import dict_row

from . import queries, timing
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    InvalidPayload,
    PglaneError,
    UnknownJob,
    first_line,
    translate,
)

Row = dict[str, Any]


def resolve_dsn(dsn: str | None) -> str:
    """The DSN to use: the argument, else $PGLANE_DSN; a clear error when there is none."""
    import os

    value = dsn or os.environ.get("PGLANE_DSN")
    if not value:
        raise ConfigurationError(
            "no database given: pass --dsn 'postgresql://user@host/db' or set PGLANE_DSN"
            " (or run `pglane demo`, which starts its own embedded PostgreSQL)"
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


# Every statement here runs with prepare=False, never as a server-side prepared statement: producers and
# operators may connect through a transaction-mode pooler (PgBouncer), where a statement psycopg prepared
# on one server session is missing on the next ("prepared statement "_pg3_0" does not exist").
def _one(conn: psycopg.Connection[Row], query: LiteralString, params: tuple[Any, ...] | dict[str, Any]) -> Row:
    with translated():
        row = conn.execute(query, params, prepare=False).fetchone()
    if row is None:  # every query given here returns exactly one row
        raise PglaneError("the database returned no row")
    return row


def payload_json(payload: Any) -> str:
    """Serialise a payload; InvalidPayload (nothing written) if it is not JSON."""
    try:
        return json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"payload is not JSON-serialisable ({exc}); send dicts, lists, strings, numbers") from None


def create_lane(
    conn: psycopg.Connection[Row],
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
) -> int:
    """Create a lane and return its id. With no lease_timeout, it is 10 % longer than job_timeout."""
    lease = timing.default_lease_timeout(job_timeout) if lease_timeout is None else lease_timeout
    for label, value in (("job_timeout", job_timeout), ("lease_timeout", lease)):
        if not math.isfinite(value):
            raise ConfigurationError(f"{label} must be a finite number of seconds")
    row = _one(
        conn,
        queries.CREATE_LANE,
        (name, slots, job_timeout, lease, max_attempts, max_queued, waiting_grace, max_payload_bytes, retry_backoff,
         max_result_bytes, takeover),
    )
    return int(row["id"])


def lanes(conn: psycopg.Connection[Row]) -> list[Row]:
    with translated():
        return conn.execute(queries.LANES, {"name": None}, prepare=False).fetchall()


_EMPTY: Any = object()  # enqueue() was given no payload: the job's is {}


@overload
def enqueue(conn: psycopg.Connection[Row], lane: str, payload: Any = ..., *, key: str | None = ...,
            run_after: datetime | None = ..., if_full: Literal["error"] = ...) -> int: ...
@overload
def enqueue(conn: psycopg.Connection[Row], lane: str, payload: Any = ..., *, key: str | None = ...,
            run_after: datetime | None = ..., if_full: Literal["skip"]) -> int | None: ...
def enqueue(
    conn: psycopg.Connection[Row],
    lane: str,
    payload: Any = _EMPTY,
    *,
    key: str | None = None,
    run_after: datetime | None = None,
    if_full: Literal["error", "skip"] = "error",
) -> int | None:
    """Add a job and return its id; the same key returns the existing job (see pglane.enqueue). A
    payload is a JSON object or array; given none, it is ``{}``; ``None`` is refused like any scalar.
    On a full bounded lane: LaneFull (``if_full="error"``), or None with nothing written and no error
    in the server's log (``if_full="skip"``: for producers that retry anyway)."""
    text = "{}" if payload is _EMPTY else payload_json(payload)
    row = _one(conn, queries.ENQUEUE, (lane, text, key, run_after, if_full))
    return None if row["enqueue"] is None else int(row["enqueue"])


def lane_status(conn: psycopg.Connection[Row]) -> list[Row]:
    with translated():
        return conn.execute(queries.LANE_STATUS, prepare=False).fetchall()


def job_status(conn: psycopg.Connection[Row], job_id: int) -> Row:
    with translated():
        row = conn.execute(queries.JOB_STATUS, (job_id,), prepare=False).fetchone()
    if row is None:
        raise UnknownJob(f"no job {job_id}; list jobs with: pglane jobs")
    return row


def jobs(
    conn: psycopg.Connection[Row], *, lane: str | None = None, status: str | None = None, limit: int = 50
) -> list[Row]:
    with translated():
        return conn.execute(queries.JOBS, {"lane": lane, "status": status, "limit": limit}, prepare=False).fetchall()


def attempts(conn: psycopg.Connection[Row], job_id: int) -> list[Row]:
    with translated():
        return conn.execute(queries.ATTEMPTS, (job_id,), prepare=False).fetchall()


def result(conn: psycopg.Connection[Row], job_id: int) -> Any:
    with translated():
        row = conn.execute(queries.JOB_RESULT, (job_id,), prepare=False).fetchone()
    if row is None:
        raise UnknownJob(f"no job {job_id}; list jobs with: pglane jobs")
    return row["result"]


def retry(conn: psycopg.Connection[Row], job_id: int) -> bool:
    return bool(_one(conn, queries.RETRY, (job_id,))["retry"])


def cancel(conn: psycopg.Connection[Row], job_id: int) -> bool:
    return bool(_one(conn, queries.CANCEL, (job_id,))["cancel"])


def recover(conn: psycopg.Connection[Row], lane: str | None = None) -> int:
    return int(_one(conn, queries.RECOVER, (lane,))["recover"])


def release_lease(conn: psycopg.Connection[Row], attempt_id: int) -> bool:
    """A person who knows the worker of lost attempt ``attempt_id`` is stopped ends a strict lane's wait
    for its lease (recorded on the attempt, who and when); InvalidTransition if there is no such wait."""
    return bool(_one(conn, queries.RELEASE_LEASE, (attempt_id,))["release_lease"])


def prune(conn: psycopg.Connection[Row], older_than: float, *, lane: str | None = None,
          include_failed: bool = False, batch: int | None = None,
          progress: Callable[[int], object] | None = None) -> int:
    """Delete finished jobs older than ``older_than`` seconds (failed ones only if asked); returns how many.
    With ``batch``, in steps of at most that many jobs, each in its own short transaction (the
    connection must be in autocommit), ``progress`` called with the total so far after each: it may
    be interrupted at any step and run again."""
    if batch is None:
        return int(_one(conn, queries.PRUNE, (older_than, lane, include_failed))["prune"])
    total, after = 0, 0
    while True:
        row = _one(conn, queries.PRUNE_BATCH, (older_than, lane, include_failed, after, batch))
        if row["last_id"] is None:
            return total
        total, after = total + int(row["deleted"]), int(row["last_id"])
        if progress is not None:
            progress(total)


def prunable(conn: psycopg.Connection[Row], older_than: float, *, lane: str | None = None,
             include_failed: bool = False) -> int:
    """How many jobs prune() would delete now (one read of the history)."""
    return int(_one(conn, queries.PRUNABLE, {"age": older_than, "lane": lane, "failed": include_failed})["n"])


def stuck_attempts(conn: psycopg.Connection[Row], lane: str | None = None) -> list[Row]:
    with translated():
        return conn.execute(queries.STUCK, (lane,), prepare=False).fetchall()


def terminate_stuck(conn: psycopg.Connection[Row], lane: str | None = None, *, wait: float = 10.0) -> int:
    """End the sessions of attempts past their lease whose worker is still connected (a person's
    decision, see `pglane recover --terminate-stuck`) and wait until they are gone, so that the
    following recover() finds the evidence. Returns how many sessions were ended."""
    import time

    pids = {int(row["backend_pid"]) for row in stuck_attempts(conn, lane)}
    for pid in pids:
        with translated():
            conn.execute(queries.TERMINATE, (pid,), prepare=False)
    deadline = time.monotonic() + wait
    while pids and time.monotonic() < deadline:
        alive = conn.execute(queries.LIVE_SESSIONS, (list(pids),), prepare=False).fetchone()
        if alive is None or alive["n"] == 0:
            break
        time.sleep(0.05)
    return len(pids)
