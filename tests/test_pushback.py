"""When the capability pushes back (docs/design.md#push-back-pauses-deferrals-and-the-breaker): a
handler's RetryLater (the attempt deferred, nothing spent of max_attempts, the lane paused until
then), a lane paused and resumed by hand, the breaker, and a job's own timeout — with real workers."""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg
import pytest

import pglane
from tests.conftest import Ledger, Workers, claim, claimed, metrics_port, scrape, slot_holder, take_slot, wait_until


def _attempts(conn: Any, job_id: int) -> list[str]:
    return [r["status"] for r in conn.execute(
        "SELECT status FROM pglane.attempts WHERE job_id = %s ORDER BY attempt_number", (job_id,))]


def _status(conn: Any, job_id: int) -> str:
    return str(conn.execute("SELECT status FROM pglane.jobs WHERE id = %s", (job_id,)).fetchone()["status"])


def _lane_row(conn: Any, lane: str) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pglane.lane_status WHERE lane = %s", (lane,)).fetchone()
    assert row is not None
    return dict(row)


def test_a_deferral_pauses_the_whole_lane_and_the_job_runs_afterwards_without_spending_an_attempt(
        conn: Any, workers: Workers, ledger: Ledger) -> None:
    pglane.create_lane(conn, "paid", slots=3, job_timeout=30, max_attempts=1)
    refused = pglane.enqueue(conn, "paid", {"refuse": 1, "after": 2, "reason": "429: retry after 2 s"})
    others = [pglane.enqueue(conn, "paid", {"sleep": 0.2}) for _ in range(12)]
    for _ in range(3):
        workers.start("paid", "tests.handlers:provider")
    wait_until(lambda: all(_status(conn, j) == "done" for j in [refused, *others]), 40, "every job done")

    assert _attempts(conn, refused) == ["deferred", "done"]  # max_attempts 1, and it ran: not spent
    pause = conn.execute("SELECT p.*, c.paused_until FROM pglane.lane_pauses p"
                         " JOIN pglane.lane_counters c USING (lane_id)").fetchone()
    assert pause["kind"] == "retry_later" and "429: retry after 2 s" in pause["reason"]
    assert abs((pause["paused_until"] - pause["paused_at"]).total_seconds() - 2) < 0.01
    # The database clock: no start of the lane from the pause's start to its end, and jobs were
    # waiting (the calls in flight at the deferral finished normally).
    during = conn.execute("SELECT count(*) AS n FROM pglane.attempts WHERE started_at >= %s AND started_at < %s",
                          (pause["paused_at"], pause["paused_until"])).fetchone()["n"]
    assert during == 0
    after = conn.execute("SELECT count(*) AS n FROM pglane.attempts WHERE started_at >= %s",
                         (pause["paused_until"],)).fetchone()["n"]
    assert after >= 2, "the pause held back nothing: every job had started before it"
    done_try = conn.execute("SELECT started_at FROM pglane.attempts WHERE job_id = %s AND status = 'done'",
                            (refused,)).fetchone()["started_at"]
    assert done_try >= pause["paused_until"]
    # The ledger, outside the database: the refused job's paid call began 2 s after its refusal.
    events = {(e, job): t for e, job, _, t in ledger.events() if job == refused}
    assert (events[("start", refused)] - events[("refused", refused)]) / 1e9 >= 2.0
    assert ledger.calls().count(refused) == 1


