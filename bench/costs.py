"""What a job costs the server, counted (#35): server instructions and WAL bytes per job of every
system's own SQL, whether a claim's cost grows with the server's connections, and what each of a
lane's features adds.

**Cost per job** (``per_job``; the ``cost`` part of every server's run, bench.runner). A fresh
cluster of the server's own binaries (bench.callgrind: a single-user backend under callgrind, exact
counts), one database per system, each drained by a procedure that sends, job after job, the
statements the system's consumer sends per job, each in a transaction of its own as an autocommit
client's:

- pglane: bench.callgrind's DRAIN (the slot, one claim, then ``complete_and_claim`` per job: the
  worker's fast path, one statement and one commit per job);
- floor_contract: the same SQL as bench.floors' contract loop sends it (``queries.CLAIM`` once, then
  ``queries.COMPLETE_AND_CLAIM``): pglane's work again, through a statement instead of a plpgsql
  expression; the two differ by that form and by the rounds' noise;
- floor_one_commit, floor_two_commits, floor_seq: bench.floors' statements on its bare table;
- floor_rows: bench.floors' floor_claim_rows on its own bare tables: the rows pglane's contract
  writes per job (the job done with its result, its attempt done, the next job claimed with the
  lane's seq, its attempt inserted) and nothing else, one commit per job;
- procrastinate: its worker's fetch and finish statements (``procrastinate_fetch_job_v2`` and
  ``procrastinate_finish_job_v1``: two transactions per job);
- pgqueuer: its QueueManager's dequeue (entrypoint limit 1, batch 1) and its completion (``log_jobs``,
  one per job: its buffer's size is the batch size): two transactions. Its worker also sends a
  second dequeue per job, which finds the entrypoint at its limit and takes nothing: not counted.

Each statement is the system's own text (bench.peers reads the peers' from their installed
releases); its placeholders become plpgsql variables of the types the server infers for them
(PREPARE), so that it is planned once and its plan cached, as a client's prepared statement is. Each
database first drains a history of 500 jobs and is analysed; then ``rounds`` rounds, each a VACUUM
of the system's tables, a warm call of 20 jobs and a counted call of JOBS, the databases' order
reversed every other round. Per system: instructions per job and WAL bytes per job (min, median and
max over the rounds), and the WAL without its full-page images (pg_waldump: the first change of a
page after a checkpoint logs the whole page; a single-user backend checkpoints when it stops, so
every counted drain writes some, in proportion to the pages it touches for the first time, which
a busy server amortises over a checkpoint interval).

**Connections** (``connections``, in the same part): a claim's instructions with the postmaster
itself under callgrind (a real backend, counted in its own process), at ``max_connections`` 100 and
at 1,000 with 500 idle sessions open; and a real backend's claim latency (no valgrind) at both,
interleaved, reported as the ratio of the p50s within each round (median and interval over the
rounds: the machine's load moves more between rounds than within one). Each configuration has its own copy of every
database, so round r of both sees the same tables. Beside head: floor_one_commit, whose one
transaction per job shows what PostgreSQL itself adds per transaction when more backends exist (its
snapshots read every backend's entry of the proc array), which head's claim and completion, one
transaction too, pays as well; and revision 0008's claim, which read the claiming session's start
from ``pg_stat_get_activity`` (a copy of every backend's status), showing what a cost that grows with
the connections looks like to the same instrument.

**Features** (``python -m bench --only features``, ``main``): instructions per job of a plain lane
and of the same lane with one feature each (a rate limit, a bound, a strict lane, groups, every job
awaited by a waiter), the feature's cost the difference within each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from pglane import client, pgbin, queries, schema

from . import callgrind, floors
from .server import with_db
from .stats import latency_ms, median_interval, progress, progress_done

JOBS = 300  # jobs per counted drain
LANE = "cc"
HISTORY = callgrind.HISTORY


# ----- a consumer's statements as a procedure ----------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One statement a consumer sends, in a transaction of its own."""

    sql: str  # as the client sends it: ``$n`` or psycopg's ``%s`` / ``%(name)s`` placeholders
    args: Sequence[str] | Mapping[str, str] = ()  # a plpgsql expression per placeholder (a literal,
    # or a column of the job's row, ``bench_row.id``)
    keeps: str | None = None  # its row is the job: kept in bench_row, this column must not be NULL
    returns: bool = True  # False: a statement without rows (no INTO)


