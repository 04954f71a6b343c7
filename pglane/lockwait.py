"""An operator's command never hangs silently behind another session's lock.

A command runs with ``lock_timeout`` set to a bounded wait (``--lock-wait``, 10 s by default). While it
runs, a watcher on a second connection notes which sessions block it (``pg_blocking_pids``, which any
role may call; a session's role and application are visible to every role). If the wait runs out,
the command fails with one line naming those sessions and what to do, and nothing was changed (the
statement's transaction is rolled back). The watcher connects only once the command has waited a
moment, so a command that meets no lock opens no second connection.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

from .errors import LockWaitTimeout

BLOCKERS: LiteralString = (
    "SELECT a.pid, a.usename::text AS role, a.application_name FROM pg_catalog.pg_stat_activity a"
    " WHERE a.pid = ANY(pg_catalog.pg_blocking_pids(%s)) ORDER BY a.pid"
)
SET_LOCK_TIMEOUT: LiteralString = "SELECT set_config('lock_timeout', %s, false)"
WATCH_AFTER = 0.5  # seconds a command runs before its blockers are watched
WATCH_EVERY = 0.2


class _Watcher(threading.Thread):
    """Notes the sessions blocking backend ``pid`` until stopped (the last non-empty answer is kept)."""

    def __init__(self, dsn: str, pid: int) -> None:
        super().__init__(name="pglane lock watcher", daemon=True)
        self.dsn, self.pid = dsn, pid
        self.stopped = threading.Event()
        self.blockers: list[dict[str, Any]] = []

    def run(self) -> None:
        if self.stopped.wait(WATCH_AFTER):
            return
        try:
            with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row,
                                 application_name="pglane lock watcher") as conn:
                while not self.stopped.is_set():
                    found = conn.execute(BLOCKERS, (self.pid,)).fetchall()
                    if found:
                        self.blockers = found
                    self.stopped.wait(WATCH_EVERY)
        except psycopg.Error:
            return  # the watcher only explains; the command's own outcome stands


def describe(blockers: list[dict[str, Any]]) -> str:
    if not blockers:
        return "another session (it ended its transaction before it could be named)"
    return ", ".join(f"session {b['pid']} (role {b['role'] or '?'}"
                     + (f", application {b['application_name']!r}" if b["application_name"] else "") + ")"
                     for b in blockers)


@contextmanager
def bounded(conn: Any, dsn: str, seconds: float) -> Iterator[None]:
    """Run the block with lock waits of at most ``seconds``; LockWaitTimeout names who blocked it."""
    conn.execute(SET_LOCK_TIMEOUT, (f"{int(seconds * 1000)}ms",))
    watcher = _Watcher(dsn, conn.info.backend_pid)
    watcher.start()
    try:
        yield
    except psycopg.errors.LockNotAvailable:
        blockers = list(watcher.blockers)
        pids = " ".join(str(b["pid"]) for b in blockers) or "PID"
        raise LockWaitTimeout(
            f"waited {seconds:g}s for a lock held by {describe(blockers)}, whose transaction has not ended: "
            f"nothing was changed. Have it commit or roll back (or end it: SELECT pg_terminate_backend({pids})), "
            "then run this again; --lock-wait sets how long to wait") from None
    finally:
        watcher.stopped.set()
        watcher.join()
