"""Shared sessions: a process's slots held on a few connections (``pglane worker ... --sessions K``).

A process serving more slots than K (or lanes by pattern) holds them on at most K sessions
(``Sessions``): each ``SharedSession`` is one direct connection (pglane.session) that holds the slot locks
of many lanes, and each slot loop gets a ``SharedSlot``, its place on one of them, which offers the same
``SlotSession`` as a dedicated session (pglane.slot). The database sees what it always sees: a session
that holds a slot of the lane claims, and the attempt records that session's identity (docs/design.md,
"Shared sessions").

Invariants:
- a slot is taken with pg_try_advisory_lock on the session, never twice: the session knows the slots it
  holds (``held``: advisory locks stack, so taking a held key again would succeed) and skips them;
- a session spreads the lanes it serves: the slots of one lane go to different sessions while there are
  sessions enough (``Sessions.place``), so that two slots of a lane share a session only when the lane has
  more slots in the process than the process has sessions;
- one reader per session: the event loop watches the socket, and every notification, whether read
  there or during another slot's statement (psycopg's notify handler), goes to the slots of its lane's
  channel: an empty payload wakes them, ``settings`` is news for them, anything else is ignored and
  counted (any login may NOTIFY a lane's channel);
- one liveness check per session: while any of its slots is in a call, a question is asked whenever
  nothing arrived for a quarter of ``liveness``, and the session is taken for lost when no answer came
  within the rest; the statements of every slot run under the deadline (pglane.session);
- a session found gone (a statement failed on it, its socket closed, a question unanswered) is gone for
  every slot on it: each waiting slot is woken to find it so, each call in progress is told (``watch``),
  and each slot loop connects again, getting a place on a new session;
- one poll per session, not per lane: every poll interval one statement asks which of the session's lanes
  have a queued job due, and wakes their places; then, when the process's recovery is due, the session
  runs it (``after_poll``: one recovery of every lane per interval). A slot loop on a shared session waits
  for nothing else (a notification, that poll, its pacing): no timer wakes a thousand idle slots at once;
- a standby never occupies a session with a blocking wait: each session tries the slots its standbys want
  in one statement every STANDBY_POLL (at most one slot per lane per try), so a free slot is taken within
  that time, never at the instant its holder's session ends as a dedicated standby's is;
- everything here runs on the process's one event loop thread: the statements of the slots of a session
  run one after another, never side by side.
How it breaks: the slots of a session live and die with it: a session cut (pg_terminate_backend, a network
cut) loses every slot on it at once, and recovery marks each of their running attempts lost (evidence: the
session's mark is gone). Two slots of one lane on one session are one session to the database: the claim
answers both with the first of the lane's slots the session holds, so a rate-limited lane's turns
(pglane.rate) space them as one slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from . import queries
from .session import LIVENESS, SETTINGS, Session, open_connection

log = logging.getLogger("pglane.worker")

STANDBY_POLL = 0.5  # seconds between a session's tries of the slots its standbys want


class SharedSession(Session):
    """One connection holding the slots of many lanes, and the places of the slot loops on it."""

    def __init__(self, conn: psycopg.Connection[dict[str, Any]], poll_interval: float,
                 liveness: float = LIVENESS, after_poll: Callable[[SharedSession], None] | None = None) -> None:
        super().__init__(conn, liveness)
        self.poll_interval = poll_interval
        self._after_poll = after_poll  # run on this session after each poll (the process's recovery, when due)
        self.places: set[SharedSlot] = set()  # every slot loop's place on this session
        self.held: set[tuple[int, int]] = set()  # (lane id, slot) this session holds
        self._channels: dict[str, set[SharedSlot]] = {}  # channel -> the places listening on it
        self._standbys: list[SharedSlot] = []  # places waiting for a slot, in the order they came
        self._round: asyncio.Future[None] | None = None  # the next standby try (its task: _standby_rounds)
        self._watchers = 0  # places in a call (watch): while any, the liveness check runs
        self._heard = time.monotonic()  # when the session last received anything
        self._asked: float | None = None  # when the last liveness question was sent (open while ``unanswered``)
        self.ignored = 0  # notifications that were neither a wake-up nor news (not pglane's)
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()  # fails once the session is found gone
        self.lost.add_done_callback(lambda f: f.exception())  # read here: nobody may be watching
        self._tasks: set[asyncio.Task[None]] = set()
        conn.add_notify_handler(self._dispatch)
        loop.add_reader(conn.fileno(), self._on_readable)
        self._spawn(self._poll())

    def place(self, lane_id: int, slots: int) -> SharedSlot:
        """A place for a slot loop of lane ``lane_id`` (``slots`` slots) on this session."""
        place = SharedSlot(self, lane_id, slots)
        self.places.add(place)
        return place

    # ----- statements --------------------------------------------------------------------------

    def execute(self, query: LiteralString | sql.Composed, params: Any = None,
                within: float | None = None) -> dict[str, Any] | None:
        if self.lost.done():
            raise psycopg.OperationalError("the shared session is gone")
        try:
            row = super().execute(query, params, within)
        except psycopg.OperationalError as exc:
            self.gone(str(exc))
            raise
        self._heard = time.monotonic()
        return row

    # ----- what arrives: notifications, answers, the end ------------------------------------------

    def _on_readable(self) -> None:
        """The socket has something between statements: notifications (dispatched by psycopg's handler),
        a liveness answer, or the connection's end."""
        pgconn = self.conn.pgconn
        try:
            pgconn.consume_input()
            while (n := pgconn.notifies()) is not None:
                if pgconn.notify_handler is not None:
                    pgconn.notify_handler(n)
            if self.unanswered:
                self.answered()
        except psycopg.Error as exc:
            self.gone(str(exc))
            return
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            self.gone("the connection was closed")
            return
        self._heard = time.monotonic()

    def _dispatch(self, notify: psycopg.Notify) -> None:
        """A notification on a lane's channel, to every place listening on it (module doc)."""
        places = self._channels.get(notify.channel, ())
        if notify.payload and notify.payload != SETTINGS:
            self.ignored += 1
            if self.ignored == 1:
                log.warning("ignored a notification on %s that is not pglane's (a %s-character payload from pid "
                            "%s); any login may send them, and only wake-ups and 'settings' count",
                            notify.channel, len(notify.payload), notify.pid)
            return
        for place in places:
            place.woken(news=notify.payload == SETTINGS)

    def gone(self, why: str) -> None:
        """The session is found gone: every place on it learns so (module doc); the connection is closed."""
        if self.lost.done():
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
        self.close()
        self.held.clear()
        self.lost.set_exception(psycopg.OperationalError(f"the shared session is gone: {why}"))
        if self._round is not None and not self._round.done():
            self._round.set_exception(psycopg.OperationalError(f"the shared session is gone: {why}"))
            self._round.exception()
        for place in tuple(self.places):
            place.interrupt()
        for task in self._tasks:
            task.cancel()

    # ----- listening -------------------------------------------------------------------------------

    def listen(self, place: SharedSlot) -> None:
        listeners = self._channels.setdefault(place.channel, set())
        if not listeners:
            self.execute(sql.SQL("LISTEN {}").format(sql.Identifier(place.channel)))
        listeners.add(place)

    def leave(self, place: SharedSlot) -> None:
        """``place`` is released: its lane's channel is left when no other place listens on it."""
        self.places.discard(place)
        listeners = self._channels.get(place.channel)
        if listeners is None or place not in listeners:
            return
        listeners.discard(place)
        if not listeners:
            del self._channels[place.channel]
            if not self.lost.done():
                with contextlib.suppress(psycopg.Error):
                    self.execute(sql.SQL("UNLISTEN {}").format(sql.Identifier(place.channel)))

    # ----- the poll -------------------------------------------------------------------------------------

    async def _poll(self) -> None:
        """Every poll interval, one statement for every lane of the session: the places of each lane with a
        queued job due are woken. A lost notification, or a job whose run_after has come, waits at most this
        long, and an idle lane costs no statement of its own (module doc)."""
        while not self.lost.done():
            await asyncio.sleep(self.poll_interval)
            lanes = sorted({place.lane_id for places in self._channels.values() for place in places})
            if not lanes:
                continue
            try:
                row = self.execute(queries.DUE_LANES, (lanes,))
            except psycopg.Error:
                continue  # gone (every place is told), or refused: tried again next interval
            for lane_id in row["due"] if row else ():
                for place in tuple(self._channels.get(f"pglane_{lane_id}", ())):
                    place.woken(news=False)
            if self._after_poll is not None:
                try:
                    self._after_poll(self)
                except psycopg.Error:
                    continue  # gone (every place is told), or refused: tried again next interval

    # ----- liveness during calls -------------------------------------------------------------------

    async def watched(self) -> None:
        """Until the session is found gone (raises OperationalError then): one place's call watches it.
        The first watcher starts the liveness check, the last one's end lets it stop."""
        self._watchers += 1
        if self._watchers == 1:
            self._spawn(self._liveness())
        try:
            await asyncio.shield(self.lost)
        finally:
            self._watchers -= 1

    async def _liveness(self) -> None:
        """While any place is in a call: ask a question when nothing arrived for a quarter of ``liveness``;
        the session is gone when its answer has not come within the rest."""
        quarter = self.liveness / 4
        while self._watchers and not self.lost.done():
            await asyncio.sleep(quarter)
            now = time.monotonic()
            if self.unanswered:  # asked (by this check: a statement would have read the answer first)
                if self._asked is not None and now - self._asked >= self.liveness * 3 / 4:
                    self.gone(f"silent for {self.liveness:g}s (no answer to a liveness check)")
            elif now - self._heard >= quarter:
                try:
                    self.ask()
                except psycopg.Error as exc:
                    self.gone(str(exc))
                    return
                self._asked = now

    # ----- standbys --------------------------------------------------------------------------------

    async def standby_round(self, place: SharedSlot) -> None:
        """Wait for the session's next try of the slots its standbys want (``place`` among them); the
        place holds a slot after it if the try got one for it. OperationalError if the session is gone."""
        if self.lost.done():
            raise psycopg.OperationalError("the shared session is gone")
        if place not in self._standbys:
            self._standbys.append(place)
        if self._round is None or self._round.done():
            self._round = asyncio.get_running_loop().create_future()
            self._spawn(self._standby_try(self._round))
        await asyncio.shield(self._round)

    async def _standby_try(self, round_: asyncio.Future[None]) -> None:
        """After STANDBY_POLL, one statement tries, for the first standby of each lane, the lane's slots
        this session does not hold, taking at most one (module doc)."""
        await asyncio.sleep(STANDBY_POLL)
        wanting: dict[int, SharedSlot] = {}
        for place in self._standbys:
            if place.slot is None and not place.released:
                wanting.setdefault(place.lane_id, place)
        lanes = list(wanting.values())
        try:
            if lanes:
                row = self.execute(queries.STANDBY_TRY, {
                    "lanes": [p.lane_id for p in lanes], "slots": [p.slots for p in lanes],
                    "held": [lane_id << 32 | slot for lane_id, slot in self.held]})
                for place, slot in zip(lanes, row["taken"] if row else (), strict=True):
                    if slot is not None:
                        place.took(slot)
        except psycopg.Error:
            return  # gone (execute said so to every place), or refused: the round's waiters find out below
        finally:
            self._standbys = [p for p in self._standbys if p.slot is None and not p.released]
            if not round_.done():
                round_.set_result(None)

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class SharedSlot:
    """A slot loop's place on a shared session: the ``SlotSession`` it uses (pglane.session)."""

    def __init__(self, session: SharedSession, lane_id: int, slots: int) -> None:
        self.session = session
        self.lane_id = lane_id
        self.slots = slots
        self.slot: int | None = None  # the slot this place holds; only took() and release() change it
        self.channel = f"pglane_{lane_id}"
        self.news = False
        self.released = False
        self.session_polls = True  # the session's poll wakes this place (SharedSession._poll), not the slot loop
        self._woken = False  # a wake-up (or news) came since the last wait returned, or forget_wakes()
        self._waiting: asyncio.Future[bool] | None = None

    @property
    def closed(self) -> bool:
        return self.released or self.session.lost.done()

    def execute(self, query: LiteralString | sql.Composed, params: Any = None,
                within: float | None = None) -> dict[str, Any] | None:
        if self.released:
            raise psycopg.OperationalError("this slot's place on the shared session was released")
        return self.session.execute(query, params, within)

    # ----- the slot ----------------------------------------------------------------------------------

    def try_take(self) -> bool:
        """Take any free slot of the lane that the session does not hold already; False when none is free."""
        assert self.slot is None, "a place takes one slot once"
        for slot in range(1, self.slots + 1):
            if (self.lane_id, slot) in self.session.held:
                continue
            row = self.execute(queries.TRY_SLOT, (self.lane_id, slot))
            if row is not None and row["pg_try_advisory_lock"]:
                self.took(slot)
                return True
        return False

    def took(self, slot: int) -> None:
        self.slot = slot
        self.session.held.add((self.lane_id, slot))

    async def wait_take(self, stopping: Callable[[], bool], reread: Callable[[], None], recheck: float) -> bool:
        """Wait as a standby until the session's try takes a slot for this place (module doc: every
        STANDBY_POLL); the lane is read again on its news and every ``recheck`` seconds, and then every slot
        tried at once. False if asked to stop first (seen within STANDBY_POLL)."""
        due = time.monotonic() + recheck
        while not stopping():
            if self.news or time.monotonic() >= due:
                reread()
                due = time.monotonic() + recheck
                if self.try_take():
                    return True
            await self.session.standby_round(self)
            if self.slot is not None:
                return True
        return False

    def release(self) -> None:
        """Give the slot back with a checked unlock (the session lives on for its other places)."""
        if self.released:
            return
        try:
            if self.slot is not None and not self.session.lost.done():
                self.session.held.discard((self.lane_id, self.slot))
                row = self.execute(queries.RELEASE_SLOT, (self.lane_id, self.slot))
                if row is None or not row["pg_advisory_unlock"]:
                    log.warning("slot %s of lane id %s was not held at release", self.slot, self.lane_id)
        except psycopg.Error:
            pass  # the session is gone, and with it the lock
        finally:
            self.slot = None
            self.released = True
            self.session.leave(self)

    # ----- wake-ups ----------------------------------------------------------------------------------

    def listen(self) -> None:
        self.session.listen(self)

    def woken(self, news: bool) -> None:
        """A wake-up (``news``: the lane's settings changed) came on the lane's channel: ends a wait."""
        self._woken = True
        if news:
            self.news = True
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(True)

    def forget_wakes(self) -> None:
        """A claim found a job: the wake-ups that came before are answered (pglane.slot's rule)."""
        self._woken = False

    async def wait_for_wake(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a wake-up on the lane; True if one came (or the session is
        gone: the claim that follows finds it so)."""
        if not self._woken and not self.closed:
            await self._wait(timeout)
        woken, self._woken = self._woken or self.closed, False
        return woken

    async def wait_for_news(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lane's news, passing over plain wake-ups (pglane.slot)."""
        deadline = time.monotonic() + timeout
        while not self.news:
            if self.closed:
                raise psycopg.OperationalError("the shared session is gone")
            left = deadline - time.monotonic()
            if left <= 0 or not await self._wait(left):
                return self.news
            self._woken = False
        return True

    async def _wait(self, timeout: float) -> bool:
        """Until woken (True), or the timeout or an interrupt (False)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()
        self._waiting = ready
        timer = loop.call_later(timeout, lambda: None if ready.done() else ready.set_result(False))
        try:
            return await ready
        finally:
            self._waiting = None
            timer.cancel()

    def interrupt(self) -> None:
        if self._waiting is not None and not self._waiting.done():
            self._waiting.set_result(False)

    async def watch(self) -> None:
        """During a call: raises OperationalError once the session is found gone (module doc)."""
        await self.session.watched()


class Sessions:
    """A process's K shared sessions, opened as slot loops need them (``place``) and again once gone."""

    def __init__(self, dsn: str, size: int, name: str, poll_interval: float, liveness: float = LIVENESS,
                 after_poll: Callable[[SharedSession], None] | None = None) -> None:
        self.dsn = dsn
        self.size = size
        self.name = name  # the worker's, in each session's application_name
        self.liveness = liveness
        self.poll_interval = poll_interval
        self.after_poll = after_poll
        self._sessions: list[SharedSession | None] = [None] * size
        self._opening = [asyncio.Lock() for _ in range(size)]  # one opening of each session at a time
        self._coming: list[list[int]] = [[] for _ in range(size)]  # lane ids of the places being made on each

    async def place(self, lane_id: int, slots: int) -> SharedSlot:
        """A place for a slot of lane ``lane_id``: on the session with the fewest places of that lane, then
        the fewest places (a gone session counts as none); opened first if need be, in a thread (the other
        slots run on meanwhile), once for all the slots that need it (OperationalError when the database
        cannot be reached)."""
        def load(i: int) -> tuple[int, int]:
            s, coming = self._sessions[i], self._coming[i]
            lanes = [] if s is None or s.lost.done() else [p.lane_id for p in s.places]
            return (lanes.count(lane_id) + coming.count(lane_id), len(lanes) + len(coming))

        i = min(range(self.size), key=load)
        self._coming[i].append(lane_id)  # counted as placed there while the session opens
        try:
            async with self._opening[i]:
                session = self._sessions[i]
                if session is None or session.lost.done():
                    conn = await asyncio.to_thread(open_connection, self.dsn, f"pglane {self.name} session {i + 1}")
                    session = self._sessions[i] = SharedSession(conn, self.poll_interval, self.liveness,
                                                                self.after_poll)
            return session.place(lane_id, slots)
        finally:
            self._coming[i].remove(lane_id)

    def close(self) -> None:
        for session in self._sessions:
            if session is not None:
                session.gone("the worker stopped")
