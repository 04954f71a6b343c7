"""The operator's surface at scale: a full lane refuses a producer cheaply (skip: nothing written, no
ERROR in the server's log, the bound still exact under races), and a prune runs in bounded batches
that can be interrupted and resumed, with lane_status exact after it."""

from __future__ import annotations

import threading
import uuid
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
