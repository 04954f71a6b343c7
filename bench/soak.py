"""``python -m bench --only soak [--jobs N] [--producers P] [--dsn DSN] [--out DIR] [--interval S] [--backlog B]``

A soak: one real worker (``python -m pglane worker soak --handler bench.handlers:noop``) runs N jobs
(default 100,000) while P producer processes (default 4) enqueue them with ``pglane.enqueue``, one
commit per job, pausing while the lane already holds ``--backlog`` queued jobs (default 1,000) so
that the run stays a steady state rather than a drain. Every ``--interval`` seconds (default 3) it
samples the worker's RSS and open fds (/proc), the sessions on the database (pg_stat_activity), the
size of every table and index of schema pglane, their dead tuples and vacuums, and the lane's claim
counter; the jobs finished per window are counted afterwards from ``jobs.finished_at`` (the
database's clock).

The verdict per series (``judge``): the median of the last third of the run against the median of
the first third, after a warm-up (the first 10 % of the run), and the least-squares trend over the
same span; a series "grew" only when both exceed its tolerance. The worker's RSS, fds and sessions,
the live-row tables (lanes, counters) and the partial indexes (whose rows are the queue or the
running attempts) must stay flat; the history tables (jobs, attempts, pruned_jobs) and their full
indexes grow with every finished job and are reported per job. Throughput per window while all
producers ran: the last third's median at least 0.8x the first third's.

Without ``--dsn`` it runs in database bench_pglane of an embedded server set up as ``python -m
bench``'s (bench.server); with ``--dsn`` in that very database, migrated with pglane.schema.upgrade.
Writes summary.json, samples.json, samples.csv, soak.svg and the processes' logs into ``--out``
(default bench/results/soak/) and prints the report.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

import pglane
from pglane import schema

from . import procs
from .server import bench_server, postgres_info
from .stats import wait_until

LANE = "soak"
PRODUCER_APP = "soak producer"
OUT = procs.RESULTS / "soak"
HISTORY_TABLES = ("jobs", "attempts", "pruned_jobs")  # they keep a row per job (or prune): they may grow
# Partial indexes that hold a row per finished job (history too): none since attempts_finished went.
HISTORY_PARTIAL: tuple[str, ...] = ()
STALL_SECONDS = 60.0
WARMUP_FRACTION = 0.1
THROUGHPUT_FLOOR = 0.8

# (series, unit, absolute tolerance, relative tolerance): the change a series may show and stay "flat"
WORKER_RULES = (("worker_rss_mb", "MB", 1.0, 0.05), ("worker_fds", "fds", 1.0, 0.0),
                ("worker_sessions", "sessions", 0.5, 0.0), ("connections", "sessions", 0.5, 0.0))
LIVE_BYTES_RULE = (1024 * 1024.0, 0.5)  # a live table or partial index: within 1 MB or 50 %
DEAD_RULE = (5000.0, 1.0)  # dead tuples: within 5,000 or double (autovacuum works in a sawtooth)

TABLES_SQL = """
SELECT s.relname, pg_total_relation_size(s.relid), pg_indexes_size(s.relid), s.n_live_tup, s.n_dead_tup,
       s.autovacuum_count + s.vacuum_count
  FROM pg_stat_user_tables s WHERE s.schemaname = 'pglane' AND s.relname <> 'alembic_version' ORDER BY s.relname"""
INDEXES_SQL = """
SELECT i.relname, i.indexrelname, pg_relation_size(i.indexrelid), x.indpred IS NOT NULL
  FROM pg_stat_user_indexes i JOIN pg_index x ON x.indexrelid = i.indexrelid
 WHERE i.schemaname = 'pglane' AND i.relname <> 'alembic_version' ORDER BY i.indexrelname"""
WORKER_APP = "pglane soak"  # PGAPPNAME of the worker's sessions; its lock session's is "pglane soak <name>"
SESSIONS_SQL = """
SELECT count(*), count(*) FILTER (WHERE application_name LIKE %s || '%%'),
       count(*) FILTER (WHERE application_name = %s)
  FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'client backend' AND pid <> pg_backend_pid()"""
LOCK_SESSION_SQL = ("SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                    " AND application_name LIKE %s || ' %%'")
CLAIMS_SQL = ("SELECT c.last_seq FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
              " WHERE l.name = %s")
QUEUED_SQL = "SELECT count(*) FROM (SELECT 1 FROM pglane.jobs WHERE lane = %s AND in_queue LIMIT %s) q"


# ----- the verdict: pure computation over sampled numbers ------------------------------------------

def slope(times: Sequence[float], values: Sequence[float]) -> float:
    """Least-squares slope of values against times (units per second); 0 for fewer than two times."""
    if len(times) < 2:
        return 0.0
    mt, mv = statistics.fmean(times), statistics.fmean(values)
    spread = sum((t - mt) ** 2 for t in times)
    return sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / spread if spread else 0.0


def thirds(times: Sequence[float], values: Sequence[float], warmup: float
           ) -> tuple[list[float], list[float], list[float], list[float]]:
    """(times, values) after ``warmup`` seconds (all of them if fewer than 3 remain), then the
    first third's and the last third's values."""
    kept = [(t, v) for t, v in zip(times, values, strict=True) if t >= warmup]
    if len(kept) < 3:
        kept = list(zip(times, values, strict=True))
    k = max(1, len(kept) // 3)
    return [t for t, _ in kept], [v for _, v in kept], [v for _, v in kept[:k]], [v for _, v in kept[-k:]]


def judge(times: Sequence[float], values: Sequence[float], *, unit: str, abs_tol: float, rel_tol: float,
          warmup: float) -> dict[str, Any]:
    """Did the series grow? The last third's median minus the first third's (``delta``) and the
    trend over the judged span (slope x span) must both exceed the tolerance, max(abs_tol, rel_tol x
    first third's median), for "grew" ("shrank" likewise downwards); otherwise "flat"."""
    ts, vs, first, last = thirds(times, values, warmup)
    a, b = statistics.median(first), statistics.median(last)
    delta, trend = b - a, slope(ts, vs) * (ts[-1] - ts[0])
    tol = max(abs_tol, rel_tol * abs(a))
    pct = f" ({100 * delta / a:+.0f} %)" if a else ""
    if delta > tol and trend > tol:
        verdict = f"grew by {delta:,.4g} {unit}{pct}"
    elif delta < -tol and trend < -tol:
        verdict = f"shrank by {-delta:,.4g} {unit}{pct}"
    else:
        verdict = "flat"
    return {"unit": unit, "start": values[0], "end": values[-1], "max": max(values), "first_third": a,
            "last_third": b, "delta": delta, "trend_over_run": trend, "tolerance": tol, "verdict": verdict,
            "grew": verdict.startswith("grew")}


def judge_throughput(times: Sequence[float], rates: Sequence[float], warmup: float) -> dict[str, Any]:
    """Jobs/s per window: stable when the last third's median is at least 0.8x the first third's."""
    _, judged, first, last = thirds(times, rates, warmup)
    a, b = statistics.median(first), statistics.median(last)
    ratio = b / a if a else 0.0
    return {"unit": "jobs/s", "first_third": a, "last_third": b, "ratio": ratio, "min": min(judged),
            "max": max(judged), "windows": len(judged), "stable": ratio >= THROUGHPUT_FLOOR,
            "verdict": "stable" if ratio >= THROUGHPUT_FLOOR else f"fell to {ratio:.2f}x"}


def verdicts(samples: list[dict[str, Any]], producers: int) -> dict[str, Any]:
    """Every series judged over the steady state, the samples taken while every producer was
    connected (its first 10 %: warm-up): the worker, live tables and partial indexes (must be flat),
    dead tuples, throughput; the history tables' growth per job from the first sample to the last."""
    steady = [s for s in samples if s["producer_sessions"] == producers] or samples
    times = [s["t"] for s in steady]
    warmup = times[0] + WARMUP_FRACTION * (times[-1] - times[0])
    jobs = samples[-1]["jobs_done"] - samples[0]["jobs_done"]

    def flat(values: list[float], unit: str, rule: tuple[float, float]) -> dict[str, Any]:
        return judge(times, values, unit=unit, abs_tol=rule[0], rel_tol=rule[1], warmup=warmup)

    def history(start: float, end: float) -> dict[str, Any]:
        per_job = (end - start) / jobs if jobs else 0.0
        return {"start": start, "end": end, "bytes_per_job": per_job,
                "verdict": f"grows with history: +{(end - start) / 2**20:.1f} MB ({per_job:.0f} B/job)"}

    out: dict[str, Any] = {"warmup_s": warmup, "steady_from_s": times[0], "steady_to_s": times[-1],
                           "must_be_flat": {}, "dead_tuples": {}, "history": {}}
    for name, unit, abs_tol, rel_tol in WORKER_RULES:
        out["must_be_flat"][name] = flat([s[name] for s in steady], unit, (abs_tol, rel_tol))
    for table in samples[-1]["tables"]:
        dead = [s["tables"].get(table, {}).get("dead", 0) for s in steady]
        vacuums = samples[-1]["tables"][table]["vacuums"] - samples[0]["tables"].get(table, {}).get("vacuums", 0)
        out["dead_tuples"][table] = {**flat(dead, "dead tuples", DEAD_RULE), "vacuums": vacuums}
        if table in HISTORY_TABLES:
            out["history"][table] = history(samples[0]["tables"].get(table, {}).get("bytes", 0),
                                            samples[-1]["tables"][table]["bytes"])
        else:
            out["must_be_flat"][f"table {table}"] = flat([s["tables"].get(table, {}).get("bytes", 0) for s in steady],
                                                         "bytes", LIVE_BYTES_RULE)
    for index, info in samples[-1]["indexes"].items():
        if (info["partial"] and index not in HISTORY_PARTIAL) or info["table"] not in HISTORY_TABLES:  # live rows
            out["must_be_flat"][f"index {index}"] = flat([s["indexes"].get(index, {}).get("bytes", 0) for s in steady],
                                                         "bytes", LIVE_BYTES_RULE)
        else:
            out["history"][f"index {index}"] = history(samples[0]["indexes"].get(index, {}).get("bytes", 0),
                                                       info["bytes"])
    windows = [s for s in steady[1:] if s.get("rate") is not None]  # each window began and ended steady
    out["throughput"] = (judge_throughput([s["t"] for s in windows], [s["rate"] for s in windows], warmup)
                         if windows else {"verdict": "no window with every producer running", "stable": False})
    out["ok"] = out["throughput"]["stable"] and not any(v["grew"] for v in out["must_be_flat"].values())
    return out


# ----- the processes -------------------------------------------------------------------------------

def produce(dsn: str, lane: str, count: int, backlog: int) -> None:
    """One producer: ``count`` jobs, one pglane.enqueue commit each, waiting while ``backlog`` are queued."""
    with pglane.connect(dsn, application_name=PRODUCER_APP) as conn:
        for n in range(count):
            if n % 50 == 0:
                while (row := conn.execute(QUEUED_SQL, (lane, backlog)).fetchone()) and row["count"] >= backlog:
                    time.sleep(0.02)
            pglane.enqueue(conn, lane, {"n": n})


def _proc_figures(pid: int) -> tuple[float, int, float]:
    """(RSS in MB, open fds, CPU seconds) of a running process, from /proc."""
    rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return rss_kb / 1024.0, len(os.listdir(f"/proc/{pid}/fd")), cpu


def sample(conn: psycopg.Connection[Any], worker: subprocess.Popen[bytes], epoch0: float, claims0: int,
           running: int) -> dict[str, Any]:
    row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    rss, fds, cpu = _proc_figures(worker.pid)
    sessions = conn.execute(SESSIONS_SQL, (WORKER_APP, PRODUCER_APP)).fetchone()
    total, worker_sessions, producer_sessions = sessions or (0, 0, 0)
    claims = conn.execute(CLAIMS_SQL, (LANE,)).fetchone()
    queued = conn.execute(QUEUED_SQL, (LANE, 10**9)).fetchone()
    return {
        "t": round(row[0] - epoch0, 3), "db_epoch": row[0], "jobs_done": (claims[0] if claims else 0) - claims0,
        "queued": queued[0] if queued else 0, "producers_running": running, "worker_rss_mb": round(rss, 2),
        "worker_fds": fds, "worker_cpu_s": cpu, "worker_sessions": worker_sessions, "connections": total,
        "producer_sessions": producer_sessions,
        "tables": {name: {"bytes": size, "index_bytes": isize, "live": live, "dead": dead, "vacuums": vac}
                   for name, size, isize, live, dead, vac in conn.execute(TABLES_SQL).fetchall()},
        "indexes": {index: {"table": table, "bytes": size, "partial": partial}
                    for table, index, size, partial in conn.execute(INDEXES_SQL).fetchall()},
    }


def add_rates(conn: psycopg.Connection[Any], samples: list[dict[str, Any]], first_id: int) -> None:
    """Jobs finished between consecutive samples, by jobs.finished_at: ``rate`` (jobs/s) of the
    window that ends at each sample (none for the first)."""
    bounds = [s["db_epoch"] for s in samples]
    counts = dict(conn.execute(
        "SELECT width_bucket(extract(epoch FROM finished_at)::float8, %s::float8[]), count(*) FROM pglane.jobs"
        " WHERE lane = %s AND id > %s AND finished_at IS NOT NULL GROUP BY 1", (bounds, LANE, first_id)).fetchall())
    for i, s in enumerate(samples):
        s["rate"] = None if i == 0 else round(counts.get(i, 0) / (bounds[i] - bounds[i - 1]), 1)


def soak(dsn: str, *, jobs: int, producers: int, out: Path, interval: float = 3.0, backlog: int = 1000
         ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the soak in the database of ``dsn``; returns (samples, verdicts)."""
    schema.upgrade(dsn)
    out.mkdir(parents=True, exist_ok=True)
    env = {"PGLANE_DSN": dsn}
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pglane.lanes WHERE name = %s", (LANE,)).fetchone():
            pglane.create_lane(conn, LANE)
        row = conn.execute("SELECT coalesce(max(id), 0) FROM pglane.jobs").fetchone()
        first_id = row[0] if row else 0
        claims0 = (conn.execute(CLAIMS_SQL, (LANE,)).fetchone() or (0,))[0]
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        epoch0 = row[0] if row else 0.0
        with procs.running(["-m", "pglane", "worker", LANE, "--handler", "bench.handlers:noop"],
                           out / "worker.log", {**env, "PGAPPNAME": WORKER_APP}) as worker:
            # its lock session, not merely a first connection that the worker may close before it takes the slot
            wait_until(lambda: bool(conn.execute(LOCK_SESSION_SQL, (WORKER_APP,)).fetchone()), 30,
                       "the worker's lock session")
            shares = [jobs // producers + (i < jobs % producers) for i in range(producers)]
            makers = [procs.spawn(["-m", "bench.soak", "--produce", str(n), "--backlog", str(backlog)],
                                  out / f"producer-{i}.log", env) for i, n in enumerate(shares)]
            try:
                samples = _sample_until_done(conn, worker, makers, jobs, interval, epoch0, claims0)
            finally:
                for p in makers:
                    procs.stop(p)
        add_rates(conn, samples, first_id)
    return samples, verdicts(samples, producers)


def _sample_until_done(conn: psycopg.Connection[Any], worker: subprocess.Popen[bytes],
                       makers: list[subprocess.Popen[bytes]], jobs: int, interval: float, epoch0: float,
                       claims0: int) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    progressed_at, next_at = time.monotonic(), time.monotonic()
    while True:
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with status {worker.returncode}; see its log")
        if failed := [p.returncode for p in makers if p.poll() not in (None, 0)]:
            raise RuntimeError(f"a producer exited with status {failed[0]}; see its log")
        running = sum(p.poll() is None for p in makers)
        samples.append(sample(conn, worker, epoch0, claims0, running))
        done = samples[-1]["jobs_done"]
        print(f"\r\033[K[soak {time.strftime('%H:%M:%S')}] {done:,}/{jobs:,} jobs, {samples[-1]['queued']:,} queued,"
              f" RSS {samples[-1]['worker_rss_mb']:.1f} MB", end="", flush=True)
        if done >= jobs and not running and samples[-1]["queued"] == 0:
            print()
            return samples
        if len(samples) > 1 and done > samples[-2]["jobs_done"]:
            progressed_at = time.monotonic()
        elif time.monotonic() - progressed_at > STALL_SECONDS:
            raise RuntimeError(f"no job claimed for {STALL_SECONDS:g} s at {done:,}/{jobs:,}")
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


# ----- output --------------------------------------------------------------------------------------

def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def report(summary: dict[str, Any]) -> str:
    v, s = summary["verdicts"], summary["settings"]
    lines = [f"soak: {summary['jobs_done']:,} jobs, {s['producers']} producers, {summary['elapsed_s']:.0f} s,"
             f" {summary['samples']} samples every {s['interval']:g} s, judged from {v['warmup_s']:.0f} s to"
             f" {v['steady_to_s']:.0f} s (every producer running, after a warm-up);"
             f" {summary['postgres']}",
             "", f"{'must stay flat':34} {'start':>10} {'1st third':>10} {'3rd third':>10} {'end':>10}  verdict"]
    for name, j in v["must_be_flat"].items():
        fmt = _mb if j["unit"] == "bytes" else (lambda x: f"{x:,.1f}")
        lines.append(f"{name:34} {fmt(j['start']):>10} {fmt(j['first_third']):>10} {fmt(j['last_third']):>10}"
                     f" {fmt(j['end']):>10}  {j['verdict']}")
    lines += ["", f"{'dead tuples':34} {'start':>10} {'1st third':>10} {'3rd third':>10} {'max':>10}  verdict"]
    for name, j in v["dead_tuples"].items():
        lines.append(f"{name:34} {j['start']:>10,} {j['first_third']:>10,.0f} {j['last_third']:>10,.0f}"
                     f" {j['max']:>10,}  {j['verdict']}, {j['vacuums']} vacuums")
    lines += ["", f"{'history (may grow)':34} {'start':>10} {'end':>10}  verdict"]
    for name, h in v["history"].items():
        lines.append(f"{name:34} {_mb(h['start']):>10} {_mb(h['end']):>10}  {h['verdict']}")
    tp = v["throughput"]
    if "ratio" in tp:
        lines += ["", f"throughput per {s['interval']:g} s window, every producer running ({tp['windows']} windows):"
                      f" first third {tp['first_third']:,.0f} jobs/s, last third {tp['last_third']:,.0f} jobs/s"
                      f" ({tp['ratio']:.2f}x; min {tp['min']:,.0f}, max {tp['max']:,.0f}): {tp['verdict']}"]
    else:
        lines += ["", f"throughput: {tp['verdict']}"]
    lines.append(f"verdict: {'nothing that must stay flat grew; throughput stable' if v['ok'] else 'SEE ABOVE'}")
    return "\n".join(lines)


def plot(samples: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.fonttype"] = "none"  # text as text: a smaller file
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(6, 1, figsize=(8, 13), sharex=True)
    panels: list[tuple[str, dict[str, list[float]]]] = [
        ("worker RSS (MB)", {"RSS": [s["worker_rss_mb"] for s in samples]}),
        ("fds and sessions", {"worker fds": [s["worker_fds"] for s in samples],
                              "worker sessions": [s["worker_sessions"] for s in samples],
                              "sessions on the database": [s["connections"] for s in samples]}),
        ("history tables (MB, with indexes)", {n: [s["tables"].get(n, {}).get("bytes", 0) / 2**20 for s in samples]
                                               for n in samples[-1]["tables"] if n in HISTORY_TABLES}),
        ("live tables, partial indexes (kB)",
         {**{n: [s["tables"].get(n, {}).get("bytes", 0) / 1024 for s in samples]
             for n in samples[-1]["tables"] if n not in HISTORY_TABLES},
          **{n: [s["indexes"].get(n, {}).get("bytes", 0) / 1024 for s in samples]
             for n, i in samples[-1]["indexes"].items() if i["partial"] and n not in HISTORY_PARTIAL}}),
        ("dead tuples", {n: [s["tables"].get(n, {}).get("dead", 0) for s in samples] for n in samples[-1]["tables"]}),
        ("jobs/s per window; queued", {"jobs/s": [s["rate"] or float("nan") for s in samples],
                                       "queued": [s["queued"] for s in samples]}),
    ]
    warmup = summary["verdicts"]["warmup_s"] / 60
    for ax, (title, series) in zip(axes, panels, strict=True):
        for label, values in series.items():
            ax.plot(t, values, label=label, linewidth=1)
        ax.axvspan(0, warmup, color="grey", alpha=0.15)
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", ncol=3)
    axes[-1].set_xlabel("minutes (grey: warm-up, not judged)")
    fig.suptitle(f"pglane soak: {summary['jobs_done']:,} jobs, {summary['settings']['producers']} producers",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def write(samples: list[dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "samples.json").write_text(json.dumps(samples) + "\n")
    flat = [{k: v for k, v in s.items() if not isinstance(v, dict)}
            | {f"{n} {k}": v for n, t in s["tables"].items() for k, v in t.items()}
            | {f"index {n} bytes": i["bytes"] for n, i in s["indexes"].items()} for s in samples]
    with (out / "samples.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in flat for k in row)))
        writer.writeheader()
        writer.writerows(flat)
    plot(samples, summary, out / "soak.svg")


def source() -> dict[str, Any]:
    """The commit measured, and the files of pglane, sql and alembic changed from it (uncommitted work)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=procs.ROOT, capture_output=True, text=True).stdout.rstrip()

    return {"commit": git("rev-parse", "--short", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "pglane", "sql", "alembic").splitlines()}


def run(dsn: str | None, *, jobs: int, producers: int, out: Path, interval: float = 3.0, backlog: int = 1000
        ) -> dict[str, Any]:
    """The soak on ``dsn``'s database (None: an embedded server's bench_pglane); writes ``out``, returns the summary."""
    started = time.monotonic()
    if dsn:
        info = postgres_info(dsn)
        samples, judged = soak(dsn, jobs=jobs, producers=producers, out=out, interval=interval, backlog=backlog)
    else:
        with bench_server(None, use_env=False) as server:
            info = postgres_info(server.admin_dsn)
            samples, judged = soak(server.dsn("pglane"), jobs=jobs, producers=producers, out=out, interval=interval,
                                   backlog=backlog)
    summary = {"settings": {"jobs": jobs, "producers": producers, "interval": interval, "backlog": backlog,
                            "server": "dsn" if dsn else "embedded", "postgres_settings": info["settings"],
                            "cpus": info["cpus"], "source": source()},
               "postgres": info["version"].split(" on ")[0], "elapsed_s": round(time.monotonic() - started, 1),
               "jobs_done": samples[-1]["jobs_done"], "samples": len(samples), "verdicts": judged}
    write(samples, summary, out)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --only soak",
                                description="a worker through many jobs beside producers: does anything grow?")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--dsn", help="run in this database (default: an embedded server's bench_pglane)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    p.add_argument("--backlog", type=int, default=1000, help="producers pause while this many jobs are queued")
    p.add_argument("--produce", type=int, help=argparse.SUPPRESS)  # a producer process: enqueue this many
    args = p.parse_args(argv)
    if args.produce is not None:
        produce(os.environ["PGLANE_DSN"], LANE, args.produce, args.backlog)
        return 0
    summary = run(args.dsn, jobs=args.jobs, producers=args.producers, out=args.out, interval=args.interval,
                  backlog=args.backlog)
    print(report(summary))
    print(f"written: {args.out}/summary.json, samples.json, samples.csv, soak.svg")
    return 0 if summary["verdicts"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
