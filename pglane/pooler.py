"""Refuse a transaction-mode pooler before the worker takes a slot (README "The lock connection").

Owns the probe that tells, by behaviour and never by configuration, whether the worker's DSN gives it a
session of its own. A worker's slot is a session advisory lock and its wake-ups a LISTEN: both belong to
the server session. A transaction-mode pooler (PgBouncer ``pool_mode = transaction``, and its kind) gives a
client a server session for one transaction at a time and hands it to other clients in between, so the
lock and the LISTEN would be held by a session that other clients use: the one-slot promise would silently
not hold. The worker therefore refuses to start (``PoolerDetected``, a ConfigurationError: exit 2).

The probe opens two client connections, A and B, through the DSN and interleaves autocommit statements,
each its own transaction: A, B, then (A, B) for some rounds, then A. Every statement reports the server
session that ran it (``pg_backend_pid()`` and the postmaster's start time, so that two servers behind one
DSN are told apart) and a session setting (``pglane.probe``) that each client set to a random token in its
first statement. A session of its own means, in every statement: A always on one server session, B always
on one, the two not the same, and each still seeing its own token. A transaction pooler breaks that at the
first chance it gets:
- idle, it reuses the server session released last (PgBouncer's default, LIFO): B's first statement runs
  on A's session (same pid, and B sees A's token);
- idle with round-robin reuse (``server_round_robin``), A's next statement lands on another session;
- busy, a session A released goes to other clients (at once, to a waiting one), so A's next statement
  lands on another session; for A to stay put, the session it released must come back to the top of
  the pool at exactly its next request, having been skipped by B's request in between, in every round.
  With 24 rounds that chance is negligible however the load is shaped (the tests run the probe many
  times against a busy pool).

The probe is cheap on a direct connection: libpq reports the backend pid the server sent at connection
start (BackendKeyData); on a direct connection it is the pid that runs the statements, while a pooler
sends a key of its own. When both A and B show their own backend's key, one round suffices (5 statements
in all); otherwise (a pooler or proxy is there) the probe runs its 24 rounds, about 50 short statements.

Invariants: the probe takes no lock and changes nothing but its own session setting (a transaction pooler
may leave that setting on a pooled session: harmless, nothing reads it); it never uses server-side
prepared statements (prepare_threshold=None), which a transaction pooler may not support; both
connections are closed before it returns. How it breaks: a pooler that kept every client on one server
session of its own through every round would pass, and then behaves as a session pool would.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

from .errors import DatabaseUnavailable, PoolerDetected, first_line

DIRECT_ROUNDS = 1  # both clients hold their own backend's key: a direct connection (or a transparent proxy)
POOLED_ROUNDS = 24  # a pooler sent its own key: session or transaction mode is told by behaviour alone

_MARK = "pglane.probe"
_SESSION: LiteralString = "SELECT pg_backend_pid() AS pid, pg_postmaster_start_time() AS started"
_FIRST: LiteralString = _SESSION + ", set_config(%s, %s, false) AS mark"  # each client's first statement
_AGAIN: LiteralString = _SESSION + ", current_setting(%s, true) AS mark"  # every later one

FIX = ("connect the worker directly to PostgreSQL, or through a session-mode pool (PgBouncer pool_mode = session); "
       "producers (enqueue, a plain INSERT) may keep using the transaction pool")


@dataclass(frozen=True)
class Seen:
    """What one statement reported: the server session that ran it and the probe setting it saw."""

    client: str  # "A" or "B"
    pid: int
    started: datetime
    mark: str | None

    @property
    def session(self) -> tuple[int, datetime]:
        return self.pid, self.started


@dataclass(frozen=True)
class Verdict:
    """The probe's finding: ``evidence`` is None when each client kept a server session of its own."""

    evidence: str | None
    statements: int
    pooled: bool  # a pooler or proxy sent its own connection key (a session-mode pool passes too)


def probe(dsn: str, *, rounds: int | None = None, connect_timeout: int = 10) -> Verdict:
    """Run the probe on ``dsn`` (module doc). ``rounds`` overrides the count chosen from the keys."""
    tokens = {"A": secrets.token_hex(8), "B": secrets.token_hex(8)}
    with _connect(dsn, connect_timeout) as a, _connect(dsn, connect_timeout) as b:
        clients = {"A": a, "B": b}
        first = {name: _run(clients[name], name, _FIRST, (_MARK, tokens[name])) for name in ("A", "B")}
        pooled = any(clients[name].info.backend_pid != first[name].pid for name in ("A", "B"))
        n = rounds if rounds is not None else POOLED_ROUNDS if pooled else DIRECT_ROUNDS
        seen = [first["A"], first["B"]]
        evidence = _broken(first, tokens, seen[-1])
        for name in ["A", "B"] * n + ["A"]:
            if evidence is not None:
                break
            seen.append(_run(clients[name], name, _AGAIN, (_MARK,)))
            evidence = _broken(first, tokens, seen[-1])
    return Verdict(evidence, len(seen), pooled)


def refuse_transaction_pooler(dsn: str) -> None:
    """Raise PoolerDetected, with the cause and the fix, unless the DSN gives each connection a session
    of its own (a direct connection, or a session-mode pool). Run by the worker before it takes a slot."""
    verdict = probe(dsn)
    if verdict.evidence is not None:
        raise PoolerDetected(
            "the worker's connection goes through a transaction-mode pooler (e.g. PgBouncer pool_mode = "
            f"transaction): {verdict.evidence}. A worker's slot is a session advisory lock and its wake-ups "
            "a LISTEN, which such a pooler hands to other clients between transactions, so the slot would "
            f"not be held; refusing to start. Fix: {FIX}"
        )


def _connect(dsn: str, connect_timeout: int) -> psycopg.Connection[dict[str, Any]]:
    try:
        return psycopg.connect(dsn, autocommit=True, row_factory=dict_row, prepare_threshold=None,
                               connect_timeout=connect_timeout, application_name="pglane pooler probe")
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to the database ({first_line(exc)}); check "
                                  "--dsn / PGLANE_DSN") from None


def _run(conn: psycopg.Connection[dict[str, Any]], client: str, query: LiteralString,
         params: tuple[str, ...]) -> Seen:
    row = conn.execute(query, params, prepare=False).fetchone()
    assert row is not None  # a SELECT without FROM returns one row
    return Seen(client, int(row["pid"]), row["started"], row["mark"])


def _broken(first: dict[str, Seen], tokens: dict[str, str], now: Seen) -> str | None:
    """Why ``now`` shows a session that is not the client's own, or None."""
    own, other = first[now.client], first["B" if now.client == "A" else "A"]
    if now.client == "B" and now.session == first["A"].session:
        return (f"two client connections were served by the same server session (pid {now.pid}) one after "
                "the other")
    if now.session != own.session:
        return (f"one client connection was moved from server session pid {own.pid} to pid {now.pid} between "
                "two transactions")
    if now.mark == tokens[other.client]:
        return f"one client connection saw the other's session setting (server session pid {now.pid})"
    if now.mark != tokens[now.client]:
        return f"a session setting made in one transaction was gone in the next (server session pid {now.pid})"
    return None
