"""Waiting for a job's result (pglane.wait, pglane enqueue --wait) against a real server: woken by the
completion's notification, answered by the backup poll when a notification is lost, one listening
session for a thousand waiters, timeouts that say where the job is, failed, cancelled and pruned
jobs, a pool as well as a connection, and what a completion costs where nobody waits."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

import pglane
from pglane import queries, waiting
from tests.conftest import Ledger, Workers, claimed, console, take_slot, terminate, wait_until

Conn = psycopg.Connection[dict[str, Any]]
FOREVER = 600.0  # a backup poll that never comes within a test: only a notification can end the wait


class Waiting:
    """A wait running in a thread of its own: its result or its error once it ends."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self.started = time.monotonic()
        self.elapsed = 0.0

        def target() -> None:
            try:
                self.value = call()
            except BaseException as exc:  # handed to the test
                self.error = exc
            finally:
                self.elapsed = time.monotonic() - self.started
                self.ended.set()

        threading.Thread(target=target, daemon=True).start()

    def outcome(self, timeout: float = 30.0) -> Any:
        assert self.ended.wait(timeout), "the wait did not end"
        if self.error is not None:
            raise self.error
        return self.value


def complete(session: Conn, lane: str, result: Any) -> int:
    """Claim the lane's next job on ``session`` (which holds a slot) and complete it; its id."""
    job = claimed(session, lane)
    session.execute(queries.COMPLETE, (job["attempt_id"], json.dumps(result), job["token"]))
    return int(job["job_id"])


def awaited(conn: Conn, job_id: int) -> bool:
    row = conn.execute("SELECT awaited FROM pglane.jobs WHERE id = %s", (job_id,)).fetchone()
    return bool(row and row["awaited"])


@pytest.fixture
def worker_session(session: Callable[..., Conn], lane: str) -> Conn:
    s = session()
    take_slot(s, lane)
    return s


@pytest.fixture(autouse=True)
def _listeners_close() -> Iterator[None]:
    yield
    wait_until(lambda: not waiting.listening_pids(), 10, "the listening sessions to close after the test")


def test_a_finished_job_returns_its_stored_result_at_once(conn: Conn, lane: str, worker_session: Conn) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    complete(worker_session, lane, {"answer": 42})
    assert pglane.wait(conn, job, timeout=FOREVER, poll_interval=FOREVER) == {"answer": 42}


def test_the_waiter_is_woken_by_the_notification_not_the_poll(conn: Conn, lane: str, worker_session: Conn) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=FOREVER, poll_interval=FOREVER))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark the job")
    complete(worker_session, lane, {"answer": 1})
    assert w.outcome() == {"answer": 1}  # the poll would have come after FOREVER


def test_a_lost_notification_is_answered_by_the_backup_poll(conn: Conn, lane: str, worker_session: Conn) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=FOREVER, poll_interval=0.5))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark the job")
    conn.execute("ALTER TABLE pglane.jobs DISABLE TRIGGER jobs_awaited_finished")  # the notification is lost
    complete(worker_session, lane, {"answer": 2})
    assert w.outcome() == {"answer": 2}


def test_a_terminated_listening_session_costs_no_result(conn: Conn, lane: str, worker_session: Conn) -> None:
    """The waiters' session is ended by the server; the job finishes meanwhile; the waiter still gets
    its result (woken when the session listens again, or by its poll), and a new session listens."""
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=FOREVER, poll_interval=2.0))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark the job")
    [pid] = waiting.listening_pids()
    terminate(conn, pid)
    complete(worker_session, lane, {"answer": 3})
    assert w.outcome() == {"answer": 3}
    second = pglane.enqueue(conn, lane, {"q": 2})
    w2 = Waiting(lambda: pglane.wait(conn, second, timeout=FOREVER, poll_interval=FOREVER))
    wait_until(lambda: awaited(conn, second), 10, "the second waiter to mark its job")
    assert waiting.listening_pids() and waiting.listening_pids() != [pid]
    complete(worker_session, lane, {"answer": 4})
    assert w2.outcome() == {"answer": 4}


