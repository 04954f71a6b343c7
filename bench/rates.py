"""What a rate limit costs, and how close a limited lane gets to its limit (#21):
`python -m bench --only rates [--jobs N] [--rounds R] [--claims M] [--seconds S] [--only NAME ...]`.

Four measurements, each on the same server, interleaved so that machine noise hits each case alike:

- ``throughput``: one real `pglane worker` (bench.handlers:noop) drains N queued jobs of a fresh lane,
  unlimited against ``--rate 1000000/min`` (generous: never refuses, but every claim records its start
  and drops the starts that left the window, as a limited lane always does). Jobs per second on the
  database clock, first start to last finish; the limited/unlimited ratio per round, its median and a
  bootstrap interval. Issue #21's bound: at least 0.90 (the limit costs at most 10 %).
- ``claim``: one session holding a slot claims and completes M jobs, alternating between the two lanes
  claim by claim; the claim's own latency (p50, p99) and the p50 ratio with a paired bootstrap interval.
- ``instructions`` (needs valgrind; on a cluster of its own, whatever PGLANE_DSN says): the server's
  instructions per job of a slot draining a generous lane through complete_and_claim against an
  unlimited one (bench.callgrind: a single-user backend, counted, not timed), interleaved rounds,
  the ratio per round, its median and a bootstrap interval against the same 1.10. What the limit
  costs the server, free of the machine's noise and of the commit's flush (which the claim-latency
  figure includes: a slower flush dilutes it).
- ``achieved``: three worker processes on a three-slot lane limited to R/s with a full queue for S
  seconds; the starts per second over the whole windows after the first start, against the limit
  (bound: at least 0.95), the busiest window (never above the limit) and the claims per start (from
  the workers' metrics is not available here: from pg_stat_user_functions, the calls of the claim).

The timed ones start their own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglane
from pglane import queries, schema

from . import callgrind
from .pglane_runs import claim_and_complete, drain, insert_jobs, lane_id, load_queued
from .procs import ROOT
from .server import env_or_embedded
from .stats import latency_ms, median_interval, ratio_interval, verdict

GENEROUS = "1000000/min"
LIMIT_PER_S = 30  # the achieved-rate case: 30 starts in any second, three slots


def _worker(dsn: str, lane: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "pglane", "worker", lane, "--handler", "bench.handlers:noop",
                             *args], env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def throughput(dsn: str, conn: psycopg.Connection[Any], jobs: int, rounds: int) -> dict[str, Any]:
    figures: dict[str, list[float]] = {"unlimited": [], "generous": []}
    for r in range(rounds):
        for case in (("unlimited", "generous") if r % 2 == 0 else ("generous", "unlimited")):
            lane = f"tp{r}_{case}"
            pglane.create_lane(conn, lane, job_timeout=60, rate=GENEROUS if case == "generous" else None)
            insert_jobs(conn, lane, jobs)
            figures[case].append(drain(dsn, conn, lane, jobs))
        print(f"throughput round {r + 1}: unlimited {figures['unlimited'][-1]:,.0f} jobs/s, "
              f"{GENEROUS} {figures['generous'][-1]:,.0f} jobs/s", flush=True)
    ratios = [g / u for g, u in zip(figures["generous"], figures["unlimited"], strict=True)]
    interval = median_interval(ratios)
    return {"jobs": jobs, "jobs_per_s": figures, "ratio": statistics.median(ratios), "interval_90": interval,
            "verdict": verdict(interval, statistics.median(ratios), ">=", 0.90)}


def claim_latency(dsn: str, conn: psycopg.Connection[Any], claims: int) -> dict[str, Any]:
    lanes = {"unlimited": "cl_unlimited", "generous": "cl_generous"}
    for case, lane in lanes.items():
        pglane.create_lane(conn, lane, job_timeout=60, rate=GENEROUS if case == "generous" else None)
        load_queued(conn, lane, claims)
    times: dict[str, list[float]] = {"unlimited": [], "generous": []}
    with psycopg.connect(dsn, autocommit=True, row_factory=psycopg.rows.dict_row) as session:
        for lane in lanes.values():
            session.execute(queries.WAIT_SLOT, (lane_id(session, lane), 1))
        for i in range(claims):
            for case in (("unlimited", "generous") if i % 2 == 0 else ("generous", "unlimited")):
                times[case].append(claim_and_complete(session, lanes[case]))
    interval = ratio_interval(times["generous"], times["unlimited"], 50)
    ratio = statistics.median(times["generous"]) / statistics.median(times["unlimited"])
    return {"claims": claims, "unlimited": latency_ms(times["unlimited"]), "generous": latency_ms(times["generous"]),
            "p50_ratio": ratio, "interval_90": interval, "verdict": verdict(interval, ratio, "<=", 1.10)}


def instructions(jobs: int, rounds: int) -> dict[str, Any]:
    def lane(rate: str | None) -> Callable[[str], None]:
        def setup(dsn: str) -> None:
            schema.upgrade(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                pglane.create_lane(conn, "cc", job_timeout=60, rate=rate)
        return setup

    counts = callgrind.interleaved_drains({"rates_unlimited": lane(None), "rates_generous": lane(GENEROUS)},
                                          jobs, rounds)
    ratios = [g / u for g, u in zip(counts["rates_generous"], counts["rates_unlimited"], strict=True)]
    interval = median_interval(ratios)
    ratio = statistics.median(ratios)
    return {"jobs_per_round": jobs, "rounds": rounds,
            "unlimited": statistics.median(counts["rates_unlimited"]),
            "generous": statistics.median(counts["rates_generous"]),
            "ratio": ratio, "interval_90": interval, "verdict": verdict(interval, ratio, "<=", 1.10)}


def busiest(starts: Sequence[float], period: float) -> int:
    """The most starts in any half-open window (t - period, t]."""
    most, lo = 0, 0
    for hi, at in enumerate(starts):
        while starts[lo] <= at - period:
            lo += 1
        most = max(most, hi - lo + 1)
    return most


def achieved(dsn: str, conn: psycopg.Connection[Any], seconds: int) -> dict[str, Any]:
    lane = "achieved"
    pglane.create_lane(conn, lane, slots=3, job_timeout=60, rate=f"{LIMIT_PER_S}/s")
    insert_jobs(conn, lane, LIMIT_PER_S * (seconds + 3))  # more than the run can start: the queue stays full
    conn.execute("SELECT pg_stat_reset()")
    procs = [_worker(dsn, lane, "--poll-interval", "30") for _ in range(3)]
    try:
        deadline = time.monotonic() + 60
        while conn.execute("SELECT count(*) AS n FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
                           " WHERE j.lane = %s", (lane,)).fetchone()["n"] == 0:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise SystemExit("achieved: no start within 60 s")
            time.sleep(0.05)
        time.sleep(seconds + 1.5)  # the measured span: whole windows after the first start, and a margin
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    rows = conn.execute("SELECT extract(epoch FROM a.started_at)::float8 AS t FROM pglane.attempts a"
                        " JOIN pglane.jobs j ON j.id = a.job_id WHERE j.lane = %s ORDER BY a.started_at",
                        (lane,)).fetchall()
    starts = [float(r["t"]) for r in rows]
    first = starts[0]
    within = [t for t in starts if t - first < seconds]  # seconds whole windows from the first start
    calls = conn.execute("SELECT coalesce(sum(calls), 0) AS n FROM pg_stat_user_functions"
                         " WHERE schemaname = 'pglane' AND funcname = 'claim_impl'").fetchone()
    rate = len(within) / seconds
    return {"limit_per_s": LIMIT_PER_S, "slots": 3, "seconds": seconds, "starts": len(within),
            "achieved_per_s": rate, "ratio": rate / LIMIT_PER_S,
            "verdict": verdict(None, rate / LIMIT_PER_S, ">=", 0.95),
            "busiest_window": busiest(starts, 1.0), "claim_calls": int(calls["n"]) if calls else None,
            "claims_per_start": (int(calls["n"]) / len(starts)) if calls and starts else None}


SCENARIOS = ("throughput", "claim", "achieved", "instructions")


def report(name: str, found: dict[str, Any]) -> str:
    """One measurement's line of the summary."""
    if "skipped" in found:
        return f"{name}: skipped ({found['skipped']})"
    if name == "throughput":
        return (f"throughput, one worker, {found['jobs']} jobs x {len(found['jobs_per_s']['unlimited'])} rounds:"
                f" unlimited {statistics.median(found['jobs_per_s']['unlimited']):,.0f} jobs/s, {GENEROUS} "
                f"{statistics.median(found['jobs_per_s']['generous']):,.0f} jobs/s; ratio {found['ratio']:.3f} "
                f"[{found['interval_90'][0]:.3f}-{found['interval_90'][1]:.3f}] >= 0.90: {found['verdict']}")
    if name == "claim":
        return (f"claim latency p50: unlimited {found['unlimited']['p50_ms']:.3f} ms, generous "
                f"{found['generous']['p50_ms']:.3f} ms (p99 {found['unlimited']['p99_ms']:.3f} / "
                f"{found['generous']['p99_ms']:.3f}); ratio {found['p50_ratio']:.3f} "
                f"[{found['interval_90'][0]:.3f}-{found['interval_90'][1]:.3f}] <= 1.10: {found['verdict']}")
    if name == "instructions":
        return (f"instructions per claim and completion ({found['rounds']} x {found['jobs_per_round']} jobs):"
                f" unlimited {found['unlimited']:,.0f}, {GENEROUS} {found['generous']:,.0f}; ratio "
                f"{found['ratio']:.3f} [{found['interval_90'][0]:.3f}-{found['interval_90'][1]:.3f}] <= 1.10:"
                f" {found['verdict']}")
    return (f"achieved: {found['starts']} starts in {found['seconds']} s on {LIMIT_PER_S}/s with 3 slots = "
            f"{found['achieved_per_s']:.2f}/s, {found['ratio']:.3f} of the limit (>= 0.95: {found['verdict']});"
            f" busiest window {found['busiest_window']} (limit {LIMIT_PER_S}); claims per start"
            f" {found['claims_per_start']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only rates", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per drain (default 3000)")
    parser.add_argument("--rounds", type=int, default=5, help="drains of each case (default 5)")
    parser.add_argument("--claims", type=int, default=3000, help="claims of each case (default 3000)")
    parser.add_argument("--seconds", type=int, default=20, help="the achieved-rate run (default 20)")
    parser.add_argument("--ic-jobs", type=int, default=300, help="jobs per counted drain (default 300)")
    parser.add_argument("--ic-rounds", type=int, default=4, help="counted drains of each case (default 4)")
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, help="some of the measurements (default: all)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    only = [name for name in SCENARIOS if name in (args.only or SCENARIOS)]
    found: dict[str, Any] = {}
    if "instructions" in only:  # its own cluster, counted while stopped: before the timed ones
        missing = callgrind.available()
        found["instructions"] = {"skipped": missing} if missing else instructions(args.ic_jobs, args.ic_rounds)
    if set(only) - {"instructions"}:
        with env_or_embedded() as dsn:
            schema.upgrade(dsn)
            with pglane.connect(dsn) as conn:
                conn.execute("ALTER SYSTEM SET track_functions = 'pl'")
                conn.execute("SELECT pg_reload_conf()")
                if "throughput" in only:
                    found["throughput"] = throughput(dsn, conn, args.jobs, args.rounds)
                if "claim" in only:
                    found["claim"] = claim_latency(dsn, conn, args.claims)
                if "achieved" in only:
                    found["achieved"] = achieved(dsn, conn, args.seconds)
    print()
    for name in only:
        print(report(name, found[name]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
