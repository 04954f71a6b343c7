"""A handler's word that the provider refused the call and nothing was paid: ``raise RetryLater(...)``.

The attempt ends ``deferred`` (pglane.defer, sql/jobs.sql): the job is queued again to run ``after``
seconds later, the deferral does not count toward the lane's max_attempts, and on a lane whose
on_retry_later is ``lane`` (the default) the whole lane pauses until then
(docs/design.md#push-back-pauses-deferrals-and-the-breaker).

The database cannot see whether a provider charged: it takes the handler's word. Raise RetryLater
only when the provider said the call was refused (HTTP 429 or 503 before any work) — never after a
call that may have been paid; for that, pass the provider an idempotency key derived from
``job.attempt_id`` or ``job.idempotency_key`` so that a repeated call is not charged twice.
"""

from __future__ import annotations

import math

MAX_AFTER = 7 * 24 * 3600.0  # a week: longer, pause the lane (pglane lane pause LANE --for DURATION)


class RetryLater(Exception):
    """Raise from a handler (sync or async): the provider refused this call, nothing was paid; run the
    job again ``after`` seconds from now (0 to a week), saying ``reason`` (e.g. the provider's answer).
    """

    def __init__(self, after: float, reason: str = "") -> None:
        if isinstance(after, bool) or not isinstance(after, int | float) or not math.isfinite(after) \
                or not 0 <= after <= MAX_AFTER:
            raise ValueError(f"RetryLater(after={after!r}): after is a number of seconds from 0 to {MAX_AFTER:g} "
                             "(a week); for a longer wait pause the lane: pglane lane pause LANE --for DURATION")
        if not isinstance(reason, str):
            raise TypeError(f"RetryLater(reason={reason!r}): the reason is text, e.g. the provider's answer")
        self.after = float(after)
        self.reason = reason
        super().__init__(f"retry later, in {self.after:g}s" + (f": {reason}" if reason else ""))
