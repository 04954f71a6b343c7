"""The job a handler receives, the claim a worker holds, and the states jobs and attempts move through.

Job states (pglane.jobs.status, CHECK job_status_valid):

    queued --claim--> running --complete--> done
       ^                 |--fail / timeout / lost, attempts left--> queued (after a backoff)
       |                 '--fail / timeout / lost, no attempts left--> failed
       '--retry (a person)-- failed, cancelled <--cancel (a person)-- queued

Attempt states (pglane.attempts.status, CHECK attempt_status_valid): running, then exactly one of
done, failed, timed_out, deferred (the handler raised RetryLater: nothing paid, the job queued again
for later), or lost (recovery found its session gone). A lost attempt may still turn done when its
late result arrives and no newer attempt exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

JOB_STATUSES = ("queued", "running", "done", "failed", "cancelled")


@dataclass(frozen=True)
class Job:
    """One claimed try at a job, as handed to a handler.

    ``attempt_id`` is unique per try: pass a key derived from it to a paid provider that honours
    idempotency keys, so that even an at-least-once lane never pays twice for one attempt.
    """

    id: int
    lane: str
    payload: Any
    attempt_id: int
    attempt_number: int
    seq: int
    idempotency_key: str | None


@dataclass(frozen=True, slots=True)
class Claim:
    """What a worker holds of a job it claimed: the ``job`` its handler gets, and what the handler
    never sees: the attempt's ``token`` (the proof complete() and fail() ask of any session but the
    claiming one) and, when the payload could not be decoded, ``undecodable``: why (the handler is
    then not called at all)."""

    job: Job
    token: str
    sent_at: float  # time.monotonic() when the claiming statement was sent: the call's deadlines count from it
    undecodable: str | None = None
    job_timeout: float | None = None  # the call's timeout the claim named (the job's own, at most the lane's)
    traceparent: str | None = None  # the producer's trace context (pglane.tracing), if it sent one
    queued_at: datetime | None = None  # when the job was enqueued (the database's clock)

    @classmethod
    def from_row(cls, row: dict[str, Any] | None, sent_at: float) -> Claim | None:
        """The claim in a row of pglane.claimed (payload and token as text); None when it holds no job.
        Decoding the payload here, not in the driver, is what lets a payload no decoder accepts (nested
        too deep, a number too long) fail its attempt instead of the worker."""
        if row is None or row["job_id"] is None:
            return None
        undecodable = None
        try:
            payload = json.loads(row["payload"])
        except (ValueError, RecursionError) as exc:
            payload, undecodable = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        job = Job(id=row["job_id"], lane=row["lane"], payload=payload, attempt_id=row["attempt_id"],
                  attempt_number=row["attempt_number"], seq=row["seq"], idempotency_key=row["idempotency_key"])
        return cls(job, row["token"], sent_at, undecodable, row.get("job_timeout"), row.get("traceparent"),
                   row.get("queued_at"))
