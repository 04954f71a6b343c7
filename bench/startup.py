"""What `pglane status` costs to start, against the least any Python client pays: a bare psycopg
connect and one query (#29, item 5: at most about twice that).

    python -m bench --only startup --dsn DSN [--runs 15] [--warmup 2]

Runs the two commands alternately, each as a fresh process (as hyperfine does), and prints each one's
median and spread (quartiles) in seconds and the ratio of the medians. Both read the same DSN from
PGLANE_DSN; `pglane status` runs as the installed console script beside this interpreter when there is
one, else as `python -m pglane`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BARE = "import os, psycopg; psycopg.connect(os.environ['PGLANE_DSN']).execute('select 1')"


def _pglane() -> list[str]:
    script = Path(sys.executable).with_name("pglane")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pglane"]


def _time(cmd: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def measure(dsn: str, runs: int, warmup: int) -> dict[str, list[float]]:
    env = {**os.environ, "PGLANE_DSN": dsn}
    commands = {"pglane status": [*_pglane(), "status"], "bare connect": [sys.executable, "-c", BARE]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for i in range(warmup + runs):
        for name, cmd in commands.items():  # alternated, so that a busy moment of the machine hits both
            took = _time(cmd, env)
            if i >= warmup:
                times[name].append(took)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --only startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("PGLANE_DSN"), help="a migrated database (default: $PGLANE_DSN)")
    p.add_argument("--runs", type=int, default=15, help="timed runs of each command")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (page cache, .pyc files)")
    args = p.parse_args(argv)
    if not args.dsn:
        p.error("give --dsn or set PGLANE_DSN")
    times = measure(args.dsn, args.runs, args.warmup)
    medians = {}
    for name, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        medians[name] = statistics.median(values)
        print(f"{name:>14}: median {medians[name]:.3f}s  (quartiles {q1:.3f}-{q3:.3f}s, {len(values)} runs)")
    print(f"{'ratio':>14}: {medians['pglane status'] / medians['bare connect']:.2f}x "
          "(pglane status / bare connect, medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
