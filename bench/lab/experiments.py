"""``python -m bench.lab.experiments [--quick] [--dsn DSN]... [--no-embedded] [--slots N ...] [--json FILE]``:
what the server version and the gapless seq cost, measured with floors (no worker) on every server.

Not part of ``python -m bench``. Each server gets a database per variant of pglane's schema, made by
pglane.schema.upgrade and then changed here (pglane's sql/ and migrations are never touched):

- ``exp_as_is``: pglane's schema as it is;
- ``exp_no_checks``: every CHECK constraint of pglane.jobs, pglane.attempts and pglane.lane_counters
  dropped, and those of the domains their columns use: what the CHECKs cost a claim per version
  (performance.md: PostgreSQL 15 rebuilds each table's CHECK expressions on every statement);
- ``exp_seq_last``: pglane.claim_impl rewritten (from its installed text, see seq_last) so that the
  lane's counters row is bumped as the claim's last write, in a CTE of the attempt's INSERT, and the
  job's row no longer gets the seq (the attempt keeps it): the counters row lock, which serialises
  a lane's claims until their commit, is then held over the attempt's insert and the commit only.
  A schema change proposal (jobs.seq would have to go or be read from the latest attempt), measured;
- ``exp_lock_first``: pglane.claim_impl with the counters row locked (FOR UPDATE) before the job is
  looked up, as a strict lane's claim already does: a lane's claimers queue once, up front, and the
  one that holds the lock never skips rows other claims have locked; the lock is held longer.
- ``exp_no_token``: pglane without the attempt's secret (#16): claim_impl stores no token (no
  gen_random_uuid()) and complete_impl's guard no longer compares one; everything else as is. What
  "only the claimer can write an outcome" costs the claim/complete path (bound: at most 3 %).

and the bare floor's database (bench_floor, bench.floors) for:

- ``floor_one_commit`` against ``floor_plpgsql``: the same two statements sent bare, and inside a
  plpgsql function: what plpgsql itself costs per version;
- ``floor_seq`` against ``floor_seq_flush``: the gapless seq under the counters row lock, its commit
  waited for as usual, and the same claim committed without waiting for its WAL flush (the row lock
  then goes at once) followed by a durable commit of its own before the job runs (bench.floors
  ._drain_seq_flush): whether not holding the seq's lock across the flush lifts the several-slot
  ceiling.

Every variant runs as N standing floor processes (bench.throughput.FloorPool) for each slot count,
in interleaved repetitions; the report gives each variant's jobs/s and the ratios that answer the
questions, with bootstrap intervals over the repetitions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pglane import client, schema

from .. import floors
from ..procs import RESULTS
from ..server import bench_server, postgres_info
from ..stats import Sizes, median_interval, progress, progress_done, rotations, summary
from ..throughput import FloorGroup, FloorPool, Group, floor_lane

VARIANTS = ("exp_as_is", "exp_no_checks", "exp_seq_last", "exp_lock_first", "exp_no_token")
BARE = ("floor_one_commit", "floor_plpgsql", "floor_seq", "floor_seq_flush")
# (name, numerator, denominator): numerator/denominator, within each repetition, at each slot count
QUESTIONS = (
    ("CHECKs: contract without/with", "exp_no_checks", "exp_as_is"),
    ("seq bumped last: contract seq_last/as is", "exp_seq_last", "exp_as_is"),
    ("counters locked first: contract lock_first/as is", "exp_lock_first", "exp_as_is"),
    ("secret: contract as is/no token", "exp_as_is", "exp_no_token"),
    ("plpgsql: plpgsql/bare", "floor_plpgsql", "floor_one_commit"),
    ("contract/bare one commit", "exp_as_is", "floor_one_commit"),
    ("seq: seq/bare", "floor_seq", "floor_one_commit"),
    ("seq lock released before the flush: seq_flush/seq", "floor_seq_flush", "floor_seq"),
)

CHECKS = """
SELECT format('ALTER TABLE %s DROP CONSTRAINT %I', c.conrelid::regclass, c.conname)
  FROM pg_constraint c
 WHERE c.contype = 'c' AND c.conrelid IN ('pglane.jobs'::regclass, 'pglane.attempts'::regclass,
                                          'pglane.lane_counters'::regclass)
UNION ALL
SELECT DISTINCT format('ALTER DOMAIN %s DROP CONSTRAINT %I', c.contypid::regtype, c.conname)
  FROM pg_constraint c JOIN pg_attribute a ON a.atttypid = c.contypid
 WHERE c.contype = 'c' AND a.attrelid IN ('pglane.jobs'::regclass, 'pglane.attempts'::regclass,
                                          'pglane.lane_counters'::regclass)
