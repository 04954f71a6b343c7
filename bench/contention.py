"""What the operator's and the producers' heavy hands cost a running worker (#19, points 3 and 4):
`python -m bench --only contention [--jobs N] [--rounds R] [--producers P] [--history H] [--only full|prune]`.

- ``full``: one real `pglane worker` (bench.handlers:noop) drains N jobs while P producer processes
  enqueue onto the same lane as fast as they can, one job per statement, autocommit. Three cases,
  interleaved round after round: ``unbounded`` (the producers' jobs are accepted and the queue grows),
  ``full_skip`` (max_queued 1,000 kept full; the producers ask ``p_if_full => 'skip'`` and are refused
  with NULL, nothing written) and ``full_error`` (the same lane, refused with PGL04: an ERROR in the
  server's log each time). Throughput on the database clock, first start to last finish; each
  bounded case's ratio to ``unbounded`` per round. Issue #19's bound: ``full_skip`` at least 0.8.
- ``prune``: H finished jobs of another lane (default 1,000,000, written directly as history), a worker
  draining a deep queue, and ``pglane prune --older-than 1h --batch 5000 --duty D`` started once the worker
  runs: the worker's throughput while the prune runs against the same length of time just before it
  (jobs finished per second on the database clock), and the prune's own time and rate. Bound: at
  least 0.8.

It starts its own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

import pglane
from pglane import schema

from .pglane_runs import drain, insert_jobs, load_finished
from .procs import ROOT
from .server import env_or_embedded
from .stats import median_interval, verdict

CASES = ("unbounded", "full_skip", "full_error")
BOUND = 1000
ENQUEUE = "SELECT pglane.enqueue(%s, '{\"p\": 1}', p_if_full => %s)"


def producer(dsn: str, lane: str, if_full: str) -> int:
    """One producer process: enqueue onto ``lane`` in a loop until SIGTERM; refusals are expected."""
    stop = False

    def stopping(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, stopping)
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop:
            try:
                conn.execute(ENQUEUE, (lane, if_full))
            except psycopg.Error as exc:  # LaneFull, when asked for an error: the point of the case
                if (exc.diag.sqlstate or "") != "PGL04":
                    raise
    return 0


def _producers(dsn: str, lane: str, if_full: str, n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-m", "bench.contention", "--producer", lane, if_full],
                             env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT, stderr=subprocess.PIPE)
            for _ in range(n)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        _, err = p.communicate(timeout=60)
        if p.returncode not in (0, -signal.SIGTERM):
            raise SystemExit(f"a producer exited {p.returncode}: {err.decode(errors='replace')[-1500:]}")


def full_lane(dsn: str, conn: psycopg.Connection[Any], jobs: int, rounds: int, producers: int) -> dict[str, Any]:
    figures: dict[str, list[float]] = {case: [] for case in CASES}
    for r in range(rounds):
        for case in CASES[r % 3:] + CASES[: r % 3]:
            lane = f"full{r}_{case}"
            pglane.create_lane(conn, lane, job_timeout=60, max_queued=None if case == "unbounded" else BOUND)
            insert_jobs(conn, lane, BOUND)
            procs = _producers(dsn, lane, "skip" if case == "full_skip" else "error", producers)
            try:
                time.sleep(1.0)  # the producers connected and hammering before the worker starts
                figures[case].append(drain(dsn, conn, lane, jobs))
            finally:
                _stop(procs)
            conn.execute("DELETE FROM pglane.jobs WHERE lane = %s AND status = 'queued'", (lane,))
        print(f"full round {r + 1}: " + ", ".join(f"{c} {figures[c][-1]:,.0f} jobs/s" for c in CASES), flush=True)
    out: dict[str, Any] = {"jobs": jobs, "producers": producers, "max_queued": BOUND, "jobs_per_s": figures}
    for case in ("full_skip", "full_error"):
        ratios = [b / u for b, u in zip(figures[case], figures["unbounded"], strict=True)]
        interval = median_interval(ratios)
        out[f"{case}/unbounded"] = {"ratio": statistics.median(ratios), "interval_90": interval,
                                    "verdict": verdict(interval, statistics.median(ratios), ">=", 0.8)}
    return out


def _finished_per_s(conn: psycopg.Connection[Any], lane: str, start: float, end: float) -> float:
    row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE lane = %s"
                       " AND finished_at >= to_timestamp(%s) AND finished_at < to_timestamp(%s)",
                       (lane, start, end)).fetchone()
    assert row is not None
    return float(row["n"]) / (end - start)


def _clock(conn: psycopg.Connection[Any]) -> float:
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8 AS t").fetchone()
    assert row is not None
    return float(row["t"])


def prune_beside(dsn: str, conn: psycopg.Connection[Any], history: int, duty: float) -> dict[str, Any]:
    pglane.create_lane(conn, "history", job_timeout=60)
    pglane.create_lane(conn, "busy", job_timeout=60)
    with psycopg.connect(dsn, autocommit=True) as raw:
        load_finished(raw, "history", history)
        raw.execute("VACUUM ANALYZE pglane.jobs")
        raw.execute("VACUUM ANALYZE pglane.attempts")
    insert_jobs(conn, "busy", 400_000)  # more than the worker drains meanwhile
    worker = subprocess.Popen([sys.executable, "-m", "pglane", "worker", "busy", "--handler", "bench.handlers:noop"],
                              env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        time.sleep(5.0)  # warm-up: the worker's first seconds are not its pace
        before_start = _clock(conn)
        time.sleep(10.0)  # the baseline window
        prune_start = _clock(conn)
        done = subprocess.run([sys.executable, "-m", "pglane", "prune", "--older-than", "1h", "--batch", "5000",
                               "--duty", str(duty)],
                              env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT, capture_output=True, text=True,
                              timeout=3600)
        prune_end = _clock(conn)
        if done.returncode != 0:
            raise SystemExit(f"pglane prune exited {done.returncode}: {done.stderr[-2000:]}")
        time.sleep(1.0)  # the last window's jobs finished and committed
    finally:
        worker.terminate()
        worker.wait(60)
    during = _finished_per_s(conn, "busy", prune_start, prune_end)
    # The same length of time just before the prune (at most the baseline window measured).
    span = min(prune_end - prune_start, prune_start - before_start)
    before = _finished_per_s(conn, "busy", prune_start - span, prune_start)
    left = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE lane = 'history'").fetchone()
    return {"history_jobs": history, "duty": duty, "prune_seconds": prune_end - prune_start,
            "prune_says": done.stderr.strip().splitlines()[-1],
            "prune_jobs_per_s": history / (prune_end - prune_start), "history_left": left["n"] if left else None,
            "worker_before_jobs_per_s": before, "worker_during_jobs_per_s": during, "ratio": during / before,
            "verdict": verdict(None, during / before, ">=", 0.8)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only contention", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=3000, help="jobs the worker drains per case (default 3000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the full-lane cases (default 3)")
    parser.add_argument("--producers", type=int, default=10, help="producer processes (default 10)")
    parser.add_argument("--history", type=int, default=1_000_000, help="finished jobs to prune (default 1M)")
    parser.add_argument("--duty", type=float, default=0.5, help="pglane prune --duty (default 0.5, its default)")
    parser.add_argument("--only", choices=("full", "prune"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--producer", nargs=2, metavar=("LANE", "IF_FULL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.producer:
        return producer(os.environ["PGLANE_DSN"], *args.producer)
    found: dict[str, Any] = {}
    with env_or_embedded() as dsn:
        schema.upgrade(dsn)
        with pglane.connect(dsn) as conn:
            if args.only in (None, "full"):
                found["full"] = full_lane(dsn, conn, args.jobs, args.rounds, args.producers)
            if args.only in (None, "prune"):
                found["prune"] = prune_beside(dsn, conn, args.history, args.duty)
    if "full" in found:
        f = found["full"]
        print(f"\nfull lane, {f['producers']} producers, one worker, {f['jobs']} jobs x {args.rounds} rounds:")
        for case in CASES:
            print(f"  {case:<11} {statistics.median(f['jobs_per_s'][case]):>8,.0f} jobs/s (median)")
        for case in ("full_skip", "full_error"):
            v = f[f"{case}/unbounded"]
            print(f"  {case}/unbounded {v['ratio']:.3f} [{v['interval_90'][0]:.3f}-{v['interval_90'][1]:.3f}]"
                  f" >= 0.8: {v['verdict']}")
    if "prune" in found:
        p = found["prune"]
        print(f"\nprune --duty {p['duty']:g} of {p['history_jobs']:,} finished jobs beside a worker: "
              f"{p['prune_seconds']:.1f} s "
              f"({p['prune_jobs_per_s']:,.0f} jobs/s, {p['history_left']} left); worker "
              f"{p['worker_before_jobs_per_s']:,.0f} jobs/s before, {p['worker_during_jobs_per_s']:,.0f} during: "
              f"{p['ratio']:.3f} >= 0.8: {p['verdict']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
