"""What waiting for results costs the worker (#20): `python -m bench.waiters [--jobs N] [--rounds R]`.

Protocol: a real `pglane worker` (bench.handlers:noop) drains N queued jobs of a fresh lane, in three
cases run interleaved, round after round, so that machine noise hits each alike:

- ``none``: nobody waits for anything;
- ``others``: 100 waiters (pglane.wait, threads over a pool of 4) wait for jobs of another lane that
  never runs: awaited rows and a listening session exist, none of them on this lane;
- ``waiters100``: 100 of this lane's N jobs, spread evenly, are awaited by 100 waiters, each woken
  by its job's notification (the trigger fires, a NOTIFY is sent, 100 status reads follow).

Throughput is N over the database-clock span from the first claim (min started_at) to the last
completion (max finished_at), so the worker's start-up does not count. Reported: per round, the
median of each case and each case's ratio to ``none`` (median of the per-round ratios). It starts its
own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

import pglane
from pglane import schema

ROOT = Path(__file__).resolve().parent.parent
CASES = ("none", "others", "waiters100")
WAITERS = 100


@contextlib.contextmanager
def database() -> Iterator[str]:
    dsn = os.environ.get("PGLANE_DSN")
    if dsn:
        yield dsn
        return
    from pglane.embedded import embedded_postgres

    with embedded_postgres() as embedded:
        yield embedded


def insert_jobs(conn: psycopg.Connection[Any], lane: str, n: int) -> list[int]:
    rows = conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                        " FROM generate_series(1, %s) g RETURNING id", (lane, n)).fetchall()
    return [int(r["id"]) for r in rows]


def _awaited(conn: psycopg.Connection[Any], ids: list[int]) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE awaited AND id = ANY(%s)", (ids,)).fetchone()
    return int(row["n"]) if row else 0


def _start_waiters(pool: ConnectionPool[Any], ids: list[int], results: list[Any]) -> list[threading.Thread]:
    def one(job: int) -> None:
        try:
            results.append(pglane.wait(pool, job, timeout=600, poll_interval=60))
        except pglane.PglaneError as exc:
            results.append(exc)

    threads = [threading.Thread(target=one, args=(job,), daemon=True) for job in ids]
    for t in threads:
        t.start()
    return threads


def drain(dsn: str, conn: psycopg.Connection[Any], lane: str, n: int) -> float:
    """One real worker (bench.handlers:noop, --max-jobs n) drains n queued jobs of the lane: jobs per
    second on the database clock, from the first start to the last finish."""
    proc = subprocess.Popen([sys.executable, "-m", "pglane", "worker", lane, "--handler", "bench.handlers:noop",
                             "--max-jobs", str(n)], env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT,
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


def run_case(dsn: str, conn: psycopg.Connection[Any], case: str, name: str, n: int) -> float:
    """Drain n jobs of a fresh lane with one worker; jobs per second on the database clock."""
    pglane.create_lane(conn, name, job_timeout=60)
    ids = insert_jobs(conn, name, n)
    results: list[Any] = []
    threads: list[threading.Thread] = []
    with ConnectionPool(dsn, min_size=1, max_size=4, open=True, timeout=120) as pool:
        if case != "none":
            if case == "others":
                pglane.create_lane(conn, f"{name}_idle", job_timeout=60)
                targets = insert_jobs(conn, f"{name}_idle", WAITERS)
            else:
                targets = ids[:: max(1, n // WAITERS)][:WAITERS]
            threads = _start_waiters(pool, targets, results)
            deadline = time.monotonic() + 60
            while _awaited(conn, targets) < len(targets):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{case}: the waiters did not mark their jobs within 60 s")
                time.sleep(0.05)
        rate = drain(dsn, conn, name, n)
        if case == "waiters100":
            for t in threads:
                t.join(60)
            if len(results) != len(threads) or any(isinstance(r, BaseException) for r in results):
                raise SystemExit(f"{case}: not every waiter got its result: {results[:3]}")
        elif case == "others":
            conn.execute("UPDATE pglane.jobs SET status = 'cancelled', finished_at = now()"
                         " WHERE lane = %s", (f"{name}_idle",))  # ends the other lane's waits
            for t in threads:
                t.join(60)
    return rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.waiters", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per run (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three cases (default 5)")
    args = parser.parse_args(argv)
    with database() as dsn:
        schema.upgrade(dsn)
        figures: dict[str, list[float]] = {case: [] for case in CASES}
        ratios: dict[str, list[float]] = {case: [] for case in CASES}
        with pglane.connect(dsn) as conn:
            for r in range(args.rounds):
                order = CASES[r % 3:] + CASES[: r % 3]  # interleaved: each case leads in turn
                this_round: dict[str, float] = {}
                for case in order:
                    this_round[case] = run_case(dsn, conn, case, f"w{r}_{case}", args.jobs)
                    figures[case].append(this_round[case])
                for case in CASES:
                    ratios[case].append(this_round[case] / this_round["none"])
                print(f"round {r + 1}: " + ", ".join(f"{c} {this_round[c]:,.0f} jobs/s" for c in CASES), flush=True)
    print(f"\n{args.jobs} jobs per run, {args.rounds} rounds, one worker, noop handler")
    print(f"{'case':<12} {'median jobs/s':>14} {'min':>8} {'max':>8} {'ratio to none (median)':>24}")
    for case in CASES:
        values = figures[case]
        print(f"{case:<12} {statistics.median(values):>14,.0f} {min(values):>8,.0f} {max(values):>8,.0f}"
              f" {statistics.median(ratios[case]):>24.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
