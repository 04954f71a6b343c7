"""Traces from the producer to the handler, and the worker's JSON logs (#36): the OpenTelemetry SDK's
in-memory exporter in this process, a real worker (pglane.Worker on its own event loop here, or a worker
process), a real server. The producer's span and the attempt's spans share one trace, for the Python API
and for a plain INSERT carrying a traceparent; a failed and a lost attempt carry their outcome, a stuck
one its span, a wait its pause and rate-limit turns; the JSON log lines parse and carry the same ids."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg.conninfo import make_conninfo

import pglane
import pglane.aio
from pglane.worker import Worker, WorkerOptions
from tests.conftest import Ledger, Workers, wait_until

EXPORTER = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
trace.set_tracer_provider(_provider)
TRACER = trace.get_tracer("tests")

TRACE_ID, PARENT_ID = "ab" * 16, "cd" * 8
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"  # what another language's producer would send


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    EXPORTER.clear()
    yield EXPORTER


@contextlib.contextmanager
def serving(dsn: str, lane: str, handler: Callable[[pglane.Job], Any], recover_interval: float = 3600
            ) -> Iterator[Worker]:
    """A real worker for ``lane`` on an event loop of its own in this process, so that its spans reach the
    in-memory exporter; stopped (its calls finished) on leaving."""
    worker = Worker(dsn, lane, handler, WorkerOptions(poll_interval=30, recover_interval=recover_interval))
    loops: list[asyncio.AbstractEventLoop] = []

    async def serve() -> None:
        loops.append(asyncio.get_running_loop())
        await worker.main()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        wait_until(lambda: loops, 10, "the worker's loop")
        loops[0].call_soon_threadsafe(worker.stop)
        thread.join(20)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found: list[ReadableSpan] = wait_until(lambda: named(exporter, name), 10, f"the span {name!r}")
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def done(conn: Any, job: int) -> Callable[[], bool]:
    return lambda: pglane.job_status(conn, job)["status"] == "done"


def inner_span(job: pglane.Job) -> dict[str, int]:
    """A handler that makes a span of its own (in the worker's thread for sync handlers)."""
    with TRACER.start_as_current_span("the paid call"):
        return {"job": job.id}


def test_the_producers_span_and_the_attempts_spans_share_one_trace(
    conn: Any, dsn: str, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "traced", job_timeout=20)
    with TRACER.start_as_current_span("POST /summaries") as request:
        job = pglane.enqueue(conn, "traced", {"text": "..."}, group="acme")
    with serving(dsn, "traced", inner_span):
        wait_until(done(conn, job), 20, "the job")
        settle = one(spans, "settle traced")
    send, wait, process = one(spans, "send traced"), one(spans, "wait traced"), one(spans, "process traced")
    paid = one(spans, "the paid call")
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in (send, wait, process, settle, paid)} == {trace_id}
    assert send.parent is not None and send.parent.span_id == request.get_span_context().span_id
    assert send.kind == trace.SpanKind.PRODUCER and process.kind == trace.SpanKind.CONSUMER
    assert wait.parent is not None and wait.parent.span_id == send.context.span_id  # continued from the job
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert settle.parent is not None and settle.parent.span_id == process.context.span_id
    assert paid.parent is not None and paid.parent.span_id == process.context.span_id  # the handler's own
    attempt = pglane.attempts(conn, job)[0]
    assert process.attributes is not None and send.attributes is not None
    assert send.attributes["messaging.message.id"] == str(job)
    assert process.attributes["messaging.system"] == "pglane"
    assert process.attributes["messaging.destination.name"] == "traced"
    assert process.attributes["messaging.message.id"] == str(job)
    assert process.attributes["pglane.attempt.id"] == attempt["id"]
    assert process.attributes["pglane.attempt.number"] == 1 and process.attributes["pglane.seq"] == 1
    assert process.attributes["pglane.outcome"] == "done"
    assert wait.start_time is not None and process.start_time is not None and wait.end_time is not None
    assert wait.start_time <= wait.end_time <= process.start_time  # queued -> claimed -> called
    assert not wait.events and not process.events  # nothing held it back; its call ended within its lease


