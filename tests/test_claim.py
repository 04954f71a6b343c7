"""Claim and completion in SQL: service order, SKIP LOCKED, the slot check, the guards, the gapless
seq. Sessions here take slot locks by hand, the way any worker in any language would."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

import pglane
from pglane import queries
from tests.conftest import claim as claim  # re-exported: tests.test_schema and tests.test_worker import it from here
from tests.conftest import lane_id, wait_until
from tests.conftest import take_slot as take_slot  # re-exported likewise


def waiting_on_lock(conn: Any, pid: int) -> None:
    """Return once backend ``pid`` is blocked on a heavyweight lock (row, advisory, ...)."""
    wait_until(lambda: conn.execute("SELECT wait_event_type = 'Lock' AS waiting FROM pg_stat_activity"
                                    " WHERE pid = %s", (pid,)).fetchone()["waiting"], what=f"backend {pid} to wait")


def test_claims_follow_the_order_jobs_were_queued(conn: Any, lane: str) -> None:
    ids = [pglane.enqueue(conn, lane, {"n": n}) for n in range(5)]
    take_slot(conn, lane)
    claimed = []
    while (row := claim(conn)) is not None:
        claimed.append(row["job_id"])
        assert conn.execute("SELECT pglane.complete(%s, '{}') AS ok", (row["attempt_id"],)).fetchone()["ok"]
    assert claimed == ids


def test_a_job_scheduled_for_later_is_not_claimed_before_its_time(conn: Any, lane: str) -> None:
    conn.execute("SELECT pglane.enqueue('brain', '{}', NULL, now() + interval '1 hour')")
    now_job = pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    row = claim(conn)
    assert row is not None and row["job_id"] == now_job
    assert claim(conn) is None


def test_claim_is_refused_without_a_slot_lock(conn: Any, lane: str) -> None:
    pglane.enqueue(conn, lane, {})
    with pytest.raises(pglane.NoSlotHeld, match="holds no slot of lane 'brain'"):
        claim(conn)
    assert conn.execute("SELECT status FROM pglane.jobs").fetchone()["status"] == "queued"


def test_claim_is_refused_to_a_session_whose_lock_is_only_transaction_level(session: Any, lane: str) -> None:
    s = session(autocommit=False)
    pglane.enqueue(s, lane, {})
    s.commit()
    s.execute("SELECT pg_advisory_xact_lock(%s, 1)", (lane_id(s, lane),))
    with pytest.raises(pglane.NoSlotHeld):
        claim(s)
    s.rollback()


def test_claim_is_refused_to_a_session_holding_only_a_shared_lock(conn: Any, lane: str) -> None:
    pglane.enqueue(conn, lane, {})
    conn.execute("SELECT pg_advisory_lock_shared(%s, 1)", (lane_id(conn, lane),))
    with pytest.raises(pglane.NoSlotHeld):
        claim(conn)


def test_claim_is_refused_while_another_session_holds_the_slot(session: Any, lane: str) -> None:
    holder, other = session(), session()
    pglane.enqueue(holder, lane, {})
    take_slot(holder, lane)
    with pytest.raises(pglane.NoSlotHeld):
        claim(other)
    assert claim(holder) is not None


def test_a_claim_check_never_lets_a_waiting_standby_in(session: Any, lane: str) -> None:
    holder, standby = session(), session()
    for _ in range(3):
        pglane.enqueue(holder, lane, {})
    take_slot(holder, lane)
    lid = lane_id(holder, lane)
    got = threading.Event()
    standby_pid = standby.info.backend_pid

    def wait_for_slot() -> None:
        standby.execute(queries.WAIT_SLOT, (lid, 1))
        got.set()

    thread = threading.Thread(target=wait_for_slot)
    thread.start()
    try:
        waiting_on_lock(holder, standby_pid)
        for _ in range(3):  # each claim pins, unlocks and re-locks the slot while the standby waits on it
            row = claim(holder)
            assert row is not None
            assert not got.is_set()
    finally:
        holder.execute(queries.RELEASE_SLOT, (lid, 1))
        thread.join(10)
    assert got.is_set()


def test_two_slots_claim_different_jobs_skipping_each_others_locked_rows(session: Any, conn: Any) -> None:
    pglane.create_lane(conn, "wide", slots=2, job_timeout=10)
    first_job, second_job = pglane.enqueue(conn, "wide", {}), pglane.enqueue(conn, "wide", {})
    a, b = session(autocommit=False), session(autocommit=False)
    take_slot(a, "wide", 1)
    take_slot(b, "wide", 2)
    a.commit()
    b.commit()
    row_a = claim(a, "wide")  # a's transaction stays open: its row lock on the first job is held
    rows_b: list[Any] = []
    # b passes the locked first job (SKIP LOCKED) and takes the second; it then waits only for a's
    # commit on the lane's seq counter, which keeps seq gapless and in commit order.
    thread = threading.Thread(target=lambda: rows_b.append(claim(b, "wide")))
    thread.start()
    waiting_on_lock(conn, b.info.backend_pid)
    a.commit()
    thread.join(10)
    b.commit()
    assert row_a is not None and rows_b and rows_b[0] is not None
    assert (row_a["job_id"], rows_b[0]["job_id"]) == (first_job, second_job)
    assert (row_a["seq"], rows_b[0]["seq"]) == (1, 2)


def test_a_worker_on_a_higher_slot_claims_without_touching_the_free_lower_ones(
    dsn: str, session: Any, conn: Any
) -> None:
    from pglane.slot import LockSession

    pglane.create_lane(conn, "wide", slots=2, job_timeout=10)
    lid = lane_id(conn, "wide")
    first = session()
    take_slot(first, "wide", 1)
    worker = LockSession.connect(dsn, lid, 2, "t")
    try:
        assert worker.try_take() and worker.slot == 2
        first.execute(queries.RELEASE_SLOT, (lid, 1))  # slot 1 is free again
        pglane.enqueue(conn, "wide", {})
        notices: list[str] = []
        worker.conn.add_notice_handler(lambda diag: notices.append(str(diag.message_primary)))
        worker.conn.execute("BEGIN")
        row = worker.conn.execute(queries.CLAIM, ("wide", "w")).fetchone()
        # the claim's transaction is still open: a starting worker can take the free slot 1 now
        newcomer = session()
        assert newcomer.execute(queries.TRY_SLOT, (lid, 1)).fetchone()["pg_try_advisory_lock"]
        worker.conn.execute("COMMIT")
        assert row is not None and row["job_id"] is not None
        assert notices == []
    finally:
        worker.release()


def test_claim_records_the_session_identity_and_the_lease(conn: Any, lane: str) -> None:
    """The identity is the session's pid and its mark, a session advisory lock it holds (pg_locks, which
    any role may read; docs/managed.md); backend_start is the mark's time. A session keeps one mark."""
    for _ in range(2):
        pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    rows = [claim(conn), claim(conn)]
    attempts = [conn.execute(
        "SELECT a.backend_pid = pg_backend_pid() AS pid_ok, a.session_mark,"
        " a.backend_start = pglane.mark_time(a.session_mark) AS start_ok,"
        " EXISTS (SELECT 1 FROM pg_locks k WHERE k.locktype = 'advisory' AND k.objsubid = 1 AND k.granted"
        "         AND k.pid = pg_backend_pid() AND (k.classid::bigint << 32 | k.objid::bigint) = a.session_mark)"
        "   AS mark_held,"
        " a.lease_expires_at - a.started_at AS lease, a.status, a.worker FROM pglane.attempts a WHERE id = %s",
        (row["attempt_id"],),
    ).fetchone() for row in rows if row is not None]
    assert len(attempts) == 2
    for attempt in attempts:
        assert attempt["pid_ok"] and attempt["start_ok"] and attempt["mark_held"]
        assert attempt["lease"].total_seconds() == 22 and attempt["status"] == "running" and attempt["worker"] == "test"
    assert attempts[0]["session_mark"] == attempts[1]["session_mark"], "a session took a second mark"


