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
    # The listings compared below can be seconds apart on a busy machine (a parallel run): no row may go
    # from "just queued" to waiting for a worker between them.
    pglane.set_lane(conn, lane, waiting_grace=3600)
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
    assert tallied(conn, "counted") == truth_failed(conn, "counted")


def tallied(conn: Any, lane: str) -> dict[str, int]:
    """The lane's failed and cancelled counts as lane_tallies holds them (what lane_status reads)."""
    row = conn.execute("SELECT coalesce(sum(t.failed), 0) AS failed, coalesce(sum(t.cancelled), 0) AS cancelled"
                       " FROM pglane.lane_tallies t JOIN pglane.lanes l ON l.id = t.lane_id WHERE l.name = %s",
                       (lane,)).fetchone()
    return {"failed": int(row["failed"]), "cancelled": int(row["cancelled"])}


def truth_failed(conn: Any, lane: str) -> dict[str, int]:
    return {k: v for k, v in truth(conn, lane).items() if k in ("failed", "cancelled")}


def test_failed_and_cancelled_are_tallied_through_fail_cancel_retry_late_result_prune_and_recount(
        conn: Any, session: Any) -> None:
    """#31 point 7: failed and cancelled are kept in the tallies as done is (the row trigger on UPDATE
    OF failed_or_cancelled, the statement triggers on INSERT and DELETE), exact at every step."""
    pglane.create_lane(conn, "tallied", job_timeout=20, max_attempts=1, retry_backoff=0)
    pglane.create_lane(conn, "other", job_timeout=20)
    deep_queue(conn, "tallied", 40, 0)
    deep_queue(conn, "other", 5, 0)
    worker = session()
    take_slot(worker, "tallied")

    def check() -> None:
        for name in ("tallied", "other"):
            assert counts(conn, name) == truth(conn, name)
            assert tallied(conn, name) == truth_failed(conn, name)

    for _ in range(6):  # failed by the worker (one attempt each)
        row = claim(worker, "tallied")
        assert row is not None
        assert worker.execute(queries.FAIL, (row["attempt_id"], "boom", False, row["token"])).fetchone()["fail"]
    check()
    assert tallied(conn, "tallied") == {"failed": 6, "cancelled": 0}
    queued = [r["id"] for r in conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'tallied' AND status = 'queued'"
                                            " ORDER BY id LIMIT 8").fetchall()]
    for job in queued:
        assert pglane.cancel(conn, job)
    check()
    assert tallied(conn, "tallied") == {"failed": 6, "cancelled": 8}
    failed = [r["id"] for r in conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'tallied' AND status = 'failed'"
                                            " ORDER BY id").fetchall()]
    for job in (failed[0], queued[0]):  # retried: out of failed and cancelled, back in the queue
        assert pglane.retry(conn, job)
    check()
    assert tallied(conn, "tallied") == {"failed": 5, "cancelled": 7}
    # A lost attempt failed by recovery, then its late result: failed, then done.
    row = claim(worker, "tallied")
    assert row is not None
    worker.execute(queries.RELEASE_SLOT, (lane_id(conn, "tallied"), 1))
    assert pglane.recover(conn, "tallied") == 1
    check()
    assert tallied(conn, "tallied") == {"failed": 6, "cancelled": 7}
    assert worker.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"])).fetchone()["complete"]
    check()
    assert tallied(conn, "tallied") == {"failed": 5, "cancelled": 7}
    # A status changed by hand with failed_or_cancelled in the SET list is counted, even unchanged.
    conn.execute("UPDATE pglane.jobs SET status = 'cancelled', failed_or_cancelled = true WHERE id = %s",
                 (failed[1],))
    check()
    assert tallied(conn, "tallied") == {"failed": 4, "cancelled": 8}
    # Prunes: failed and cancelled jobs deleted, plain and in batches.
    conn.execute("UPDATE pglane.jobs SET finished_at = now() - interval '2 hours' WHERE id = ANY(%s)",
                 (failed[2:4] + queued[1:3],))
    assert pglane.prune(conn, 3600, include_failed=True) == 4
    check()
    conn.execute("UPDATE pglane.jobs SET finished_at = now() - interval '2 hours' WHERE finished_at IS NOT NULL")
    assert pglane.prune(conn, 3600, batch=3, include_failed=True) > 0
    check()
    assert tallied(conn, "tallied") == {"failed": 0, "cancelled": 0}
    # recount_tallies: the same counts again; and after a status changed without the column, the right ones.
    for job in [r["id"] for r in conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'tallied' AND status ="
                                              " 'queued' ORDER BY id LIMIT 3").fetchall()]:
        assert pglane.cancel(conn, job)
    before = tallied(conn, "tallied")
    conn.execute("SELECT pglane.recount_tallies()")
    assert tallied(conn, "tallied") == before == {"failed": 0, "cancelled": 3}
    conn.execute("UPDATE pglane.jobs SET status = 'failed', finished_at = now() WHERE lane = 'other'")
    assert tallied(conn, "other") != truth_failed(conn, "other")  # the column was not written: not counted
    conn.execute("SELECT pglane.recount_tallies()")
    check()
    assert tallied(conn, "other") == {"failed": 5, "cancelled": 0}


