"""Crashes at random moments over a few hundred jobs, a PostgreSQL restart in immediate mode in the
middle of a run, and many producers while the worker runs. After each: nothing lost, nothing paid
twice, nothing left running, every failure explained, seq gapless."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pglane
from pglane import schema
from pglane.embedded import EmbeddedServer, embedded_server
from tests.conftest import Ledger, Workers, concurrently, slot_holder, wait_until
from tests.crash.conftest import check_invariants, drained


def test_workers_killed_at_random_moments_over_hundreds_of_jobs(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    rng = random.Random(20261202)
    jobs = [pglane.enqueue(conn, lane, {"sleep": rng.choice([0, 0.005, 0.02])}) for _ in range(300)]
    for _ in range(10):
        victim = workers.start(lane)
        wait_until(lambda: slot_holder(conn, lane), 20, "a slot holder")
        time.sleep(rng.uniform(0.05, 0.4))  # the random moment of the kill: a sleep is the point here
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    workers.start(lane)
    drained(conn, lane, jobs, timeout=120)
    check_invariants(conn, lane, jobs, ledger)
    statuses = [pglane.job_status(conn, j)["status"] for j in jobs]
    assert statuses.count("failed") <= 10  # at most one cut call per kill


def test_a_standby_and_random_kills_keep_one_call_at_a_time(
    conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    rng = random.Random(7)
    jobs = [pglane.enqueue(conn, lane, {"sleep": 0.01}) for _ in range(150)]
    procs = [workers.start(lane), workers.start(lane)]
    for _ in range(6):
        # The holder among the live workers: the one that logged its slot (on a loaded machine the
        # standby may log it a while after the killed holder's backend let the lock go).
        def holding(procs: list[Any] = procs) -> list[Any]:
            return [p for p in procs if p.poll() is None and "holding slot" in Workers.log(p)]
        wait_until(lambda: slot_holder(conn, lane) and holding(), 30, "a live worker holding the slot")
        time.sleep(rng.uniform(0.1, 0.3))  # the random moment of the kill
        holder = holding()[0]
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        procs = [p for p in procs if p.poll() is None] + [workers.start(lane)]
    drained(conn, lane, jobs, timeout=120)
    check_invariants(conn, lane, jobs, ledger)
    ledger.assert_one_call_at_a_time()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """A server of its own, so that restarting it disturbs no other test."""
    with embedded_server(Path(tmp_path_factory.mktemp("restartable")) / "data") as srv:
        schema.upgrade(srv.dsn)
        yield srv


def test_postgres_restarted_in_immediate_mode_mid_run_loses_and_repeats_nothing(
    server: EmbeddedServer, tmp_path: Path
) -> None:
    ledger = Ledger(tmp_path / "ledger")
    fleet = Workers(server.dsn, ledger, tmp_path)
    with pglane.connect(server.dsn) as conn:
        pglane.create_lane(conn, "restart", job_timeout=20)
        jobs = [pglane.enqueue(conn, "restart", {"sleep": 0.01}) for _ in range(200)]
    try:
        fleet.start("restart", "tests.handlers:paid_call", "--poll-interval", "1")
        fleet.start("restart", "tests.handlers:paid_call", "--poll-interval", "1")
        wait_until(lambda: len(ledger.calls()) >= 40, 30, "the run to be under way")
        server.restart("immediate")
        with pglane.connect(server.dsn) as conn:
            late = [pglane.enqueue(conn, "restart", {}) for _ in range(20)]  # enqueued after the restart
            drained(conn, "restart", jobs + late, timeout=120)
            check_invariants(conn, "restart", jobs + late, ledger)
            logs = "".join(Workers.log(p) for p in fleet.procs)
            assert "reconnecting" in logs
            assert all(p.poll() is None for p in fleet.procs)
    finally:
        fleet.stop_all()


def test_many_producers_while_the_worker_runs_every_job_done_exactly_once(
    dsn: str, conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    workers.start(lane, "tests.handlers:noop")
    ids: list[int] = []
    lock = threading.Lock()

    def produce() -> None:
        with pglane.connect(dsn) as c:
            mine = [pglane.enqueue(c, lane, {}) for _ in range(500)]
        with lock:
            ids.extend(mine)

    concurrently([produce] * 8)
    assert len(set(ids)) == 4000
    drained(conn, lane, ids, timeout=180)
    check_invariants(conn, lane, ids, ledger)
    done = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status = 'done'").fetchone()["n"]
    assert done == 4000
    attempts = conn.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()["n"]
    assert attempts == 4000  # exactly once: one attempt per job
