"""An outcome on its way to the database: held from the moment the call returns until the database
has answered its write.

Every outcome is written through the guarded pglane.complete()/fail() (docs/design.md#what-holds),
so a late or zombie write never overwrites a newer attempt. The ``Outbox`` is the one place an outcome
not yet stored lives: a write that fails because the session is gone leaves it held, the next session
stores it first, and a worker that stops with it still held logs ``Unstored.statement()``, the SQL a
person runs to store it (recovery marks the attempt lost meanwhile; the statement then stores it as a
late result).

Invariants:
- at most one outcome is held (a slot runs one call at a time), and it is held before its write is sent:
  there is no moment at which a written-but-unanswered outcome is known nowhere;
- a result the database refuses on a session that lives on (too large, not storable) is not retried as
  is: the attempt fails with the reason instead, so a refusal never loops;
- nothing here claims: a fused write and claim (complete_and_claim) is the worker's round trip, which
  reports back through ``stored``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

from . import queries
from .errors import first_line
from .handler import Outcome
from .job import Claim
from .metrics import LaneMetrics
from .session import SlotSession

log = logging.getLogger("pglane.worker")


@dataclass(frozen=True, slots=True)
class Unstored:
    claim: Claim
    outcome: Outcome

    def statement(self) -> str:
        """The statement an operator runs to store this outcome (it carries the attempt's token). Only
        ever logged, never executed by pglane; psycopg quotes the values as literals."""
        attempt, token, outcome = self.claim.job.attempt_id, self.claim.token, self.outcome
        if outcome.result_json is not None:
            statement = sql.SQL("SELECT pglane.complete({}, {}::jsonb, {}::uuid)").format(
                attempt, outcome.result_json, token)
        elif outcome.retry_after is not None:
            statement = sql.SQL("SELECT pglane.defer({}, make_interval(secs => {}), {}, {}::uuid)").format(
                attempt, outcome.retry_after, outcome.error or "", token)
        else:
            statement = sql.SQL("SELECT pglane.fail({}, {}, {}, {}::uuid)").format(
                attempt, outcome.error or "", outcome.timed_out, token)
        return statement.as_string()


class Outbox:
    def __init__(self, metrics: LaneMetrics | None = None) -> None:
        self.held: Unstored | None = None
        self._metrics = metrics

    def hold(self, claim: Claim, outcome: Outcome) -> Unstored:
        self.held = Unstored(claim, outcome)
        return self.held

    def store(self, session: SlotSession) -> None:
        """Write the held outcome alone (nothing if none). A session that dies meanwhile raises, and the
        outcome stays held."""
        if self.held is None:
            return
        claim, outcome = self.held.claim, self.held.outcome
        attempt, token = claim.job.attempt_id, claim.token
        if outcome.result_json is not None:
            try:
                row = session.execute(queries.COMPLETE, (attempt, outcome.result_json, token))
            except psycopg.Error as exc:
                if session_lost(session, exc):
                    raise
                outcome = Outcome(error=f"the result could not be stored: {first_line(exc)} (SQLSTATE "
                                        f"{exc.sqlstate}; the call itself completed)")
                self.hold(claim, outcome)
            else:
                self.stored(bool((row or {}).get("complete")))
                return
        if outcome.retry_after is not None:
            row = session.execute(queries.DEFER, (attempt, outcome.retry_after, outcome.error, token))
            self.stored(bool((row or {}).get("defer")))
            return
        row = session.execute(queries.FAIL, (attempt, outcome.error, outcome.timed_out, token))
        self.stored(bool((row or {}).get("fail")))

    def stored(self, accepted: bool) -> None:
        """The database answered the held outcome's write: counted, if the guard accepted it, as what was
        written (a result it could not store was written as a failure), and logged in one line a person
        reads (lane, job, attempt, outcome, seconds since the claim); a warning if the guard refused it."""
        assert self.held is not None
        claim, outcome = self.held.claim, self.held.outcome
        self.held = None
        job = claim.job
        if not accepted:
            log.warning("outcome of attempt %s of job %s refused: a newer attempt exists, or the job was "
                        "finished elsewhere or deleted (with its lane); nothing was overwritten",
                        job.attempt_id, job.id)
            return
        ok = outcome.result_json is not None
        deferred = outcome.retry_after is not None
        if self._metrics is not None:
            (self._metrics.done if ok else self._metrics.deferred if deferred else self._metrics.failed).inc()
        if deferred:
            log.info("lane %s job %s attempt %s (#%s) deferred for %gs, nothing paid: %s", job.lane, job.id,
                     job.attempt_id, job.attempt_number, outcome.retry_after, outcome.error or "no reason given")
        elif log.isEnabledFor(logging.INFO):
            log.info("lane %s job %s attempt %s (#%s) %s in %.3fs", job.lane, job.id, job.attempt_id,
                     job.attempt_number, outcome.name,
                     time.monotonic() - claim.sent_at)


def session_lost(session: SlotSession, exc: psycopg.Error) -> bool:
    """Whether an error means the session is gone (closed, a connection error, the server ending it),
    rather than the database refusing a statement on a session that lives on."""
    return session.closed or (exc.sqlstate or "08").startswith(("08", "57P"))
