"""bench.throughput's floors at several slots, at tiny scale: the standing floor processes (``python -m
bench.floors serve``) drain floor_rows, the contract's rows alone, at three slots at once: every job once,
claims in one gapless order. No figure of speed is asserted: only what must hold on any machine."""

from __future__ import annotations

from pathlib import Path

import psycopg

from bench import floors, procs, throughput
from bench.server import BenchServer, with_db
from pglane import client, schema

SLOTS, JOBS = 3, 900


def test_floor_rows_at_three_slots_drains_every_job_once_in_one_gapless_order(dsn: str, tmp_path: Path) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for db in ("floors_bare", "floors_pglane"):
            conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {db}")
    server = BenchServer(admin_dsn=dsn, dsns={"bare": with_db(dsn, "floors_bare"),
                                              "pglane": with_db(dsn, "floors_pglane")})
    floors.setup(server.dsn("bare"))
    schema.upgrade(server.dsn("pglane"))
    with client.connect(server.dsn("pglane")) as conn:
        client.create_lane(conn, throughput.floor_lane(SLOTS), slots=SLOTS)
    pool = throughput.FloorPool(SLOTS, bare_db="bare", contract_db="pglane")
    group = throughput.FloorGroup("floor_rows", pool)
    try:
        pool.start(server, tmp_path)
        group.prepare(server, JOBS)
        group.run(server, JOBS)  # every process answered done
    finally:
        for proc in pool.procs:  # EOF on stdin ends a floor process
            assert proc.stdin is not None
            proc.stdin.close()
        for proc in pool.procs:
            try:
                proc.wait(30)
            finally:
                procs.stop(proc)
    assert [proc.returncode for proc in pool.procs] == [0] * SLOTS

    with psycopg.connect(server.dsn("bare"), autocommit=True) as conn:
        jobs = conn.execute("SELECT count(*) FILTER (WHERE status = 'done' AND attempts = 1), count(*)"
                            " FROM floor_rows_jobs").fetchone()
        attempts = conn.execute("SELECT count(*) FILTER (WHERE status = 'done'), count(DISTINCT job_id),"
                                " array_agg(seq ORDER BY seq) = array(SELECT generate_series(1, %s)::bigint)"
                                " FROM floor_rows_attempts", (JOBS,)).fetchone()
        workers = conn.execute("SELECT count(DISTINCT worker) FROM floor_rows_attempts").fetchone()
    assert jobs == (JOBS, JOBS)
    assert attempts == (JOBS, JOBS, True)
    # claimed at once by more than one process (each names its slot): a drain of about a second, begun by
    # the three within milliseconds of each other
    assert workers is not None and 2 <= workers[0] <= SLOTS
