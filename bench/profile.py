"""``python -m bench --only profile [--jobs N]``: where the pglane worker loses against floor_contract.

It runs alone (not in a server's run of ``python -m bench``), on its own embedded server (or PGLANE_DSN) it measures:
1. throughput, interleaved: floor_contract (sync psycopg), the same loop on async psycopg, the real
   worker (warnings only, as the floors log nothing), the worker with its default log line per job, and
   the worker with its handler awaited directly (BENCH_EXPERIMENT=lean-call, see bench.handlers):
   splits the gap into async driver, logging, call scaffolding and the rest of the worker;
2. the worker under cProfile (BENCH_PROFILE, see bench.handlers): calls per job and own time;
3. server side: pg_stat_statements with track=all around floor_contract: each statement inside
   pglane.claim / complete / complete_and_claim, its calls and mean time;
4. HOT updates per table (pg_stat_user_tables) after the drains;
5. wake latency: floor_listen (bare), the same LISTEN loop on pglane's SQL, the real worker;
6. the plan the claim's job lookup gets (auto_explain, nested) on a small all-queued table and
   behind history;
7. the claim on an idle backend (spaced like the wake-latency jobs) against floor_listen's statement:
   the part of the wake-latency gap that is server work.
Prints one plain-text report.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pglane import queries

from . import floors, real
from .pglane_runs import (
    CLAIM_LANE,
    FLOOR_LANE,
    LANE,
    Pglane,
    claim_and_complete,
    lane_id,
    load_finished,
    load_queued,
    truncate,
)
from .procs import RESULTS
from .server import bench_server
from .stats import latency_ms, progress, progress_done, rotations


async def _contract_async(dsn: str, lid: int, n: int) -> float:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        await conn.execute(queries.WAIT_SLOT, (lid, 1))
        t0 = time.perf_counter()
        job = await (await conn.execute(queries.CLAIM, (FLOOR_LANE, "floor"))).fetchone()
        for _ in range(n + 2):
            if job is None or job["job_id"] is None:
                break
            job = await (await conn.execute(queries.COMPLETE_AND_CLAIM, (job["attempt_id"], "null", FLOOR_LANE,
                                                                        "floor", job["token"]))).fetchone()
        elapsed = time.perf_counter() - t0
        await conn.execute(queries.RELEASE_SLOT, (lid, 1))
        return elapsed


def contract_async(dsn: str, n: int) -> float:
    floors.contract_preload(dsn, n)
    with psycopg.connect(dsn, autocommit=True) as conn:
        lid = lane_id(conn, FLOOR_LANE)
    return n / asyncio.run(_contract_async(dsn, lid, n))


class Experiment(Pglane):
    """The real worker with BENCH_EXPERIMENT set (see bench.handlers)."""

    def __init__(self, experiment: str) -> None:
        super().__init__()
        self.experiment = experiment

    def worker(self, dsn: str, handler: str, lane: str | None = None) -> tuple[list[str], dict[str, str]]:
        args, env = super().worker(dsn, handler, lane)
        return args, {**env, "BENCH_EXPERIMENT": self.experiment}


def _profile_summary(path: Path, jobs: int) -> list[str]:
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values())
    waiting = sum(entry[2] for key, entry in raw.items() if key[2] in ("<method 'poll' of 'select.epoll' objects>",))
    lines = [f"profiled CPU+wait {total:.3f} s for {jobs} jobs; of it waiting in epoll (server time) {waiting:.3f} s;"
             f" Python own time {(total - waiting) / jobs * 1e6:.0f} µs/job (profiler-inflated)"]
    groups: dict[str, float] = {}
    for (filename, _line, func), entry in raw.items():
        if func == "<method 'poll' of 'select.epoll' objects>":
            continue
        if "pglane" in filename and "site-packages" not in filename:
            group = "pglane worker code"
        elif "psycopg" in filename:
            group = "psycopg"
        elif "asyncio" in filename or "selectors" in filename or "Context" in func:
            group = "asyncio"
        elif "threading" in filename or "_thread" in func:
            group = "threading"
        else:
            group = "other"
        groups[group] = groups.get(group, 0.0) + entry[2]
    ranked = sorted(groups.items(), key=lambda x: -x[1])
    lines += [f"  {g:<22} {t / jobs * 1e6:7.1f} µs/job own time" for g, t in ranked]
    lines.append("  per job: calls (coroutine resumptions count as calls) and cumulative time")
    wanted = ("_call", "call", "_call_slow", "_write_and_claim", "arm", "disarm", "start", "outcome_of",
              "ensure_future", "create_task", "wait", "call_later", "_run_once", "execute")
    for (filename, _line, func), entry in sorted(raw.items(), key=lambda kv: -kv[1][3]):
        if func in wanted and entry[1] >= jobs:
            where = Path(filename).name
            lines.append(f"    {where + ':' + func:<34} {entry[1] / jobs:5.2f} calls,"
                         f" cumulative {entry[3] / jobs * 1e6:6.1f} µs")
    return lines[:40]


def _server_breakdown(server_dsn: str, admin_dsn: str, jobs: int) -> list[str]:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_stat_statements_reset()")
    floors.contract_preload(server_dsn, jobs)
    with psycopg.connect(server_dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SET pg_stat_statements.track = 'all'")
        floors.contract_drain(conn, jobs)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT calls, total_exec_time, toplevel, wal_bytes, regexp_replace(query, '\\s+', ' ', 'g')"
            " FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid"
            " WHERE d.datname = 'bench_pglane' AND calls >= %s ORDER BY total_exec_time DESC LIMIT 14", (jobs // 2,),
        ).fetchall()
    lines = ["  mean µs/call  calls/job  WAL B/job  top  statement (nested statements inside pglane's functions)"]
    for calls, total, top, wal, query in rows:
        lines.append(f"  {total / calls * 1000:12.1f} {calls / jobs:10.2f} {float(wal) / jobs:10.0f}  "
                     f"{'yes' if top else ' no'}  {query[:150]}")
    return lines


def _floor_exec(floor_dsn: str, admin_dsn: str, jobs: int) -> str:
    """Mean server execution time of floor_one_commit's single statement, for comparison."""
    floors.preload(floor_dsn, jobs)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_stat_statements_reset()")
        floors.one_commit(floor_dsn, jobs)
        row = admin.execute(
            "SELECT total_exec_time / calls, wal_bytes / calls FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = 'bench_floor' AND query LIKE 'WITH done AS%'"
        ).fetchone()
    if row is None:
        return "  floor_one_commit statement: not seen"
    return (f"  for comparison, floor_one_commit's one statement: {row[0] * 1000:.1f} µs mean exec,"
            f" {float(row[1]):.0f} WAL B/call")


