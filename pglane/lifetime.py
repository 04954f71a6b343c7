"""When a worker process stops taking jobs: a stop request (SIGTERM, SIGINT, ``Worker.stop``), its
``--max-jobs``, its ``--max-lifetime`` or a hung handler's recycle; and each lane's periodic recovery
between them (``Recovery``).

A ``Lifetime`` belongs to the process, and every slot of every lane it serves shares it (pglane.worker).
Invariants:
- a stop never cuts a call off: it ends waits (the backoff's sleep, the idle waits of every slot, through
  the sessions ``interrupting`` names), never a call in progress;
- ``--max-jobs`` counts the jobs the process's slots *claimed* (``claimed``), so that slots claiming side
  by side never start more than it between them: every claim is a statement the event loop's thread
  runs to its end, and each is sent only after ``done()`` said no, with no await in between;
- a recycle (a handler outlived the hard timeout, pglane.call) is a stop that ends in EXIT_HUNG: the hung
  call's session is ``kept`` (its slot stays held, so no second call of its lane starts beside the
  thread that cannot be stopped) until the process exits, once every other call has finished;
- every timer counts on time.monotonic(), from the process's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from .session import SlotSession

log = logging.getLogger("pglane.worker")


class Waits:
    """The sessions waiting idle (each slot's, side by side) that an event must interrupt: a stop request
    (Lifetime), a lane's retirement (pglane.lane)."""

    def __init__(self) -> None:
        self._sessions: set[SlotSession] = set()

    @contextlib.contextmanager
    def interrupting(self, session: SlotSession) -> Iterator[None]:
        """While inside, interrupt_all() ends ``session``'s wait."""
        self._sessions.add(session)
        try:
            yield
        finally:
            self._sessions.discard(session)

    def interrupt_all(self) -> None:
        for session in tuple(self._sessions):
            session.interrupt()


class Lifetime:
    def __init__(self, max_jobs: int | None, max_lifetime: float | None) -> None:
        self.started = time.monotonic()
        self.jobs_run = 0  # calls made to their end, by every slot
        self.claimed = 0  # jobs claimed by every slot: what --max-jobs counts
        self._max_jobs = max_jobs
        self._max_lifetime = max_lifetime
        self.stop_requested = asyncio.Event()  # set once; what every wait of every slot also waits for
        self.waits = Waits()  # the sessions waiting idle, which a stop request interrupts
        self.hung: str | None = None  # why the process recycles (a handler outlived the hard timeout)
        self.kept: list[SlotSession] = []  # the hung calls' sessions: held, never released, until the exit

    # ----- the end ---------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        if not self.stop_requested.is_set():
            log.info("%s: finishing the calls in progress, then releasing the slots and exiting", reason)
            self.stop_requested.set()
            self.waits.interrupt_all()

    def recycle(self, reason: str, session: SlotSession) -> None:
        """A handler outlived the hard timeout on ``session`` (its attempt recorded already): keep that
        session, and its slot, until the exit; stop the rest of the process, which then exits EXIT_HUNG."""
        self.kept.append(session)
        if self.hung is None:
            self.hung = reason
        self.stop(reason)

    def count_claim(self) -> None:
        """A slot claimed a job; the one that reaches --max-jobs ends every idle slot's wait (a slot on a
        shared session waits for no timer: it would wait until woken)."""
        self.claimed += 1
        if self._max_jobs is not None and self.claimed == self._max_jobs:
            log.info("--max-jobs %s reached: finishing the calls in progress, then releasing the slots and exiting",
                     self._max_jobs)
            self.waits.interrupt_all()

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def done(self) -> bool:
        """No new job starts: a stop was asked for, or the process is due to recycle."""
        if self.stop_requested.is_set():
            return True
        if self._max_jobs is not None and self.claimed >= self._max_jobs:
            return True
        return self._max_lifetime is not None and time.monotonic() - self.started >= self._max_lifetime

    def ends_in(self, now: float) -> float | None:
        """Seconds until --max-lifetime (None without one)."""
        return None if self._max_lifetime is None else max(0.0, self.started + self._max_lifetime - now)

    async def nap(self, seconds: float) -> None:
        """Sleep, unless a stop request comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_requested.wait(), seconds)



class Recovery:
    """When a lane's next recovery is due: one timer per lane, shared by the process's slots of it, so a
    lane is recovered every ``interval`` however many of its slots the process holds."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._at = time.monotonic()  # the first recovery runs on the first slot taken

    def due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._at

    def due_in(self, now: float) -> float:
        return max(0.0, self._at - now)

    def done(self) -> None:
        self._at = time.monotonic() + self._interval
