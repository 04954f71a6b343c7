"""``python -m bench --only clients`` (bench.clients) at tiny scale: each consumer, run from start to exit
under callgrind, drains its preloaded jobs and is counted per job as the difference of two drains. No
figure of speed is asserted: only what must hold on any machine."""

from __future__ import annotations

import shutil

import psycopg
import pytest

from bench import clients
from bench.pglane_runs import FLOOR_LANE, Pglane
from bench.server import with_db

BIG, SMALL = 40, 8
pytestmark = pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian's package valgrind)")


@pytest.mark.timeout(600)  # four Python processes under callgrind, on a machine shared with the suite
def test_the_worker_and_floor_contract_are_counted_per_job_from_two_drains(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS bench_clients WITH (FORCE)")
        conn.execute("CREATE DATABASE bench_clients")
    db = with_db(dsn, "bench_clients")
    Pglane().setup(db)
    # 32 jobs apart: what the worker's timers add to one run (its threads wake 8 times a second, and a run
    # under valgrind on a loaded machine lasts tens of seconds: a few million instructions) must stay well
    # under what the jobs between the two drains cost (about 9 million). At 8 jobs apart it did not.
    runs = clients.measure(db, BIG, SMALL, 1, names=["pglane worker", "floor_contract"])

    # each process drained its jobs to the end: a worker exits (0, or measure raises) only after its
    # --max-jobs; the last drain, floor_contract's SMALL jobs on its lane (each preload empties the tables), is done
    with psycopg.connect(db) as conn:
        done: dict[str, int] = dict(conn.execute(
            "SELECT lane, count(*) FILTER (WHERE status = 'done') FROM pglane.jobs GROUP BY lane").fetchall())
    assert done == {FLOOR_LANE: SMALL}
    # a job costs a Python consumer tens to hundreds of thousands of instructions: not zero (nothing
    # counted), not millions (start-up counted in one drain only)
    for name in ("pglane worker", "floor_contract"):
        [per_job] = runs[name]
        assert 10_000 < per_job < 3_000_000, (name, per_job)
    lines = clients.report(runs, BIG, SMALL)
    assert f"{BIG} jobs less {SMALL}, 1 rounds" in lines[0]
    assert any(line.strip().startswith("pglane worker") and "floor_contract" in line for line in lines[1:])
