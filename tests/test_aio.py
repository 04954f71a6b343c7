"""pglane.aio against a real server: the synchronous API's names, arguments, results and errors on an
AsyncConnection and an AsyncConnectionPool; waits woken by notification, answered by the poll when it
is lost, a thousand of them over one listening session; and the README's web-app handler, run."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pglane
import pglane.aio
from pglane import queries, waiting
from tests.conftest import ROOT, claimed, take_slot, wait_until

Conn = psycopg.Connection[dict[str, Any]]
FOREVER = 600.0  # a backup poll that never comes within a test


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro
    return asyncio.run(main())


def complete(session: Conn, lane: str, result: Any) -> int:
    job = claimed(session, lane)
    session.execute(queries.COMPLETE, (job["attempt_id"], json.dumps(result), job["token"]))
    return int(job["job_id"])


def awaited(conn: Conn, job_id: int) -> bool:
    row = conn.execute("SELECT awaited FROM pglane.jobs WHERE id = %s", (job_id,)).fetchone()
    return bool(row and row["awaited"])


async def until(check: Callable[[], Any], timeout: float = 10.0) -> None:
    """The event loop's wait_until: poll ``check`` with a deadline, letting the loop's tasks run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.02)


@pytest.fixture
def worker_session(session: Callable[..., Conn], lane: str) -> Conn:
    s = session()
    take_slot(s, lane)
    return s


@pytest.fixture(autouse=True)
def _listeners_close() -> Iterator[None]:
    yield
    wait_until(lambda: not waiting.listening_pids(), 10, "the thread listeners to close after the test")


@pytest.mark.parametrize("kind", ["connection", "pool"])
def test_every_call_answers_as_its_synchronous_twin(dsn: str, conn: Conn, worker_session: Conn, kind: str) -> None:
    async def scenario() -> None:
        async with await pglane.aio.connect(dsn) as aconn, AsyncConnectionPool(dsn, min_size=1, max_size=2) as pool:
            target: Any = aconn if kind == "connection" else pool
            assert await pglane.aio.create_lane(target, "other", job_timeout=30) > 0
            job = await pglane.aio.enqueue(target, "brain", {"q": 1}, key="k")
            assert await pglane.aio.enqueue(target, "brain", {"q": 1}, key="k") == job
            assert await pglane.aio.job_status(target, job) == pglane.job_status(conn, job)
            assert await pglane.aio.jobs(target, lane="brain") == pglane.jobs(conn, lane="brain")
            assert await pglane.aio.lanes(target) == pglane.client.lanes(conn)
            assert [r["lane"] for r in await pglane.aio.lane_status(target)] == ["brain", "other"]
            with pytest.raises(pglane.UnknownLane):
                await pglane.aio.enqueue(target, "nope", {})
            with pytest.raises(pglane.UnknownJob):
                await pglane.aio.job_status(target, job + 100)
            with pytest.raises(pglane.InvalidPayload):
                await pglane.aio.enqueue(target, "brain", {"not json": object()})
            complete(worker_session, "brain", {"answer": 1})
            assert await pglane.aio.result(target, job) == {"answer": 1}
            assert [a["status"] for a in await pglane.aio.attempts(target, job)] == ["done"]
            second = await pglane.aio.enqueue(target, "brain", {"q": 2})
            assert await pglane.aio.cancel(target, second)
            assert await pglane.aio.retry(target, second)
            with pytest.raises(pglane.InvalidTransition):
                await pglane.aio.retry(target, job)
            assert await pglane.aio.recover(target) == 0
            assert await pglane.aio.stuck_attempts(target) == []
            assert await pglane.aio.prunable(target, 0) == 1
            assert await pglane.aio.prune(target, 0, batch=10) == 1
            with pytest.raises(pglane.JobPruned):
                await pglane.aio.wait(target, job, timeout=0)

    run(scenario())


@pytest.mark.parametrize("kind", ["connection", "pool"])
def test_a_wait_is_woken_by_the_notification(dsn: str, conn: Conn, lane: str, worker_session: Conn,
                                             kind: str) -> None:
    async def scenario() -> Any:
        async with await pglane.aio.connect(dsn) as aconn, AsyncConnectionPool(dsn, min_size=1, max_size=2) as pool:
            target: Any = aconn if kind == "connection" else pool
            job = await pglane.aio.enqueue(target, lane, {"q": 1})
            waiter = asyncio.create_task(pglane.aio.wait(target, job, timeout=FOREVER, poll_interval=FOREVER))
            await until(lambda: awaited(conn, job))
            complete(worker_session, lane, {"answer": kind})
            return await asyncio.wait_for(waiter, 30)

    assert run(scenario()) == {"answer": kind}


def test_a_lost_notification_is_answered_by_the_poll(dsn: str, conn: Conn, lane: str, worker_session: Conn) -> None:
    async def scenario() -> Any:
        async with await pglane.aio.connect(dsn) as aconn:
            job = await pglane.aio.enqueue(aconn, lane, {"q": 1})
            waiter = asyncio.create_task(pglane.aio.wait(aconn, job, timeout=FOREVER, poll_interval=0.5))
            await until(lambda: awaited(conn, job))
            conn.execute("ALTER TABLE pglane.jobs DISABLE TRIGGER jobs_awaited_finished")
            complete(worker_session, lane, {"answer": "polled"})
            return await asyncio.wait_for(waiter, 30)

    assert run(scenario()) == {"answer": "polled"}


