"""What a lane's groups cost (#32 point 7): `python -m bench --only groups [--quick] [--queued N] [--groups G]
[--claims M] [--rounds R] [--drain-jobs D] [--only claim|throughput|ledger|enqueue|instructions ...] [--json FILE]`.

Three lanes on one server, each with N queued jobs (default 100,000) and 6 slots: ``limit``, the N jobs
over G groups (default 10,000; job n in group n mod G) and ``group_slots`` 1, the costly path (the claim
counts the lane's full groups under the counters lock, full_groups, and the pick passes them over);
``fair``, the same groups without group_slots (service by rounds only); ``plain``, no groups at all.

- ``claim``: one session holding slot 1 of each lane claims (``pglane.claim``, the statement's round
  trip timed on the client, commit included) and then, untimed, completes the job and enqueues one
  more (the backlog stays at N, the new job continuing the round-robin of groups); the lanes
  interleaved claim by claim in an order rotated each time, so noise hits each alike. Two phases:
  ``idle`` (nothing else running) and ``busy`` (5 other sessions hold slots 2-6 of each lane and keep
  one running job each: on ``limit`` full_groups then finds 5 full groups, which the pick passes
  over). p50/p90/p99 of each lane; the p50 ratios limit/plain, fair/plain and limit/fair with paired
  bootstrap intervals (resampled by round). Issue #32's bound: limit/plain at most 1.3. Then, untimed
  and lane after lane, where the claim's server time goes: pg_stat_user_functions (track_functions =
  all, in the claiming session only) per claim, each pglane function's self time.
- ``throughput``: one real ``pglane worker`` (bench.handlers:noop, ``--max-jobs D``) drains D jobs of each
  lane's N (refilled after each drain, untimed), the lanes' drains in an order rotated each round; jobs
  per second on the database clock, first start to last finish; the ratios to ``plain`` per round,
  their median and a bootstrap interval. Bound: limit/plain at least 0.8.
- ``ledger``: 6 worker processes (bench.handlers:ledger) on a 6-slot lane with group_slots 1 and 50
  groups; a third of the jobs in group g0 with priority 1 (at the head of the queue: without the limit
  all 6 workers would run g0 at once), the rest over g1-g49; each call sleeps 20 ms and its handler
  appends its start and end (monotonic ns) to a file outside the database, fsynced line by line. The
  most calls of one group in progress at once (must be 1), the most calls in progress at all, and the
  calls made. The same on a control lane without group_slots shows that the ledger sees overlaps.
- ``enqueue``: one producer, one commit per job, into ``limit`` (a group each, round-robin over G) and
  into ``plain`` (none), a plain INSERT and pglane.enqueue(): the four kinds interleaved job by job in
  an order rotated each time (finer than the enqueue part of a server's run, which rotates runs of
  jobs: on a shared machine a run of a second catches a burst that the next one misses), each
  statement timed; jobs per second of each kind (jobs over the sum of their times), the ratio
  groups/plain with a paired bootstrap interval, and the p50 latency ratio. Then a bulk ``INSERT ...
  SELECT`` of B jobs (default 100,000) into a fresh lane, with G groups against none, alternating, R
  repetitions; the ratio per repetition, its median and interval. Every insert computes its job's
  round (fair_rank, one index probe), with a group or without. Untimed, the round's own share:
  fair_rank's and the insert trigger's time per job (pg_stat_user_functions).
- ``instructions`` (only when named: needs valgrind, and minutes; on a cluster of its own, whatever
  PGLANE_DSN says): the server's instructions per job of a slot draining each kind of lane (the same
  N queued and G groups) through complete_and_claim (bench.callgrind: a single-user backend, counted,
  not timed), idle and busy (5 jobs of other groups running beside, as in ``claim``), rounds
  interleaved; the ratios per round, their median and interval. What groups cost the server, free
  of the machine's noise and of the commit's flush.

It starts its own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set (then it makes its lanes,
named ``grp_*``, in that database). The machine's load average and CPU busy share are recorded per
part: the figures are ratios measured side by side, never absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg.rows import dict_row

import pglane
from pglane import queries, schema

from . import callgrind
from .pglane_runs import claim_and_complete, lane_id
from .procs import ROOT
from .server import env_or_embedded, quiesce
from .stats import (
    latency_ms,
    median_interval,
    percentile,
    ratio_interval,
    rotations,
    sum_ratio_interval,
    summary,
    verdict,
    wait_until,
)

LANES = {"limit": "grp_limit", "fair": "grp_fair", "plain": "grp_plain"}
SLOTS = 6
CLAIM_BOUND = 1.3  # limit/plain claim p50, at most
THROUGHPUT_BOUND = 0.8  # limit/plain jobs/s, at least
LEDGER_LANES = {"limited": "grp_ledger", "control": "grp_ledger_control"}
PARTS = ("claim", "throughput", "ledger", "enqueue", "instructions")
DEFAULT_PARTS = PARTS[:4]  # instructions (valgrind, minutes) only when asked for
INSERT: LiteralString = "INSERT INTO pglane.jobs (lane, payload, group_key) VALUES (%s, %s::jsonb, %s)"


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
    """Record, around a part, the load average at its start and end and how busy the CPUs were (all of
    the machine's work, this bench's included): how noisy the machine was while it ran."""
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


# ----- lanes and jobs ------------------------------------------------------------------------------

def group_of(n: int, groups: int) -> str:
    return f"g{n % groups}"


class Backlog:
    """A lane's queued jobs: job n of a grouped lane is in group n mod G, so the groups are served in
    turn; ``refill`` continues the numbering, so the backlog keeps its shape."""

    def __init__(self, lane: str, groups: int | None) -> None:
        self.lane, self.groups, self.next = lane, groups, 0

    def load(self, conn: psycopg.Connection[Any], count: int) -> None:
        """count more queued jobs in one statement, through pglane's insert triggers."""
        first, last = self.next, self.next + count - 1
        if self.groups:
            conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key)"
                         " SELECT %s, jsonb_build_object('n', g), 'g' || (g %% %s)"
                         " FROM generate_series(%s::bigint, %s::bigint) g", (self.lane, self.groups, first, last))
        else:
            conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                         " FROM generate_series(%s::bigint, %s::bigint) g", (self.lane, first, last))
        self.next += count

    def one(self, conn: psycopg.Connection[Any]) -> None:
        group = group_of(self.next, self.groups) if self.groups else None
        conn.execute(INSERT, (self.lane, f'{{"n": {self.next}}}', group))
        self.next += 1


