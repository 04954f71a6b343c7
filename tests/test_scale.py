"""The operator's surface at scale: a full lane refuses a producer cheaply (skip: nothing written, no
ERROR in the server's log, the bound still exact under races), and a prune runs in bounded batches
that can be interrupted and resumed, with lane_status exact after it."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import pglane
from pglane import queries
from tests.conftest import claim, lane_id, take_slot
from tests.test_cli import run


@pytest.fixture
def server_log(postgresql_proc: Any) -> Path:
    logfile = getattr(postgresql_proc, "logfile", None)
    if not logfile or not Path(logfile).is_file():
        pytest.skip("the server's log is not readable here (PGLANE_TEST_DSN names an outside server)")
    return Path(logfile)


def test_a_full_lane_skips_a_producer_without_writing_or_logging_an_error(
    conn: Any, dsn: str, server_log: Path
) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=20, max_queued=2)
    kept = [pglane.enqueue(conn, "bounded", {"n": n}) for n in range(2)]
    marker = f"skip-{uuid.uuid4()}"
    before = server_log.read_text(errors="replace").count("ERROR")
    for _ in range(50):
        assert pglane.enqueue(conn, "bounded", {"m": marker}, if_full="skip") is None
    assert pglane.enqueue(conn, "bounded", {"m": marker}, key="k", if_full="skip") is None
    conn.execute("SELECT 1")  # the log is written by now
    assert server_log.read_text(errors="replace").count("ERROR") == before
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 2
    with pytest.raises(pglane.LaneFull):
        pglane.enqueue(conn, "bounded", {})  # the default still raises
    done = run("enqueue", "bounded", "{}", "--if-full", "skip", dsn=dsn)
    assert done.returncode == 3 and "lane bounded is full" in done.stderr
    # A repeated key is answered with its job, full lane or not; room again takes the next one.
    take_slot(conn, "bounded")
    assert claim(conn, "bounded") is not None
    assert pglane.enqueue(conn, "bounded", {"n": 2}, if_full="skip") not in (None, *kept)


def test_the_bound_holds_exactly_when_producers_race_with_skip(dsn: str, conn: Any) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=20, max_queued=5)
    results: list[int | None] = []
    lock = threading.Lock()

    def produce() -> None:
        with pglane.connect(dsn) as c:
            for _ in range(5):
                job = pglane.enqueue(c, "bounded", {}, if_full="skip")
                with lock:
                    results.append(job)

    threads = [threading.Thread(target=produce) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(1 for r in results if r is not None) == 5 and len(results) == 40
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 5


def finished_jobs(conn: Any, lane: str, n: int, status: str = "done") -> list[int]:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, '{}' FROM generate_series(1, %s)", (lane, n))
    rows = conn.execute("UPDATE pglane.jobs SET status = %s, failed_or_cancelled = %s IN ('failed', 'cancelled'),"
                        " finished_at = now() - interval '1 day' WHERE lane = %s AND status = 'queued' RETURNING id",
                        (status, status, lane)).fetchall()
    return [r["id"] for r in rows]


def test_a_prune_in_batches_deletes_what_prune_would_and_reports_progress(conn: Any, lane: str) -> None:
    finished_jobs(conn, lane, 50)
    finished_jobs(conn, lane, 5, "failed")
    queued = pglane.enqueue(conn, lane, {})
    seen: list[int] = []
    assert pglane.prune(conn, 3600, batch=7, progress=seen.append) == 50
    assert seen == [7, 14, 21, 28, 35, 42, 49, 50]
    status = next(r for r in pglane.lane_status(conn) if r["lane"] == lane)
    assert (status["done"], status["failed"], status["queued"]) == (0, 5, 1)
    assert pglane.job_status(conn, queued)["status"] == "queued"


def test_an_interrupted_prune_loses_nothing_and_a_second_run_finishes_it(conn: Any, lane: str, dsn: str) -> None:
    finished_jobs(conn, lane, 40)
    step = conn.execute("SELECT * FROM pglane.prune_batch(interval '1 hour', NULL, false, 0, 15)").fetchone()
    assert step["deleted"] == 15  # then the prune is interrupted: each step was its own transaction
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 25
    done = run("prune", "--older-than", "1h", "--batch", "10", dsn=dsn)
    assert done.returncode == 0
    assert done.stdout.startswith("pruned 25 finished job(s) older than 1h, with their attempts;"
                                    " their idempotency keys are remembered")
    assert "pruned 25 of 25 jobs (100%)" in done.stderr  # not a terminal: plain lines
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0


def test_a_bad_batch_is_refused_with_what_to_give(dsn: str, lane: str) -> None:
    done = run("prune", "--older-than", "1h", "--batch", "0", dsn=dsn)
    assert done.returncode == 2 and "--batch must be at least 1" in done.stderr


# ----- listings cost what they list (#19, point 1) ---------------------------------------------------

def deep_queue(conn: Any, lane: str, eligible: int, scheduled: int) -> None:
    """``eligible`` queued jobs and ``scheduled`` ones (run_after in the future, latest first, so that
    id order is not service order), each set in one INSERT ... SELECT through the producers' path."""
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(1, %s) g", (lane, eligible))
    conn.execute("INSERT INTO pglane.jobs (lane, payload, run_after)"
                 " SELECT %s, jsonb_build_object('s', g), now() + interval '1 hour' - g * interval '1 second'"
                 " FROM generate_series(1, %s) g", (lane, scheduled))


