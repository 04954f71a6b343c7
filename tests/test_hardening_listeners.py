"""Hardening of pglane's listeners (#30 points 3 and 5), through real roles and real processes.

3. Notifications are untrusted: a login with no pglane role may NOTIFY pglane_done with anything. The
   waiters' listener ignores (and counts) what is no job id, stays up, is started again whatever ends it,
   and a flood of notifications costs each waiter a bounded number of reads.
5. A standby waiting for a slot learns of a raised slot count (the lane's 'settings' notification, or
   its periodic re-check) and takes the new slot at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pglane
import pglane.aio
from pglane import queries, waiting
from tests.conftest import Ledger, Workers, claimed, slot_holder, take_slot, wait_until

Conn = psycopg.Connection[dict[str, Any]]
POLL = 30.0  # the waits' backup poll: only a notification can end a wait within a test's deadlines
PROMPT = 3.0  # a woken wait ends within this, far below POLL
STRANGER = "pglane_test_stranger"
JUNK = ["²", "-1", "x" * 7999, "99999999999999999999999", "", " 1", "1e3", "٣", "1a", "0x10"]


class Waiting:
    """A wait in a thread of its own: its result or error, and when it ended."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self.ended_at = 0.0

        def target() -> None:
            try:
                self.value = call()
            except BaseException as exc:  # handed to the test
                self.error = exc
            finally:
                self.ended_at = time.monotonic()
                self.ended.set()

        threading.Thread(target=target, daemon=True).start()

    def outcome(self, timeout: float) -> Any:
        assert self.ended.wait(timeout), f"the wait did not end within {timeout}s"
        if self.error is not None:
            raise self.error
        return self.value


def complete(session: Conn, lane: str, result: Any) -> int:
    job = claimed(session, lane)
    session.execute(queries.COMPLETE, (job["attempt_id"], json.dumps(result), job["token"]))
    return int(job["job_id"])


def awaited(conn: Conn, *jobs: int) -> bool:
    row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE awaited AND id = ANY(%s)", (list(jobs),)).fetchone()
    return row is not None and row["n"] == len(jobs)


def waiters_thread_alive() -> bool:
    return any(t.name == "pglane-waiters" and t.is_alive() for t in threading.enumerate())


@pytest.fixture
def worker_session(session: Callable[..., Conn], lane: str) -> Conn:
    s = session()
    take_slot(s, lane)
    return s


