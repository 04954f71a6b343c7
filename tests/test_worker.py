"""The worker process: wake-up by NOTIFY, standby takeover, one call at a time on a one-slot lane,
graceful stop, handler failures, timeouts. Real `pglane worker` subprocesses, real signals."""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

import pglane
from pglane.job import Claim
from pglane.session import SlotSession
from pglane.slotloop import SlotLoop
from pglane.worker import Worker, WorkerOptions
from tests.conftest import Ledger, Workers, claim, metrics_port, scrape, slot_holder, take_slot, terminate, wait_until


def wait_idle(conn: Any, lane: str) -> int:
    """Wait until a worker holds the lane's slot and sits idle after a claim; returns its backend pid."""
    def idle() -> int | None:
        holders = slot_holder(conn, lane)
        if not holders:
            return None
        row = conn.execute("SELECT state, query FROM pg_stat_activity WHERE pid = %s", (holders[0],)).fetchone()
        ok = row and row["state"] == "idle" and "claim" in row["query"]  # claim_or_wait, complete_and_claim
        return holders[0] if ok else None

    return int(wait_until(idle, 20, "an idle worker holding the slot"))


def status(conn: Any, job: int) -> str:
    return str(pglane.job_status(conn, job)["status"])


def done(conn: Any, job: int) -> Callable[[], bool]:
    return lambda: status(conn, job) == "done"


def start_delay(conn: Any, job: int) -> float:
    """Seconds from the job's commit to its start, on the database clock."""
    row = conn.execute("SELECT started_at - created_at AS d FROM pglane.jobs WHERE id = %s", (job,)).fetchone()
    return float(row["d"].total_seconds())


def test_an_idle_worker_is_woken_by_the_commit_not_by_its_poll(
    conn: Any, lane: str, workers: Workers
) -> None:
    workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "30")
    wait_idle(conn, lane)
    delays = []
    for _ in range(3):
        job = pglane.enqueue(conn, lane, {})
        wait_until(done(conn, job), 10, "the job to run")
        delays.append(start_delay(conn, job))
        wait_idle(conn, lane)
    # A 30 s poll interval could not do this: only the NOTIFY can. (The bench measures how fast: about
    # a millisecond. The bound here leaves room for a stalled commit on a loaded machine.)
    assert max(delays) < 5.0, delays


def test_a_wake_up_costs_one_claim_and_one_fused_completion_not_an_extra_empty_claim(
    conn: Any, lane: str, workers: Workers
) -> None:
    proc = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "60", "--recover-interval", "3600",
                         "--metrics-port", "0")
    port = metrics_port(proc)
    wait_idle(conn, lane)
    claims = "pglane_claim_latency_seconds_count"  # every claim() and complete_and_claim() round trip
    before = wait_until(lambda: scrape(port).get(claims), 20, "the metrics endpoint")
    for n in range(3):
        job = pglane.enqueue(conn, lane, {"n": n})
        wait_until(done(conn, job), 10, "the job to run")
        wait_idle(conn, lane)
    # The NOTIFY that woke the worker is consumed after its claim, so it cannot wake it a second time
    # (the wait covers the last fused completion's metric being recorded just after its round trip).
    wait_until(lambda: scrape(port)[claims] - before >= 2 * 3, 10, "the last round trip's metric")
    assert scrape(port)[claims] - before == 2 * 3


class JobJustAfterAnEmptyClaim(Worker):
    """A worker in this process that, once armed, commits a job right after a claim that found
    nothing, and lets that job's NOTIFY reach its connection before it goes back to waiting: the
    instant at which the notification could be taken for the one that woke the empty claim."""

    def __init__(self, dsn: str, lane: str) -> None:
        super().__init__(dsn, lane, lambda job: None, WorkerOptions(poll_interval=60, recover_interval=3600))
        self.armed = threading.Event()
        self.job: int | None = None

    def _claim(self, slot: SlotLoop, session: SlotSession) -> Claim | None:
        job = super()._claim(slot, session)
        if job is None and self.armed.is_set():
            self.armed.clear()
            with pglane.connect(self.dsn) as other:
                self.job = pglane.enqueue(other, self.lane_name, {})
            session.execute("SELECT 1")  # the job's NOTIFY has now reached this connection
        return job