@pytest.mark.parametrize("handler", ["tests.handlers:provider", "tests.handlers:async_provider"])
def test_a_job_deferred_past_max_deferrals_fails_saying_why_and_only_the_job_waits_on_a_job_lane(
        conn: Any, workers: Workers, ledger: Ledger, handler: str) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30, max_deferrals=3, on_retry_later="job")
    job = pglane.enqueue(conn, "paid", {"refuse": 100, "after": 0, "reason": "503 Service Unavailable"})
    port = metrics_port(workers.start("paid", handler, "--metrics-port", "0"))
    wait_until(lambda: _status(conn, job) == "failed", 30, "the job to fail")
    counted = scrape(port, "paid")
    assert counted["pglane_jobs_deferred_total"] == 4 and counted["pglane_jobs_failed_total"] == 0
    assert _attempts(conn, job) == ["deferred"] * 4  # the 4th deferral is past --max-deferrals 3
    status = pglane.job_status(conn, job)
    assert "deferred 4 times in a row" in status["last_error"] and "--max-deferrals 3" in status["last_error"]
    assert "503 Service Unavailable" in status["last_error"] and f"pglane retry {job}" in status["last_error"]
    assert "retry" in status["next_safe_action"] and "nothing paid" in status["next_safe_action"]
    assert conn.execute("SELECT count(*) AS n FROM pglane.lane_pauses").fetchone()["n"] == 0  # 'job': no pause
    assert ledger.calls() == []  # refused every time: never paid


def test_deferrals_in_a_row_end_with_a_failure_and_a_retry_starts_them_again(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30, max_attempts=3, max_deferrals=1, on_retry_later="job",
                       retry_backoff=0.001)
    job = pglane.enqueue(conn, "paid", {})
    s = session()
    take_slot(s, "paid")

    def defer() -> None:
        row = wait_until(lambda: claim(s, "paid"), 5, "the job to be claimable")
        assert s.execute("SELECT pglane.defer(%s, '0 s', 'busy', %s) AS ok",
                         (row["attempt_id"], row["token"])).fetchone()["ok"]

    def fail() -> None:
        row = wait_until(lambda: claim(s, "paid"), 5, "the job to be claimable")
        s.execute("SELECT pglane.fail(%s, 'broke', false, %s)", (row["attempt_id"], row["token"]))

    defer()
    fail()  # ends the run of deferrals
    defer()  # one in a row again: allowed
    fail()
    defer()
    assert _status(conn, job) == "queued"  # 5 attempts, 2 of them counted: max_attempts 3 not reached
    defer()  # two in a row: over max_deferrals 1
    assert _status(conn, job) == "failed"
    pglane.retry(conn, job)
    defer()  # a person's retry starts the count again
    assert _status(conn, job) == "queued"


def test_a_bad_deferral_is_refused_with_what_to_do_and_the_attempt_stays_running(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30)
    pglane.enqueue(conn, "paid", {})
    s = session()
    take_slot(s, "paid")
    row = claimed(s, "paid")
    for interval in ("-1 s", "8 days"):
        with pytest.raises(psycopg.Error) as err:
            s.execute("SELECT pglane.defer(%s, %s::interval, 'x', %s)", (row["attempt_id"], interval, row["token"]))
        assert "0 seconds to 7 days" in str(err.value) and "pause" in (err.value.diag.message_hint or "")
    assert _attempts(conn, row["job_id"]) == ["running"]
    for seconds in (-1, float("nan"), 8 * 24 * 3600, True):
        with pytest.raises(ValueError, match="0 to 604800"):
            pglane.RetryLater(after=seconds)