def service_order(conn: Any, lane: str) -> list[int]:
    """The lane's queued jobs in the order the claim serves them: eligible ones by created_at and id,
    then the scheduled ones by run_after (then created_at and id)."""
    rows = conn.execute("SELECT id FROM pglane.jobs WHERE lane = %s AND status = 'queued'"
                        " ORDER BY run_after > now(), CASE WHEN run_after > now() THEN run_after END, created_at, id",
                        (lane,)).fetchall()
    return [r["id"] for r in rows]


def test_a_deep_queue_is_listed_in_service_order_with_the_positions_one_job_reads(conn: Any, lane: str) -> None:
    pglane.create_lane(conn, "other", job_timeout=20)
    deep_queue(conn, lane, 2500, 500)
    deep_queue(conn, "other", 300, 50)
    take_slot(conn, lane)
    claimed = [claim(conn, lane) for _ in range(3)]  # running now: out of the queue, and of the positions
    cancelled = service_order(conn, lane)[10]
    pglane.cancel(conn, cancelled)
    expected = service_order(conn, lane)
    assert len(expected) == 2500 + 500 - 3 - 1 and cancelled not in expected

    listed = pglane.jobs(conn, lane=lane, status="queued", limit=None)
    assert [r["job_id"] for r in listed] == expected
    assert [r["queue_position"] for r in listed] == list(range(1, len(expected) + 1))
    # One job's position, read alone through job_status, is the one the listing gave it.
    for index in (0, 1, 9, 10, 1999, 2495, 2496, len(expected) - 1):
        alone = pglane.job_status(conn, expected[index])
        assert alone["queue_position"] == index + 1 == listed[index]["queue_position"]
    # A limit lists the head of the same order; every lane at once counts each lane on its own.
    head = pglane.jobs(conn, lane=lane, status="queued", limit=50)
    assert [(r["job_id"], r["queue_position"]) for r in head] == [(r["job_id"], r["queue_position"])
                                                                   for r in listed[:50]]
    everything = pglane.jobs(conn, limit=None)
    other = [r for r in everything if r["lane"] == "other"]
    assert [r["job_id"] for r in other] == service_order(conn, "other")
    assert [r["queue_position"] for r in other] == list(range(1, 351))
    assert {r["job_id"]: r["queue_position"] for r in everything if r["lane"] == lane and r["status"] == "queued"} \
        == {r["job_id"]: r["queue_position"] for r in listed}
    finished = [r for r in everything if r["status"] != "queued"]
    assert {r["job_id"] for r in finished} == {c["job_id"] for c in claimed if c} | {cancelled}
    assert all(r["queue_position"] is None for r in finished)
    # The listing gives job_status's columns, in its order.
    columns = [c.name for c in conn.execute("SELECT * FROM pglane.job_status LIMIT 0").description]
    assert list(listed[0]) == columns
    volatile = {"waiting_for_worker", "next_safe_action"}  # they turn when the 5 s grace ends
    alone = pglane.job_status(conn, expected[0])
    assert {k: v for k, v in listed[0].items() if k not in volatile} == {k: v for k, v in alone.items()
                                                                         if k not in volatile}


