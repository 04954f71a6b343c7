"""Fencing: the lock session cut during a call, a frozen worker thawed after a takeover, a stuck
attempt past its lease, and timeouts firing inside claim and complete. Writes are fenced by the
attempt; a late result is kept only when no newer attempt exists; nothing is handed over by timer."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

import pglane
from tests.conftest import (
    ROOT,
    Ledger,
    Workers,
    claim,
    claimed,
    metrics_port,
    scrape,
    slot_holder,
    take_slot,
    terminate,
    wait_until,
)
from tests.crash.conftest import check_invariants, drained


def worker_of(conn: Any, attempt: int) -> str:
    return str(conn.execute("SELECT worker FROM pglane.attempts WHERE id = %s", (attempt,)).fetchone()["worker"])


def test_a_cut_lock_session_stops_claims_and_the_worker_reconnects_and_delivers(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    proc = workers.start(lane)
    job = pglane.enqueue(conn, lane, {"sleep": 3.0})  # the cut lands in the call, even on a loaded machine
    wait_until(lambda: job in ledger.calls(), 20, "the call")
    terminate(conn, slot_holder(conn, lane)[0])
    later = [pglane.enqueue(conn, lane, {}) for _ in range(3)]
    drained(conn, lane, [job, *later])
    assert pglane.job_status(conn, job)["status"] == "done"  # its pending completion was delivered
    log = Workers.log(proc)
    assert "the slot session died during attempt" in log and log.count("holding slot 1") == 2
    ledger.assert_one_call_at_a_time()
    check_invariants(conn, lane, [job, *later], ledger)


def test_with_a_standby_a_cut_lock_session_hands_over_and_no_new_call_overlaps(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    first, second = workers.start_holder_and_standby(conn, lane)
    job = pglane.enqueue(conn, lane, {"sleep": 3.0})  # the cut lands in the call, even on a loaded machine
    wait_until(lambda: job in ledger.calls(), 20, "the call")
    cut = time.monotonic_ns()
    terminate(conn, slot_holder(conn, lane)[0])
    later = [pglane.enqueue(conn, lane, {"sleep": 0.05}) for _ in range(5)]
    drained(conn, lane, later)
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 20, "the late result")
    # The call in flight was paid: its output is kept (late-result rule), never re-run.
    assert pglane.result(conn, job) is not None and ledger.calls().count(job) == 1
    attempt = pglane.attempts(conn, job)[0]
    assert attempt["status"] == "done"
    # Every call started after the cut ran alone.
    ledger.assert_one_call_at_a_time(since_ns=cut)
    assert first.poll() is None and second.poll() is None
    check_invariants(conn, lane, [job, *later], ledger)


def freeze_and_hand_over(conn: Any, lane: str, workers: Workers, ledger: Ledger,
                         *frozen_args: str) -> tuple[Any, int, int]:
    frozen, _ = workers.start_holder_and_standby(conn, lane, *frozen_args)
    job = pglane.enqueue(conn, lane, {"sleep": 3.0})  # long enough to be stopped in, on a loaded machine
    wait_until(lambda: job in ledger.calls(), 20, "the call")
    attempt = ledger.attempts_of("start")[-1]
    frozen.send_signal(signal.SIGSTOP)
    terminate(conn, slot_holder(conn, lane)[0])  # what keepalives do to a silent peer, sooner
    return frozen, job, attempt


def test_a_frozen_worker_thawed_after_a_takeover_keeps_its_paid_output_and_starts_nothing(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    frozen, job, attempt = freeze_and_hand_over(conn, lane, workers, ledger)
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "failed", 20, "the standby's recovery")
    later = [pglane.enqueue(conn, lane, {"sleep": 0.05}) for _ in range(3)]
    drained(conn, lane, later)
    frozen.send_signal(signal.SIGCONT)
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 20, "the late result")
    status = pglane.attempts(conn, job)
    assert [a["status"] for a in status] == ["done"]
    assert status[0]["error"].startswith("late result accepted after recovery had marked this attempt lost")
    more = [pglane.enqueue(conn, lane, {}) for _ in range(3)]
    drained(conn, lane, more)
    zombie = worker_of(conn, attempt)
    assert [worker_of(conn, a) for a in ledger.attempts_of("start")].count(zombie) == 1  # it started nothing new
    assert "standby" in Workers.log(frozen)
    check_invariants(conn, lane, [job, *later, *more], ledger)


def test_a_frozen_workers_late_result_never_overwrites_a_newer_attempt(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "retrying", job_timeout=20, max_attempts=2)
    frozen, job, _ = freeze_and_hand_over(conn, "retrying", workers, ledger, "--metrics-port", "0")
    port = metrics_port(frozen)
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 30, "the second attempt")
    fresh = pglane.result(conn, job)
    frozen.send_signal(signal.SIGCONT)
    wait_until(lambda: "refused" in Workers.log(frozen), 20, "the zombie's completion to be refused")
    assert pglane.result(conn, job) == fresh
    # The refused outcome is counted neither done nor failed by the zombie.
    counted = scrape(port, "retrying")
    assert (counted["pglane_jobs_done_total"], counted["pglane_jobs_failed_total"]) == (0, 0)
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost", "done"]
    assert fresh["seq"] == 2
    check_invariants(conn, "retrying", [job], ledger, at_most_once=False)


def test_a_stuck_attempt_is_reported_never_handed_over_and_ended_only_on_request(
    dsn: str, conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "short", job_timeout=3, lease_timeout=4)
    frozen = workers.start("short")
    job = pglane.enqueue(conn, "short", {"sleep": 2.5})  # long enough to be stopped in, on a loaded machine
    wait_until(lambda: job in ledger.calls(), 20, "the call")
    frozen.send_signal(signal.SIGSTOP)  # hung, with its session still connected
    try:
        lane_row = wait_until(
            lambda: next((r for r in pglane.lane_status(conn) if r["lane"] == "short" and r["stuck"]), None),
            20, "the lease to pass")
        assert "--terminate-stuck" in lane_row["next_safe_action"]
        assert "inspect stuck attempt" in pglane.job_status(conn, job)["next_safe_action"]
        assert pglane.recover(conn, "short") == 0  # alive: never handed over by a timer
        plain = subprocess.run([sys.executable, "-m", "pglane", "--dsn", dsn, "recover", "short"],
                               capture_output=True, text=True, cwd=ROOT)
        assert plain.stdout.startswith("nothing to recover") and "past its lease" in plain.stderr
        ended = subprocess.run([sys.executable, "-m", "pglane", "--dsn", dsn, "recover", "short",
                                "--terminate-stuck"], capture_output=True, text=True, cwd=ROOT)
        assert ended.returncode == 0 and ended.stdout.startswith("marked 1 attempt(s)"), ended.stderr
        assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
    finally:
        frozen.send_signal(signal.SIGCONT)
    # Thawed, it finds its session ended and delivers its outcome, whichever of its clocks ran out first:
    # a late result (accepted), a job time-out (refused: the attempt was ended as lost), or the hard
    # time-out (refused too, and the process exits 75). Then it holds the slot again, or has exited.
    wait_until(lambda: frozen.poll() is not None or Workers.log(frozen).count("holding slot 1") == 2, 20,
               "the thawed worker to settle")
    assert ledger.calls().count(job) == 1
    check_invariants(conn, "short", [job], ledger)


def test_a_lock_timeout_inside_complete_rolls_back_cleanly(session: Any, lane: str) -> None:
    worker, blocker = session(), session(autocommit=False)
    job = pglane.enqueue(worker, lane, {})
    take_slot(worker, lane)
    row = claimed(worker, lane)
    blocker.execute("SELECT 1 FROM pglane.jobs WHERE id = %s FOR UPDATE", (job,))
    worker.execute("SET lock_timeout = '100ms'")
    with pytest.raises(psycopg.errors.LockNotAvailable):
        worker.execute("SELECT pglane.complete(%s, '{\"a\": 1}')", (row["attempt_id"],))
    blocker.rollback()
    state = worker.execute("SELECT j.status, a.status AS attempt FROM pglane.jobs j JOIN pglane.attempts a"
                           " ON a.job_id = j.id").fetchone()
    assert state == {"status": "running", "attempt": "running"}
    assert worker.execute("SELECT pglane.complete(%s, '{\"a\": 1}') AS ok", (row["attempt_id"],)).fetchone()["ok"]


def test_a_statement_timeout_inside_claim_consumes_no_seq_and_claims_nothing(session: Any, lane: str) -> None:
    worker, blocker = session(), session(autocommit=False)
    pglane.enqueue(worker, lane, {})
    take_slot(worker, lane)
    blocker.execute("SELECT 1 FROM pglane.lane_counters FOR UPDATE")
    worker.execute("SET statement_timeout = '100ms'")
    with pytest.raises(psycopg.errors.QueryCanceled):
        claim(worker, lane)
    blocker.rollback()
    worker.execute("RESET statement_timeout")
    assert worker.execute("SELECT status FROM pglane.jobs").fetchone()["status"] == "queued"
    assert worker.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()["n"] == 0
    row = claimed(worker, lane)
    assert row["seq"] == 1  # the cancelled claim gave its number back