def test_the_async_producer_records_its_trace_too(conn: Any, dsn: str, spans: InMemorySpanExporter) -> None:
    pglane.create_lane(conn, "atraced", job_timeout=20)

    async def produce() -> tuple[int, int]:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            with TRACER.start_as_current_span("async request") as request:
                return await pglane.aio.enqueue(aconn, "atraced", {}), request.get_span_context().trace_id

    job, trace_id = asyncio.run(produce())
    traceparent = conn.execute("SELECT traceparent FROM pglane.jobs WHERE id = %s", (job,)).fetchone()["traceparent"]
    assert traceparent.startswith(f"00-{trace_id:032x}-{one(spans, 'send atraced').context.span_id:016x}-")


def test_a_plain_insert_with_a_traceparent_is_continued_by_the_worker(
    conn: Any, dsn: str, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "inserted", job_timeout=20)
    job = conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('inserted', '{}', %s)"
                       " RETURNING id", (TRACEPARENT,)).fetchone()["id"]
    with serving(dsn, "inserted", lambda job: {}):
        wait_until(done(conn, job), 20, "the job")
        one(spans, "settle inserted")
    process = one(spans, "process inserted")
    assert f"{process.context.trace_id:032x}" == TRACE_ID
    assert process.parent is not None and f"{process.parent.span_id:016x}" == PARENT_ID


def test_a_failed_attempt_carries_its_outcome(conn: Any, dsn: str, spans: InMemorySpanExporter) -> None:
    pglane.create_lane(conn, "failing", job_timeout=20)
    job = conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('failing', '{}', %s)"
                       " RETURNING id", (TRACEPARENT,)).fetchone()["id"]

    def refuse(job: pglane.Job) -> None:
        raise RuntimeError("the provider said no")

    with serving(dsn, "failing", refuse):
        wait_until(lambda: pglane.job_status(conn, job)["status"] == "failed", 20, "the failed job")
        one(spans, "settle failing")
    process = one(spans, "process failing")
    assert process.attributes is not None and process.attributes["pglane.outcome"] == "failed"
    assert process.status.status_code == trace.StatusCode.ERROR
    assert process.status.description is not None and "the provider said no" in process.status.description
    assert f"{process.context.trace_id:032x}" == TRACE_ID


def test_a_lost_attempt_is_written_into_its_trace_by_the_worker_that_recovers_it(
    conn: Any, dsn: str, workers: Workers, ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "dying", job_timeout=20)
    job = conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('dying', '{\"sleep\": 60}', %s)"
                       " RETURNING id", (TRACEPARENT,)).fetchone()["id"]
    victim = workers.start("dying")  # a worker process: it dies with whatever spans it had
    wait_until(lambda: ledger.calls() == [job], 30, "the call to start")
    victim.kill()
    victim.wait()
    with serving(dsn, "dying", lambda job: {}):  # takes the slot and recovers the lane at once
        lost = one(spans, "lost dying")
    attempt = pglane.attempts(conn, job)[0]
    assert attempt["status"] == "lost"
    assert lost.attributes is not None and lost.attributes["pglane.outcome"] == "lost"
    assert lost.attributes["pglane.attempt.id"] == attempt["id"]
    assert f"{lost.context.trace_id:032x}" == TRACE_ID
    assert lost.parent is not None and f"{lost.parent.span_id:016x}" == PARENT_ID
    assert lost.status.status_code == trace.StatusCode.ERROR
    assert lost.status.description is not None and "the paid call may have been made" in lost.status.description


@pytest.mark.parametrize("bad", ["00-" + "0" * 32 + "-" + PARENT_ID + "-01", "01-" + TRACE_ID + "-" + PARENT_ID + "-01",
                                 TRACEPARENT.upper(), TRACEPARENT + "-extra", "x" * 100_000])
def test_a_malformed_traceparent_is_refused_with_what_it_should_be_and_nothing_is_written(conn: Any, bad: str) -> None:
    pglane.create_lane(conn, "strict_tp", job_timeout=20)
    with pytest.raises(psycopg.Error) as refused:
        conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('strict_tp', '{}', %s)", (bad,))
    assert refused.value.sqlstate == "PGL10"
    assert "is not a W3C trace context" in str(refused.value) and len(str(refused.value)) < 1000
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0