@pytest.fixture
def producer(dsn: str, conn: Any) -> Iterator[Any]:
    """A connection acting as a member of pglane_producer (as tests/test_security.py's as_role makes)."""
    if not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("acting as a producer needs a superuser test connection to switch roles")
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_test_producer NOLOGIN;"
                 " EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    conn.execute("GRANT pglane_producer TO pglane_test_producer")
    with pglane.connect(dsn) as c:
        c.execute("SET ROLE pglane_test_producer")
        yield c


def test_a_producer_lists_its_own_jobs_with_positions_counted_among_everyone_s(
    conn: Any, lane: str, producer: Any
) -> None:
    deep_queue(conn, lane, 400, 0)  # someone else's jobs, ahead in the queue
    mine = [pglane.enqueue(producer, lane, {"mine": n}) for n in range(5)]
    deep_queue(conn, lane, 100, 0)
    listed = pglane.jobs(producer, lane=lane, status="queued", limit=None)
    assert [(r["job_id"], r["queue_position"]) for r in listed] == [(job, 401 + n) for n, job in enumerate(mine)]
    assert [pglane.job_status(producer, job)["queue_position"] for job in mine] == [401, 402, 403, 404, 405]
    # Called directly, the positions function tells a producer nothing of the jobs it did not enqueue.
    direct = producer.execute("SELECT job_id FROM pglane.queue_positions(%s) ORDER BY job_id", (lane,)).fetchall()
    assert [r["job_id"] for r in direct] == mine


def test_jobs_json_streams_the_whole_listing_from_a_server_side_cursor(conn: Any, lane: str, dsn: str) -> None:
    deep_queue(conn, lane, 2000, 10)
    done = run("jobs", "--lane", lane, "--json", "--limit", "0", dsn=dsn)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [r["job_id"] for r in rows] == service_order(conn, lane)
    assert [r["queue_position"] for r in rows] == list(range(1, 2011))
    assert json.loads(run("jobs", "--lane", lane, "--json", "--limit", "7", dsn=dsn).stdout) == rows[:7]
    assert json.loads(run("jobs", "--lane", "none-such", "--json", dsn=dsn).stdout) == []
    # The rows come batch by batch from a cursor on the server, never all at once.
    with pglane.connect(dsn) as reader:
        seen = 0
        for row in pglane.client.iter_jobs(reader, lane=lane, batch=100):
            if seen == 150:
                cursors = reader.execute("SELECT name FROM pg_cursors").fetchall()
                assert [c["name"] for c in cursors] == ["pglane_jobs"]
            assert row["queue_position"] == seen + 1
            seen += 1
        assert seen == 2010
        left = reader.execute("SELECT count(*) AS n FROM pg_cursors").fetchone()
        assert left is not None and left["n"] == 0


# ----- lane_status without the history (#19, point 2) -------------------------------------------------

COUNTED = ("queued", "running", "done", "failed", "cancelled")


def counts(conn: Any, lane: str) -> dict[str, int]:
    """lane_status's counts of the lane."""
    row = next(r for r in pglane.lane_status(conn) if r["lane"] == lane)
    return {k: row[k] for k in COUNTED}


