"""Every client call, written once, as a plan of steps free of I/O; `client` runs plans on a
connection or a pool, `aio` runs the same plans on their asyncio counterparts.

Owns: what each public call of the client API sends (a statement of `queries`, its parameters),
what it checks before sending, and how it shapes the rows that come back. A plan is a generator: it
yields a step (`Query`, `Pause`, `Listen`) and is sent the step's answer (the rows of a `Query`;
`None` for the others); its return value is the call's. A runner only executes steps, so the sync
and the async API cannot drift apart: adding a call means one plan here and a one-line function in
each of `client` and `aio` with the same signature.

Invariant: a plan never touches a connection, a clock it sleeps on, or a socket; everything that
waits or talks to the server is a step. (Reading ``time.monotonic()`` for a deadline is allowed.)
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, LiteralString, TypeVar

from . import queries, timing, tracing
from .errors import (
    ConfigurationError,
    InvalidInput,
    InvalidPayload,
    JobCancelled,
    JobFailed,
    JobPruned,
    UnknownJob,
    WaitTimeout,
)

Row = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Query:
    """Run ``sql`` (a named statement of `queries`, never built from input) with ``params``; the
    answer is the one row (``rows="one"``: a missing row is an error), the row or None
    (``"optional"``), or every row (``"all"``)."""

    sql: LiteralString
    params: tuple[Any, ...] | dict[str, Any] = ()
    rows: Literal["one", "optional", "all"] = "one"


@dataclass(frozen=True)
class Pause:
    """Wait ``seconds``; with ``wake_on`` (a job id the plan listens for), end early when that job's
    completion is notified. The answer is True if a notification ended it."""

    seconds: float
    wake_on: int | None = None


@dataclass(frozen=True)
class Listen:
    """Be told when job ``job_id`` finishes: from here on, a `Pause` with ``wake_on=job_id`` ends at
    its notification. The runner returns only once the process's listening session is listening (or
    known to be down, in which case pauses run their full length: the backup poll)."""

    job_id: int


Step = Query | Pause | Listen
Plan = Generator[Step, Any, T]

UNKNOWN_JOB = "no job {job}; list jobs with: pglane jobs"
_EMPTY: Any = object()  # enqueue() was given no payload: the job's is {}


def payload_json(payload: Any) -> str:
    """Serialise a payload; InvalidPayload (nothing written) if it is not JSON."""
    try:
        return json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidPayload(f"payload is not JSON-serialisable ({exc}); send dicts, lists, strings, numbers") from None


DEFAULT_KEY_RETENTION = 30 * 86400.0  # seconds a pruned job's idempotency key is remembered (lanes.key_retention)


def create_lane(name: str, *, slots: int, job_timeout: float, lease_timeout: float | None, max_attempts: int,
                max_queued: int | None, waiting_grace: float, max_payload_bytes: int, retry_backoff: float,
                max_result_bytes: int, takeover: str, rate: str | None = None,
                key_retention: float = DEFAULT_KEY_RETENTION, group_slots: int | None = None,
                max_deferrals: int = 20, on_retry_later: str = "lane",
                pause_after_failures: int | None = None) -> Plan[int]:
    lease = timing.default_lease_timeout(job_timeout) if lease_timeout is None else lease_timeout
    for label, value in (("job_timeout", job_timeout), ("lease_timeout", lease)):
        if not math.isfinite(value):
            raise ConfigurationError(f"{label} must be a finite number of seconds")
    row = yield Query(queries.CREATE_LANE, (name, slots, job_timeout, lease, max_attempts, max_queued, waiting_grace,
                                            max_payload_bytes, retry_backoff, max_result_bytes, takeover,
                                            key_retention, group_slots, max_deferrals,
                                            on_retry_later.replace("-", "_"), pause_after_failures, rate))
    return int(row["id"])


def set_lane(name: str, settings: dict[str, Any]) -> Plan[str]:
    """Change lane ``name``'s settings (pglane.set_lane): what changed, and what it means for running workers."""
    row = yield Query(queries.SET_LANE, (name, json.dumps(settings)))
    return str(row["note"])


