"""The claim before and after its rebuild (#31): revision 0008 (the last claim in one function) against
head (the claim as four steps since 0009, with groups and priorities since 0011), on an unlimited lane
and on a rate-limited one whose rate never refuses (1,000,000 a second: the rate path runs, nothing
waits).

Two measures, each paired:

* claim latency: one server, two databases (one migrated to 0008, one to head), lanes ``plain`` and
  ``limited`` in each with the same queued jobs. One session per database and lane holds slot 1 and
  runs claim (timed: the round trip of ``SELECT * FROM pglane.claim(...)``, commit and its WAL flush
  included), then complete (untimed). The four variants take turns job by job, the order rotated
  each turn, so that the machine's noise falls on all alike. Reported per lane: p50 and p90 of each
  revision and head/0008 of the p50 (and p90) with a paired bootstrap 95 % interval (sample i of
  both came from the same turn).
* server instructions per job (bench.callgrind, as bench.lab.identity): a single-user backend drains
  each lane through complete_and_claim (a claim and a completion per job), 0008 and head in four
  databases of one cluster, rounds interleaved. Whatever the machine does, the counts are the same
  for the same work; but a database's count moves by 1-3 % from round to round (its tables' state),
  so head/0008 is taken within each round, and its median and range over the rounds reported.

    python -m bench.lab.claim_revisions [--jobs 8000] [--rounds 5] [--cg-jobs 500] [--dsn DSN]
    (those defaults took 9 minutes on 2 busy cores; --only latency or --only instructions for one)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pglane import pgbin, schema

from .. import callgrind
from ..server import bench_server, postgres_info, quiesce, with_db
from ..stats import percentile, progress, progress_done, ratio_interval, rotations

BEFORE = "0008"
REVISIONS = (BEFORE, "head")
RATE = 1_000_000  # a second: the most a lane may have (lane_rate_valid), never reached here
LANES = ("plain", "limited")  # unlimited, and limited to RATE a second
LEVEL = 0.95


def _db(revision: str) -> str:
    return f"claimrev_{revision}"


def create_lane(conn: psycopg.Connection[Any], name: str, limited: bool) -> int:
    """Lane ``name`` by a plain INSERT (either revision takes it; its trigger makes the counters row)."""
    if limited:
        row = conn.execute("INSERT INTO pglane.lanes (name, rate_limit, rate_period)"
                           f" VALUES (%s, {RATE}, '1 second') RETURNING id", (name,)).fetchone()
    else:
        row = conn.execute("INSERT INTO pglane.lanes (name) VALUES (%s) RETURNING id", (name,)).fetchone()
    assert row is not None
    return int(row[0] if isinstance(row, tuple) else row["id"])


def queue(conn: psycopg.Connection[Any], lane: str, count: int) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(1, %s) g", (lane, count))


# ----- the machine ---------------------------------------------------------------------------------

def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (0, 0 where there is none)."""
    with contextlib.suppress(OSError):
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields) - idle, sum(fields)
    return 0, 0


