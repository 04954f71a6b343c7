"""``python -m bench --only scale [--dsn DSN] [--queued N] [--finished N] [--rounds N] [--before REV] [--json FILE]``

The operator's surface at scale (#19, points 1 and 2), in server time (EXPLAIN ANALYZE's execution
time: what the query costs the server, without the transfer to the client):

- listing: ``pglane jobs --status queued`` (pglane.queries.JOBS) over a queue of 10,000 and of
  ``--queued`` (default 100,000) jobs, 50 rows and all of them; one job's position (job_status
  WHERE job_id = the last queued job);
- lane_status of a lane whose queue of 20,000 waits past the grace with a slot held (so that every
  branch of its advice is read, the last 5 minutes' flow included), with no history and then behind
  ``--finished`` (default 1,000,000) finished jobs, 5 % of them failed or cancelled (#31 point 7: at
  most 2x the lane without history, and at most 20 ms);
- claim/complete: the worker's path (complete_and_claim on one slot, durable commits) with and
  without what lane_status's counts add to the job tables (the jobs_tally_* statement triggers, the
  failed_or_cancelled column and its index, attempts_finished): two databases of one server, the
  second with those removed, in interleaved rounds: jobs/s, the calls' server time
  (pg_stat_statements) and the backend's CPU per job (/proc), each side's median and their ratio.

``--before REV`` (default: the commit before #19's listing work) also measures the views of that
revision (read with ``git show REV:sql/views.sql``, created in schema bench_before over the same
tables) for the before/after figures; ``--before ''`` skips them. With no --dsn (and no PGLANE_DSN)
a throwaway embedded PostgreSQL runs it. Everything happens in databases bench_scale and
bench_scale_without, dropped first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pglane import client, queries, schema

from . import callgrind
from .pglane_runs import load_finished
from .server import tune_embedded, with_db
from .stats import median_interval, verdict

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "9dca339"  # the last commit before #19's listing and lane_status work
# pglane jobs's statement at BEFORE, over the view named {view} (positions from job_status, per row).
JOBS_BEFORE = (
    "SELECT * FROM {view}"
    " WHERE (%(lane)s::text IS NULL OR lane = %(lane)s) AND (%(status)s::text IS NULL OR status = %(status)s)"
    " ORDER BY status <> 'queued', (status = 'queued' AND run_after > now()),"
    " CASE WHEN status = 'queued' AND run_after > now() THEN run_after END,"
    " CASE WHEN status = 'queued' THEN created_at END, CASE WHEN status = 'queued' THEN job_id END,"
    " job_id DESC LIMIT %(limit)s"
)
# What lane_status's counts add to the job tables (bench_scale_without has none of it): statement
# triggers (they do not fire on claim or complete), the generated column failed_or_cancelled with its
# partial index, and attempts_finished.
BOUND = 1.02  # #19: lane_status's counts slow the claim/complete path by at most 2 %
TALLY_TRIGGERS = ("jobs_tally_insert", "jobs_tally_delete", "jobs_tally_truncate", "jobs_tally_update")


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """The DSN of a fresh database bench_scale on the given server, or on a throwaway embedded one."""
    if dsn:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP DATABASE IF EXISTS bench_scale WITH (FORCE)")
            conn.execute("CREATE DATABASE bench_scale")
        yield with_db(dsn, "bench_scale")
        return
    from pglane.embedded import embedded_server

    with embedded_server(fsync=True) as embedded:
        tune_embedded(embedded.dsn)  # durable commits, as the other benches, and pg_stat_statements loaded
        embedded.restart("fast")
        with psycopg.connect(embedded.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench_scale")
        yield with_db(embedded.dsn, "bench_scale")


def first(row: dict[str, Any] | None) -> dict[str, Any]:
    assert row is not None
    return row


def server_ms(conn: psycopg.Connection[Any], query: str, params: Any = None) -> float:
    """The query's execution time on the server, in ms (EXPLAIN ANALYZE, without per-node timing)."""
    plan = conn.execute(sql.SQL("EXPLAIN (ANALYZE, TIMING OFF, FORMAT JSON) ") + sql.SQL(query),
                        params).fetchone()
    assert plan is not None
    doc = plan[0] if isinstance(plan, tuple) else next(iter(plan.values()))
    return float(doc[0]["Execution Time"])