def test_a_timeout_says_the_job_is_queued_and_where(conn: Conn, lane: str) -> None:
    pglane.enqueue(conn, lane, {"q": "ahead"})
    job = pglane.enqueue(conn, lane, {"q": 1})
    with pytest.raises(pglane.WaitTimeout, match="still queued at position 2") as caught:
        pglane.wait(conn, job, timeout=0.2)
    assert caught.value.status == "queued" and caught.value.queue_position == 2
    assert pglane.job_status(conn, job)["status"] == "queued"  # the job goes on


def test_a_timeout_says_the_job_is_running_and_since_when(conn: Conn, lane: str, worker_session: Conn) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    claimed(worker_session, lane)
    started = pglane.job_status(conn, job)["started_at"]
    with pytest.raises(pglane.WaitTimeout, match=re.escape(f"still running since {started}")) as caught:
        pglane.wait(conn, job, timeout=0)
    assert caught.value.status == "running" and caught.value.started_at == started


def test_a_failed_job_raises_job_failed_with_the_reason_the_attempt_and_the_next_safe_action(
        conn: Conn, lane: str, worker_session: Conn) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=FOREVER, poll_interval=FOREVER))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark the job")
    attempt = claimed(worker_session, lane)
    worker_session.execute(queries.FAIL, (attempt["attempt_id"], "provider said 503", False, attempt["token"]))
    with pytest.raises(pglane.JobFailed) as caught:
        w.outcome()
    error = caught.value
    assert "provider said 503" in (error.last_error or "")
    assert error.attempt_id == attempt["attempt_id"] and error.attempt_number == 1
    assert error.next_safe_action is not None and f"pglane retry {job}" in error.next_safe_action
    assert "provider said 503" in str(error) and f"pglane retry {job}" in str(error)


def test_a_cancelled_job_raises_job_cancelled(conn: Conn, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=FOREVER, poll_interval=FOREVER))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark the job")
    pglane.cancel(conn, job)
    with pytest.raises(pglane.JobCancelled, match=f"pglane retry {job}"):
        w.outcome()


def test_a_pruned_job_says_it_was_pruned_and_an_unknown_one_says_unknown(
        conn: Conn, lane: str, worker_session: Conn) -> None:
    first = pglane.enqueue(conn, lane, {"q": 1})
    second = pglane.enqueue(conn, lane, {"q": 2})
    complete(worker_session, lane, {"answer": 1})
    complete(worker_session, lane, {"answer": 2})
    assert pglane.prune(conn, 0, batch=1) == 2
    for job in (first, second):
        with pytest.raises(pglane.JobPruned, match=f"job {job} finished and was pruned"):
            pglane.wait(conn, job, timeout=1)
    with pytest.raises(pglane.UnknownJob) as caught:
        pglane.wait(conn, second + 1000, timeout=1)
    assert not isinstance(caught.value, pglane.JobPruned)


