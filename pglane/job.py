"""The job a handler receives, and the states jobs and attempts move through.

Job states (pglane.jobs.status, CHECK job_status_valid):

    queued --claim--> running --complete--> done
       ^                 |--fail / timeout / lost, attempts left--> queued (after a backoff)
       |                 '--fail / timeout / lost, no attempts left--> failed
       '--retry (a person)-- failed, cancelled <--cancel (a person)-- queued

Attempt states (pglane.attempts.status, CHECK attempt_status_valid): running, then exactly one of
done, failed, timed_out, or lost (recovery found its session gone). A lost attempt may still turn
done when its late result arrives and no newer attempt exists.
"""

from __future__ import annotations

from dataclasses import dataclass
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
