"""The waiters' listener: one listening session per process (per event loop, for asyncio) and
database, shared by every `wait` in it, handing each completion notification to the waiters of that
job.

Owns: the LISTEN on ``pglane_done`` (sql/wait.sql's trigger sends an awaited job's id there when it
finishes), the table of job id -> waiters, and the listening session's life: opened by the first
waiter, re-opened after it is lost while anyone waits, closed a moment after the last waiter left.

Invariants: a waiter registers before the session is known to listen and reads the job's state only
after (`listen` returns once LISTEN has committed, or once the session is known to be down), so a
completion is either seen by that read or notified. Whenever the session is lost and listens again,
every waiter is woken to read again: notifications sent meanwhile are gone. A notification is only a
hint: a waiter always reads the job's state itself, and reads it every poll interval anyway.

Notifications are untrusted input: any login may NOTIFY pglane_done with any payload (pg_notify is
granted to PUBLIC), so a payload is a job id only if it is 1 to 19 ASCII digits; anything else is
ignored and counted (`ignored_notifications`). A notification for a job nobody here waits for wakes
nobody, and a waiter woken again and again (a flood of its job's id) reads its job at most
``WAKE_BURST`` times at once and then once per ``WAKE_GAP`` (`_ReadBudget`). The listening session
is kept up whatever fails in it: any exception ends that opening, not the listener, which opens
again with backoff while anyone waits; a listener found dead anyway (its thread or task ended) is
started again by the next waiter's registration or pause. Waiters meanwhile go on by their poll.

How it breaks: through a transaction-mode pooler, LISTEN does not follow the session; waits then
end by their backup poll (the job's state is always read). A listening session that cannot connect
leaves the waiters polling; it retries with backoff while anyone waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from . import queries

log = logging.getLogger(__name__)

APPLICATION_NAME = "pglane waiters"  # the listening session's application_name (pg_stat_activity)
READY_TIMEOUT = 10.0  # how long a waiter waits for the session to listen before it relies on polls alone
LINGER = 2.0  # the session stays open this long after the last waiter left, for the next one
_BACKOFF = (0.1, 0.5, 1.0, 2.0, 5.0)
MAX_ID_DIGITS = 19  # a bigint has at most 19 digits: a longer payload is no job id
WAKE_GAP = 0.5  # a waiter woken by notifications reads its job at most once per WAKE_GAP ...
WAKE_BURST = 2  # ... after its first WAKE_BURST reads (a completion, and a reconnection's wake-up)


def conninfo_of(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """The connection string of the server session ``conn`` has, password included (libpq's own
    record of the options it used), for the listening session to reach the same database as."""
    options = {o.keyword.decode(): o.val.decode() for o in conn.pgconn.info if o.val is not None and o.val != b""}
    options["application_name"] = APPLICATION_NAME
    return make_conninfo(**options)


class _Counters:
    """What this process's waiters did, for tests and diagnostics: ``ignored``, notifications on
    pglane_done whose payload was no job id; ``reads``, reads of a job's state after a wait's first
    (each pause ends in one). Guarded by ``lock`` (listener threads and waiting threads count)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ignored = 0
        self.reads = 0

    def count(self, ignored: int = 0, reads: int = 0) -> None:
        with self.lock:
            self.ignored += ignored
            self.reads += reads


_counters = _Counters()


def ignored_notifications() -> int:
    """How many pglane_done notifications this process ignored because their payload was no job id."""
    return _counters.ignored


def waiter_reads() -> int:
    """How many times this process's waits read their job's state again after their first read."""
    return _counters.reads


def _job_id(payload: str) -> int | None:
    """The job id a pglane_done payload names, or None (counted) for anything else: 1 to MAX_ID_DIGITS
    ASCII digits only ('²'.isdigit() is true, and int() refuses it)."""
    if 0 < len(payload) <= MAX_ID_DIGITS and payload.isascii() and payload.isdigit():
        return int(payload)
    _counters.count(ignored=1)
    return None


class _ReadBudget:
    """How soon a woken waiter may read its job: a token bucket of WAKE_BURST reads, refilled by one per
    WAKE_GAP. However many notifications come, a waiter reads at most WAKE_BURST + t / WAKE_GAP times in t
    seconds (its poll aside); a genuine completion is read at once unless a flood came first."""

    def __init__(self) -> None:
        self.tokens = float(WAKE_BURST)  # may go below 0: a read owed, paid by the hold `take` returns
        self.at = time.monotonic()

    def take(self) -> float:
        """Take one read; the seconds to hold the waiter before it reads."""
        now = time.monotonic()
        self.tokens = min(float(WAKE_BURST), self.tokens + (now - self.at) / WAKE_GAP) - 1
        self.at = now
        return max(0.0, -self.tokens * WAKE_GAP)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