def numbered(text: str) -> tuple[str, list[str | None]]:
    """``text`` with psycopg's placeholders as ``$n`` (a name used twice is one number), and the
    placeholders' names in number order (None for positional ones)."""
    names: list[str | None] = []

    def number(found: re.Match[str]) -> str:
        name = found.group(1)
        if name is not None and name in names:
            return f"${names.index(name) + 1}"
        names.append(name)
        return f"${len(names)}"

    if re.search(r"\$\d", text):
        return text, [None] * max(int(n) for n in re.findall(r"\$(\d+)", text))
    return re.sub(r"%\((\w+)\)s|%s", number, text), names


def param_types(conn: psycopg.Connection[Any], text: str) -> list[str]:
    """The types the server infers for the ``$n`` of ``text`` (PREPARE, in the database it runs in)."""
    conn.execute(f"PREPARE bench_infer AS {text}")
    try:
        row = conn.execute("SELECT parameter_types::text[] FROM pg_prepared_statements"
                           " WHERE name = 'bench_infer'").fetchone()
    finally:
        conn.execute("DEALLOCATE bench_infer")
    assert row is not None
    return list(row[0])


def procedure(conn: psycopg.Connection[Any], first: Sequence[Step], each: Sequence[Step], init: str = "",
              end: str = "") -> str:
    """``public.cost_drain(p_jobs)``: ``init``, the steps of ``first`` once, the steps of ``each`` for
    every job, ``end``; every step followed by a COMMIT."""
    declare = ["bench_row record;", "bench_out record;"]
    body: list[str] = [init] if init else []

    def statement(k: int, step: Step, indent: str) -> None:
        text, names = numbered(step.sql.strip().rstrip(";"))
        types = param_types(conn, text)
        args = ([step.args[name or ""] for name in names] if isinstance(step.args, Mapping)
                else list(step.args))
        assert len(args) == len(types), (step.sql, args, types)
        for n, (expr, kind) in enumerate(zip(args, types, strict=True), 1):
            if "bench_row" in expr:  # the job's: set before each statement
                declare.append(f"bench_a{k}_{n} {kind};")
                body.append(f"{indent}bench_a{k}_{n} := {expr};")
            else:
                declare.append(f"bench_a{k}_{n} {kind} := {expr};")
        text = re.sub(r"\$(\d+)", lambda m: f"bench_a{k}_{m.group(1)}", text)
        into = "" if not step.returns else "\nINTO bench_row" if step.keeps else "\nINTO bench_out"
        body.append(f"{text}{into};")
        if step.keeps:
            body.append(f"{indent}IF bench_row.{step.keeps} IS NULL THEN\n"
                        f"{indent}    RAISE EXCEPTION 'cost_drain: no job after % jobs', bench_i;\n{indent}END IF;")
        body.append(f"{indent}COMMIT;")

    for k, step in enumerate(first, 1):
        statement(k, step, "    ")
    body.append("    FOR bench_i IN 1 .. p_jobs LOOP")
    for k, step in enumerate(each, len(first) + 1):
        statement(k, step, "        ")
    body.append("    END LOOP;")
    if end:
        body.append(end)
    lines = "\n    ".join(declare)
    return ("CREATE OR REPLACE PROCEDURE public.cost_drain(p_jobs integer) LANGUAGE plpgsql AS $drain$\n"
            f"DECLARE\n    bench_i integer := 0;\n    {lines}\nBEGIN\n" + "\n".join(body) + "\nEND $drain$;")


def literal(conn: psycopg.Connection[Any], value: Any) -> str:
    return sql.Literal(value).as_string(conn)


# ----- the systems -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Consumer:
    """One system as the cost part drains it: ``setup(dsn, n)`` makes its schema in a fresh database,
    queues n jobs and installs the procedure ``drain.call`` runs; ``drain.setup`` vacuums its tables."""

    name: str
    setup: Callable[[str, int], None]
    drain: callgrind.Drain


def _vacuum(*tables: str) -> str:
    return "\n".join(f"VACUUM {t};" for t in tables)


COST_DRAIN = "CALL public.cost_drain({});"


