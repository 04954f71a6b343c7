"""What the attempt's secret costs the claim/complete path (#16): `python -m bench.lab.secret [--rounds R] [--jobs N]`.

Protocol: one session holding a slot claims and completes jobs through pglane's own functions
(claim, then complete_and_claim, as the worker does), in blocks of N, alternating round after round
between pglane as installed and pglane without the secret (bench.lab.experiments' exp_no_token rewrite:
the claim stores no token, complete's guard compares none), swapped in the same database by
re-creating the two functions from their installed text, so that both cases run on the same tables,
the same session and the same plan cache state. ``synchronous_commit = off`` for the session: with
no wait for the WAL flush, what is left is the functions' own work, where the secret's cost would
show (with the flush, it is a smaller share still). Reported: jobs/s per case, the paired ratio
(with the secret / without) per round, its median and a bootstrap interval; #16's bound: at least
0.97 (no more than 3 % slower). It starts its own embedded PostgreSQL unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import psycopg
from psycopg.rows import dict_row

import pglane
from pglane import queries, schema

from ..pglane_runs import lane_id, load_queued
from ..server import env_or_embedded
from ..stats import median_interval, verdict
from .experiments import no_token_claim, no_token_complete

FUNCTIONS = ("pglane.claim_impl", "pglane.complete_impl")
LANE = "secret"


def _drain(conn: psycopg.Connection[Any], n: int) -> float:
    t0 = time.perf_counter()
    row = conn.execute(queries.CLAIM, (LANE, "bench")).fetchone()
    for _ in range(n):
        assert row is not None and row["job_id"] is not None, "the backlog ran dry"
        row = conn.execute(queries.COMPLETE_AND_CLAIM,
                           (row["attempt_id"], "null", LANE, "bench", row["token"])).fetchone()
    return n / (time.perf_counter() - t0)


def measure(dsn: str, rounds: int, jobs: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        pglane.create_lane(conn, LANE)
        load_queued(conn, LANE, rounds * 2 * (jobs + 1) + 10)
        installed = {f: str(conn.execute("SELECT pg_get_functiondef(%s::regproc) AS d", (f,)).fetchone()["d"])  # type: ignore[index]
                     for f in FUNCTIONS}
        without = [no_token_claim(installed["pglane.claim_impl"]),
                   no_token_complete(installed["pglane.complete_impl"])]
        if None in without:
            raise SystemExit("claim_impl or complete_impl is not of the shape exp_no_token rewrites")
        conn.execute("SET synchronous_commit = off")
        conn.execute(queries.WAIT_SLOT, (lane_id(conn, LANE), 1))
        figures: dict[str, list[float]] = {"secret": [], "no_secret": []}
        try:
            for r in range(rounds):
                for case in (("secret", "no_secret") if r % 2 == 0 else ("no_secret", "secret")):
                    for text in (installed.values() if case == "secret" else without):
                        conn.execute(psycopg.sql.SQL(text))  # type: ignore[arg-type]  # pglane's own text
                    figures[case].append(_drain(conn, jobs))
        finally:
            for text in installed.values():
                conn.execute(psycopg.sql.SQL(text))  # as installed again
    ratios = [a / b for a, b in zip(figures["secret"], figures["no_secret"], strict=True)]
    interval = median_interval(ratios)
    return {"rounds": rounds, "jobs": jobs, "jobs_per_s": figures, "ratio": statistics.median(ratios),
            "interval_90": interval, "verdict": verdict(interval, statistics.median(ratios), ">=", 0.97)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.secret", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of the two cases (default 20)")
    parser.add_argument("--jobs", type=int, default=1500, help="claim/complete pairs per block (default 1500)")
    args = parser.parse_args(argv)
    with env_or_embedded() as dsn:
        schema.upgrade(dsn)
        found = measure(dsn, args.rounds, args.jobs)
    s, n = found["jobs_per_s"]["secret"], found["jobs_per_s"]["no_secret"]
    print(f"claim/complete, one session, synchronous_commit off, {args.rounds} rounds x {args.jobs}: with the secret "
          f"{statistics.median(s):,.0f} jobs/s, without {statistics.median(n):,.0f} jobs/s; paired ratio "
          f"{found['ratio']:.3f} [{found['interval_90'][0]:.3f}-{found['interval_90'][1]:.3f}] >= 0.97: "
          f"{found['verdict']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
