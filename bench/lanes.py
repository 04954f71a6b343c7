"""Many lanes in one process (#34 point 6): `python -m bench --only lanes [--quick] [--lanes N] [--busy B]
[--sessions K] [--jobs M] [--samples S] [--window W] [--rounds R] [--only connections|idle|wake|throughput ...]
[--json FILE]`.

N one-slot lanes (default 1,000; ``lnb_i0001``...) are served by one real worker process, ``pglane worker
--lanes-like 'lnb_i%' --slots-each 1 --sessions K --poll-interval 30`` (``--sessions`` only where the
worker has it: before #34's shared sessions every slot holds a connection of its own), beside a
one-lane worker (``pglane worker lnb_one``), both with bench.handlers:stamp. Once every lane's slot is
held (pglane.slot_holders, with a deadline):

- ``connections``: the server sessions of each process (pg_stat_activity rows whose application_name
  contains its ``--name``), and how long the many-lane process took to hold every slot.
- ``idle``: with every lane idle (once the processes' sessions have been idle for 11 s, 60 s at most:
  a backend's statistics reach pg_stat_database up to 10 s after it goes idle, so the start-up's
  transactions are counted before the window), a window of W seconds (default 60; quick 30: whole
  periods of the workers' 30 s poll and recovery intervals, whose work comes in bursts): CPU seconds
  per second of wall time of each worker process (utime + stime from /proc/PID/stat), of the many-lane
  process's backends, and of the whole server (the postmaster and all its children: the postmaster is
  the parent of this bench's own backend, so only a server on this machine is measured), and the
  database's transactions per second (pg_stat_database). A worker without per-lane polling stays near
  zero whatever N.
- ``wake``: S rounds (default 50; quick 15), each one job into a random lane of the N and one into
  ``lnb_one``, in an order alternated each round; each job is a plain autocommitted INSERT, the
  clock starts when its commit returns and stops at the handler's stamp (the same machine's clock,
  as the wake part of a server's run), and the next job goes in only once this one is done (plus 25-35
  ms). The p50 of each, the ratio many/one with a paired bootstrap interval; issue #34's bound: at
  most 1.5.
- ``throughput``: B busy lanes (default 100; quick 20; ``lnb_b001``...). Per round, in an order
  rotated each round: (a) ``one_process``: one worker ``--lanes-like 'lnb_b%' --sessions K --max-jobs
  B*M``; (b) ``processes``: B one-lane workers ``pglane worker LANE --max-jobs M``; each started and
  waited for until every busy lane's slot is held, then M jobs per lane (default 300; quick 100) go in
  with one INSERT, and the processes exit by themselves: jobs per second on the database clock, the
  first attempt's start to the last finish; (c) ``floor_one_commit`` (bench.floors: one session
  completing job N in the statement that claims N+1, one commit per job, on a bare table in schema
  ``lnb_floor``) drains B*M jobs: the server's commit rate for one session. R rounds (default 3;
  quick 2); the ratios a/b (bound: at least 0.8), a/floor and b/floor per round, their medians and
  bootstrap intervals.

Every job enqueued is checked to have run once: done, with one attempt. The lanes live in the
database of PGLANE_DSN when it is set (an earlier run's ``lnb_*`` lanes and their jobs are deleted
first, and at the end), else in an embedded PostgreSQL started by the bench (fsync on) with
max_connections raised to N + B + 100 (``--max-connections``): without shared sessions every slot
holds a connection. The machine's load average and CPU busy share are recorded per part: the figures
are ratios measured side by side, or (idle) CPU shares, never absolute speeds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from pglane import schema

from . import floors, procs
from .groups import _code as code
from .groups import machine
from .stats import (
    BenchTimeout,
    latency_ms,
    median_interval,
    percentile,
    ratio_interval,
    rotations,
    summary,
    verdict,
    wait_until,
)

IDLE_LIKE, ONE_LANE, BUSY_LIKE, OURS = "lnb_i%", "lnb_one", "lnb_b%", r"lnb\_%"
MANY, ONE = "lnb-many", "lnb-one"  # the standing workers' --name (application_name contains it)
FLOOR_SCHEMA = "lnb_floor"
PARTS = ("connections", "idle", "wake", "throughput")
WAKE_BOUND = 1.5  # wake p50 many/one, at most
THROUGHPUT_BOUND = 0.8  # one process / one process per lane, jobs/s, at least
WARMUP = 3
GAP_S = (0.025, 0.035)
STATS_LAG = 11  # seconds: an idle backend's statistics reach pg_stat_database within 10 s


@dataclasses.dataclass(frozen=True)
class Settings:
    lanes: int
    busy: int
    sessions: int
    sessions_passed: bool  # the worker has --sessions (else every slot holds a connection of its own)
    jobs: int
    samples: int
    window: float
    rounds: int
    poll_interval: float
    recover_interval: float | None


# ----- the server and the processes ---------------------------------------------------------------

@contextlib.contextmanager
def server(max_connections: int) -> Iterator[str]:
    """PGLANE_DSN when set, else a throwaway embedded server (fsync on) with max_connections raised."""
    if os.environ.get("PGLANE_DSN"):
        yield os.environ["PGLANE_DSN"]
        return
    from pglane.embedded import EmbeddedServer, embedded_server

    @dataclasses.dataclass(frozen=True)
    class Wide(EmbeddedServer):
        def server_options(self) -> str:  # a later -c wins
            return f"{super().server_options()} -c max_connections={max_connections}"

    with embedded_server(fsync=True) as first:
        first.stop("fast")
        Wide(first.data_dir, first.socket_dir, first.fsync, first.port, first.listen).start()
        yield first.dsn  # stopped by embedded_server's exit, as the same data directory


def has_sessions_option() -> bool:
    done = subprocess.run([sys.executable, "-m", "pglane", "worker", "--help"], cwd=procs.ROOT,
                          capture_output=True, text=True, check=False)
    return "--sessions" in done.stdout


def worker(s: Settings, name: str, lanes: list[str], *, like: str | None = None, handler: str = "noop",
           max_jobs: int | None = None) -> list[str]:
    args = ["-m", "pglane", "worker", *lanes, "--handler", f"bench.handlers:{handler}", "--name", name,
            "--poll-interval", f"{s.poll_interval:g}"]
    if like:
        args += ["--lanes-like", like, "--slots-each", "1"] + (["--sessions", str(s.sessions)]
                                                              if s.sessions_passed else [])
    if s.recover_interval is not None:
        args += ["--recover-interval", f"{s.recover_interval:g}"]
    return args + (["--max-jobs", str(max_jobs)] if max_jobs else [])


def wait_held(conn: psycopg.Connection[Any], like: str, count: int, running: list[subprocess.Popen[bytes]],
              what: str) -> float:
    """Until ``count`` lanes matching ``like`` have their slot held; the seconds it took."""
    started = time.monotonic()

    def held() -> bool:
        for p in running:
            if p.poll() is not None:
                raise SystemExit(f"{what}: a worker exited {p.returncode} before holding its slots; see its log")
        row = conn.execute("SELECT count(DISTINCT lane_id) AS n FROM pglane.slot_holders"
                           " WHERE lane LIKE %s AND granted AND mode = 'ExclusiveLock'", (like,)).fetchone()
        return row is not None and int(row["n"]) >= count

    wait_until(held, 60 + 0.2 * count, f"{what}: {count} slots held", interval=0.1)
    return time.monotonic() - started


def rss_mb(pid: int) -> float:
    """The resident memory of process ``pid`` (VmRSS in /proc), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for pid {pid}")


