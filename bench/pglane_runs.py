"""pglane itself: the real worker as a consumer (throughput, wake, cost through bench.real), claim
latency against backlog and history, standby takeover, and enqueue throughput; and one real worker's
drain of a lane (``drain``), for the scenarios that run on a server of their own (rates, contention).

The parts of a server's run use database bench_pglane, migrated with pglane.schema.upgrade, each on
lanes of its own; ``drain`` works in whatever database it is given.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row, tuple_row

from pglane import client, queries, schema

from . import procs
from .real import Put, RealSystem, sql_producer
from .server import quiesce
from .stats import latency_ms, progress, rotations, summary, wait_until

LANE = "bench"
CLAIM_LANE = "claims"
TAKEOVER_LANE = "takeover"
ENQ_LANES = {"enq": None, "enq_unbounded": None, "enq_bounded": 100_000_000}
FLOOR_LANE = "floor"
# A plain INSERT, as a producer in any language enqueues (pglane's own enqueue is queries.ENQUEUE).
INSERT: LiteralString = "INSERT INTO pglane.jobs (lane, payload) VALUES (%s, %s::jsonb)"


def insert_params(lane: str, payload: str) -> tuple[str, str]:
    """INSERT's parameters."""
    return (lane, payload)


def enqueue_params(lane: str, payload: str) -> tuple[str, str, None, None, str, int, None, int, None, None]:
    """queries.ENQUEUE's parameters for one job: no idempotency key, no run_after, an error if the
    lane is full, cost 1, no group, priority 0, no job timeout of its own, no traceparent (the order of
    pglane.enqueue's arguments, as pglane.statements sends them)."""
    return (lane, payload, None, None, "error", 1, None, 0, None, None)


def lane_id(conn: psycopg.Connection[Any], name: str) -> int:
    """The lane's integer id (the first key of its slot locks), whatever the connection's row factory."""
    with conn.cursor(row_factory=tuple_row) as cur:
        row = cur.execute(queries.LANES, {"name": name}).fetchone()
    assert row is not None, name
    return int(row[0])


def claim_and_complete(conn: psycopg.Connection[dict[str, Any]], lane: str) -> float:
    """pglane.claim() on a session holding a slot of the lane, then (untimed) complete(): the claim's seconds."""
    t0 = time.perf_counter()
    row = conn.execute(queries.CLAIM, (lane, "bench")).fetchone()
    elapsed = time.perf_counter() - t0
    assert row is not None and row["job_id"] is not None, "the backlog ran dry"
    conn.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"]))
    return elapsed


def load_queued(conn: psycopg.Connection[Any], lane: str, count: int) -> None:
    """count queued jobs in one statement, through pglane's insert triggers (validation, bound, NOTIFY)."""
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(0, %s - 1) g", (lane, count))


def load_finished(conn: psycopg.Connection[Any], lane: str, count: int) -> None:
    """count finished jobs with one done attempt each, written directly: the insert trigger refuses
    non-queued rows, so triggers (and FK checks) are off for this session while it loads history."""
    conn.execute("SET session_replication_role = replica")
    try:
        conn.execute(
            "INSERT INTO pglane.jobs (lane, payload, status, created_at, run_after, started_at, finished_at,"
            " attempts, result, seq)"
            " SELECT %s, jsonb_build_object('n', g), 'done', t, t, t, t + interval '1 ms', 1, 'null', g"
            " FROM generate_series(1, %s) g, LATERAL (SELECT now() - interval '1 day' + g * interval '1 ms' AS t) x",
            (lane, count))
        conn.execute(
            "INSERT INTO pglane.attempts (job_id, attempt_number, status, worker, backend_pid, backend_start,"
            " started_at, finished_at, lease_expires_at, seq)"
            " SELECT id, 1, 'done', 'history', 0, created_at, started_at, finished_at,"
            " started_at + interval '660 seconds', seq FROM pglane.jobs WHERE lane = %s", (lane,))
    finally:
        conn.execute("RESET session_replication_role")


def insert_jobs(conn: psycopg.Connection[Any], lane: str, n: int) -> list[int]:
    """n queued jobs of the lane in one statement (payload ``{"n": i}``); their ids."""
    rows = conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                        " FROM generate_series(1, %s) g RETURNING id", (lane, n)).fetchall()
    return [int(r["id"]) for r in rows]


def drain(dsn: str, conn: psycopg.Connection[Any], lane: str, n: int) -> float:
    """One real worker (bench.handlers:noop, --max-jobs n) drains n queued jobs of the lane: jobs per
    second on the database clock, from the first start to the last finish."""
    proc = subprocess.Popen([sys.executable, "-m", "pglane", "worker", lane, "--handler", "bench.handlers:noop",
                             "--max-jobs", str(n)], env={**os.environ, "PGLANE_DSN": dsn}, cwd=procs.ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"the worker on {lane} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    row = conn.execute("SELECT count(*) FILTER (WHERE status = 'done') AS done,"
                       " extract(epoch FROM max(finished_at) - min(started_at))::float8 AS seconds"
                       " FROM pglane.jobs WHERE lane = %s", (lane,)).fetchone()
    assert row is not None
    if row["done"] != n:
        raise SystemExit(f"{lane}: {row['done']} of {n} jobs done")
    return float(n / row["seconds"])