def truth(conn: Any, lane: str) -> dict[str, int]:
    """The same counts, read from the whole history."""
    rows = conn.execute("SELECT status, count(*) AS n FROM pglane.jobs WHERE lane = %s GROUP BY status",
                        (lane,)).fetchall()
    found = {r["status"]: r["n"] for r in rows}
    return {k: found.get(k, 0) for k in COUNTED}


def test_lane_status_counts_stay_exact_through_claims_failures_cancels_retries_and_prunes(
    conn: Any, session: Any
) -> None:
    pglane.create_lane(conn, "counted", job_timeout=20, max_attempts=2, retry_backoff=0)
    pglane.create_lane(conn, "beside", job_timeout=20)
    deep_queue(conn, "counted", 300, 20)
    deep_queue(conn, "beside", 40, 0)
    worker = session()
    take_slot(worker, "counted")
    assert counts(conn, "counted") == truth(conn, "counted") == {
        "queued": 320, "running": 0, "done": 0, "failed": 0, "cancelled": 0}

    def check() -> None:
        assert counts(conn, "counted") == truth(conn, "counted")
        assert counts(conn, "beside") == truth(conn, "beside")

    def fail(row: dict[str, Any]) -> None:
        assert worker.execute(queries.FAIL, (row["attempt_id"], "boom", False, row["token"])).fetchone()["fail"]

    done = []
    row = claim(worker, "counted")
    for n in range(120):  # the worker's path (complete_and_claim), and plain claim and fail
        assert row is not None
        if n % 10 == 9:
            fail(row)  # back in the queue, at its head: it has one more attempt
            row = claim(worker, "counted")
        else:
            done.append(row["job_id"])
            row = worker.execute(queries.COMPLETE_AND_CLAIM, (row["attempt_id"], "null", "counted", "test",
                                                              row["token"])).fetchone()
            assert row is not None and row["completed"]
    running = row
    assert running is not None and counts(conn, "counted")["running"] == 1
    check()
    for _ in range(30):  # two failures each: the second fails the job
        row = claim(worker, "counted")
        assert row is not None
        fail(row)
        check()
    assert truth(conn, "counted")["failed"] == 15
    failed = [r["id"] for r in conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'counted' AND status = 'failed'"
                                            " ORDER BY id").fetchall()]
    queued = [r["id"] for r in conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'counted' AND status = 'queued'"
                                            " ORDER BY id LIMIT 25").fetchall()]
    for job in queued:
        assert pglane.cancel(conn, job)
    check()
    assert counts(conn, "counted")["cancelled"] == 25 and counts(conn, "counted")["failed"] == len(failed) > 0
    for job in (*failed[:3], *queued[:4]):  # retry: failed and cancelled jobs back in the queue
        assert pglane.retry(conn, job)
    check()
    assert flag_disagrees(conn) == 0
    assert worker.execute(queries.COMPLETE, (running["attempt_id"], "null", running["token"])).fetchone()["complete"]
    check()
    # Prunes, plain and in batches (finished long ago, so that they are old enough to go).
    conn.execute("UPDATE pglane.jobs SET finished_at = finished_at - interval '2 hours' WHERE id = ANY(%s)",
                 (done[:60],))
    assert pglane.prune(conn, 3600) == 60
    check()
    conn.execute("UPDATE pglane.jobs SET finished_at = now() - interval '2 hours' WHERE finished_at IS NOT NULL")
    pruned = pglane.prune(conn, 3600, batch=17, include_failed=True)
    assert pruned > 0
    check()
    assert {k: v for k, v in counts(conn, "counted").items() if k in ("done", "failed", "cancelled")} == {
        "done": 0, "failed": 0, "cancelled": 0}
    # A rolled back insert counts nothing; a TRUNCATE counts everything away.
    with pytest.raises(psycopg.errors.RaiseException), conn.transaction():
        deep_queue(conn, "counted", 50, 0)
        conn.execute("DO $$ BEGIN RAISE EXCEPTION 'changed my mind'; END $$")
    check()
    conn.execute("TRUNCATE pglane.attempts, pglane.jobs")
    check()
    deep_queue(conn, "counted", 5, 0)
    check()
    assert flag_disagrees(conn) == 0