def connections(conn: psycopg.Connection[Any], name: str) -> int:
    row = conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE strpos(application_name, %s) > 0",
                       (name,)).fetchone()
    return int(row["n"]) if row else 0


# ----- CPU from /proc -----------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, utime + stime in clock ticks) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[11]) + int(fields[12])


def server_pids(conn: psycopg.Connection[Any]) -> list[int]:
    """The postmaster (the parent of this session's backend) and its children; none for a server
    that is not on this machine."""
    row = conn.execute("SELECT pg_backend_pid() AS pid").fetchone()
    mine = _stat(int(row["pid"])) if row else None
    if mine is None:
        return []
    postmaster = mine[0]
    with contextlib.suppress(OSError):
        if b"postgres" not in Path(f"/proc/{postmaster}/cmdline").read_bytes():
            return []
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or (0, 0))[0] == postmaster]
    return [postmaster, *children]


def cpu(groups: dict[str, list[int]]) -> dict[str, int]:
    return {name: sum((_stat(pid) or (0, 0))[1] for pid in pids) for name, pids in groups.items()}


def backend_pids(conn: psycopg.Connection[Any], name: str) -> list[int]:
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE strpos(application_name, %s) > 0", (name,))
    return [int(r["pid"]) for r in rows.fetchall()]