def truncate(conn: psycopg.Connection[Any]) -> None:
    conn.execute("TRUNCATE pglane.attempts, pglane.jobs")


class Pglane(RealSystem):
    """pglane's real worker on one lane (default: the bench lane) of database bench_pglane.

    It logs warnings only (``--quiet``), as every other consumer here does: the peers run with no logging
    set up (so their per-job INFO lines are never formatted) and the floors log nothing. pglane's default,
    a line per job, costs the worker about 93,000 instructions a job (``python -m bench --only clients``)
    and a one-slot no-op drain 8-11 % of its jobs/s (``--only profile``: "a line per job");
    ``per_job_lines=True`` runs it so."""

    name = "pglane"
    db = "pglane"

    def __init__(self, lane: str = LANE, *, per_job_lines: bool = False) -> None:
        self.lane = lane
        self.per_job_lines = per_job_lines
        self.remaining_sql = (
            f"SELECT count(*) FROM (SELECT 1 FROM pglane.jobs WHERE lane = '{lane}' AND in_queue"
            " UNION ALL SELECT 1 FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
            f" WHERE a.status = 'running' AND j.lane = '{lane}' LIMIT 1) s")
        self.finished_sql = ("SELECT extract(epoch FROM max(finished_at))::float8 FROM pglane.jobs"
                             f" WHERE lane = '{lane}'")
        self.sessions_like = f"pglane {lane} %"

    def setup(self, dsn: str) -> None:
        schema.upgrade(dsn)
        with client.connect(dsn) as conn:
            for name in (LANE, CLAIM_LANE, TAKEOVER_LANE, FLOOR_LANE):
                client.create_lane(conn, name)
            for name, bound in ENQ_LANES.items():
                client.create_lane(conn, name, max_queued=bound)

    def reset(self, conn: psycopg.Connection[Any]) -> None:
        truncate(conn)

    def worker(self, dsn: str, handler: str, lane: str | None = None) -> tuple[list[str], dict[str, str]]:
        return (["-m", "pglane", "worker", lane or self.lane, "--handler", f"bench.handlers:{handler}",
                 "--poll-interval", "5", *([] if self.per_job_lines else ["--quiet"])], {"PGLANE_DSN": dsn})

    def bulk_enqueue(self, dsn: str, n: int) -> float:
        with psycopg.connect(dsn, autocommit=True) as conn:
            load_queued(conn, self.lane, n)
            return time.time()

    def producer(self, dsn: str) -> AbstractAsyncContextManager[Put]:
        lane = self.lane
        return sql_producer(dsn, queries.ENQUEUE, lambda n: enqueue_params(lane, f'{{"n": {n}}}'))


# ----- claim latency ---------------------------------------------------------------------------