def _hot(dsn: str, tables: list[str]) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
            " WHERE schemaname || '.' || relname = ANY(%s) ORDER BY 1", (tables,)).fetchall()
    return [f"  {name:<22} inserts {ins:>7}  updates {upd:>7}  HOT {hot:>7} ({(hot / upd * 100) if upd else 0:.0f} %)"
            for name, ins, upd, hot in rows]


def _collect(into: list[str]) -> Any:
    return lambda diag: into.append(diag.message_primary or "")


def _claim_plans(dsn: str) -> list[str]:
    lines = []
    for queued, finished in ((1_000, 0), (1_000, 100_000)):
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            truncate(conn)
            if finished:
                load_finished(conn, CLAIM_LANE, finished)
            load_queued(conn, CLAIM_LANE, queued)
            conn.execute("VACUUM ANALYZE pglane.jobs")
            conn.execute(queries.WAIT_SLOT, (lane_id(conn, CLAIM_LANE), 1))
            for _ in range(8):  # past plpgsql's custom-plan phase
                claim_and_complete(conn, CLAIM_LANE)
            notices: list[str] = []
            conn.add_notice_handler(_collect(notices))
            conn.execute("LOAD 'auto_explain'")
            conn.execute("SET auto_explain.log_min_duration = 0")
            conn.execute("SET auto_explain.log_nested_statements = on")
            conn.execute("SET client_min_messages = log")
            conn.execute(queries.CLAIM, (CLAIM_LANE, "bench")).fetchone()
            conn.execute("RESET client_min_messages")
            plan = next((n for n in notices if "FROM pglane.jobs j" in n and "SKIP LOCKED" in n), "(no plan seen)")
            body = plan.split("\n", 1)[-1] if "Query Text" in plan else plan
            lines.append(f"  {queued:,} queued + {finished:,} finished:")
            lines += ["    " + line for line in body.splitlines() if "->" in line or "Limit" in line or "Scan" in line]
            truncate(conn)
    return lines