def test_a_paused_lane_starts_nothing_until_resumed_and_its_sleeping_workers_start_within_a_second(
        conn: Any, workers: Workers) -> None:
    pglane.create_lane(conn, "paid", slots=3, job_timeout=30)
    watched = workers.start("paid", "tests.handlers:paid_call", "--poll-interval", "30", "--metrics-port", "0")
    for _ in range(2):
        workers.start("paid", "tests.handlers:paid_call", "--poll-interval", "30")
    wait_until(lambda: len(slot_holder(conn, "paid")) == 3, 30, "three workers holding the three slots")
    port = metrics_port(watched)

    def claims() -> float:
        return scrape(port, "paid").get("pglane_claim_latency_seconds_count", 0.0)

    before = wait_until(claims, 20, "the watched worker's first claim")
    note = pglane.pause_lane(conn, "paid", reason="provider maintenance")
    assert "paused until resumed" in note and "pglane lane resume paid" in note
    jobs = []
    for _ in range(12):  # one at a time: each enqueue's NOTIFY wakes every worker
        jobs.append(pglane.enqueue(conn, "paid", {}))
        time.sleep(0.05)
    # Each worker claims once, is told the lane is paused until resumed, and sleeps through the rest.
    watch_until = time.monotonic() + 1.5  # an absence is observed over a window: 1.5 s of it
    while time.monotonic() < watch_until:
        assert conn.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()["n"] == 0
        time.sleep(0.05)
    # A claim or two per worker whatever the enqueues (one told it the lane is paused; a loaded machine
    # may let a wake-up from before the pause's answer through), not one per enqueue.
    assert claims() - before <= 3, f"{claims() - before} claims while paused for 12 enqueues: polling churn"
    status = _lane_row(conn, "paid")
    assert status["paused"] and status["paused_until"] is None  # until resumed
    assert status["pause_reason"] == "provider maintenance"
    assert "paused until resumed" in status["next_safe_action"]
    assert "pglane lane resume paid" in status["next_safe_action"]
    job_view = pglane.job_status(conn, jobs[0])
    assert job_view["waiting_for_worker"] is False and "resumes" in job_view["next_safe_action"]

    resumed_at = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]
    assert "resumed" in pglane.resume_lane(conn, "paid")
    wait_until(lambda: all(_status(conn, j) == "done" for j in jobs), 30, "the jobs to run after the resume")
    first = conn.execute("SELECT min(started_at) AS t FROM pglane.attempts").fetchone()["t"]
    assert (first - resumed_at).total_seconds() < 1.0, "the resume did not wake the workers (poll interval 30 s)"
    assert not _lane_row(conn, "paid")["paused"]
    assert conn.execute("SELECT resumed_by FROM pglane.lane_pauses").fetchone()["resumed_by"] is not None


def test_a_pause_holds_in_the_claim_itself_and_writes_nothing(conn: Any, session: Any) -> None:
    for name, kwargs in (("plain", {}), ("strict", {"takeover": "after_lease"}), ("rated", {"rate": "1000/s"}),
                         ("grouped", {"group_slots": 1})):
        pglane.create_lane(conn, name, job_timeout=30, **kwargs)
        pglane.enqueue(conn, name, {}, group="g")
        s = session()
        take_slot(s, name)
        pglane.pause_lane(conn, name, for_seconds=60)
        seq = conn.execute("SELECT c.last_seq FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
                           " WHERE l.name = %s", (name,)).fetchone()["last_seq"]
        row = s.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (name,)).fetchone()
        assert row["job_id"] is None and row["wait_reason"] == "paused", name
        assert 58 < row["wait_seconds"] <= 60, name
        assert conn.execute("SELECT c.last_seq FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
                            " WHERE l.name = %s", (name,)).fetchone()["last_seq"] == seq, name
        pglane.resume_lane(conn, name)
        assert claimed(s, name)["seq"] == seq + 1, name


def test_a_pause_that_ended_by_time_lets_the_lane_start_again_and_pausing_in_the_past_is_refused(
        conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30)
    pglane.enqueue(conn, "paid", {})
    s = session()
    take_slot(s, "paid")
    pglane.pause_lane(conn, "paid", for_seconds=0.3)
    assert claim(s, "paid") is None
    wait_until(lambda: claim(s, "paid"), 5, "the pause to end by itself")
    with pytest.raises(psycopg.Error, match="in the future"):
        conn.execute("SELECT pglane.pause_lane('paid', now() - interval '1 s')")
    with pytest.raises(pglane.PglaneError, match="unknown lane"):
        pglane.pause_lane(conn, "nope")
    with pytest.raises(pglane.PglaneError, match="not both"):
        pglane.pause_lane(conn, "paid", for_seconds=5, until=conn.execute("SELECT now() AS t").fetchone()["t"])


