"""`pglane worker --lanes-like PATTERN [--slots-each N]` (#34 point 1): one process serves every lane whose
name matches, those created while it runs included, and lets go of a lane that is deleted. Real worker
processes; a lane's creation and deletion reach it by NOTIFY pglane_lanes, which only makes it read the
lane list again (a forged one changes nothing)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import pglane
from pglane.worker import Worker, WorkerOptions
from tests.conftest import Ledger, Workers, console, lane_id, slot_holder, wait_until
from tests.test_many_lanes import PAID, all_done, create, holders, status


def slot_locks(conn: Any, lane_id: int) -> int:
    """Slot locks held on a lane id, whether or not the lane still exists (slot_holders needs its row)."""
    row = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
                       " AND classid = %s::oid AND granted", (lane_id,)).fetchone()
    return int(row["n"])


def watch_idle(conn: Any) -> bool:
    """The worker's watch of the lanes (its own connection) has been idle a while: it waits for news."""
    row = conn.execute("SELECT bool_and(clock_timestamp() - state_change > interval '0.3 s') AS idle"
                       " FROM pg_stat_activity WHERE application_name LIKE 'pglane % lanes'"
                       " AND state = 'idle'").fetchone()
    return bool(row["idle"])


def test_lanes_like_serves_the_matching_lanes_with_slots_each_and_not_the_others(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    matching = {"tenant_a": 2, "tenant_b": 2}
    create(conn, {**matching, "other": 1, "named": 1})
    proc = workers.start_lanes(["named"], "--lanes-like", "tenant_%", "--slots-each", "2", *PAID,
                               "--poll-interval", "30")
    wait_until(lambda: holders(conn, {**matching, "named": 1}) == {**matching, "named": 1}, 30, "every slot")
    jobs = [pglane.enqueue(conn, name, {}) for name in (*matching, "named") for _ in range(3)]
    other = pglane.enqueue(conn, "other", {})
    wait_until(all_done(conn, jobs), 30, "the matching and the named lanes' jobs")
    assert status(conn, other) == "queued" and slot_holder(conn, "other") == []
    assert sorted(ledger.calls()) == sorted(jobs) and proc.poll() is None


def test_a_lane_created_while_the_worker_runs_is_served_within_seconds_without_a_restart(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    create(conn, {"tenant_a": 1})
    proc = workers.start_lanes([], "--lanes-like", "tenant_%", *PAID, "--poll-interval", "30")
    wait_until(lambda: slot_holder(conn, "tenant_a"), 30, "the first lane's slot")
    wait_until(lambda: watch_idle(conn), 10, "the watch of the lanes to wait (past its gap between reads)")
    pid = proc.pid
    began = time.monotonic()
    create(conn, {"tenant_new": 1, "unrelated": 1})
    job = pglane.enqueue(conn, "tenant_new", {})
    wait_until(all_done(conn, [job]), 3, "the new lane's job, by notification (the poll is 30 s)")
    assert time.monotonic() - began < 3
    assert proc.poll() is None and proc.pid == pid and slot_holder(conn, "unrelated") == []
    assert "holding slot 1 of lane tenant_new" in Workers.log(proc) and ledger.calls() == [job]


def test_a_deleted_lane_finishes_its_call_releases_its_slots_and_the_others_go_on(
    conn: Any, dsn: str, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"tenant_a": 1, "tenant_b": 2}
    create(conn, lanes)
    gone_id = lane_id(conn, "tenant_b")
    proc = workers.start_lanes([], "--lanes-like", "tenant_%", "--slots-each", "2", *PAID, "--poll-interval", "30")
    wait_until(lambda: holders(conn, lanes) == {"tenant_a": 1, "tenant_b": 2}, 30, "every slot")
    running = pglane.enqueue(conn, "tenant_b", {"sleep": 2})
    wait_until(lambda: ledger.calls() == [running], 20, "a call in flight on the lane to delete")
    deleted = console(dsn, "lane", "delete", "tenant_b", "--force")
    assert deleted.returncode == 0, deleted.stderr
    wait_until(lambda: slot_locks(conn, gone_id) == 0, 10, "the deleted lane's slots released")
    # The call in flight ran to its end (never cut off), once; its outcome had no attempt left to go to.
    assert [event for event, job, _, _ in ledger.events() if job == running] == ["claimed", "start", "end"]
    log = Workers.log(proc)
    assert "lane tenant_b was deleted" in log and "outcome of attempt" in log and proc.poll() is None
    jobs = [pglane.enqueue(conn, "tenant_a", {}) for _ in range(3)]
    wait_until(all_done(conn, jobs), 20, "the other lane's jobs, after the deletion")
    create(conn, {"tenant_b": 1})  # made again: a new lane (a new id), served anew
    again = pglane.enqueue(conn, "tenant_b", {})
    wait_until(all_done(conn, [again]), 10, "the lane made again")
    calls = ledger.calls()
    assert len(calls) == len(set(calls)) == 5 and proc.poll() is None  # nothing ran twice


def test_a_forged_notification_changes_nothing(conn: Any, session: Any, workers: Workers, ledger: Ledger) -> None:
    lanes = {"tenant_a": 1, "tenant_b": 1}
    create(conn, {**lanes, "other": 1})
    proc = workers.start_lanes([], "--lanes-like", "tenant_%", *PAID, "--poll-interval", "30")
    wait_until(lambda: holders(conn, lanes) == lanes, 30, "every slot")
    pids = {name: slot_holder(conn, name) for name in lanes}
    forger = session()  # any login may NOTIFY any channel
    for payload in ("", "other", "tenant_a", "deleted tenant_b", "x" * 7000, "'; DROP TABLE pglane.lanes; --"):
        for _ in range(20):
            forger.execute("SELECT pg_notify('pglane_lanes', %s)", (payload,))
    jobs = [pglane.enqueue(conn, name, {}) for name in lanes]
    wait_until(all_done(conn, jobs), 20, "the lanes' jobs, after the forged notifications")
    assert {name: slot_holder(conn, name) for name in lanes} == pids  # no slot released, none retaken
    assert slot_holder(conn, "other") == [] and proc.poll() is None
    log = Workers.log(proc)
    assert log.count("holding slot") == 2 and "was deleted" not in log and "could not read" not in log


def test_the_python_api_serves_lanes_like_a_pattern(conn: Any, dsn: str) -> None:
    create(conn, {"t_1": 1, "x_1": 1})
    worker = Worker(dsn, lanes_like="t\\_%", handler=lambda job: {"lane": job.lane},
                    options=WorkerOptions(poll_interval=30))
    loops: list[asyncio.AbstractEventLoop] = []
    codes: list[int] = []

    async def serve() -> None:
        loops.append(asyncio.get_running_loop())
        codes.append(await worker.main())

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        create(conn, {"t_2": 1, "tx2": 1})  # tx2 matches t_% but not t\_%
        jobs = [pglane.enqueue(conn, name, {}) for name in ("t_1", "t_2")]
        wait_until(all_done(conn, jobs), 30, "both matching lanes' jobs")
        skipped = [pglane.enqueue(conn, name, {}) for name in ("x_1", "tx2")]
    finally:
        wait_until(lambda: loops, 10, "the worker's loop")
        loops[0].call_soon_threadsafe(worker.stop)
        thread.join(20)
    assert codes == [0] and not thread.is_alive()
    assert [pglane.result(conn, j) for j in jobs] == [{"lane": "t_1"}, {"lane": "t_2"}]
    assert [status(conn, j) for j in skipped] == ["queued", "queued"]


@pytest.mark.parametrize(("args", "says"), [
    (["--lanes-like", "t_%", "--handler", "a=tests.handlers:echo"], "--lanes-like serves the lanes it finds"),
    (["a", "--slots-each", "2", "--handler", "tests.handlers:echo"], "--slots-each is the slot count"),
    (["--lanes-like", "t_%", "--slots-each", "0", "--handler", "tests.handlers:echo"], "'0': give a whole number"),
    (["--handler", "tests.handlers:echo"], "or serve lanes by pattern with --lanes-like"),
])
def test_the_worker_command_refuses_a_pattern_plan_it_cannot_serve(dsn: str, args: list[str], says: str) -> None:
    done = console(dsn, "worker", *args)
    assert done.returncode == 2 and says in done.stderr, done.stderr