def _at(revision: str) -> Callable[[str, int], None]:
    """pglane's schema at ``revision`` (0008: the claim read pg_stat_get_activity, a control), lane cc,
    ``n`` queued jobs and bench.callgrind's DRAIN."""
    def setup(dsn: str, n: int) -> None:
        schema.upgrade(dsn, revision)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO pglane.lanes (name) VALUES (%s)", (LANE,))  # either revision takes it
            conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, '{}' FROM generate_series(1, %s)",
                         (LANE, n))
            conn.execute(callgrind.DRAIN)
    return setup


def _contract(dsn: str, n: int) -> None:
    _at("head")(dsn, n)
    with psycopg.connect(dsn, autocommit=True) as conn:
        lane, worker = literal(conn, LANE), literal(conn, "floor")
        row = conn.execute("SELECT id FROM pglane.lanes WHERE name = %s", (LANE,)).fetchone()
        assert row is not None
        first = [Step(queries.WAIT_SLOT, (str(row[0]), "1")),
                 Step(queries.CLAIM, (lane, worker), keeps="job_id")]
        each = [Step(queries.COMPLETE_AND_CLAIM, ("bench_row.attempt_id", "'null'", lane, worker, "bench_row.token"),
                     keeps="job_id")]
        conn.execute(procedure(conn, first, each, end="    PERFORM pg_advisory_unlock_all();"))


def _floor(each: Callable[[], list[Step]], preload: Callable[[str, int], None] = floors.preload,
           kept: Sequence[str] = ("id",)) -> Callable[[str, int], None]:
    """A floor of bench.floors: its schema, ``n`` jobs queued by ``preload``, and a procedure whose
    first step finds the columns ``kept`` of bench_row NULL (no previous job)."""
    def setup(dsn: str, n: int) -> None:
        floors.setup(dsn)
        preload(dsn, n)
        nulls = ", ".join(f"NULL::bigint AS {column}" for column in kept)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(procedure(conn, [], each(), init=f"    SELECT {nulls} INTO bench_row;"))
    return setup


def _procrastinate(dsn: str, n: int) -> None:
    from .peers import Procrastinate, procrastinate_job_sql

    system = Procrastinate()
    system.setup(dsn)
    system.bulk_enqueue(dsn, n)
    fetch, finish = procrastinate_job_sql()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT * FROM procrastinate_register_worker_v1()").fetchone()  # as its worker, once
        assert row is not None
        each = [Step(fetch, {"queues": "NULL", "worker_id": str(row[0])}, keeps="id"),
                Step(finish, {"job_id": "bench_row.id", "status": "'succeeded'", "delete_job": "false"})]
        conn.execute(procedure(conn, [], each))


SENTINEL = 987_654_321  # the job id handed to pgqueuer's completion, found again in its arguments


def _pgqueuer(dsn: str, n: int) -> None:
    from .peers import Pgqueuer, pgqueuer_job_sql

    system = Pgqueuer()
    system.setup(dsn)
    system.bulk_enqueue(dsn, n)
    (dequeue, dequeue_args), (complete, complete_args) = pgqueuer_job_sql(uuid.uuid4(), SENTINEL)
    with psycopg.connect(dsn, autocommit=True) as conn:
        each = [Step(dequeue, [literal(conn, a) for a in dequeue_args], keeps="id"),
                Step(complete, ["ARRAY[bench_row.id]" if a == [SENTINEL] else literal(conn, a) for a in complete_args],
                     returns=False)]
        conn.execute(procedure(conn, [], each))


def consumer(name: str) -> Consumer:
    [found] = [c for c in consumers() if c.name == name]
    return found