def test_a_terminated_listening_session_costs_no_result(dsn: str, conn: Conn, lane: str,
                                                         worker_session: Conn) -> None:
    async def scenario() -> Any:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2) as pool:
            job = await pglane.aio.enqueue(pool, lane, {"q": 1})
            waiter = asyncio.create_task(pglane.aio.wait(pool, job, timeout=FOREVER, poll_interval=2.0))
            await until(lambda: awaited(conn, job))
            [pid] = waiting.async_listening_pids()
            conn.execute(queries.TERMINATE, (pid,))
            complete(worker_session, lane, {"answer": "after the cut"})
            return await asyncio.wait_for(waiter, 30)

    assert run(scenario()) == {"answer": "after the cut"}


def test_timeouts_failures_and_cancellations_raise_as_in_the_synchronous_api(
        dsn: str, conn: Conn, lane: str, worker_session: Conn) -> None:
    async def scenario() -> None:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2) as pool:
            failing = await pglane.aio.enqueue(pool, lane, {"q": "fails"})
            queued = await pglane.aio.enqueue(pool, lane, {"q": "waits"})
            with pytest.raises(pglane.WaitTimeout, match="still queued at position 2"):
                await pglane.aio.wait(pool, queued, timeout=0.2)
            attempt = claimed(worker_session, lane)
            with pytest.raises(pglane.WaitTimeout, match="still running since"):
                await pglane.aio.wait(pool, failing, timeout=0)
            worker_session.execute(queries.FAIL, (attempt["attempt_id"], "quota exceeded", False, attempt["token"]))
            with pytest.raises(pglane.JobFailed, match="quota exceeded") as caught:
                await pglane.aio.wait(pool, failing, timeout=FOREVER)
            assert caught.value.attempt_id == attempt["attempt_id"]
            assert f"pglane retry {failing}" in (caught.value.next_safe_action or "")
            waiter = asyncio.create_task(pglane.aio.wait(pool, queued, timeout=FOREVER, poll_interval=FOREVER))
            await until(lambda: awaited(conn, queued))
            await pglane.aio.cancel(pool, queued)
            with pytest.raises(pglane.JobCancelled):
                await asyncio.wait_for(waiter, 30)

    run(scenario())


def backends(conn: Conn) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database()"
                       " AND backend_type = 'client backend'").fetchone()
    assert row is not None
    return int(row["n"])


def test_a_thousand_waits_share_one_listening_session_and_a_small_pool(
        dsn: str, conn: Conn, lane: str, worker_session: Conn) -> None:
    n = 1000
    ids = [int(r["id"]) for r in conn.execute(
        "INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', jsonb_build_object('n', g)"
        " FROM generate_series(1, %s) g RETURNING id", (n,)).fetchall()]
    before = backends(conn)

    async def scenario() -> list[Any]:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=4, timeout=120) as pool:
            waits = [asyncio.create_task(pglane.aio.wait(pool, job, timeout=FOREVER, poll_interval=FOREVER))
                     for job in ids]
            await until(lambda: conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE awaited"
                                             ).fetchone()["n"] == n, 120)  # type: ignore[index]
            during = backends(conn)
            assert during - before <= 4 + 1, f"{during - before} more sessions for {n} waits"
            assert len(waiting.async_listening_pids()) == 1
            for _ in range(n):
                complete(worker_session, lane, {"ok": True})
            return list(await asyncio.wait_for(asyncio.gather(*waits), 120))

    assert run(scenario()) == [{"ok": True}] * n


def readme_block() -> str:
    text = (ROOT / "docs" / "sql-api.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- tested: tests/test_aio.py -->\n```python\n(.*?)```", text, re.S)
    assert found, "docs/sql-api.md has no web-app block marked <!-- tested: tests/test_aio.py -->"
    return found.group(1)


def test_the_readme_web_app_handler_tells_waiting_to_start_then_returns_the_result(
        dsn: str, conn: Conn, session: Callable[..., Conn], monkeypatch: pytest.MonkeyPatch) -> None:
    pglane.create_lane(conn, "brain", job_timeout=20, waiting_grace=0.1)
    monkeypatch.setenv("PGLANE_DSN", dsn)
    told: list[str] = []
    worker = session()

    async def tell(text: str) -> None:
        told.append(text)
        if text.startswith("waiting to start") and len(told) == 1:  # now a worker comes
            take_slot(worker, "brain")
            complete(worker, "brain", {"summary": "report 7, summarised"})

    async def scenario() -> tuple[Any, Any]:
        handler: dict[str, Any] = {}
        exec(compile(readme_block(), "docs/sql-api.md", "exec"), handler)  # the docs' own code
        pool = handler["pool"]
        await pool.open()
        try:
            first = await handler["summarise"]("req-1", "summarise report 7", tell)
            again = await handler["summarise"]("req-1", "summarise report 7", tell)  # a reload: no second job
            return first, again
        finally:
            await pool.close()

    first, again = run(scenario())
    assert first == again == {"summary": "report 7, summarised"}
    assert told == ["waiting to start (position 1)"]
    assert len(pglane.jobs(conn, lane="brain")) == 1