def test_the_json_log_lines_parse_and_carry_the_lane_job_attempt_and_trace(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    pglane.create_lane(conn, "logged", job_timeout=20)
    job = conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('logged', %s, %s)"
                       " RETURNING id", (json.dumps({"fail": "boom"}), TRACEPARENT)).fetchone()["id"]
    proc = workers.start("logged", "tests.handlers:paid_call", "--log-format", "json")
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "failed", 30, "the failed job")
    attempt = pglane.attempts(conn, job)[0]["id"]

    def failed_line() -> dict[str, Any] | None:
        lines = [json.loads(line) for line in Workers.log(proc).splitlines() if line.strip()]  # every line parses
        return next((e for e in lines if e.get("job") == job and "failed" in e["message"]), None)

    entry = wait_until(failed_line, 10, "the failed attempt's line")
    assert entry["lane"] == "logged" and entry["attempt"] == attempt and entry["trace_id"] == TRACE_ID
    assert entry["level"] == "INFO" and entry["logger"] == "pglane.worker" and entry["pid"] == proc.pid
    assert "boom" in entry["message"]
    holding = next(json.loads(line) for line in Workers.log(proc).splitlines() if "holding slot" in line)
    assert holding["lane"] == "logged" and "job" not in holding  # a slot's line between jobs: no job


def claim_answered(conn: Any) -> bool:
    """This test's worker has sent its claim and waits (its session idle after claim_or_wait)."""
    return bool(conn.execute("SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle'"
                             " AND query LIKE %s", ("%claim_or_wait%",)).fetchall())


def test_a_pause_and_the_rate_limits_turn_are_events_of_the_jobs_wait(
    conn: Any, dsn: str, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "held", job_timeout=20)
    pglane.pause_lane(conn, "held", reason="the provider said 429")
    job = pglane.enqueue(conn, "held", {})
    with serving(dsn, "held", lambda job: {}):
        wait_until(lambda: claim_answered(conn), 20, "the worker's claim of the paused lane")
        late = pglane.enqueue(conn, "held", {})  # queued in the middle of the pause
        pglane.resume_lane(conn, "held")
        wait_until(done(conn, late), 20, "the jobs, after the resume")
        held = {int(str(s.attributes["messaging.message.id"])): s for s in named(spans, "wait held") if s.attributes}
    assert set(held) == {job, late}
    for wait in held.values():
        assert [e.name for e in wait.events] == ["pglane.paused"]
        paused = wait.events[0]
        assert paused.attributes is not None and paused.attributes["pglane.wait_reason"] == "paused"
        assert "pglane.wait_seconds" not in paused.attributes  # paused until resumed: no end was known
        assert wait.start_time is not None and wait.end_time is not None
        assert wait.start_time <= paused.timestamp <= wait.end_time
    assert held[late].events[0].timestamp == held[late].start_time  # the pause was on when it came

    spans.clear()
    pglane.create_lane(conn, "paced", job_timeout=20, rate="1/2s")
    first, second = pglane.enqueue(conn, "paced", {}), pglane.enqueue(conn, "paced", {})
    with serving(dsn, "paced", lambda job: {}):
        wait_until(done(conn, second), 20, "the second job, a rate turn later")
        waits = {int(str(s.attributes["messaging.message.id"])): s for s in named(spans, "wait paced") if s.attributes}
    assert set(waits) == {first, second}
    assert not waits[first].events
    turn = waits[second].events
    assert [e.name for e in turn] == ["pglane.rate_limited"]
    assert turn[0].attributes is not None and 0 < float(str(turn[0].attributes["pglane.wait_seconds"])) <= 2