def claim_latency(dsn: str, admin_dsn: str, queued: int, finished: int, claims: int, label: str
                  ) -> tuple[dict[str, Any], list[float]]:
    """p50/p99 of pglane.claim() with ``queued`` jobs waiting and ``finished`` jobs of history.
    Each timed claim is followed (untimed) by complete() and the enqueue of one new job, so the
    backlog stays at ``queued``."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        truncate(conn)
        progress(f"{label}: loading {finished} finished + {queued} queued")
        if finished:
            load_finished(conn, CLAIM_LANE, finished)
        load_queued(conn, CLAIM_LANE, queued)
        conn.execute("VACUUM ANALYZE pglane.jobs")
        if finished:
            conn.execute("VACUUM ANALYZE pglane.attempts")  # never analyze it empty: see performance.md
        quiesce(admin_dsn)
        conn.execute(queries.WAIT_SLOT, (lane_id(conn, CLAIM_LANE), 1))
        progress(f"{label}: {claims} claims")
        samples: list[float] = []
        for i in range(claims + 20):  # the first 20 warm the session's plan cache, untimed
            elapsed = claim_and_complete(conn, CLAIM_LANE)
            if i >= 20:
                samples.append(elapsed)
            conn.execute("INSERT INTO pglane.jobs (lane) VALUES (%s)", (CLAIM_LANE,))
        conn.execute("SELECT pg_advisory_unlock_all()")
        truncate(conn)
    stats = latency_ms(samples)
    return ({"queued": queued, "finished": finished, "p50_ms": stats["p50_ms"], "p99_ms": stats["p99_ms"],
             "claims": claims}, samples)


# ----- takeover --------------------------------------------------------------------------------

def _slot_state(conn: psycopg.Connection[Any], lid: int) -> tuple[int, int]:
    """(granted, waiting) session locks on slot 1 of lane id ``lid``."""
    row = conn.execute(
        "SELECT count(*) FILTER (WHERE granted), count(*) FILTER (WHERE NOT granted) FROM pglane.slot_holders"
        " WHERE lane_id = %s AND slot = 1", (lid,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def takeover(dsn: str, admin_dsn: str, kills: int, logs: Path) -> dict[str, Any]:
    """SIGKILL the active worker of a one-slot lane in the middle of a call while a standby waits and
    the next job is queued; time from the kill to the standby's handler starting that next job."""
    system = Pglane()
    stamps_file = logs / "takeover.stamps"
    stamps_file.unlink(missing_ok=True)
    args, env = system.worker(dsn, "stamp", lane=TAKEOVER_LANE)
    env = {**env, "BENCH_STAMPS": str(stamps_file)}
    samples: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        lid = lane_id(conn, TAKEOVER_LANE)
        for k in range(kills):
            progress(f"takeover: kill {k + 1}/{kills}")
            quiesce(admin_dsn)
            with procs.running(args, logs / "takeover-active.log", env) as active:
                wait_until(lambda: _slot_state(conn, lid)[0] == 1, 30, "the active worker's slot")
                with procs.running(args, logs / "takeover-standby.log", env) as standby:
                    wait_until(lambda: _slot_state(conn, lid)[1] == 1, 30, "the standby to wait")
                    first, second = 2 * k, 2 * k + 1
                    conn.execute(queries.ENQUEUE, enqueue_params(TAKEOVER_LANE, f'{{"n": {first}, "sleep": 60}}'))
                    wait_until(procs.has_stamp(stamps_file, first), 30, "the active worker's call")
                    conn.execute(queries.ENQUEUE, enqueue_params(TAKEOVER_LANE, f'{{"n": {second}}}'))
                    killed_at = time.time()
                    active.send_signal(signal.SIGKILL)
                    wait_until(procs.has_stamp(stamps_file, second), 30, "the standby to take over")
                    samples.append(procs.read_stamps(stamps_file)[second] - killed_at)
                    procs.stop(standby)
                procs.stop(active)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "runs": samples}


# ----- enqueue throughput ----------------------------------------------------------------------

def _one_by_one(query: LiteralString, lane: str,
                params: Callable[[str, str], Sequence[object]]) -> Callable[[psycopg.Connection[Any], int], None]:
    """Job n enqueued with one autocommitted ``query`` each, its parameters params(lane, payload)."""
    def run(conn: psycopg.Connection[Any], n: int) -> None:
        for i in range(n):
            conn.execute(query, params(lane, f'{{"n": {i}}}'))

    return run


def _batch(conn: psycopg.Connection[Any], n: int) -> None:
    with conn.transaction(), conn.cursor() as cur:
        cur.executemany(INSERT, [("enq", f'{{"n": {i}}}') for i in range(n)])


ENQUEUE_VARIANTS: dict[str, Callable[[psycopg.Connection[Any], int], None]] = {
    "insert": _one_by_one(INSERT, "enq", insert_params),
    "enqueue_fn": _one_by_one(queries.ENQUEUE, "enq", enqueue_params),
    "batch_executemany": _batch,
    "insert_unbounded_100k": _one_by_one(INSERT, "enq_unbounded", insert_params),
    "insert_bounded_100k": _one_by_one(INSERT, "enq_bounded", insert_params),
}


def enqueue_throughput(dsn: str, admin_dsn: str, n: int, backlog: int, repetitions: int) -> dict[str, Any]:
    """Jobs/s of one producer for each variant (one commit per job except the batch), interleaved.
    The *_100k variants insert into lanes that already hold ``backlog`` queued jobs; the bounded
    lane has max_queued set (far above), so every insert maintains and checks its counter."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        truncate(conn)
        progress(f"enqueue: loading {backlog} queued into a bounded and an unbounded lane")
        load_queued(conn, "enq_unbounded", backlog)
        load_queued(conn, "enq_bounded", backlog)
        conn.execute("VACUUM ANALYZE pglane.jobs")
        quiesce(admin_dsn)
        runs: dict[str, list[float]] = {name: [] for name in ENQUEUE_VARIANTS}
        for rep, name in rotations(list(ENQUEUE_VARIANTS), repetitions):
            progress(f"enqueue: {name} (repetition {rep + 1}/{repetitions})")
            t0 = time.perf_counter()
            ENQUEUE_VARIANTS[name](conn, n)
            runs[name].append(n / (time.perf_counter() - t0))
        truncate(conn)
    result: dict[str, Any] = {name: {"jobs_per_s": summary(values)} for name, values in runs.items()}
    result["jobs_per_run"] = n
    result["backlog"] = backlog
    return result
