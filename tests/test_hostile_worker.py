"""Hostile input against a real worker process: no payload, result, error or flood of wake-ups
stops it; every attempt it could not complete is failed with the reason; a stop always stops it."""

from __future__ import annotations

import json
import signal
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pglane
from tests.conftest import Ledger, Workers, lane_id, metrics_port, scrape, wait_until


def finished(conn: Any, job: int) -> bool:
    return bool(pglane.job_status(conn, job)["status"] in ("done", "failed"))


def error_of(conn: Any, job: int) -> str:
    return str(pglane.attempts(conn, job)[-1]["error"])


@pytest.mark.parametrize("stored", ["[" * 3000 + "]" * 3000, '{"n": 1' + "0" * 5000 + "}"])
def test_a_payload_no_decoder_takes_fails_its_attempt_and_never_the_worker(
    conn: Any, lane: str, workers: Workers, ledger: Ledger, stored: str
) -> None:
    bad, good = pglane.enqueue(conn, lane, {}), pglane.enqueue(conn, lane, {})
    # Stored behind enqueue's checks, as a row written before them (or by a bug) would be.
    conn.execute("UPDATE pglane.jobs SET payload = %s::jsonb WHERE id = %s", (stored, bad))
    proc = workers.start(lane, "tests.handlers:paid_call")
    wait_until(lambda: finished(conn, bad) and finished(conn, good), 20, "both jobs to finish")
    assert pglane.job_status(conn, bad)["status"] == "failed"
    assert error_of(conn, bad).startswith("payload cannot be decoded (")
    assert "the handler was not called, so nothing was paid" in error_of(conn, bad)
    assert "paid call may have been made" not in str(pglane.job_status(conn, bad)["last_error"])
    assert bad not in ledger.calls()
    assert pglane.job_status(conn, good)["status"] == "done"
    assert proc.poll() is None


def test_a_result_the_database_refuses_fails_its_attempt_and_a_stop_still_stops_the_worker(
    conn: Any, lane: str, workers: Workers
) -> None:
    # The database refuses a result with 54000 (program_limit_exceeded), as it does one over jsonb's
    # 256 MB, but at once: a trigger the test owns raises it for a marked result.
    conn.execute("""
        CREATE FUNCTION public.refuse_marked() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.result ? 'refuse_me' THEN
                RAISE EXCEPTION USING ERRCODE = '54000', MESSAGE = 'total size of jsonb object exceeds the maximum';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_marked BEFORE UPDATE ON pglane.jobs
            FOR EACH ROW EXECUTE FUNCTION public.refuse_marked();
    """)
    refused = pglane.enqueue(conn, lane, {"result": {"refuse_me": 1}})
    after = pglane.enqueue(conn, lane, {"result": {"fine": 1}})
    proc = workers.start(lane, "tests.handlers:hostile")
    wait_until(lambda: finished(conn, refused) and finished(conn, after), 20, "both jobs to finish")
    assert pglane.job_status(conn, refused)["status"] == "failed"
    assert "the result could not be stored: total size of jsonb object exceeds the maximum (SQLSTATE 54000" \
        in error_of(conn, refused)
    assert pglane.result(conn, after) == {"fine": 1}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


@pytest.mark.parametrize(("payload", "expected"), [
    ({"nest": 3000}, "not JSON-serialisable (list: RecursionError"),
    ({"chars": 5000}, "result of 5002 bytes exceeds the lane's max_result_bytes of 1000; it was not stored"),
])
def test_a_result_too_deep_or_too_large_fails_its_attempt_before_it_is_sent(
    conn: Any, workers: Workers, payload: dict[str, Any], expected: str
) -> None:
    pglane.create_lane(conn, "small", job_timeout=20, max_result_bytes=1000)
    job, after = pglane.enqueue(conn, "small", payload), pglane.enqueue(conn, "small", {"chars": 10})
    proc = workers.start("small", "tests.handlers:hostile")
    wait_until(lambda: finished(conn, job) and finished(conn, after), 20, "both jobs to finish")
    assert pglane.job_status(conn, job)["status"] == "failed"
    assert expected in error_of(conn, job)
    assert pglane.result(conn, after) == "y" * 10
    assert proc.poll() is None


