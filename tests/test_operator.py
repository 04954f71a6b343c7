"""The operator's surface: one query tells the state and the next safe action of every lane and job,
from the database clock; bounded lanes; retry and cancel only where allowed; pruning; metrics."""

from __future__ import annotations

import functools
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import pglane
from pglane import queries
from tests.conftest import (
    Workers,
    claim,
    claimed,
    concurrently,
    metrics_port,
    scrape,
    take_slot,
    wait_session_gone,
    wait_until,
)


def action(conn: Any, job: int) -> str:
    return str(pglane.job_status(conn, job)["next_safe_action"])


def lane_row(conn: Any, lane: str) -> dict[str, Any]:
    return next(r for r in pglane.lane_status(conn) if r["lane"] == lane)


def hold_slot(session: Any, lane: str, slot: int = 1) -> Any:
    """A new session holding a slot of the lane, as a worker's would."""
    s = session()
    take_slot(s, lane, slot)
    return s


def age(conn: Any, job: int, seconds: float) -> None:
    """Make a job look queued ``seconds`` ago (explicit timestamps instead of sleeping)."""
    conn.execute("UPDATE pglane.jobs SET created_at = now() - make_interval(secs => %s),"
                 " run_after = now() - make_interval(secs => %s) WHERE id = %s", (seconds, seconds, job))


def test_waiting_for_worker_honours_the_grace_on_both_sides_of_the_boundary(session: Any, lane: str) -> None:
    s = session(autocommit=False)
    job = pglane.enqueue(s, lane, {})
    s.commit()
    # One transaction: now() is the same instant for the update and the view.
    s.execute("UPDATE pglane.jobs SET created_at = now() - interval '5 seconds',"
              " run_after = now() - interval '5 seconds' WHERE id = %s", (job,))
    at_boundary = pglane.job_status(s, job)["waiting_for_worker"]
    s.execute("UPDATE pglane.jobs SET created_at = now() - interval '5.000001 seconds',"
              " run_after = now() - interval '5.000001 seconds' WHERE id = %s", (job,))
    past_boundary = pglane.job_status(s, job)["waiting_for_worker"]
    s.rollback()
    assert (at_boundary, past_boundary) == (False, True)


def test_waiting_counts_from_eligibility_not_from_creation(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '1 hour', run_after = now() - interval '1 s'"
                 " WHERE id = %s", (job,))
    assert pglane.job_status(conn, job)["waiting_for_worker"] is False
    conn.execute("UPDATE pglane.lanes SET waiting_grace = interval '0'")
    assert pglane.job_status(conn, job)["waiting_for_worker"] is True


def test_every_job_state_has_its_next_safe_action(session: Any, conn: Any, lane: str) -> None:
    fresh = pglane.enqueue(conn, lane, {})
    assert action(conn, fresh) == "nothing to do: just queued"
    age(conn, fresh, 60)
    assert action(conn, fresh).startswith("start a worker for lane brain")
    later = conn.execute("SELECT pglane.enqueue('brain', '{}', NULL, now() + interval '1 hour') AS id").fetchone()["id"]
    assert action(conn, later).startswith("nothing to do: scheduled to run after")

    holder = hold_slot(session, lane)
    running = claimed(holder, lane)
    assert running["job_id"] == fresh
    assert action(conn, fresh) == "nothing to do: running"
    waiting = pglane.enqueue(conn, lane, {})
    age(conn, waiting, 60)
    assert action(conn, waiting).startswith("wait: every slot of lane brain is busy")

    conn.execute("UPDATE pglane.attempts SET lease_expires_at = now() - interval '1 s' WHERE id = %s",
                 (running["attempt_id"],))
    assert action(conn, fresh).startswith(f"inspect stuck attempt {running['attempt_id']}: past its lease")
    assert "--terminate-stuck" in action(conn, fresh)

    holder.close()  # the worker's session ends in the middle of the call (the backend exits a moment later)
    gone = f"run: pglane recover brain (the worker of attempt {running['attempt_id']} is gone)"
    wait_until(lambda: action(conn, fresh) == gone, 10, "the session to be gone")
    pglane.recover(conn, lane)
    assert action(conn, fresh) == (f"inspect attempt {running['attempt_id']}: worker lost during the call; "
                                   f"retry only if you accept paying again: pglane retry {fresh}")

    holder = hold_slot(session, lane)
    timed = claimed(holder, lane)
    holder.execute("SELECT pglane.fail(%s, 'timed out', true)", (timed["attempt_id"],))
    assert "ran past its job_timeout (its own, else the lane's)" in action(conn, timed["job_id"])
    pglane.enqueue(conn, lane, {})
    failing = claimed(holder, lane)
    assert failing is not None
    pglane.cancel(conn, later)
    assert action(conn, later) == f"nothing to do: cancelled (pglane retry {later} runs it after all)"
    holder.execute("SELECT pglane.fail(%s, 'boom')", (failing["attempt_id"],))
    assert action(conn, failing["job_id"]).startswith(f"inspect attempt {failing['attempt_id']}: the handler failed")
    done = pglane.enqueue(conn, lane, {})
    finished = claimed(holder, lane)
    assert finished["job_id"] == done
    holder.execute("SELECT pglane.complete(%s, '{}')", (finished["attempt_id"],))
    assert action(conn, done) == "nothing to do: done, result stored"