"""


BUMP = re.compile(r"\n(\s*)UPDATE pglane\.lane_counters c\s+SET last_seq = c\.last_seq \+ 1,(?P<set>.*?)"
                  r"\s+WHERE c\.lane_id = v_lane\.id\s+RETURNING c\.last_seq INTO r\.seq;", re.S)
INSERT = re.compile(r"(?P<head>INSERT INTO pglane\.attempts AS a\s.*?)VALUES \((?P<values>.*?)\)"
                    r"\s+RETURNING a\.id, a\.token INTO r\.attempt_id, r\.token;", re.S)


def seq_last(definition: str) -> str | None:
    """claim_impl's text with the counters bump moved into a CTE of the attempt's INSERT (the last
    write) and the job's ``seq = r.seq`` dropped; None when the text is not of the expected shape
    (claim.sql changed): the variant is then left out."""
    bump = BUMP.search(definition)
    if bump is None or ", seq = r.seq" not in definition:
        return None
    body = definition[:bump.start()] + definition[bump.end():]
    insert = INSERT.search(body)
    if insert is None or "r.seq" not in insert.group("values"):
        return None
    cte = (f"WITH bump AS (UPDATE pglane.lane_counters c SET last_seq = c.last_seq + 1,{bump.group('set')}"
           " WHERE c.lane_id = v_lane.id RETURNING c.last_seq)\n    ")
    new = (cte + insert.group("head") + "SELECT " + insert.group("values").replace("r.seq", "bump.last_seq")
           + " FROM bump RETURNING a.id, a.token, a.seq INTO r.attempt_id, r.token, r.seq;")
    return (body[:insert.start()] + new + body[insert.end():]).replace(", seq = r.seq", "", 1)


LOOKUP = "\n        SELECT j.id INTO r.job_id"


def lock_first(definition: str) -> str | None:
    """claim_impl's text with the counters row locked just before the job lookup; None if not found."""
    if definition.count(LOOKUP) != 1:
        return None
    lock = "\n        PERFORM 1 FROM pglane.lane_counters c WHERE c.lane_id = v_lane.id FOR UPDATE;"
    return definition.replace(LOOKUP, lock + LOOKUP)


TOKEN_MADE = "r.lease_expires_at, r.seq, gen_random_uuid()"
TOKEN_GUARD = ("\n       AND (a.token = p_token OR pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start,"
               " a.session_mark));")


def no_token_claim(definition: str) -> str | None:
    """claim_impl's text storing no token; None if the text is not of the expected shape."""
    return definition.replace(TOKEN_MADE, "r.lease_expires_at, r.seq, NULL", 1) if TOKEN_MADE in definition else None


def no_token_complete(definition: str) -> str | None:
    """complete_impl's text with its usual-case guard not asking for the token; None if not found."""
    return definition.replace(TOKEN_GUARD, ";", 1) if definition.count(TOKEN_GUARD) == 1 else None


Rewrite = Callable[[str], "str | None"]
# variant -> the functions it rewrites from their installed text, and how
REWRITES: dict[str, list[tuple[str, Rewrite]]] = {
    "exp_seq_last": [("pglane.claim_impl", seq_last)],
    "exp_lock_first": [("pglane.claim_impl", lock_first)],
    "exp_no_token": [("pglane.claim_impl", no_token_claim), ("pglane.complete_impl", no_token_complete)],
}


def setup(dsns: dict[str, str], slot_counts: Sequence[int]) -> dict[str, int]:
    """Every variant's schema and lanes; returns how many CHECKs each variant dropped."""
    dropped = {}
    for variant in VARIANTS:
        schema.upgrade(dsns[variant])
        with client.connect(dsns[variant]) as conn:
            for n in slot_counts:
                client.create_lane(conn, floor_lane(n), slots=n)
        with psycopg.connect(dsns[variant], autocommit=True) as conn:
            statements = [str(r[0]) for r in conn.execute(CHECKS).fetchall()] if variant == "exp_no_checks" else []
            for statement in statements:
                conn.execute(sql.SQL(statement))  # names read from the catalog, quoted by format()
            dropped[variant] = len(statements)
            for function, rewrite in REWRITES.get(variant, []):
                row = conn.execute("SELECT pg_get_functiondef(%s::regproc)", (function,)).fetchone()
                rewritten = rewrite(str(row[0])) if row else None
                if rewritten is None:
                    raise RuntimeError(f"{function} is not of the shape {variant} rewrites:"
                                       " update bench.lab.experiments")
                conn.execute(sql.SQL(rewritten))  # pglane's own function text, rewritten above
    floors.setup(dsns["floor"])
    return dropped