COLD_GAP_S = 0.03  # the wake-latency protocol's spacing: the server backend sleeps between jobs


def _cold_claims(server: Any, count: int) -> list[str]:
    """What a wake-up pays on the server: claims spaced like the wake-latency jobs (the backend idle
    and its caches cold in between), against floor_listen's statement spaced alike, interleaved.
    Client-side round trip (commit included), and pg_stat_statements with track=all on the two timed
    sessions only (producers and completions run on other sessions, at the server's track=top)."""
    pg_dsn, floor_dsn = server.dsn("pglane"), server.dsn("floor")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        truncate(conn)
    with psycopg.connect(floor_dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE floor_jobs")
    with (psycopg.connect(server.admin_dsn, autocommit=True) as admin,
          psycopg.connect(pg_dsn, autocommit=True, row_factory=dict_row) as claimer,
          psycopg.connect(floor_dsn, autocommit=True) as floor,
          psycopg.connect(pg_dsn, autocommit=True) as pg_other,
          psycopg.connect(floor_dsn, autocommit=True) as floor_other):
        claimer.execute(queries.WAIT_SLOT, (lane_id(claimer, LANE), 1))
        for c in (claimer, floor):
            c.execute("SET pg_stat_statements.track = 'all'")
        admin.execute("SELECT pg_stat_statements_reset()")
        times: dict[str, list[float]] = {"pglane.claim()": [], "floor_listen's statement": []}
        for _ in range(count):
            pg_other.execute("INSERT INTO pglane.jobs (lane) VALUES (%s)", (LANE,))
            floor_other.execute("INSERT INTO floor_jobs DEFAULT VALUES")
            time.sleep(COLD_GAP_S)
            started = time.perf_counter()
            job = claimer.execute(queries.CLAIM, (LANE, "cold")).fetchone()
            times["pglane.claim()"].append(time.perf_counter() - started)
            time.sleep(COLD_GAP_S)
            started = time.perf_counter()
            row = floor.execute(floors.COMPLETE_AND_CLAIM, {"prev": None}).fetchone()
            times["floor_listen's statement"].append(time.perf_counter() - started)
            assert job is not None and row is not None
            pg_other.execute(queries.COMPLETE, (job["attempt_id"], None, job["token"]))
            floor_other.execute(floors.COMPLETE, {"prev": row[0]})
        rows = admin.execute(
            "SELECT mean_exec_time, toplevel, regexp_replace(query, '\\s+', ' ', 'g') FROM pg_stat_statements"
            " WHERE calls >= %s AND (NOT toplevel OR query LIKE '%%pglane.claim(%%' OR query LIKE 'WITH done AS%%')"
            " ORDER BY mean_exec_time DESC LIMIT 10", (count,)).fetchall()
    lines = []
    for name, values in times.items():
        stats = latency_ms(values)
        lines.append(f"  {name:<26} client p50 {stats['p50_ms']:.3f}  p99 {stats['p99_ms']:.3f} ms")
    lines.append("  mean µs/call  top  statement (server side, cold)")
    lines += [f"  {mean * 1000:12.1f}  {'yes' if top else ' no'}  {query[:130]}" for mean, top, query in rows]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only profile")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--wake-jobs", type=int, default=150)
    args = parser.parse_args(argv)
    logs = RESULTS / "profile-logs"
    logs.mkdir(parents=True, exist_ok=True)
    out: list[str] = []
    with bench_server() as server:
        pglane = Pglane()  # logs warnings only, as the floors; lined: pglane's default, a line per job
        lined = Pglane(per_job_lines=True)
        pglane.setup(server.dsn("pglane"))
        floors.setup(server.dsn("floor"))
        floors.FloorListenContract().setup(server.dsn("contract"))
        dsn = server.dsn("pglane")
        loops: dict[str, Callable[[], float]] = {
            "floor_contract (sync)": lambda: floors.throughput(server, "floor_contract", args.jobs),
            "floor_contract (async psycopg)": lambda: contract_async(dsn, args.jobs),
            "pglane worker": lambda: real.throughput(server, pglane, args.jobs, logs),
            "pglane worker, a line per job": lambda: real.throughput(server, lined, args.jobs, logs),
            "pglane worker, lean _call": lambda: real.throughput(server, Experiment("lean-call"), args.jobs, logs),
        }
        for name, run in loops.items():
            progress(f"profile: warm-up {name}")
            run()
        runs: dict[str, list[float]] = {name: [] for name in loops}
        for rep, name in rotations(list(loops), args.repetitions):
            progress(f"profile: {name} ({rep + 1}/{args.repetitions})")
            runs[name].append(loops[name]())
        out.append(f"1. throughput, {args.jobs} jobs, median of {args.repetitions} interleaved runs")
        base = statistics.median(runs["floor_contract (sync)"])
        for name, values in runs.items():
            med = statistics.median(values)
            out.append(f"  {name:<32} {med:7.0f} jobs/s  {1e6 / med:6.0f} µs/job  "
                       f"(+{1e6 / med - 1e6 / base:4.0f} µs vs sync floor)  x{med / base:.2f}")

        progress("profile: worker under cProfile")
        prof = RESULTS / "worker.prof"
        prof.unlink(missing_ok=True)
        os.environ["BENCH_PROFILE"] = str(prof)
        try:
            rate = real.throughput(server, pglane, args.jobs, logs)
        finally:
            del os.environ["BENCH_PROFILE"]
        out.append(f"2. worker under cProfile ({rate:.0f} jobs/s while profiled; stats in {prof})")
        out += _profile_summary(prof, args.jobs)

        progress("profile: server-side statements")
        out.append("3. server side of floor_contract (pg_stat_statements, track=all)")
        out += _server_breakdown(dsn, server.admin_dsn, args.jobs)
        out.append(_floor_exec(server.dsn("floor"), server.admin_dsn, args.jobs))
        out.append("4. HOT updates after the drains (n_tup_hot_upd / n_tup_upd)")
        out += _hot(dsn, ["pglane.jobs", "pglane.attempts", "pglane.lane_counters"])
        out += _hot(server.dsn("floor"), ["public.floor_jobs"])

        out.append(f"5. wake latency over {args.wake_jobs} jobs (commit → handler start)")
        for system in (floors.FloorListen(), floors.FloorListenContract(), pglane):
            samples = real.wake(server, [system], args.wake_jobs, logs, f"profile wake: {system.name}")
            stats = latency_ms(samples[system.name])
            out.append(f"  {system.name:<16} p50 {stats['p50_ms']:.2f}  p95 {stats['p95_ms']:.2f}"
                       f"  p99 {stats['p99_ms']:.2f} ms")
        progress("profile: claim plans")
        out.append("6. plan of the claim's job lookup (auto_explain, nested, after 8 claims)")
        out += _claim_plans(dsn)
        progress("profile: cold claims")
        out.append(f"7. the claim on an idle backend, {args.wake_jobs} claims {COLD_GAP_S * 1000:.0f} ms apart"
                   " (what a wake-up pays), against floor_listen's statement")
        out += _cold_claims(server, args.wake_jobs)
    progress_done()
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