def pause_lane(name: str, *, for_seconds: float | None = None, until: datetime | None = None,
               reason: str | None = None) -> Plan[str]:
    """Pause lane ``name`` (pglane.pause_lane): for some seconds, until a moment, or (neither) until resumed."""
    if for_seconds is not None and until is not None:
        raise InvalidInput("give a pause's length (for) or its end (until), not both")
    if for_seconds is not None and (isinstance(for_seconds, bool) or not isinstance(for_seconds, int | float)
                                    or not math.isfinite(for_seconds) or for_seconds <= 0):
        raise InvalidInput(f"a pause of {for_seconds!r} seconds: give a length above zero, e.g. 600 or '10m' "
                           "on the command line")
    row = yield Query(queries.PAUSE_LANE, (name, until, for_seconds, reason))
    return str(row["note"])


def resume_lane(name: str) -> Plan[str]:
    """End lane ``name``'s pause now (pglane.resume_lane)."""
    row = yield Query(queries.RESUME_LANE, (name,))
    return str(row["note"])


def lanes() -> Plan[list[Row]]:
    return (yield Query(queries.LANES, {"name": None}, rows="all"))  # type: ignore[no-any-return]


def enqueue(lane: str, payload: Any, *, key: str | None, run_after: datetime | None,
            if_full: Literal["error", "skip"], cost: int = 1, group: str | None = None,
            priority: int = 0, job_timeout: float | None = None) -> Plan[int | None]:
    text = "{}" if payload is _EMPTY else payload_json(payload)
    if job_timeout is not None and (isinstance(job_timeout, bool) or not isinstance(job_timeout, int | float)
                                    or not math.isfinite(job_timeout) or job_timeout <= 0):
        raise InvalidInput(f"job_timeout={job_timeout!r}: a job's own timeout is a number of seconds above zero, "
                           "at most its lane's job_timeout; nothing was enqueued")
    with tracing.sending(lane) as send:  # the producer's span; its context is the job's traceparent
        row = yield Query(queries.ENQUEUE, (lane, text, key, run_after, if_full, cost, group, priority, job_timeout,
                                            send.traceparent))
        job = None if row["enqueue"] is None else int(row["enqueue"])
        send.sent(job)
    return job


def lane_status() -> Plan[list[Row]]:
    return (yield Query(queries.LANE_STATUS, rows="all"))  # type: ignore[no-any-return]


def job_status(job_id: int) -> Plan[Row]:
    row = yield Query(queries.JOB_STATUS, (job_id,), rows="optional")
    if row is None:
        raise UnknownJob(UNKNOWN_JOB.format(job=job_id))
    return row  # type: ignore[no-any-return]


def jobs(*, lane: str | None, status: str | None, limit: int | None, group: str | None = None) -> Plan[list[Row]]:
    params = {"lane": lane, "status": status, "limit": limit, "group": group}
    return (yield Query(queries.JOBS, params, rows="all"))  # type: ignore[no-any-return]


def group_status(lane: str, limit: int | None) -> Plan[list[Row]]:
    return (yield Query(queries.GROUP_STATUS, (lane, limit), rows="all"))  # type: ignore[no-any-return]


def attempts(job_id: int) -> Plan[list[Row]]:
    return (yield Query(queries.ATTEMPTS, (job_id,), rows="all"))  # type: ignore[no-any-return]


def result(job_id: int) -> Plan[Any]:
    row = yield Query(queries.JOB_RESULT, (job_id,), rows="optional")
    if row is None:
        raise UnknownJob(UNKNOWN_JOB.format(job=job_id))
    return row["result"]


def retry(job_id: int) -> Plan[bool]:
    return bool((yield Query(queries.RETRY, (job_id,)))["retry"])


def cancel(job_id: int) -> Plan[bool]:
    return bool((yield Query(queries.CANCEL, (job_id,)))["cancel"])


def recover(lane: str | None) -> Plan[int]:
    return int((yield Query(queries.RECOVER, (lane,)))["recover"])