# --- threads -----------------------------------------------------------------------------------------

@dataclass
class _Session:
    """One opening of the listening session; ``ready`` is set once its LISTEN has committed, or once
    it failed (``up`` then says which)."""

    ready: threading.Event = field(default_factory=threading.Event)
    up: bool = False
    backend_pid: int | None = None
    thread: threading.Thread | None = None


class Listener:
    """The listening session of one database for this process's threads."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self._lock = threading.Lock()
        self._waiters: dict[int, set[threading.Event]] = {}  # guarded by _lock
        self._session: _Session | None = None  # the current thread's; None when no thread runs (_lock)

    def add(self, job_id: int) -> tuple[threading.Event, _Session]:
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(event)
            return event, self._running()

    def revive(self) -> None:
        """Start the listening thread again if it died (see _running)."""
        with self._lock:
            if self._waiters:
                self._running()

    def _running(self) -> _Session:
        """The current session, its thread started anew if none runs or the one recorded died: _run
        catches every Exception, so only something stranger ends it without _idle, and the waiters
        registered meanwhile poll until this runs (at the next registration or pause). Under _lock."""
        session = self._session
        if session is None or session.thread is None or not session.thread.is_alive():
            if session is not None:
                log.warning("pglane: the waiters' listening thread had died; starting it again")
            session = self._session = _Session()
            session.thread = threading.Thread(target=self._run, args=(session,), name="pglane-waiters", daemon=True)
            session.thread.start()
        return session

    def remove(self, job_id: int, event: threading.Event) -> None:
        with self._lock:
            events = self._waiters.get(job_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[job_id]

    def _wake(self, job_id: int | None) -> None:
        """Wake the waiters of ``job_id``, or every waiter (None)."""
        with self._lock:
            groups = list(self._waiters.values()) if job_id is None else [self._waiters.get(job_id, set())]
            for events in groups:
                for event in events:
                    event.set()

    def _idle(self, session: _Session) -> bool:
        """True, and the thread's end recorded, when nobody waits; else False."""
        with self._lock:
            if self._waiters:
                return False
            if self._session is session:
                self._session = None
            return True

    def _run(self, session: _Session) -> None:
        failures = 0
        while True:
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    conn.execute(queries.LISTEN_DONE)
                    session.backend_pid, session.up, failures = conn.info.backend_pid, True, 0
                    session.ready.set()
                    self._wake(None)  # anything sent before this LISTEN is read by the waiters again
                    idle_for = 0.0
                    while True:
                        for note in conn.notifies(timeout=0.5):
                            self._wake(_job_id(note.payload))
                        idle_for = idle_for + 0.5 if not self._waiters else 0.0
                        if idle_for >= LINGER and self._idle(session):
                            return
            except Exception as exc:  # whatever it was (a lost session, a bug): open again, with backoff
                session.up = False
                session.ready.set()  # waiters go on by polling
                self._wake(None)
                if self._idle(session):
                    return
                log.warning("pglane: the waiters' listening session failed (%s); waits poll until it is back",
                            _first_line(exc))
                time.sleep(_BACKOFF[min(failures, len(_BACKOFF) - 1)])
                failures += 1
                session.ready.clear()


_listeners: dict[str, Listener] = {}
_listeners_lock = threading.Lock()
_pool_conninfo: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _listener(conninfo: str) -> Listener:
    with _listeners_lock:
        found = _listeners.get(conninfo)
        if found is None:
            found = _listeners[conninfo] = Listener(conninfo)
        return found


class Waiter:
    """One wait's registration: `pause` ends at the job's notification or after ``seconds``."""

    def __init__(self, listener: Listener, job_id: int) -> None:
        self._listener, self._job_id = listener, job_id
        self._budget = _ReadBudget()
        self._event, session = listener.add(job_id)
        session.ready.wait(READY_TIMEOUT)

    def pause(self, seconds: float) -> bool:
        self._listener.revive()
        until = time.monotonic() + seconds
        fired = self._event.wait(seconds)
        if fired and (hold := min(self._budget.take(), until - time.monotonic())) > 0:
            time.sleep(hold)  # a flood of this job's id: the notifications meanwhile fold into one read
        self._event.clear()  # before the state is read again: a later notification is never lost
        _counters.count(reads=1)
        return fired

    def close(self) -> None:
        self._listener.remove(self._job_id, self._event)


