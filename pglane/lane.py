"""A lane as one worker process serves it: its settings as last read, and what the process's slots of
the lane share — the ``Caller`` (the lane's job and hard timeouts, the handler's threads), the recovery
timer and the lane's metrics.

Invariants:
- the settings apply to every slot of the lane in the process from the statement after they are read:
  the timeouts to the next call, the lane's slot count to each session's next take or claim (each session
  reads the lane's news on its own connection and sets its own ``slots``);
- recovery runs once per interval for the lane (its own timer, ``recover(lane)``), or, in a process on shared
  sessions (pglane.shared), once per interval for every lane (the process's timer, ``recover()``);
- the hard timeout is the worker's ``--timeout``, else the lane's job timeout plus the margin inside its
  lease (pglane.timing): one lane's timeouts never change another lane's;
- a lane served by pattern (``--lanes-like``) is ``retired`` once the database no longer has it (its
  row gone, or its name now another lane's id): its slot loops then end as on a stop, each after its
  call, and never claim again. Only a read of pglane.lanes retires a lane, never a notification.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg

from . import queries, timing, tracing
from .call import Caller, Watchdog
from .errors import UnknownLane, first_line
from .handler import Handler, Runner
from .lifetime import Recovery, Waits
from .metrics import LaneMetrics
from .session import Session, SlotSession

log = logging.getLogger("pglane.worker")


@dataclass(frozen=True)
class Lane:
    id: int
    name: str
    slots: int
    job_timeout: float
    lease_timeout: float
    max_result_bytes: int
    takeover: str

    @classmethod
    def from_row(cls, row: Any, name: str) -> Lane:
        """The settings in a row of queries.LANES; UnknownLane when there is none."""
        if row is None:
            raise UnknownLane(f"unknown lane {name!r}; create it with: pglane lane create {name}")
        if isinstance(row, dict):
            row = tuple(row.values())
        lane_id, lane_name, slots, job_timeout, lease_timeout, _, _, max_result_bytes, takeover = row
        return cls(lane_id, lane_name, slots, job_timeout, lease_timeout, max_result_bytes, takeover)


def hard_timeout(lane: Lane, timeout: float | None) -> float:
    """The worker's --timeout (``timeout``), else the lane's job timeout plus the margin inside its lease."""
    return timeout or timing.default_worker_timeout(lane.job_timeout, lane.lease_timeout)


def violations(lane: Lane, timeout: float | None) -> list[str]:
    """The timing rules the lane's settings break with the worker's hard timeout (pglane.timing)."""
    return timing.Timeouts(job=lane.job_timeout, lease=lane.lease_timeout,
                           worker=hard_timeout(lane, timeout)).violations()


STUCK = tracing.Stuck()  # the stuck attempts this process has written a span for (each once)


def recover(session: Session | SlotSession, lane: str | None) -> None:
    """Mark lost the running attempts of ``lane`` (None: of every lane) whose worker is provably gone; log
    how many, and (tracing on) write their ``lost`` spans, their workers died with their own, and a
    ``stuck`` span for each attempt past its lease whose worker is still connected."""
    row = session.execute(queries.RECOVER, (lane,))
    if row and row["recover"]:
        log.warning("recovered %s attempt(s) of %s whose worker was gone (marked lost)", row["recover"],
                    f"lane {lane}" if lane else "the lanes")
        if tracing.active():
            tracing.lost(_traced(session, queries.LOST_AT, (row["at"],), "lost"))
    if tracing.active():
        STUCK.found(_traced(session, queries.STUCK_TRACED, (lane,), "stuck"))


def _traced(session: Session | SlotSession, query: LiteralString, params: tuple[Any, ...], column: str
            ) -> list[dict[str, Any]]:
    """What a recovery reads for its spans (a JSON array in ``column``): spans are a help, never a reason
    to end a session, so a refusal (a role not granted what the query reads, say) is logged and gives none;
    a lost connection is raised, as from any statement."""
    try:
        row = session.execute(query, params)
    except psycopg.Error as exc:
        if isinstance(exc, psycopg.OperationalError):
            raise
        log.warning("no recovery spans: the database refused their query (%s); the worker goes on", first_line(exc))
        return []
    return json.loads(row[column]) if row else []


class ServedLane:
    """One lane served by ``slots`` slot loops of a process (pglane.slotloop)."""

    def __init__(self, settings: Lane, slots: int, handler: Handler, watchdog: Watchdog, *,
                 timeout: float | None, recover_interval: float, metrics: LaneMetrics | None,
                 by_pattern: bool = False, recovery: Recovery | None = None) -> None:
        self.name = settings.name
        self.by_pattern = by_pattern  # served because its name matches --lanes-like: it may be retired
        self.retired = False  # the lane is gone from the database: its slot loops end (module doc)
        self.waits = Waits()  # the sessions waiting idle, which retire() interrupts
        self.admissions = tracing.Admissions()  # what its claims were told while held back (traces only)
        self.settings = settings  # as last read (the process's start, each session's start, the lane's news)
        self.slots = slots  # how many slots of the lane the process takes (each a slot loop)
        self._timeout = timeout  # the worker's --timeout, if given: the hard timeout of every lane
        self.metrics = metrics
        # The lane's own recovery timer; or the process's, which recovers every lane at once (a process on
        # shared sessions: one recovery per interval, not one per lane).
        self.recovery = recovery or Recovery(recover_interval)
        self._recovers = None if recovery is not None else self.name  # recover()'s argument: this lane, or all
        self.caller = Caller(Runner(handler, threads=slots), watchdog, settings.job_timeout,
                             hard_timeout(settings, timeout), settings.max_result_bytes, metrics)

    def reload(self, session: SlotSession) -> None:
        """The lane's settings as they are now (pglane lane set changes them while workers run): read at
        each session's start and after the lane's news, before the next claim. Slots apply to this
        session's next claim (one above the lane's slots is refused, and the slot loop takes a slot
        again), the timeouts to the next call of any slot of the lane."""
        session.news = False
        new = Lane.from_row(session.execute(queries.LANES, {"name": self.name}), self.name)
        if new.id != self.settings.id:  # deleted, and a lane of the same name made since: not this one
            raise UnknownLane(f"lane {self.name} (id {self.settings.id}) was deleted; a new lane has its name")
        session.slots = new.slots
        if new == self.settings:
            return  # read already, by another slot of the lane that had the news first
        for problem in violations(new, self._timeout):
            log.error("lane %s's new settings break a timing rule: %s", new.name, problem)
        hard = hard_timeout(new, self._timeout)
        self.caller.job_timeout, self.caller.hard_timeout = new.job_timeout, hard
        self.caller.max_result_bytes = new.max_result_bytes
        self.settings = new
        log.info("lane %s settings now: %s slot(s), job timeout %gs, hard timeout %gs, lease %gs",
                 new.name, new.slots, new.job_timeout, hard, new.lease_timeout)

    def recover(self, session: SlotSession, *, taking: bool = False) -> None:
        """Recover (when due: every lane, on shared sessions), or, ``taking`` a slot, this lane alone: a
        takeover recovers what the slot's last holder left at once, whatever the process's timer says."""
        lane = self.name if taking else self._recovers
        recover(session, lane)
        if lane == self._recovers:
            self.recovery.done()

    def retire(self) -> None:
        """The lane is gone (a read of the lane list said so): its slot loops end, each after its call."""
        if not self.retired:
            self.retired = True
            log.info("lane %s was deleted: its slots end, each after the call it runs", self.name)
            self.waits.interrupt_all()


    def shutdown(self) -> None:
        self.caller.runner.shutdown()
