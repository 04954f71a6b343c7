"""The worker loop: hold a slot of one lane, claim, call the handler, write the outcome; survive the rest.

Owns the sequence of one worker process (docs/design.md); the call and its timeouts belong to pglane.call,
the slot session to pglane.slot. Its states, and where each one leads:

    state            what happens                                              leads to
    connecting       a session is opened (after a backoff, see below); an      standby; holding
                     outcome still pending is written first
    standby          every slot is held: wait for one to free, listening: the  holding; stopping
                     lane's news, or each poll interval, reads its slots again
    holding, idle    on taking the slot (LISTENing already): recover, claim.   calling; stopping
                     With no job: recover if due, else wait for a NOTIFY, the
                     poll interval or the recovery timer; claim again
    calling          the handler runs on the claimed job (pglane.call)         writing; exit 75
    writing          the outcome goes through the guarded complete()/fail();   calling; idle; pending;
                     on the fast path (no stop, no recovery due) fused with    stopping
                     the next claim in one round trip (complete_and_claim)
    pending outcome  the session died before the outcome was written: it is    connecting
                     kept
    stopping         SIGTERM/SIGINT, --max-jobs, --max-lifetime: the call in   exit 0; exit 69 (the
                     progress ends, its outcome is written, the slot released  database unreachable,
                                                                               an outcome pending)

A database error or a lost session, in any state with a session, leads back to connecting: at once
after a session that got a job done, else after a backoff (tenacity: 0.1 s doubling up to 5 s, so a
repeated error is never spun on) that a stop request cuts short. Asked to stop, the worker makes one
more attempt, to deliver a pending outcome, and gives up if that fails too.

Invariants:
- a claim commits before the handler runs, and runs on the slot session (the database refuses others);
- every outcome is written through the guarded pglane.complete()/fail(), so a late or zombie write can
  never overwrite a newer attempt; an outcome that could not be written (the connection died) is kept
  as ``_pending`` and delivered first after reconnecting;
- a stop never cuts a call off: the worker finishes the current call, writes its outcome, releases the
  slot and exits 0. If the database is unreachable then, it does not wait for it: it logs the statement
  that stores the outcome and exits 69 (EXIT_UNSTORED);
- a handler still running at the hard timeout gets its attempt recorded timed_out and the process ends
  with 75 (EXIT_HUNG), because a thread cannot be killed (pglane.call);
- no NOTIFY is dropped unanswered: one is forgotten only after a claim that found a job (another claim
  follows before any wait); one read during an empty claim may announce a job committed after that
  claim's snapshot, so it ends the next wait at once. A lost one would cost a poll interval.
How it breaks: if the slot session dies during a call, another worker may take the slot and start
the next job while this call finishes; this call's result is then still accepted under the
late-result rule, and the one-slot promise resumes once this worker is a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from psycopg import sql
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type, wait_exponential

from . import queries, timing
from .call import EXIT_HUNG as EXIT_HUNG
from .call import QUICK_CALL as QUICK_CALL
from .call import Caller
from .call import Watchdog as Watchdog
from .errors import ConfigurationError, DatabaseUnavailable, NoSlotHeld, UnknownLane, first_line, translate
from .errors import SlotLost as SlotLost
from .handler import Handler, Outcome, Runner
from .job import Claim
from .metrics import Metrics
from .slot import LIVENESS, LockSession

log = logging.getLogger("pglane.worker")

EXIT_OK = 0
EXIT_UNSTORED = 69  # EX_UNAVAILABLE: stopped while the database was unreachable, an outcome unwritten
SESSION_ENDS = (psycopg.Error, NoSlotHeld, DatabaseUnavailable)  # what ends a session: back to connecting
READ_ONLY = "25006"  # read_only_sql_transaction: what a standby or a demoted primary answers a write
EMPTY_CLAIM_GAP = 0.02  # at most 50 claims a second that find nothing, however many wake-ups come
# Back-to-back jobs whose handler never suspends (an async handler with nothing to await) never give
# the event loop a turn, and a stop signal is dispatched only on one: the drain yields at least this often.
LOOP_TURN = 0.05


@dataclass(frozen=True)
class WorkerOptions:
    poll_interval: float = 5.0
    max_jobs: int | None = None
    max_lifetime: float | None = None
    timeout: float | None = None  # the hard timeout; default: timing.default_worker_timeout
    recover_interval: float = 30.0
    name: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on 127.0.0.1:PORT
    liveness: float = LIVENESS  # a lock session silent this long is taken for lost


@dataclass(frozen=True)
class Lane:
    id: int
    name: str
    slots: int
    job_timeout: float
    lease_timeout: float
    max_result_bytes: int
    takeover: str


class Worker:
    _caller: Caller  # makes the calls; made by main() once the lane's timeouts are known

    def __init__(self, dsn: str, lane: str, handler: Handler, options: WorkerOptions | None = None) -> None:
        self.dsn = dsn
        self.lane_name = lane
        self.options = options or WorkerOptions()
        self.name = self.options.name or f"{socket.gethostname()}:{os.getpid()}"
        self.runner = Runner(handler)
        self.jobs_run = 0
        self._stopping = asyncio.Event()
        self._pending: tuple[Claim, Outcome] | None = None  # an outcome not yet written; see module doc
        self._empty_claimed = 0.0  # when a claim last found nothing (time.monotonic())
        # After an empty claim that said when this slot may start a job (a strict lane's lease, or a rate
        # limit's opening): when, and whether it was the rate (then only a lane's news cuts the wait short).
        self._claim_allowed: float | None = None
        self._rate_limited = False
        self._sent = 0.0  # when the last claiming statement was sent (time.monotonic())
        self._started = 0.0  # time.monotonic(), as every timer of the worker
        self._next_recover = 0.0
        self._last_try = False  # the current session began after a stop request: if it fails, give up
        self._metrics: Metrics | None = None
        self._idle_session: LockSession | None = None  # the session waiting idle, for stop() to interrupt
        self._lane: Lane  # the lane's settings as last read (each session's start, and after its news)

    # ----- life cycle -----------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        return asyncio.run(self.main())

    def stop(self, reason: str = "stop requested") -> None:
        if not self._stopping.is_set():
            log.info("%s: finishing the current job, then releasing the slot and exiting", reason)
            self._stopping.set()
            if self._idle_session is not None:
                self._idle_session.interrupt()

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self.stop, f"{signal.Signals(sig).name} received")
        self._started = time.monotonic()
        lane = self._load_lane()
        from .pooler import refuse_transaction_pooler  # a direct or session-pooled DSN, before any slot

        refuse_transaction_pooler(self.dsn)
        hard_timeout = self.options.timeout or timing.default_worker_timeout(lane.job_timeout, lane.lease_timeout)
        if broken := timing.Timeouts(job=lane.job_timeout, lease=lane.lease_timeout, worker=hard_timeout).violations():
            raise ConfigurationError(f"lane {lane.name}: " + "; ".join(broken))
        refresher = None
        if self.options.metrics_port is not None:
            self._metrics = Metrics(lane.name, self.options.metrics_port)
            refresher = asyncio.ensure_future(self._metrics.refresh_forever(self.dsn))
        self._caller = Caller(self.runner, self.dsn, lane.job_timeout, hard_timeout, lane.max_result_bytes,
                              self._metrics)
        log.info("worker %s for lane %s (%s slot(s), job timeout %gs, hard timeout %gs, lease %gs)",
                 self.name, lane.name, lane.slots, lane.job_timeout, hard_timeout, lane.lease_timeout)
        try:
            await self._serve_until_stopped(lane)
        finally:
            self.runner.shutdown()
            if refresher is not None:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
            if self._metrics is not None:
                self._metrics.close()
        log.info("worker %s stopped after %s job(s)", self.name, self.jobs_run)
        if self._pending is not None:
            claim, outcome = self._pending
            log.error("stopped before the database took the outcome of attempt %s of job %s: it is not stored; "
                      "recovery will mark the attempt lost, and then this statement stores it as a late result: %s",
                      claim.job.attempt_id, claim.job.id, unstored_sql(claim, outcome))
            return EXIT_UNSTORED
        return EXIT_OK

    def _done(self) -> bool:
        return self._stopping.is_set() or self._recycle_due()

    def _recycle_due(self) -> bool:
        o = self.options
        if o.max_jobs is not None and self.jobs_run >= o.max_jobs:
            return True
        return o.max_lifetime is not None and time.monotonic() - self._started >= o.max_lifetime

    def _load_lane(self) -> Lane:
        try:
            conn = psycopg.connect(self.dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to the database ({first_line(exc)}); check "
                                      "--dsn / PGLANE_DSN") from None
        with conn:
            row = conn.execute(queries.LANES, {"name": self.lane_name}).fetchone()
        return self._lane_from(row)

    def _lane_from(self, row: Any) -> Lane:
        if row is None:
            raise UnknownLane(f"unknown lane {self.lane_name!r}; create it with: pglane lane create {self.lane_name}")
        if isinstance(row, dict):
            row = tuple(row.values())
        lane_id, name, slots, job_timeout, lease_timeout, _, _, max_result_bytes, takeover = row
        return Lane(lane_id, name, slots, job_timeout, lease_timeout, max_result_bytes, takeover)

    def _reload_lane(self, session: LockSession, lane: Lane) -> Lane:
        """The lane's settings as they are now (pglane lane set changes them while workers run): read at
        each session's start and after the lane's news, before the next claim. Slots apply to this
        session's next claim (one above the lane's slots is refused, and the worker takes a slot again),
        the timeouts to the next call."""
        session.news = False
        new = self._lane_from(session.execute(queries.LANES, {"name": self.lane_name}))
        if new != lane:
            hard = self.options.timeout or timing.default_worker_timeout(new.job_timeout, new.lease_timeout)
            broken = timing.Timeouts(job=new.job_timeout, lease=new.lease_timeout, worker=hard).violations()
            for problem in broken:
                log.error("lane %s's new settings break a timing rule: %s", new.name, problem)
            self._caller.job_timeout, self._caller.hard_timeout = new.job_timeout, hard
            self._caller.max_result_bytes = new.max_result_bytes
            session.slots = new.slots
            log.info("lane %s settings now: %s slot(s), job timeout %gs, hard timeout %gs, lease %gs",
                     new.name, new.slots, new.job_timeout, hard, new.lease_timeout)
        return new

    # ----- sessions, one after another: connecting, with the backoff -------------------------

    async def _serve_until_stopped(self, lane: Lane) -> None:
        """Sessions one after another until there is nothing left to do (module doc: connecting)."""
        while self._work_left():
            reconnecting = AsyncRetrying(  # begun afresh after a session that got a job done
                retry=retry_if_exception_type(SESSION_ENDS), wait=wait_exponential(multiplier=0.1, max=5.0),
                stop=self._give_up, sleep=self._nap, before_sleep=_log_retry)
            try:
                async for attempt in reconnecting:
                    with attempt:
                        await self._serve(lane)
            except RetryError as exc:
                _log_session_end(exc.last_attempt.exception(), "not reconnecting: the worker is stopping")
                return

    def _work_left(self) -> bool:
        return not self._done() or self._pending is not None

    def _give_up(self, _: RetryCallState) -> bool:
        """After a failed session: it was the last try after a stop, or nothing is left to do."""
        return self._last_try or not self._work_left()

    async def _nap(self, seconds: float) -> None:
        """The backoff's sleep: a stop request ends it at once."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _serve(self, lane: Lane) -> None:
        """One session, until done. A database error ends it: raised for a backoff, unless the session
        got a job done (then it returns, and the next session begins at once, its backoff afresh)."""
        if not self._work_left():
            return  # stopped during a backoff, with no outcome to deliver
        self._last_try = self._stopping.is_set()
        jobs = self.jobs_run
        try:
            await self._session(lane)
        except SESSION_ENDS as exc:
            if self.jobs_run == jobs:
                raise
            _log_session_end(exc, "reconnecting")

    async def _session(self, lane: Lane) -> None:
        """Connect, deliver a pending outcome, LISTEN, take a slot (or wait as a standby), recover, drain."""
        try:
            session = LockSession.connect(self.dsn, lane.id, lane.slots, f"{lane.name} {self.name}",
                                          self.options.liveness)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(first_line(exc)) from None
        try:
            if self._pending is not None:
                self._write(session, *self._pending)
            lane = self._lane = self._reload_lane(session, lane)
            session.listen()  # before the standby's wait: the lane's news (more slots) must reach it
            if self._done() or not await self._take_slot(session, lane):
                return
            if self._metrics is not None:
                self._metrics.slot_held.set(1)
            self._recover(session)
            await self._drain(session)
        finally:
            if self._metrics is not None:
                self._metrics.slot_held.set(0)
            session.release()

    async def _take_slot(self, session: LockSession, lane: Lane) -> bool:
        """Take a free slot, or wait as a standby until one frees (or the lane gets more slots: its news,
        or each poll interval, reads the lane again); False if asked to stop first."""
        if not session.try_take():
            log.info("standby: all %s slot(s) of lane %s are held; waiting to take over", lane.slots, lane.name)
            if not await session.wait_take(self._stopping, lambda: self._standby_reread(session),
                                           self.options.poll_interval):
                return False
        log.info("holding slot %s of lane %s", session.slot, lane.name)
        return True

    def _standby_reread(self, session: LockSession) -> None:
        self._lane = self._reload_lane(session, self._lane)

    # ----- holding the slot: run the job held, else wait and claim ---------------------------

    async def _drain(self, session: LockSession) -> None:
        """Holding the slot, until done: run the job held, else wait and claim (module doc)."""
        claim = self._claim(session)
        turn = time.monotonic() + LOOP_TURN
        while claim is not None or not self._done():
            if session.news:  # pglane lane set changed the lane: its settings apply from here
                self._lane = self._reload_lane(session, self._lane)
            if claim is not None:
                outcome = await self._call(session, claim)
                self.jobs_run += 1
                claim = self._write_and_claim(session, claim, outcome)
                if time.monotonic() >= turn:  # SIGTERM's handler runs on a turn of the loop: give it one
                    await asyncio.sleep(0)
                    turn = time.monotonic() + LOOP_TURN
            else:
                claim = await self._wait_and_claim(session)

    def _call(self, session: LockSession, claim: Claim) -> Coroutine[Any, Any, Outcome]:
        """Calling (pglane.call); a plain method handing on the call's coroutine, so it costs no second one."""
        return self._caller.call(session, claim)

    async def _wait_and_claim(self, session: LockSession) -> Claim | None:
        """Idle: recover the lane if due (when idle, and between jobs of a long busy spell), else wait for
        a wake-up; then claim. None once done. Claims that find nothing are at most one per
        EMPTY_CLAIM_GAP: a flood of NOTIFYs (any session may send them) costs that many claims, no more."""
        if self._recovery_due():
            self._recover(session)
        else:
            await self._idle(session)
            if self._done():
                return None
            if (gap := self._empty_claimed + EMPTY_CLAIM_GAP - time.monotonic()) > 0:
                await self._nap(gap)
        claim = self._claim(session)
        if claim is not None:
            # Only now may the wake-up be forgotten: the loop claims again before it waits, so a NOTIFY
            # read with this claim is answered by that one. After an empty claim, one read with it may be
            # for a job committed after its snapshot: it stays, and ends the next wait.
            session.forget_wakes()
        return claim

    async def _idle(self, session: LockSession) -> None:
        """Wait for a NOTIFY, the poll interval, the next recovery, the end of life, or a stop."""
        now = time.monotonic()
        timeout = min(self.options.poll_interval, max(0.0, self._next_recover - now))
        if self._claim_allowed is not None:  # the last claim said when this slot may start a job
            timeout = min(timeout, max(0.0, self._claim_allowed - now))
        if self.options.max_lifetime is not None:
            timeout = min(timeout, max(0.0, self._started + self.options.max_lifetime - now))
        if not self._stopping.is_set():
            self._idle_session = session
            try:
                if self._rate_limited:  # a new job changes nothing before the opening: sleep through
                    await session.wait_for_news(timeout)
                else:
                    await session.wait_for_wake(timeout)
            finally:
                self._idle_session = None

    def _recovery_due(self) -> bool:
        return time.monotonic() >= self._next_recover

    def _recover(self, session: LockSession) -> None:
        row = session.execute(queries.RECOVER, (self.lane_name,))
        if row and row["recover"]:
            log.warning("recovered %s attempt(s) of lane %s whose worker was gone (marked lost)",
                        row["recover"], self.lane_name)
        self._next_recover = time.monotonic() + self.options.recover_interval

    # ----- claim and write ------------------------------------------------------------------

    def _claim(self, session: LockSession) -> Claim | None:
        return self._taken(self._claim_round_trip(session, queries.CLAIM_OR_WAIT, (self.lane_name, self.name)))

    def _taken(self, row: dict[str, Any] | None) -> Claim | None:
        """The claim a claiming statement's row holds, stamped with when that statement was sent (the
        call's deadlines count from then). None for an empty claim, whose time is kept. Either way,
        when this slot may start its next job, if the row says (wait_seconds: a strict lane's lease, or
        a rate limit's opening for this slot: wait_reason 'rate')."""
        claim = Claim.from_row(row, self._sent)
        now = time.monotonic()
        if claim is None:
            self._empty_claimed = now
        wait = (row or {}).get("wait_seconds")
        self._claim_allowed = None if wait is None else now + wait
        self._rate_limited = wait is not None and (row or {}).get("wait_reason") == "rate"
        return claim

    def _rate_turn_ahead(self) -> bool:
        """The lane's rate limit said this slot's next start must wait: store the outcome alone."""
        return self._rate_limited and self._claim_allowed is not None and time.monotonic() < self._claim_allowed

    def _claim_round_trip(self, session: LockSession, query: LiteralString,
                          params: tuple[Any, ...]) -> dict[str, Any] | None:
        """Run a statement that claims (claim, or complete_and_claim); its row. The one place that times
        a claim (the claim latency metric) and turns the database's refusal of a claim into SlotLost."""
        started = self._sent = time.monotonic()
        try:
            row = session.execute(query, params)
        except psycopg.Error as exc:
            if isinstance(translate(exc), NoSlotHeld):
                raise SlotLost(first_line(exc)) from None
            raise
        if self._metrics is not None:
            self._metrics.claim_latency.observe(time.monotonic() - started)
        return row

    def _write_and_claim(self, session: LockSession, claim: Claim, outcome: Outcome) -> Claim | None:
        """Write the outcome and claim the next job: one round trip for a result (the fast path). Only
        written, nothing claimed, when the worker is done, a recovery is due (it runs first), or the
        lane's rate limit said this slot's next start must wait."""
        if self._done() or self._recovery_due() or self._rate_turn_ahead():
            self._write(session, claim, outcome)
            return None
        if outcome.result_json is None:
            self._write(session, claim, outcome)
            return self._claim(session)
        self._pending = (claim, outcome)
        try:
            row = self._claim_round_trip(session, queries.COMPLETE_AND_CLAIM,
                                         (claim.job.attempt_id, outcome.result_json, self.lane_name, self.name,
                                          claim.token))
        except psycopg.Error as exc:
            if _session_lost(session, exc):
                raise
            self._write(session, claim, outcome)  # alone: the database refused the result, or the claim
            return self._claim(session)
        self._pending = None
        assert row is not None
        self._written(claim, bool(row["completed"]), ok=True)
        return self._taken(row)

    def _write(self, session: LockSession, claim: Claim, outcome: Outcome) -> None:
        """Write one outcome through the guarded functions. A result the database refuses (too large,
        not storable, anything but a lost session) fails the attempt with the reason instead; an outcome
        that could not be written because the session is gone stays pending for the next session."""
        self._pending = (claim, outcome)
        attempt, token = claim.job.attempt_id, claim.token
        if outcome.result_json is not None:
            try:
                row = session.execute(queries.COMPLETE, (attempt, outcome.result_json, token))
            except psycopg.Error as exc:
                if _session_lost(session, exc):
                    raise
                outcome = Outcome(error=f"the result could not be stored: {first_line(exc)} (SQLSTATE "
                                        f"{exc.sqlstate}; the call itself completed)")
                self._pending = (claim, outcome)
            else:
                self._pending = None
                self._written(claim, bool((row or {}).get("complete")), ok=True)
                return
        row = session.execute(queries.FAIL, (attempt, outcome.error, outcome.timed_out, token))
        self._pending = None
        self._written(claim, bool((row or {}).get("fail")), ok=False, timed_out=outcome.timed_out)

    def _written(self, claim: Claim, accepted: bool, *, ok: bool, timed_out: bool = False) -> None:
        """An outcome reached the database: counted, if the guard accepted it, as what was written (a
        result the database could not store was written as a failure), and logged in one line a person
        reads (lane, job, attempt, outcome, seconds since the claim); a warning if the guard refused it."""
        job = claim.job
        if not accepted:
            log.warning("outcome of attempt %s of job %s refused: a newer attempt exists or the job was "
                        "finished elsewhere; nothing was overwritten", job.attempt_id, job.id)
            return
        if self._metrics is not None:
            (self._metrics.done if ok else self._metrics.failed).inc()
        if log.isEnabledFor(logging.INFO):
            log.info("lane %s job %s attempt %s (#%s) %s in %.3fs", job.lane, job.id, job.attempt_id,
                     job.attempt_number, "done" if ok else "timed_out" if timed_out else "failed",
                     time.monotonic() - claim.sent_at)


def unstored_sql(claim: Claim, outcome: Outcome) -> str:
    """The statement an operator runs to store an outcome the worker could not write (it carries the
    attempt's token). Only ever logged, never executed by pglane; psycopg quotes the values as literals."""
    attempt, token = claim.job.attempt_id, claim.token
    if outcome.result_json is not None:
        statement = sql.SQL("SELECT pglane.complete({}, {}::jsonb, {}::uuid)").format(attempt, outcome.result_json,
                                                                                     token)
    else:
        statement = sql.SQL("SELECT pglane.fail({}, {}, {}, {}::uuid)").format(attempt, outcome.error or "",
                                                                             outcome.timed_out, token)
    return statement.as_string()


def _session_lost(session: LockSession, exc: psycopg.Error) -> bool:
    """Whether an error means the session is gone (closed, a connection error, the server ending it),
    rather than the database refusing a statement on a session that lives on."""
    return session.conn.closed or (exc.sqlstate or "08").startswith(("08", "57P"))


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


