"""When a worker process stops taking jobs: a stop request (SIGTERM, SIGINT, ``Worker.stop``), its
``--max-jobs`` or its ``--max-lifetime``; and the periodic recovery it runs between them.

Invariants:
- a stop never cuts a call off: it ends waits (the backoff's sleep, the idle wait, through the session
  ``interrupting`` names), never a call in progress;
- every timer counts on time.monotonic(), from the process's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from .slot import LockSession

log = logging.getLogger("pglane.worker")


class Lifetime:
    def __init__(self, max_jobs: int | None, max_lifetime: float | None, recover_interval: float) -> None:
        self.started = time.monotonic()
        self.jobs_run = 0
        self._max_jobs = max_jobs
        self._max_lifetime = max_lifetime
        self._recover_interval = recover_interval
        self._recover_at = self.started  # the first recovery runs on the first slot taken
        self.stop_requested = asyncio.Event()  # set once; what every wait of the worker also waits for
        self._waiting: LockSession | None = None  # a session waiting idle, which a stop request interrupts

    # ----- the end ---------------------------------------------------------------------------

    def stop(self, reason: str) -> None:
        if not self.stop_requested.is_set():
            log.info("%s: finishing the current job, then releasing the slot and exiting", reason)
            self.stop_requested.set()
            if self._waiting is not None:
                self._waiting.interrupt()

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def done(self) -> bool:
        """No new job starts: a stop was asked for, or the process is due to recycle."""
        if self.stop_requested.is_set():
            return True
        if self._max_jobs is not None and self.jobs_run >= self._max_jobs:
            return True
        return self._max_lifetime is not None and time.monotonic() - self.started >= self._max_lifetime

    def ends_in(self, now: float) -> float | None:
        """Seconds until --max-lifetime (None without one)."""
        return None if self._max_lifetime is None else max(0.0, self.started + self._max_lifetime - now)

    async def nap(self, seconds: float) -> None:
        """Sleep, unless a stop request comes first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_requested.wait(), seconds)

    @contextlib.contextmanager
    def interrupting(self, session: LockSession) -> Iterator[None]:
        """While inside, a stop request interrupts ``session``'s wait."""
        self._waiting = session
        try:
            yield
        finally:
            self._waiting = None

    # ----- recovery between jobs -------------------------------------------------------------

    def recovery_due(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._recover_at

    def recover_in(self, now: float) -> float:
        return max(0.0, self._recover_at - now)

    def recovered(self) -> None:
        self._recover_at = time.monotonic() + self._recover_interval