def test_the_failed_and_cancelled_trigger_fires_for_fail_and_cancel_never_for_claim_and_complete(
        conn: Any, session: Any) -> None:
    """jobs_tally_update is declared AFTER UPDATE OF failed_or_cancelled: the claim's and the completion's
    UPDATEs of jobs, which do not name that column, never fire it (here its function, in this test's
    database only, counts its calls instead)."""
    conn.execute("CREATE SEQUENCE pglane.test_fired")
    conn.execute("CREATE OR REPLACE FUNCTION pglane.jobs_tally_update() RETURNS trigger LANGUAGE plpgsql AS"
                 " $$ BEGIN PERFORM nextval('pglane.test_fired'); RETURN NULL; END $$")

    def fired() -> int:
        return int(conn.execute("SELECT last_value - 1 + is_called::int AS n FROM pglane.test_fired").fetchone()["n"])

    lane = "once"
    pglane.create_lane(conn, lane, max_attempts=1)
    deep_queue(conn, lane, 12, 0)
    worker = session()
    take_slot(worker, lane)
    row = claim(worker, lane)
    for _ in range(5):  # claims and completions, plain and together
        assert row is not None
        assert worker.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"])).fetchone()["complete"]
        row = claim(worker, lane)
        assert row is not None
        row = worker.execute(queries.COMPLETE_AND_CLAIM, (row["attempt_id"], "null", lane, "test",
                                                          row["token"])).fetchone()
    assert fired() == 0
    assert row is not None
    assert worker.execute(queries.FAIL, (row["attempt_id"], "boom", False, row["token"])).fetchone()["fail"]
    job = conn.execute("SELECT id FROM pglane.jobs WHERE status = 'queued' ORDER BY id LIMIT 1").fetchone()["id"]
    assert pglane.cancel(conn, job)
    assert pglane.retry(conn, job)
    assert pglane.job_status(conn, row["job_id"])["status"] == "failed"
    assert fired() == 3  # the failure, the cancel and the retry


def test_lane_status_reads_failed_and_cancelled_from_the_tallies_not_their_index(conn: Any, lane: str) -> None:
    """Its plan (as the superuser sees it) reads lane_tallies and never jobs_failed_or_cancelled, with
    that index holding most of the lane's jobs."""
    deep_queue(conn, lane, 400, 0)
    conn.execute("UPDATE pglane.jobs SET status = CASE WHEN id %% 2 = 0 THEN 'failed' ELSE 'cancelled' END,"
                 " failed_or_cancelled = true, finished_at = now() WHERE lane = %s AND id %% 10 <> 0", (lane,))
    conn.execute("ANALYZE pglane.jobs")
    conn.execute("ANALYZE pglane.lane_tallies")
    assert counts(conn, lane) == truth(conn, lane)
    for query in ("SELECT * FROM pglane.lane_status", "SELECT * FROM pglane.lane_status WHERE lane = %s"):
        plan = json.dumps(conn.execute("EXPLAIN (VERBOSE, FORMAT JSON) " + query,
                                       (lane,) if "%s" in query else None).fetchone()["QUERY PLAN"])
        assert "lane_tallies" in plan
        assert "jobs_failed_or_cancelled" not in plan