def timed(conn: psycopg.Connection[Any], query: str, params: Any = None, runs: int = 5) -> dict[str, float]:
    """Median and best of ``runs`` executions (after one warm-up), in ms."""
    server_ms(conn, query, params)
    samples = [server_ms(conn, query, params) for _ in range(runs)]
    return {"median_ms": round(statistics.median(samples), 2), "best_ms": round(min(samples), 2)}


def install_before(conn: psycopg.Connection[Any], rev: str) -> bool:
    """Create rev's lane_status and job_status in schema bench_before; False if git cannot show them."""
    try:
        text = subprocess.run(["git", "show", f"{rev}:sql/views.sql"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return False
    conn.execute("DROP SCHEMA IF EXISTS bench_before CASCADE")
    conn.execute("CREATE SCHEMA bench_before")
    for name in ("lane_status", "job_status"):
        found = re.search(rf"CREATE OR REPLACE VIEW pglane\.{name}\b.*?;\n", text, re.S)
        assert found, f"no view {name} at {rev}"
        conn.execute(found.group(0).replace(f"pglane.{name}", f"bench_before.{name}", 1))
    return True


def queue(conn: psycopg.Connection[Any], lane: str, n: int) -> None:
    """n queued jobs, created a minute ago (past the grace), through the producers' INSERT path."""
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(1, %s) g", (lane, n))
    conn.execute("UPDATE pglane.jobs SET created_at = created_at - interval '1 minute',"
                 " run_after = run_after - interval '1 minute' WHERE lane = %s AND in_queue", (lane,))
    conn.execute("VACUUM ANALYZE pglane.jobs")


def listing(conn: psycopg.Connection[Any], depth: int, before: bool, runs: int) -> dict[str, Any]:
    lane = f"deep{depth}"
    client.create_lane(conn, lane)
    queue(conn, lane, depth)
    out: dict[str, Any] = {"queued": depth}
    for limit in (50, None):
        params = {"lane": lane, "status": "queued", "limit": limit}
        label = "all" if limit is None else str(limit)
        out[f"after_{label}"] = timed(conn, queries.JOBS, params, runs)
        if before and depth <= 10_000:  # the old way costs rows x depth: 100,000 deep, an hour and more
            out[f"before_{label}"] = timed(conn, JOBS_BEFORE.format(view="bench_before.job_status"), params, 1)
    last = conn.execute("SELECT max(id) FROM pglane.jobs WHERE lane = %s AND in_queue", (lane,)).fetchone()
    assert last is not None
    one = "SELECT * FROM {} WHERE job_id = %s"
    out["one_job_after"] = timed(conn, one.format("pglane.job_status"), (last[0],), runs)
    if before:  # one job's position: the same count of the queue index, before and after
        out["one_job_before"] = timed(conn, one.format("bench_before.job_status"), (last[0],), runs)
    conn.execute("DELETE FROM pglane.jobs WHERE lane = %s", (lane,))
    return out


def lane_status(conn: psycopg.Connection[Any], finished: int, before: bool, runs: int,
                queued: int = 20_000, failed_share: float = 0.05) -> dict[str, Any]:
    """lane_status of one lane with ``queued`` jobs waiting past the grace and a slot held (every branch
    of its advice read, the last 5 minutes' flow included), first with no history (lane fresh), then
    (lane history) behind ``finished`` finished jobs of which ``failed_share`` failed or cancelled (half
    each): #31 point 7 asks the second for at most 2x the first, and at most 20 ms."""
    out: dict[str, Any] = {"finished": finished, "queued": queued,
                           "failed_or_cancelled": int(finished * failed_share)}

    def measure(lane: str, with_before: bool) -> dict[str, Any]:
        lane_id = conn.execute(queries.LANES, {"name": lane}).fetchone()
        assert lane_id is not None
        conn.execute(queries.TRY_SLOT, (lane_id[0], 1))  # a worker holds the slot: the advice reads the flow
        query = f"SELECT * FROM {{}}.lane_status WHERE lane = '{lane}'"
        row = conn.execute(query.format("pglane")).fetchone()
        assert row is not None
        names = [c.name for c in conn.execute("SELECT * FROM pglane.lane_status LIMIT 0").description or []]
        shown = ("queued", "running", "done", "failed", "cancelled", "next_safe_action")
        got: dict[str, Any] = {"row": {k: str(v) for k, v in zip(names, row, strict=False) if k in shown}}
        got["after"] = timed(conn, query.format("pglane"), None, runs)
        if with_before:
            got["before"] = timed(conn, query.format("bench_before"), None, runs)
        conn.execute(queries.RELEASE_SLOT, (lane_id[0], 1))
        return got

    client.create_lane(conn, "fresh")
    queue(conn, "fresh", queued)
    conn.execute("VACUUM ANALYZE pglane.attempts")
    out["no_history"] = measure("fresh", False)
    conn.execute("DELETE FROM pglane.jobs WHERE lane = 'fresh'")
    client.create_lane(conn, "history")
    t0 = time.monotonic()
    load_finished(conn, "history", finished)  # triggers off: counted by recount_tallies() below
    every = max(1, round(2 / failed_share)) if failed_share > 0 else 0
    if every:  # 1 in `every` failed, 1 in `every` cancelled (written as the functions do: the flag with status)
        conn.execute("SET session_replication_role = replica")
        conn.execute("UPDATE pglane.jobs SET status = CASE WHEN id %% %s = 0 THEN 'failed' ELSE 'cancelled' END,"
                     " failed_or_cancelled = true WHERE lane = 'history' AND id %% %s IN (0, 1)", (every, every))
        conn.execute("RESET session_replication_role")
    conn.execute("SELECT pglane.recount_tallies()")
    queue(conn, "history", queued)
    conn.execute("VACUUM ANALYZE pglane.attempts")
    out["load_s"] = round(time.monotonic() - t0, 1)
    out["history"] = measure("history", before)
    out["ratio_to_no_history"] = round(out["history"]["after"]["median_ms"]
                                       / out["no_history"]["after"]["median_ms"], 2)
    return out


def without_counts(dsn: str) -> None:
    """pglane's schema in database ``dsn`` less what lane_status's counts add to the job tables."""
    schema.upgrade(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for trigger in TALLY_TRIGGERS:
            conn.execute(sql.SQL("DROP TRIGGER {} ON pglane.jobs").format(sql.Identifier(trigger)))
        conn.execute("ALTER TABLE pglane.jobs DROP COLUMN failed_or_cancelled CASCADE")  # and lane_status


def claim_complete_instructions(jobs: int, rounds: int) -> dict[str, Any]:
    """The same comparison in instructions (bench.callgrind): a single-user backend of an embedded
    cluster drains ``jobs`` jobs through complete_and_claim in each database, ``rounds`` times
    interleaved."""
    def with_counts(dsn: str) -> None:
        schema.upgrade(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            client.create_lane(conn, "cc")

    def without(dsn: str) -> None:
        without_counts(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            client.create_lane(conn, "cc")

    counts = callgrind.interleaved_drains({"bench_scale": with_counts, "bench_scale_without": without}, jobs, rounds)
    return {"jobs_per_round": jobs, "rounds": rounds,
            "instructions_per_job": compare({True: counts["bench_scale"], False: counts["bench_scale_without"]},
                                            "<=", BOUND)}


class Drainer:
    """One slot of lane cc in one database: drains rounds of jobs through complete_and_claim."""

    def __init__(self, dsn: str, durable: bool) -> None:
        self.conn = client.connect(dsn)
        if not durable:  # the functions' own work, without the commit's flush and its noise
            self.conn.execute("SET synchronous_commit = off")
        client.create_lane(self.conn, "cc")
        lane_id = first(self.conn.execute(queries.LANES, {"name": "cc"}).fetchone())["id"]
        self.conn.execute(queries.TRY_SLOT, (lane_id, 1))
        self.conn.execute(queries.SLOT_HINT, ("1",))
        try:  # the server's own time per call, without the commit's flush: steadier than jobs/s
            self.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self.conn.execute("SELECT pg_stat_statements_reset()")  # refused unless preloaded
            self.statements = True
        except psycopg.Error:
            self.statements = False
        self.pid = first(self.conn.execute("SELECT pg_backend_pid() AS pid").fetchone())["pid"]

    def cpu_seconds(self) -> float | None:
        """The backend's CPU time so far (user + system), if its /proc entry is readable here."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def drain(self, jobs: int) -> tuple[float, float | None, float | None]:
        """jobs/s, the calls' mean server time (us) and the backend's CPU per job (us) of one round.
        History stays, as in service (an emptied attempts table would leave the claim with the plans
        of an empty table: a trap, not a measure)."""
        conn = self.conn
        conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'cc', '{}' FROM generate_series(1, %s)", (jobs,))
        conn.execute("VACUUM ANALYZE pglane.jobs")
        conn.execute("VACUUM ANALYZE pglane.attempts")
        conn.execute("CHECKPOINT")  # no round pays for another's dirty pages
        if self.statements:
            conn.execute("SELECT pg_stat_statements_reset()")
        row = first(conn.execute(queries.CLAIM_OR_WAIT, ("cc", "bench")).fetchone())
        cpu0 = self.cpu_seconds()
        t0 = time.perf_counter()
        n = 0
        while row["job_id"] is not None:
            row = first(conn.execute(queries.COMPLETE_AND_CLAIM,
                                     (row["attempt_id"], "null", "cc", "bench", row["token"])).fetchone())
            n += 1
        rate = n / (time.perf_counter() - t0)
        cpu1 = self.cpu_seconds()
        cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n * 1e6
        us = None
        if self.statements:
            found = conn.execute("SELECT mean_exec_time FROM pg_stat_statements"
                                 " WHERE query LIKE '%%pglane.complete_and_claim%%' AND dbid ="
                                 " (SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
            us = None if found is None else found["mean_exec_time"] * 1000
        return rate, us, cpu


def claim_complete(dsn: str, jobs: int, rounds: int, durable: bool) -> dict[str, Any]:
    """The worker's path on one slot, in two databases of one server that differ only by what
    lane_status's counts add to the job tables: this one (head) and bench_scale_without (head with
    the tally triggers, the failed_or_cancelled column and its index and attempts_finished removed),
    in interleaved rounds, each database growing the same history."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS bench_scale_without WITH (FORCE)")
        admin.execute("CREATE DATABASE bench_scale_without")
    other = with_db(dsn, "bench_scale_without")
    without_counts(other)
    sides = {True: Drainer(dsn, durable), False: Drainer(other, durable)}
    try:
        for side in sides.values():  # warm-up, and a history behind the queue
            side.drain(jobs)
            side.drain(jobs)
        rates: dict[bool, list[float]] = {True: [], False: []}
        server: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                rate, us, cpu_us = sides[on].drain(jobs)
                rates[on].append(rate)
                if us is not None:
                    server[on].append(us)
                if cpu_us is not None:
                    cpu[on].append(cpu_us)
    finally:
        for side in sides.values():
            side.conn.close()
    out: dict[str, Any] = {"jobs_per_round": jobs, "rounds": rounds, "synchronous_commit": "on" if durable else "off",
                           "jobs_s": compare(rates, ">=", 1 / BOUND)}
    if len(server[True]) == len(server[False]) == rounds:  # pg_stat_statements: the calls' execution time
        out["server_us_per_job"] = compare(server, "<=", BOUND)
    if len(cpu[True]) == len(cpu[False]) == rounds:  # the backend's CPU time (a server on this machine)
        out["backend_cpu_us_per_job"] = compare(cpu, "<=", BOUND)
    return out


def compare(values: dict[bool, list[float]], op: str, bound: float) -> dict[str, Any]:
    """Interleaved rounds with (True) and without (False) the counts: each side, the paired ratios, a
    bootstrap interval of their median and the verdict against #19's bound (at most 2 % slower)."""
    ratios = [w / b for w, b in zip(values[True], values[False], strict=True)]
    interval = median_interval(ratios)
    return {"with_counts": [round(x, 1) for x in values[True]], "without": [round(x, 1) for x in values[False]],
            "median_with": round(statistics.median(values[True]), 1),
            "median_without": round(statistics.median(values[False]), 1),
            "ratio_median": round(statistics.median(ratios), 4),
            "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
            "interval_90": [round(interval[0], 4), round(interval[1], 4)],
            "verdict": f"{verdict(interval, statistics.median(ratios), op, bound)} ({op} {bound:.4f})"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --only scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--dsn", help="a server to run on (default: $PGLANE_DSN, else a throwaway embedded one)")
    p.add_argument("--queued", type=int, default=100_000)
    p.add_argument("--finished", type=int, default=1_000_000)
    p.add_argument("--runs", type=int, default=5, help="timed runs per query (median reported)")
    p.add_argument("--rounds", type=int, default=10, help="interleaved claim/complete rounds of each kind")
    p.add_argument("--cc-jobs", type=int, default=3000, help="jobs per claim/complete round")
    p.add_argument("--before", default=BEFORE, help="revision whose views give the before figures ('': none)")
    p.add_argument("--async-commit", action="store_true",
                   help="claim/complete with synchronous_commit off: the functions' work without the flush's noise")
    p.add_argument("--ic-jobs", type=int, default=400, help="jobs per round counted in instructions")
    p.add_argument("--only", nargs="*", choices=("listing", "lane_status", "claim_complete", "instructions"))
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    only = set(args.only or ("listing", "lane_status", "claim_complete", "instructions"))
    results: dict[str, Any] = {}
    if only - {"instructions"}:  # the rest run on a server (the instructions on a cluster of their own)
        with database(args.dsn or os.environ.get("PGLANE_DSN")) as dsn:
            schema.upgrade(dsn)
            with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
                results["server"] = first(conn.execute("SELECT version()").fetchone())["version"]
            with psycopg.connect(dsn, autocommit=True) as conn:
                before = bool(args.before) and install_before(conn, args.before)
                if "listing" in only:
                    for depth in sorted({10_000, args.queued}):
                        results[f"listing_{depth}"] = listing(conn, depth, before, args.runs)
                        print(json.dumps({f"listing_{depth}": results[f"listing_{depth}"]}), flush=True)
                if "lane_status" in only:
                    results["lane_status"] = lane_status(conn, args.finished, before, args.runs)
                    print(json.dumps({"lane_status": results["lane_status"]}), flush=True)
                conn.execute("TRUNCATE pglane.attempts, pglane.jobs")
            if "claim_complete" in only:
                results["claim_complete"] = claim_complete(dsn, args.cc_jobs, args.rounds, not args.async_commit)
                print(json.dumps({"claim_complete": results["claim_complete"]}), flush=True)
    if "instructions" in only:
        missing = callgrind.available()
        results["claim_complete_instructions"] = (
            {"skipped": missing} if missing else claim_complete_instructions(args.ic_jobs, args.rounds))
        print(json.dumps({"claim_complete_instructions": results["claim_complete_instructions"]}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