def consumers() -> list[Consumer]:
    floor_tables = _vacuum("floor_jobs", "floor_counters")
    prev = {"prev": "bench_row.id"}
    rows = {"prev": "bench_row.id", "prev_attempt": "bench_row.attempt_id", "result": "'null'", "worker": "'floor'"}
    return [
        Consumer("pglane", _at("head"), callgrind.Drain(f"CALL public.callgrind_drain('{LANE}', {{}});")),
        Consumer("floor_contract", _contract, callgrind.Drain(COST_DRAIN)),
        Consumer("floor_one_commit", _floor(lambda: [Step(floors.COMPLETE_AND_CLAIM, prev, keeps="id")]),
                 callgrind.Drain(COST_DRAIN, floor_tables)),
        Consumer("floor_two_commits", _floor(lambda: [Step(floors.CLAIM, keeps="id"),
                                                      Step(floors.COMPLETE, prev, returns=False)]),
                 callgrind.Drain(COST_DRAIN, floor_tables)),
        Consumer("floor_seq", _floor(lambda: [Step(floors.COMPLETE_AND_CLAIM_SEQ, prev, keeps="id")]),
                 callgrind.Drain(COST_DRAIN, floor_tables)),
        Consumer("floor_rows", _floor(lambda: [Step(floors.COMPLETE_AND_CLAIM_ROWS, rows, keeps="id")],
                                      floors.preload_rows, ("id", "attempt_id")),
                 callgrind.Drain(COST_DRAIN, _vacuum("floor_rows_jobs", "floor_rows_attempts", "floor_rows_counters"))),
        Consumer("procrastinate", _procrastinate,
                 callgrind.Drain(COST_DRAIN, _vacuum("procrastinate_jobs", "procrastinate_events"))),
        Consumer("pgqueuer", _pgqueuer, callgrind.Drain(COST_DRAIN, _vacuum("pgqueuer", "pgqueuer_log"))),
    ]


def spread(values: Sequence[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}


def _with_history(setup: Callable[[str, int], None], drain: callgrind.Drain) -> Callable[[str, int], None]:
    """``setup``, then a drain of HISTORY jobs and the planner's statistics (bench.callgrind: analysed
    empty, the job tables would be planned as empty)."""
    def ready(dsn: str, n: int) -> None:
        setup(dsn, n)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(drain.call.format(HISTORY).rstrip(";").encode())
            conn.execute("VACUUM ANALYZE")
    return ready


def per_job(bindir: Path, rounds: int, jobs: int = JOBS, systems: Sequence[Consumer] | None = None
            ) -> dict[str, dict[str, Any]]:
    """Every system's instructions and WAL bytes per job (see the module doc), on the binaries in ``bindir``."""
    chosen = list(systems or consumers())
    with callgrind.cluster(bindir) as found:
        with found.running() as admin:
            for system in chosen:
                progress(f"cost per job: setting up {system.name}")
                db = f"cost_{system.name}"
                with psycopg.connect(admin, autocommit=True) as conn:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db)))
                _with_history(system.setup, system.drain)(with_db(admin, db), HISTORY + (jobs + 40) * (rounds + 1))
        counted = callgrind.counted_rounds(found, {f"cost_{s.name}": s.drain for s in chosen}, jobs, rounds,
                                           "cost per job")
    progress_done()
    out: dict[str, dict[str, Any]] = {}
    for system in chosen:
        runs = counted[f"cost_{system.name}"]
        out[system.name] = {
            "instructions_per_job": spread([c.instructions / jobs for c in runs]),
            "wal_bytes_per_job": spread([c.wal_bytes / jobs for c in runs]),
            "wal_bytes_per_job_no_fpi": spread([(c.wal_bytes - c.wal_fpi_bytes) / jobs for c in runs]),
            "jobs_per_round": jobs,
        }
    return out


def counted(admin_dsn: str, rounds: int) -> dict[str, Any]:
    """The counted figures of the cost part for the server at ``admin_dsn``, on its own binaries:
    ``per_job`` (per system) and ``connections``; or ``skipped`` and why (no valgrind, no binaries)."""
    missing = callgrind.available()
    if missing:
        return {"skipped": missing}
    bindir, why = bindir_of(admin_dsn)
    if bindir is None:
        return {"skipped": why}
    return {"postgres": version(bindir), "bindir": str(bindir), "per_job": per_job(bindir, rounds),
            "connections": connections(bindir, rounds)}


# ----- connections -------------------------------------------------------------------------------

IDLE = 500  # idle sessions open beside the measured one at max_connections 1,000 (none at 100)
PORT = 5432  # names the socket file in the cluster's own directory