def test_a_job_committed_just_after_an_empty_claim_still_wakes_the_worker(
    conn: Any, dsn: str, lane: str
) -> None:
    worker = JobJustAfterAnEmptyClaim(dsn, lane)
    loops: list[asyncio.AbstractEventLoop] = []

    async def serve() -> int:
        loops.append(asyncio.get_running_loop())
        return await worker.main()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        wait_idle(conn, lane)
        worker.armed.set()
        # A wake-up with nothing to claim (as when another slot's worker took the job first).
        conn.execute("SELECT pg_notify('pglane_' || id, '') FROM pglane.lanes WHERE name = %s", (lane,))
        job = wait_until(lambda: worker.job, 10, "the empty claim")
        wait_until(done(conn, job), 20, "the job to run")
        assert start_delay(conn, job) < 6  # not the 60 s poll: its NOTIFY was not taken for the old one
    finally:
        for loop in loops:
            loop.call_soon_threadsafe(worker.stop)
        thread.join(20)
    assert not thread.is_alive()


def test_jobs_queued_before_any_worker_listens_are_drained_when_one_starts(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    jobs = [pglane.enqueue(conn, lane, {"n": n}) for n in range(5)]
    workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "30")
    wait_until(lambda: all(status(conn, j) == "done" for j in jobs), 20, "the backlog to drain")
    assert ledger.calls() == jobs


def test_a_missed_notification_costs_at_most_one_poll_interval(conn: Any, lane: str, workers: Workers) -> None:
    poll = 4.0
    workers.start(lane, "tests.handlers:paid_call", "--poll-interval", str(poll), "--recover-interval", "3600")
    wait_idle(conn, lane)
    # Insert without the trigger's NOTIFY: as if the notification were lost.
    conn.execute("ALTER TABLE pglane.jobs DISABLE TRIGGER jobs_after_insert")
    job = pglane.enqueue(conn, lane, {})
    conn.execute("ALTER TABLE pglane.jobs ENABLE TRIGGER jobs_after_insert")
    wait_until(done(conn, job), 10 * poll, "the poll to pick the job up")
    # One poll interval, plus slack for a loaded machine (recovery, the other timer that would have
    # found it, is an hour away).
    assert start_delay(conn, job) < 1.5 * poll


def test_a_worker_whose_session_was_cut_listens_again_after_it_reconnects(
    conn: Any, lane: str, workers: Workers
) -> None:
    poll = 60.0
    proc = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", str(poll))
    first = wait_idle(conn, lane)
    terminate(conn, first)
    second = wait_idle(conn, lane)
    job = pglane.enqueue(conn, lane, {})
    wait_until(done(conn, job), 20, "the job to run")
    assert start_delay(conn, job) < poll / 10  # only a NOTIFY on the new session can do this
    assert slot_holder(conn, lane) == [second] and Workers.log(proc).count("holding slot 1") == 2


