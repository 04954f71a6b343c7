"""Hardening, second round (#30), the database's part: a job that can never fit its lane's rate wedges
nothing, whatever route brought it (a retry, a re-queue, a race of `lane set` with a producer); a
change of settings does not wait behind a producer's open transaction, and a lowered rate is atomic
with enqueues; an INSERT of a job never fails because the NOTIFY queue is full (a stranger can fill
it); a producer's plain INSERT may set cost."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from pytest_postgresql import factories

import pglane
from pglane.errors import CostOverRate
from tests.conftest import PG_CTL, _apply_migrations, claim, claimed, console, take_slot, wait_until


def rate_lane(conn: Any, rate: str = "5/s", **settings: Any) -> str:
    pglane.create_lane(conn, "c", job_timeout=20, rate=rate, **settings)
    return "c"


def test_a_cancelled_job_retried_after_the_rate_was_lowered_is_refused(conn: Any) -> None:
    lane = rate_lane(conn)
    job = pglane.enqueue(conn, lane, {}, cost=5)
    pglane.cancel(conn, job)
    pglane.set_lane(conn, lane, rate="2/s")  # nothing queued costs more: allowed
    with pytest.raises(CostOverRate, match="could never start"):
        pglane.retry(conn, job)
    assert pglane.job_status(conn, job)["status"] == "cancelled"


def test_a_requeued_job_that_no_longer_fits_is_passed_over_and_says_what_to_do(conn: Any) -> None:
    lane = rate_lane(conn, max_attempts=3)
    costly = pglane.enqueue(conn, lane, {}, cost=5)
    take_slot(conn, lane)
    attempt = claimed(conn, lane)["attempt_id"]
    pglane.set_lane(conn, lane, rate="2/s", retry_backoff=0)  # the job runs: not queued, so allowed
    conn.execute("SELECT pglane.fail(%s, 'provider hiccup')", (attempt,))
    assert pglane.job_status(conn, costly)["status"] == "queued"
    behind = pglane.enqueue(conn, lane, {})
    # Once the first start (cost 5) has left the 1 s window, the job behind it starts.
    row = wait_until(lambda: claim(conn, lane), 10, "a claim past the costly job")
    assert row["job_id"] == behind, "the costly job wedged the lane"
    status = pglane.job_status(conn, costly)
    assert status["next_safe_action"].startswith("change it: job") and "pglane cancel" in status["next_safe_action"]
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '1 hour' WHERE id = %s", (costly,))
    assert pglane.job_status(conn, costly)["waiting_for_worker"] is False


def blocked_call(conn: Any, dsn: str, call: Callable[[Any], object], waits_in: str) -> Callable[[], object]:
    """Run ``call`` on a connection of its own in a thread until it waits for a lock in a statement that
    names ``waits_in``; returns what finishes it: its outcome (a value or the exception it raised)."""
    outcome: list[object] = []

    def run() -> None:
        with pglane.connect(dsn) as other:
            try:
                outcome.append(call(other))
            except BaseException as exc:
                outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                    " AND query LIKE %s", (f"%{waits_in}%",)).fetchone()["n"] == 1, 10,
               f"{waits_in} to wait for a lock")

    def finished() -> object:
        thread.join(10)
        assert len(outcome) == 1, "the blocked call did not finish"
        return outcome[0]

    return finished


def test_lowering_the_rate_waits_for_a_producers_insert_and_then_refuses(dsn: str, conn: Any, session: Any) -> None:
    lane = rate_lane(conn)
    producer = session(autocommit=False)
    job = pglane.enqueue(producer, lane, {}, cost=5)  # not committed yet
    finished = blocked_call(conn, dsn, lambda c: pglane.set_lane(c, lane, rate="2/s"), "set_lane")
    producer.commit()
    assert isinstance(finished(), CostOverRate)
    assert pglane.job_status(conn, job)["status"] == "queued"


def test_an_enqueue_racing_a_lowered_rate_reads_the_new_rate(dsn: str, conn: Any, session: Any) -> None:
    lane = rate_lane(conn)
    operator = session(autocommit=False)
    pglane.set_lane(operator, lane, rate="2/s")  # not committed yet
    finished = blocked_call(conn, dsn, lambda c: pglane.enqueue(c, lane, {}, cost=5), "enqueue")
    operator.commit()
    assert isinstance(finished(), CostOverRate)
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0


def test_a_settings_change_does_not_wait_behind_a_producers_open_transaction(conn: Any, session: Any) -> None:
    lane = rate_lane(conn)
    producer = session(autocommit=False)
    pglane.enqueue(producer, lane, {})  # holds the lane row FOR KEY SHARE until it commits
    operator = session()
    operator.execute("SET lock_timeout = '2s'")
    assert "slots 1 -> 3" in pglane.set_lane(operator, lane, slots=3, rate="10/s")
    producer.rollback()


def test_a_producers_plain_insert_may_set_cost(conn: Any) -> None:
    if not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("acting as a producer needs a superuser test connection to switch roles")
    lane = rate_lane(conn)
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_test_cost NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    conn.execute("GRANT pglane_producer TO pglane_test_cost")
    conn.execute("SET ROLE pglane_test_cost")
    try:
        conn.execute("INSERT INTO pglane.jobs (lane, payload, cost) VALUES (%s, '{}', 3)", (lane,))
    finally:
        conn.execute("RESET ROLE")
    assert conn.execute("SELECT cost FROM pglane.jobs").fetchone() == {"cost": 3}


# --- a full NOTIFY queue -------------------------------------------------------------------------------
# PostgreSQL 17's max_notify_queue_pages makes the queue small enough to fill (64 pages of 8 kB).

def _server_major() -> int:
    if PG_CTL is None:
        return 0
    from pglane import pgbin

    out = subprocess.run([str(pgbin.find_bindir() / f"postgres{pgbin.EXE}"), "--version"], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split()[-1].split(".")[0])


small_queue_proc = factories.postgresql_proc(
    executable=PG_CTL or "pg_ctl", port=None, dbname="pglane_small_queue", load=[_apply_migrations],
    postgres_options="-c max_notify_queue_pages=64")
small_queue_db = factories.postgresql("small_queue_proc")


@pytest.fixture
def small_queue(request: pytest.FixtureRequest) -> Iterator[str]:
    major = _server_major()
    if major < 17:
        pytest.skip("filling the NOTIFY queue needs PostgreSQL 17+ (max_notify_queue_pages) started by the suite"
                    f" (found {major or 'PGLANE_TEST_DSN'})")
    db = request.getfixturevalue("small_queue_db")
    info = db.info
    yield make_conninfo(host=info.host, port=info.port, user=info.user, dbname=info.dbname,
                        password=info.password or None)


def fill_notify_queue(dsn: str) -> psycopg.Connection[Any]:
    """A stranger's attack: a listener that stays in a transaction (the queue's tail stays with it), and a
    flood of 8 kB notifications until PostgreSQL refuses more. Returns the stuck listener."""
    stuck = psycopg.connect(dsn, autocommit=True)
    stuck.execute("LISTEN flood")
    stuck.execute("BEGIN")
    stuck.execute("SELECT 1")
    with psycopg.connect(dsn, autocommit=True) as flooder:
        for _ in range(10_000):
            try:
                flooder.execute("SELECT pg_notify('flood', repeat('x', 7900))")
            except psycopg.errors.ProgramLimitExceeded:
                break
        else:
            pytest.fail("the NOTIFY queue never filled")
        usage = flooder.execute("SELECT pg_notification_queue_usage()").fetchone()
        assert usage is not None and usage[0] > 0.9
    return stuck


def test_a_full_notify_queue_never_fails_an_enqueue_or_a_completion(small_queue: str) -> None:
    with pglane.connect(small_queue) as opened:
        conn: Any = opened
        conn.autocommit = True
        pglane.create_lane(conn, "brain", job_timeout=20)
        awaited = pglane.enqueue(conn, "brain", {"n": 0})
        stuck = fill_notify_queue(small_queue)
        try:
            first = pglane.enqueue(conn, "brain", {"n": 1})  # refused with "too many notifications" before
            conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', '{\"n\": 2}')")
            assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 3
            # The workers' poll finds them; a completion of an awaited job (it notifies) is stored too.
            conn.execute("SELECT * FROM pglane.await_job(%s)", (awaited,))
            take_slot(conn, "brain")
            row = claimed(conn, "brain")
            assert row["job_id"] == awaited
            assert conn.execute("SELECT pglane.complete(%s, '{}') AS ok", (row["attempt_id"],)).fetchone()["ok"]
            assert claimed(conn, "brain")["job_id"] == first
            skipped = conn.execute("SELECT pglane.notifications_skipped() AS n").fetchone()["n"]
            assert skipped >= 3, "the skipped wake-ups were not counted"
        finally:
            stuck.close()
        # Once the listener is gone the queue drains and wake-ups flow again (no counting).
        wait_until(lambda: conn.execute("SELECT pg_notification_queue_usage() AS u").fetchone()["u"] < 0.5, 20,
                   "the queue to drain")
        pglane.enqueue(conn, "brain", {"n": 3})
        assert conn.execute("SELECT pglane.notifications_skipped() AS n").fetchone()["n"] == skipped


@pytest.mark.parametrize("command", [("lane", "set", "c", "--rate", "1/s"), ("lane", "delete", "c", "--force"),
                                     ("cancel", "JOB")])
def test_an_operator_command_behind_another_sessions_lock_stops_and_names_it(
        dsn: str, conn: Any, session: Any, command: tuple[str, ...]) -> None:
    lane = rate_lane(conn)
    job = pglane.enqueue(conn, lane, {})
    holder = session(autocommit=False)
    holder.execute("SET application_name = 'forgotten transaction'")
    pglane.enqueue(holder, lane, {})  # the lane row FOR KEY SHARE, until it ends
    holder.execute("SELECT 1 FROM pglane.jobs WHERE id = %s FOR UPDATE", (job,))
    done = console(dsn, *[str(job) if part == "JOB" else part for part in command], "--lock-wait", "1s")
    assert done.returncode == 1, done
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert f"session {holder.info.backend_pid}" in line and "'forgotten transaction'" in line, line
    assert "nothing was changed" in line
    holder.rollback()
    assert pglane.job_status(conn, job)["status"] == "queued"
    assert conn.execute("SELECT rate_limit FROM pglane.lanes WHERE name = %s", (lane,)).fetchone() == {"rate_limit": 5}