def test_a_producer_waits_for_its_own_jobs_only(conn: Conn, dsn: str, lane: str, worker_session: Conn) -> None:
    for name in ("pglane_test_waiter_a", "pglane_test_waiter_b"):
        conn.execute(f"DO $$ BEGIN CREATE ROLE {name} NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute(f"GRANT pglane_producer TO {name}")
    with pglane.connect(dsn) as a, pglane.connect(dsn) as b:
        a.execute("SET ROLE pglane_test_waiter_a")
        b.execute("SET ROLE pglane_test_waiter_b")
        job = pglane.enqueue(a, lane, {"q": 1})
        with pytest.raises(pglane.UnknownJob):
            pglane.wait(b, job, timeout=0)
        assert not awaited(conn, job)  # another producer's wait marks nothing
        w = Waiting(lambda: pglane.wait(a, job, timeout=FOREVER, poll_interval=FOREVER))
        wait_until(lambda: awaited(conn, job), 10, "the producer's wait to mark its job")
        complete(worker_session, lane, {"answer": "mine"})
        assert w.outcome() == {"answer": "mine"}


def test_a_completion_where_nobody_waits_sends_no_notification(conn: Conn, session: Callable[..., Conn],
                                                               lane: str, worker_session: Conn) -> None:
    listener = session()
    listener.execute(queries.LISTEN_DONE)
    pglane.enqueue(conn, lane, {"q": 1})
    pglane.enqueue(conn, lane, {"q": 2})
    complete(worker_session, lane, {"answer": 1})
    waited = pglane.enqueue(conn, lane, {"q": 3})
    w = Waiting(lambda: pglane.wait(conn, waited, timeout=FOREVER, poll_interval=FOREVER))
    wait_until(lambda: awaited(conn, waited), 10, "the waiter to mark the job")
    complete(worker_session, lane, {"answer": 2})  # unawaited: no notification
    complete(worker_session, lane, {"answer": 3})  # awaited: one
    w.outcome()
    notes = [n.payload for n in listener.notifies(timeout=1.0, stop_after=2)]
    assert notes == [str(waited)]


def test_a_pool_serves_waits_and_every_call(dsn: str, conn: Conn, lane: str, worker_session: Conn) -> None:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:  # plain connections: tuples, no autocommit
        job = pglane.enqueue(pool, lane, {"q": "pooled"}, key="k1")
        assert pglane.enqueue(pool, lane, {"q": "pooled"}, key="k1") == job
        assert pglane.job_status(pool, job)["status"] == "queued"
        assert [j["job_id"] for j in pglane.jobs(pool, lane=lane)] == [job]
        w = Waiting(lambda: pglane.wait(pool, job, timeout=FOREVER, poll_interval=FOREVER))
        wait_until(lambda: awaited(conn, job), 10, "the pooled waiter to mark the job")
        complete(worker_session, lane, {"answer": "pooled"})
        assert w.outcome() == {"answer": "pooled"}
        assert pglane.result(pool, job) == {"answer": "pooled"}


def backends(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                       " AND backend_type = 'client backend'").fetchone()
    assert row is not None
    return int(row["n"])


def test_a_thousand_waiting_threads_share_one_listening_session(dsn: str, conn: Conn, lane: str,
                                                                 worker_session: Conn) -> None:
    n = 1000
    ids = [int(r["id"]) for r in conn.execute(
        "INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', jsonb_build_object('n', g)"
        " FROM generate_series(1, %s) g RETURNING id", (n,)).fetchall()]
    before = backends(conn)
    with ConnectionPool(dsn, min_size=1, max_size=4, open=True, timeout=120) as pool:
        waits = [Waiting(lambda job=job: pglane.wait(pool, job, timeout=FOREVER, poll_interval=FOREVER))  # type: ignore[misc]
                 for job in ids]
        wait_until(lambda: conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE awaited").fetchone()["n"] == n,  # type: ignore[index]
                   120, "every waiter to mark its job")
        during = backends(conn)
        assert during - before <= 4 + 1, f"{during - before} more sessions for {n} waiters"
        assert len(waiting.listening_pids()) == 1
        for _ in range(n):
            complete(worker_session, lane, {"ok": True})
        results = [w.outcome(120) for w in waits]
    assert results == [{"ok": True}] * n


# --- the command line ---------------------------------------------------------------------------------

cli = console  # the real console script


def test_cli_enqueue_wait_prints_the_result_and_a_repeated_key_returns_it_without_a_second_call(
        dsn: str, conn: Conn, lane: str, workers: Workers, ledger: Ledger) -> None:
    workers.start(lane)
    payload = json.dumps({"result": {"summary": "report 7"}, "sleep": 0.2})
    first = cli(dsn, "enqueue", lane, payload, "--key", "report-7", "--wait", "--timeout", "30")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {"summary": "report 7"}
    again = cli(dsn, "enqueue", lane, payload, "--key", "report-7", "--wait", "--timeout", "30")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"summary": "report 7"}
    assert len(ledger.calls()) == 1  # the repeated request was answered from the stored result


def test_cli_enqueue_wait_on_a_failed_job_says_why_and_what_to_do(
        dsn: str, conn: Conn, lane: str, workers: Workers) -> None:
    workers.start(lane)
    done = cli(dsn, "enqueue", lane, json.dumps({"fail": "the provider refused"}), "--wait", "--timeout", "30")
    assert done.returncode == 1
    assert "the provider refused" in done.stderr and "pglane retry" in done.stderr
    assert done.stdout == ""


def test_cli_enqueue_wait_timeout_says_where_the_job_is(dsn: str, conn: Conn, lane: str) -> None:
    done = cli(dsn, "enqueue", lane, "{}", "--wait", "--timeout", "0.3")
    assert done.returncode == 4
    assert "still queued at position 1" in done.stderr