def test_producers_in_open_transactions_do_not_wait_on_each_other_for_the_counts(conn: Any, lane: str, dsn: str
                                                                               ) -> None:
    deep_queue(conn, lane, 10, 0)
    with pglane.connect(dsn) as first, pglane.connect(dsn) as second:
        for c in (first, second):
            c.execute("SET lock_timeout = '2s'")  # waiting would fail the test, not hang it
        with first.transaction():
            pglane.enqueue(first, lane, {"a": 1})
            with second.transaction():
                pglane.enqueue(second, lane, {"b": 1})
                deep_queue(second, lane, 3, 0)
            with pytest.raises(psycopg.errors.RaiseException), second.transaction():
                pglane.enqueue(second, lane, {"c": 1})
                second.execute("DO $$ BEGIN RAISE EXCEPTION 'rolled back'; END $$")
            assert counts(conn, lane)["queued"] == truth(conn, lane)["queued"] == 14  # first's not yet committed
    assert counts(conn, lane) == truth(conn, lane) and truth(conn, lane)["queued"] == 15


def test_many_changes_in_one_statement_cost_each_the_same_and_fold(conn: Any, lane: str) -> None:
    deep_queue(conn, lane, 3000, 0)
    started = time.monotonic()
    conn.execute("UPDATE pglane.jobs SET status = 'cancelled', failed_or_cancelled = true, finished_at = now()"
                 " WHERE id <= 2000")
    assert time.monotonic() - started < 10  # one row at a time, never the statement's rows so far
    conn.execute("UPDATE pglane.jobs SET status = 'queued', failed_or_cancelled = false, finished_at = NULL"
                 " WHERE id <= 500")
    conn.execute("DELETE FROM pglane.jobs WHERE id > 2900")
    assert counts(conn, lane) == truth(conn, lane) == {"queued": 1400, "running": 0, "done": 0, "failed": 0,
                                                       "cancelled": 1500}
    deep_queue(conn, lane, 1, 0)  # the next transaction that folds folds them all (one in 64 do)
    for _ in range(64):
        pglane.enqueue(conn, lane, {})
    rows = conn.execute("SELECT count(*) AS n FROM pglane.lane_tallies").fetchone()["n"]
    assert rows <= 64
    assert counts(conn, lane) == truth(conn, lane)


def flag_disagrees(conn: Any) -> int:
    """Jobs whose failed_or_cancelled (written by pglane's functions with status) disagrees with status."""
    return int(conn.execute("SELECT count(*) AS n FROM pglane.jobs"
                            " WHERE failed_or_cancelled IS DISTINCT FROM (status IN ('failed', 'cancelled'))"
                            ).fetchone()["n"])