def test_every_lane_state_has_its_next_safe_action(session: Any, conn: Any, lane: str) -> None:
    assert lane_row(conn, lane)["next_safe_action"].startswith("nothing queued; start a worker for lane brain")
    job = pglane.enqueue(conn, lane, {})
    assert lane_row(conn, lane)["next_safe_action"].startswith("start a worker for lane brain")
    holder = hold_slot(session, lane)
    row = lane_row(conn, lane)
    assert (row["consumers"], row["next_safe_action"]) == (1, "nothing to do")
    attempt = claimed(holder, lane)["attempt_id"]
    conn.execute("UPDATE pglane.attempts SET lease_expires_at = now() - interval '1 s' WHERE id = %s", (attempt,))
    assert lane_row(conn, lane)["next_safe_action"].startswith("inspect 1 stuck attempt(s)")
    holder.close()
    wait_until(lambda: lane_row(conn, lane)["next_safe_action"].startswith(
        "run: pglane recover brain (1 running attempt(s)"), 10, "the session to be gone")
    pglane.recover(conn, lane)
    assert pglane.job_status(conn, job)["status"] == "failed"
    holder = hold_slot(session, lane)
    backlog = [pglane.enqueue(conn, lane, {}) for _ in range(3)]
    for j in backlog:
        age(conn, j, 60)
    # arrived within the last 5 minutes, waited a minute with every slot busy, and nothing finishing
    assert lane_row(conn, lane)["next_safe_action"].startswith("backlog of lane brain is growing")


def test_lane_status_counts_each_status_of_its_own_lane_only(session: Any, conn: Any, lane: str) -> None:
    pglane.create_lane(conn, "other")
    pglane.enqueue(conn, "other", {})  # another lane's job is counted there, not here
    jobs = [pglane.enqueue(conn, lane, {"n": n}) for n in range(15)]
    holder = hold_slot(session, lane)
    # A different number of jobs in each status, so that no two counts can be swapped unseen.
    want = {"done": 3, "failed": 2, "running": 1, "cancelled": 4, "queued": 5}
    for _ in range(want["done"]):
        assert holder.execute("SELECT pglane.complete(%s, '1')", (claimed(holder, lane)["attempt_id"],)).fetchone()
    for _ in range(want["failed"]):
        assert holder.execute("SELECT pglane.fail(%s, 'boom')", (claimed(holder, lane)["attempt_id"],)).fetchone()
    claimed(holder, lane)
    for job in jobs[-want["cancelled"]:]:
        assert pglane.cancel(conn, job)
    states = [pglane.job_status(conn, j)["status"] for j in jobs]
    assert {k: states.count(k) for k in want} == want
    row = lane_row(conn, lane)
    assert {k: row[k] for k in want} == want
    other = lane_row(conn, "other")
    assert {k: other[k] for k in want} == {"done": 0, "failed": 0, "running": 0, "cancelled": 0, "queued": 1}


