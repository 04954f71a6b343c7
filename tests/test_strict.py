"""Strict lanes (takeover after_lease): the calls possibly in flight (running attempts, and lost ones
whose lease runs on) never exceed the lane's slots; the claim says how long to wait, the views say
why, and a person who knows the old worker is stopped may end the wait, on the record."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import pglane
from tests.conftest import Workers, claim, take_slot, terminate, wait_session_gone, wait_until


def lose_an_attempt(conn: Any, session: Any, lane: str) -> dict[str, Any]:
    """A worker session claims a job, then is cut (its backend ended); recovery marks the attempt lost."""
    pglane.enqueue(conn, lane, {"first": True})
    holder = session()
    take_slot(holder, lane)
    row = claim(holder, lane)
    assert row is not None
    pid = holder.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
    terminate(conn, pid)
    wait_session_gone(conn, pid)
    assert pglane.recover(conn, lane) == 1
    return row


def test_a_strict_lane_takes_no_job_while_a_lost_attempts_lease_runs_and_says_why(
    conn: Any, session: Any
) -> None:
    pglane.create_lane(conn, "strict", job_timeout=60, takeover="after_lease")
    lost = lose_an_attempt(conn, session, "strict")
    waiting = pglane.enqueue(conn, "strict", {"second": True})
    successor = session()
    take_slot(successor, "strict")
    row = successor.execute("SELECT * FROM pglane.claim_impl('strict', 'w')").fetchone()
    assert row["job_id"] is None
    lease_left = conn.execute("SELECT extract(epoch FROM lease_expires_at - now())::float8 AS s"
                              " FROM pglane.attempts WHERE id = %s", (lost["attempt_id"],)).fetchone()["s"]
    assert lease_left - 2 < row["wait_seconds"] <= lease_left + 0.5
    assert claim(successor, "strict") is None

    status = next(r for r in pglane.lane_status(conn) if r["lane"] == "strict")
    assert (status["takeover"], status["in_flight"]) == ("after_lease", 1)
    for action in (status["next_safe_action"], pglane.job_status(conn, waiting)["next_safe_action"]):
        assert f"the worker of lost attempt {lost['attempt_id']} may still be calling" in action
        assert f"pglane release-lease {lost['attempt_id']}" in action

    assert pglane.release_lease(conn, lost["attempt_id"]) is True
    recorded = conn.execute("SELECT lease_released_by, lease_released_at IS NOT NULL AS at"
                            " FROM pglane.attempts WHERE id = %s", (lost["attempt_id"],)).fetchone()
    assert recorded == {"lease_released_by": conn.info.user, "at": True}
    taken = claim(successor, "strict")
    assert taken is not None and taken["job_id"] == waiting
    with pytest.raises(pglane.InvalidTransition, match="no wait to end"):
        pglane.release_lease(conn, lost["attempt_id"])


def test_a_strict_lane_takes_the_next_job_once_the_lease_has_passed(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "strict", job_timeout=1, lease_timeout=2, takeover="after_lease")
    lost = lose_an_attempt(conn, session, "strict")
    waiting = pglane.enqueue(conn, "strict", {})
    successor = session()
    take_slot(successor, "strict")
    assert claim(successor, "strict") is None
    taken = wait_until(lambda: claim(successor, "strict"), 10, "the lease to pass")
    assert taken["job_id"] == waiting
    ends = conn.execute("SELECT lease_expires_at FROM pglane.attempts WHERE id = %s",
                        (lost["attempt_id"],)).fetchone()["lease_expires_at"]
    started = conn.execute("SELECT started_at FROM pglane.attempts WHERE id = %s",
                           (taken["attempt_id"],)).fetchone()["started_at"]
    assert started >= ends


def test_an_immediate_lane_takes_the_next_job_at_once(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "loose", job_timeout=60)
    lose_an_attempt(conn, session, "loose")
    waiting = pglane.enqueue(conn, "loose", {})
    successor = session()
    take_slot(successor, "loose")
    taken = claim(successor, "loose")
    assert taken is not None and taken["job_id"] == waiting


def test_two_slots_racing_never_count_the_same_room(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "strict2", slots=2, job_timeout=60, takeover="after_lease")
    lose_an_attempt(conn, session, "strict2")  # one of two places is held by a lost call
    for _ in range(4):
        pglane.enqueue(conn, "strict2", {})
    sessions = [session(), session()]
    for slot, s in enumerate(sessions, start=1):
        s.execute("SELECT pg_advisory_lock(id, %s) FROM pglane.lanes WHERE name = 'strict2'", (slot,))
    barrier, taken = threading.Barrier(2), []

    def race(s: Any) -> None:
        barrier.wait()
        taken.append(claim(s, "strict2"))

    threads = [threading.Thread(target=race, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(1 for t in taken if t is not None) == 1


def test_check_names_a_strict_lane_whose_lease_leaves_no_room_for_the_liveness_deadline(
    dsn: str, conn: Any
) -> None:
    from tests.test_cli import run

    pglane.create_lane(conn, "tight", job_timeout=60, lease_timeout=66, takeover="after_lease")
    pglane.create_lane(conn, "roomy", job_timeout=60, lease_timeout=100, takeover="after_lease")
    done = run("check", "--stop-grace", "100", dsn=dsn)
    assert done.returncode == 1
    assert "lane tight: S1 strict lane" in done.stdout and "lane roomy: ok" in done.stdout


def test_a_worker_on_a_strict_lane_waits_for_the_lease_not_the_poll(
    conn: Any, session: Any, workers: Workers
) -> None:
    pglane.create_lane(conn, "strict", job_timeout=1, lease_timeout=3, takeover="after_lease")
    lost = lose_an_attempt(conn, session, "strict")
    waiting = pglane.enqueue(conn, "strict", {})
    workers.start("strict", "tests.handlers:paid_call", "--poll-interval", "60", "--timeout", "1.5")
    wait_until(lambda: pglane.job_status(conn, waiting)["status"] == "done", 15, "the job after the lease")
    ends, started = conn.execute(
        "SELECT (SELECT lease_expires_at FROM pglane.attempts WHERE id = %s) AS ends,"
        " (SELECT started_at FROM pglane.attempts WHERE job_id = %s) AS started", (lost["attempt_id"], waiting)
    ).fetchone().values()
    assert ends <= started < ends + timedelta(seconds=2)  # woken by the lease's end, not the 60 s poll


def test_release_lease_is_an_operators_decision(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "strict", job_timeout=60, takeover="after_lease")
    lost = lose_an_attempt(conn, session, "strict")
    worker = session()
    worker.execute("SET ROLE pglane_worker")
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        worker.execute("SELECT pglane.release_lease(%s)", (lost["attempt_id"],))
    assert next(r for r in pglane.lane_status(conn) if r["lane"] == "strict")["in_flight"] == 1