def transactions(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute("SELECT xact_commit + xact_rollback AS n FROM pg_stat_database"
                       " WHERE datname = current_database()").fetchone()
    return int(row["n"]) if row else 0


def idle(conn: psycopg.Connection[Any], workers: dict[str, subprocess.Popen[bytes]], window: float
         ) -> dict[str, Any]:
    def quiet() -> bool:
        row = conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE (strpos(application_name, %s) > 0"
                           " OR strpos(application_name, %s) > 0) AND (state <> 'idle'"
                           " OR state_change > clock_timestamp() - make_interval(secs => %s))",
                           (MANY, ONE, STATS_LAG)).fetchone()
        return row is not None and int(row["n"]) == 0

    settled = True
    try:
        wait_until(quiet, 60, f"the workers' sessions idle for {STATS_LAG} s", interval=0.5)
    except BenchTimeout:
        settled = False
    groups = {name: [p.pid] for name, p in workers.items()}
    groups[f"{MANY}_backends"] = backend_pids(conn, MANY)
    groups["server"] = server_pids(conn)
    tx0, before, t0 = transactions(conn), cpu(groups), time.monotonic()
    time.sleep(window)  # the measuring window itself
    after, elapsed, tx1 = cpu(groups), time.monotonic() - t0, transactions(conn)
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[str, Any] = {"window_s": round(elapsed, 2), "settled": settled,
                           "transactions_per_s": round((tx1 - tx0 - 2) / elapsed, 2)}  # less our own reads
    for name, pids in groups.items():
        out[f"{name}_cpu_per_s"] = round((after[name] - before[name]) / hz / elapsed, 5) if pids else None
    return out


# ----- wake ---------------------------------------------------------------------------------------

def wake(conn: psycopg.Connection[Any], lanes: list[str], stamps: dict[str, Path], samples: int) -> dict[str, Any]:
    rng = random.Random(34)
    committed: dict[str, dict[int, float]] = {"many": {}, "one": {}}

    def put(who: str, n: int) -> None:
        lane = rng.choice(lanes) if who == "many" else ONE_LANE
        row = conn.execute("INSERT INTO pglane.jobs (lane, payload) VALUES (%s, jsonb_build_object('n', %s))"
                           " RETURNING id", (lane, n)).fetchone()
        committed[who][n] = time.time()  # autocommit: the commit has returned
        assert row is not None
        wait_until(lambda: _done(conn, int(row["id"])), 30, f"job {row['id']} of {lane} done", interval=0.01)
        time.sleep(rng.uniform(*GAP_S))  # the worker back in its wait before the next job

    for i in range(WARMUP):  # untimed: first-job effects
        put("many", 1_000_000 + i)
        put("one", 1_000_000 + i)
    for n, who in rotations(["many", "one"], samples):
        put(who, n)
    found: dict[str, list[float]] = {}
    for who, times in committed.items():
        stamped = procs.read_stamps(stamps[who])
        found[who] = [stamped[n] - times[n] for n in range(samples)]
    out: dict[str, Any] = {"samples": samples}
    for who, values in found.items():
        out[who] = {**latency_ms(values), "p90_ms": percentile([v * 1000 for v in values], 90)}
    ratio = statistics.median(found["many"]) / statistics.median(found["one"])
    interval = ratio_interval(found["many"], found["one"], 50)
    out["many/one"] = {"p50_ratio": ratio, "interval_90": list(interval),
                       "verdict": verdict(interval, ratio, "<=", WAKE_BOUND)}
    return out


def _done(conn: psycopg.Connection[Any], job: int) -> bool:
    row = conn.execute("SELECT status FROM pglane.jobs WHERE id = %s", (job,)).fetchone()
    return row is not None and row["status"] == "done"


# ----- throughput ---------------------------------------------------------------------------------

def drain(conn: psycopg.Connection[Any], dsn: str, s: Settings, how: str, lanes: list[str], logs: Path,
          label: str) -> dict[str, Any]:
    """One drain of M jobs per busy lane by ``how`` (one_process, processes); jobs/s on the database clock."""
    if how == "one_process":
        commands = [worker(s, f"lnb-tp-{label}", [], like=BUSY_LIKE, max_jobs=s.busy * s.jobs)]
    else:
        commands = [worker(s, f"lnb-{label}-{i:04d}", [lane], max_jobs=s.jobs) for i, lane in enumerate(lanes)]
    env = {"PGLANE_DSN": dsn}
    row = conn.execute("SELECT coalesce(max(id), 0) AS id FROM pglane.jobs").fetchone()
    before = int(row["id"]) if row else 0
    running = [procs.spawn(args, logs / f"{how}-{label}.log", env) for args in commands]
    try:
        wait_held(conn, BUSY_LIKE, len(lanes), running, f"{how} {label}")
        conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT l, jsonb_build_object('n', g)"
                     " FROM unnest(%s::text[]) l CROSS JOIN generate_series(1, %s) g", (lanes, s.jobs))

        def finished() -> bool:  # every worker gone (--max-jobs), or every job done
            if all(p.poll() is not None for p in running):
                return True
            row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE id > %s AND status = 'done'",
                               (before,)).fetchone()
            return row is not None and int(row["n"]) == len(lanes) * s.jobs

        wait_until(finished, 120 + len(lanes) * s.jobs / 20, f"{how} {label}: the jobs done", interval=0.25)
        with contextlib.suppress(BenchTimeout):  # past its --max-jobs a worker exits by itself: some time
            # to do so (a hundred exiting at once on a small machine take seconds), then it is sent SIGTERM
            wait_until(lambda: all(p.poll() is not None for p in running), 2 + 0.2 * len(running), "the exits",
                       interval=0.05)
        lingering = [p for p in running if p.poll() is None]
    finally:
        for p in running:
            procs.stop(p)
    # SIGTERM may find a lingering worker past its own handlers, on its way out: its jobs are checked below
    failed = [p.returncode for p in running
              if p.returncode != 0 and not (p in lingering and p.returncode == -signal.SIGTERM)]
    if failed:
        raise SystemExit(f"{how} {label}: {len(failed)} worker(s) exited {failed[0]}; see {logs}")
    row = conn.execute("SELECT count(*) AS jobs, count(*) FILTER (WHERE status = 'done' AND attempts = 1) AS once,"
                       " extract(epoch FROM max(finished_at) - min(started_at))::float8 AS seconds"
                       " FROM pglane.jobs WHERE id > %s", (before,)).fetchone()
    assert row is not None
    if row["once"] != s.busy * s.jobs or row["jobs"] != s.busy * s.jobs:
        raise SystemExit(f"{how} {label}: {row['once']} of {row['jobs']} jobs done once, {s.busy * s.jobs} enqueued")
    return {"jobs": int(row["jobs"]), "done_once": int(row["once"]), "seconds": float(row["seconds"]),
            "jobs_per_s": row["jobs"] / float(row["seconds"]), "stopped_after_last_job": len(lingering)}