def test_the_breaker_pauses_after_k_failures_in_a_row_and_stays_tripped_across_a_worker_restart(
        conn: Any, workers: Workers, ledger: Ledger) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30, pause_after_failures=3)
    jobs = [pglane.enqueue(conn, "paid", {"fail": "502 Bad Gateway"}) for _ in range(5)]
    first = workers.start("paid", "tests.handlers:paid_call", "--poll-interval", "0.2")
    wait_until(lambda: _lane_row(conn, "paid")["paused"], 30, "the breaker to trip")
    failed = conn.execute("SELECT id FROM pglane.attempts WHERE status = 'failed' ORDER BY id").fetchall()
    assert len(failed) == 3
    status = _lane_row(conn, "paid")
    assert status["paused"] and status["paused_until"] is None  # until a person resumes it
    assert "by the breaker" in status["next_safe_action"] and "3 failed attempts in a row" in status["next_safe_action"]
    assert all(str(r["id"]) in status["next_safe_action"] for r in failed)
    assert "502 Bad Gateway" in status["pause_reason"]

    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    workers.start("paid", "tests.handlers:paid_call", "--poll-interval", "0.2")
    wait_until(lambda: slot_holder(conn, "paid"), 30, "the new worker's slot")
    watch_until = time.monotonic() + 1.0  # tripped: the new worker polls every 0.2 s and starts nothing
    while time.monotonic() < watch_until:
        assert conn.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()["n"] == 3
        time.sleep(0.05)
    assert [_status(conn, j) for j in jobs].count("queued") == 2
    pglane.resume_lane(conn, "paid")
    wait_until(lambda: [_status(conn, j) for j in jobs].count("failed") == 5, 30, "the rest to run after resume")
    assert len(ledger.calls()) == 5


def test_a_success_ends_a_run_of_failures(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "paid", job_timeout=30, pause_after_failures=3)
    s = session()
    take_slot(s, "paid")
    for outcome in ("fail", "fail", "done", "fail", "fail"):
        pglane.enqueue(conn, "paid", {})
        row = claimed(s, "paid")
        if outcome == "fail":
            s.execute("SELECT pglane.fail(%s, 'broke', false, %s)", (row["attempt_id"], row["token"]))
        else:
            s.execute("SELECT pglane.complete(%s, '{}'::jsonb, %s)", (row["attempt_id"], row["token"]))
    assert not _lane_row(conn, "paid")["paused"]  # 2, then a success, then 2: never 3 in a row
    pglane.enqueue(conn, "paid", {})
    row = claimed(s, "paid")
    s.execute("SELECT pglane.fail(%s, 'broke', false, %s)", (row["attempt_id"], row["token"]))
    assert _lane_row(conn, "paid")["paused"]


def test_a_jobs_own_timeout_ends_its_call_at_one_second_on_a_lane_of_sixty(
        conn: Any, workers: Workers) -> None:
    pglane.create_lane(conn, "paid", job_timeout=60)
    short = pglane.enqueue(conn, "paid", {"sleep": 30}, job_timeout=1)
    plain = pglane.enqueue(conn, "paid", {"sleep": 0.1})
    workers.start("paid", "tests.handlers:async_paid_call")
    wait_until(lambda: _status(conn, plain) == "done", 30, "both jobs to end")
    row = conn.execute("SELECT status, error, finished_at - started_at AS took FROM pglane.attempts"
                       " WHERE job_id = %s", (short,)).fetchone()
    assert row["status"] == "timed_out" and "job_timeout of 1s" in row["error"]
    assert 0.9 < row["took"].total_seconds() < 5, row["took"]
    assert pglane.job_status(conn, short)["job_timeout"].total_seconds() == 1


def test_a_job_timeout_above_its_lanes_or_not_above_zero_is_refused_and_nothing_written(conn: Any) -> None:
    pglane.create_lane(conn, "paid", job_timeout=60)
    with pytest.raises(pglane.InvalidInput) as err:
        pglane.enqueue(conn, "paid", {}, job_timeout=120)
    assert "at most its lane" in str(err.value) and "pglane lane set paid --job-timeout" in str(err.value)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(pglane.InvalidInput, match="above zero"):
            pglane.enqueue(conn, "paid", {}, job_timeout=bad)
    with pytest.raises(psycopg.Error, match="at most its lane"):
        conn.execute("INSERT INTO pglane.jobs (lane, payload, job_timeout) VALUES ('paid', '{}', '2 minutes')")
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0
    ok = pglane.enqueue(conn, "paid", {}, job_timeout=60)  # equal to the lane's: allowed
    assert pglane.job_status(conn, ok)["job_timeout"].total_seconds() == 60