@contextlib.contextmanager
def postmaster(found: callgrind.Cluster, max_connections: int, counted: Path | None = None) -> Iterator[str]:
    """The cluster's postmaster, started by hand with ``max_connections`` (under callgrind when
    ``counted`` names its output files: every backend it forks is counted in a file of its own, only
    inside CALL, one part per CALL); its admin DSN. Stopped (fast) at exit."""
    with callgrind.binaries(found.bindir) as bindir:
        command = [*pgbin.root_prefix()]
        if counted is not None:
            command += [shutil.which("valgrind") or "valgrind", "--tool=callgrind", "--collect-atstart=no",
                        "--toggle-collect=ExecuteCallStmt", "--dump-after=ExecuteCallStmt",
                        f"--callgrind-out-file={counted}.%p"]
        command += [str(bindir / "postgres"), "-D", str(found.data), "-c", f"max_connections={max_connections}",
                    "-c", "listen_addresses=", "-c", f"unix_socket_directories={found.root}", "-c", f"port={PORT}",
                    "-c", "autovacuum=off"]
    dsn = f"host={found.root} port={PORT} user=postgres dbname=postgres"
    with open(found.root / "postmaster.log", "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                psycopg.connect(dsn, connect_timeout=5).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the postmaster did not start (exit {proc.returncode}): see "
                                       f"{found.root / 'postmaster.log'}") from None
                time.sleep(0.5)
        yield dsn
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def idle_sessions(dsn: str, count: int) -> Iterator[list[psycopg.Connection[Any]]]:
    """``count`` sessions open and idle (opened by 4 threads: under callgrind each backend's start-up
    takes a third of a second)."""
    opened: list[psycopg.Connection[Any]] = []
    lock = threading.Lock()

    def open_some(n: int) -> None:
        for _ in range(n):
            conn = psycopg.connect(dsn, autocommit=True)
            with lock:
                opened.append(conn)

    threads = [threading.Thread(target=open_some, args=(count // 4 + (i < count % 4),)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(opened) != count:
            raise RuntimeError(f"{len(opened)} of {count} idle sessions opened")
        yield opened
    finally:
        for conn in opened:
            conn.close()


def _counted_drain(dsn: str, db: str, drain: callgrind.Drain, jobs: int, out: Path) -> float:
    """Instructions per job of one warm counted drain of ``jobs`` jobs by a new session of ``db`` (a
    process of its own, counted in its own file ``out``.<pid>.2): as bench.callgrind counts, in a
    real backend."""
    with psycopg.connect(with_db(dsn, db), autocommit=True) as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert row is not None
        for statement in filter(None, drain.setup.splitlines()):
            conn.execute(statement.encode())
        conn.execute(drain.call.format(20).encode())
        conn.execute(drain.call.format(jobs).encode())
    return callgrind.total(Path(f"{out}.{row[0]}.2")) / jobs


def _claim_latency(dsn: str, db: str, claims: int) -> list[float]:
    """Seconds of ``claims`` claims (pglane.claim's round trip and commit) by a session holding slot 1,
    each followed, untimed, by its completion; 20 untimed first."""
    from .pglane_runs import claim_and_complete, lane_id

    with psycopg.connect(with_db(dsn, db), autocommit=True, row_factory=dict_row) as conn:
        conn.execute(queries.WAIT_SLOT, (lane_id(conn, LANE), 1))
        for _ in range(20):
            claim_and_complete(conn, LANE)
        return [claim_and_complete(conn, LANE) for _ in range(claims)]


def connections(bindir: Path, rounds: int, jobs: int = JOBS, claims: int = 500, idle: int = IDLE) -> dict[str, Any]:
    """A claim's server instructions (a real backend under callgrind) and a real backend's claim
    latency at max_connections 100 and at 1,000 with ``idle`` idle sessions (see the module doc):
    head's claim and completion, 0008's, and floor_one_commit's one transaction per job, which says
    what PostgreSQL itself adds per transaction."""
    configs = {100: 0, 1000: idle}  # max_connections: idle sessions open beside the measured one
    floor = consumer("floor_one_commit")
    systems = {"head": (_at("head"), callgrind.Drain()), "0008": (_at("0008"), callgrind.Drain()),
               "floor_one_commit": (floor.setup, floor.drain)}
    with callgrind.cluster(bindir) as found:
        with found.running() as admin:
            progress("connections: setting up")
            with psycopg.connect(admin, autocommit=True) as conn:
                for name in (*systems, "latency"):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(f"conn_{name}")))
            for name, (setup, drain) in systems.items():
                _with_history(setup, drain)(with_db(admin, f"conn_{name}"), HISTORY + (jobs + 40) * rounds + 100)
            _with_history(_at("head"), callgrind.Drain())(with_db(admin, "conn_latency"),
                                                          HISTORY + (claims + 40) * rounds * len(configs) + 100)
            with psycopg.connect(admin, autocommit=True) as conn:
                for name in systems:  # a copy per configuration: round r of each sees the same tables
                    for n in configs:
                        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                            sql.Identifier(f"conn_{name}_{n}"), sql.Identifier(f"conn_{name}")))
        counts: dict[str, dict[int, list[float]]] = {name: {n: [] for n in configs} for name in systems}
        for n, others in configs.items():
            out = found.root / f"conn{n}"
            with postmaster(found, n, out) as dsn:
                progress(f"connections: max_connections {n}, opening {others} idle sessions under callgrind")
                with idle_sessions(dsn, others):
                    for r in range(rounds):
                        for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                            value = _counted_drain(dsn, f"conn_{name}_{n}", systems[name][1], jobs, out)
                            counts[name][n].append(value)
                            progress(f"connections round {r + 1}/{rounds}: {name} at {n}: {value:,.0f}/job")
        times: dict[int, list[list[float]]] = {n: [] for n in configs}  # per round
        for r in range(rounds):
            for n, others in (list(configs.items()) if r % 2 == 0 else list(configs.items())[::-1]):
                progress(f"connections: claim latency round {r + 1}/{rounds}, max_connections {n}")
                with postmaster(found, n) as dsn, idle_sessions(dsn, others):
                    times[n].append(_claim_latency(dsn, "conn_latency", claims))
    progress_done()
    low, high = sorted(configs)
    doc: dict[str, Any] = {"jobs_per_round": jobs, "rounds": rounds, "claims_per_round": claims,
                           "idle_sessions": {str(n): k for n, k in configs.items()},
                           "instructions_per_job": {}, "instructions_ratio": {}, "instructions_added": {}}
    for name, found_counts in counts.items():
        doc["instructions_per_job"][name] = {str(n): spread(v) for n, v in found_counts.items()}
        ratios = [a / b for a, b in zip(found_counts[high], found_counts[low], strict=True)]
        doc["instructions_ratio"][name] = {**spread(ratios), "interval_90": list(median_interval(ratios))}
        doc["instructions_added"][name] = spread([a - b for a, b in zip(found_counts[high], found_counts[low],
                                                                           strict=True)])
    # what head's SQL adds that grows, beyond what one transaction of the bare floor gains: per round
    beyond = [1 + ((h1 - h0) - (f1 - f0)) / h0 for h1, h0, f1, f0 in zip(
        counts["head"][high], counts["head"][low], counts["floor_one_commit"][high], counts["floor_one_commit"][low],
        strict=True)]
    doc["beyond_floor_ratio"] = {**spread(beyond), "interval_90": list(median_interval(beyond))}
    doc["claim_latency"] = {str(n): latency_ms([t for found_round in t_rounds for t in found_round])
                            for n, t_rounds in times.items()}
    # the machine's load moves between rounds more than within one: the p50s' ratio within each round
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(times[high], times[low], strict=True)]
    doc["claim_p50_ratio"] = {**spread(ratios), "value": statistics.median(ratios),
                              "interval_90": list(median_interval(ratios))}
    return doc


