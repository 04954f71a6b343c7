"""The error tree: every failure a user can meet is a PglaneError that says what was wrong and
what to do next.

The SQL in ``sql/`` raises with pglane's own SQLSTATE codes (class ``PG``, which PostgreSQL does not
use) and with named CHECK constraints. Each class declares the code it stands for as ``sqlstate``
(as psycopg's own error classes do); ``SQLSTATES`` is built from those declarations, never kept by
hand. ``translate()`` maps codes and constraint names, never message text, onto this tree: it is the
only place where database errors become pglane errors.
"""

from __future__ import annotations

from typing import ClassVar

import psycopg


def first_line(exc: BaseException | None) -> str:
    """The first line of an exception's message (its type's name when it has none): for logs and the CLI."""
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


# pglane's own SQLSTATEs, raised by sql/*.sql with ERRCODE: filled by the classes below as they are
# defined (PglaneError.__init_subclass__), one class per code.
SQLSTATES: dict[str, type[PglaneError]] = {}


class PglaneError(Exception):
    """Root of every error pglane raises on purpose."""

    # The SQLSTATE the SQL raises for this error, or None when it is not raised by the database. Each
    # class declares its own: a subclass that declares none has none (it never inherits its parent's).
    sqlstate: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("sqlstate")
        if code is None:
            cls.sqlstate = None
            return
        if code in SQLSTATES:
            raise TypeError(f"SQLSTATE {code} is claimed by {SQLSTATES[code].__name__} and {cls.__name__}")
        SQLSTATES[code] = cls


class ConfigurationError(PglaneError):
    """Settings that cannot work together, or a missing setting (DSN, handler, timeouts)."""


class DatabaseUnavailable(PglaneError):
    """The database cannot be reached."""


class SchemaError(PglaneError):
    """The database is not migrated to the version this pglane expects, or cannot be migrated."""


class InsufficientPrivilege(SchemaError):
    """The role running the migration may not do what it needs (it lacks CREATEROLE to create
    pglane's group roles): nothing was changed; migrate as a role that has it."""

    sqlstate = "PGL11"


class EmbeddedServerError(PglaneError):
    """The embedded PostgreSQL could not be found, started or stopped."""


class InvalidInput(PglaneError):
    """A value was refused before anything was written: nothing changed."""

    sqlstate = "PGL10"


class UnknownLane(InvalidInput):
    sqlstate = "PGL01"


class InvalidPayload(InvalidInput):
    sqlstate = "PGL02"


class PayloadTooLarge(InvalidInput):
    sqlstate = "PGL03"


class InvalidIdempotencyKey(InvalidInput):
    sqlstate = "PGL07"


class InvalidLane(InvalidInput):
    """Lane settings out of range or contradictory (a CHECK refused them)."""


class CostOverRate(InvalidInput):
    """A job's cost exceeds its lane's rate limit, so it could never start (or a rate was lowered below
    a queued job's cost): nothing was written."""

    sqlstate = "PGL13"


class UnknownJob(InvalidInput):
    sqlstate = "PGL09"


class LaneFull(PglaneError):
    """The lane holds ``max_queued`` queued jobs already; nothing was written. ``retry_after``: the
    seconds its workers lately took to make that much room (None when they started too little to
    tell, and for a retry refused on a full lane)."""

    sqlstate = "PGL04"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class IdempotencyConflict(PglaneError):
    """The same idempotency key was sent with a different payload; nothing was written."""

    sqlstate = "PGL05"


class NoSlotHeld(PglaneError):
    """claim() was called by a session that holds no slot lock of the lane."""

    sqlstate = "PGL06"


class SlotLost(NoSlotHeld):
    """A worker's slot session no longer holds its slot (the database refused its claim with PGL06):
    the worker reconnects and takes a slot again before it claims."""


class NotTheClaimer(PglaneError):
    """An outcome was sent for an attempt by a session that did not claim it and lacks its token:
    nothing was written."""

    sqlstate = "PGL12"


