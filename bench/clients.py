"""``python -m bench --only clients [--big N] [--small N] [--rounds R]``: the consumer's own instructions per
job, counted by callgrind: the real worker against floor_contract's bare loop (the same SQL, no worker).

Wall-clock ratios on 2 shared cores move by 20 % between runs, and a consumer's CPU time read from the
kernel by 15 %: neither can see a change of a few percent in the worker's Python. ``valgrind
--tool=callgrind`` counts every instruction the client process executes, all its threads together,
the same figure for the same work whatever else the machine does. Each consumer drains N preloaded
no-op jobs of its lane in a process of its own, run from start to exit under callgrind (the worker with
``--max-jobs N``); its figure per job is the difference between a drain of ``--big`` and one of
``--small`` jobs, over their difference: start-up, imports and shut-down cancel out.

Consumers:
- ``pglane worker``: ``python -m pglane worker --quiet`` (warnings only, as the floor logs nothing);
- ``pglane worker, a line per job``: the same with its default logging, a line per job;
- ``floor_contract``: bench.floors' contract loop (``pglane.claim`` once, then
  ``pglane.complete_and_claim`` per job, sync psycopg, its handler a plain function call).

What it does not count: the server (bench.callgrind and bench.costs count that), the kernel's side of
the round trips, and time. Under valgrind the process runs some 50 times slower, so what the worker does
on timers (its lane's recovery every interval, the liveness checks of an idle session) is counted more
often than at full speed, a few million instructions a run on a loaded machine: against 500 jobs' worth
(140 million for the worker) that is the rounds' 1-2 % spread; keep ``--big`` hundreds of jobs above
``--small``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import psycopg

from . import callgrind, floors, procs
from .pglane_runs import LANE, Pglane, load_queued, truncate
from .server import bench_server
from .stats import progress, progress_done, wait_until

WORKER = ["-m", "pglane", "worker", LANE, "--handler", "bench.handlers:noop"]
FLOOR = ["-c", "import sys; from bench import floors; floors.contract(sys.argv[1], int(sys.argv[2]))"]


def _preload_lane(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        truncate(conn)
        load_queued(conn, LANE, n)


# name: (preload n jobs, the process's arguments for n jobs at a DSN)
CONSUMERS: dict[str, tuple[Callable[[str, int], None], Callable[[str, int], list[str]]]] = {
    "pglane worker": (_preload_lane, lambda dsn, n: [*WORKER, "--quiet", "--max-jobs", str(n)]),
    "pglane worker, a line per job": (_preload_lane, lambda dsn, n: [*WORKER, "--max-jobs", str(n)]),
    "floor_contract": (floors.contract_preload, lambda dsn, n: [*FLOOR, dsn, str(n)]),
}


RUN_TIMEOUT = 600.0  # seconds for one counted process: some 50 times slower under valgrind
# bench.handlers reads these: a profiled or patched worker is not the one counted
NOT_PASSED = ("BENCH_PROFILE", "BENCH_EXPERIMENT")


def instructions(argv: list[str], dsn: str, scratch: Path) -> int:
    """The instructions ``python argv`` executes from start to exit, every thread (callgrind)."""
    for old in scratch.glob("client.*"):
        old.unlink()
    env = procs.child_env({"PGLANE_DSN": dsn}, without=NOT_PASSED)
    done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={scratch}/client.%p",
                           sys.executable, *argv], cwd=procs.ROOT, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=RUN_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode} under callgrind: "
                           f"{done.stderr.decode(errors='replace')[-2000:]}")
    parts = list(scratch.glob("client.*"))
    if not parts:
        raise RuntimeError(f"callgrind wrote nothing for {argv}")
    return sum(callgrind.total(part) for part in parts)


def _slots_free(dsn: str) -> None:
    """Wait until no session holds an advisory lock in the database: the previous run's backend may still
    hold its slot for a moment after its client exited, and a worker started then would wait as a standby,
    its waiting counted as if it were work."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        def free() -> bool:
            row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
                               " (SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
            return row is not None and row[0] == 0
        wait_until(free, 30, "the previous run's slot to be released")


def per_job(name: str, dsn: str, big: int, small: int, scratch: Path) -> float:
    """One round: consumer ``name``'s instructions per job, (I(big) - I(small)) / (big - small)."""
    preload, argv = CONSUMERS[name]
    counted = {}
    for n in (big, small):
        preload(dsn, n)
        _slots_free(dsn)
        counted[n] = instructions(argv(dsn, n), dsn, scratch)
    return (counted[big] - counted[small]) / (big - small)


def measure(dsn: str, big: int, small: int, rounds: int, names: list[str] | None = None) -> dict[str, list[float]]:
    """Every consumer's instructions per job in each round (rounds interleaved)."""
    runs: dict[str, list[float]] = {name: [] for name in names or CONSUMERS}
    with tempfile.TemporaryDirectory(prefix="bench-clients-") as tmp:
        for r in range(rounds):
            for name in runs:
                progress(f"clients: {name} (round {r + 1}/{rounds})")
                runs[name].append(per_job(name, dsn, big, small, Path(tmp)))
    progress_done()
    return runs


def report(runs: dict[str, list[float]], big: int, small: int) -> list[str]:
    """One line per consumer: its median per job, its rounds, and its ratio to floor_contract's median."""
    floor = statistics.median(runs["floor_contract"]) if runs.get("floor_contract") else None
    rounds = len(next(iter(runs.values())))
    lines = [f"the consumer's own instructions per job (callgrind, {big} jobs less {small}, {rounds} rounds)"]
    for name, values in runs.items():
        median = statistics.median(values)
        ratio = f"  x{median / floor:.2f} floor_contract" if floor else ""
        lines.append(f"  {name:<30} {median:>10,.0f}  ({' '.join(f'{x:,.0f}' for x in values)}){ratio}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only clients")
    parser.add_argument("--big", type=int, default=600, help="jobs of the larger drain (default 600)")
    parser.add_argument("--small", type=int, default=100, help="jobs of the smaller drain (default 100)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if (why := callgrind.available()) is not None:
        raise SystemExit(f"cannot count instructions: {why}")
    if args.big <= args.small:
        raise SystemExit("--big must be more jobs than --small")
    with bench_server() as server:
        dsn = server.dsn("pglane")
        Pglane().setup(dsn)
        runs = measure(dsn, args.big, args.small, args.rounds)
    print("\n".join(report(runs, args.big, args.small)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