def floor_dsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS lnb_floor CASCADE")
        conn.execute("CREATE SCHEMA lnb_floor")
    scoped = make_conninfo(dsn, options=f"-c search_path={FLOOR_SCHEMA}")
    floors.setup(scoped)
    return scoped


def throughput(conn: psycopg.Connection[Any], dsn: str, s: Settings, lanes: list[str], logs: Path) -> dict[str, Any]:
    scoped = floor_dsn(dsn)
    kinds = ("one_process", "processes", "floor_one_commit")
    rounds: list[dict[str, Any]] = [{} for _ in range(s.rounds)]
    for r, kind in rotations(kinds, s.rounds):
        print(f"throughput round {r + 1}/{s.rounds}: {kind}", flush=True)
        if kind == "floor_one_commit":
            floors.preload(scoped, s.busy * s.jobs)
            rounds[r][kind] = {"jobs_per_s": s.busy * s.jobs / floors.one_commit(scoped, s.busy * s.jobs)}
        else:
            rounds[r][kind] = drain(conn, dsn, s, kind, lanes, logs, f"r{r + 1}")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("DROP SCHEMA lnb_floor CASCADE")
    out: dict[str, Any] = {"busy_lanes": s.busy, "jobs_per_lane": s.jobs, "rounds": rounds}
    for kind in kinds:
        out[kind] = summary([x[kind]["jobs_per_s"] for x in rounds])
    for a, b in (("one_process", "processes"), ("one_process", "floor_one_commit"),
                 ("processes", "floor_one_commit")):
        ratios = [x[a]["jobs_per_s"] / x[b]["jobs_per_s"] for x in rounds]
        out[f"{a}/{b}"] = {"ratio": statistics.median(ratios), "interval_90": list(median_interval(ratios)),
                           "per_round": ratios}
    judged = out["one_process/processes"]
    judged["verdict"] = verdict(tuple(judged["interval_90"]), judged["ratio"], ">=", THROUGHPUT_BOUND)
    return out


