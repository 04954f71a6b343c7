"""The operator's surface at scale: a full lane refuses a producer cheaply (skip: nothing written, no
ERROR in the server's log, the bound still exact under races), and a prune runs in bounded batches
that can be interrupted and resumed, with lane_status exact after it."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pglane
from tests.conftest import claim, take_slot
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
    rows = conn.execute("UPDATE pglane.jobs SET status = %s, finished_at = now() - interval '1 day'"
                        " WHERE lane = %s AND status = 'queued' RETURNING id", (status, lane)).fetchall()
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
    assert done.returncode == 0 and done.stdout.strip() == "25"
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
