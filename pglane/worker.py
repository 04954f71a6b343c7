"""The worker loop: hold a slot of one lane, claim, call the handler, write the outcome; survive the rest.

Owns the sequence of one worker process (docs/design.md); the call and its timeouts belong to pglane.call,
the slot session to pglane.slot, the outcome not yet stored to pglane.outbox, what the last claim said
about the next one to pglane.pacing, and when the process stops to pglane.lifetime. Its states, and
where each one leads:

    state            what happens                                              leads to
    connecting       a session is opened (after a backoff, see below); an      standby; holding
                     outcome still pending is written first
    standby          every slot is held: wait for one to free, listening: the  holding; stopping
                     lane's news, or each poll interval, reads its slots again
    holding, idle    on taking the slot (LISTENing already): recover, claim.   calling; stopping
                     With no job: recover if due, else wait for a NOTIFY, the
                     poll interval, the recovery timer or the claim's pacing
                     (a lease's end, the rate limit's turn); claim again
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
  never overwrite a newer attempt; an outcome that could not be written (the connection died) stays
  in the outbox and is delivered first after reconnecting;
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
from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type, wait_exponential

from . import queries, timing
from .call import Caller
from .errors import ConfigurationError, DatabaseUnavailable, NoSlotHeld, SlotLost, UnknownLane, first_line, translate
from .handler import Handler, Outcome, Runner
from .job import Claim
from .lifetime import Lifetime
from .metrics import Metrics
from .outbox import Outbox, session_lost
from .pacing import Pacing
from .slot import LIVENESS, LockSession

log = logging.getLogger("pglane.worker")

EXIT_OK = 0
EXIT_UNSTORED = 69  # EX_UNAVAILABLE: stopped while the database was unreachable, an outcome unwritten
SESSION_ENDS = (psycopg.Error, NoSlotHeld, DatabaseUnavailable)  # what ends a session: back to connecting
READ_ONLY = "25006"  # read_only_sql_transaction: what a standby or a demoted primary answers a write
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
    """One slot of one lane, held in turn by sessions; its state is four values: the lane's settings as
    last read (``_lane``), the last claim's pacing (pglane.pacing), the outcome not yet stored
    (pglane.outbox) and the process's lifetime (pglane.lifetime)."""

    _caller: Caller  # makes the calls; made by main() once the lane's timeouts are known
    _lane: Lane  # the lane's settings as last read (each session's start, and after its news)
    _outbox: Outbox  # the outcome not yet stored; made by main() with the metrics

    def __init__(self, dsn: str, lane: str, handler: Handler, options: WorkerOptions | None = None) -> None:
        self.dsn = dsn
        self.lane_name = lane
        self.options = options or WorkerOptions()
        self.name = self.options.name or f"{socket.gethostname()}:{os.getpid()}"
        self.runner = Runner(handler)
        o = self.options
        self.lifetime = Lifetime(o.max_jobs, o.max_lifetime, o.recover_interval)
        self._pacing = Pacing.first()
        self._metrics: Metrics | None = None

    @property
    def jobs_run(self) -> int:
        return self.lifetime.jobs_run

    # ----- life cycle -----------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        return asyncio.run(self.main())

    def stop(self, reason: str = "stop requested") -> None:
        self.lifetime.stop(reason)

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self.stop, f"{signal.Signals(sig).name} received")
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
        self._outbox = Outbox(self._metrics)
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
        if (unstored := self._outbox.held) is not None:
            job = unstored.claim.job
            log.error("stopped before the database took the outcome of attempt %s of job %s: it is not stored; "
                      "recovery will mark the attempt lost, and then this statement stores it as a late result: %s",
                      job.attempt_id, job.id, unstored.statement())
            return EXIT_UNSTORED
        return EXIT_OK

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
        """Sessions one after another until there is nothing left to do (module doc: connecting). Asked
        to stop, one more session is tried (to deliver an outcome still held); if it fails too, give up."""
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
                        await self._serve(lane)
            except RetryError as exc:
                _log_session_end(exc.last_attempt.exception(), "not reconnecting: the worker is stopping")
                return

    def _work_left(self) -> bool:
        return not self.lifetime.done() or self._outbox.held is not None

    async def _serve(self, lane: Lane) -> None:
        """One session, until done. A database error ends it: raised for a backoff, unless the session
        got a job done (then it returns, and the next session begins at once, its backoff afresh)."""
        jobs = self.jobs_run
        try:
            await self._session(lane)
        except SESSION_ENDS as exc:
            if self.jobs_run == jobs:
                raise
            _log_session_end(exc, "reconnecting")

    async def _session(self, lane: Lane) -> None:
        """Connect, deliver an outcome still held, LISTEN, take a slot (or wait as a standby), recover, drain."""
        try:
            session = LockSession.connect(self.dsn, lane.id, lane.slots, f"{lane.name} {self.name}",
                                          self.options.liveness)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(first_line(exc)) from None
        try:
            self._outbox.store(session)
            lane = self._lane = self._reload_lane(session, lane)
            session.listen()  # before the standby's wait: the lane's news (more slots) must reach it
            if self.lifetime.done() or not await self._take_slot(session, lane):
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
            if not await session.wait_take(self.lifetime.stop_requested, lambda: self._standby_reread(session),
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
        while claim is not None or not self.lifetime.done():
            if session.news:  # pglane lane set changed the lane: its settings apply from here
                self._lane = self._reload_lane(session, self._lane)
            if claim is not None:
                outcome = await self._call(session, claim)
                self.lifetime.jobs_run += 1
                claim = self._store_and_claim(session, claim, outcome)
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
        a wake-up, no sooner than the pacing allows; then claim. None once done."""
        if self.lifetime.recovery_due():
            self._recover(session)
        else:
            await self._idle(session)
            if self.lifetime.done():
                return None
            if (gap := self._pacing.next_claim_at() - time.monotonic()) > 0:
                await self.lifetime.nap(gap)
        claim = self._claim(session)
        if claim is not None:
            # Only now may the wake-up be forgotten: the loop claims again before it waits, so a NOTIFY
            # read with this claim is answered by that one. After an empty claim, one read with it may be
            # for a job committed after its snapshot: it stays, and ends the next wait.
            session.forget_wakes()
        return claim

    async def _idle(self, session: LockSession) -> None:
        """Wait for a NOTIFY, the poll interval, the next recovery, the pacing's bound, the end of life,
        or a stop."""
        now = time.monotonic()
        bounds = (self.options.poll_interval, self.lifetime.recover_in(now), self._pacing.wait_bound(now),
                  self.lifetime.ends_in(now))
        timeout = min(b for b in bounds if b is not None)
        if self.lifetime.stopping:
            return
        with self.lifetime.interrupting(session):
            if self._pacing.sleeps_through_jobs:
                await session.wait_for_news(timeout)
            else:
                await session.wait_for_wake(timeout)

    def _recover(self, session: LockSession) -> None:
        row = session.execute(queries.RECOVER, (self.lane_name,))
        if row and row["recover"]:
            log.warning("recovered %s attempt(s) of lane %s whose worker was gone (marked lost)",
                        row["recover"], self.lane_name)
        self.lifetime.recovered()

    # ----- claim and store ------------------------------------------------------------------

    def _claim(self, session: LockSession) -> Claim | None:
        return self._claim_round_trip(session, queries.CLAIM_OR_WAIT, (self.lane_name, self.name))[0]

    def _claim_round_trip(self, session: LockSession, query: LiteralString,
                          params: tuple[Any, ...]) -> tuple[Claim | None, dict[str, Any] | None]:
        """Run a statement that claims (claim_or_wait, or complete_and_claim): the claim its row holds,
        stamped with when the statement was sent (the call's deadlines count from then), and the row;
        the row's pacing kept. The one place that times a claim (the claim latency metric) and turns the
        database's refusal of a claim into SlotLost."""
        sent = time.monotonic()
        try:
            row = session.execute(query, params)
        except psycopg.Error as exc:
            if isinstance(translate(exc), NoSlotHeld):
                raise SlotLost(first_line(exc)) from None
            raise
        now = time.monotonic()
        if self._metrics is not None:
            self._metrics.claim_latency.observe(now - sent)
        claim = Claim.from_row(row, sent)
        self._pacing = Pacing.from_row(row, claim is not None, now)
        return claim, row

    def _store_and_claim(self, session: LockSession, claim: Claim, outcome: Outcome) -> Claim | None:
        """Store the outcome and claim the next job: one round trip for a result (the fast path). Only
        stored, nothing claimed, when the worker is done, a recovery is due (it runs first), or the
        lane's rate limit said this slot's next start must wait."""
        self._outbox.hold(claim, outcome)
        if self.lifetime.done() or self.lifetime.recovery_due() or self._pacing.holds_start(time.monotonic()):
            self._outbox.store(session)
            return None
        if outcome.result_json is None:
            self._outbox.store(session)
            return self._claim(session)
        try:
            claimed, row = self._claim_round_trip(
                session, queries.COMPLETE_AND_CLAIM,
                (claim.job.attempt_id, outcome.result_json, self.lane_name, self.name, claim.token))
        except psycopg.Error as exc:
            if session_lost(session, exc):
                raise
            self._outbox.store(session)  # alone: the database refused the result, or the claim
            return self._claim(session)
        assert row is not None
        self._outbox.stored(bool(row["completed"]))
        return claimed


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