def make_lanes(conn: psycopg.Connection[Any], queued: int, groups: int) -> dict[str, Backlog]:
    backlogs = {}
    for case, lane in LANES.items():
        pglane.create_lane(conn, lane, slots=SLOTS, job_timeout=600, group_slots=1 if case == "limit" else None)
        backlogs[case] = Backlog(lane, None if case == "plain" else groups)
        backlogs[case].load(conn, queued)
    conn.execute("VACUUM ANALYZE pglane.jobs")
    return backlogs


# ----- where the server's time goes ----------------------------------------------------------------

FUNCTION_STATS: LiteralString = (
    "SELECT funcname AS name, calls, total_time, self_time FROM pg_stat_user_functions WHERE schemaname = 'pglane'")


def _function_stats(conn: psycopg.Connection[Any]) -> dict[str, tuple[int, float, float]]:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return {r["name"]: (int(r["calls"]), float(r["total_time"]), float(r["self_time"]))
            for r in conn.execute(FUNCTION_STATS).fetchall()}


def functions_per(dsn: str, conn: psycopg.Connection[Any], units: int,
                  work: Callable[[psycopg.Connection[dict[str, Any]]], None], expect: str) -> dict[str, Any] | None:
    """Run ``work`` in a fresh session with track_functions = all (set in that session only, which needs
    a superuser; None otherwise) and return, per unit of work, each pglane function's calls and self and
    total time in µs (the session's statistics are read once it has ended and flushed them, until
    function ``expect`` shows the calls)."""
    before = _function_stats(conn)
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as session:
        try:
            session.execute("SET track_functions = 'all'")
        except psycopg.Error:
            return None
        work(session)
    after: dict[str, tuple[int, float, float]] = {}

    def flushed() -> bool:
        nonlocal after
        after = _function_stats(conn)
        return after.get(expect, (0, 0.0, 0.0))[0] - before.get(expect, (0, 0.0, 0.0))[0] >= units

    try:
        wait_until(flushed, 15, f"the statistics of {expect}", interval=0.2)
    except Exception:
        return None
    out = {}
    for name, (calls, total, self_time) in after.items():
        c0, t0, s0 = before.get(name, (0, 0.0, 0.0))
        if calls > c0:
            out[name] = {"calls": round((calls - c0) / units, 2), "self_us": round(1000 * (self_time - s0) / units, 1),
                         "total_us": round(1000 * (total - t0) / units, 1)}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["self_us"]))


# ----- claim latency -------------------------------------------------------------------------------

def _claims(session: psycopg.Connection[dict[str, Any]], backlogs: dict[str, Backlog], claims: int,
            ) -> dict[str, list[float]]:
    """The interleaved loop: claim i of every lane, in an order rotated each time."""
    times: dict[str, list[float]] = {case: [] for case in backlogs}
    for _, case in rotations(list(backlogs), claims):
        times[case].append(claim_and_complete(session, backlogs[case].lane))
        backlogs[case].one(session)
    return times


