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

How it breaks: through a transaction-mode pooler, LISTEN does not follow the session; waits then
end by their backup poll (the job's state is always read). A listening session that cannot connect
leaves the waiters polling; it retries with backoff while anyone waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
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


def conninfo_of(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> str:
    """The connection string of the server session ``conn`` has, password included (libpq's own
    record of the options it used), for the listening session to reach the same database as."""
    options = {o.keyword.decode(): o.val.decode() for o in conn.pgconn.info if o.val is not None and o.val != b""}
    options["application_name"] = APPLICATION_NAME
    return make_conninfo(**options)


def _job_id(payload: str) -> int | None:
    return int(payload) if payload.isdigit() else None


# --- threads -----------------------------------------------------------------------------------------

@dataclass
class _Session:
    """One opening of the listening session; ``ready`` is set once its LISTEN has committed, or once
    it failed (``up`` then says which)."""

    ready: threading.Event = field(default_factory=threading.Event)
    up: bool = False
    backend_pid: int | None = None


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
            if self._session is None:
                self._session = _Session()
                threading.Thread(target=self._run, args=(self._session,), name="pglane-waiters",
                                 daemon=True).start()
            return event, self._session

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
            except psycopg.Error as exc:
                session.up = False
                session.ready.set()  # waiters go on by polling
                self._wake(None)
                if self._idle(session):
                    return
                log.warning("pglane: the waiters' listening session failed (%s); waits poll until it is back",
                            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                threading.Event().wait(_BACKOFF[min(failures, len(_BACKOFF) - 1)])
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
        self._event, session = listener.add(job_id)
        session.ready.wait(READY_TIMEOUT)

    def pause(self, seconds: float) -> bool:
        fired = self._event.wait(seconds)
        self._event.clear()  # before the state is read again: a later notification is never lost
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
        if self._task is None or self._task.done():
            self.ready = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="pglane-waiters")
        return event

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
            except psycopg.Error as exc:
                self.backend_pid = None
                self.ready.set()
                self._wake(None)
                if not self._waiters:
                    return
                log.warning("pglane: the waiters' listening session failed (%s); waits poll until it is back",
                            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                await asyncio.sleep(_BACKOFF[min(failures, len(_BACKOFF) - 1)])
                failures += 1
                self.ready = asyncio.Event()


_async_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncListener]] = (
    weakref.WeakKeyDictionary())


class AsyncWaiter:
    """`Waiter` for asyncio."""

    def __init__(self, listener: AsyncListener, job_id: int) -> None:
        self._listener, self._job_id = listener, job_id
        self._event = listener.add(job_id)

    async def started(self) -> AsyncWaiter:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listener.ready.wait(), READY_TIMEOUT)
        return self

    async def pause(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(self._event.wait(), seconds)
            fired = True
        except TimeoutError:
            fired = False
        self._event.clear()
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