def test_queue_positions_count_from_one_in_service_order_under_concurrent_producers(
    dsn: str, conn: Any, lane: str
) -> None:
    def produce() -> None:
        with pglane.connect(dsn) as c:
            for _ in range(25):
                pglane.enqueue(c, lane, {})

    concurrently([produce] * 4)
    rows = conn.execute("SELECT job_id, queue_position FROM pglane.job_status ORDER BY queue_position").fetchall()
    assert [r["queue_position"] for r in rows] == list(range(1, 101))
    service = [r["id"] for r in conn.execute(  # service order (docs/design.md), as the claim's pick says it
        "SELECT id FROM pglane.jobs WHERE status = 'queued' ORDER BY priority DESC, fair_rank, created_at, id")]
    assert [r["job_id"] for r in rows] == service
    take_slot(conn, lane)
    first = claimed(conn, lane)
    assert first["job_id"] == service[0]
    assert pglane.job_status(conn, service[1])["queue_position"] == 1


def test_the_jobs_listing_shows_queued_jobs_in_the_order_they_will_be_served(session: Any, conn: Any,
                                                                              lane: str) -> None:
    later = pglane.enqueue(conn, lane, {}, run_after=datetime.now(UTC) + timedelta(seconds=60))
    pair = [r["id"] for r in conn.execute(  # one statement: the same created_at, served by id
        "INSERT INTO pglane.jobs (lane) VALUES (%s), (%s) RETURNING id", (lane, lane)).fetchall()]
    holder = hold_slot(session, lane)
    started = pglane.enqueue(conn, lane, {}, priority=1)  # first in service order: running, not queued
    assert claimed(holder, lane)["job_id"] == started
    listed = pglane.jobs(conn, lane=lane, status="queued")
    assert [r["job_id"] for r in listed] == [*pair, later]
    assert [r["queue_position"] for r in listed] == [1, 2, 3]
    everything = [r["job_id"] for r in pglane.jobs(conn, lane=lane)]
    assert everything == [*pair, later, started]  # queued first in service order, then the rest


def test_a_bounded_lane_never_holds_more_than_max_queued_under_concurrent_producers(
    dsn: str, conn: Any
) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=10, max_queued=50)
    accepted, refused = [], []
    lock = threading.Lock()

    def produce(n: int) -> None:
        with pglane.connect(dsn) as c:
            for i in range(20):
                try:
                    if i % 2:
                        pglane.enqueue(c, "bounded", {"n": n, "i": i})
                    else:
                        c.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('bounded', '{}')")
                    with lock:
                        accepted.append(1)
                except pglane.LaneFull:
                    with lock:
                        refused.append(1)
                except psycopg.Error as exc:  # a plain INSERT's refusal arrives untranslated
                    assert isinstance(pglane.errors.translate(exc), pglane.LaneFull), exc
                    with lock:
                        refused.append(1)

    concurrently([functools.partial(produce, n) for n in range(8)])
    queued = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status = 'queued'").fetchone()["n"]
    assert (len(accepted), len(refused), queued) == (50, 110, 50)
    row = lane_row(conn, "bounded")
    assert (row["queued"], row["max_queued"]) == (50, 50)


def test_a_lane_made_bounded_later_counts_the_jobs_it_already_has(conn: Any, lane: str) -> None:
    for _ in range(3):
        pglane.enqueue(conn, lane, {})
    conn.execute("UPDATE pglane.lanes SET max_queued = 4 WHERE name = 'brain'")
    pglane.enqueue(conn, lane, {})
    with pytest.raises(pglane.LaneFull):
        pglane.enqueue(conn, lane, {})