class PermissionDenied(PglaneError):
    """The connecting role lacks a privilege the statement needs (SQLSTATE 42501): nothing changed."""

    sqlstate = "42501"


class InvalidTransition(PglaneError):
    """retry/cancel asked for a job whose status does not allow it; nothing changed."""

    sqlstate = "PGL08"


# Named CHECK constraints (alembic owns them) and what to tell the user when one refuses a value.
CONSTRAINT_HINTS: dict[str, str] = {
    "lane_lease_exceeds_job_timeout": (
        "R1 job_timeout < lease_timeout: lease_timeout must be longer than job_timeout, or a running job "
        "could be handed to a second worker; raise --lease-timeout or lower --job-timeout"
    ),
    "lane_name_valid": (
        "lane names are 1-48 characters: a lowercase letter, then lowercase letters, digits, '_' or '-'"
    ),
    "lane_slots_range": "slots must be between 1 and 1000",
    "lane_max_attempts_range": "max_attempts must be between 1 and 100",
    "lane_max_queued_range": "max_queued must be at least 1 (or unset for an unbounded lane)",
    "lane_job_timeout_range": "job_timeout must be between 1 second and 7 days",
    "lane_lease_timeout_range": "lease_timeout must be at most 8 days",
    "lane_waiting_grace_range": "waiting_grace must be between 0 and 1 hour",
    "lane_max_payload_range": "max_payload_bytes must be between 1 byte and 64 MiB",
    "lane_retry_backoff_range": "retry_backoff must be between 0 and 1 hour",
    "lane_max_result_range": "max_result_bytes must be between 1 byte and 256 MiB",
    "lane_takeover_valid": "takeover must be immediate or after_lease",
    "lane_rate_valid": "a rate is 1 to 1,000,000 starts per period of 1 second to 1 day, e.g. 10/s or 60/min",
    "job_cost_positive": "a job's cost is a whole number of at least 1",
    "lane_group_slots_range": "--group-slots must be between 1 and 1000, or none for no limit per group",
    "job_group_1_to_255_characters": "a job's group is at most 255 characters; use a shorter tenant id",
    "job_status_valid": "job status must be one of queued, running, done, failed, cancelled",
    "lane_max_deferrals_range": "--max-deferrals must be between 0 and 10000",
    "lane_on_retry_later_valid": "--on-retry-later must be job or lane",
    "lane_pause_after_failures_range": "--pause-after-failures must be between 1 and 10000, or none for no breaker",
    "attempt_status_valid": "attempt status must be one of running, done, failed, lost, timed_out, deferred",
}


def translate(exc: psycopg.Error) -> PglaneError | None:
    """Map a database error to a PglaneError by SQLSTATE or constraint name; None if it is not ours."""
    diag = exc.diag
    code = diag.sqlstate or ""
    if isinstance(exc, psycopg.DataError) and not code:  # refused by the driver before sending
        return InvalidInput(f"{exc}; remove NUL characters from lane names, keys and payloads")
    if code in ("22P05", "22P02"):  # untranslatable character / invalid text representation
        return InvalidInput(f"{diag.message_primary or exc}: PostgreSQL cannot store this value as given"
                            " (e.g. a \\u0000 in JSON); fix the value and send it again")
    if code == PermissionDenied.sqlstate:
        return PermissionDenied(f"{diag.message_primary or exc}: the connecting role needs the pglane role for"
                                " this (pglane_producer to enqueue and read its jobs, pglane_worker to run a"
                                " worker, pglane_operator for status, retry, cancel, recover and prune);"
                                " an administrator grants it, e.g. GRANT pglane_operator TO your_login")
    if code in SQLSTATES:
        message = diag.message_primary or str(exc)
        if diag.message_hint:
            message = f"{message} ({diag.message_hint})"
        if code == LaneFull.sqlstate:  # the detail the SQL writes: retry_after_seconds=N, or empty
            after = (diag.message_detail or "").removeprefix("retry_after_seconds=")
            return LaneFull(message, float(after) if after.replace(".", "", 1).isdigit() else None)
        if code == JobPruned.sqlstate:  # the detail the SQL writes: job_id=N
            job = (diag.message_detail or "").removeprefix("job_id=")
            return JobPruned(int(job) if job.isascii() and job.isdigit() else None, message=message)
        return SQLSTATES[code](message)
    if code == "23514":  # check_violation
        name = diag.constraint_name or ""
        hint = CONSTRAINT_HINTS.get(name)
        if hint is not None:
            return InvalidLane(f"refused by {name}: {hint}")
    if code == "23505" and (diag.constraint_name or "") == "lanes_name_key":
        return InvalidLane("a lane with that name exists already; pick another name")
    return None


