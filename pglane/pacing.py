"""What a claim says about the next one: when this slot may ask again, and why.

The claim answers every time (pglane.claim_or_wait, docs/design.md#admission): a job, or none; and,
when a lane policy holds this slot back, ``wait_seconds`` and ``wait_reason`` — ``'lease'`` (a strict
lane waits for a lost attempt's lease), ``'rate'`` (the rate limit's turn of this slot) or ``'paused'``
(the lane is paused until then, or with no wait_seconds until a person resumes it). A worker
keeps the latest answer as one ``Pacing`` value and reads every decision from it; nothing else in the
worker remembers when it last claimed or what it was told.

Invariants:
- claims that find nothing are at most one per EMPTY_CLAIM_GAP, however many wake-ups come (any
  session may send a NOTIFY: a flood of them costs that many claims, no more);
- a rate limit's turn is not moved by a new job (only the lane's news, e.g. a higher rate, can): a slot
  told its rate turn sleeps through job wake-ups, and stores an outcome without claiming before it;
- nor is a pause's end: a paused slot sleeps through job wake-ups until the pause ends or the lane's
  news (a resume) comes, so a paused lane costs no claim per enqueue;
- a lease's end is only a bound: a new job may be claimable sooner on another policy's word, so job
  wake-ups still end that wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMPTY_CLAIM_GAP = 0.02  # at most 50 claims a second that find nothing, however many wake-ups come


@dataclass(frozen=True, slots=True)
class Pacing:
    answered_at: float  # time.monotonic() when the claim's answer arrived
    found_job: bool
    allowed_at: float | None = None  # this slot may start no job before (time.monotonic()), if told
    reason: str | None = None  # why: 'lease', 'rate', or None

    @classmethod
    def first(cls) -> Pacing:
        """Before any claim: nothing said, nothing held back."""
        return cls(answered_at=float("-inf"), found_job=True)

    @classmethod
    def from_row(cls, row: dict[str, Any] | None, found_job: bool, now: float) -> Pacing:
        """The pacing a claiming statement's row says (a row of pglane.claimed, or none)."""
        wait, reason = (row or {}).get("wait_seconds"), (row or {}).get("wait_reason")
        if wait is None:  # paused until resumed: no bound but the poll interval; else nothing said
            return cls(now, found_job, float("inf"), reason) if reason == "paused" else cls(now, found_job)
        return cls(now, found_job, now + wait, reason)

    def next_claim_at(self) -> float:
        """The earliest a claim after this one is worth sending, whatever wakes the slot."""
        return self.answered_at if self.found_job else self.answered_at + EMPTY_CLAIM_GAP

    def wait_bound(self, now: float) -> float | None:
        """How long an idle slot waits at most before asking again, on this answer's word (None: no bound)."""
        return None if self.allowed_at is None or self.allowed_at == float("inf") else max(0.0, self.allowed_at - now)

    @property
    def sleeps_through_jobs(self) -> bool:
        """A new job changes nothing before the rate limit's turn or a pause's end: only the lane's news
        ends the wait."""
        return self.reason in ("rate", "paused")

    def holds_start(self, now: float) -> bool:
        """The rate limit said this slot's next start must wait: an outcome is stored without a claim."""
        return self.sleeps_through_jobs and self.allowed_at is not None and now < self.allowed_at
