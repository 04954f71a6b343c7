"""tests/netproxy.py against the real PostgreSQL: every mode, with psycopg clients and a real worker.

A fault that must *not* produce something (no answer, no EOF) is checked over a short window (QUIET);
everything that must happen is polled for with a deadline, and no test can hang: a query that the proxy
holds runs in a thread or through libpq's non-blocking calls, and the proxy's reset at teardown ends it.
"""

from __future__ import annotations

import hashlib
import random
import select
import socket
import string
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import psycopg
import pytest
from psycopg import pq

import pglane
from tests.conftest import Ledger, Workers, wait_session_gone, wait_until
from tests.netproxy import NetProxy

QUIET = 0.3  # how long something that must not happen is watched for
PROMPT = 3.0  # how soon something that must happen has to
T = TypeVar("T")
Client = psycopg.Connection[tuple[Any, ...]]


@pytest.fixture
def proxy(dsn: str) -> Iterator[NetProxy]:
    with NetProxy.for_dsn(dsn) as p:
        yield p


@pytest.fixture
def through(proxy: NetProxy, dsn: str) -> str:
    return proxy.dsn_through(dsn)


@pytest.fixture
def client() -> Iterator[Callable[[str], Client]]:
    """Open psycopg connections (autocommit), closed at teardown."""
    opened: list[Client] = []

    def open_client(dsn: str) -> Client:
        c = psycopg.connect(dsn, autocommit=True, connect_timeout=5)
        opened.append(c)
        return c

    yield open_client
    for c in opened:
        c.close()


class Call(threading.Thread, Generic[T]):
    """Run ``fn`` in a thread, keeping its result or its error: a call the proxy may hold forever."""

    def __init__(self, fn: Callable[[], T]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: T | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc

    def outcome(self, timeout: float = PROMPT) -> T | None:
        """Wait for the call to end, then return its result or raise its error."""
        self.join(timeout)
        assert not self.is_alive(), f"the call did not return within {timeout}s"
        if self.error is not None:
            raise self.error
        return self.result


def readable(c: Client, timeout: float) -> bool:
    """Whether the client's socket has something (data, EOF or an error) within ``timeout`` seconds."""
    return bool(select.select([c.pgconn.socket], [], [], timeout)[0])


def send(c: Client, sql: str) -> None:
    """Send a query without waiting for its answer (libpq's non-blocking API)."""
    c.pgconn.send_query(sql.encode())
    assert c.pgconn.flush() == 0


def answer(c: Client, timeout: float = PROMPT) -> str:
    """The single value answering the query send() sent; fails if it does not come within ``timeout``."""
    pgconn = c.pgconn
    deadline = time.monotonic() + timeout
    while True:
        pgconn.consume_input()
        if not pgconn.is_busy():
            break
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no answer within {timeout}s"
        select.select([pgconn.socket], [], [], remaining)
    result = pgconn.get_result()
    assert result is not None and result.status == pq.ExecStatus.TUPLES_OK, result and result.error_message
    value = result.get_value(0, 0)
    while pgconn.get_result() is not None:
        pass
    assert value is not None
    return value.decode()


def upstream_port(c: Client) -> int:
    """The client port the server sees for this session: the proxy connection's upstream_port."""
    row = c.execute("SELECT inet_client_port()").fetchone()
    assert row is not None
    return int(row[0])


def advisory_locks(conn: Any, pid: int) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted",
                       (pid,)).fetchone()
    return int(row["n"])


