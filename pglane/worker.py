"""The worker process: serve one or many lanes, up to N slots of each, in one event loop.

``pglane worker a=2 b --handler M:C`` (or ``pglane.Worker(dsn, lanes={"a": 2, "b": 1}, handler=...)``)
runs one slot loop (pglane.slotloop) per slot: two of lane a, one of b, each in a task of its own,
each with its own lock session for now (docs/design.md, "The lock connection"). Owns what belongs to the
process, not to a slot or a lane: the signal handlers, the one metrics server, the pooler refusal (once),
the lifetime (--max-jobs and --max-lifetime counted over the process, the stop request every slot
shares), the watchdog, and the exit status. What belongs to a lane (its settings and their reload, its
caller with its timeouts, its recovery timer) is pglane.lane's, shared by the process's slots of it.

    state        what happens                                                   leads to
    starting     every lane read (an unknown one refused), every lane's timing   serving; exit 2, 1
                 rules checked, the pooler probed: before any slot is taken
    serving      every slot loop runs until done (pglane.slotloop)              stopping
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import psycopg

from . import queries
from .call import EXIT_HUNG, Watchdog
from .errors import ConfigurationError, DatabaseUnavailable, UnknownLane, first_line
from .handler import Handler
from .job import Claim
from .lane import Lane, ServedLane, violations
from .lifetime import Lifetime
from .metrics import Metrics
from .slot import LIVENESS, LockSession
from .slotloop import SlotLoop

log = logging.getLogger("pglane.worker")

H = TypeVar("H")  # a handler, or what names one (the command line checks its plan before importing any)

EXIT_OK = 0
EXIT_UNSTORED = 69  # EX_UNAVAILABLE: stopped while the database was unreachable, an outcome unwritten


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


def plan(lanes: Mapping[str, int] | Iterable[str], handler: H | None,
         handlers: Mapping[str, H] | None) -> dict[str, tuple[int, H]]:
    """Each lane served, with its slot count and its handler: ``handlers[lane]``, else ``handler``.
    ConfigurationError for no lane, a count below 1, a lane with no handler or a handler for a lane
    not served."""
    counts = dict(lanes) if isinstance(lanes, Mapping) else dict.fromkeys(lanes, 1)
    handlers = dict(handlers or {})
    if not counts:
        raise ConfigurationError("name at least one lane to serve")
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
    a lane's own handler before ``handler``) serves several, each handler seeing ``job.lane``."""

    def __init__(self, dsn: str, lane: str | None = None, handler: Handler | None = None,
                 options: WorkerOptions | None = None, *, lanes: Mapping[str, int] | Iterable[str] | None = None,
                 handlers: Mapping[str, Handler] | None = None) -> None:
        if (lane is None) == (lanes is None):
            raise ConfigurationError("give a worker one lane, or lanes={name: slots, ...}, not both")
        self.dsn = dsn
        self.plan = plan(lanes if lanes is not None else [lane] if lane is not None else [], handler, handlers)
        self.lane_name = next(iter(self.plan))  # the first lane served (the only one of a one-lane worker)
        self.options = options or WorkerOptions()
        self.name = self.options.name or f"{socket.gethostname()}:{os.getpid()}"
        self.lifetime = Lifetime(self.options.max_jobs, self.options.max_lifetime)
        self.slots: list[SlotLoop] = []  # made by main()

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
        metrics = Metrics(o.metrics_port) if o.metrics_port is not None else None
        watchdog = Watchdog(self.dsn)
        watchdog.start()
        lanes = [ServedLane(settings[name], n, handler, watchdog, timeout=o.timeout,
                            recover_interval=o.recover_interval, metrics=metrics.lane(name) if metrics else None)
                 for name, (n, handler) in self.plan.items()]
        refresher = asyncio.ensure_future(metrics.refresh_forever(self.dsn)) if metrics is not None else None
        for lane in lanes:
            s = lane.settings
            log.info("worker %s for lane %s (%s slot(s), job timeout %gs, hard timeout %gs, lease %gs)", self.name,
                     s.name, s.slots, s.job_timeout, lane.caller.hard_timeout, s.lease_timeout)
            if lane.slots > s.slots:
                log.warning("lane %s has %s slot(s) and this worker asks for %s: %s will wait as standby until the "
                            "lane has more (pglane lane set %s --slots N)", s.name, s.slots, lane.slots,
                            lane.slots - s.slots, s.name)
        self.slots = [SlotLoop(lane, self.lifetime, self.name, poll_interval=o.poll_interval, connect=self._connect,
                               claim=self._claim) for lane in lanes for _ in range(lane.slots)]
        try:
            failure = await self._run_slots()
        finally:
            for lane in lanes:
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
        if failure is not None:
            raise failure
        return EXIT_UNSTORED if unstored else EXIT_OK

    async def _run_slots(self) -> BaseException | None:
        """Run every slot loop until each has ended; the first unexpected error stops the process (the
        other slots finish their calls) and is returned."""
        failure: BaseException | None = None
        tasks = [asyncio.ensure_future(slot.run()) for slot in self.slots]
        for ended in asyncio.as_completed(tasks):
            try:
                await ended
            except Exception as exc:
                log.error("a slot of this worker failed (%s: %s): stopping the worker", type(exc).__name__,
                          first_line(exc))
                failure = failure or exc
                self.stop("a slot failed")
        return failure

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
        if len(missing := [name for name, row in rows.items() if row is None]) > 1:
            raise UnknownLane(f"unknown lanes {', '.join(map(repr, missing))}; create each with: pglane lane "
                              "create NAME")
        return {name: Lane.from_row(row, name) for name, row in rows.items()}  # one unknown: UnknownLane

    # ----- what every slot loop gets from the process -----------------------------------------

    def _connect(self, lane: ServedLane) -> LockSession:
        """A session of its own for a slot of ``lane``: a dedicated lock connection."""
        s = lane.settings
        return LockSession.connect(self.dsn, s.id, s.slots, f"{s.name} {self.name}", self.options.liveness)

    def _claim(self, slot: SlotLoop, session: LockSession) -> Claim | None:
        """Every claim_or_wait of every slot goes through here, on the slot's session (a subclass may
        watch the claims)."""
        return slot.claim(session)