def listen(target: psycopg.Connection[Any] | ConnectionPool[Any], job_id: int) -> Waiter:
    """Register a waiter for ``job_id`` on the listening session of ``target``'s database."""
    if isinstance(target, ConnectionPool):
        conninfo = _pool_conninfo.get(target)
        if conninfo is None:
            with target.connection() as conn:
                conninfo = _pool_conninfo[target] = conninfo_of(conn)
    else:
        conninfo = conninfo_of(target)
    return Waiter(_listener(conninfo), job_id)


def listening_pids() -> list[int]:
    """The server pids of this process's listening sessions for threads (for tests and diagnostics)."""
    with _listeners_lock:
        sessions = [listener._session for listener in _listeners.values()]
    return [s.backend_pid for s in sessions if s is not None and s.up and s.backend_pid is not None]


# --- asyncio -----------------------------------------------------------------------------------------

class AsyncListener:
    """The listening session of one database for one event loop's tasks."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        self.backend_pid: int | None = None

    def add(self, job_id: int) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        self.revive()
        return event

    def revive(self) -> None:
        """Start the listening task if none runs (it ended idle, or died: _run catches every Exception,
        so only cancellation or something stranger ends it otherwise)."""
        if self._waiters and (self._task is None or self._task.done()):
            self.ready = asyncio.Event()
            self.backend_pid = None
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pglane-waiters")

    def remove(self, job_id: int, event: asyncio.Event) -> None:
        events = self._waiters.get(job_id)
        if events is not None:
            events.discard(event)
            if not events:
                del self._waiters[job_id]

    def _wake(self, job_id: int | None) -> None:
        groups = list(self._waiters.values()) if job_id is None else [self._waiters.get(job_id, set())]
        for events in groups:
            for event in events:
                event.set()

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True) as conn:
                    await conn.execute(queries.LISTEN_DONE)
                    self.backend_pid, failures = conn.info.backend_pid, 0
                    self.ready.set()
                    self._wake(None)
                    idle_for = 0.0
                    while True:
                        async for note in conn.notifies(timeout=0.5):
                            self._wake(_job_id(note.payload))
                        idle_for = idle_for + 0.5 if not self._waiters else 0.0
                        if idle_for >= LINGER and not self._waiters:
                            self.backend_pid = None
                            return
            except Exception as exc:  # whatever it was (a lost session, a bug): open again, with backoff
                self.backend_pid = None
                self.ready.set()
                self._wake(None)
                if not self._waiters:
                    return
                log.warning("pglane: the waiters' listening session failed (%s); waits poll until it is back",
                            _first_line(exc))
                await asyncio.sleep(_BACKOFF[min(failures, len(_BACKOFF) - 1)])
                failures += 1
                self.ready = asyncio.Event()


_async_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncListener]] = (
    weakref.WeakKeyDictionary())


class AsyncWaiter:
    """`Waiter` for asyncio."""

    def __init__(self, listener: AsyncListener, job_id: int) -> None:
        self._listener, self._job_id = listener, job_id
        self._budget = _ReadBudget()
        self._event = listener.add(job_id)

    async def started(self) -> AsyncWaiter:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listener.ready.wait(), READY_TIMEOUT)
        return self

    async def pause(self, seconds: float) -> bool:
        self._listener.revive()
        until = time.monotonic() + seconds
        try:
            await asyncio.wait_for(self._event.wait(), seconds)
            fired = True
        except TimeoutError:
            fired = False
        if fired and (hold := min(self._budget.take(), until - time.monotonic())) > 0:
            await asyncio.sleep(hold)  # as Waiter.pause
        self._event.clear()
        _counters.count(reads=1)
        return fired

    def close(self) -> None:
        self._listener.remove(self._job_id, self._event)


async def alisten(target: psycopg.AsyncConnection[Any] | AsyncConnectionPool[Any], job_id: int) -> AsyncWaiter:
    """Register a waiter for ``job_id`` on this event loop's listening session of ``target``'s database."""
    if isinstance(target, AsyncConnectionPool):
        conninfo = _pool_conninfo.get(target)
        if conninfo is None:
            async with target.connection() as conn:
                conninfo = _pool_conninfo[target] = conninfo_of(conn)
    else:
        conninfo = conninfo_of(target)
    per_loop = _async_listeners.setdefault(asyncio.get_running_loop(), {})
    listener = per_loop.get(conninfo)
    if listener is None:
        listener = per_loop[conninfo] = AsyncListener(conninfo)
    return await AsyncWaiter(listener, job_id).started()


def async_listening_pids() -> list[int]:
    """The server pids of the running event loop's listening sessions."""
    per_loop = _async_listeners.get(asyncio.get_running_loop(), {})
    return [listener.backend_pid for listener in per_loop.values() if listener.backend_pid is not None]