@pytest.fixture
def stranger(conn: Conn, dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A login with no pglane role at all, made by the superuser test connection."""
    conn.execute(f"DO $$ BEGIN CREATE ROLE {STRANGER} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    with psycopg.connect(make_conninfo(dsn, user=STRANGER), autocommit=True) as s:
        assert s.execute("SELECT pg_has_role(current_user, 'pglane_producer', 'MEMBER')").fetchone() == (False,)
        yield s


def notify_all(sender: psycopg.Connection[Any], payloads: list[str]) -> None:
    for payload in payloads:  # one transaction each: identical notifications of one transaction fold
        sender.execute("SELECT pg_notify('pglane_done', %s)", (payload,))


@pytest.fixture(autouse=True)
def _listeners_close() -> Iterator[None]:
    yield
    wait_until(lambda: not waiting.listening_pids(), 10, "the listening sessions to close after the test")


# --- 3. the waiters' listener ------------------------------------------------------------------------

def test_a_strangers_junk_neither_kills_nor_slows_a_wait(conn: Conn, lane: str, worker_session: Conn,
                                                         stranger: psycopg.Connection[Any]) -> None:
    other = pglane.enqueue(conn, lane, {"q": "nobody waits"})
    job = pglane.enqueue(conn, lane, {"q": 1})
    w = Waiting(lambda: pglane.wait(conn, job, timeout=120, poll_interval=POLL))
    wait_until(lambda: awaited(conn, job), 10, "the waiter to mark its job")
    [pid] = waiting.listening_pids()
    ignored = waiting.ignored_notifications()
    notify_all(stranger, [*JUNK, str(other), str(other + 1000), "1"])
    wait_until(lambda: waiting.ignored_notifications() >= ignored + len(JUNK), 10, "the listener to read the junk")
    assert waiting.ignored_notifications() == ignored + len(JUNK)
    assert waiters_thread_alive() and waiting.listening_pids() == [pid]  # the same session listens on
    assert not w.ended.is_set()
    completed = time.monotonic()
    complete(worker_session, lane, {"answer": 1})  # the lane's first job is `other`: nobody waits for it
    complete(worker_session, lane, {"answer": 2})
    assert w.outcome(PROMPT) == {"answer": 2}
    assert w.ended_at - completed < PROMPT


def test_a_strangers_junk_neither_kills_nor_slows_an_async_wait(dsn: str, conn: Conn, lane: str,
                                                                worker_session: Conn,
                                                                stranger: psycopg.Connection[Any]) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})

    async def scenario() -> float:
        async with await pglane.aio.connect(dsn) as aconn:
            task = asyncio.ensure_future(pglane.aio.wait(aconn, job, timeout=120, poll_interval=POLL))
            while not awaited(conn, job):
                await asyncio.sleep(0.02)
            [pid] = waiting.async_listening_pids()
            ignored = waiting.ignored_notifications()
            notify_all(stranger, [*JUNK, str(job + 1000)])
            deadline = time.monotonic() + 10
            while waiting.ignored_notifications() < ignored + len(JUNK):
                assert time.monotonic() < deadline, "the listener did not read the junk"
                await asyncio.sleep(0.02)
            assert waiting.async_listening_pids() == [pid] and not task.done()
            completed = time.monotonic()
            complete(worker_session, lane, {"answer": 1})
            assert await asyncio.wait_for(task, PROMPT) == {"answer": 1}
            return time.monotonic() - completed

    assert asyncio.run(scenario()) < PROMPT


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death, wanted
def test_a_listener_that_fails_for_any_reason_is_started_again(conn: Conn, lane: str, worker_session: Conn,
                                                               stranger: psycopg.Connection[Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in the listening thread (here: the payload's parser raising) ends that session, not waiting:
    it listens again and the waits registered meanwhile are woken by their job's notification. A thread
    that died anyway (SystemExit) is started again by the next wait."""
    real = waiting._job_id
    fail_with: list[BaseException] = []

    def parse(payload: str) -> int | None:
        if payload == "boom" and fail_with:
            raise fail_with.pop()
        return real(payload)

    monkeypatch.setattr(waiting, "_job_id", parse)
    first, second, third = (pglane.enqueue(conn, lane, {"q": n}) for n in range(3))
    w1 = Waiting(lambda: pglane.wait(conn, first, timeout=120, poll_interval=POLL))
    wait_until(lambda: awaited(conn, first), 10, "the first waiter to mark its job")
    [pid] = waiting.listening_pids()

    fail_with.append(RuntimeError("a bug"))
    notify_all(stranger, ["boom"])
    wait_until(lambda: waiting.listening_pids() not in ([], [pid]), 10, "the listener to listen again")
    completed = time.monotonic()
    complete(worker_session, lane, "one")
    assert w1.outcome(PROMPT) == "one" and w1.ended_at - completed < PROMPT

    w2 = Waiting(lambda: pglane.wait(conn, second, timeout=120, poll_interval=POLL))
    wait_until(lambda: awaited(conn, second), 10, "the second waiter to mark its job")
    fail_with.append(SystemExit())  # ends the thread itself: no except clause of _run sees it
    notify_all(stranger, ["boom"])
    wait_until(lambda: not waiters_thread_alive(), 10, "the listening thread to die")
    w3 = Waiting(lambda: pglane.wait(conn, third, timeout=120, poll_interval=POLL))  # starts it again
    wait_until(lambda: awaited(conn, third) and waiting.listening_pids(), 10, "a new listening session")
    completed = time.monotonic()
    complete(worker_session, lane, "two")  # w2 registered before the death: the new session serves it too
    assert w2.outcome(PROMPT) == "two" and w2.ended_at - completed < PROMPT
    complete(worker_session, lane, "three")
    assert w3.outcome(PROMPT) == "three"


def test_a_flood_of_notifications_costs_each_waiter_a_bounded_number_of_reads(
        conn: Conn, lane: str, worker_session: Conn, stranger: psycopg.Connection[Any]) -> None:
    n, flood = 20, 2000
    jobs = [pglane.enqueue(conn, lane, {"q": i}) for i in range(n)]
    waits = [Waiting(lambda job=job: pglane.wait(conn, job, timeout=120, poll_interval=POLL))  # type: ignore[misc]
             for job in jobs]
    wait_until(lambda: awaited(conn, *jobs), 20, "every waiter to mark its job")
    others = [str(jobs[-1] + 1 + i) for i in range(50)]  # real-looking ids nobody here waits for
    mix = [*JUNK, *others, *map(str, jobs)]  # and the waited jobs' own ids
    payloads = [mix[i % len(mix)] for i in range(flood)]
    junk = sum(p in JUNK for p in payloads)
    reads, ignored, started = waiting.waiter_reads(), waiting.ignored_notifications(), time.monotonic()
    notify_all(stranger, payloads)
    wait_until(lambda: waiting.ignored_notifications() >= ignored + junk, 20, "the listener to read the flood")
    time.sleep(2 * waiting.WAKE_GAP)  # a measuring window: the reads still owed for the flood are made
    elapsed = time.monotonic() - started
    spent = waiting.waiter_reads() - reads
    cap = n * (waiting.WAKE_BURST + elapsed / waiting.WAKE_GAP)
    print(f"\n{flood} notifications in {elapsed:.2f}s, {n} waiters: {spent} reads ({spent / elapsed:.0f}/s), "
          f"cap {cap:.0f} ({cap / elapsed:.0f}/s)")
    assert spent <= cap, f"{spent} reads for {flood} notifications in {elapsed:.1f}s (cap {cap:.0f})"
    assert waiters_thread_alive() and not any(w.ended.is_set() for w in waits)
    completed = time.monotonic()
    for _ in jobs:
        complete(worker_session, lane, "ok")
    assert [w.outcome(PROMPT + waiting.WAKE_GAP) for w in waits] == ["ok"] * n
    assert max(w.ended_at for w in waits) - completed < PROMPT + waiting.WAKE_GAP
# --- 5. a standby learns of new slots -----------------------------------------------------------------

def running_together(ledger: Ledger, first: int, second: int) -> bool:
    """Job ``second``'s call started while job ``first``'s call ran (it started, and has not ended)."""
    events = ledger.events()
    starts = {job: t for event, job, _, t in events if event == "start"}
    ends = {job for event, job, _, _ in events if event == "end"}
    return first in starts and second in starts and first not in ends and starts[first] < starts[second]


def holder_and_standby(conn: Conn, lane: str, workers: Workers, ledger: Ledger, *args: str) -> tuple[Any, Any, int]:
    """Worker A holding the lane's one slot with a long call running, worker B waiting as a standby."""
    long_call = pglane.enqueue(conn, lane, {"sleep": 60})
    a = workers.start(lane, "tests.handlers:paid_call", *args)
    wait_until(lambda: long_call in ledger.calls(), 20, "worker A's long call")
    b = workers.start(lane, "tests.handlers:paid_call", *args)
    wait_until(lambda: "standby" in Workers.log(b), 20, "worker B to wait as a standby")
    return a, b, long_call


def test_raising_slots_reaches_a_waiting_standby_at_once(conn: Conn, lane: str, workers: Workers,
                                                         ledger: Ledger) -> None:
    a, b, long_call = holder_and_standby(conn, lane, workers, ledger, "--poll-interval", "60")
    second = pglane.enqueue(conn, lane, {"sleep": 0})
    pglane.set_lane(conn, lane, slots=2)
    wait_until(lambda: running_together(ledger, long_call, second), 3, "B to run the second job beside A's call")
    assert "holding slot 2" in Workers.log(b)
    assert len(slot_holder(conn, lane)) == 2 and a.poll() is None


def test_a_standby_rereads_the_slots_on_its_own_when_no_notification_comes(conn: Conn, lane: str, workers: Workers,
                                                                           ledger: Ledger) -> None:
    _, b, long_call = holder_and_standby(conn, lane, workers, ledger, "--poll-interval", "1")
    second = pglane.enqueue(conn, lane, {"sleep": 0})
    conn.execute("UPDATE pglane.lanes SET slots = 2 WHERE name = %s", (lane,))  # no NOTIFY: the re-check finds it
    wait_until(lambda: running_together(ledger, long_call, second), 5, "B to run the second job beside A's call")
    assert "holding slot 2" in Workers.log(b)


def test_a_strangers_junk_on_a_lanes_channel_is_ignored_by_its_worker(conn: Conn, lane: str, workers: Workers,
                                                                      ledger: Ledger,
                                                                      stranger: psycopg.Connection[Any]) -> None:
    """The lane channel's notifications are untrusted too: only '' (a wake-up) and 'settings' (news) count;
    anything else is ignored, logged once, and the worker serves on."""
    worker = workers.start(lane, "tests.handlers:paid_call", "--poll-interval", "60")
    wait_until(lambda: "holding slot" in Workers.log(worker), 20, "the worker's slot")
    channel = f"pglane_{conn.execute(queries.LANES, {'name': lane}).fetchone()['id']}"  # type: ignore[index]
    for payload in [*JUNK, "settings!", "SETTINGS"] * 20:
        stranger.execute("SELECT pg_notify(%s, %s)", (channel, payload))
    job = pglane.enqueue(conn, lane, {})
    wait_until(lambda: job in ledger.calls(), PROMPT, "the worker to run a job after the junk")
    wait_until(lambda: "ignored a notification on " + channel in Workers.log(worker), 10, "the worker's note")
    assert Workers.log(worker).count("ignored a notification") == 1 and worker.poll() is None
