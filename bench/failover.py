"""How long a worker takes to resume after a failover (#18): `python -m bench --only failover [--runs N] [--json PATH]`.

Protocol, per run: a primary and a synchronous standby built from the server binaries the suite uses
(tests.replica: ``pg_basebackup -R``, ``synchronous_standby_names``, ``synchronous_commit = on``); a
one-slot lane with a backlog of short jobs (10 ms calls) and a producer adding one every 10 ms, both
on the multi-host DSN ``host=a,b target_session_attrs=read-write``; one real ``pglane worker``
(bench.handlers:stamp, default options) on that DSN. Once the worker has started a random number of
jobs (10-60), the primary's postmaster is SIGKILLed at a random moment of a call; the standby, once
it has replayed what it received, is read for the jobs that had an attempt on the old primary (a hot
standby answers reads), then promoted with ``pg_ctl promote -w``. Nobody touches the worker.

Reported per run, on this machine's clock (the handler stamps ``time.time()`` when it starts a job):

- ``promotion_s``: ``pg_ctl promote``'s own time (it polls the server every 100 ms, so it may return
  up to 0.1 s after the server began accepting writes);
- ``kill_to_next_job_s``: from the SIGKILL to the handler starting the first job claimed on the
  promoted standby (one that had no attempt on the old primary); it includes the standby's read and
  the promotion, which an HA manager replaces with its own detection (Patroni: ``ttl``, 30 s by default);
- ``promoted_to_next_job_s``: from ``pg_ctl promote``'s return to that start (negative when the worker
  claimed before pg_ctl noticed the promotion);
- ``kill_to_promote_s``: from the SIGKILL to the start of ``pg_ctl promote``;

and the median of each over the runs. A timeout (no job started on the new primary within 120 s, the
worker exited) ends the script with the worker's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

import pglane
from bench.procs import read_stamps, spawn, stop
from bench.stats import BenchTimeout, wait_until
from pglane.errors import PglaneError
from tests.replica import Node, make_template, synchronous_pair

LANE = "failover"
BACKLOG = 300  # jobs queued before the worker starts: after the promotion a job is there to claim at once
CALL = 0.01  # seconds each call lasts
PRODUCE_EVERY = 0.01  # the producer's pace
RESUME_WITHIN = 120.0
FIGURES = ("promotion_s", "kill_to_next_job_s", "promoted_to_next_job_s", "kill_to_promote_s")


class Producer(threading.Thread):
    """Enqueues ``{"n": k}`` jobs through the multi-host DSN until stopped; a call that fails (the
    primary died, no server accepts writes yet) is retried with the same idempotency key."""

    def __init__(self, dsn: str, first: int) -> None:
        super().__init__(name="failover-producer", daemon=True)
        self.dsn, self.n = dsn, first
        self.retried = 0
        self.halt = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self.halt.is_set():
            try:
                if conn is None:
                    conn = pglane.connect(self.dsn, connect_timeout=5)
                pglane.enqueue(conn, LANE, {"n": self.n, "sleep": CALL}, key=f"n{self.n}")
                self.n += 1
                self.halt.wait(PRODUCE_EVERY)
            except (PglaneError, psycopg.Error):
                self.retried += 1
                if conn is not None:
                    conn.close()
                conn = None
                self.halt.wait(0.05)
        if conn is not None:
            conn.close()


def claimed_on_old_primary(standby: Node) -> set[int]:
    """Once the standby has replayed all it received (the primary is dead: nothing more comes), the
    payload numbers of the jobs that have an attempt on it: claimed on the old primary."""
    with pglane.connect(standby.dsn) as c:
        def replayed() -> bool:
            row = c.execute("SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn() AS done").fetchone()
            return bool(row and row["done"])

        wait_until(replayed, 30, "the standby to replay what it received")
        rows = c.execute("SELECT DISTINCT (j.payload->>'n')::int AS n FROM pglane.attempts a"
                         " JOIN pglane.jobs j ON j.id = a.job_id").fetchall()
    return {int(r["n"]) for r in rows}


def run(template: Path, directory: Path, seed: int) -> dict[str, Any]:
    """One failover (module doc); its figures."""
    rng = random.Random(seed)
    stamps = directory / "stamps"
    log = directory / "worker.log"
    with synchronous_pair(template, directory / "servers") as pair:
        with pglane.connect(pair.primary.dsn) as c:
            row = c.execute("SHOW server_version").fetchone()
            version = str(row["server_version"]) if row else "?"
            pglane.create_lane(c, LANE, job_timeout=60)
            c.execute("INSERT INTO pglane.jobs (lane, payload)"
                      " SELECT %s, jsonb_build_object('n', g, 'sleep', %s::float8) FROM generate_series(0, %s) g",
                      (LANE, CALL, BACKLOG - 1))
        producer = Producer(pair.dsn, BACKLOG)
        worker = spawn(["-m", "pglane", "worker", LANE, "--handler", "bench.handlers:stamp"], log,
                       {"PGLANE_DSN": pair.dsn, "BENCH_STAMPS": str(stamps)})
        try:
            producer.start()
            calls = rng.randint(10, 60)
            wait_until(lambda: len(read_stamps(stamps)) >= calls, 60, f"the worker to start {calls} jobs")
            time.sleep(rng.uniform(0, CALL))  # a random moment of a call
            killed = time.time()
            pair.kill_primary()
            before = claimed_on_old_primary(pair.standby)
            promote = time.time()
            pair.standby.promote()
            promoted = time.time()

            def resumed() -> float | None:
                if worker.poll() is not None:
                    raise BenchTimeout(f"the worker exited {worker.returncode}")
                after = [t for n, t in read_stamps(stamps).items() if n not in before]
                return min(after) if after else None

            try:
                wait_until(lambda: resumed() is not None, RESUME_WITHIN, "a job started on the promoted standby")
            except BenchTimeout as exc:
                tail = log.read_text(errors="replace")[-3000:]
                raise SystemExit(f"{exc}; the worker's log ({log}):\n{tail}") from None
            started = resumed()
            assert started is not None
        finally:
            producer.halt.set()
            producer.join(30)
            stop(worker)
    return {"promotion_s": round(promoted - promote, 3), "kill_to_next_job_s": round(started - killed, 3),
            "promoted_to_next_job_s": round(started - promoted, 3), "kill_to_promote_s": round(promote - killed, 3),
            "jobs_before_kill": calls, "producer_retries": producer.retried, "postgres": version}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in FIGURES}


@contextlib.contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix="pglane-failover-") as tmp:
            yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only failover", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="failovers, each on a new pair (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the runs and medians there")
    parser.add_argument("--dir", help="keep the servers' data and logs here (default: a temporary directory)")
    parser.add_argument("--seed", type=int, default=1, help="the first run's seed (default 1)")
    args = parser.parse_args(argv)
    with _workdir(args.dir) as work:
        template = make_template(work)
        runs = []
        for i in range(args.runs):
            figures = {"run": i + 1, **run(template, work / f"run{i + 1}", args.seed + i)}
            runs.append(figures)
            print("failover:", ", ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    summary = medians(runs)
    load = [round(x, 2) for x in os.getloadavg()]
    machine = {"cpus": os.cpu_count(), "loadavg": load}
    print(f"median of {len(runs)} run(s):", ", ".join(f"{k} {v}" for k, v in summary.items()))
    print(f"machine: {os.cpu_count()} CPUs, load average {' '.join(map(str, load))}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": runs, "median": summary, "machine": machine}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