def depth(conn: Any, lane: str) -> tuple[int, int]:
    """(jobs queued in the lane, the bounded lane's counter): the two must agree."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM pglane.jobs j WHERE j.lane = l.name AND j.status = 'queued') AS real,"
        " a.admitted - c.left_queue AS counted FROM pglane.lanes l JOIN pglane.lane_counters c ON c.lane_id = l.id"
        " JOIN pglane.lane_admissions a ON a.lane_id = l.id"
        " WHERE l.name = %s", (lane,)).fetchone()
    return int(row["real"]), int(row["counted"])


def test_max_queued_holds_for_jobs_coming_back_to_the_queue(session: Any, conn: Any) -> None:
    lane = "bounded"
    pglane.create_lane(conn, lane, job_timeout=20, max_attempts=3, max_queued=2, retry_backoff=0)
    holder = hold_slot(session, lane)
    first = pglane.enqueue(conn, lane, {})
    attempt = claimed(holder, lane)["attempt_id"]
    waiting = [pglane.enqueue(conn, lane, {}) for _ in range(2)]  # the lane is full again
    assert depth(conn, lane) == (2, 2)

    # A failed attempt with attempts left: failed, not re-queued past the bound, and told why.
    assert holder.execute("SELECT pglane.fail(%s, 'boom') AS ok", (attempt,)).fetchone()["ok"] is True
    job = pglane.job_status(conn, first)
    assert job["status"] == "failed"
    assert job["last_error"] == f"boom; not re-queued: lane {lane} is full (max_queued 2); run it again when" \
        f" there is room: pglane retry {first}"
    assert depth(conn, lane) == (2, 2)

    # An operator's retry into the full lane: refused, nothing changed.
    with pytest.raises(pglane.LaneFull, match=f"lane '{lane}' is full: job {first} stays failed"):
        pglane.retry(conn, first)
    assert pglane.job_status(conn, first)["status"] == "failed"
    assert depth(conn, lane) == (2, 2)

    # A lost worker on an at-least-once lane that is full: failed with the reason, the bound holds.
    lost = claimed(holder, lane)
    pglane.enqueue(conn, lane, {})
    pid = holder.info.backend_pid
    holder.close()  # the backend exits a moment later: recovery needs the evidence that it is gone
    wait_session_gone(conn, pid)
    assert pglane.recover(conn, lane) == 1
    job = pglane.job_status(conn, lost["job_id"])
    assert job["status"] == "failed" and job["attempt_status"] == "lost"
    assert f"not re-queued: lane {lane} is full (max_queued 2)" in job["last_error"]
    assert f"pglane retry {lost['job_id']}" in job["last_error"]
    assert depth(conn, lane) == (2, 2)

    # Room again: the same retry goes through and takes the freed place.
    pglane.cancel(conn, waiting[1])
    assert depth(conn, lane) == (1, 1)
    assert pglane.retry(conn, first) is True
    assert pglane.job_status(conn, first)["status"] == "queued"
    assert depth(conn, lane) == (2, 2)


def test_an_unbounded_lane_still_requeues_a_failed_attempt(session: Any, conn: Any) -> None:
    pglane.create_lane(conn, "open", job_timeout=20, max_attempts=2, retry_backoff=0)
    holder = hold_slot(session, "open")
    job = pglane.enqueue(conn, "open", {})
    holder.execute("SELECT pglane.fail(%s, 'boom')", (claimed(holder, "open")["attempt_id"],))
    row = pglane.job_status(conn, job)
    assert (row["status"], row["last_error"]) == ("queued", "boom")


@pytest.mark.parametrize(
    ("status", "retry_ok", "cancel_ok"),
    [("queued", False, True), ("running", False, False), ("done", False, False),
     ("failed", True, False), ("cancelled", True, False)],
)
def test_retry_and_cancel_only_where_they_are_allowed(
    session: Any, conn: Any, lane: str, status: str, retry_ok: bool, cancel_ok: bool
) -> None:
    job = pglane.enqueue(conn, lane, {})
    if status != "queued":
        holder = hold_slot(session, lane)
        attempt = claimed(holder, lane)["attempt_id"]
        if status == "done":
            holder.execute("SELECT pglane.complete(%s, '{}')", (attempt,))
        elif status == "failed":
            holder.execute("SELECT pglane.fail(%s, 'boom')", (attempt,))
        elif status == "cancelled":
            holder.execute("SELECT pglane.fail(%s, 'boom')", (attempt,))
            pglane.retry(conn, job)
            pglane.cancel(conn, job)
    assert pglane.job_status(conn, job)["status"] == status
    for op, allowed, after in ((pglane.retry, retry_ok, "queued"), (pglane.cancel, cancel_ok, "cancelled")):
        before = pglane.job_status(conn, job)["status"]
        if allowed:
            assert op(conn, job) is True
            assert pglane.job_status(conn, job)["status"] == after
            conn.execute("UPDATE pglane.jobs SET status = %s, failed_or_cancelled = %s IN ('failed', 'cancelled')"
                         " WHERE id = %s", (before, before, job))  # restore, as pglane's functions write it
        else:
            with pytest.raises(pglane.InvalidTransition, match=f"job {job} is {before}; only"):
                op(conn, job)
            assert pglane.job_status(conn, job)["status"] == before


def test_retrying_a_done_job_says_why_not(session: Any, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    holder = hold_slot(session, lane)
    holder.execute("SELECT pglane.complete(%s, '{}')", (claimed(holder, lane)["attempt_id"],))
    with pytest.raises(pglane.InvalidTransition, match="its result is stored; enqueue a new job with a new key"):
        pglane.retry(conn, job)


def test_prune_removes_old_finished_jobs_but_keeps_failures_unless_asked(session: Any, conn: Any, lane: str) -> None:
    holder = hold_slot(session, lane)
    done, failed, cancelled, recent = (pglane.enqueue(conn, lane, {}, key=k) for k in "abcd")
    holder.execute("SELECT pglane.complete(%s, '{}')", (claimed(holder, lane)["attempt_id"],))
    holder.execute("SELECT pglane.fail(%s, 'boom')", (claimed(holder, lane)["attempt_id"],))
    pglane.cancel(conn, cancelled)
    holder.execute("SELECT pglane.complete(%s, '{}')", (claimed(holder, lane)["attempt_id"],))
    conn.execute("UPDATE pglane.jobs SET finished_at = now() - interval '8 days' WHERE id <> %s", (recent,))
    assert pglane.prune(conn, 7 * 86400) == 2
    left = {r["id"] for r in conn.execute("SELECT id FROM pglane.jobs")}
    assert left == {failed, recent}
    assert conn.execute("SELECT count(*) AS n FROM pglane.attempts WHERE job_id = %s", (failed,)).fetchone()["n"] == 1
    assert pglane.prune(conn, 7 * 86400, include_failed=True) == 1
    with pytest.raises(pglane.JobPruned) as kept:  # a pruned key is remembered for the lane's key retention
        pglane.enqueue(conn, lane, {}, key="a")
    assert kept.value.job_id == done
    pglane.prune(conn, 7 * 86400, forget_keys=True)  # forgotten only when the operator says so
    assert pglane.enqueue(conn, lane, {}, key="a") not in (done, failed)


def test_the_queue_gauges_count_this_lanes_queued_and_running_jobs_only(conn: Any, lane: str) -> None:
    pglane.create_lane(conn, "other", job_timeout=20)
    for name in (lane, "other"):
        for _ in range(3):
            pglane.enqueue(conn, name, {})
        take_slot(conn, name)
        assert claim(conn, name) is not None
    done = claim(conn, lane)
    assert done is not None and conn.execute("SELECT pglane.complete(%s)", (done["attempt_id"],)).fetchone()
    row = conn.execute(queries.QUEUE_GAUGES, {"lane": lane}).fetchone()
    # brain: 3 enqueued, 2 claimed, the second completed; other: 2 queued, 1 running (not counted here)
    assert (row["queued"], row["running"]) == (1, 1)
    assert row["oldest"] >= 0


def test_the_metrics_endpoint_is_scraped_over_http(conn: Any, lane: str, workers: Workers) -> None:
    for _ in range(3):
        pglane.enqueue(conn, lane, {"sleep": 0.01})
    pglane.enqueue(conn, lane, {"fail": "boom"})
    port = metrics_port(workers.start(lane, "tests.handlers:paid_call", "--metrics-port", "0"))
    metrics = wait_until(lambda: (m := scrape(port)) and m.get("pglane_jobs_done_total") == 3
                         and m.get("pglane_jobs_failed_total") == 1 and m, 20, "metrics")
    assert metrics["pglane_slot_held"] == 1
    assert metrics["pglane_jobs_failed_total"] == 1
    assert metrics["pglane_attempt_duration_seconds_count"] == 4
    assert metrics["pglane_claim_latency_seconds_count"] >= 4
    assert "pglane_queue_depth" in metrics and "pglane_oldest_queued_age_seconds" in metrics
    assert "pglane_running_jobs" in metrics
