"""The worker process: serve one or many lanes, up to N slots of each, in one event loop.

``pglane worker a=2 b --handler M:C`` (or ``pglane.Worker(dsn, lanes={"a": 2, "b": 1}, handler=...)``)
runs one slot loop (pglane.slotloop) per slot: two of lane a, one of b, each in a task of its own,
each on its own lock session, or, with more slots than ``--sessions K`` (or ``--lanes-like``), all of them on K
shared sessions (pglane.shared; docs/design.md, "Shared sessions"). Owns what belongs to the
process, not to a slot or a lane: the signal handlers, the one metrics server, the pooler refusal (once),
the lifetime (--max-jobs and --max-lifetime counted over the process, the stop request every slot
shares), the watchdog, and the exit status. What belongs to a lane (its settings and their reload, its
caller with its timeouts, its recovery timer) is pglane.lane's, shared by the process's slots of it.

``--lanes-like PATTERN`` (``Worker(dsn, lanes_like="tenant_%", slots_each=N, handler=h)``) also serves
every lane whose name matches the SQL LIKE pattern, N slots of each, the lanes created later included:
one task of the process (``_watch``) LISTENs on pglane_lanes, which a lane's creation and deletion
notify (sql/lanes.sql), and reads the matching lanes again, in one query, on each notification and each
poll interval (a notification may be lost, or forged: it only ever causes that read). A lane new to the
read gets its slot loops; one gone from it (deleted, or made again under another id) is retired: its
slot loops end as on a stop, each after its call (pglane.lane). A lane named as LANE[=N] is served as
named, never retired by the pattern. A matching lane whose settings break a timing rule is logged and
not served (a named one is refused at the start).

    state        what happens                                                   leads to
    starting     every lane read (an unknown one refused), every lane's timing   serving; exit 2, 1
                 rules checked, the pooler probed: before any slot is taken
    serving      every slot loop runs until done (pglane.slotloop); with        stopping
                 --lanes-like, the lanes matching it come and go (above)
    stopping     SIGTERM/SIGINT, --max-jobs, --max-lifetime, a hung handler or   exit 0, 69, 75
                 a slot loop's unexpected error: no slot claims again; each
                 call in progress ends, its outcome is written, its slot freed

Invariants:
- one slot's wait, call or error never holds up another slot: every wait is on the event loop (a
  standby's blocking wait runs in a thread of its own), every sync handler in a thread of its lane's;
- a stop never cuts a call off: the process exits once every slot loop has ended, each after its call;
  exit 0, or 69 (EXIT_UNSTORED) when an outcome could not be stored (the database unreachable), each
  such outcome's storing statement logged;
- a handler still running at the hard timeout gets its attempt recorded timed_out, its slot kept, and
  the process ends with 75 (EXIT_HUNG) once the other slots' calls have finished (a thread cannot be
  killed, pglane.call): every lane of the process then stops taking jobs until it is restarted;
- a slot loop's unexpected error stops the process the same way, and is raised once every other slot
  loop has ended.
How it breaks: a handler that blocks the event loop itself (an async handler that never awaits, a C
extension holding the GIL) stops every slot of the process; past its hard timeout the watchdog ends the
process at once (exit 75), cutting the other calls off: their attempts are recovered as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from . import queries
from .call import EXIT_HUNG, Watchdog
from .errors import ConfigurationError, DatabaseUnavailable, UnknownLane, first_line
from .handler import Handler
from .job import Claim
from .lane import Lane, ServedLane, recover, violations
from .lifetime import Lifetime, Recovery
from .metrics import Metrics
from .session import KEEPALIVES, LIVENESS, SESSIONS, SlotSession
from .shared import Sessions, SharedSession
from .slot import LockSession
from .slotloop import SlotLoop

log = logging.getLogger("pglane.worker")

H = TypeVar("H")  # a handler, or what names one (the command line checks its plan before importing any)

EXIT_OK = 0
EXIT_UNSTORED = 69  # EX_UNAVAILABLE: stopped while the database was unreachable, an outcome unwritten
REREAD_GAP = 0.1  # --lanes-like: seconds at least between two reads of the lanes (at most 10 a second)


@dataclass(frozen=True)
class WorkerOptions:
    poll_interval: float = 5.0
    max_jobs: int | None = None  # over the process: every slot's jobs together
    max_lifetime: float | None = None
    timeout: float | None = None  # the hard timeout; default: timing.default_worker_timeout, per lane
    recover_interval: float = 30.0
    name: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on 127.0.0.1:PORT
    liveness: float = LIVENESS  # a lock session silent this long is taken for lost
    sessions: int = SESSIONS  # --sessions: more slots than this (or --lanes-like) share this many sessions


def plan(lanes: Mapping[str, int] | Iterable[str], handler: H | None,
         handlers: Mapping[str, H] | None, lanes_like: str | None = None,
         slots_each: int = 1) -> dict[str, tuple[int, H]]:
    """Each lane named, with its slot count and its handler: ``handlers[lane]``, else ``handler``.
    ConfigurationError for no lane (and no ``lanes_like``), a count below 1, a lane with no handler, a
    handler for a lane not named, or ``lanes_like`` without ``handler`` (the lanes it finds use it)."""
    counts = dict(lanes) if isinstance(lanes, Mapping) else dict.fromkeys(lanes, 1)
    handlers = dict(handlers or {})
    if lanes_like is not None:
        if not lanes_like:
            raise ConfigurationError("--lanes-like needs a pattern, e.g. 'tenant_%'")
        if not isinstance(slots_each, int) or slots_each < 1:
            raise ConfigurationError(f"--slots-each {slots_each}: a worker takes at least 1 slot of each lane")
        if handler is None:
            raise ConfigurationError("--lanes-like serves the lanes it finds with the handler for every lane: give "
                                     "--handler MODULE:CALLABLE")
    elif not counts:
        raise ConfigurationError("name at least one lane to serve, or serve lanes by pattern with --lanes-like")
    if few := [f"{name}={n}" for name, n in counts.items() if not isinstance(n, int) or n < 1]:
        raise ConfigurationError(f"{', '.join(few)}: a worker takes at least 1 slot of each lane it serves")
    if stray := sorted(set(handlers) - set(counts)):
        raise ConfigurationError(f"a handler is given for {', '.join(stray)}, which this worker does not serve; "
                                 f"serve it (pglane worker {' '.join([*counts, *stray])} ...) or drop that handler")
    served: dict[str, tuple[int, H]] = {}
    for name, n in counts.items():
        chosen = handlers.get(name, handler)
        if chosen is None:
            raise ConfigurationError(f"no handler for lane {name}: give --handler {name}=MODULE:CALLABLE, or one "
                                     "--handler MODULE:CALLABLE for every lane without its own")
        served[name] = (n, chosen)
    return served


class Worker:
    """A worker process: up to N slots of each of its lanes. ``Worker(dsn, "lane", handler)`` serves one
    slot of one lane; ``Worker(dsn, lanes={"a": 2, "b": 1}, handler=h)`` (or ``handlers={"a": h, ...}``,
    a lane's own handler before ``handler``) serves several, each handler seeing ``job.lane``;
    ``lanes_like="tenant_%"`` (with or without named lanes) serves ``slots_each`` slots of every lane whose
    name matches, the lanes created later included, with ``handler`` (module doc)."""

    def __init__(self, dsn: str, lane: str | None = None, handler: Handler | None = None,
                 options: WorkerOptions | None = None, *, lanes: Mapping[str, int] | Iterable[str] | None = None,
                 handlers: Mapping[str, Handler] | None = None, lanes_like: str | None = None,
                 slots_each: int = 1) -> None:
        if lane is not None and lanes is not None:
            raise ConfigurationError("give a worker one lane, or lanes={name: slots, ...}, not both")
        if lane is None and lanes is None and lanes_like is None:
            raise ConfigurationError("give a worker one lane, lanes={name: slots, ...} or lanes_like=PATTERN")
        self.dsn = dsn
        self.plan = plan(lanes if lanes is not None else [lane] if lane is not None else [], handler, handlers,
                         lanes_like, slots_each)
        self.lanes_like = lanes_like
        self.slots_each = slots_each
        self._pattern_handler = handler  # what the lanes found by the pattern run
        # the first lane named (the only one of a one-lane worker); empty for a worker by pattern alone
        self.lane_name = next(iter(self.plan), "")
        self.options = options or WorkerOptions()
        self.name = self.options.name or f"{socket.gethostname()}:{os.getpid()}"
        self.lifetime = Lifetime(self.options.max_jobs, self.options.max_lifetime)
        self.slots: list[SlotLoop] = []  # made by main(), and by _watch as lanes matching the pattern come
        self.served: dict[str, ServedLane] = {}  # each lane served now, by name
        self._every_lane: list[ServedLane] = []  # each lane served since the start (shut down at the end)
        self._tasks: set[asyncio.Future[None]] = set()  # the slot loops still running
        self._more = asyncio.Event()  # slot loops were added (_run_slots waits for them too)
        self._watchdog: Watchdog | None = None
        self._metrics: Metrics | None = None
        self._refused: set[int] = set()  # ids of matching lanes not served (a timing rule broken): logged once
        if not isinstance(self.options.sessions, int) or self.options.sessions < 1:
            raise ConfigurationError(f"--sessions {self.options.sessions}: a worker needs at least 1 session")
        # More slots than --sessions, or lanes by pattern (how many is not known): the slots share that many
        # sessions (pglane.shared), with one recovery timer for every lane; else each slot has its own.
        self._shared: Sessions | None = None
        self._recovery: Recovery | None = None
        if lanes_like is not None or sum(n for n, _ in self.plan.values()) > self.options.sessions:
            self._shared = Sessions(dsn, self.options.sessions, self.name, self.options.poll_interval,
                                    self.options.liveness, after_poll=self._recover_shared)
            self._recovery = Recovery(self.options.recover_interval)

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
        settings = self._load_lanes()
        from .pooler import refuse_transaction_pooler  # a direct or session-pooled DSN, before any slot

        refuse_transaction_pooler(self.dsn)
        o = self.options
        if broken := [f"lane {name}: " + "; ".join(problems) for name, lane in settings.items()
                      if (problems := violations(lane, o.timeout))]:
            raise ConfigurationError("; ".join(broken))
        metrics = self._metrics = Metrics(o.metrics_port) if o.metrics_port is not None else None
        self._watchdog = Watchdog(self.dsn)
        self._watchdog.start()
        for name, (n, handler) in self.plan.items():
            self._serve(settings[name], n, handler, by_pattern=False)
        refresher = asyncio.ensure_future(metrics.refresh_forever(self.dsn)) if metrics is not None else None
        try:
            failure = await self._run_slots()
        finally:
            for lane in self._every_lane:
                lane.shutdown()
            if refresher is not None:
                refresher.cancel()
                await asyncio.gather(refresher, return_exceptions=True)
            if metrics is not None:
                metrics.close()
        log.info("worker %s stopped after %s job(s)", self.name, self.jobs_run)
        unstored = self._log_unstored()
        if self.lifetime.hung is not None:
            log.error("%s: exiting %s to be restarted (every lane of this process was stopped; its other calls "
                      "finished first)", self.lifetime.hung, EXIT_HUNG)
            logging.shutdown()
            os._exit(EXIT_HUNG)  # the hung thread cannot be stopped, nor joined: the process must go
        if self._shared is not None:
            self._shared.close()  # after the hung exit: a hung call's shared session stays held until then
        if failure is not None:
            raise failure
        return EXIT_UNSTORED if unstored else EXIT_OK

    def _serve(self, settings: Lane, n: int, handler: Handler, *, by_pattern: bool) -> None:
        """Serve ``n`` slots of the lane: its ServedLane, and a slot loop (in a task) per slot."""
        o = self.options
        assert self._watchdog is not None
        lane = ServedLane(settings, n, handler, self._watchdog, timeout=o.timeout, recover_interval=o.recover_interval,
                          metrics=self._metrics.lane(settings.name) if self._metrics else None, by_pattern=by_pattern,
                          recovery=self._recovery)
        self.served[settings.name] = lane
        self._every_lane.append(lane)
        s = lane.settings
        log.info("worker %s for lane %s (%s slot(s), job timeout %gs, hard timeout %gs, lease %gs)", self.name,
                 s.name, s.slots, s.job_timeout, lane.caller.hard_timeout, s.lease_timeout)
        if lane.slots > s.slots:
            log.warning("lane %s has %s slot(s) and this worker asks for %s: %s will wait as standby until the "
                        "lane has more (pglane lane set %s --slots N)", s.name, s.slots, lane.slots,
                        lane.slots - s.slots, s.name)
        for _ in range(n):
            slot = SlotLoop(lane, self.lifetime, self.name, poll_interval=o.poll_interval, connect=self._connect,
                            claim=self._claim)
            self.slots.append(slot)
            self._tasks.add(asyncio.ensure_future(slot.run()))
        self._more.set()

    async def _run_slots(self) -> BaseException | None:
        """Run every slot loop until each has ended (and, with --lanes-like, the watch of the lanes, until the
        process is done); the first unexpected error stops the process (the other slots finish their
        calls) and is returned."""
        failure: BaseException | None = None
        watch = asyncio.ensure_future(self._watch()) if self.lanes_like is not None else None
        while self._tasks or (watch is not None and not watch.done()):
            if watch is not None and not self._tasks and self.lifetime.done():
                watch.cancel()  # --max-jobs or --max-lifetime: nothing more will be served
            more: asyncio.Future[Any] = asyncio.ensure_future(self._more.wait())
            waiting: set[asyncio.Future[Any]] = {*self._tasks, more}
            if watch is not None and not watch.done():
                waiting.add(watch)
            ended, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            more.cancel()
            self._more.clear()
            for task in ended - {more}:
                self._tasks.discard(task)
                if task.cancelled() or (exc := task.exception()) is None:
                    continue
                log.error("a %s of this worker failed (%s: %s): stopping the worker",
                          "slot" if task is not watch else "watch of the lanes", type(exc).__name__, first_line(exc))
                failure = failure or exc
                self.stop("a slot failed" if task is not watch else "the watch of the lanes failed")
        return failure

    # ----- --lanes-like: the lanes matching the pattern, as they come and go --------------------

    async def _watch(self) -> None:
        """Until the process is done: read the lanes matching the pattern (one query), serve the new, retire
        the gone; then wait for a NOTIFY on pglane_lanes, the poll interval or a stop. A database error
        is logged and the read tried again at the next poll interval, on a new connection."""
        assert self.lanes_like is not None
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self.lifetime.done():
                try:
                    if conn is None:
                        conn = psycopg.connect(self.dsn, autocommit=True,
                                               application_name=f"pglane {self.name} lanes"[:63], **KEEPALIVES)
                        conn.execute(queries.LANES_CHANNEL)
                    self._follow(conn.execute(queries.LANES_LIKE, {"pattern": self.lanes_like}).fetchall())
                except psycopg.Error as exc:
                    log.warning("could not read the lanes like %r (%s); trying again in %gs", self.lanes_like,
                                first_line(exc), self.options.poll_interval)
                    if conn is not None:
                        conn.close()
                    conn = None
                conn = await self._lanes_news(conn)
        finally:
            if conn is not None:
                conn.close()

    def _follow(self, rows: list[Any]) -> None:
        """Serve each lane of ``rows`` (the pattern's, as read now) not served yet; retire each lane served by
        pattern that is not among them (under the same id)."""
        now = {lane.name: lane for lane in (Lane.from_row(row, row[1]) for row in rows)}
        for name, lane in list(self.served.items()):
            if lane.by_pattern and (name not in now or now[name].id != lane.settings.id):
                lane.retire()
                del self.served[name]
        for name, settings in now.items():
            if name in self.served or name in self.plan or self.lifetime.done():
                continue
            if problems := violations(settings, self.options.timeout):
                if settings.id not in self._refused:
                    self._refused.add(settings.id)
                    log.error("lane %s matches %r but is not served: %s", name, self.lanes_like, "; ".join(problems))
                continue
            assert self._pattern_handler is not None
            self._serve(settings, self.slots_each, self._pattern_handler, by_pattern=True)

    async def _lanes_news(self, conn: psycopg.Connection[Any] | None) -> psycopg.Connection[Any] | None:
        """Wait for a NOTIFY on the lanes' channel (consumed, whatever it says), the poll interval, the end of
        life or a stop; the connection, or None if it was found gone."""
        await self.lifetime.nap(REREAD_GAP)  # a flood of notifications (any login may send them) costs little
        if conn is not None:  # one that came during the read may be for a lane its snapshot missed: read again
            try:
                if sum(1 for _ in conn.notifies(timeout=0)):
                    return conn
            except psycopg.Error:
                conn.close()
                return None
        loop = asyncio.get_running_loop()
        bounds = (self.options.poll_interval, self.lifetime.ends_in(time.monotonic()))
        ready: asyncio.Future[Any] = loop.create_future()
        stop: asyncio.Future[Any] = asyncio.ensure_future(self.lifetime.stop_requested.wait())
        if conn is not None:
            loop.add_reader(conn.fileno(), lambda: None if ready.done() else ready.set_result(None))
        try:
            await asyncio.wait({ready, stop}, timeout=min(b for b in bounds if b is not None),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if conn is not None:
                loop.remove_reader(conn.fileno())
        if conn is not None:
            try:
                for _ in conn.notifies(timeout=0):
                    pass  # what a notification says is not trusted: it only brings the next read forward
            except psycopg.Error:
                conn.close()
                return None
        return conn

    def _log_unstored(self) -> bool:
        """Log, at ERROR, how to store each outcome a slot could not (the database unreachable); any?"""
        unstored = [slot.outbox.held for slot in self.slots if slot.outbox.held is not None]
        for held in unstored:
            job = held.claim.job
            log.error("stopped before the database took the outcome of attempt %s of job %s: it is not stored; "
                      "recovery will mark the attempt lost, and then this statement stores it as a late result: %s",
                      job.attempt_id, job.id, held.statement())
        return bool(unstored)

    def _load_lanes(self) -> dict[str, Lane]:
        """Every lane served, as the database has it now; UnknownLane naming each that is not there."""
        try:
            conn = psycopg.connect(self.dsn, autocommit=True)
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"cannot connect to the database ({first_line(exc)}); check "
                                      "--dsn / PGLANE_DSN") from None
        with conn:
            rows = {name: conn.execute(queries.LANES, {"name": name}).fetchone() for name in self.plan}
        if not rows:
            return {}
        if len(missing := [name for name, row in rows.items() if row is None]) > 1:
            raise UnknownLane(f"unknown lanes {', '.join(map(repr, missing))}; create each with: pglane lane "
                              "create NAME")
        return {name: Lane.from_row(row, name) for name, row in rows.items()}  # one unknown: UnknownLane

    # ----- what every slot loop gets from the process -----------------------------------------

    async def _connect(self, lane: ServedLane) -> SlotSession:
        """A session for a slot of ``lane``: a place on one of the process's shared sessions, or (a process
        with no more slots than --sessions) a dedicated lock connection of its own, opened in a thread
        (the other slots run on meanwhile, whatever the network does)."""
        s = lane.settings
        if self._shared is not None:
            return await self._shared.place(s.id, s.slots)
        return await asyncio.to_thread(LockSession.connect, self.dsn, s.id, s.slots, f"{s.name} {self.name}",
                                       self.options.liveness)

    def _recover_shared(self, session: SharedSession) -> None:
        """After a shared session's poll: every lane's recovery, when the process's timer says it is due
        (an idle slot would run it too, but idle slots on shared sessions wait for no timer)."""
        if self._recovery is not None and self._recovery.due():
            recover(session, None)
            self._recovery.done()

    def _claim(self, slot: SlotLoop, session: SlotSession) -> Claim | None:
        """Every claim_or_wait of every slot goes through here, on the slot's session (a subclass may
        watch the claims)."""
        return slot.claim(session)