# ----- features ----------------------------------------------------------------------------------

GROUPS = 100  # the groups lane's jobs, spread over this many groups
# feature: (create_lane's options, what it is)
FEATURES: dict[str, tuple[dict[str, Any], str]] = {
    "plain": ({}, "a plain lane: one slot, no feature"),
    "rate": ({"rate": "1000000/min"}, "a rate limit that never refuses (every start recorded)"),
    "bound": ({"max_queued": 1_000_000}, "a bound, max_queued 1,000,000 (never full)"),
    "strict": ({"takeover": "after_lease"}, "a strict lane (takeover after_lease)"),
    "groups": ({"group_slots": 1}, f"groups: group_slots 1, the jobs in {GROUPS} groups"),
    "waiters": ({}, "waiters: every job awaited (pglane.wait's mark), its completion notifies"),
}
AWAIT_ALL = "UPDATE pglane.jobs SET awaited = true WHERE status = 'queued'"  # as await_job marks a job


def features(rounds: int, jobs: int = JOBS, bindir: Path | None = None) -> dict[str, Any]:
    """Instructions per job of a plain lane and of one lane per feature (FEATURES), and what each adds
    (its count less plain's, within each round), bench.callgrind's interleaved drains."""
    def lane(options: dict[str, Any]) -> Callable[[str], None]:
        def setup(dsn: str) -> None:
            schema.upgrade(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                client.create_lane(conn, LANE, job_timeout=60, **options)
        return setup

    counts = callgrind.interleaved_drains({f"feature_{k}": lane(o) for k, (o, _) in FEATURES.items()}, jobs, rounds,
                                          groups={"feature_groups": GROUPS}, finish=True, bindir=bindir,
                                          after_load={"feature_waiters": AWAIT_ALL})
    plain = counts["feature_plain"]
    out: dict[str, Any] = {"jobs_per_round": jobs, "rounds": rounds, "features": {}}
    for name, (_, about) in FEATURES.items():
        runs = counts[f"feature_{name}"]
        out["features"][name] = {"about": about, "instructions_per_job": spread(runs),
                                 "added": spread([a - b for a, b in zip(runs, plain, strict=True)]),
                                 "ratio": spread([a / b for a, b in zip(runs, plain, strict=True)])}
    return out


def features_markdown(found: dict[str, Any]) -> str:
    rows = []
    for name, f in found["features"].items():
        ipj, added = f["instructions_per_job"], f["added"]
        rows.append(f"| {f['about']} | {ipj['median']:,.0f} ({ipj['min']:,.0f}-{ipj['max']:,.0f}) | "
                    + ("-" if name == "plain" else
                       f"{added['median']:+,.0f} ({added['min']:+,.0f} to {added['max']:+,.0f}), "
                       f"{f['ratio']['median']:.3f}x") + " |")
    return ("| lane | instructions per job, median (min-max) | added to plain, median (min to max), ratio |\n"
            "|---|---|---|\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench --only features [--rounds R] [--jobs N] [--bindir DIR] [--json FILE]``."""
    p = argparse.ArgumentParser(prog="python -m bench --only features",
                                description="server instructions per job of a plain lane and what each feature"
                                            " adds (callgrind, a single-user backend)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--jobs", type=int, default=JOBS, help=f"jobs per counted drain (default {JOBS})")
    p.add_argument("--bindir", type=Path, help="PostgreSQL's bin directory (default: the embedded server's)")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    missing = callgrind.available()
    if missing:
        print(f"python -m bench --only features: skipped: {missing}", file=sys.stderr)
        return 2
    found = features(args.rounds, args.jobs, args.bindir)
    found["postgres"] = version(args.bindir or pgbin.find_bindir())
    print(f"{found['postgres']}, {args.rounds} rounds of {args.jobs} jobs\n\n" + features_markdown(found))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2) + "\n")
    return 0


