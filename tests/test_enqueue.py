"""Enqueue from any language: plain INSERT, pglane.enqueue() and Python, with the same validation,
idempotency keys, the same bound and the same wake-up."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

import pglane
from tests.conftest import concurrently, lane_id, take_slot


def count_jobs(conn: Any) -> int:
    return int(conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"])


def test_plain_insert_enqueues_a_queued_job(conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', '{\"q\": 1}')")
    row = conn.execute("SELECT status, payload, attempts, seq, run_after = created_at AS now"
                       " FROM pglane.jobs").fetchone()
    assert row == {"status": "queued", "payload": {"q": 1}, "attempts": 0, "seq": None, "now": True}


def test_sql_enqueue_and_python_enqueue_return_the_new_job_id(conn: Any, lane: str) -> None:
    first = conn.execute("SELECT pglane.enqueue('brain', '{\"q\": 1}') AS id").fetchone()["id"]
    second = pglane.enqueue(conn, lane, {"q": 2})
    assert second == first + 1
    assert [r["payload"] for r in conn.execute("SELECT payload FROM pglane.jobs ORDER BY id")] == [{"q": 1}, {"q": 2}]


def test_same_idempotency_key_returns_the_same_job_and_writes_nothing(conn: Any, lane: str) -> None:
    first = pglane.enqueue(conn, lane, {"q": 1}, key="request-1")
    assert pglane.enqueue(conn, lane, {"q": 1}, key="request-1") == first
    assert count_jobs(conn) == 1


def test_same_key_is_returned_whatever_the_job_status(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1}, key="k")
    pglane.cancel(conn, job)
    assert pglane.enqueue(conn, lane, {"q": 1}, key="k") == job
    assert conn.execute("SELECT status FROM pglane.jobs").fetchone()["status"] == "cancelled"


def test_same_key_with_another_payload_is_a_clear_conflict(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1}, key="request-1")
    with pytest.raises(pglane.IdempotencyConflict, match=f"belongs to job {job}, which has a different payload"):
        pglane.enqueue(conn, lane, {"q": 2}, key="request-1")
    assert count_jobs(conn) == 1


def test_plain_insert_of_an_existing_key_is_a_unique_violation_unless_on_conflict(conn: Any, lane: str) -> None:
    pglane.enqueue(conn, lane, {"q": 1}, key="k")
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES ('brain', '{}', 'k')")
    conn.execute("INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES ('brain', '{}', 'k')"
                 " ON CONFLICT (lane, idempotency_key) DO NOTHING")
    assert count_jobs(conn) == 1


def test_the_same_key_sent_concurrently_by_many_clients_makes_one_job(dsn: str, conn: Any, lane: str) -> None:
    ids: list[int] = []
    barrier = threading.Barrier(8)

    def client() -> None:
        with pglane.connect(dsn) as c:
            barrier.wait()
            ids.append(pglane.enqueue(c, lane, {"q": "same"}, key="burst"))

    concurrently([client] * 8)
    assert len(ids) == 8 and len(set(ids)) == 1
    assert count_jobs(conn) == 1


@pytest.mark.parametrize(
    ("insert", "error", "message"),
    [
        ("INSERT INTO pglane.jobs (lane, payload) VALUES ('nope', '{}')", pglane.UnknownLane, "unknown lane 'nope'"),
        ("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', '3')", pglane.InvalidPayload, "not number"),
        ("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', '\"text\"')", pglane.InvalidPayload, "not string"),
        ("INSERT INTO pglane.jobs (lane, payload, status) VALUES ('brain', '{}', 'done')", pglane.InvalidInput,
         "must be inserted queued"),
        ("INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES ('brain', '{}', repeat('k', 300))",
         pglane.InvalidIdempotencyKey, "300 characters"),
    ],
)
def test_bad_plain_inserts_are_refused_with_a_clear_error_and_write_nothing(
    conn: Any, lane: str, insert: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message), pglane.client.translated():
        conn.execute(insert)
    assert count_jobs(conn) == 0


def test_oversized_payload_is_refused_by_every_path(conn: Any) -> None:
    pglane.create_lane(conn, "small", job_timeout=10)
    conn.execute("UPDATE pglane.lanes SET max_payload_bytes = 1000 WHERE name = 'small'")
    big = {"blob": "x" * 2000}
    with pytest.raises(pglane.PayloadTooLarge, match="exceeds the 1000-byte limit of lane 'small'"):
        pglane.enqueue(conn, "small", big)
    with pytest.raises(pglane.PayloadTooLarge), pglane.client.translated():
        conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('small', %s::jsonb)",
                     (pglane.client.payload_json(big),))
    assert count_jobs(conn) == 0


def test_python_enqueue_refuses_a_payload_that_is_not_json(conn: Any, lane: str) -> None:
    with pytest.raises(pglane.InvalidPayload, match="not JSON-serialisable"):
        pglane.enqueue(conn, lane, {"when": object()})
    with pytest.raises(pglane.InvalidPayload):
        pglane.enqueue(conn, lane, {"x": float("nan")})
    assert count_jobs(conn) == 0


def test_bad_json_text_is_refused_by_postgres_before_anything_is_written(conn: Any, lane: str) -> None:
    with pytest.raises(psycopg.errors.InvalidTextRepresentation):
        conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', '{bad')")
    assert count_jobs(conn) == 0


def test_a_committed_insert_notifies_the_lane_once_per_transaction(dsn: str, session: Any, lane: str) -> None:
    listener = session()
    lid = lane_id(listener, lane)
    listener.execute(f"LISTEN pglane_{lid}")
    producer = session(autocommit=False)
    with producer.transaction():
        producer.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', '{}' FROM generate_series(1, 1000)")
        for n in range(5):
            pglane.enqueue(producer, lane, {"n": n})
        assert count_jobs(listener) == 0  # nothing is visible, to a worker either, before the commit
    notes = list(listener.notifies(timeout=1.0))
    assert [(n.channel, n.payload) for n in notes] == [(f"pglane_{lid}", "")]
    assert count_jobs(listener) == 1005


def test_a_rolled_back_enqueue_leaves_no_row_and_wakes_nobody(session: Any, lane: str) -> None:
    listener = session()
    lid = lane_id(listener, lane)
    listener.execute(f"LISTEN pglane_{lid}")
    producer = session(autocommit=False)
    producer.execute("SELECT pglane.enqueue('brain', '{}')")
    producer.rollback()
    assert list(listener.notifies(timeout=0.5)) == []
    assert count_jobs(listener) == 0


def test_a_bounded_lane_refuses_jobs_past_max_queued_on_every_path(conn: Any) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=10, max_queued=3)
    for n in range(2):
        pglane.enqueue(conn, "bounded", {"n": n})
    conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('bounded', '{}')")
    with pytest.raises(pglane.LaneFull, match="lane 'bounded' is full: max_queued is 3 and 3 job"):
        pglane.enqueue(conn, "bounded", {"n": 9})
    with pytest.raises(pglane.LaneFull), pglane.client.translated():
        conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES ('bounded', '{}')")
    assert count_jobs(conn) == 3
    job = conn.execute("SELECT min(id) AS id FROM pglane.jobs").fetchone()["id"]
    pglane.cancel(conn, job)  # leaving the queue frees a place
    pglane.enqueue(conn, "bounded", {"n": 10})
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status = 'queued'").fetchone()["n"] == 3


def test_lane_full_says_when_to_retry_from_the_lanes_recent_starts(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=10, max_queued=3)
    for n in range(3):
        pglane.enqueue(conn, "bounded", {"n": n})
    with pytest.raises(pglane.LaneFull) as idle:
        pglane.enqueue(conn, "bounded", {"n": 9})
    assert idle.value.retry_after is None  # no start yet: nothing to tell from
    assert "retry later" in str(idle.value)
    worker = session()
    take_slot(worker, "bounded")
    for n in range(3):  # three starts, half a second apart on the server's clock, each making room
        row = worker.execute("SELECT c.job_id FROM pglane.claim_or_wait('bounded', 'w') c, pg_sleep(0.5)").fetchone()
        assert row is not None and row["job_id"] is not None
        pglane.enqueue(conn, "bounded", {"n": 3 + n})
    with pytest.raises(pglane.LaneFull) as one:
        pglane.enqueue(conn, "bounded", {"n": 9})
    span = conn.execute("SELECT extract(epoch FROM now() - min(started_at))::float8 AS s FROM pglane.jobs"
                        " WHERE lane = 'bounded' AND started_at IS NOT NULL").fetchone()["s"]
    assert one.value.retry_after is not None and span >= 1.0
    assert abs(one.value.retry_after - span / 3) < 0.2, (one.value.retry_after, span)  # 3 starts in span s: 1 job
    assert f"retry in about {int(-(-one.value.retry_after // 1))} s" in str(one.value)
    with pytest.raises(pglane.LaneFull) as six, pglane.client.translated():
        conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'bounded', '{}' FROM generate_series(1, 6)")
    assert six.value.retry_after is not None
    # Room for six takes six times as long: six jobs at the rate of three starts in the span, measured
    # again (time has passed since the first refusal); retry_after is rounded to 0.1 s, and a loaded
    # machine puts some milliseconds between the refusal's clock and this one.
    span6 = conn.execute("SELECT extract(epoch FROM now() - min(started_at))::float8 AS s FROM pglane.jobs"
                         " WHERE lane = 'bounded' AND started_at IS NOT NULL").fetchone()["s"]
    assert abs(six.value.retry_after - 6 * span6 / 3) < 0.45, (six.value.retry_after, span6)
    assert count_jobs(conn) == 6


def test_a_batch_insert_past_the_bound_is_refused_whole(conn: Any) -> None:
    pglane.create_lane(conn, "bounded", job_timeout=10, max_queued=3)
    pglane.enqueue(conn, "bounded", {})
    with pytest.raises(pglane.LaneFull, match="max_queued is 3 and 1 job"), pglane.client.translated():
        conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'bounded', '{}' FROM generate_series(1, 3)")
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'bounded', '{}' FROM generate_series(1, 2)")
    assert count_jobs(conn) == 3
