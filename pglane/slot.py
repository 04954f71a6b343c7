"""The dedicated slot session: one direct database session (pglane.session) that holds one slot of one
lane, listens for its wake-ups and runs its claims. A process whose slots share a few sessions
(``--sessions K``) uses pglane.shared instead; both offer a slot loop the same ``SlotSession``.

Owns the lock connection. Invariants:
- the session holds at most one slot, taken once (advisory locks stack; a second take would need a
  second release) and released with a checked unlock;
- claims run on this session, because pglane.claim() refuses any session that holds no slot;
- the lock key is (lane id, slot number), never a hash of the name; the channel is ``pglane_<id>``.
- the channel's notifications are untrusted (any login may NOTIFY it): an empty payload is a wake-up,
  ``settings`` is news (pglane.set_lane changed the lane), anything else is ignored and counted
  (``ignored``), the first one logged; a flood of any of them costs claims at most the worker's cap.
- a standby learns of a raised slot count: it listens while it waits and reads the lane again on its news
  and every ``recheck`` seconds anyway (`wait_take`).
- the session is never silent for long unnoticed: every statement runs under a deadline (pglane.session),
  and during a call ``watch()`` asks the
  server a question whenever nothing arrived for a quarter of that time and takes the session for lost
  when no answer comes within the rest. A silent network (packets dropped, nothing closed, which TCP itself may not
  notice for minutes) is thus noticed within ``liveness`` seconds during a call, and within the poll
  interval plus ``liveness`` while idle.
How it breaks: when the connection drops (server restart, pg_terminate_backend, network cut) the
server frees the slot while this process may still be inside a call. Every use of the connection
raises ``psycopg.OperationalError`` after that, and the worker then reconnects and must take a slot
again before it claims. The connection must be
direct: a transaction-mode pooler (PgBouncer) would hand the lock and the LISTEN to other clients.

The connection is a synchronous psycopg connection driven from the worker's event loop: its
statements are short (a claim, a completion) and block the loop for their round trip only, which
costs far less per job than an async connection's machinery (bench: `python -m bench`); waiting
(for a NOTIFY, or for the connection to fail during a call) is done on the event loop by watching
the socket, never by blocking. The one long blocking call, a standby's bounded wait for a slot, runs
in a thread of its own, so that the other slots of the process (pglane.worker) run on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
from psycopg import sql

from . import queries
from .session import LIVENESS, SETTINGS, Session, open_connection

log = logging.getLogger("pglane.worker")

STANDBY_WAIT = "500ms"  # one blocking wait for a busy slot; bounded so that a stop request (and news) is seen
class LockSession(Session):
    def __init__(self, conn: psycopg.Connection[dict[str, Any]], lane_id: int, slots: int,
                 liveness: float = LIVENESS) -> None:
        super().__init__(conn, liveness)
        self.lane_id = lane_id
        self.slots = slots
        self.slot: int | None = None  # the slot this session holds; only _took and release change it
        self.channel = f"pglane_{lane_id}"
        self._waiting: asyncio.Future[bool] | None = None  # the wait interrupt() ends; set by _readable only
        self.news = False  # a NOTIFY 'settings' came (the lane's settings changed); the worker clears it
        self.ignored = 0  # notifications on the channel that were neither a wake-up nor news (not pglane's)
        self.session_polls = False  # the slot loop polls the lane itself, every poll interval

    @classmethod
    def connect(cls, dsn: str, lane_id: int, slots: int, name: str, liveness: float = LIVENESS) -> LockSession:
        return cls(open_connection(dsn, f"pglane {name}"), lane_id, slots, liveness)

    def try_take(self) -> bool:
        """Take any free slot at once; False when all are held by others."""
        assert self.slot is None, "a session takes one slot once"
        for slot in range(1, self.slots + 1):
            row = self.execute(queries.TRY_SLOT, (self.lane_id, slot))
            if row is not None and row["pg_try_advisory_lock"]:
                self._took(slot)
                return True
        return False

    def _took(self, slot: int) -> None:
        self.slot = slot
        self.execute(queries.SLOT_HINT, (str(slot),))

    async def wait_take(self, stopping: Callable[[], bool], reread: Callable[[], None], recheck: float) -> bool:
        """Wait as a standby until a slot frees, then take it; False if asked to stop first.
        Waits on one slot at a time (rotating, STANDBY_WAIT each) so that a one-slot lane is taken over
        the moment its holder's session ends. Each wait blocks a thread of this session's own, never the
        event loop, on which the process's other slots run: the connection is this session's alone, and
        nothing on the loop touches it until the wait returns (a stop request is therefore seen between
        waits, within STANDBY_WAIT, and the Fuse still cuts a wait the network made silent). Between
        waits the lane's notifications are read (listen() first): on its news, and every ``recheck``
        seconds anyway (a notification may be lost), ``reread`` reads the lane again (setting ``slots``)
        and every slot is tried at once, so that a raised slot count is taken without waiting for a holder."""
        self.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(STANDBY_WAIT)))
        waiter = ThreadPoolExecutor(1, thread_name_prefix="pglane-standby")
        try:
            turn = 0
            due = time.monotonic() + recheck
            while not stopping():
                self._drain_notifies()  # plain wake-ups are dropped: the first claim after the take answers them
                if self.news or time.monotonic() >= due:
                    reread()
                    due = time.monotonic() + recheck
                    if self.try_take():
                        return True
                slot = turn % self.slots + 1
                turn += 1
                if await asyncio.wrap_future(waiter.submit(self._wait_slot, slot)):
                    self._took(slot)
                    return True
                if self.slots > 1 and self.try_take():
                    return True
            return False
        finally:
            waiter.shutdown(wait=False)
            if not self.conn.closed:
                self.execute("RESET lock_timeout")

    def _wait_slot(self, slot: int) -> bool:
        """In the standby's thread: wait up to STANDBY_WAIT for ``slot``; True once taken."""
        try:
            self.execute(queries.WAIT_SLOT, (self.lane_id, slot))
        except psycopg.errors.LockNotAvailable:
            return False
        return True

    def listen(self) -> None:
        self.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))

    def _drain_notifies(self) -> bool:
        """Consume the notifications received so far; True if there was a wake-up or news, and `news`
        set if one was news (the lane's settings changed); others are ignored (module doc). Raises
        OperationalError when the connection is gone (that is how a dead session is noticed)."""
        got = False
        for notify in self.conn.notifies(timeout=0):
            if notify.payload == SETTINGS:
                got = self.news = True
            elif not notify.payload:
                got = True
            else:
                self.ignored += 1
                if self.ignored == 1:
                    log.warning("ignored a notification on %s that is not pglane's (a %s-character payload "
                                "from pid %s); any login may send them, and only wake-ups and 'settings' count",
                                self.channel, len(notify.payload), notify.pid)
        return got

    def forget_wakes(self) -> None:
        """Consume the NOTIFY that wait_for_wake() returned on, once a claim has run since and found
        a job: the claim read it into psycopg's backlog, from where this takes it (and whatever else
        has arrived). Otherwise the next wait would return at once for it. Never after a claim that
        found nothing: a NOTIFY read with that claim may be for a job committed after its snapshot,
        and only the next wait, returning at once, keeps that job from waiting for the poll."""
        self._drain_notifies()

    async def _readable(self, timeout: float | None = None) -> bool:
        """Wait until the socket has something to read (a NOTIFY, an error, EOF); False on timeout
        or interrupt(). One future, one reader and one timer: this is the wake-up path."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()

        def settle(value: bool) -> None:
            if not ready.done():
                ready.set_result(value)

        fd = self.conn.fileno()
        loop.add_reader(fd, settle, True)
        timer = loop.call_later(timeout, settle, False) if timeout is not None else None
        self._waiting = ready
        try:
            return await ready
        finally:
            self._waiting = None
            loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()

    def interrupt(self) -> None:
        """End the current wait for a wake-up at once (a stop was requested)."""
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(False)

    async def wait_for_wake(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a NOTIFY on the lane; True if one came, or may have:
        the socket became readable. What arrived is left unread, so that the claim goes first on the
        wake-up path (reading it here cost more than the rest of the worker's Python together); the
        claim reads it (or raises OperationalError if it was the connection's end), and the caller
        then calls forget_wakes() if that claim found a job."""
        if self._drain_notifies():  # received during an earlier statement
            return True
        return await self._readable(timeout)

    async def wait_for_news(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a NOTIFY that carries news ('settings': the lane's settings
        changed), reading and dropping the plain ones (a job arrived): a slot waiting for its rate
        limit's opening cannot start sooner for a new job, and must not claim for every one. True if
        news came; False on timeout or interrupt()."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain_notifies()
            if self.news:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not await self._readable(left):
                return False

    async def watch(self) -> None:
        """Consume notifications until the connection fails or goes silent; raises OperationalError
        then. Run during a call, so that a lost lock connection is noticed at once, and a silent one
        within ``liveness`` seconds: whenever nothing arrived for a quarter of that time it asks the
        server a question (SELECT 1) that must be answered within the three quarters left."""
        while True:
            if await self._readable(self.liveness / 4):
                self._drain_notifies()
            else:
                await self._ping(self.liveness * 3 / 4)

    async def _ping(self, within: float) -> None:
        """Ask the server a question (SELECT 1) and wait up to ``within`` seconds for its answer; if none
        comes, close the session (nothing more is sent on it, so releasing it needs no round trip)
        and raise OperationalError. Cancelled meanwhile (the call ended), the answer is left to be
        read by the session's next statement, under its own deadline, never here: this must not
        block the event loop."""
        self.ask()
        pgconn = self.conn.pgconn
        deadline = time.monotonic() + within
        while True:
            pgconn.consume_input()
            while pgconn.notifies() is not None:
                pass
            if self.answered():
                return
            if not await self._readable(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                self.conn.close()
                raise psycopg.OperationalError(
                    f"the lock session was silent for {self.liveness:g}s (no answer to a liveness check)")

    def release(self) -> None:
        """Give the slot back with a checked unlock, and close the session."""
        try:
            if self.slot is not None and not self.conn.closed:
                row = self.execute(queries.RELEASE_SLOT, (self.lane_id, self.slot))
                if row is None or not row["pg_advisory_unlock"]:
                    log.warning("slot %s of lane id %s was not held at release", self.slot, self.lane_id)
        except psycopg.Error:
            pass  # the session is gone, and with it the lock
        finally:
            self.slot = None
            self.close()