@contextlib.contextmanager
def machine(into: dict[str, Any]) -> Iterator[None]:
    """The load average at the start and end of a part, and how busy all CPUs were meanwhile."""
    busy0, total0 = _cpu_ticks()
    into["loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    try:
        yield
    finally:
        busy1, total1 = _cpu_ticks()
        into["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        into["cpu_busy"] = round((busy1 - busy0) / (total1 - total0), 3) if total1 > total0 else None
        into["elapsed_s"] = round(time.monotonic() - started, 1)


def _machine_text(m: dict[str, Any]) -> str:
    return (f"load {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f} (1 min),"
            f" CPUs {100 * (m['cpu_busy'] or 0):.0f} % busy, {m['elapsed_s']} s")


# ----- claim latency -------------------------------------------------------------------------------

class Variant:
    """One database and lane, with its own session holding slot 1 of the lane."""

    def __init__(self, dsn: str, revision: str, lane: str) -> None:
        self.revision, self.lane = revision, lane
        self.conn = psycopg.connect(dsn, autocommit=True, row_factory=dict_row)
        row = self.conn.execute("SELECT id FROM pglane.lanes WHERE name = %s", (lane,)).fetchone()
        assert row is not None, lane
        self.conn.execute("SELECT pg_advisory_lock(%s, 1)", (row["id"],))
        self.conn.execute("SELECT set_config('pglane.slot', '1', false)")  # as pglane worker says it

    def job(self) -> int:
        """Claim (timed) and complete (untimed) one job: the claim's nanoseconds."""
        t0 = time.perf_counter_ns()
        row = self.conn.execute("SELECT * FROM pglane.claim(%s, 'bench')", (self.lane,)).fetchone()
        elapsed = time.perf_counter_ns() - t0
        assert row is not None and row["job_id"] is not None, f"{self.revision}/{self.lane} ran dry"
        done = self.conn.execute("SELECT pglane.complete(%s, '{}'::jsonb) AS ok", (row["attempt_id"],)).fetchone()
        assert done is not None and done["ok"], f"{self.revision}/{self.lane}: the completion was refused"
        return elapsed

    def close(self) -> None:
        self.conn.close()


def _name(revision: str, lane: str) -> str:
    return f"{lane}@{revision}"


def latency(dsns: dict[str, str], jobs: int, warm: int, history: int) -> dict[str, Any]:
    """Claim round trips of the four variants, interleaved job by job: nanoseconds per variant."""
    for revision, dsn in dsns.items():
        progress(f"latency: migrating {_db(revision)} to {revision}")
        schema.upgrade(dsn, revision)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for lane in LANES:
                create_lane(conn, lane, lane == "limited")
                queue(conn, lane, history + warm + jobs + 10)
    variants = {_name(rev, lane): Variant(dsns[rev], rev, lane) for lane in LANES for rev in REVISIONS}
    try:
        # A history drained first, then the planner's statistics (as bench.callgrind does): a lane
        # with finished jobs and attempts behind it, as a server in use has.
        for i, (_, name) in enumerate(rotations(list(variants), history)):
            variants[name].job()
            if i % 200 == 0:
                progress(f"latency: history {i // len(variants)}/{history}")
        for dsn in dsns.values():
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
        for _, name in rotations(list(variants), warm):  # untimed: each session's plans cached
            variants[name].job()
        for dsn in dsns.values():
            quiesce(dsn)
        times: dict[str, list[int]] = {name: [] for name in variants}
        for i, (_, name) in enumerate(rotations(list(variants), jobs)):
            times[name].append(variants[name].job())
            if i % 400 == 0:
                progress(f"latency: job {i // len(variants)}/{jobs}")
        progress_done()
    finally:
        for v in variants.values():
            v.close()
    return times


def latency_figures(times: dict[str, list[int]]) -> dict[str, Any]:
    ms = {name: [t / 1e6 for t in samples] for name, samples in times.items()}
    out: dict[str, Any] = {}
    for lane in LANES:
        before, after = ms[_name(BEFORE, lane)], ms[_name("head", lane)]
        row: dict[str, Any] = {"n": len(before)}
        for rev, samples in ((BEFORE, before), ("head", after)):
            row[rev] = {"p50_ms": percentile(samples, 50), "p90_ms": percentile(samples, 90),
                        "p99_ms": percentile(samples, 99)}
        for q in (50, 90):
            row[f"p{q}_ratio"] = percentile(after, q) / percentile(before, q)
            row[f"p{q}_interval_95"] = list(ratio_interval(after, before, q, level=LEVEL, rounds=2000))
        pairs = [a / b for a, b in zip(after, before, strict=True)]
        row["per_turn_ratio_median"] = statistics.median(pairs)
        out[lane] = row
    return out


# ----- instructions --------------------------------------------------------------------------------

def _setup(revision: str, limited: bool) -> Callable[[str], None]:
    def setup(dsn: str) -> None:
        schema.upgrade(dsn, revision)
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_lane(conn, "cc", limited)  # bench.callgrind drains lane cc
    return setup


def drains(setups: dict[str, Callable[[str], None]], jobs: int, rounds: int) -> dict[str, list[float]]:
    """bench.callgrind.interleaved_drains as it was at 19e3684 (kept here so that it keeps running at
    0008: it queues the jobs by a plain INSERT of lane and payload only, which every revision takes):
    instructions per job of lane cc drained through complete_and_claim, one database per setup, after
    a history of HISTORY jobs and VACUUM ANALYZE; the order reversed every other round."""
    names = list(setups)
    with callgrind.cluster() as found:
        with found.running() as admin:
            with psycopg.connect(admin, autocommit=True) as conn:
                for name in names:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            for name in names:
                setups[name](with_db(admin, name))
                with psycopg.connect(with_db(admin, name), autocommit=True) as conn:
                    queue(conn, "cc", callgrind.HISTORY + (jobs + 40) * (rounds + 1))
                    conn.execute(callgrind.DRAIN)
                    conn.execute("CALL public.callgrind_drain('cc', %s)", (callgrind.HISTORY,))
                    conn.execute("VACUUM ANALYZE")
        counts: dict[str, list[float]] = {name: [] for name in names}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                total = found.drain_instructions(name, "cc", jobs,
                                                 setup="VACUUM pglane.jobs;\nVACUUM pglane.attempts;")
                counts[name].append(total / jobs)
                progress(f"instructions round {r + 1}/{rounds}: {name} {total / jobs:,.0f}/job")
    progress_done()
    return counts


def instructions(rounds: int, jobs: int) -> dict[str, Any]:
    setups = {f"cg_{lane}_{rev}": _setup(rev, lane == "limited") for lane in LANES for rev in REVISIONS}
    counts = drains(setups, jobs, rounds)
    out: dict[str, Any] = {"rounds": rounds, "jobs_per_round": jobs}
    for lane in LANES:
        before, after = counts[f"cg_{lane}_{BEFORE}"], counts[f"cg_{lane}_head"]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        out[lane] = {BEFORE: before, "head": after, f"median_{BEFORE}": statistics.median(before),
                     "median_head": statistics.median(after), "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios}
    return out


# ----- the report ----------------------------------------------------------------------------------

def _iv(v: Sequence[float]) -> str:
    return f"[{v[0]:.3f}-{v[1]:.3f}]"


def report(found: dict[str, Any]) -> str:
    lines = [f"{found.get('postgres', 'PostgreSQL ?')}; {found['cpus']} CPUs"]
    if "latency" in found:
        lat = found["latency"]
        lines.append(f"claim round trip, {lat['jobs']} claims per variant, the four interleaved"
                     f" ({_machine_text(lat['machine'])}):")
        lines.append(f"  {'lane':<8} {'p50 0008':>9} {'p50 head':>9} {'p90 0008':>9} {'p90 head':>9}"
                     "   head/0008 p50 [95 %]   head/0008 p90 [95 %]")
        for lane in LANES:
            r = lat["figures"][lane]
            lines.append(f"  {lane:<8} {r[BEFORE]['p50_ms']:>9.3f} {r['head']['p50_ms']:>9.3f}"
                         f" {r[BEFORE]['p90_ms']:>9.3f} {r['head']['p90_ms']:>9.3f}"
                         f"   {r['p50_ratio']:.3f} {_iv(r['p50_interval_95'])}"
                         f"     {r['p90_ratio']:.3f} {_iv(r['p90_interval_95'])}   (ms)")
    if "instructions" in found:
        ins = found["instructions"]
        lines.append(f"server instructions per job (claim + completion, complete_and_claim), {ins['rounds']} rounds"
                     f" of {ins['jobs_per_round']} jobs ({_machine_text(ins['machine'])}):")
        for lane in LANES:
            r = ins[lane]
            lines.append(f"  {lane:<8} 0008 {' / '.join(f'{x:,.0f}' for x in r[BEFORE])};"
                         f" head {' / '.join(f'{x:,.0f}' for x in r['head'])};"
                         f" head/0008 {r['ratio_median']:.3f} (rounds {r['ratio_min']:.3f}-{r['ratio_max']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.claim_revisions", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=8000, help="timed claims per variant (default 8000)")
    p.add_argument("--warm", type=int, default=50, help="untimed claims per variant before (default 50)")
    p.add_argument("--history", type=int, default=500,
                   help="jobs each variant drains before the planner's statistics are taken (default 500)")
    p.add_argument("--rounds", type=int, default=5, help="instructions: interleaved rounds (default 5)")
    p.add_argument("--cg-jobs", type=int, default=500, help="instructions: jobs per round (default 500)")
    p.add_argument("--only", choices=("latency", "instructions"), help="one of the two measures")
    p.add_argument("--dsn", help="a server to use (a superuser's DSN; default PGLANE_DSN, else an embedded one)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    found: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(),
                             "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    if args.only != "latency":
        missing = callgrind.available()
        if missing:
            print(f"bench.lab.claim_revisions: {missing}", file=sys.stderr)
            return 2
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # the embedded server's, as callgrind runs it
        found["postgres"] = subprocess.run([str(pgbin.find_bindir() / "postgres"), "--version"], capture_output=True,
                                           text=True, timeout=30).stdout.strip().replace("postgres (PostgreSQL)",
                                                                                         "PostgreSQL")
    if args.only != "instructions":
        with bench_server(args.dsn, extra=[_db(rev) for rev in REVISIONS]) as server:
            info = postgres_info(server.admin_dsn)
            found["postgres"] = str(info["version"]).split(",")[0]
            found["server_settings"] = info["settings"]
            lat: dict[str, Any] = {"jobs": args.jobs, "machine": {}}
            with machine(lat["machine"]):
                times = latency({rev: server.dsn(_db(rev)) for rev in REVISIONS}, args.jobs, args.warm, args.history)
            lat["figures"] = latency_figures(times)
            found["latency"] = lat
            if args.json:
                found["latency_ns"] = times
    if args.only != "latency":
        m: dict[str, Any] = {}
        with machine(m):
            found["instructions"] = instructions(args.rounds, args.cg_jobs)
        found["instructions"]["machine"] = m
    print(report(found))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