# ----- the lanes, the standing workers ------------------------------------------------------------

def clean(conn: psycopg.Connection[Any]) -> None:
    """An earlier run's lanes and their jobs (every lnb_* name is this bench's)."""
    conn.execute("DELETE FROM pglane.jobs WHERE lane LIKE %s", (OURS,))
    conn.execute("DELETE FROM pglane.lanes WHERE name LIKE %s", (OURS,))


def make_lanes(conn: psycopg.Connection[Any], prefix: str, count: int) -> list[str]:
    names = [f"{prefix}{i:0{max(3, len(str(count)))}d}" for i in range(1, count + 1)]
    conn.execute("INSERT INTO pglane.lanes (name) SELECT unnest(%s::text[])", (names,))
    return names


def standing(conn: psycopg.Connection[Any], dsn: str, s: Settings, idle_lanes: list[str], logs: Path,
             parts: list[str]) -> dict[str, Any]:
    """The many-lane and the one-lane worker, idle: connections, idle CPU, wake."""
    out: dict[str, Any] = {}
    stamps = {"many": logs / "many.stamps", "one": logs / "one.stamps"}
    args = {"many": worker(s, MANY, [], like=IDLE_LIKE, handler="stamp"),
            "one": worker(s, ONE, [ONE_LANE], handler="stamp")}
    workers: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for who in ("many", "one"):
            workers[who] = procs.spawn(args[who], logs / f"{who}.log",
                                       {"PGLANE_DSN": dsn, "BENCH_STAMPS": str(stamps[who])})
        print(f"waiting for one process to hold the slots of {s.lanes} lanes", flush=True)
        ready = wait_held(conn, IDLE_LIKE, s.lanes, [workers["many"]], "many lanes")
        wait_held(conn, ONE_LANE, 1, [workers["one"]], "one lane")
        if "connections" in parts:
            many = connections(conn, MANY)
            out["connections"] = {"lanes": s.lanes, "ready_s": round(ready, 2), "many": many,
                                  "per_lane": round(many / s.lanes, 4), "one_lane": connections(conn, ONE),
                                  "rss_mb": {who: rss_mb(p.pid) for who, p in workers.items()}}
        if "idle" in parts:
            print(f"idle: a {s.window:g} s window", flush=True)
            found: dict[str, Any] = {}
            with machine(found.setdefault("machine", {})):
                found.update(idle(conn, {MANY: workers["many"], ONE: workers["one"]}, s.window))
            out["idle"] = found
        if "wake" in parts:
            print(f"wake: {s.samples} rounds, a random lane of {s.lanes} and the one-lane worker's", flush=True)
            found = {}
            with machine(found.setdefault("machine", {})):
                found.update(wake(conn, idle_lanes, stamps, s.samples))
            out["wake"] = found
    finally:
        for p in workers.values():
            procs.stop(p)
    return out