def bindir_of(admin_dsn: str) -> tuple[Path | None, str]:
    """The binaries of the server at ``admin_dsn`` on this machine, or None and why not: the
    installation ``python -m bench.server start`` wrote into its data directory, else the system's
    (/usr/lib/postgresql/MAJOR/bin), else pglane.pgbin's choice (the embedded server's), the first
    whose major version is the server's."""
    from .server import BINDIR_FILE

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('server_version_num')::integer / 10000,"
                           " current_setting('data_directory', true)").fetchone()
    assert row is not None
    major, data = int(row[0]), row[1]
    candidates = []
    with contextlib.suppress(OSError, TypeError):
        candidates.append(Path((Path(data) / BINDIR_FILE).read_text().strip()))
    candidates.append(Path(f"/usr/lib/postgresql/{major}/bin"))
    with contextlib.suppress(Exception):
        candidates.append(pgbin.find_bindir())
    for bindir in candidates:
        if (bindir / "postgres").is_file() and version(bindir).split(" ")[-1].split(".")[0] == str(major):
            return bindir, ""
    return None, f"no PostgreSQL {major} server binaries on this machine (looked in {', '.join(map(str, candidates))})"


def version(bindir: Path) -> str:
    """``postgres --version`` of the binaries in ``bindir``: "PostgreSQL 18.6"."""
    done = subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True, timeout=60)
    found = re.search(r"\(PostgreSQL\) (\S+)", done.stdout)
    return f"PostgreSQL {found.group(1)}" if found else done.stdout.strip()


if __name__ == "__main__":
    raise SystemExit(main())
