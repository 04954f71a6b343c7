"""What waiting for results costs the worker (#20): `python -m bench.lab.waiters [--jobs N] [--rounds R]`.

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
import statistics
import threading
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

import pglane
from pglane import schema

from ..pglane_runs import drain, insert_jobs
from ..server import env_or_embedded

CASES = ("none", "others", "waiters100")
WAITERS = 100


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
    parser = argparse.ArgumentParser(prog="python -m bench.lab.waiters", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per run (default 2000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the three cases (default 5)")
    args = parser.parse_args(argv)
    with env_or_embedded() as dsn:
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
