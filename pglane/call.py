"""One call as the worker makes it: the handler run on a claimed job under the lane's job timeout and
the worker's hard timeout, with the slot session watched while it runs.

Owns the worker's side of the call; pglane.handler owns the handler itself (loading it, running it,
its ``Outcome``, ``settle()``). One ``Caller`` per lane the process serves (its timeouts), making the
calls of every slot of that lane side by side; one ``Watchdog`` per process. Invariants:
- no call outlives the hard timeout: at the job timeout the handler is asked to stop (``settle()``);
  one still running at the hard timeout (it ignored cancellation, or it is sync: a thread cannot be
  killed) gets its attempt recorded timed_out and ``Hung`` is raised: the process stops taking jobs,
  lets its other calls finish and ends with EXIT_HUNG, for its supervisor to restart it (pglane.worker).
  The event loop does that at the deadline; the ``Watchdog``, from its own thread and connection, ends
  the process at once for a handler that blocks the event loop itself (no other call can finish then);
- a call still running after QUICK_CALL has the slot session watched, so that a session that dies
  during it is noticed at once. The call goes on (it may have been paid for); when it ends, that
  session is released, so nothing more runs on it: the worker's write of the outcome fails and the
  outcome is kept pending for the next session. Shorter calls go unwatched: a watcher costs a task.
How it breaks: a handler that holds the GIL without releasing it (a C extension) stops the watchdog
as well; only the process manager's stop grace ends that process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

from . import queries
from .errors import first_line
from .handler import Outcome, Runner, outcome_of, settle
from .job import Claim, Job
from .metrics import LaneMetrics
from .session import SlotSession

log = logging.getLogger("pglane.worker")

EXIT_HUNG = 75  # EX_TEMPFAIL: a handler outlived the hard timeout; restart the process
QUICK_CALL = 0.05  # calls shorter than this run without a session watcher (saves a task per job)
RECORD_HUNG = 0.5  # at most this long to record a hung call timed_out before the process ends it


class Hung(Exception):
    """A handler outlived the hard timeout; its attempt is recorded timed_out (or, with its session gone,
    left for recovery to mark lost). The slot that made the call keeps its session until the process ends."""


class Watchdog(threading.Thread):
    """The last resort against a handler that blocks the event loop past the hard timeout: from its
    own thread and its own connection it records the attempt timed_out, then ends the process.

    One per process, watching the calls of every slot: arming costs the event loop one dict assignment
    per job (atomic under the GIL, as the thread's copy of the dict is): the thread is never signalled,
    it looks every TICK seconds, so a hung call is caught within GRACE + TICK after its hard deadline
    (the event loop itself acts at the deadline when it can)."""

    GRACE = 1.0
    TICK = 0.25

    def __init__(self, dsn: str) -> None:
        super().__init__(name="pglane-watchdog", daemon=True)
        self.dsn = dsn
        # Each call in progress, by attempt id: (the claim, monotonic hard deadline); changed by the loop only.
        self.armed: dict[int, tuple[Claim, float]] = {}

    def arm(self, claim: Claim, deadline: float) -> None:
        self.armed[claim.job.attempt_id] = (claim, deadline)

    def disarm(self, claim: Claim) -> None:
        self.armed.pop(claim.job.attempt_id, None)

    def run(self) -> None:
        while True:
            time.sleep(self.TICK)
            now = time.monotonic()
            for claim, deadline in self.armed.copy().values():
                if now > deadline + self.GRACE:
                    self._fire(claim)

    def _fire(self, claim: Claim) -> None:
        log.error("attempt %s: the handler blocked the worker past its hard timeout; recording it "
                  "timed_out and ending the process (exit %s)", claim.job.attempt_id, EXIT_HUNG)
        def record() -> None:
            with contextlib.suppress(Exception), psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as c:
                c.execute(queries.FAIL, (claim.job.attempt_id, "timed out: the handler blocked past the worker's "
                                         "hard timeout; the process was recycled", True, claim.token))

        recorder = threading.Thread(target=record, daemon=True)  # briefly: the call runs on until the exit
        recorder.start()
        recorder.join(RECORD_HUNG)
        os._exit(EXIT_HUNG)


class Caller:
    """Makes one lane's calls, one at a time per slot (its runner has a thread for each of the process's
    slots of the lane), under the lane's timeouts as last read; the process's watchdog watches them."""

    def __init__(self, runner: Runner, watchdog: Watchdog, job_timeout: float, hard_timeout: float,
                 max_result_bytes: int, metrics: LaneMetrics | None = None) -> None:
        self.runner = runner
        self.watchdog = watchdog
        self.job_timeout = job_timeout
        self.hard_timeout = hard_timeout
        self.max_result_bytes = max_result_bytes
        self.metrics = metrics

    async def call(self, session: SlotSession, claim: Claim) -> Outcome:
        """Run the handler on the claimed job; its outcome. A payload that could not be decoded fails
        without a call; a result over the lane's max_result_bytes fails without being sent. Raises
        ``Hung`` for a handler that outlives the hard timeout (its attempt recorded timed_out)."""
        job = claim.job
        if claim.undecodable is not None:
            return _logged(job, Outcome(error=f"payload cannot be decoded ({claim.undecodable}); the handler was "
                                              "not called, so nothing was paid"))
        # Both timeouts count from when the claim was sent, before the server started the lease: so the
        # call ends (or the process does, EXIT_HUNG) before the lease ends on the server, whatever the
        # network did meanwhile (R2: worker timeout < lease).
        started = claim.sent_at
        # The job's own timeout, if it has one, is never above the lane's (checked at enqueue; and a
        # lane's lowered since wins): the hard timeout and the lease stay the lane's (R1-R3).
        job_timeout = min(self.job_timeout, claim.job_timeout or self.job_timeout)
        self.watchdog.arm(claim, started + self.hard_timeout)
        future, cancel = self.runner.start(job)  # an async handler that never suspends is done already
        if future.done():
            outcome: Outcome | None = outcome_of(future)
        else:
            outcome = await self._call_slow(session, claim, future, cancel, started, job_timeout)
        self.watchdog.disarm(claim)
        if outcome is None:
            raise self._hung(session, claim)
        if self.metrics is not None:
            self.metrics.duration.observe(time.monotonic() - started)
        # JSON as json.dumps writes it is ASCII: its length in characters is its size in bytes.
        if outcome.result_json is not None and len(outcome.result_json) > self.max_result_bytes:
            outcome = Outcome(error=f"the handler's result of {len(outcome.result_json)} bytes exceeds the lane's "
                                    f"max_result_bytes of {self.max_result_bytes}; it was not stored (the call itself "
                                    "completed): store large outputs elsewhere and return a reference")
        return outcome if outcome.error is None or outcome.retry_after is not None else _logged(job, outcome)

    async def _call_slow(self, session: SlotSession, claim: Claim, future: asyncio.Future[Any],
                         cancel: Callable[[], object], started: float, job_timeout: float) -> Outcome | None:
        """A call that did not finish at once: past QUICK_CALL, watch the slot session until the job
        deadline, then settle the call under both timeouts (None: it outlived the hard one)."""
        job = claim.job
        lost = False
        done, _ = await asyncio.wait((future,), timeout=QUICK_CALL)
        if not done:
            watcher = asyncio.ensure_future(session.watch())
            await asyncio.wait((future, watcher), timeout=max(0.0, started + job_timeout - time.monotonic()),
                               return_when=asyncio.FIRST_COMPLETED)
            watcher.cancel()
            (ended,) = await asyncio.gather(watcher, return_exceptions=True)
            if isinstance(ended, psycopg.Error):
                lost = True
                log.error("the slot session died during attempt %s (%s): no new claim until a slot is taken "
                          "again; the call goes on and its result will be delivered", job.attempt_id,
                          first_line(ended))
        outcome = await settle(future, cancel, job_timeout, started + job_timeout, started + self.hard_timeout)
        self.watchdog.disarm(claim)  # the handler is done: what follows may block on the session, not on it
        if lost:
            session.release()  # nothing more runs on it: the outcome's write fails and is kept pending
        return outcome

    def _hung(self, session: SlotSession, claim: Claim) -> Hung:
        """The handler outlived the hard timeout: record its attempt timed_out (if the session is gone,
        recovery marks it lost instead); the process must end, the only way to stop a thread."""
        reason = (f"timed out: the handler ignored cancellation past the worker's hard timeout of "
                  f"{self.hard_timeout:g}s; the process was recycled")
        with contextlib.suppress(psycopg.Error):  # briefly: the call runs on until the process ends
            session.execute(queries.FAIL, (claim.job.attempt_id, reason, True, claim.token), within=RECORD_HUNG)
        log.error("attempt %s of job %s (lane %s): the handler ignored cancellation past the hard timeout; "
                  "recorded timed_out, recycling the process (exit %s)", claim.job.attempt_id, claim.job.id,
                  claim.job.lane, EXIT_HUNG)
        return Hung(f"lane {claim.job.lane}: the handler of attempt {claim.job.attempt_id} outlived the hard "
                    f"timeout of {self.hard_timeout:g}s")


def _logged(job: Job, outcome: Outcome) -> Outcome:
    """A failed outcome, logged in one line."""
    assert outcome.error is not None
    log.info("attempt %s of job %s %s: %s", job.attempt_id, job.id, "timed out" if outcome.timed_out else "failed",
             outcome.error.partition("\n")[0])
    return outcome