def test_completion_is_accepted_once_and_stores_the_result(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    row = claim(conn)
    assert row is not None
    ok = conn.execute("SELECT pglane.complete(%s, '{\"a\": 1}') AS ok", (row["attempt_id"],)).fetchone()["ok"]
    again = conn.execute("SELECT pglane.complete(%s, '{\"a\": 2}') AS ok", (row["attempt_id"],)).fetchone()["ok"]
    assert (ok, again) == (True, False)
    assert pglane.result(conn, job) == {"a": 1}
    failed = conn.execute("SELECT pglane.fail(%s, 'late') AS ok", (row["attempt_id"],)).fetchone()["ok"]
    assert failed is False and pglane.job_status(conn, job)["status"] == "done"


def superseded(conn: Any) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """A job on a three-attempt lane whose first attempt failed ('boom') and whose second is running:
    (job id, first attempt's claim row, second attempt's claim row)."""
    pglane.create_lane(conn, "retrying", job_timeout=10, max_attempts=3)
    job = pglane.enqueue(conn, "retrying", {})
    take_slot(conn, "retrying")
    first = claim(conn, "retrying")
    assert first is not None
    assert conn.execute("SELECT pglane.fail(%s, 'boom') AS ok", (first["attempt_id"],)).fetchone()["ok"]
    conn.execute("UPDATE pglane.jobs SET run_after = now() WHERE id = %s", (job,))  # skip the backoff
    second = claim(conn, "retrying")
    assert second is not None and second["attempt_number"] == 2
    return job, first, second


def test_late_completion_is_refused_after_a_newer_attempt(conn: Any) -> None:
    job, first, second = superseded(conn)
    stale = conn.execute("SELECT pglane.complete(%s, '{\"stale\": true}') AS ok", (first["attempt_id"],)).fetchone()
    assert stale["ok"] is False
    assert conn.execute("SELECT status, result FROM pglane.jobs").fetchone() == {"status": "running", "result": None}
    fresh = conn.execute("SELECT pglane.complete(%s, '{\"fresh\": true}') AS ok", (second["attempt_id"],))
    assert fresh.fetchone()["ok"]
    assert pglane.result(conn, job) == {"fresh": True}


def test_a_stale_attempt_can_neither_fail_nor_complete_through_the_fast_path(conn: Any) -> None:
    job, first, _ = superseded(conn)
    nothing = conn.execute("SELECT pglane.fail(%s, 'stale') AS ok", (first["attempt_id"],)).fetchone()
    assert nothing["ok"] is False
    following = pglane.enqueue(conn, "retrying", {})
    fused = conn.execute("SELECT * FROM pglane.complete_and_claim(%s, '{\"stale\": true}', 'retrying', 'test')",
                         (first["attempt_id"],)).fetchone()
    assert fused["completed"] is False and fused["job_id"] == following  # refused, and the next job is claimed
    assert [(a["status"], a["error"]) for a in pglane.attempts(conn, job)] == [("failed", "boom"), ("running", None)]
    assert pglane.job_status(conn, job)["status"] == "running" and pglane.result(conn, job) is None


def test_recovery_marks_lost_an_attempt_whose_session_let_go_of_its_slot(session: Any, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    holder = session()
    take_slot(holder, lane)
    assert claim(holder, lane) is not None
    assert pglane.recover(conn, lane) == 0  # connected and holding the slot: alive
    holder.execute(queries.RELEASE_SLOT, (lane_id(conn, lane), 1))
    assert pglane.recover(conn, lane) == 1  # still connected, but no longer the lane's consumer
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
    assert pglane.job_status(conn, job)["status"] == "failed"


def test_a_retried_job_runs_one_more_attempt(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    first = claim(conn, lane)
    assert first is not None
    conn.execute("SELECT pglane.fail(%s, 'boom')", (first["attempt_id"],))
    assert pglane.job_status(conn, job)["status"] == "failed"  # one attempt allowed
    assert pglane.retry(conn, job) is True
    second = claim(conn, lane)
    assert second is not None and (second["job_id"], second["attempt_number"]) == (job, 2)
    conn.execute("SELECT pglane.complete(%s, '{\"ok\": 1}')", (second["attempt_id"],))
    assert pglane.result(conn, job) == {"ok": 1}
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["failed", "done"]


def test_fail_requeues_while_attempts_remain_then_fails(conn: Any) -> None:
    pglane.create_lane(conn, "twice", job_timeout=10, max_attempts=2)
    job = pglane.enqueue(conn, "twice", {})
    take_slot(conn, "twice")
    for expected in ("queued", "failed"):
        conn.execute("UPDATE pglane.jobs SET run_after = now() WHERE id = %s", (job,))
        row = claim(conn, "twice")
        assert row is not None
        conn.execute("SELECT pglane.fail(%s, 'boom')", (row["attempt_id"],))
        status = pglane.job_status(conn, job)
        assert status["status"] == expected and status["last_error"] == "boom"
    attempts = [a["status"] for a in pglane.attempts(conn, job)]
    assert attempts == ["failed", "failed"]


@pytest.mark.parametrize("reason", [None, "", "  \n"])
def test_a_failure_given_no_reason_still_says_why(conn: Any, lane: str, reason: str | None) -> None:
    job = pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    row = claim(conn, lane)
    assert row is not None
    assert conn.execute("SELECT pglane.fail(%s, %s) AS ok", (row["attempt_id"], reason)).fetchone()["ok"]
    status = pglane.job_status(conn, job)
    assert status["status"] == "failed" and status["last_error"].startswith("failed without a reason")
    assert pglane.attempts(conn, job)[0]["error"].startswith("failed without a reason")


def test_failed_attempt_backs_off_for_seconds_not_minutes(conn: Any) -> None:
    pglane.create_lane(conn, "backoff", job_timeout=10, max_attempts=3)
    pglane.enqueue(conn, "backoff", {})
    take_slot(conn, "backoff")
    row = claim(conn, "backoff")
    assert row is not None
    conn.execute("SELECT pglane.fail(%s, 'boom')", (row["attempt_id"],))
    # Both ends from fail()'s own transaction: a slow commit on a loaded machine cannot skew them.
    delay = conn.execute("SELECT j.run_after - a.finished_at AS d FROM pglane.jobs j"
                         " JOIN pglane.attempts a ON a.job_id = j.id").fetchone()["d"].total_seconds()
    assert delay == 2.0  # the lane's default retry_backoff, doubled per attempt from the first


def test_seq_is_gapless_in_claim_order_with_many_producers_and_two_slots(dsn: str, conn: Any) -> None:
    pglane.create_lane(conn, "wide", slots=2, job_timeout=10)
    producing = threading.Event()

    def produce(n: int) -> None:
        with pglane.connect(dsn) as c:
            for i in range(25):
                pglane.enqueue(c, "wide", {"producer": n, "i": i})

    def consume(slot: int, seqs: list[int]) -> None:
        with pglane.connect(dsn) as c:
            take_slot(c, "wide", slot)
            idle_rounds = 0
            while idle_rounds < 20:
                row = claim(c, "wide")
                if row is None:
                    idle_rounds += 0 if producing.is_set() else 1
                    continue
                seqs.append(row["seq"])
                if row["seq"] % 7 == 0:  # a claim that rolls back gives its number back
                    c.autocommit = False
                    claim(c, "wide")
                    c.rollback()
                    c.autocommit = True
                c.execute("SELECT pglane.complete(%s, NULL)", (row["attempt_id"],))

    seqs_a: list[int] = []
    seqs_b: list[int] = []
    producing.set()
    producers = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    consumers = [threading.Thread(target=consume, args=(1, seqs_a)), threading.Thread(target=consume, args=(2, seqs_b))]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join()
    producing.clear()
    for t in consumers:
        t.join()
    assert sorted(seqs_a + seqs_b) == list(range(1, 101))
    assert seqs_a == sorted(seqs_a) and seqs_b == sorted(seqs_b)
    stored = [r["seq"] for r in conn.execute("SELECT seq FROM pglane.attempts ORDER BY started_at, id")]
    assert sorted(stored) == list(range(1, 101))


def test_statuses_outside_the_contract_are_refused_by_named_checks(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        conn.execute("UPDATE pglane.jobs SET status = 'paused' WHERE id = %s", (job,))
    assert excinfo.value.diag.constraint_name == "job_status_valid"
    take_slot(conn, lane)
    row = claim(conn)
    assert row is not None
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        conn.execute("UPDATE pglane.attempts SET status = 'zombie' WHERE id = %s", (row["attempt_id"],))
    assert excinfo.value.diag.constraint_name == "attempt_status_valid"
    with pytest.raises(psycopg.errors.CheckViolation) as excinfo:
        conn.execute("UPDATE pglane.attempts SET status = 'done' WHERE id = %s", (row["attempt_id"],))
    assert excinfo.value.diag.constraint_name == "attempt_finished_when_not_running"


@pytest.mark.parametrize(("job_timeout", "lease_timeout"), [(60, 60), (60, 30)])
def test_a_lease_not_longer_than_the_job_timeout_is_refused(conn: Any, job_timeout: int, lease_timeout: int) -> None:
    with pytest.raises(pglane.InvalidLane, match="lane_lease_exceeds_job_timeout"):
        pglane.create_lane(conn, "tight", job_timeout=job_timeout, lease_timeout=lease_timeout)
    assert conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"] == 0
    pglane.create_lane(conn, "fine", job_timeout=job_timeout)
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE pglane.lanes SET lease_timeout = make_interval(secs => %s)", (lease_timeout,))


@pytest.mark.parametrize(
    ("settings", "constraint"),
    [({"slots": 0}, "lane_slots_range"), ({"slots": 1001}, "lane_slots_range"),
     ({"max_attempts": 0}, "lane_max_attempts_range"), ({"max_attempts": 101}, "lane_max_attempts_range"),
     ({"job_timeout": 0.5}, "lane_job_timeout_range"), ({"job_timeout": 8 * 86400}, "lane_job_timeout_range"),
     ({"job_timeout": 60, "lease_timeout": 9 * 86400}, "lane_lease_timeout_range"),
     ({"max_queued": 0}, "lane_max_queued_range"), ({"max_payload_bytes": 0}, "lane_max_payload_range"),
     ({"waiting_grace": -1}, "lane_waiting_grace_range"), ({"retry_backoff": 7200}, "lane_retry_backoff_range")],
)
def test_lane_settings_out_of_range_are_refused_by_name_with_what_to_do(
    conn: Any, settings: dict[str, Any], constraint: str
) -> None:
    with pytest.raises(pglane.InvalidLane, match=f"refused by {constraint}: "):
        pglane.create_lane(conn, "odd", **{"job_timeout": 60, **settings})
    assert conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"] == 0


@pytest.mark.parametrize("job_timeout", [1, 5, 90, 600, 3600, 86400])
def test_every_lane_pglane_creates_by_default_has_a_lease_longer_than_its_job_timeout(
    conn: Any, job_timeout: int
) -> None:
    pglane.create_lane(conn, "defaults", job_timeout=job_timeout)
    row = conn.execute("SELECT lease_timeout > job_timeout AS ok FROM pglane.lanes").fetchone()
    assert row["ok"]


def test_a_lane_created_with_no_options_has_the_seed_numbers(conn: Any) -> None:
    conn.execute("INSERT INTO pglane.lanes (name) VALUES ('plain')")
    row = conn.execute("SELECT slots, job_timeout, lease_timeout, max_attempts, max_queued"
                       " FROM pglane.lanes").fetchone()
    assert (row["slots"], row["max_attempts"], row["max_queued"]) == (1, 1, None)
    assert (row["job_timeout"].total_seconds(), row["lease_timeout"].total_seconds()) == (600, 660)