@contextlib.contextmanager
def pools(server: Any, slot_counts: Sequence[int], logs: Path) -> Iterator[list[Group]]:
    """A FloorPool per (variant, slot count), each group a system of the run; stopped at exit."""
    made: list[FloorPool] = []
    found: list[Group] = []
    try:
        for n in slot_counts:
            for variant in VARIANTS:
                made.append(FloorPool(n, "floor", variant))
                found.append(FloorGroup(variant, made[-1], kind="contract"))
            found += [FloorGroup(name, made[-1]) for name in BARE]
        for pool in made:
            pool.start(server, logs)
        for pool in made:
            pool.ready()
        yield found
    finally:
        for pool in made:
            for proc in pool.procs:
                if proc.stdin is not None:
                    with contextlib.suppress(OSError):
                        proc.stdin.close()
            for proc in pool.procs:
                with contextlib.suppress(Exception):
                    proc.wait(15)


def measure(dsn: str | None, sizes: Sizes, slot_counts: Sequence[int], label: str) -> dict[str, Any]:
    logs = RESULTS / "logs" / f"experiments-{label}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    block: dict[str, Any] = {"loadavg_start": os.getloadavg()}
    with bench_server(dsn, VARIANTS, use_env=False) as server:
        block["postgres"] = postgres_info(server.admin_dsn)
        progress("experiments: setting up")
        block["checks_dropped"] = setup(server.dsns, slot_counts)
        with pools(server, slot_counts, logs) as groups:
            keys = {f"{g.system}@{g.slots}": g for g in groups}
            jobs = {}
            for key, g in keys.items():
                progress(f"experiments: warm-up {key}")
                rate = g.drain(server, 200)
                jobs[key] = max(100, min(sizes.throughput_jobs, round(rate * sizes.drain_seconds)))
            runs: dict[str, list[float]] = {key: [] for key in keys}
            for rep, key in rotations(list(keys), sizes.repetitions):
                progress(f"experiments: {key} (repetition {rep + 1}/{sizes.repetitions})")
                runs[key].append(keys[key].drain(server, jobs[key]))
    progress_done()
    block["throughput_jobs_per_s"] = {key: summary(values) for key, values in runs.items()}
    answers: dict[str, Any] = {}
    for name, a, b in QUESTIONS:
        for n in slot_counts:
            ra, rb = runs.get(f"{a}@{n}"), runs.get(f"{b}@{n}")
            if ra and rb:
                per_rep = [x / y for x, y in zip(ra, rb, strict=True)]
                answers[f"{name} @{n}"] = {"value": statistics.median(per_rep),
                                           "interval_90": list(median_interval(per_rep))}
    block["ratios"] = answers
    block["loadavg_end"] = os.getloadavg()
    return block


def markdown(block: dict[str, Any]) -> str:
    lines = [f"## {block['postgres']['version'].split(' on ')[0]} (CHECKs dropped: "
             f"{block['checks_dropped'].get('exp_no_checks')}; load {block['loadavg_start'][0]:.1f} -> "
             f"{block['loadavg_end'][0]:.1f})", "", "| variant | jobs/s (median) | range |", "|---|---|---|"]
    for key, tp in block["throughput_jobs_per_s"].items():
        lines.append(f"| {key} | {tp['median']:,.0f} | {tp['min']:,.0f}-{tp['max']:,.0f} |")
    lines += ["", "| question | ratio | 90% interval |", "|---|---|---|"]
    for key, v in block["ratios"].items():
        lines.append(f"| {key} | {v['value']:.3f} | {v['interval_90'][0]:.2f}-{v['interval_90'][1]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.experiments", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dsn", action="append", default=[])
    p.add_argument("--no-embedded", action="store_true")
    p.add_argument("--slots", nargs="+", type=int, default=[1, 8])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    sizes = Sizes.choose(args.quick)
    targets: list[str | None] = ([] if args.no_embedded else [None]) + list(args.dsn)
    blocks = []
    started = time.monotonic()
    for i, dsn in enumerate(targets):
        block = measure(dsn, sizes, args.slots, "embedded" if dsn is None else f"dsn{i}")
        blocks.append(block)
        print(markdown(block))
    print(f"elapsed {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"versions": blocks}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