def _latency_figures(times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case, samples in times.items():
        stats = latency_ms(samples)
        out[case] = {"p50_ms": stats["p50_ms"], "p90_ms": percentile([s * 1000 for s in samples], 90),
                     "p99_ms": stats["p99_ms"], "n": stats["n"]}
    for a, b in (("limit", "plain"), ("fair", "plain"), ("limit", "fair")):
        ratio = statistics.median(times[a]) / statistics.median(times[b])
        interval = ratio_interval(times[a], times[b], 50)
        out[f"{a}/{b}"] = {"p50_ratio": ratio, "interval_90": list(interval),
                           "p90_ratio": percentile(times[a], 90) / percentile(times[b], 90),
                           "p90_interval_90": list(ratio_interval(times[a], times[b], 90))}
    judged = out["limit/plain"]
    judged["verdict"] = verdict(tuple(judged["interval_90"]), judged["p50_ratio"], "<=", CLAIM_BOUND)
    return out


@contextlib.contextmanager
def others_running(dsn: str, backlogs: dict[str, Backlog], count: int) -> Iterator[list[str]]:
    """``count`` other sessions, each holding slot k + 2 of every lane and one running job of it (claimed,
    completed only on the way out): the groups of those jobs are full on ``limit``."""
    sessions = [psycopg.connect(dsn, autocommit=True, row_factory=dict_row) for _ in range(count)]
    held: list[tuple[psycopg.Connection[dict[str, Any]], dict[str, Any]]] = []
    try:
        for k, session in enumerate(sessions):
            for backlog in backlogs.values():
                session.execute(queries.WAIT_SLOT, (lane_id(session, backlog.lane), k + 2))
                row = session.execute(queries.CLAIM, (backlog.lane, f"other{k}")).fetchone()
                assert row is not None and row["job_id"] is not None, "the backlog ran dry"
                held.append((session, row))
                backlog.one(session)
        groups = sessions[0].execute(
            "SELECT j.group_key FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
            " WHERE a.status = 'running' AND j.lane = %s ORDER BY 1", (backlogs["limit"].lane,)).fetchall()
        yield [str(g["group_key"]) for g in groups]
    finally:
        for session, row in held:
            session.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"]))
        for session in sessions:
            session.close()


def claim_latency(dsn: str, conn: psycopg.Connection[Any], backlogs: dict[str, Backlog], claims: int,
                  others: int, where_claims: int) -> dict[str, Any]:
    out: dict[str, Any] = {"claims_per_lane": claims}
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as session:
        for backlog in backlogs.values():
            session.execute(queries.WAIT_SLOT, (lane_id(session, backlog.lane), 1))
        _claims(session, backlogs, 20)  # untimed: the session's plans cached
        quiesce(dsn)
        print(f"claim: idle, {claims} claims per lane, interleaved", flush=True)
        with machine(out.setdefault("machine_idle", {})):
            out["idle"] = _latency_figures(_claims(session, backlogs, claims))
        with others_running(dsn, backlogs, others) as full:
            quiesce(dsn)
            print(f"claim: busy ({others} other jobs running per lane), {claims} claims per lane", flush=True)
            with machine(out.setdefault("machine_busy", {})):
                out["busy"] = _latency_figures(_claims(session, backlogs, claims))
            out["busy"]["others_running"] = others
            out["busy"]["full_groups_on_limit"] = full
    where: dict[str, Any] = {}
    for case, backlog in backlogs.items():
        def work(s: psycopg.Connection[dict[str, Any]], backlog: Backlog = backlog) -> None:
            """Only the claims in the counted session: the completion and the new job from ``conn``."""
            s.execute(queries.WAIT_SLOT, (lane_id(s, backlog.lane), 1))
            for _ in range(where_claims):
                row = s.execute(queries.CLAIM, (backlog.lane, "bench")).fetchone()
                assert row is not None and row["job_id"] is not None, "the backlog ran dry"
                conn.execute(queries.COMPLETE, (row["attempt_id"], "null", row["token"]))
                backlog.one(conn)
        where[case] = functions_per(dsn, conn, where_claims, work, "claim_impl")
    out["server_time_per_claim"] = where
    return out


# ----- throughput ----------------------------------------------------------------------------------

def drain_some(dsn: str, conn: psycopg.Connection[Any], lane: str, n: int) -> float:
    """One real worker (bench.handlers:noop, --max-jobs n) takes n of the lane's queued jobs: jobs per
    second on the database clock, from the first start to the last finish of those n."""
    row = conn.execute("SELECT c.last_seq FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
                       " WHERE l.name = %s", (lane,)).fetchone()
    assert row is not None
    before = int(row["last_seq"])
    proc = subprocess.Popen([sys.executable, "-m", "pglane", "worker", lane, "--handler", "bench.handlers:noop",
                             "--max-jobs", str(n)], env={**os.environ, "PGLANE_DSN": dsn}, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"the worker on {lane} exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    row = conn.execute("SELECT count(*) FILTER (WHERE status = 'done') AS done,"
                       " extract(epoch FROM max(finished_at) - min(started_at))::float8 AS seconds"
                       " FROM pglane.jobs WHERE lane = %s AND seq > %s", (lane, before)).fetchone()
    assert row is not None
    if row["done"] != n:
        raise SystemExit(f"{lane}: {row['done']} of {n} jobs done")
    return float(n / row["seconds"])


def throughput(dsn: str, conn: psycopg.Connection[Any], backlogs: dict[str, Backlog], jobs: int,
               rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs_per_drain": jobs, "rounds": rounds}
    figures: dict[str, list[float]] = {case: [] for case in backlogs}
    with machine(out.setdefault("machine", {})):
        for i, (r, case) in enumerate(rotations(list(backlogs), rounds)):
            quiesce(dsn)
            figures[case].append(drain_some(dsn, conn, backlogs[case].lane, jobs))
            backlogs[case].load(conn, jobs)  # untimed: the backlog back at N
            if (i + 1) % len(backlogs) == 0:
                print(f"throughput round {r + 1}: " + ", ".join(f"{c} {v[-1]:,.0f}" for c, v in figures.items())
                      + " jobs/s", flush=True)
    out["jobs_per_s"] = {case: summary(values) for case, values in figures.items()}
    for a in ("limit", "fair"):
        ratios = [x / y for x, y in zip(figures[a], figures["plain"], strict=True)]
        out[f"{a}/plain"] = {"ratio": statistics.median(ratios), "interval_90": list(median_interval(ratios)),
                             "per_round": ratios}
    judged = out["limit/plain"]
    judged["verdict"] = verdict(tuple(judged["interval_90"]), judged["ratio"], ">=", THROUGHPUT_BOUND)
    return out


# ----- the ledger ----------------------------------------------------------------------------------

def read_ledger(path: Path) -> list[tuple[str, str, int, int]]:
    """(event, group, attempt id, monotonic ns) of every complete line (see bench.handlers.ledger)."""
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] in ("start", "end"):
            out.append((parts[0], parts[1], int(parts[3]), int(parts[4])))
    return out


def most_at_once(intervals: Sequence[tuple[int, int]]) -> int:
    """The most intervals (start, end) in progress at one instant; one that ends when another starts
    does not overlap it."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    most = running = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def ledger_figures(events: Sequence[tuple[str, str, int, int]]) -> dict[str, Any]:
    """Calls made and finished; the most calls in progress at once, of one group and of all. A call
    that never wrote its end counts as in progress until the end of the run."""
    starts = {attempt: (group, t) for event, group, attempt, t in events if event == "start"}
    ends = {attempt: t for event, _, attempt, t in events if event == "end"}
    forever = max((t for *_, t in events), default=0) + 1
    by_group: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for attempt, (group, t) in starts.items():
        by_group[group].append((t, ends.get(attempt, forever)))
    per_group = {group: most_at_once(spans) for group, spans in by_group.items()}
    busiest = max(per_group, key=lambda g: per_group[g], default=None)
    return {"calls": len(starts), "finished": sum(1 for a in starts if a in ends), "groups": len(by_group),
            "most_at_once_per_group": per_group[busiest] if busiest is not None else 0, "busiest_group": busiest,
            "most_at_once": most_at_once([span for spans in by_group.values() for span in spans])}


def ledger_jobs(n: int, groups: int, sleep: float) -> list[tuple[str, str, int]]:
    """(payload, group, priority): a third of the jobs in g0 with priority 1 (the head of the queue), the
    rest over g1 .. g{groups-1}."""
    jobs = []
    for i in range(n):
        group = "g0" if i % 3 == 0 else f"g{1 + (i - 1 - i // 3) % (groups - 1)}"  # the others in turn
        jobs.append((json.dumps({"n": i, "group": group, "sleep": sleep}), group, 1 if group == "g0" else 0))
    return jobs


def ledger_run(dsn: str, conn: psycopg.Connection[Any], lane: str, group_slots: int | None, workers: int, jobs: int,
               groups: int, sleep: float, folder: Path) -> dict[str, Any]:
    pglane.create_lane(conn, lane, slots=workers, job_timeout=60, group_slots=group_slots)
    path = folder / f"{lane}.ledger"
    path.touch()
    lid = lane_id(conn, lane)
    env = {**os.environ, "PGLANE_DSN": dsn, "BENCH_LEDGER": str(path)}
    logs = [(folder / f"{lane}-{k}.log").open("wb") for k in range(workers)]
    procs = [subprocess.Popen([sys.executable, "-m", "pglane", "worker", lane, "--handler", "bench.handlers:ledger",
                               "--poll-interval", "1"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
             for log in logs]
    try:
        def holding() -> bool:
            for p, log in zip(procs, logs, strict=True):
                if p.poll() is not None:
                    tail = Path(log.name).read_text(errors="replace")[-2000:]
                    raise SystemExit(f"a ledger worker on {lane} exited {p.returncode}: {tail}")
            row = conn.execute("SELECT count(*) AS n FROM pglane.slot_holders WHERE lane_id = %s AND granted",
                               (lid,)).fetchone()
            return row is not None and int(row["n"]) == workers

        wait_until(holding, 60, f"{workers} workers holding the slots of {lane}", interval=0.05)
        started = time.monotonic()
        with conn.transaction(), conn.cursor() as cur:  # all at once: every worker woken together
            cur.executemany("INSERT INTO pglane.jobs (lane, payload, group_key, priority)"
                            " VALUES (%s, %s::jsonb, %s, %s)",
                            [(lane, *job) for job in ledger_jobs(jobs, groups, sleep)])

        def done() -> bool:
            row = conn.execute("SELECT count(*) FILTER (WHERE status IN ('done', 'failed')) AS n FROM pglane.jobs"
                               " WHERE lane = %s", (lane,)).fetchone()
            return row is not None and int(row["n"]) == jobs

        wait_until(done, 60 + jobs * sleep * 2, f"the {jobs} jobs of {lane}", interval=0.05)
        elapsed = time.monotonic() - started
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    row = conn.execute("SELECT count(*) FILTER (WHERE status = 'done') AS done, count(*) AS jobs FROM pglane.jobs"
                       " WHERE lane = %s", (lane,)).fetchone()
    assert row is not None
    found = ledger_figures(read_ledger(path))
    return {"lane": lane, "group_slots": group_slots, "workers": workers, "jobs": jobs, "groups": groups,
            "sleep_s": sleep, "jobs_done": int(row["done"]), "seconds": round(elapsed, 2), **found}


def ledger(dsn: str, conn: psycopg.Connection[Any], workers: int, jobs: int, groups: int, sleep: float
           ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="pglane-ledger-") as tmp, machine(out.setdefault("machine", {})):
        out["limited"] = ledger_run(dsn, conn, LEDGER_LANES["limited"], 1, workers, jobs, groups, sleep, Path(tmp))
        out["control"] = ledger_run(dsn, conn, LEDGER_LANES["control"], None, workers, jobs, groups, sleep, Path(tmp))
    limited = out["limited"]
    ok = limited["most_at_once_per_group"] == 1 and limited["calls"] == jobs == limited["jobs_done"]
    out["verdict"] = "met" if ok else "missed"
    return out


# ----- enqueue -------------------------------------------------------------------------------------

def _one_statement(query: LiteralString, backlog: Backlog, grouped: bool
                   ) -> Callable[[psycopg.Connection[Any]], float]:
    """One job, one autocommitted statement, timed on the client: a plain INSERT or pglane.enqueue();
    with a group (round-robin over the lane's groups) or none."""
    def run(conn: psycopg.Connection[Any]) -> float:
        i = backlog.next
        group = group_of(i, backlog.groups) if grouped and backlog.groups else None
        params: tuple[object, ...] = ((backlog.lane, f'{{"n": {i}}}', group) if query is INSERT else
                                      (backlog.lane, f'{{"n": {i}}}', None, None, "error", 1, group, 0, None, None))
        t0 = time.perf_counter()
        conn.execute(query, params)
        elapsed = time.perf_counter() - t0
        backlog.next += 1
        return elapsed
    return run


def enqueue(dsn: str, conn: psycopg.Connection[Any], backlogs: dict[str, Backlog], n: int, bulk: int, groups: int,
            repetitions: int) -> dict[str, Any]:
    out: dict[str, Any] = {"jobs_per_variant": n, "bulk_jobs": bulk, "bulk_repetitions": repetitions}
    variants = {"insert_groups": _one_statement(INSERT, backlogs["limit"], True),
                "insert_plain": _one_statement(INSERT, backlogs["plain"], False),
                "enqueue_groups": _one_statement(queries.ENQUEUE, backlogs["limit"], True),
                "enqueue_plain": _one_statement(queries.ENQUEUE, backlogs["plain"], False)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    bulks: dict[str, list[float]] = {"bulk_groups": [], "bulk_plain": []}
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as session:
        for name in variants:  # untimed: the session's plans cached
            for _ in range(20):
                variants[name](session)
        quiesce(dsn)
        print(f"enqueue: one commit per job, {n} of each kind, interleaved job by job", flush=True)
        with machine(out.setdefault("machine_single", {})):
            for _, name in rotations(list(variants), n):
                times[name].append(variants[name](session))
        print(f"enqueue: INSERT ... SELECT of {bulk:,} into a fresh lane, {repetitions} repetitions", flush=True)
        with machine(out.setdefault("machine_bulk", {})):
            for r in range(repetitions):
                for case in (("bulk_groups", "bulk_plain") if r % 2 == 0 else ("bulk_plain", "bulk_groups")):
                    lane = f"grp_{case}_{r}"
                    pglane.create_lane(session, lane, job_timeout=600)
                    fresh = Backlog(lane, groups if case == "bulk_groups" else None)
                    quiesce(dsn)
                    t0 = time.perf_counter()
                    fresh.load(session, bulk)
                    bulks[case].append(bulk / (time.perf_counter() - t0))
    for name, samples in times.items():
        out[name] = {"jobs_per_s": len(samples) / sum(samples), **latency_ms(samples)}
    for a, b in (("insert_groups", "insert_plain"), ("enqueue_groups", "enqueue_plain")):
        low, high = sum_ratio_interval(times[b], times[a])  # time per job of b over a: a's jobs/s over b's
        out[f"{a}/{b}"] = {"ratio": sum(times[b]) / sum(times[a]), "interval_90": [low, high],
                           "p50_latency_ratio": statistics.median(times[a]) / statistics.median(times[b]),
                           "p50_interval_90": list(ratio_interval(times[a], times[b], 50))}
    for name, values in bulks.items():
        out[name] = {"jobs_per_s": summary(values)}
    ratios = [x / y for x, y in zip(bulks["bulk_groups"], bulks["bulk_plain"], strict=True)]
    out["bulk_groups/bulk_plain"] = {"ratio": statistics.median(ratios), "interval_90": list(median_interval(ratios)),
                                     "per_repetition": ratios}

    where: dict[str, Any] = {}
    units = min(n, 500)
    for name, grouped, backlog in (("groups", True, backlogs["limit"]), ("plain", False, backlogs["plain"])):
        one = _one_statement(INSERT, backlog, grouped)

        def work(s: psycopg.Connection[dict[str, Any]], one: Callable[[psycopg.Connection[Any]], float] = one
                 ) -> None:
            for _ in range(units):
                one(s)
        where[name] = functions_per(dsn, conn, units, work, "jobs_before_insert")
    out["server_time_per_insert"] = where
    return out


# ----- instructions --------------------------------------------------------------------------------

def instructions(jobs: int, rounds: int, queued: int, groups: int, others: int) -> dict[str, Any]:
    """Server instructions per job of a slot draining each kind of lane through complete_and_claim
    (bench.callgrind: a single-user backend under callgrind, one database per kind and phase,
    ``queued`` jobs more than the drains take, over ``groups`` groups where the kind has them), rounds
    interleaved. Phase ``idle``: no other job running; ``busy``: ``others`` jobs running beside, each of a
    group of its own (claimed by other sessions in the setup and never finished: on ``limit`` their
    groups are full, which full_groups counts at every claim)."""
    def lane(group_slots: int | None, grouped: bool, busy: int) -> Callable[[str], None]:
        def setup(dsn: str) -> None:
            schema.upgrade(dsn)
            with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
                pglane.create_lane(conn, "cc", slots=SLOTS, job_timeout=60, group_slots=group_slots)
                for k in range(busy):
                    conn.execute(INSERT, ("cc", "{}", f"busy{k}" if grouped else None))
                sessions = [psycopg.connect(dsn, autocommit=True, row_factory=dict_row) for _ in range(busy)]
                try:
                    for k, other in enumerate(sessions):
                        other.execute(queries.WAIT_SLOT, (lane_id(other, "cc"), k + 2))
                        row = other.execute(queries.CLAIM, ("cc", f"other{k}")).fetchone()
                        assert row is not None and row["job_id"] is not None
                finally:
                    for other in sessions:
                        other.close()  # their jobs stay running: nothing recovers them here
        return setup

    kinds = {"limit": (1, True), "fair": (None, True), "plain": (None, False)}
    setups = {f"groups_{case}_{phase}": lane(gs, grouped, others if phase == "busy" else 0)
              for phase in ("idle", "busy") for case, (gs, grouped) in kinds.items()}
    counts = callgrind.interleaved_drains(setups, jobs, rounds, groups={name: groups for name in setups
                                                                        if "plain" not in name},
                                          backlog=queued, finish=True)
    out: dict[str, Any] = {"jobs_per_round": jobs, "rounds": rounds, "queued": queued, "groups": groups,
                           "others_running_when_busy": others}
    for phase in ("idle", "busy"):
        found: dict[str, Any] = {}
        for case in kinds:
            values = counts[f"groups_{case}_{phase}"]
            found[case] = {"median": statistics.median(values), "runs": values}
        for a, b in (("limit", "plain"), ("fair", "plain"), ("limit", "fair")):
            ratios = [x / y for x, y in zip(counts[f"groups_{a}_{phase}"], counts[f"groups_{b}_{phase}"], strict=True)]
            found[f"{a}/{b}"] = {"ratio": statistics.median(ratios), "interval_90": list(median_interval(ratios))}
        out[phase] = found
    return out


# ----- the report ----------------------------------------------------------------------------------

def _iv(v: Sequence[float]) -> str:
    return f"[{v[0]:.3f}-{v[1]:.3f}]"


def _machine(m: dict[str, Any]) -> str:
    return (f"load {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}, CPUs {100 * (m['cpu_busy'] or 0):.0f} %"
            f" busy, {m['elapsed_s']} s")


def report(found: dict[str, Any]) -> str:
    lines = [f"{found['postgres']}; {found['settings']['queued']:,} queued per lane over "
             f"{found['settings']['groups']:,} groups; {found['mode']} mode; {found['date']}; code {found['code']}"]
    if "claim" in found:
        c = found["claim"]
        for phase in ("idle", "busy"):
            f = c[phase]
            lines.append(f"claim latency, {phase} ({c['claims_per_lane']} claims per lane; "
                         f"{_machine(c['machine_' + phase])}):")
            for case in LANES:
                lines.append(f"  {case:<6} p50 {f[case]['p50_ms']:.3f} ms  p90 {f[case]['p90_ms']:.3f}"
                             f"  p99 {f[case]['p99_ms']:.3f}")
            for pair in ("limit/plain", "fair/plain", "limit/fair"):
                r = f[pair]
                lines.append(f"  {pair:<11} p50 {r['p50_ratio']:.3f} {_iv(r['interval_90'])}"
                             f"  p90 {r['p90_ratio']:.3f} {_iv(r['p90_interval_90'])}"
                             + (f"  <= {CLAIM_BOUND}: {r['verdict']}" if "verdict" in r else ""))
        for case, funcs in c["server_time_per_claim"].items():
            if funcs:
                top = ", ".join(f"{name} {v['self_us']:.0f}" for name, v in list(funcs.items())[:6])
                total = funcs.get("claim", {}).get("total_us")
                lines.append(f"  server µs per claim, {case}: claim {total} in all; self: {top}")
    if "throughput" in found:
        t = found["throughput"]
        lines.append(f"throughput, one worker, {t['jobs_per_drain']} jobs x {t['rounds']} rounds"
                     f" ({_machine(t['machine'])}):")
        lines.append("  " + ", ".join(f"{case} {t['jobs_per_s'][case]['median']:,.0f}" for case in LANES)
                     + " jobs/s (medians)")
        for a in ("limit", "fair"):
            r = t[f"{a}/plain"]
            lines.append(f"  {a}/plain {r['ratio']:.3f} {_iv(r['interval_90'])}"
                         + (f"  >= {THROUGHPUT_BOUND}: {r['verdict']}" if "verdict" in r else ""))
    if "ledger" in found:
        led = found["ledger"]
        lines.append(f"ledger ({_machine(led['machine'])}):")
        for case in ("limited", "control"):
            x = led[case]
            lines.append(f"  {case:<8} group_slots {x['group_slots']}, {x['workers']} workers, {x['groups']} groups:"
                         f" {x['calls']} calls ({x['jobs_done']} of {x['jobs']} jobs done) in {x['seconds']} s;"
                         f" most at once of one group {x['most_at_once_per_group']} ({x['busiest_group']}),"
                         f" of all {x['most_at_once']}")
        lines.append(f"  most at once per group on the limited lane = 1: {led['verdict']}")
    if "instructions" in found:
        ic = found["instructions"]
        if "skipped" in ic:
            lines.append(f"instructions: skipped ({ic['skipped']})")
        else:
            lines.append(f"server instructions per claim and completion (callgrind, {ic['rounds']} x"
                         f" {ic['jobs_per_round']} jobs, {ic['queued']:,} queued):")
            for phase in ("idle", "busy"):
                f = ic[phase]
                lines.append(f"  {phase:<4} " + ", ".join(f"{case} {f[case]['median']:,.0f}" for case in LANES)
                             + "; " + ", ".join(f"{pair} {f[pair]['ratio']:.3f} {_iv(f[pair]['interval_90'])}"
                                               for pair in ("limit/plain", "fair/plain", "limit/fair")))
    if "enqueue" in found:
        e = found["enqueue"]
        lines.append(f"enqueue, one commit per job, {e['jobs_per_variant']} of each kind interleaved"
                     f" ({_machine(e['machine_single'])}):")
        for a, b in (("insert_groups", "insert_plain"), ("enqueue_groups", "enqueue_plain")):
            r = e[f"{a}/{b}"]
            lines.append(f"  {a} {e[a]['jobs_per_s']:,.0f} / {b} {e[b]['jobs_per_s']:,.0f} jobs/s:"
                         f" {r['ratio']:.3f} {_iv(r['interval_90'])}; p50 latency {e[a]['p50_ms']:.3f} /"
                         f" {e[b]['p50_ms']:.3f} ms: {r['p50_latency_ratio']:.3f} {_iv(r['p50_interval_90'])}")
        r = e["bulk_groups/bulk_plain"]
        lines.append(f"  INSERT ... SELECT of {e['bulk_jobs']:,} into a fresh lane x {e['bulk_repetitions']}"
                     f" ({_machine(e['machine_bulk'])}): groups {e['bulk_groups']['jobs_per_s']['median']:,.0f} /"
                     f" none {e['bulk_plain']['jobs_per_s']['median']:,.0f} jobs/s: {r['ratio']:.3f}"
                     f" {_iv(r['interval_90'])}")
        for name, funcs in e["server_time_per_insert"].items():
            if funcs:
                trig = funcs.get("jobs_before_insert", {})
                rank = funcs.get("fair_rank", {})
                lines.append(f"  server µs per insert, {name}: trigger {trig.get('total_us')} in all,"
                             f" fair_rank {rank.get('total_us')}")
    return "\n".join(lines)


def _code() -> str:
    """The commit measured, and whether pglane's SQL or Python differed from it (another's edits)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", "sql", "pglane", "alembic")
    return commit + (" with uncommitted changes to sql/pglane/alembic" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only groups", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer claims, rounds and jobs (the lanes keep --queued and --groups)")
    parser.add_argument("--queued", type=int, default=100_000, help="queued jobs per lane (default 100000)")
    parser.add_argument("--groups", type=int, default=10_000, help="groups of the grouped lanes (default 10000)")
    parser.add_argument("--claims", type=int, help="timed claims per lane and phase (default 2000; quick 600)")
    parser.add_argument("--others", type=int, default=SLOTS - 1,
                        help=f"other running jobs per lane in the busy phase (default {SLOTS - 1})")
    parser.add_argument("--rounds", type=int, help="drains per lane, and bulk enqueues (default 6; quick 3)")
    parser.add_argument("--drain-jobs", type=int, help="jobs per drain (default 1500; quick 600)")
    parser.add_argument("--workers", type=int, default=6, help="ledger: worker processes (default 6)")
    parser.add_argument("--ledger-groups", type=int, default=50, help="ledger: groups (default 50)")
    parser.add_argument("--ledger-jobs", type=int, help="ledger: jobs (default 300; quick 150)")
    parser.add_argument("--sleep", type=float, default=0.02, help="ledger: each call's sleep (default 0.02 s)")
    parser.add_argument("--enqueue-jobs", type=int, help="single-row enqueues of each kind (default 2000; quick 500)")
    parser.add_argument("--bulk", type=int, help="jobs of the bulk INSERT ... SELECT (default 100000; quick 20000)")
    parser.add_argument("--ic-jobs", type=int, default=300, help="instructions: jobs per counted drain (default 300)")
    parser.add_argument("--ic-rounds", type=int, default=4, help="instructions: counted drains of each lane"
                        " (default 4)")
    parser.add_argument("--only", nargs="*", choices=PARTS,
                        help="some of the parts (default: all but instructions, which needs valgrind and minutes)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    q = args.quick
    claims = args.claims or (600 if q else 2000)
    rounds = args.rounds or (3 if q else 6)
    drain_jobs = args.drain_jobs or (600 if q else 1500)
    ledger_jobs_n = args.ledger_jobs or (150 if q else 300)
    enqueue_jobs = args.enqueue_jobs or (500 if q else 2000)
    bulk = args.bulk or (20_000 if q else 100_000)
    only = [name for name in PARTS if name in (args.only or DEFAULT_PARTS)]
    if args.ledger_groups < 2 or args.workers < 2:
        parser.error("the ledger needs at least 2 groups and 2 workers")
    sized = [args.claims, args.rounds, args.drain_jobs, args.ledger_jobs, args.enqueue_jobs, args.bulk]
    custom = any(v is not None for v in sized) or (args.queued, args.groups) != (100_000, 10_000)
    found: dict[str, Any] = {
        "mode": "custom" if custom else "quick" if q else "full",
        "settings": {"queued": args.queued, "groups": args.groups, "claims": claims, "others": args.others,
                     "rounds": rounds, "drain_jobs": drain_jobs, "workers": args.workers,
                     "ledger_groups": args.ledger_groups, "ledger_jobs": ledger_jobs_n, "sleep": args.sleep,
                     "enqueue_jobs": enqueue_jobs, "bulk": bulk},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(), "code": _code(),
    }
    started = time.monotonic()
    if "instructions" in only:  # a cluster of its own, counted while stopped: before the timed parts
        missing = callgrind.available()
        found["instructions"] = ({"skipped": missing} if missing else
                                 instructions(args.ic_jobs, args.ic_rounds, args.queued, args.groups, args.others))
    with env_or_embedded() as dsn, machine(found.setdefault("machine", {})):
        schema.upgrade(dsn)
        with pglane.connect(dsn) as conn:
            row = conn.execute("SELECT current_setting('server_version') AS v").fetchone()
            found["postgres"] = f"PostgreSQL {row['v'] if row else '?'}"
            backlogs: dict[str, Backlog] = {}
            if {"claim", "throughput", "enqueue"} & set(only):
                print(f"loading {args.queued:,} queued jobs into each of {', '.join(LANES.values())}", flush=True)
                backlogs = make_lanes(conn, args.queued, args.groups)
            if "claim" in only:
                found["claim"] = claim_latency(dsn, conn, backlogs, claims, args.others, min(claims, 500))
            if "throughput" in only:
                found["throughput"] = throughput(dsn, conn, backlogs, drain_jobs, rounds)
            if "ledger" in only:
                found["ledger"] = ledger(dsn, conn, args.workers, ledger_jobs_n, args.ledger_groups, args.sleep)
            if "enqueue" in only:
                found["enqueue"] = enqueue(dsn, conn, backlogs, enqueue_jobs, bulk, args.groups, rounds)
    found["elapsed_s"] = round(time.monotonic() - started, 1)
    print()
    print(report(found))
    print(f"elapsed {found['elapsed_s']} s; machine: {_machine(found['machine'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2, default=str) + "\n")
    return 0 if found.get("ledger", {}).get("verdict", "met") == "met" else 1


if __name__ == "__main__":
    raise SystemExit(main())