class PoolerDetected(ConfigurationError):
    """The worker's DSN leads through a transaction-mode pooler, which would hand its slot lock and its
    LISTEN to other clients between transactions (pglane.pooler): the worker refuses to start."""


# --- waiting for a job's result (pglane.wait) -------------------------------------------------------
class JobFailed(PglaneError):
    """The awaited job failed: ``last_error`` says why, ``attempt_id``/``attempt_number`` which try
    failed last, ``next_safe_action`` what to do (e.g. ``pglane retry J`` if paying again is fine)."""

    def __init__(self, job_id: int, *, last_error: str | None, attempt_id: int | None, attempt_number: int | None,
                 next_safe_action: str | None) -> None:
        self.job_id, self.last_error, self.next_safe_action = job_id, last_error, next_safe_action
        self.attempt_id, self.attempt_number = attempt_id, attempt_number
        super().__init__(f"job {job_id} failed (attempt {attempt_number}, id {attempt_id}): "
                         f"{first_line(Exception(last_error or 'no reason recorded'))}; next: {next_safe_action}")


class JobCancelled(PglaneError):
    """The awaited job was cancelled before it ran; ``next_safe_action`` says how to run it after all."""

    def __init__(self, job_id: int, *, next_safe_action: str | None) -> None:
        self.job_id, self.next_safe_action = job_id, next_safe_action
        super().__init__(f"job {job_id} was cancelled; next: {next_safe_action}")


class JobPruned(UnknownJob):
    """The job finished and was deleted by ``pglane prune`` since: its result is gone. Met by a wait for
    it, and by an enqueue that repeats its idempotency key within its lane's key retention (PGL14,
    nothing written: the request was served once and is not paid for again). An UnknownJob, with the
    reason; ``job_id`` is the pruned job's."""

    sqlstate = "PGL14"

    def __init__(self, job_id: int | None, *, pruned_at: object = None, message: str | None = None) -> None:
        self.job_id, self.pruned_at = job_id, pruned_at
        super().__init__(message or (
            f"job {job_id} finished and was pruned at {pruned_at}: its result is no longer stored"
            " (results stay readable until pglane prune deletes them); enqueue it again with a new key"
            " to run it again"))


class LockWaitTimeout(PglaneError):
    """A command waited its bounded time for a lock another session holds (pglane.lockwait): nothing was
    changed; the message names the blocking sessions and what to do."""


class WaitTimeout(PglaneError):
    """A wait ended before the job finished; the job goes on. ``status`` is where it is: queued at
    ``queue_position`` (``waiting_for_worker`` once past the lane's grace), or running since
    ``started_at``; ``next_safe_action`` is the job's."""

    def __init__(self, job_id: int, row: dict[str, object], waited: float) -> None:
        self.job_id, self.waited = job_id, waited
        self.status, self.queue_position = row.get("status"), row.get("queue_position")
        self.started_at, self.next_safe_action = row.get("started_at"), row.get("next_safe_action")
        if self.status == "queued":
            where = f"still queued at position {self.queue_position}"
        elif self.status == "running":
            where = f"still running since {self.started_at} (attempt {row.get('attempts')})"
        else:
            where = f"{self.status}"
        super().__init__(f"job {job_id} is {where} after a wait of {waited:.1f}s; it goes on without you: wait"
                         f" again, or read it with pglane show {job_id} (next: {self.next_safe_action})")
