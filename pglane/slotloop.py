"""The slot loop: hold one slot of one lane, claim, call the handler, write the outcome; survive the rest.

A worker process runs one slot loop per slot it serves, each in a task of its own on the process's one
event loop (pglane.worker). Owns the sequence of one slot; the lane's settings, caller and recovery timer
belong to pglane.lane (shared by the process's slots of the lane), the call and its timeouts to
pglane.call, the slot session to pglane.slot, the outcome not yet stored to pglane.outbox, what the last
claim said about the next one to pglane.pacing, and when the process stops to pglane.lifetime. Its
states, and where each one leads:

    state            what happens                                              leads to
    connecting       a session is opened (after a backoff, see below); an      standby; holding
                     outcome still pending is written first
    standby          every slot is held: wait for one to free, listening: the  holding; stopping
                     lane's news, or each poll interval, reads its slots again
    holding, idle    on taking the slot (LISTENing already): recover, claim.   calling; stopping
                     With no job: recover if due, else wait for a NOTIFY, the
                     poll interval, the recovery timer or the claim's pacing
                     (a lease's end, the rate limit's turn); claim again
    calling          the handler runs on the claimed job (pglane.call)         writing; hung
    writing          the outcome goes through the guarded complete()/fail();   calling; idle; pending;
                     on the fast path (no stop, no recovery due) fused with    stopping
                     the next claim in one round trip (complete_and_claim)
    pending outcome  the session died before the outcome was written: it is    connecting
                     kept
    hung             the handler outlived the hard timeout: its attempt is     the process's exit 75
                     recorded timed_out, the process stops; the session (and
                     the slot) is kept until the process exits
    stopping         SIGTERM/SIGINT, --max-jobs, --max-lifetime, another        the slot loop ends
                     slot's hang, or the lane's deletion (a lane served by
                     --lanes-like, pglane.lane): the call in progress ends,
                     its outcome is written, the slot released

A database error or a lost session, in any state with a session, leads back to connecting: at once
after a session that got a job done, else after a backoff (tenacity: 0.1 s doubling up to 5 s, so a
repeated error is never spun on) that a stop request cuts short. Asked to stop, the slot loop makes one
more attempt, to deliver a pending outcome, and gives up if that fails too (the process then logs the
statement that stores it and exits 69).

Invariants:
- a claim commits before the handler runs, and runs on the slot session (the database refuses others);
- every outcome is written through the guarded pglane.complete()/fail(), so a late or zombie write can
  never overwrite a newer attempt; an outcome that could not be written (the connection died) stays
  in the outbox and is delivered first after reconnecting;
- a stop never cuts a call off: the slot loop finishes the current call, writes its outcome and
  releases the slot;
- the slot loop talks to its session only through SlotSession's methods, and never blocks the event
  loop longer than one statement's round trip (a connection is opened in a thread: a silent network
  would hold the loop up to connect_timeout): the other slots of the process run meanwhile;
- no claim is sent once the process is done (``Lifetime.done()`` is read, with no await between, before
  every claim), so --max-jobs bounds the claims of all the process's slots together;
- no NOTIFY is dropped unanswered: one is forgotten only after a claim that found a job (another claim
  follows before any wait); one read during an empty claim may announce a job committed after that
  claim's snapshot, so it ends the next wait at once. A lost one would cost a poll interval.
How it breaks: if the slot session dies during a call, another worker may take the slot and start
the next job while this call finishes; this call's result is then still accepted under the
late-result rule, and the one-slot promise resumes once this slot loop is a standby.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, LiteralString

import psycopg
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type, wait_exponential

from . import logs, queries, tracing
from .call import Hung
from .errors import DatabaseUnavailable, NoSlotHeld, SlotLost, UnknownLane, first_line, translate
from .handler import Outcome
from .job import Claim
from .lane import ServedLane
from .lifetime import Lifetime
from .outbox import Outbox, session_lost
from .pacing import Pacing
from .session import SlotSession

log = logging.getLogger("pglane.worker")

SESSION_ENDS = (psycopg.Error, NoSlotHeld, DatabaseUnavailable)  # what ends a session: back to connecting
READ_ONLY = "25006"  # read_only_sql_transaction: what a standby or a demoted primary answers a write
# Back-to-back jobs whose handler never suspends (an async handler with nothing to await) never give
# the event loop a turn, and a stop signal (or another slot) gets one only then: the drain yields at
# least this often.
LOOP_TURN = 0.05
# An idle slot on a shared session waits for a wake-up, its session's poll, its pacing or a stop, with no
# timer of its own (pglane.shared): this long at most, a backstop that costs 1,000 lanes a claim a second.
IDLE_AT_MOST = 1000.0

class SlotLoop:
    """One slot of one lane, held in turn by sessions; its own state is the last claim's pacing
    (pglane.pacing) and the outcome not yet stored (pglane.outbox). It gets its sessions from ``connect``
    and uses them through SlotSession's methods only; ``claim`` is the process's claim hook
    (``Worker._claim``), through which every claim_or_wait of this slot goes."""

    def __init__(self, lane: ServedLane, lifetime: Lifetime, name: str, *, poll_interval: float,
                 connect: Callable[[ServedLane], Awaitable[SlotSession]],
                 claim: Callable[[SlotLoop, SlotSession], Claim | None]) -> None:
        self.lane = lane
        self.lifetime = lifetime
        self.name = name  # the worker's name, recorded on attempts
        self.poll_interval = poll_interval
        self._connect = connect  # opens a session for a slot of the lane (the process's: Worker._connect)
        self._claim = claim
        self.outbox = Outbox(lane.metrics)
        self.jobs_run = 0  # calls this slot made to their end
        self._pacing = Pacing.first()

    async def run(self) -> None:
        """Sessions one after another until there is nothing left to do (module doc: connecting). Asked
        to stop, one more session is tried (to deliver an outcome still held); if it fails too, give up."""
        logs.LANE.set(self.lane.name)  # this task's log lines name the lane (pglane.logs)
        last_try = False

        def give_up(_: RetryCallState) -> bool:
            return last_try or not self._work_left()

        while self._work_left():
            reconnecting = AsyncRetrying(  # begun afresh after a session that got a job done
                retry=retry_if_exception_type(SESSION_ENDS), wait=wait_exponential(multiplier=0.1, max=5.0),
                stop=give_up, sleep=self.lifetime.nap, before_sleep=_log_retry)
            try:
                async for attempt in reconnecting:
                    with attempt:
                        if not self._work_left():
                            return  # stopped during a backoff, with no outcome to deliver
                        last_try = self.lifetime.stopping
                        await self._serve()
            except RetryError as exc:
                _log_session_end(exc.last_attempt.exception(), "not reconnecting: the worker is stopping")
                return

    def _work_left(self) -> bool:
        return not self._ended() or self.outbox.held is not None

    def _ended(self) -> bool:
        """No new job starts on this slot: the process is done, or the lane was deleted (its retirement)."""
        return self.lifetime.done() or self.lane.retired

    async def _serve(self) -> None:
        """One session, until done. A database error ends it: raised for a backoff, unless the session
        got a job done (then it returns, and the next session begins at once, its backoff afresh)."""
        jobs = self.jobs_run
        try:
            await self._session()
        except SESSION_ENDS as exc:
            if self.jobs_run == jobs:
                raise
            _log_session_end(exc, "reconnecting")

    async def _session(self) -> None:
        """Connect, deliver an outcome still held, LISTEN, take a slot (or wait as a standby), recover, drain."""
        lane = self.lane
        try:
            session = await self._open()
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(first_line(exc)) from None
        if session is None:
            return  # stopped while connecting, with no outcome to deliver
        held = False
        try:
            self.outbox.store(session)
            lane.reload(session)
            session.listen()  # before the standby's wait: the lane's news (more slots) must reach it
            if self._ended() or not await self._take_slot(session):
                return
            held = True
            if lane.metrics is not None:
                lane.metrics.slot_held.inc()
            lane.recover(session, taking=True)
            await self._drain(session)
        except Hung as hung:
            self.lifetime.recycle(str(hung), session)  # the session, and the slot, are held until the exit
        except UnknownLane:
            if not lane.by_pattern:
                raise
            lane.retire()  # a lane served by pattern was deleted: this slot ends (its release below)
        finally:
            if held and lane.metrics is not None:
                lane.metrics.slot_held.dec()
            if session not in self.lifetime.kept:
                session.release()

    async def _open(self) -> SlotSession | None:
        """The slot's next session (Worker._connect); None if a stop came first and the slot has no outcome to
        deliver: a silent network holds a connection attempt up to its connect_timeout, which must not hold
        up the process's exit (a hung call's lease runs meanwhile). The attempt is left to end in its thread,
        and what it opens is released then."""
        opening = asyncio.ensure_future(self._connect(self.lane))
        if self.outbox.held is not None:
            return await opening
        stop = asyncio.ensure_future(self.lifetime.stop_requested.wait())
        await asyncio.wait((opening, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if opening.done():
            return opening.result()
        opening.add_done_callback(_release_unused)
        return None

    async def _take_slot(self, session: SlotSession) -> bool:
        """Take a free slot, or wait as a standby until one frees (or the lane gets more slots: its news,
        or each poll interval, reads the lane again); False if asked to stop first."""
        lane = self.lane
        if not session.try_take():
            log.info("standby: all %s slot(s) of lane %s are held; waiting to take over", session.slots, lane.name)
            if not await session.wait_take(self._ended, lambda: lane.reload(session),
                                           self.poll_interval):
                return False
        log.info("holding slot %s of lane %s", session.slot, lane.name)
        return True

    # ----- holding the slot: run the job held, else wait and claim ---------------------------

    async def _drain(self, session: SlotSession) -> None:
        """Holding the slot, until done: run the job held, else wait and claim (module doc)."""
        claim = None if self._ended() else self._claim(self, session)  # done while this slot waited
        turn = time.monotonic() + LOOP_TURN
        while claim is not None or not self._ended():
            if session.news:  # pglane lane set changed the lane: its settings apply from here
                self.lane.reload(session)
            if claim is not None:
                claim = await self._run(session, claim)
                if time.monotonic() >= turn:  # SIGTERM's handler runs on a turn of the loop: give it one
                    await asyncio.sleep(0)
                    turn = time.monotonic() + LOOP_TURN
            else:
                claim = await self._wait_and_claim(session)

    async def _run(self, session: SlotSession, claim: Claim) -> Claim | None:
        """Calling, then writing (module doc): the claimed job's call, its outcome stored and, on the fast
        path, the next job claimed (returned). The job's log context and spans (pglane.logs, pglane.tracing)
        span both."""
        job = claim.job
        logs.JOB.set((job.id, job.attempt_id, tracing.trace_id(claim.traceparent)))
        spans = tracing.Attempt(job.lane, job.id, job.attempt_id, job.attempt_number, job.seq, claim.traceparent,
                                claim.queued_at, held=self.lane.admissions.explaining(job.id, claim.queued_at)
                                ) if tracing.active() else None
        try:
            outcome = await self._call(session, claim)
        except Hung:
            if spans is not None:
                spans.called("timed_out", "the handler outlived the hard timeout")
                spans.settled(True)
            raise
        if spans is not None:
            spans.called(outcome.name, outcome.error, outcome.retry_after)
        self.jobs_run += 1
        self.lifetime.jobs_run += 1
        try:
            return self._store_and_claim(session, claim, outcome)
        finally:
            if spans is not None:
                spans.settled(self.outbox.held is None)
            logs.JOB.set(None)

    def _call(self, session: SlotSession, claim: Claim) -> Coroutine[Any, Any, Outcome]:
        """Calling (pglane.call); a plain method handing on the call's coroutine, so it costs no second one."""
        return self.lane.caller.call(session, claim)

    async def _wait_and_claim(self, session: SlotSession) -> Claim | None:
        """Idle: recover the lane if due (when idle, and between jobs of a long busy spell), else wait for
        a wake-up, no sooner than the pacing allows; then claim. None once done."""
        if self.lane.recovery.due():
            self.lane.recover(session)
        else:
            await self._idle(session)
            if self._ended():
                return None
            if (gap := self._pacing.next_claim_at() - time.monotonic()) > 0:
                await self.lifetime.nap(gap)
                if self._ended():
                    return None
        claim = self._claim(self, session)
        if claim is not None:
            # Only now may the wake-up be forgotten: the loop claims again before it waits, so a NOTIFY
            # read with this claim is answered by that one. After an empty claim, one read with it may be
            # for a job committed after its snapshot: it stays, and ends the next wait.
            session.forget_wakes()
        return claim

    async def _idle(self, session: SlotSession) -> None:
        """Wait for a NOTIFY, the poll interval, the lane's next recovery, the pacing's bound, the end of
        life, or a stop."""
        now = time.monotonic()
        polled = session.session_polls  # the shared session polls and recovers for its slots (pglane.shared)
        bounds = (None if polled else self.poll_interval, None if polled else self.lane.recovery.due_in(now),
                  self._pacing.wait_bound(now), self.lifetime.ends_in(now))
        timeout = min((b for b in bounds if b is not None), default=IDLE_AT_MOST)
        if self.lifetime.stopping or self.lane.retired:
            return
        with self.lifetime.waits.interrupting(session), self.lane.waits.interrupting(session):
            if self._pacing.sleeps_through_jobs:
                await session.wait_for_news(timeout)
            else:
                await session.wait_for_wake(timeout)

    # ----- claim and store ------------------------------------------------------------------

    def claim(self, session: SlotSession) -> Claim | None:
        """Claim a job of the lane on the session (claim_or_wait); the process's claim hook ends here."""
        return self._claim_round_trip(session, queries.CLAIM_OR_WAIT, (self.lane.name, self.name))[0]

    def _claim_round_trip(self, session: SlotSession, query: LiteralString,
                          params: tuple[Any, ...]) -> tuple[Claim | None, dict[str, Any] | None]:
        """Run a statement that claims (claim_or_wait, or complete_and_claim): the claim its row holds,
        stamped with when the statement was sent (the call's deadlines count from then), and the row;
        the row's pacing kept, a job claimed counted. The one place that times a claim (the claim latency
        metric) and turns the database's refusal of a claim into SlotLost."""
        sent = time.monotonic()
        try:
            row = session.execute(query, params)
        except psycopg.Error as exc:
            if isinstance(known := translate(exc), NoSlotHeld):
                raise SlotLost(first_line(exc)) from None
            if isinstance(known, UnknownLane) and self.lane.by_pattern:
                raise known from None  # deleted while served by pattern: the slot ends (_session)
            raise
        now = time.monotonic()
        if self.lane.metrics is not None:
            self.lane.metrics.claim_latency.observe(now - sent)
        claim = Claim.from_row(row, sent)
        if claim is not None:
            self.lifetime.count_claim()
            if self.lane.metrics is not None and claim.queued_at is not None:
                self.lane.metrics.wait.observe(max(0.0, time.time() - claim.queued_at.timestamp()))
        self._pacing = Pacing.from_row(row, claim is not None, now)
        if tracing.active():  # held back: an event of the next jobs' wait spans
            self.lane.admissions.heard(self._pacing.reason, (row or {}).get("wait_seconds"),
                                       claim.job.id if claim is not None else None)
        return claim, row

    def _store_and_claim(self, session: SlotSession, claim: Claim, outcome: Outcome) -> Claim | None:
        """Store the outcome and claim the next job: one round trip for a result (the fast path). Only
        stored, nothing claimed, when the process is done, the lane's recovery is due (it runs first), or
        the lane's rate limit said this slot's next start must wait."""
        self.outbox.hold(claim, outcome)
        if self._ended() or self.lane.recovery.due() or self._pacing.holds_start(time.monotonic()):
            self.outbox.store(session)
            return None
        if outcome.result_json is None:
            self.outbox.store(session)
            return self._claim(self, session)
        try:
            claimed, row = self._claim_round_trip(
                session, queries.COMPLETE_AND_CLAIM,
                (claim.job.attempt_id, outcome.result_json, self.lane.name, self.name, claim.token))
        except psycopg.Error as exc:
            if session_lost(session, exc):
                raise
            self.outbox.store(session)  # alone: the database refused the result, or the claim
            return self._claim(self, session)
        assert row is not None
        self.outbox.stored(bool(row["completed"]))
        return claimed


def _release_unused(opening: asyncio.Future[SlotSession]) -> None:
    """A session opened after its slot loop stopped waiting for it: released at once (it holds no slot)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().release()


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    _log_session_end(exc, f"reconnecting in {state.upcoming_sleep:.1f}s")


def _log_session_end(exc: BaseException | None, then: str) -> None:
    """One line per session that ended (so one per backoff step: never a flood), saying why."""
    if isinstance(exc, psycopg.Error) and exc.sqlstate == READ_ONLY:
        log.warning("the server is read-only (a standby, or a primary being demoted: %s); %s; point the DSN at "
                    "the primary, e.g. host=a,b target_session_attrs=read-write", first_line(exc), then)
    elif isinstance(exc, DatabaseUnavailable):
        log.warning("cannot reach the database (%s); %s", first_line(exc), then)
    elif isinstance(exc, psycopg.OperationalError | NoSlotHeld):
        log.warning("lost the slot session (%s); %s", first_line(exc), then)
    else:
        log.error("database error (%s); %s", first_line(exc), then)