def test_a_lost_attempt_failed_by_recovery_and_its_late_result_keep_the_counts_exact(
        conn: Any, session: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    holder = session()
    take_slot(holder, lane)
    row = claim(holder, lane)
    assert row is not None
    holder.execute(queries.RELEASE_SLOT, (lane_id(conn, lane), 1))
    assert pglane.recover(conn, lane) == 1  # the session let go of its slot: lost, and failed (one attempt)
    assert pglane.job_status(conn, job)["status"] == "failed"
    assert counts(conn, lane) == truth(conn, lane) and counts(conn, lane)["failed"] == 1
    # The paid result arrives late, with the attempt's token: accepted, the failed job becomes done.
    assert holder.execute(queries.COMPLETE, (row["attempt_id"], '{"late": true}', row["token"])).fetchone()["complete"]
    assert pglane.job_status(conn, job)["status"] == "done"
    assert counts(conn, lane) == truth(conn, lane) and counts(conn, lane)["failed"] == 0
    assert flag_disagrees(conn) == 0


def test_a_status_changed_by_hand_is_counted_again_by_recount_tallies(conn: Any, lane: str) -> None:
    deep_queue(conn, lane, 5, 0)
    conn.execute("UPDATE pglane.jobs SET status = 'cancelled', finished_at = now() WHERE lane = %s", (lane,))
    assert flag_disagrees(conn) == 5 and counts(conn, lane) != truth(conn, lane)  # the column was not written
    conn.execute("SELECT pglane.recount_tallies()")
    assert flag_disagrees(conn) == 0
    assert counts(conn, lane) == truth(conn, lane) == {"queued": 0, "running": 0, "done": 0, "failed": 0,
                                                       "cancelled": 5}


def test_rows_written_with_triggers_off_are_counted_again_by_recount_tallies(conn: Any, lane: str) -> None:
    deep_queue(conn, lane, 7, 0)
    conn.execute("SET session_replication_role = replica")  # a bulk load with triggers off, as bench does
    conn.execute("INSERT INTO pglane.jobs (lane, payload, status, finished_at) SELECT %s, '{}', 'done', now()"
                 " FROM generate_series(1, 40)", (lane,))
    conn.execute("RESET session_replication_role")
    assert counts(conn, lane) != truth(conn, lane)
    assert conn.execute("SELECT pglane.recount_tallies() AS n").fetchone()["n"] == 1
    assert counts(conn, lane) == truth(conn, lane) == {"queued": 7, "running": 0, "done": 40, "failed": 0,
                                                       "cancelled": 0}


def test_a_growing_backlog_is_told_from_the_last_five_minutes_alone(conn: Any, session: Any, lane: str) -> None:
    worker = session()
    take_slot(worker, lane)
    # An hour-old history of 200 finished jobs does not count; 30 started now, 40 arrived now.
    deep_queue(conn, lane, 230, 0)
    for _ in range(230):
        row = claim(worker, lane)
        assert row is not None
        worker.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"]))
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '1 hour',"
                 " finished_at = now() - interval '1 hour'"
                 " WHERE id IN (SELECT id FROM pglane.jobs ORDER BY id LIMIT 200)")
    conn.execute("UPDATE pglane.attempts SET started_at = now() - interval '1 hour',"
                 " finished_at = now() - interval '1 hour'"
                 " WHERE job_id IN (SELECT id FROM pglane.jobs ORDER BY id LIMIT 200)")
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '1 hour' WHERE id IN"
                 " (SELECT id FROM pglane.jobs ORDER BY id OFFSET 200)")  # arrived earlier, started now
    deep_queue(conn, lane, 40, 0)
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '1 minute', run_after = now() - interval"
                 " '1 minute' WHERE status = 'queued'")
    flow = conn.execute("SELECT * FROM pglane.lane_flow(%s)", (lane,)).fetchone()
    assert (flow["arrived_5m"], flow["left_5m"]) == (40, 30)
    assert counts(conn, lane) == truth(conn, lane)
    row = next(r for r in pglane.lane_status(conn) if r["lane"] == lane)
    assert row["next_safe_action"].startswith(
        "backlog of lane brain is growing (40 queued, 40 arrived and 30 started or cancelled in 5 min)")
    queued = conn.execute("SELECT id FROM pglane.jobs WHERE status = 'queued' LIMIT 15").fetchall()
    cancelled = [r["id"] for r in queued]
    for job in cancelled:  # cancelled jobs have left the queue too
        pglane.cancel(conn, job)
    flow = conn.execute("SELECT * FROM pglane.lane_flow(%s)", (lane,)).fetchone()
    assert (flow["arrived_5m"], flow["left_5m"]) == (40, 45)
    assert next(r for r in pglane.lane_status(conn) if r["lane"] == lane)["next_safe_action"] == "nothing to do"
