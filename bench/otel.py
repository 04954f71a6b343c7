"""What tracing costs a worker (#36): `python -m bench --only otel [--jobs N] [--rounds R] [--json FILE]`.

One lane (``otel_bench``), drained by one real ``pglane worker otel_bench --handler bench.handlers:noop
--max-jobs N`` (default 3,000 jobs) in two ways, alternated round by round in an order rotated each round:

- ``without``: the OpenTelemetry API cannot be imported (the worker starts with ``opentelemetry``
  blocked in ``sys.modules``: as if ``pglane[otel]`` were not installed), so pglane.tracing is off;
- ``with``: the API installed, no SDK or exporter configured: every attempt makes its wait, process and
  settle spans through the API's no-op tracer, and extracts the job's traceparent.

Every job carries a traceparent (as a traced producer's would), set by the one INSERT that loads the N
jobs before the worker starts (untimed). Jobs per second on the database clock, first attempt's start
to last finish, and the worker process's CPU time per job (its rusage: steadier than a rate on a shared
machine); the ratios with/without per round, their medians and ranges. Issue #36's bound: within noise
of without. It starts its own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import psycopg

import pglane
from pglane import schema

from .procs import RESULTS, spawn
from .server import env_or_embedded
from .stats import progress, progress_done, rotations

LANE = "otel_bench"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# the worker's command line, with the OpenTelemetry API made unimportable first (``without``)
BLOCKED = ("import runpy, sys; sys.modules['opentelemetry'] = None; sys.argv = ['pglane', *sys.argv[1:]]; "
           "runpy.run_module('pglane', run_name='__main__')")


def drain(dsn: str, mode: str, jobs: int, log: Path) -> tuple[float, float]:
    """Load ``jobs`` jobs, drain them with one worker in ``mode``: jobs per second on the database clock,
    and the worker process's CPU time per job (user + system, microseconds: its own work, which the
    machine's other load does not change as much as it changes a rate)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pglane.jobs WHERE lane = %s", (LANE,))
        conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent)"
                     " SELECT %s, '{}', %s FROM generate_series(1, %s)", (LANE, TRACEPARENT, jobs))
    args = ["worker", LANE, "--handler", "bench.handlers:noop", "--max-jobs", str(jobs), "--quiet",
            "--dsn", dsn]
    proc = spawn(["-c", BLOCKED, *args] if mode == "without" else ["-m", "pglane", *args], log)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} worker exited {proc.returncode}: see {log}")
    cpu_us = (usage.ru_utime + usage.ru_stime) * 1e6 / jobs
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) AS n, extract(epoch FROM max(finished_at) - min(started_at))::float8 AS s"
                           " FROM pglane.jobs WHERE lane = %s AND status = 'done'", (LANE,)).fetchone()
    assert row is not None and row[0] == jobs, f"{mode}: {row} of {jobs} jobs done"
    return float(row[0] / row[1]), cpu_us


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --only otel", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    log = RESULTS / "otel" / "worker.log"
    rates: dict[str, list[float]] = {"without": [], "with": []}
    cpu: dict[str, list[float]] = {"without": [], "with": []}
    with env_or_embedded() as dsn:
        schema.upgrade(dsn)
        with pglane.connect(dsn) as conn:
            if not any(lane["name"] == LANE for lane in conn.execute("SELECT name FROM pglane.lanes")):
                pglane.create_lane(conn, LANE, job_timeout=60)
        order = rotations(["without", "with"], args.rounds)
        for i, (_, mode) in enumerate(order):
            progress(f"otel: {mode} ({i + 1}/{len(order)})")
            rate, cpu_us = drain(dsn, mode, args.jobs, log)
            rates[mode].append(rate)
            cpu[mode].append(cpu_us)
        progress_done()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM pglane.jobs WHERE lane = %s", (LANE,))
    ratios = [w / wo for w, wo in zip(rates["with"], rates["without"], strict=True)]
    cpu_ratios = [w / wo for w, wo in zip(cpu["with"], cpu["without"], strict=True)]
    report: dict[str, Any] = {"jobs": args.jobs, "rounds": args.rounds, "jobs_per_second": rates,
                              "ratio_with_over_without": ratios, "median_ratio": statistics.median(ratios),
                              "worker_cpu_us_per_job": cpu, "cpu_ratio_with_over_without": cpu_ratios,
                              "median_cpu_ratio": statistics.median(cpu_ratios), "load": os.getloadavg()}
    print(f"jobs/s without the API: {', '.join(f'{r:.0f}' for r in rates['without'])}")
    print(f"jobs/s with the API, no exporter: {', '.join(f'{r:.0f}' for r in rates['with'])}")
    print(f"with/without per round: {', '.join(f'{r:.3f}' for r in ratios)}; median {report['median_ratio']:.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]; load {report['load'][0]:.2f}")
    print(f"worker CPU us per job without / with: {statistics.median(cpu['without']):.0f} / "
          f"{statistics.median(cpu['with']):.0f}; with/without per round: {', '.join(f'{r:.3f}' for r in cpu_ratios)};"
          f" median {report['median_cpu_ratio']:.3f} [{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}]")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
