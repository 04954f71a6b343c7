"""The error tree: every failure a user can meet is a PglaneError that says what was wrong and
what to do next.

The SQL in ``sql/`` raises with pglane's own SQLSTATE codes (class ``PG``, see ``SQLSTATES``) and
with named CHECK constraints; ``translate()`` maps those codes and constraint names, never message
text, onto this tree. It is the only place where database errors become pglane errors.
"""

from __future__ import annotations

import psycopg


def first_line(exc: BaseException | None) -> str:
    """The first line of an exception's message (its type's name when it has none): for logs and the CLI."""
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


class PglaneError(Exception):
    """Root of every error pglane raises on purpose."""


class ConfigurationError(PglaneError):
    """Settings that cannot work together, or a missing setting (DSN, handler, timeouts)."""


class DatabaseUnavailable(PglaneError):
    """The database cannot be reached."""


class SchemaError(PglaneError):
    """The database is not migrated to the version this pglane expects."""


class EmbeddedServerError(PglaneError):
    """The embedded PostgreSQL could not be found, started or stopped."""


class InvalidInput(PglaneError):
    """A value was refused before anything was written: nothing changed."""


class UnknownLane(InvalidInput):
    pass


class InvalidPayload(InvalidInput):
    pass


class PayloadTooLarge(InvalidInput):
    pass


class InvalidIdempotencyKey(InvalidInput):
    pass


class InvalidLane(InvalidInput):
    """Lane settings out of range or contradictory (a CHECK refused them)."""


class LaneFull(PglaneError):
    """The lane holds ``max_queued`` queued jobs already; nothing was written."""


class IdempotencyConflict(PglaneError):
    """The same idempotency key was sent with a different payload; nothing was written."""


class NoSlotHeld(PglaneError):
    """claim() was called by a session that holds no slot lock of the lane."""


class UnknownJob(InvalidInput):
    pass


class InvalidTransition(PglaneError):
    """retry/cancel asked for a job whose status does not allow it; nothing changed."""


# pglane's own SQLSTATEs, raised by sql/*.sql with ERRCODE. Class "PG" is not used by PostgreSQL.
SQLSTATES: dict[str, type[PglaneError]] = {
    "PGL01": UnknownLane,
    "PGL02": InvalidPayload,
    "PGL03": PayloadTooLarge,
    "PGL04": LaneFull,
    "PGL05": IdempotencyConflict,
    "PGL06": NoSlotHeld,
    "PGL07": InvalidIdempotencyKey,
    "PGL08": InvalidTransition,
    "PGL09": UnknownJob,
    "PGL10": InvalidInput,
}

# Named CHECK constraints (alembic owns them) and what to tell the user when one refuses a value.
CONSTRAINT_HINTS: dict[str, str] = {
    "lane_lease_exceeds_job_timeout": (
        "lease_timeout must be longer than job_timeout, or a running job could be handed to a "
        "second worker; raise --lease-timeout or lower --job-timeout"
    ),
    "lane_name_valid": (
        "lane names are 1-48 characters: a lowercase letter, then lowercase letters, digits or '_'"
    ),
    "lane_slots_range": "slots must be between 1 and 1000",
    "lane_max_attempts_range": "max_attempts must be between 1 and 100",
    "lane_max_queued_range": "max_queued must be at least 1 (or unset for an unbounded lane)",
    "lane_job_timeout_range": "job_timeout must be between 1 second and 7 days",
    "lane_lease_timeout_range": "lease_timeout must be at most 8 days",
    "lane_waiting_grace_range": "waiting_grace must be between 0 and 1 hour",
    "lane_max_payload_range": "max_payload_bytes must be between 1 byte and 64 MiB",
    "lane_retry_backoff_range": "retry_backoff must be between 0 and 1 hour",
    "job_status_valid": "job status must be one of queued, running, done, failed, cancelled",
    "attempt_status_valid": "attempt status must be one of running, done, failed, lost, timed_out",
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
    if code in SQLSTATES:
        message = diag.message_primary or str(exc)
        if diag.message_hint:
            message = f"{message} ({diag.message_hint})"
        return SQLSTATES[code](message)
    if code == "23514":  # check_violation
        name = diag.constraint_name or ""
        hint = CONSTRAINT_HINTS.get(name)
        if hint is not None:
            return InvalidLane(f"refused by {name}: {hint}")
    if code == "23505" and (diag.constraint_name or "") == "lanes_name_key":
        return InvalidLane("a lane with that name exists already; pick another name")
    return None