def test_lane_flow_reads_a_bounded_number_of_rows_when_the_last_five_minutes_were_busy(conn: Any) -> None:
    """More than 5,000 jobs arrived in the last 5 minutes: lane_flow counts over the latest 5,000 (the
    same period for both sides), not all of them."""
    pglane.create_lane(conn, "busy")
    pglane.create_lane(conn, "calm")
    deep_queue(conn, "busy", 6000, 0)  # one transaction: one created_at
    deep_queue(conn, "calm", 100, 0)
    busy = conn.execute("SELECT * FROM pglane.lane_flow('busy')").fetchone()
    calm = conn.execute("SELECT * FROM pglane.lane_flow('calm')").fetchone()
    assert (busy["arrived_5m"], busy["left_5m"]) == (4900, 0)  # jobs 1,101 to 6,100: 4,900 of busy's
    assert (calm["arrived_5m"], calm["left_5m"]) == (100, 0)
    first = conn.execute("SELECT id FROM pglane.jobs WHERE lane = 'busy' ORDER BY id LIMIT 7").fetchall()
    for r in first:  # the lane's first jobs, arrived before the latest 5,000: their cancels count
        assert pglane.cancel(conn, r["id"])
    assert conn.execute("SELECT * FROM pglane.lane_flow('busy')").fetchone()["left_5m"] == 7
    # 995 later jobs failed: the latest 1,000 failed or cancelled jobs hold 5 of the 7 cancels.
    conn.execute("UPDATE pglane.jobs SET status = 'failed', failed_or_cancelled = true, finished_at = now()"
                 " WHERE id IN (SELECT id FROM pglane.jobs WHERE lane = 'busy' AND status = 'queued'"
                 " ORDER BY id DESC LIMIT 995)")
    assert conn.execute("SELECT * FROM pglane.lane_flow('busy')").fetchone()["left_5m"] == 5
    assert counts(conn, "busy") == truth(conn, "busy")


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


def test_failed_and_cancelled_are_counted_once_by_the_upgrade_and_kept_by_the_downgrade(dsn: str) -> None:
    """A database at 0008 with failed and cancelled jobs: 0009 counts them into the tallies once, and
    lane_status reads the same counts before the upgrade, after it and after a downgrade."""
    from pglane import schema

    def status(c: Any) -> dict[str, int]:
        row = c.execute("SELECT queued, done, failed, cancelled FROM pglane.lane_status WHERE lane = 'kept'").fetchone()
        return dict(row)

    schema.downgrade(dsn, "0008")
    with psycopg.connect(dsn, autocommit=True, row_factory=psycopg.rows.dict_row) as c:
        c.execute("INSERT INTO pglane.lanes (name) VALUES ('kept')")
        c.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'kept', '{}' FROM generate_series(1, 20)")
        for job in (1, 2, 3):
            c.execute("SELECT pglane.cancel(%s)", (job,))
        c.execute("UPDATE pglane.jobs SET status = 'failed', failed_or_cancelled = true, finished_at = now()"
                  " WHERE id IN (4, 5)")
        c.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now() WHERE id = 6")
        at_0008 = status(c)
    assert at_0008 == {"queued": 14, "done": 1, "failed": 2, "cancelled": 3}
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True, row_factory=psycopg.rows.dict_row) as c:
        assert status(c) == at_0008
        c.execute("SELECT pglane.cancel(7)")
    schema.downgrade(dsn, "0008")
    with psycopg.connect(dsn, autocommit=True, row_factory=psycopg.rows.dict_row) as c:
        assert status(c) == {"queued": 13, "done": 1, "failed": 2, "cancelled": 4}
    schema.upgrade(dsn)