def test_a_standby_takes_over_when_the_active_worker_is_killed_and_calls_never_overlap(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    first, second = workers.start_holder_and_standby(conn, lane)
    first_pid = slot_holder(conn, lane)[0]
    jobs = [pglane.enqueue(conn, lane, {"sleep": 0.05}) for _ in range(20)]
    wait_until(lambda: len(ledger.calls()) >= 5, 20, "some calls")
    first.kill()
    first.wait()
    wait_until(lambda: slot_holder(conn, lane) not in ([], [first_pid]), 10, "the standby to take the slot")
    wait_until(lambda: all(status(conn, j) in ("done", "failed") for j in jobs), 30, "every job to finish")
    ledger.assert_one_call_at_a_time()
    statuses = [status(conn, j) for j in jobs]
    failed = {j for j, s in zip(jobs, statuses, strict=True) if s == "failed"}
    assert len(failed) <= 1  # only the job claimed by the killed worker, if it had claimed one
    calls = ledger.calls()
    assert len(calls) == len(set(calls))  # nothing was called twice
    # Every job that is done was called; the cut one may have died before its call began.
    assert set(jobs) - failed <= set(calls) <= set(jobs)
    assert second.poll() is None


def test_a_standby_takes_over_when_the_active_worker_exits_on_sigterm(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    first, second = workers.start_holder_and_standby(conn, lane)
    first.send_signal(signal.SIGTERM)
    assert first.wait(20) == 0
    job = pglane.enqueue(conn, lane, {})
    wait_until(lambda: status(conn, job) == "done", 20, "the standby to serve the job")
    assert "holding slot 1" in Workers.log(second)


def test_two_workers_started_at_once_on_a_one_slot_lane_never_run_two_calls_at_once(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    jobs = [pglane.enqueue(conn, lane, {"sleep": 0.02}) for _ in range(30)]
    procs = [workers.start(lane), workers.start(lane)]
    wait_until(lambda: all(status(conn, j) == "done" for j in jobs), 30, "every job")
    ledger.assert_one_call_at_a_time()
    assert len(slot_holder(conn, lane)) == 1
    # The later starter may log that it waits as a standby only after the jobs are done.
    wait_until(lambda: sum("standby" in Workers.log(p) for p in procs) == 1, 20, "one standby")
    assert sum("holding slot" in Workers.log(p) for p in procs) == 1


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_finishes_the_current_call_and_exits_0(
    conn: Any, lane: str, workers: Workers, ledger: Ledger, stop: signal.Signals
) -> None:
    proc = workers.start(lane)
    job = pglane.enqueue(conn, lane, {"sleep": 1.5})
    wait_until(lambda: ledger.calls() == [job], 20, "the call to start")
    proc.send_signal(stop)
    assert proc.wait(30) == 0
    assert status(conn, job) == "done"
    assert slot_holder(conn, lane) == []
    leftover = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'").fetchone()["n"]
    assert leftover == 0


def test_a_stop_signal_stops_a_worker_busy_with_calls_that_never_suspend(
    conn: Any, lane: str, workers: Workers
) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, '{}' FROM generate_series(1, 200000)", (lane,))
    proc = workers.start(lane, "tests.handlers:noop_async")
    done = "SELECT count(*) AS n FROM pglane.jobs WHERE lane = %s AND status = 'done'"
    wait_until(lambda: conn.execute(done, (lane,)).fetchone()["n"] >= 200, 30, "the worker to be busy")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, "the worker went on with its backlog after SIGTERM"
    assert "SIGTERM received" in workers.log(proc)
    left = conn.execute("SELECT count(*) FILTER (WHERE status = 'queued') AS queued,"
                        " count(*) FILTER (WHERE status = 'running') AS running FROM pglane.jobs WHERE lane = %s",
                        (lane,)).fetchone()
    assert left["queued"] > 0 and left["running"] == 0  # stopped between jobs, with the backlog left queued


def test_a_stop_while_the_database_is_unreachable_logs_how_to_store_the_outcome(
    dsn: str, conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    from psycopg import sql
    from psycopg.conninfo import make_conninfo

    database = sql.Identifier(conn.info.dbname)
    proc = workers.start(lane)
    # The call outlasts the set-up below, so the session is cut during it, even on a loaded machine.
    job = pglane.enqueue(conn, lane, {"sleep": 3.0, "result": {"paid": "it's done"}})
    wait_until(lambda: ledger.calls() == [job], 20, "the call to start")
    admin = pglane.connect(make_conninfo(dsn, dbname="postgres"))  # a database cannot close itself
    admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
    try:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                     " WHERE datname = current_database() AND application_name LIKE 'pglane %%'")
        wait_until(lambda: "cannot reach the database" in workers.log(proc), 30, "a failed reconnection")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 69
    finally:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        admin.close()
    assert [j for event, j, _, _ in ledger.events() if event == "end"] == [job]  # paid and answered
    line = next(line for line in workers.log(proc).splitlines() if "is not stored" in line)
    assert " ERROR pglane.worker[" in line
    statement = line[line.index("SELECT pglane.complete("):]
    assert pglane.recover(conn, lane) == 1
    assert conn.execute(statement).fetchone()["complete"] is True
    assert pglane.result(conn, job) == {"paid": "it's done"}
    assert status(conn, job) == "done"


def test_max_jobs_recycles_the_worker_with_exit_0_after_the_current_job(
    conn: Any, lane: str, workers: Workers
) -> None:
    jobs = [pglane.enqueue(conn, lane, {}) for _ in range(5)]
    proc = workers.start(lane, "tests.handlers:paid_call", "--max-jobs", "2")
    assert proc.wait(30) == 0
    assert [status(conn, j) for j in jobs] == ["done", "done", "queued", "queued", "queued"]


def test_max_lifetime_reached_during_a_call_finishes_the_call_first(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    job = pglane.enqueue(conn, lane, {"sleep": 4.0})
    waiting = pglane.enqueue(conn, lane, {})
    proc = workers.start(lane, "tests.handlers:paid_call", "--max-lifetime", "2")  # slow start-up: room
    assert proc.wait(30) == 0
    assert ledger.calls() == [job]  # the call outlived the lifetime and was not cut off
    assert (status(conn, job), status(conn, waiting)) == ("done", "queued")


def test_max_lifetime_recycles_an_idle_worker_with_exit_0(lane: str, workers: Workers) -> None:
    proc = workers.start(lane, "tests.handlers:paid_call", "--max-lifetime", "1", "--poll-interval", "30")
    assert proc.wait(30) == 0


def test_a_handler_that_raises_fails_its_attempt_and_the_lane_goes_on(
    conn: Any, lane: str, workers: Workers
) -> None:
    bad = pglane.enqueue(conn, lane, {"fail": "the provider said no"})
    good = pglane.enqueue(conn, lane, {})
    workers.start(lane)
    wait_until(lambda: status(conn, good) == "done", 20, "the next job")
    row = pglane.job_status(conn, bad)
    assert row["status"] == "failed"
    attempt = pglane.attempts(conn, bad)[0]
    assert attempt["status"] == "failed"
    assert attempt["error"].startswith("RuntimeError: the provider said no")
    assert "Traceback" in attempt["error"]


def test_a_result_that_is_not_json_fails_the_attempt_and_says_why(conn: Any, lane: str, workers: Workers) -> None:
    jobs = [pglane.enqueue(conn, lane, {}) for _ in range(2)]
    proc = workers.start(lane, "tests.handlers:not_json")
    wait_until(lambda: all(status(conn, j) == "failed" for j in jobs), 20, "both jobs to fail")
    for job in jobs:  # the lane went on after the first
        assert "not JSON-serialisable" in pglane.attempts(conn, job)[0]["error"]
    assert proc.poll() is None


def test_a_result_the_database_cannot_store_fails_the_attempt_and_counts_as_failed(
    conn: Any, lane: str, workers: Workers
) -> None:
    jobs = [pglane.enqueue(conn, lane, {}) for _ in range(2)]
    port = metrics_port(workers.start(lane, "tests.handlers:unstorable", "--metrics-port", "0"))
    wait_until(lambda: all(status(conn, j) == "failed" for j in jobs), 20, "both attempts to fail")
    for job in jobs:  # the lane went on after the first
        assert pglane.attempts(conn, job)[0]["error"].startswith("the result could not be stored: ")
    counted = wait_until(lambda: (m := scrape(port)) and m.get("pglane_jobs_failed_total") == 2 and m, 10,
                         "the failures to be counted")
    assert counted["pglane_jobs_done_total"] == 0


def test_an_async_handler_is_awaited(conn: Any, lane: str, workers: Workers) -> None:
    job = pglane.enqueue(conn, lane, {"sleep": 0.1})
    workers.start(lane, "tests.handlers:async_paid_call")
    wait_until(lambda: status(conn, job) == "done", 20, "the job")
    assert pglane.result(conn, job) == {"job": job, "seq": 1}


def test_a_handler_past_its_job_timeout_is_recorded_timed_out(conn: Any, workers: Workers, ledger: Ledger) -> None:
    pglane.create_lane(conn, "quick", job_timeout=1, lease_timeout=3)
    slow = pglane.enqueue(conn, "quick", {"sleep": 30})
    after = pglane.enqueue(conn, "quick", {})
    workers.start("quick", "tests.handlers:async_paid_call")
    wait_until(lambda: status(conn, after) == "done", 20, "the next job")
    attempt = pglane.attempts(conn, slow)[0]
    assert attempt["status"] == "timed_out" and "job_timeout of 1s" in attempt["error"]
    assert status(conn, slow) == "failed"


def test_on_an_at_least_once_lane_a_timed_out_attempt_is_queued_again_and_runs_once_more(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "quick", job_timeout=1, lease_timeout=3, max_attempts=2, retry_backoff=0)
    job = pglane.enqueue(conn, "quick", {})
    workers.start("quick", "tests.handlers:slow_first")
    wait_until(done(conn, job), 20, "the second attempt")
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["timed_out", "done"]
    assert pglane.result(conn, job) == {"attempt": 2}
    assert ledger.calls() == [job, job]


def test_an_idle_worker_recovers_an_attempt_whose_session_is_gone_on_its_timer(
    conn: Any, session: Callable[..., Any], workers: Workers
) -> None:
    pglane.create_lane(conn, "pair", slots=2, job_timeout=20)
    proc = workers.start("pair", "tests.handlers:paid_call", "--poll-interval", "60", "--recover-interval", "1")
    wait_idle(conn, "pair")
    # Another consumer (any language) on slot 2 claims a job, then its session ends mid-call. Enqueue
    # and claim commit together, so the idle worker's wake-up finds nothing to take.
    other = session(autocommit=False)
    take_slot(other, "pair", 2)  # the worker took slot 1
    job = pglane.enqueue(other, "pair", {})
    assert other.execute("SELECT job_id FROM pglane.claim('pair', 'elsewhere')").fetchone()["job_id"] == job
    other.commit()
    other.close()
    # Nothing wakes the idle worker for a minute but its recovery timer.
    wait_until(lambda: status(conn, job) == "failed", 15, "the idle worker's recovery")
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
    assert "recovered 1 attempt(s) of lane pair" in Workers.log(proc)


def test_a_handler_ignoring_cancellation_cannot_hold_the_slot_past_the_hard_timeout(
    conn: Any, workers: Workers
) -> None:
    pglane.create_lane(conn, "hung", job_timeout=1, lease_timeout=3)
    job = pglane.enqueue(conn, "hung", {"sleep": 60})
    proc = workers.start("hung", "tests.handlers:ignores_cancellation")
    assert proc.wait(30) == 75  # recycled: a supervisor restarts it
    attempt = pglane.attempts(conn, job)[0]
    assert attempt["status"] == "timed_out" and "hard timeout" in attempt["error"]
    # The process exited without unlocking: the slot frees when its backend notices and exits.
    wait_until(lambda: slot_holder(conn, "hung") == [], 10, "the slot to be released")


def test_a_sync_handler_that_hangs_is_timed_out_and_the_process_recycled(conn: Any, workers: Workers) -> None:
    pglane.create_lane(conn, "stuck", job_timeout=1, lease_timeout=3)
    job = pglane.enqueue(conn, "stuck", {"sleep": 60})
    after = pglane.enqueue(conn, "stuck", {})
    proc = workers.start("stuck", "tests.handlers:paid_call")
    assert proc.wait(30) == 75
    assert pglane.attempts(conn, job)[0]["status"] == "timed_out"
    workers.start("stuck", "tests.handlers:paid_call")  # the supervisor restarts it: the lane goes on
    wait_until(done(conn, after), 20, "the next job")
    assert status(conn, job) == "failed"


def test_the_worker_refuses_to_start_when_its_timeout_contradicts_the_lane(lane: str, workers: Workers) -> None:
    proc = workers.start(lane, "tests.handlers:paid_call", "--timeout", "30")  # lease is 22 s
    assert proc.wait(30) == 2
    assert "R2 worker timeout < lease_timeout" in Workers.log(proc)


def test_the_worker_refuses_an_unknown_lane_and_a_bad_handler(conn: Any, lane: str, workers: Workers) -> None:
    unknown = workers.start("nope")
    assert unknown.wait(30) == 1
    assert "unknown lane 'nope'" in Workers.log(unknown)
    bad = workers.start(lane, "tests.handlers:missing")
    assert bad.wait(30) == 2
    assert "has no 'missing'" in Workers.log(bad)


def test_the_worker_log_says_what_it_does_in_one_line_each(conn: Any, lane: str, workers: Workers) -> None:
    proc = workers.start(lane)
    wait_until(lambda: slot_holder(conn, lane), 20, "the slot")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    lines = Workers.log(proc).splitlines()
    assert any("holding slot 1 of lane brain" in line for line in lines)
    assert any("SIGTERM received" in line for line in lines)
    assert not any(line.startswith("Traceback") for line in lines)




def test_the_lock_connection_carries_keepalives(dsn: str, conn: Any, lane: str) -> None:
    from pglane.slot import LockSession

    session = LockSession.connect(dsn, 1, 1, "probe")
    try:
        got = session.conn.info.get_parameters()
    finally:
        session.release()
    documented = {"keepalives": "1", "keepalives_idle": "5", "keepalives_interval": "2", "keepalives_count": "3",
                  "tcp_user_timeout": "10000"}  # as docs/design.md says
    assert {k: got.get(k) for k in documented} == documented


def test_a_database_error_makes_the_worker_back_off_and_go_on_not_die(conn: Any, lane: str, workers: Workers) -> None:
    proc = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "0.2")
    wait_idle(conn, lane)
    conn.execute("ALTER FUNCTION pglane.claim_or_wait(text, text) RENAME TO claim_away")
    wait_until(lambda: "database error" in Workers.log(proc), 20, "the worker to meet the error")
    conn.execute("ALTER FUNCTION pglane.claim_away(text, text) RENAME TO claim_or_wait")
    job = pglane.enqueue(conn, lane, {})
    wait_until(lambda: status(conn, job) == "done", 30, "the worker to go on")
    assert proc.poll() is None


def test_a_repeated_database_error_backs_off_up_to_5_s_and_a_stop_cuts_the_backoff_short(
    conn: Any, lane: str, workers: Workers
) -> None:
    proc = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "0.2")
    wait_idle(conn, lane)
    conn.execute("ALTER FUNCTION pglane.claim_or_wait(text, text) RENAME TO claim_away")
    try:
        wait_until(lambda: "reconnecting in 5.0s" in Workers.log(proc), 30, "the backoff to reach its bound")
        delays = re.findall(r"database error .*; reconnecting in ([\d.]+)s", Workers.log(proc))
        assert delays[:7] == ["0.1", "0.2", "0.4", "0.8", "1.6", "3.2", "5.0"]  # doubling, never a spin
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert time.monotonic() - stopped < 4  # not the 5 s sleep out: the stop ended it
    finally:
        conn.execute("ALTER FUNCTION pglane.claim_away(text, text) RENAME TO claim_or_wait")


def test_the_logged_statement_for_an_unstored_failure_stores_its_text_exactly(conn: Any, lane: str) -> None:
    from pglane.handler import Outcome
    from pglane.job import Claim
    from pglane.outbox import Unstored

    pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    row = claim(conn, lane)
    assert row is not None
    job = pglane.Job(id=row["job_id"], lane=lane, payload={}, attempt_id=row["attempt_id"], attempt_number=1,
                     seq=row["seq"], idempotency_key=None)
    error = "ValueError: it's C:\\temp\\x; DROP TABLE pglane.jobs; --"
    statement = Unstored(Claim(job, str(row["token"]), sent_at=0.0), Outcome(error=error)).statement()
    with pglane.connect(conn.info.dsn) as elsewhere:  # the token lets any session store it
        assert (elsewhere.execute(statement).fetchone() or {}).get("fail") is True
    assert pglane.attempts(conn, job.id)[0]["error"] == error


def test_a_read_only_server_gets_one_log_line_per_backoff_step_and_the_worker_resumes_when_writable(
    dsn: str, conn: Any, lane: str, workers: Workers
) -> None:
    from psycopg import sql

    database = sql.Identifier(conn.info.dbname)
    proc = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "0.2")
    pid = wait_idle(conn, lane)
    conn.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    try:
        terminate(conn, pid)  # as a demotion ends every session: the new ones are read-only
        wait_until(lambda: Workers.log(proc).count("the server is read-only") >= 6, 30, "six backoff steps")
        stamps = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in Workers.log(proc).splitlines()
                  if "the server is read-only" in line]
        # One line per backoff step (0.1 s doubling): the first six span 0.1 + 0.2 + ... + 1.6 s = 3.1 s.
        assert (stamps[5] - stamps[0]).total_seconds() >= 2.5, f"a flood: {len(stamps)} lines {stamps}"
        assert "target_session_attrs=read-write" in Workers.log(proc)
    finally:
        conn.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))
    job = pglane.enqueue(conn, lane, {})
    wait_until(lambda: status(conn, job) == "done", 30, "the worker to resume on a writable server")
    assert proc.poll() is None
