"""SIGKILL at every cut of the crash timeline (docs/design.md), with real processes: the producer before
and after its enqueue commits, the worker after the claim, after the paid call, after the output is
stored. A new worker takes the slot each time; recovery is by evidence only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pglane
from tests.conftest import ROOT, Ledger, Workers, claim, slot_holder, take_slot, wait_until
from tests.crash.conftest import check_invariants, drained

PRODUCER = """
import os, sys, pglane
conn = pglane.connect(os.environ["PGLANE_DSN"])
conn.autocommit = False
job = pglane.enqueue(conn, "brain", {"q": "report-7"}, key="report-7")
if sys.argv[1] == "after":
    conn.commit()
print(job, flush=True)
sys.stdin.read()  # wait to be killed
"""


def producer(dsn: str, cut: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PRODUCER, cut], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, PGLANE_DSN=dsn), cwd=ROOT)


def kill(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_producer_killed_before_its_enqueue_commits_leaves_nothing_and_a_retry_makes_one_job(
    dsn: str, conn: Any, lane: str
) -> None:
    proc = producer(dsn, "before")
    assert proc.stdout is not None and proc.stdout.readline().strip()
    kill(proc)
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0
    first = pglane.enqueue(conn, lane, {"q": "report-7"}, key="report-7")  # the client retries with the key
    assert pglane.enqueue(conn, lane, {"q": "report-7"}, key="report-7") == first
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 1


def test_producer_killed_after_its_enqueue_commits_leaves_a_job_that_runs_once(
    dsn: str, conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    proc = producer(dsn, "after")
    assert proc.stdout is not None
    job = int(proc.stdout.readline())
    kill(proc)
    assert pglane.enqueue(conn, lane, {"q": "report-7"}, key="report-7") == job  # a retry finds it
    workers.start(lane)
    drained(conn, lane, [job])
    assert pglane.job_status(conn, job)["status"] == "done" and ledger.calls() == [job]
    check_invariants(conn, lane, [job], ledger)


def kill_at(conn: Any, lane: str, workers: Workers, ledger: Ledger, payload: dict[str, Any], event: str) -> int:
    """Run one job, SIGKILL the worker once the ledger shows ``event`` for it, and let a new worker
    take the slot and recover. Returns the job id."""
    victim = workers.start(lane)
    job = pglane.enqueue(conn, lane, payload, key="the-job")
    wait_until(lambda: job in [j for e, j, _, _ in ledger.events() if e == event], 20, f"the {event} event")
    victim_session = slot_holder(conn, lane)
    kill(victim)
    assert pglane.job_status(conn, job)["status"] == "running"  # the database has not been told yet
    workers.start(lane)
    wait_until(lambda: slot_holder(conn, lane) not in ([], victim_session), 20, "a new worker to take the slot")
    wait_until(lambda: pglane.job_status(conn, job)["status"] != "running", 20, "recovery on taking the slot")
    return job


def assert_lost_and_not_rerun(conn: Any, lane: str, job: int, ledger: Ledger, paid_calls: int) -> None:
    row = pglane.job_status(conn, job)
    assert row["status"] == "failed"
    assert "the paid call may have been made" in row["last_error"]
    assert "not re-run automatically" in row["last_error"]
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
    assert "retry only if you accept paying again" in row["next_safe_action"]
    # A repeated request returns the failed job; nothing runs again.
    assert pglane.enqueue(conn, lane, {"hold_before": 30} if paid_calls == 0 else {"hold_after": 30},
                          key="the-job") == job
    follow = pglane.enqueue(conn, lane, {})
    drained(conn, lane, [follow])  # the lane moved on
    assert ledger.calls().count(job) == paid_calls
    check_invariants(conn, lane, [job, follow], ledger)


def test_worker_killed_after_the_claim_before_the_call(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    job = kill_at(conn, lane, workers, ledger, {"hold_before": 30}, "claimed")
    assert_lost_and_not_rerun(conn, lane, job, ledger, paid_calls=0)


def test_worker_killed_after_the_paid_call_before_its_output_is_stored(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    job = kill_at(conn, lane, workers, ledger, {"hold_after": 30}, "end")
    assert_lost_and_not_rerun(conn, lane, job, ledger, paid_calls=1)


def test_worker_killed_after_its_output_is_stored(conn: Any, lane: str, workers: Workers, ledger: Ledger) -> None:
    victim = workers.start(lane)
    job = pglane.enqueue(conn, lane, {"result": {"answer": 42}}, key="the-job")
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 20, "the output to be stored")
    kill(victim)
    workers.start(lane)
    wait_until(lambda: slot_holder(conn, lane), 20, "a new worker")
    assert pglane.enqueue(conn, lane, {"result": {"answer": 42}}, key="the-job") == job
    assert pglane.result(conn, job) == {"answer": 42}
    assert ledger.calls() == [job]
    check_invariants(conn, lane, [job], ledger)


def test_on_an_at_least_once_lane_a_lost_attempt_is_queued_again_and_runs_once_more(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "retrying", job_timeout=20, max_attempts=2)
    victim = workers.start("retrying")
    job = pglane.enqueue(conn, "retrying", {"sleep": 3.0})  # killed in the call, even on a loaded machine
    wait_until(lambda: job in ledger.calls(), 20, "the call")
    kill(victim)
    workers.start("retrying")
    drained(conn, "retrying", [job])
    assert pglane.job_status(conn, job)["status"] == "done"
    assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost", "done"]
    assert ledger.calls() == [job, job]  # at least once: the second call is the lane owner's choice
    check_invariants(conn, "retrying", [job], ledger, at_most_once=False)


def test_a_poison_job_that_kills_its_worker_fails_once_and_never_wedges_the_lane(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    poison = pglane.enqueue(conn, lane, {"poison": True})
    after = [pglane.enqueue(conn, lane, {}) for _ in range(3)]
    first = workers.start(lane)
    first.wait(20)  # it killed itself in the middle of the call
    workers.start(lane)  # the supervisor restarts it
    drained(conn, lane, [poison, *after])
    assert pglane.job_status(conn, poison)["status"] == "failed"
    assert [pglane.job_status(conn, j)["status"] for j in after] == ["done"] * 3
    assert ledger.calls().count(poison) == 1
    check_invariants(conn, lane, [poison, *after], ledger)


def test_a_busy_worker_recovers_a_dead_peers_attempt_periodically(
    dsn: str, conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "pair", slots=2, job_timeout=20)
    orphan = pglane.enqueue(conn, "pair", {})
    peer = pglane.connect(dsn)  # a peer holding slot 2 claims a job
    take_slot(peer, "pair", 2)
    claimed = claim(peer, "pair")
    assert claimed is not None and claimed["job_id"] == orphan
    busy = [pglane.enqueue(conn, "pair", {"sleep": 0.02}) for _ in range(400)]
    workers.start("pair", "tests.handlers:paid_call", "--recover-interval", "0.5")
    wait_until(lambda: len(ledger.calls()) >= 10, 20, "the worker to be busy")
    assert pglane.job_status(conn, orphan)["status"] == "running"  # its peer is alive: nothing to recover
    peer.close()  # ... and now dies without a word, while the worker is busy
    wait_until(lambda: pglane.job_status(conn, orphan)["status"] == "failed", 20, "the periodic recovery")
    still_busy = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE id = ANY(%s) AND status = 'queued'",
                              (busy,)).fetchone()["n"]
    assert still_busy > 0  # recovered while the worker was draining, not only when idle
    drained(conn, "pair", busy, timeout=120)
    check_invariants(conn, "pair", [orphan, *busy], ledger)