def test_a_strict_lanes_wait_for_a_lost_calls_lease_is_an_event_of_the_jobs_wait(
    conn: Any, dsn: str, workers: Workers, ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "leased", job_timeout=60, takeover="after_lease")
    first = pglane.enqueue(conn, "leased", {"sleep": 60})
    victim = workers.start("leased")  # dies mid-call: its call may go on until the lease ends
    wait_until(lambda: ledger.calls() == [first], 30, "the call to start")
    victim.kill()
    victim.wait()
    second = pglane.enqueue(conn, "leased", {})
    with serving(dsn, "leased", lambda job: {}):  # takes the slot, finds the attempt lost, waits for its lease
        wait_until(lambda: pglane.attempts(conn, first)[0]["status"] == "lost" and claim_answered(conn), 20,
                   "the attempt found lost, and the claim told to wait for its lease")
        pglane.release_lease(conn, pglane.attempts(conn, first)[0]["id"])  # a person: that worker is stopped
        wait_until(done(conn, second), 20, "the second job, after the release")
        wait = one(spans, "wait leased")
    assert [e.name for e in wait.events] == ["pglane.lease_wait"]
    lease = wait.events[0]
    assert lease.attributes is not None and lease.attributes["pglane.wait_reason"] == "lease"
    assert float(str(lease.attributes["pglane.wait_seconds"])) > 0  # until the lost call's lease ends


def test_a_stuck_attempt_is_written_into_its_trace_once_by_a_worker_that_recovers_beside_it(
    conn: Any, dsn: str, workers: Workers, ledger: Ledger, spans: InMemorySpanExporter
) -> None:
    pglane.create_lane(conn, "frozen", slots=2, job_timeout=1, lease_timeout=2)
    job = conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent) VALUES ('frozen', '{\"sleep\": 60}', %s)"
                       " RETURNING id", (TRACEPARENT,)).fetchone()["id"]
    victim = workers.start("frozen")  # a worker process, frozen mid-call: its session lives on past the lease
    wait_until(lambda: ledger.calls() == [job], 30, "the call to start")
    victim.send_signal(signal.SIGSTOP)
    # The lane's other slot, served as deployed: a login that is only a pglane_worker.
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_traced_worker LOGIN; EXCEPTION WHEN duplicate_object THEN NULL;"
                 " END $$")
    conn.execute("GRANT pglane_worker TO pglane_traced_worker")
    with serving(make_conninfo(dsn, user="pglane_traced_worker"), "frozen", lambda job: {}, recover_interval=0.2):
        stuck = one(spans, "stuck frozen")
        assert pglane.job_status(conn, job)["status"] == "running"  # reported, never handed to another worker
        time.sleep(1.0)  # five more recoveries find it stuck: nothing else tells that they ran
    assert len(named(spans, "stuck frozen")) == 1  # once, however many recoveries saw it
    attempt = pglane.attempts(conn, job)[0]
    assert stuck.start_time == int(attempt["lease_expires_at"].timestamp() * 1e9)
    assert stuck.attributes is not None and stuck.attributes["pglane.state"] == "stuck"
    assert stuck.attributes["pglane.attempt.id"] == attempt["id"]
    assert f"{stuck.context.trace_id:032x}" == TRACE_ID
    assert stuck.status.description is not None
    assert "pglane recover frozen --terminate-stuck" in stuck.status.description


def test_a_refused_span_query_never_stops_the_worker(
    conn: Any, dsn: str, spans: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    # Spans are a help: a database that refuses what recovery reads for them (here the grant taken back)
    # costs the spans, logged, not the session.
    pglane.create_lane(conn, "refused", job_timeout=20)
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_traced_worker LOGIN; EXCEPTION WHEN duplicate_object THEN NULL;"
                 " END $$")
    conn.execute("GRANT pglane_worker TO pglane_traced_worker")
    conn.execute("REVOKE EXECUTE ON FUNCTION pglane.stuck_attempts(text) FROM pglane_worker")
    job = pglane.enqueue(conn, "refused", {})
    with serving(make_conninfo(dsn, user="pglane_traced_worker"), "refused", lambda job: {}):
        wait_until(done(conn, job), 20, "the job")
    assert one(spans, "process refused").attributes is not None
    assert any("no recovery spans" in r.getMessage() and "permission denied" in r.getMessage()
               for r in caplog.records)
    assert not any("reconnecting" in r.getMessage() for r in caplog.records)