def test_forward_carries_queries_whole_both_ways_and_counts(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    assert c.execute("SELECT 1").fetchone() == (1,)
    [connection] = proxy.connections
    assert proxy.connection(upstream_port=upstream_port(c)) is connection
    assert proxy.accepted == 1 and proxy.refused == 0
    # Megabytes each way, in many chunks and partial writes, arrive whole and in order.
    text = "".join(random.choices(string.ascii_letters, k=3_000_000))
    row = c.execute("SELECT md5(%s), repeat(%s, 300000)", (text, "0123456789")).fetchone()
    assert row == (hashlib.md5(text.encode()).hexdigest(), "0123456789" * 300000)
    assert proxy.bytes_to_server > 3_000_000 and proxy.bytes_to_client > 3_000_000
    assert (connection.bytes_to_server, connection.bytes_to_client) == (proxy.bytes_to_server, proxy.bytes_to_client)


def test_connections_are_proxied_at_once_and_each_takes_a_mode_of_its_own(
        proxy: NetProxy, through: str, client: Callable[[str], Client], conn: Any) -> None:
    conn.execute("SELECT pg_advisory_lock(1)")
    waiting, other, third = client(through), client(through), client(through)
    send(waiting, "SELECT pg_advisory_lock(1)")  # blocks in the server, its connection open
    assert other.execute("SELECT 2").fetchone() == (2,)
    conn.execute("SELECT pg_advisory_unlock(1)")
    assert answer(waiting) == ""  # pg_advisory_lock() returns void
    assert len(proxy.connections) == 3 and proxy.accepted == 3

    proxy.connection(upstream_port=upstream_port(other)).blackhole()
    send(other, "SELECT 2")
    assert third.execute("SELECT 3").fetchone() == (3,)
    assert not readable(other, QUIET)
    proxy.forward()  # the proxy's mode replaces every connection's own
    assert answer(other) == "2"


def test_a_blackhole_is_silent_and_forward_resumes_the_held_query(
        proxy: NetProxy, through: str, client: Callable[[str], Client], conn: Any) -> None:
    c = client(through)
    pid = c.info.backend_pid
    c.execute("SELECT 'before'")
    proxy.blackhole()
    sent, received = proxy.bytes_to_server, proxy.bytes_to_client
    send(c, "SELECT 42")
    # No answer, no EOF, no error: the socket stays quiet and open, and the server never saw the query.
    assert not readable(c, QUIET)
    assert c.pgconn.status == pq.ConnStatus.OK and not c.closed
    assert (proxy.bytes_to_server, proxy.bytes_to_client) == (sent, received)
    row = conn.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    assert row["query"] == "SELECT 'before'"
    proxy.forward()
    assert answer(c) == "42"
    assert c.execute("SELECT 43").fetchone() == (43,)


def test_a_query_with_a_client_deadline_times_out_in_a_blackhole_and_completes_once_it_heals(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    proxy.blackhole()
    call = Call(lambda: c.execute("SELECT 1").fetchone())
    call.join(QUIET)
    assert call.is_alive(), "the query returned through a blackhole"
    proxy.forward()
    assert call.outcome() == (1,)


def test_megabytes_sent_into_a_blackhole_arrive_whole_after_it(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    proxy.blackhole()
    text = "".join(random.choices(string.ascii_letters, k=8_000_000))  # more than the kernels buffer
    call = Call(lambda: c.execute("SELECT md5(%s)", (text,)).fetchone())
    call.join(QUIET)
    assert call.is_alive()
    proxy.forward()
    assert call.outcome(10) == (hashlib.md5(text.encode()).hexdigest(),)


def test_one_way_to_server_holds_the_queries_only(
        proxy: NetProxy, through: str, client: Callable[[str], Client], conn: Any) -> None:
    c = client(through)
    pid = c.info.backend_pid
    proxy.one_way("to_server")
    sent = proxy.bytes_to_server
    send(c, "SELECT pg_advisory_lock(7)")
    assert not readable(c, QUIET)
    assert advisory_locks(conn, pid) == 0 and proxy.bytes_to_server == sent
    proxy.forward()
    assert answer(c) == ""
    assert advisory_locks(conn, pid) == 1
    # The other direction flows: what the server sends on its own arrives (here: its session ending).
    proxy.one_way("to_server")
    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert readable(c, PROMPT)
    with pytest.raises(psycopg.OperationalError):
        c.execute("SELECT 1")


def test_one_way_to_client_lets_the_server_run_the_queries_unheard(
        proxy: NetProxy, through: str, client: Callable[[str], Client], conn: Any) -> None:
    c = client(through)
    pid = c.info.backend_pid
    proxy.one_way("to_client")
    received = proxy.bytes_to_client
    send(c, "SELECT pg_advisory_lock(7)")
    wait_until(lambda: advisory_locks(conn, pid) == 1, PROMPT, "the server to run the query")
    assert not readable(c, QUIET)
    assert proxy.bytes_to_client == received
    proxy.forward()
    assert answer(c) == ""


def test_one_way_takes_a_direction() -> None:
    with NetProxy("127.0.0.1", 9) as p, pytest.raises(ValueError, match="to_server"):
        p.one_way("sideways")  # type: ignore[arg-type]


def test_latency_delays_each_direction_and_keeps_the_order(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    proxy.latency(0.15)
    started = time.monotonic()
    assert c.execute("SELECT 1").fetchone() == (1,)
    assert time.monotonic() - started >= 0.3  # there and back
    numbers = c.execute("SELECT string_agg(i::text, ',') FROM generate_series(1, 200000) i").fetchone()
    assert numbers == (",".join(map(str, range(1, 200001))),)
    proxy.latency(60)
    send(c, "SELECT 2")
    proxy.forward()  # what waits goes at once
    assert answer(c) == "2"


def test_reset_sends_both_sides_a_reset_at_once(
        proxy: NetProxy, through: str, client: Callable[[str], Client], conn: Any) -> None:
    c = client(through)
    pid = c.info.backend_pid
    proxy.reset()
    assert proxy.connections == []
    started = time.monotonic()
    assert readable(c, PROMPT)
    with pytest.raises(psycopg.OperationalError):
        c.execute("SELECT 1")
    assert time.monotonic() - started < PROMPT
    wait_session_gone(conn, pid)  # the server heard it too
    assert client(through).execute("SELECT 1").fetchone() == (1,)  # later connections are proxied


def test_reset_ends_a_query_held_in_a_blackhole_promptly(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    proxy.blackhole()
    call = Call(lambda: c.execute("SELECT 1").fetchone())
    call.join(QUIET)
    assert call.is_alive()
    proxy.reset()
    with pytest.raises(psycopg.OperationalError):
        call.outcome()


def test_refuse_new_resets_or_leaves_hanging_new_connections_only(
        proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    old = client(through)
    proxy.refuse_new()
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        client(through)
    assert time.monotonic() - started < PROMPT
    assert old.execute("SELECT 1").fetchone() == (1,)
    assert (proxy.accepted, proxy.refused) == (2, 1)

    proxy.refuse_new(hang=True)
    call = Call(lambda: client(through))
    call.join(QUIET)
    assert call.is_alive(), "a connection got through"
    proxy.reset()  # ends the hanging connection (and the old one)
    with pytest.raises(psycopg.OperationalError):
        call.outcome()

    proxy.refuse_new(False)
    assert client(through).execute("SELECT 1").fetchone() == (1,)
    assert (proxy.accepted, proxy.refused) == (4, 2)


def test_a_unix_socket_target(postgresql_proc: Any, dsn: str, client: Callable[[str], Client]) -> None:
    socket_dir = getattr(postgresql_proc, "unixsocketdir", None)
    if not socket_dir or not Path(socket_dir, f".s.PGSQL.{postgresql_proc.port}").exists():
        pytest.skip("the server has no Unix socket here")
    with NetProxy(str(socket_dir), postgresql_proc.port) as proxy:
        c = client(proxy.dsn_through(dsn))
        assert c.execute("SELECT inet_client_port()").fetchone() == (None,)  # the server sees a Unix socket
        [connection] = proxy.connections
        assert connection.upstream_port is None and connection.client_port is not None
        proxy.blackhole()
        send(c, "SELECT 5")
        assert not readable(c, QUIET)
        proxy.forward()
        assert answer(c) == "5"
        proxy.reset()
        with pytest.raises(psycopg.OperationalError):
            c.execute("SELECT 1")


def test_a_target_that_refuses_resets_the_client(client: Callable[[str], Client], dsn: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]  # nothing listens there once closed
    with NetProxy("127.0.0.1", free_port) as proxy:
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            client(proxy.dsn_through(dsn))
        assert time.monotonic() - started < PROMPT and proxy.connections == []


def test_close_ends_everything(proxy: NetProxy, through: str, client: Callable[[str], Client]) -> None:
    c = client(through)
    proxy.close()
    with pytest.raises(psycopg.OperationalError):
        c.execute("SELECT 1")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=PROMPT).close()
    proxy.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        proxy.blackhole()


def test_a_worker_process_runs_jobs_through_the_proxy(
        proxy: NetProxy, through: str, conn: Any, lane: str, ledger: Ledger, tmp_path: Path) -> None:
    workers = Workers(through, ledger, tmp_path)
    try:
        workers.start(lane)
        job = pglane.enqueue(conn, lane, {})
        wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 20, "the job to run")
        assert ledger.calls() == [job]
        sessions = conn.execute("SELECT client_port FROM pg_stat_activity "
                                "WHERE application_name LIKE 'pglane%' AND datname = current_database()").fetchall()
        ports = [r["client_port"] for r in sessions]
        assert ports and all(proxy.connection(upstream_port=p) for p in ports)  # every session of the worker
    finally:
        workers.stop_all()