def test_a_huge_error_is_kept_to_its_head_and_tail(conn: Any, lane: str, workers: Workers) -> None:
    job = pglane.enqueue(conn, lane, {"raise_chars": 5_000_000})
    proc = workers.start(lane, "tests.handlers:hostile")
    wait_until(lambda: finished(conn, job), 30, "the job to fail")
    for text in (error_of(conn, job), str(pglane.job_status(conn, job)["last_error"])):
        assert len(text) < 66_000
        assert text.startswith("ValueError: xxx") and "characters cut ...]" in text
        assert "the real cause" in text[-40_000:]  # the tail, where the traceback ends, is kept
    assert proc.poll() is None


def test_a_flood_of_wake_ups_costs_a_bounded_number_of_claims(conn: Any, lane: str, workers: Workers) -> None:
    port = metrics_port(workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "60", "--metrics-port", "0"))
    claims = "pglane_claim_latency_seconds_count"
    before = wait_until(lambda: scrape(port).get(claims), 20, "the metrics endpoint")
    channel = f"pglane_{lane_id(conn, lane)}"
    started = time.monotonic()
    with psycopg.connect(conn.info.dsn, autocommit=True) as flooder:  # any login may NOTIFY any channel
        for i in range(3000):
            flooder.execute("SELECT pg_notify(%s, %s)", (channel, str(i)))
    elapsed = time.monotonic() - started
    job = pglane.enqueue(conn, lane, {})  # the worker still answers a real one at once
    wait_until(lambda: finished(conn, job), 10, "the job after the flood")
    spent = scrape(port)[claims] - before
    assert spent <= 50 * (elapsed + 1) + 5, f"{spent} claims for 3,000 wake-ups in {elapsed:.1f}s"


# Any JSON a producer may send, nested and scalar, with what a handler may return or raise.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**1200), max_value=10**1200)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
ASKS = st.one_of(
    st.fixed_dictionaries({"result": JSON}),
    st.fixed_dictionaries({"raise": st.text()}),
    st.fixed_dictionaries({"nest": st.integers(0, 4000)}),
    st.fixed_dictionaries({"chars": st.integers(0, 3000)}),
    st.builds(lambda depth: "[" * depth + "]" * depth, st.integers(1, 3000)),  # stored as given
    st.builds(lambda digits: '{"n": 1' + "0" * digits + "}", st.integers(1, 6000)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(asks=st.lists(ASKS, min_size=1, max_size=4))
def test_no_payload_or_result_stops_a_running_worker_and_every_attempt_is_explained(
    conn: Any, workers: Workers, asks: list[Any]
) -> None:
    if not conn.execute("SELECT 1 FROM pglane.lanes WHERE name = 'fuzz'").fetchone():
        pglane.create_lane(conn, "fuzz", job_timeout=20, max_result_bytes=2000)
        workers.start("fuzz", "tests.handlers:hostile")
    jobs = []
    for ask in asks:
        text = ask if isinstance(ask, str) else json.dumps(ask)
        try:
            jobs.append(pglane.enqueue(conn, "fuzz", json.loads(text)))
        except (pglane.InvalidInput, ValueError, RecursionError):  # refused at the door: stored behind it
            later = datetime.now(UTC) + timedelta(hours=1)  # out of the worker's reach until stored
            job = pglane.enqueue(conn, "fuzz", {}, run_after=later)
            try:
                conn.execute("UPDATE pglane.jobs SET payload = %s::jsonb, run_after = now() WHERE id = %s",
                             (text, job))
            except psycopg.DataError:  # not even jsonb (a NUL character): no consumer can ever meet it
                pglane.cancel(conn, job)
                continue
            conn.execute("SELECT pg_notify(%s, '')", (f"pglane_{lane_id(conn, 'fuzz')}",))
            jobs.append(job)
    wait_until(lambda: all(finished(conn, j) for j in jobs), 30, "every job to finish")
    for job in jobs:
        status = pglane.job_status(conn, job)
        if status["status"] == "failed":
            assert error_of(conn, job).strip(), f"job {job} failed without a reason"
    (worker,) = workers.procs
    assert worker.poll() is None, Workers.log(worker)