def tally(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Every job this run enqueued: how many, how many done, attempts in all, and any not run exactly once."""
    row = conn.execute(
        "SELECT count(*) AS enqueued, count(*) FILTER (WHERE j.status = 'done') AS done,"
        " coalesce(sum(a.n), 0)::bigint AS attempts, count(*) FILTER (WHERE a.n IS DISTINCT FROM 1) AS not_once"
        " FROM pglane.jobs j LEFT JOIN LATERAL (SELECT count(*) AS n FROM pglane.attempts a WHERE a.job_id = j.id) a"
        " ON true WHERE j.lane LIKE %s", (OURS,)).fetchone()
    assert row is not None
    return {k: int(v) for k, v in row.items()}


# ----- the report ---------------------------------------------------------------------------------

def _iv(v: list[float]) -> str:
    return f"[{v[0]:.3f}-{v[1]:.3f}]"


def _machine(m: dict[str, Any]) -> str:
    return (f"load {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}, CPUs {100 * (m['cpu_busy'] or 0):.0f} %"
            f" busy, {m['elapsed_s']} s")


def report(found: dict[str, Any]) -> str:
    st = found["settings"]
    sessions = f"--sessions {st['sessions']}" if st["sessions_passed"] else "no --sessions (a connection per slot)"
    lines = [f"{found['postgres']}; {st['lanes']} lanes, {sessions}; {found['mode']} mode; {found['date']};"
             f" code {found['code']}"]
    if "connections" in found:
        c = found["connections"]
        lines.append(f"connections: {c['many']} for {c['lanes']} lanes ({c['per_lane']} per lane; every slot held"
                     f" after {c['ready_s']} s); the one-lane worker {c['one_lane']}")
        if "rss_mb" in c:
            lines.append(f"memory (RSS): the {c['lanes']}-lane process {c['rss_mb']['many']} MB, the one-lane"
                         f" process {c['rss_mb']['one']} MB")
    if "idle" in found:
        i = found["idle"]
        lines.append(f"idle, {i['window_s']} s ({_machine(i['machine'])}; settled: {i['settled']}), CPU s per s:"
                     f" many-lane process {i[f'{MANY}_cpu_per_s']}, its backends {i[f'{MANY}_backends_cpu_per_s']},"
                     f" one-lane process {i[f'{ONE}_cpu_per_s']}, server {i['server_cpu_per_s']};"
                     f" {i['transactions_per_s']} transactions/s")
    if "wake" in found:
        w = found["wake"]
        r = w["many/one"]
        lines.append(f"wake, {w['samples']} rounds ({_machine(w['machine'])}): p50 many {w['many']['p50_ms']:.2f} ms,"
                     f" one {w['one']['p50_ms']:.2f} ms (p90 {w['many']['p90_ms']:.2f} / {w['one']['p90_ms']:.2f});"
                     f" many/one {r['p50_ratio']:.3f} {_iv(r['interval_90'])}  <= {WAKE_BOUND}: {r['verdict']}")
    if "throughput" in found:
        t = found["throughput"]
        lines.append(f"throughput, {t['busy_lanes']} busy lanes x {t['jobs_per_lane']} jobs, {len(t['rounds'])}"
                     f" rounds ({_machine(t['machine'])}): one process {t['one_process']['median']:,.0f},"
                     f" {t['busy_lanes']} processes {t['processes']['median']:,.0f}, floor_one_commit"
                     f" {t['floor_one_commit']['median']:,.0f} jobs/s (medians)")
        for pair in ("one_process/processes", "one_process/floor_one_commit", "processes/floor_one_commit"):
            r = t[pair]
            lines.append(f"  {pair} {r['ratio']:.3f} {_iv(r['interval_90'])} (rounds: "
                         + ", ".join(f"{x:.3f}" for x in r["per_round"]) + ")"
                         + (f"  >= {THROUGHPUT_BOUND}: {r['verdict']}" if "verdict" in r else ""))
    j = found["jobs"]
    lines.append(f"jobs: {j['enqueued']} enqueued, {j['done']} done, {j['attempts']} attempts, {j['not_once']} not run"
                 " exactly once")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --only lanes", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 lanes, 20 busy, fewer samples, jobs and rounds")
    parser.add_argument("--lanes", type=int, help="idle one-slot lanes of one process (default 1000; quick 200)")
    parser.add_argument("--busy", type=int, help="busy lanes of the throughput part (default 100; quick 20)")
    parser.add_argument("--sessions", type=int, default=4, help="the worker's --sessions K, where it has it"
                        " (default 4)")
    parser.add_argument("--jobs", type=int, help="jobs per busy lane per drain (default 300; quick 100)")
    parser.add_argument("--samples", type=int, help="wake rounds (default 50; quick 15)")
    parser.add_argument("--window", type=float, help="idle CPU window in seconds (default 60; quick 30)")
    parser.add_argument("--rounds", type=int, help="throughput rounds (default 3; quick 2)")
    parser.add_argument("--poll-interval", type=float, default=30.0, help="the workers' --poll-interval (30)")
    parser.add_argument("--recover-interval", type=float,
                        help="the workers' --recover-interval (default: the worker's own)")
    parser.add_argument("--max-connections", type=int, help="the embedded server's (default lanes + busy + 100)")
    parser.add_argument("--logs", type=Path, default=procs.RESULTS / "logs" / "lanes",
                        help="the workers' logs and stamps (emptied first)")
    parser.add_argument("--only", nargs="*", choices=PARTS, help="some of the parts (default: all)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    q = args.quick
    s = Settings(lanes=args.lanes or (200 if q else 1000), busy=args.busy or (20 if q else 100),
                 sessions=args.sessions, sessions_passed=has_sessions_option(), jobs=args.jobs or (100 if q else 300),
                 samples=args.samples or (15 if q else 50), window=args.window or (30.0 if q else 60.0),
                 rounds=args.rounds or (2 if q else 3), poll_interval=args.poll_interval,
                 recover_interval=args.recover_interval)
    parts = [p for p in PARTS if p in (args.only or PARTS)]
    sized = (args.lanes, args.busy, args.jobs, args.samples, args.window, args.rounds)
    found: dict[str, Any] = {"mode": "custom" if any(v is not None for v in sized) else "quick" if q else "full",
                             "settings": dataclasses.asdict(s), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                             "cpus": os.cpu_count(), "code": code()}
    for path in args.logs.glob("*"):
        path.unlink()
    args.logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with server(args.max_connections or s.lanes + s.busy + 100) as dsn, machine(found.setdefault("machine", {})):
        schema.upgrade(dsn)
        with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
            row = conn.execute("SELECT current_setting('server_version') AS v,"
                               " current_setting('max_connections')::int AS m").fetchone()
            assert row is not None
            found["postgres"], found["max_connections"] = f"PostgreSQL {row['v']}", row["m"]
            clean(conn)
            idle_lanes = make_lanes(conn, "lnb_i", s.lanes)
            busy_lanes = make_lanes(conn, "lnb_b", s.busy)
            conn.execute("INSERT INTO pglane.lanes (name) VALUES (%s)", (ONE_LANE,))
            if {"connections", "idle", "wake"} & set(parts):
                found.update(standing(conn, dsn, s, idle_lanes, args.logs, parts))
            if "throughput" in parts:
                t: dict[str, Any] = {}
                with machine(t.setdefault("machine", {})):
                    t.update(throughput(conn, dsn, s, busy_lanes, args.logs))
                found["throughput"] = t
            found["jobs"] = tally(conn)
            if os.environ.get("PGLANE_DSN"):
                clean(conn)
    found["elapsed_s"] = round(time.monotonic() - started, 1)
    print()
    print(report(found))
    print(f"elapsed {found['elapsed_s']} s; machine: {_machine(found['machine'])}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2, default=str) + "\n")
    return 0 if found["jobs"]["not_once"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
