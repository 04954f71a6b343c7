"""A worker's database session: one direct connection that holds slot locks, under a deadline.

Two kinds build on it: a dedicated one that holds one slot (pglane.slot, ``LockSession``), and one that
holds the slots of many lanes for a process run with ``--sessions K`` (pglane.shared, ``SharedSession``).
``SlotSession`` is what a slot loop sees of either (pglane.slotloop): the slot loop, the call, the outbox
and the lane use nothing else.

Invariants:
- every statement runs under a deadline (``liveness`` seconds, 10 by default), past which the ``Fuse``
  cuts the socket: a silent network (packets dropped, nothing closed, which TCP itself may not notice
  for minutes) fails the statement with OperationalError instead of hanging the worker;
- a liveness question left open (sent, its answer not read: ``unanswered``) is read first by the next
  statement, under that statement's deadline;
- the connection must be direct: a transaction-mode pooler (PgBouncer) would hand the locks and the
  LISTEN to other clients (pglane.pooler refuses one at the worker's start).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, LiteralString, Protocol

import psycopg
from psycopg import pq, sql
from psycopg.rows import dict_row
from psycopg.types.string import TextLoader

log = logging.getLogger("pglane.worker")

LIVENESS = 10.0  # seconds a lock session may stay silent before it is taken for lost (--liveness)
# Dead-peer detection by the kernel beside it (libpq keepalives; ignored on Unix sockets): a silent
# host is noticed after about idle + interval * count = 5 + 2 * 3 = 11 seconds, unacknowledged data
# after 10 s. They cannot see a peer that acknowledges and never answers (a hung proxy or server):
# the liveness checks do.
KEEPALIVES: dict[str, Any] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10000,
}
SESSIONS = 4  # --sessions: a process with more slots shares this many sessions (docs/design.md, "Shared sessions")
SETTINGS = "settings"  # the payload of pglane.set_lane's NOTIFY (sql/lanes.sql); '' is a plain wake-up


class Fuse(threading.Thread):
    """Cuts a session whose statement has not returned by its deadline: it shuts the socket down, so that
    libpq's blocked read returns and the statement fails with OperationalError. Arming costs one
    attribute assignment per statement (atomic under the GIL); the thread looks every TICK."""

    TICK = 0.25

    def __init__(self, fd: int) -> None:
        super().__init__(name="pglane-fuse", daemon=True)
        self.fd = fd
        self.deadline: float | None = None  # time.monotonic(); set by the event loop only
        self.blown = False
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.TICK):
            deadline = self.deadline
            if deadline is not None and time.monotonic() > deadline and not self.blown:
                self.blown = True
                log.error("the lock session was silent past its deadline; cutting it")
                with contextlib.suppress(OSError):
                    cut = socket.socket(fileno=os.dup(self.fd))
                    cut.shutdown(socket.SHUT_RDWR)
                    cut.close()


def open_connection(dsn: str, application_name: str) -> psycopg.Connection[dict[str, Any]]:
    """A direct autocommit connection for a worker's session, with the kernel's dead-peer detection."""
    conn = psycopg.Connection.connect(dsn, autocommit=True, row_factory=dict_row,
                                      application_name=application_name[:63], **KEEPALIVES)
    # A claim's payload and token arrive as text: the worker decodes the payload itself, so that one
    # no decoder accepts fails its attempt rather than the fetch (pglane.job.Claim.from_row).
    for type_name in ("jsonb", "uuid"):
        conn.adapters.register_loader(type_name, TextLoader)
    return conn


class Session:
    """One connection and its deadline: the statements of one slot (LockSession) or of many (SharedSession)."""

    def __init__(self, conn: psycopg.Connection[dict[str, Any]], liveness: float = LIVENESS) -> None:
        self.conn = conn
        self.liveness = liveness
        self._fuse = Fuse(conn.fileno())
        self._fuse.start()
        self.unanswered = False  # a liveness question whose answer is still to be read (module doc)
        # Every statement runs on this one cursor (its row is returned, never the cursor): a cursor made per
        # statement (conn.execute) copies the connection's adapters each time, 17 % of the worker's own
        # instructions per job (python -m bench --only clients, bench/README.md).
        self._cursor = conn.cursor()

    @property
    def closed(self) -> bool:
        """The session is gone: nothing more can run on it."""
        return bool(self.conn.closed)

    def execute(self, query: LiteralString | sql.Composed, params: Any = None,
                within: float | None = None) -> dict[str, Any] | None:
        """Run one statement on the session under the liveness deadline (or a shorter one, ``within``
        seconds); its first row (None if none)."""
        deadline = time.monotonic() + (self.liveness if within is None else min(within, self.liveness))
        self._fuse.deadline = deadline
        try:
            if self.unanswered:  # first the answer to the question a finished call left open
                self._read_answer(deadline)
            cur = self._cursor.execute(query, params)
            # Whether it returned rows, from the result's status: cur.description builds a Column per field
            # (15 for a claim) at every statement: 30 % of the worker's own instructions per job
            # (python -m bench --only clients, bench/README.md).
            res = cur.pgresult
            return cur.fetchone() if res is not None and res.status == pq.ExecStatus.TUPLES_OK else None
        finally:
            self._fuse.deadline = None

    def _read_answer(self, deadline: float) -> None:
        """Read the answer to an open liveness question by ``deadline``, waiting in select() (which lets
        other threads run: libpq's own blocking read would hold the GIL, and so stop the fuse and the
        watchdog); OperationalError when none comes."""
        pgconn = self.conn.pgconn
        while True:
            pgconn.consume_input()
            if self.answered():
                return
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.conn.fileno()], [], [], left)[0]:
                self.conn.close()
                raise psycopg.OperationalError("the lock session was silent: no answer to a liveness check")

    def ask(self) -> None:
        """Send a liveness question (SELECT 1) without waiting for its answer (``answered`` reads it)."""
        pgconn = self.conn.pgconn
        pgconn.send_query(b"SELECT 1")
        pgconn.flush()
        self.unanswered = True

    def answered(self) -> bool:
        """Whether the open liveness question's answer has arrived (read from what consume_input took in);
        if so it is read and the question closed."""
        pgconn = self.conn.pgconn
        if pgconn.is_busy():
            return False
        while pgconn.get_result() is not None:  # buffered: returns at once
            pass
        self.unanswered = False
        return True

    def close(self) -> None:
        self._fuse.done.set()
        self.conn.close()


class SlotSession(Protocol):
    """What a slot loop uses of the session that holds its slot (module doc): a LockSession of its own,
    or a SharedSlot, its place on a session shared with other slots."""

    slot: int | None  # the slot held; None before the take and after the release
    slots: int  # the lane's slot count as last read (pglane.lane sets it)
    news: bool  # the lane's settings changed (a NOTIFY 'settings'); the lane's reload clears it
    session_polls: bool  # the session polls the lane for due jobs; else the slot loop does, each poll interval

    @property
    def closed(self) -> bool: ...

    def execute(self, query: LiteralString | sql.Composed, params: Any = None,
                within: float | None = None) -> dict[str, Any] | None: ...

    def try_take(self) -> bool: ...

    async def wait_take(self, stopping: Callable[[], bool], reread: Callable[[], None], recheck: float) -> bool: ...

    def listen(self) -> None: ...

    def forget_wakes(self) -> None: ...

    async def wait_for_wake(self, timeout: float) -> bool: ...

    async def wait_for_news(self, timeout: float) -> bool: ...

    def interrupt(self) -> None: ...

    async def watch(self) -> None: ...

    def release(self) -> None: ...
