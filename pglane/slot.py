"""The slot: one dedicated, direct database session that holds a lane's slot lock, listens for its
wake-ups and runs its claims.

Owns the lock connection. Invariants:
- the session holds at most one slot, taken once (advisory locks stack; a second take would need a
  second release) and released with a checked unlock;
- claims run on this session, because pglane.claim() refuses any session that holds no slot;
- the lock key is (lane id, slot number), never a hash of the name; the channel is ``pglane_<id>``.
How it breaks: when the connection drops (server restart, pg_terminate_backend, network cut) the
server frees the slot while this process may still be inside a call. Keepalives bound how long a dead
peer goes unnoticed; every use of the connection raises ``psycopg.OperationalError`` after that, and
the worker then reconnects and must take a slot again before it claims. The connection must be
direct: a transaction-mode pooler (PgBouncer) would hand the lock and the LISTEN to other clients.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from . import queries

log = logging.getLogger("pglane.worker")

# Dead-peer detection on the lock connection (libpq keepalives; ignored on Unix sockets):
# a silent host is noticed after about idle + interval * count = 10 + 5 * 3 = 25 seconds.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 25000,
}
STANDBY_WAIT = "500ms"  # one blocking wait for a busy slot; bounded so that a stop request is seen


class LockSession:
    def __init__(self, conn: psycopg.AsyncConnection[dict[str, Any]], lane_id: int, slots: int) -> None:
        self.conn = conn
        self.lane_id = lane_id
        self.slots = slots
        self.slot: int | None = None  # the slot this session holds; only take()/release() change it
        self.channel = f"pglane_{lane_id}"

    @classmethod
    async def connect(cls, dsn: str, lane_id: int, slots: int, name: str) -> LockSession:
        conn = await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, row_factory=dict_row, application_name=f"pglane {name}"[:63], **KEEPALIVES
        )
        return cls(conn, lane_id, slots)

    async def try_take(self) -> bool:
        """Take any free slot at once; False when all are held by others."""
        assert self.slot is None, "a session takes one slot once"
        for slot in range(1, self.slots + 1):
            row = await (await self.conn.execute(queries.TRY_SLOT, (self.lane_id, slot))).fetchone()
            if row is not None and row["pg_try_advisory_lock"]:
                self.slot = slot
                return True
        return False

    async def wait_take(self, stopping: asyncio.Event) -> bool:
        """Wait as a standby until a slot frees, then take it; False if asked to stop first.
        Blocks on one slot at a time (rotating) so that a one-slot lane is taken over the moment
        its holder's session ends."""
        await self.conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(STANDBY_WAIT)))
        try:
            turn = 0
            while not stopping.is_set():
                slot = turn % self.slots + 1
                turn += 1
                try:
                    await self.conn.execute(queries.WAIT_SLOT, (self.lane_id, slot))
                except psycopg.errors.LockNotAvailable:
                    if self.slots > 1 and await self.try_take():
                        return True
                    continue
                self.slot = slot
                return True
            return False
        finally:
            if not self.conn.closed:
                await self.conn.execute("RESET lock_timeout")

    async def listen(self) -> None:
        await self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))

    async def wait_for_wake(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a NOTIFY on the lane; True if one came."""
        async for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            return True
        return False

    async def watch(self) -> None:
        """Consume notifications until the connection fails; raises OperationalError then.
        Run during a call, so that a lost lock connection is noticed at once."""
        async for _ in self.conn.notifies():
            pass

    async def release(self) -> None:
        """Give the slot back with a checked unlock, and close the session."""
        try:
            if self.slot is not None and not self.conn.closed:
                row = await (await self.conn.execute(queries.RELEASE_SLOT, (self.lane_id, self.slot))).fetchone()
                if row is None or not row["pg_advisory_unlock"]:
                    log.warning("slot %s of lane id %s was not held at release", self.slot, self.lane_id)
        except psycopg.Error:
            pass  # the session is gone, and with it the lock
        finally:
            self.slot = None
            await self.conn.close()
