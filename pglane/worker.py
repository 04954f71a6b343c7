"""The worker loop: hold a slot of one lane, claim, call the handler, complete; survive the rest.

Owns the sequence of one worker process (DESIGN §3): take a free slot or wait as a standby, recover
the lane, LISTEN, drain the queue, and wait for a wake-up or the poll interval; the call and its
timeouts belong to pglane.call. Invariants:
- a claim commits before the handler runs, and runs on the slot session (the database refuses others);
- every outcome is written through the guarded pglane.complete()/fail(), so a late or zombie write can
  never overwrite a newer attempt; an outcome that could not be written (the connection died) is kept
  as ``_pending`` and delivered first after reconnecting;
- on SIGTERM/SIGINT, --max-jobs or --max-lifetime the worker finishes the current call, writes its
  outcome, releases the slot and exits 0: a stop never cuts a call off. If the database is unreachable
  then, it does not wait for it: it logs the statement that stores the outcome and exits 69;
- a handler still running at the hard timeout (it ignored cancellation, or it is sync) gets its
  attempt recorded timed_out and the process ends with EXIT_HUNG, because a thread cannot be killed
  (pglane.call); a slot session that dies during a call is released when the call ends, so the write
  of its outcome fails and the outcome is kept pending;
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
from typing import Any

import psycopg
from psycopg import sql
from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, wait_exponential

from . import queries, timing
from .call import EXIT_HUNG as EXIT_HUNG
from .call import QUICK_CALL as QUICK_CALL
from .call import Caller
from .call import Watchdog as Watchdog
from .errors import ConfigurationError, DatabaseUnavailable, SlotLost, UnknownLane, first_line
from .handler import Handler, Outcome, Runner
from .job import Job
from .metrics import Metrics
from .slot import LockSession

log = logging.getLogger("pglane.worker")

EXIT_OK = 0
EXIT_UNSTORED = 69  # EX_UNAVAILABLE: stopped while the database was unreachable, an outcome unwritten


@dataclass(frozen=True)
class WorkerOptions:
    poll_interval: float = 5.0
    max_jobs: int | None = None
    max_lifetime: float | None = None
    timeout: float | None = None  # the hard timeout; default: timing.default_worker_timeout
    recover_interval: float = 30.0
    name: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on 127.0.0.1:PORT


@dataclass(frozen=True)
class Lane:
    id: int
    name: str
    slots: int
    job_timeout: float
    lease_timeout: float


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
        self._pending: tuple[Job, Outcome] | None = None  # an outcome not yet written; see module doc
        self._started = 0.0
        self._next_recover = 0.0
        self._metrics: Metrics | None = None
        self._session: LockSession | None = None  # the session waiting idle, for stop() to interrupt

    # ----- life cycle -----------------------------------------------------------------------

    def run(self) -> int:
        """Run until stopped; returns the process exit code."""
        return asyncio.run(self.main())

    def stop(self, reason: str = "stop requested") -> None:
        if not self._stopping.is_set():
            log.info("%s: finishing the current job, then releasing the slot and exiting", reason)
            self._stopping.set()
            if self._session is not None:
                self._session.interrupt()

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self.stop, f"{signal.Signals(sig).name} received")
        self._started = loop.time()
        lane = self._load_lane()
        hard_timeout = self.options.timeout or timing.default_worker_timeout(lane.job_timeout, lane.lease_timeout)
        if broken := timing.Timeouts(job=lane.job_timeout, lease=lane.lease_timeout, worker=hard_timeout).violations():
            raise ConfigurationError(f"lane {lane.name}: " + "; ".join(broken))
        refresher = None
        if self.options.metrics_port is not None:
            self._metrics = Metrics(lane.name, self.options.metrics_port)
            refresher = asyncio.ensure_future(self._metrics.refresh_forever(self.dsn))
        self._caller = Caller(self.runner, self.dsn, lane.job_timeout, hard_timeout, self._metrics)
        log.info("worker %s for lane %s (%s slot(s), job timeout %gs, hard timeout %gs, lease %gs)",
                 self.name, lane.name, lane.slots, lane.job_timeout, hard_timeout, lane.lease_timeout)
        failures, jobs_then = 0, 0  # sessions ended by a database error with no job done in between
        try:
            while not self._done() or self._pending is not None:
                try:
                    await self._serve(lane)
                except (psycopg.OperationalError, SlotLost) as exc:
                    log.warning("lost the slot session (%s); reconnecting", first_line(exc))
                except RetryError:
                    break  # asked to stop while the database was unreachable
                except psycopg.Error as exc:  # the database refused something: back off, never spin
                    failures, jobs_then = (1 if self.jobs_run > jobs_then else failures + 1), self.jobs_run
                    delay = min(5.0, 0.1 * 2**failures)
                    log.error("database error (%s); reconnecting in %.1fs", first_line(exc), delay)
                    await asyncio.sleep(delay)
        finally:
            self.runner.shutdown()
            if refresher is not None:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
            if self._metrics is not None:
                self._metrics.close()
        log.info("worker %s stopped after %s job(s)", self.name, self.jobs_run)
        if self._pending is not None:
            job, outcome = self._pending
            log.error("stopped while the database was unreachable: the outcome of attempt %s of job %s is not "
                      "stored; recovery will mark the attempt lost, and then this statement stores it as a late "
                      "result: %s", job.attempt_id, job.id, unstored_sql(job, outcome))
            return EXIT_UNSTORED
        return EXIT_OK

    def _done(self) -> bool:
        return self._stopping.is_set() or self._recycle_due()

    def _recycle_due(self) -> bool:
        o = self.options
        if o.max_jobs is not None and self.jobs_run >= o.max_jobs:
            return True
        return o.max_lifetime is not None and asyncio.get_running_loop().time() - self._started >= o.max_lifetime

    def _load_lane(self) -> Lane:
        try:
            conn = psycopg.connect(self.dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to the database ({first_line(exc)}); check "
                                      "--dsn / PGLANE_DSN") from None
        with conn:
            row = conn.execute(queries.LANES, {"name": self.lane_name}).fetchone()
        if row is None:
            raise UnknownLane(f"unknown lane {self.lane_name!r}; create it with: pglane lane create {self.lane_name}")
        return Lane(*row[:5])

    # ----- one session: connect, slot, listen, recover, drain ---------------------------------

    async def _connect(self, lane: Lane) -> LockSession:
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.1, max=5.0),
            stop=lambda _state: self._stopping.is_set(),
            retry=retry_if_exception_type(psycopg.OperationalError),
            before_sleep=lambda rs: log.warning(
                "cannot reach the database (%s); retrying", first_line(rs.outcome.exception()) if rs.outcome else ""),
        ):
            with attempt:
                return LockSession.connect(self.dsn, lane.id, lane.slots, f"{lane.name} {self.name}")
        raise AssertionError("unreachable")

    async def _serve(self, lane: Lane) -> None:
        session = await self._connect(lane)
        try:
            if self._pending is not None:
                job, outcome = self._pending
                self._write(session, job, outcome)
                self._pending = None
            if self._done():
                return
            if not session.try_take():
                log.info("standby: all %s slot(s) of lane %s are held; waiting to take over", lane.slots, lane.name)
                if not await session.wait_take(self._stopping):
                    return
            log.info("holding slot %s of lane %s", session.slot, lane.name)
            if self._metrics is not None:
                self._metrics.slot_held.set(1)
            session.listen()
            self._recover(session)
            await self._drain(session)
        finally:
            if self._metrics is not None:
                self._metrics.slot_held.set(0)
            session.release()

    def _recover(self, session: LockSession) -> None:
        row = session.conn.execute(queries.RECOVER, (self.lane_name,)).fetchone()
        if row and row["recover"]:
            log.warning("recovered %s attempt(s) of lane %s whose worker was gone (marked lost)",
                        row["recover"], self.lane_name)
        self._next_recover = asyncio.get_running_loop().time() + self.options.recover_interval

    async def _drain(self, session: LockSession) -> None:
        loop = asyncio.get_running_loop()
        job = self._claim(session)
        while True:
            if job is not None:
                outcome = await self._call(session, job)
                self.jobs_run += 1
                if self._done():
                    self._write(session, job, outcome)
                    return
                if loop.time() < self._next_recover:
                    job = self._write_and_claim(session, job, outcome)  # the fast path
                    continue
                self._write(session, job, outcome)
            if self._done():
                return
            if loop.time() >= self._next_recover:  # when idle, and between jobs of a long busy spell
                self._recover(session)
                job = self._claim(session)
                if job is not None:
                    continue
            await self._idle(session)
            if self._done():
                return
            job = self._claim(session)
            if job is not None:
                # Only now may the wake-up be forgotten: the loop claims again before it waits, so a
                # NOTIFY read with it is answered by that claim. After an empty claim, one read with
                # it may be for a job committed after its snapshot: it stays, and ends the next wait.
                session.forget_wakes()

    async def _idle(self, session: LockSession) -> None:
        """Wait for a NOTIFY, the poll interval, the next recovery, the end of life, or a stop."""
        loop = asyncio.get_running_loop()
        timeout = min(self.options.poll_interval, max(0.0, self._next_recover - loop.time()))
        if self.options.max_lifetime is not None:
            timeout = min(timeout, max(0.0, self._started + self.options.max_lifetime - loop.time()))
        if not self._stopping.is_set():
            self._session = session
            try:
                await session.wait_for_wake(timeout)
            finally:
                self._session = None

    # ----- claim, call, write ---------------------------------------------------------------

    def _claim(self, session: LockSession) -> Job | None:
        started = time.perf_counter()
        try:
            cur = session.conn.execute(queries.CLAIM, (self.lane_name, self.name))
        except psycopg.Error as exc:
            if exc.sqlstate == "PGL06":
                raise SlotLost(first_line(exc)) from None
            raise
        row = cur.fetchone()
        if self._metrics is not None:
            self._metrics.claim_latency.observe(time.perf_counter() - started)
        return _job(row)

    def _call(self, session: LockSession, job: Job) -> Coroutine[Any, Any, Outcome]:
        """Calling (pglane.call); a plain method handing on the call's coroutine, so it costs no second one."""
        return self._caller.call(session, job)

    def _write(self, session: LockSession, job: Job, outcome: Outcome) -> None:
        """Write one outcome through the guarded functions; keeps it pending if the session dies."""
        self._pending = (job, outcome)
        if outcome.result_json is not None:
            try:
                row = session.conn.execute(queries.COMPLETE, (job.attempt_id, outcome.result_json)).fetchone()
                accepted = bool((row or {}).get("complete"))
            except psycopg.DataError as exc:
                outcome = Outcome(error=f"the result could not be stored: {first_line(exc)}")
                self._pending = (job, outcome)
            else:
                self._pending = None
                self._written(job, accepted, ok=True)
                return
        row = session.conn.execute(queries.FAIL, (job.attempt_id, outcome.error, outcome.timed_out)).fetchone()
        self._pending = None
        self._written(job, bool((row or {}).get("fail")), ok=False)

    def _write_and_claim(self, session: LockSession, job: Job, outcome: Outcome) -> Job | None:
        if outcome.result_json is None:
            self._write(session, job, outcome)
            return self._claim(session)
        self._pending = (job, outcome)
        started = time.perf_counter()
        try:
            cur = session.conn.execute(
                queries.COMPLETE_AND_CLAIM, (job.attempt_id, outcome.result_json, self.lane_name, self.name))
        except psycopg.DataError:
            self._write(session, job, outcome)  # re-tried alone, then failed with the reason
            return self._claim(session)
        except psycopg.Error as exc:
            if exc.sqlstate == "PGL06":
                raise SlotLost(first_line(exc)) from None
            raise
        self._pending = None
        row = cur.fetchone()
        if self._metrics is not None:
            self._metrics.claim_latency.observe(time.perf_counter() - started)
        assert row is not None
        self._written(job, bool(row["completed"]), ok=True)
        return _job(row)

    def _written(self, job: Job, accepted: bool, *, ok: bool) -> None:
        """An outcome reached the database: counted, if the guard accepted it, as what was written (a
        result the database could not store was written as a failure); logged if the guard refused it."""
        if self._metrics is not None and accepted:
            (self._metrics.done if ok else self._metrics.failed).inc()
        if not accepted:
            log.warning("outcome of attempt %s of job %s refused: a newer attempt exists or the job was "
                        "finished elsewhere; nothing was overwritten", job.attempt_id, job.id)


def unstored_sql(job: Job, outcome: Outcome) -> str:
    """The statement an operator runs to store an outcome the worker could not write. Only ever logged,
    never executed by pglane; psycopg quotes the values as SQL literals."""
    if outcome.result_json is not None:
        statement = sql.SQL("SELECT pglane.complete({}, {}::jsonb)").format(job.attempt_id, outcome.result_json)
    else:
        statement = sql.SQL("SELECT pglane.fail({}, {}, {})").format(job.attempt_id, outcome.error or "",
                                                                       outcome.timed_out)
    return statement.as_string()


def _job(row: dict[str, Any] | None) -> Job | None:
    if row is None or row["job_id"] is None:
        return None
    return Job(id=row["job_id"], lane=row["lane"], payload=row["payload"], attempt_id=row["attempt_id"],
               attempt_number=row["attempt_number"], seq=row["seq"], idempotency_key=row["idempotency_key"])