def release_lease(attempt_id: int) -> Plan[bool]:
    return bool((yield Query(queries.RELEASE_LEASE, (attempt_id,)))["release_lease"])


def prune(older_than: float, *, lane: str | None, include_failed: bool, batch: int | None,
          progress: Callable[[int], object] | None, forget_keys: bool = False) -> Plan[int]:
    if batch is None:
        return int((yield Query(queries.PRUNE, (older_than, lane, include_failed, forget_keys)))["prune"])
    total, after = 0, 0
    while True:  # each step its own statement: on a pool, its own borrowed connection and transaction
        row = yield Query(queries.PRUNE_BATCH, (older_than, lane, include_failed, after, batch, forget_keys))
        if row["last_id"] is None:
            return total
        total, after = total + int(row["deleted"]), int(row["last_id"])
        if progress is not None:
            progress(total)


def prunable(older_than: float, *, lane: str | None, include_failed: bool) -> Plan[int]:
    row = yield Query(queries.PRUNABLE, {"age": older_than, "lane": lane, "failed": include_failed})
    return int(row["n"])


def stuck_attempts(lane: str | None) -> Plan[list[Row]]:
    return (yield Query(queries.STUCK, (lane,), rows="all"))  # type: ignore[no-any-return]


def terminate_stuck(lane: str | None, *, wait: float) -> Plan[int]:
    pids = {int(row["backend_pid"]) for row in (yield from stuck_attempts(lane))}
    for pid in pids:
        yield Query(queries.TERMINATE, (pid,))
    deadline = time.monotonic() + wait
    while pids and time.monotonic() < deadline:
        alive = yield Query(queries.LIVE_SESSIONS, (list(pids),))
        if alive["n"] == 0:
            break
        yield Pause(0.05)
    return len(pids)


# --- waiting for a job's result -------------------------------------------------------------------

FINISHED = ("done", "failed", "cancelled")
DEFAULT_POLL_INTERVAL = 5.0  # the backup poll: what a lost notification costs at most


def wait(job_id: int, *, timeout: float | None, poll_interval: float) -> Plan[Any]:
    """Wait until job ``job_id`` is finished and return its result; see `outcome` for the errors.

    Order matters: listen first, then mark the job awaited and read its state in one statement
    (pglane.await_job), so that a completion committed after the read is always notified, and one
    committed before it is seen by the read. Then each notification, or each ``poll_interval``
    without one (a lost notification, a listener down), reads the state again."""
    if timeout is not None and not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigurationError(f"timeout must be a finite number of seconds >= 0 (or None), not {timeout!r}")
    if not (poll_interval > 0 and math.isfinite(poll_interval)):
        raise ConfigurationError(f"poll_interval must be a positive number of seconds, not {poll_interval!r}")
    started = time.monotonic()
    yield Listen(job_id)
    while True:
        row = yield Query(queries.AWAIT_JOB, (job_id,), rows="optional")
        if row is None or row["status"] in (*FINISHED, "pruned"):
            return outcome(job_id, row)
        left = math.inf if timeout is None else started + timeout - time.monotonic()
        if left <= 0:
            raise WaitTimeout(job_id, row, time.monotonic() - started)
        yield Pause(min(poll_interval, left), wake_on=job_id)


def outcome(job_id: int, row: Row | None) -> Any:
    """The result of a finished job, or the error that says why there is none: JobFailed (with the
    last error, the attempt and the next safe action), JobCancelled, JobPruned, UnknownJob."""
    if row is None:
        raise UnknownJob(UNKNOWN_JOB.format(job=job_id))
    status = row["status"]
    if status == "done":
        return row["result"]
    if status == "failed":
        raise JobFailed(job_id, last_error=row["last_error"], attempt_id=row["attempt_id"],
                        attempt_number=row["attempts"], next_safe_action=row["next_safe_action"])
    if status == "cancelled":
        raise JobCancelled(job_id, next_safe_action=row["next_safe_action"])
    if status == "pruned":
        raise JobPruned(job_id, pruned_at=row["pruned_at"])
    raise AssertionError(f"job {job_id} is {status}, not finished")  # the caller checks FINISHED first
