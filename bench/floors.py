"""The floors: hand-written psycopg loops that show what one consumer could reach at all.

floor_two_commits: claim job N (commit), complete it (commit): two round trips, two commits per job.
floor_one_commit:  one statement completes job N and claims job N+1: one round trip, one commit.
  Both run on a bare table (bench_floor.floor_jobs) with one partial queue index.
floor_seq:         floor_one_commit plus the lane's gapless seq (a counters row bumped under its lock).
floor_rows:        floor_seq plus every other row pglane's contract writes per job, and nothing else
  (bench.costs counts it): job N done with its result and its attempt row done, job N+1's attempt
  row inserted (with the attempts' primary key, their unique (job_id, attempt_number), their
  partial index of running attempts and their foreign key to the job), in bare tables
  (floor_rows_jobs, floor_rows_attempts, floor_rows_counters) without CHECKs, triggers or guards.
  Counted per job (bench.costs) and drained at several slots (bench.throughput): what the contract's
  rows allow, whatever pglane's SQL does beside them.
floor_contract:    pglane's own SQL on pglane's schema, no worker: take the slot lock, pglane.claim once,
  then pglane.complete_and_claim per job. What the worker could reach if Python cost nothing.
floor_listen:      a bare LISTEN consumer process (``python -m bench.floors listen DSN``): wait for a
  NOTIFY, then drain with the one-commit statement; its handler stamps the start of each job.
floor_listen_contract: the same bare loop on pglane's schema and SQL (``... listen-contract DSN``):
  holding the slot lock, pglane.claim on a wake-up, pglane.complete_and_claim while jobs remain. The
  wake-latency twin of floor_contract: between it and floor_listen is what pglane's claim costs over a
  single UPDATE; between it and pglane is what the worker's Python costs.

Every throughput loop starts with N preloaded jobs, a connected session and (floor_contract) the slot
lock held, and stops when the call that completes the last job returns.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pglane import queries

from . import procs
from .pglane_runs import FLOOR_LANE, LANE, Pglane, lane_id, load_queued, truncate
from .real import Put, RealSystem, measure_cost, per_job, sql_producer
from .server import BenchServer

SCHEMA = """
CREATE TABLE floor_jobs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payload     jsonb       NOT NULL DEFAULT '{}',
    status      text        NOT NULL DEFAULT 'queued',
    created_at  timestamptz NOT NULL DEFAULT now(),
    started_at  timestamptz,
    finished_at timestamptz
);
CREATE INDEX floor_jobs_queue ON floor_jobs (id) WHERE status = 'queued';
ALTER TABLE floor_jobs ADD COLUMN seq bigint;
-- floor_seq's gapless claim sequence: a narrow side table, as pglane.lane_counters is
CREATE TABLE floor_counters (lane integer PRIMARY KEY, last_seq bigint NOT NULL DEFAULT 0);
INSERT INTO floor_counters (lane) VALUES (1);
CREATE FUNCTION floor_claim_seq(p_prev bigint) RETURNS TABLE (id bigint, payload jsonb) LANGUAGE plpgsql AS $$
DECLARE
    v_id  bigint;
    v_seq bigint;
BEGIN
    IF p_prev IS NOT NULL THEN
        UPDATE floor_jobs j SET status = 'done', finished_at = now() WHERE j.id = p_prev;
    END IF;
    SELECT j.id INTO v_id FROM floor_jobs j WHERE j.status = 'queued' ORDER BY j.id LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE floor_counters c SET last_seq = c.last_seq + 1 WHERE c.lane = 1 RETURNING c.last_seq INTO v_seq;
    RETURN QUERY UPDATE floor_jobs j SET status = 'running', started_at = now(), seq = v_seq WHERE j.id = v_id
                 RETURNING j.id, j.payload;
END $$;
-- floor_rows: the rows pglane's contract writes per job and nothing else (no CHECK, no trigger, no
-- guard, no generated column): the jobs' columns the contract names, the attempts' with the indexes
-- it needs (primary key, one attempt number per job, the running attempts) and their foreign key to
-- the job; the lane's gapless seq in a counters row of its own, as floor_seq's. Both tables at
-- pglane's fillfactor 90, and the queue index keyed, as pglane's is (on in_queue), on what the claim
-- changes and the completion does not (here started_at, set by the claim): a completion changes no
-- indexed column and may be a HOT update. Keyed on status, as floor_seq's, every completion would
-- write an index entry that pglane's does not (bench README, #35).
CREATE TABLE floor_rows_jobs (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payload     jsonb       NOT NULL DEFAULT '{}',
    status      text        NOT NULL DEFAULT 'queued',
    created_at  timestamptz NOT NULL DEFAULT now(),
    started_at  timestamptz,
    finished_at timestamptz,
    attempts    integer     NOT NULL DEFAULT 0,
    result      jsonb,
    seq         bigint
) WITH (fillfactor = 90);
CREATE INDEX floor_rows_jobs_queue ON floor_rows_jobs (id) WHERE started_at IS NULL;
CREATE TABLE floor_rows_attempts (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id           bigint      NOT NULL REFERENCES floor_rows_jobs (id),
    attempt_number   integer     NOT NULL,
    status           text        NOT NULL DEFAULT 'running',
    worker           text        NOT NULL,
    backend_pid      integer     NOT NULL,
    started_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    lease_expires_at timestamptz NOT NULL,
    seq              bigint      NOT NULL,
    token            uuid        NOT NULL,
    UNIQUE (job_id, attempt_number)
) WITH (fillfactor = 90);
CREATE INDEX floor_rows_attempts_running ON floor_rows_attempts (job_id) WHERE status = 'running';
CREATE TABLE floor_rows_counters (lane integer PRIMARY KEY, last_seq bigint NOT NULL DEFAULT 0);
INSERT INTO floor_rows_counters (lane) VALUES (1);
CREATE FUNCTION floor_claim_rows(p_prev bigint, p_prev_attempt bigint, p_result jsonb, p_worker text)
RETURNS TABLE (id bigint, attempt_id bigint, payload jsonb, token uuid) LANGUAGE plpgsql AS $$
DECLARE
    v_id      bigint;
    v_seq     bigint;
    v_number  integer;
    v_payload jsonb;
    v_attempt bigint;
    v_token   uuid := gen_random_uuid();
BEGIN
    IF p_prev IS NOT NULL THEN
        UPDATE floor_rows_jobs j SET status = 'done', finished_at = now(), result = p_result WHERE j.id = p_prev;
        UPDATE floor_rows_attempts a SET status = 'done', finished_at = now() WHERE a.id = p_prev_attempt;
    END IF;
    SELECT j.id INTO v_id FROM floor_rows_jobs j WHERE j.started_at IS NULL ORDER BY j.id LIMIT 1
        FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    UPDATE floor_rows_counters c SET last_seq = c.last_seq + 1 WHERE c.lane = 1 RETURNING c.last_seq INTO v_seq;
    UPDATE floor_rows_jobs j SET status = 'running', started_at = now(), attempts = j.attempts + 1, seq = v_seq
        WHERE j.id = v_id RETURNING j.attempts, j.payload INTO v_number, v_payload;
    INSERT INTO floor_rows_attempts AS a (job_id, attempt_number, status, worker, backend_pid, started_at,
                                          lease_expires_at, seq, token)
        VALUES (v_id, v_number, 'running', p_worker, pg_backend_pid(), now(), now() + interval '60 seconds',
                v_seq, v_token)
        RETURNING a.id INTO v_attempt;
    RETURN QUERY SELECT v_id, v_attempt, v_payload, v_token;
END $$;
-- floor_one_commit's two statements in a plpgsql function: what plpgsql itself costs (bench.lab.experiments)
CREATE FUNCTION floor_claim_plpgsql(p_prev bigint) RETURNS TABLE (id bigint, payload jsonb) LANGUAGE plpgsql AS $$
DECLARE
    v_id bigint;
BEGIN
    IF p_prev IS NOT NULL THEN
        UPDATE floor_jobs j SET status = 'done', finished_at = now() WHERE j.id = p_prev;
    END IF;
    SELECT j.id INTO v_id FROM floor_jobs j WHERE j.status = 'queued' ORDER BY j.id LIMIT 1 FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY UPDATE floor_jobs j SET status = 'running', started_at = now() WHERE j.id = v_id
                 RETURNING j.id, j.payload;
END $$;
CREATE FUNCTION floor_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('floor_wake', '');
    RETURN NULL;
END $$;
CREATE TRIGGER floor_wake AFTER INSERT ON floor_jobs FOR EACH STATEMENT EXECUTE FUNCTION floor_wake();
"""

CLAIM = ("UPDATE floor_jobs SET status = 'running', started_at = now()"
         " WHERE id = (SELECT id FROM floor_jobs WHERE status = 'queued' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
         " RETURNING id, payload")
COMPLETE = "UPDATE floor_jobs SET status = 'done', finished_at = now() WHERE id = %(prev)s"
COMPLETE_AND_CLAIM = f"WITH done AS ({COMPLETE}) {CLAIM}"
# floor_one_commit plus the guarantee that serialises a lane's claims: the lane's gapless seq, bumped
# under the counters row lock in the claiming transaction (held until its commit), after the job is
# picked, as pglane.claim does (a claim that rolls back rolls its bump back: no gap). A plpgsql
# function as pglane's claim is (one statement of data-modifying CTEs deadlocked between two claimers).
COMPLETE_AND_CLAIM_SEQ = "SELECT * FROM floor_claim_seq(%(prev)s)"
COMPLETE_AND_CLAIM_PLPGSQL = "SELECT * FROM floor_claim_plpgsql(%(prev)s)"
# floor_seq plus the contract's other rows: job N's result and attempt row done, job N+1's attempt
# row inserted (its id and token returned, as pglane's claim returns them); one commit per job
COMPLETE_AND_CLAIM_ROWS = "SELECT * FROM floor_claim_rows(%(prev)s, %(prev_attempt)s, %(result)s, %(worker)s)"
MAX_SECONDS = 300.0


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)


def handler(payload: Any) -> None:
    """The no-op job."""


def preload(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE floor_jobs")
        conn.execute("INSERT INTO floor_jobs (payload) SELECT jsonb_build_object('n', g)"
                     " FROM generate_series(0, %s - 1) g", (n,))


def preload_rows(dsn: str, n: int) -> None:
    """floor_rows' tables emptied and n jobs queued."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE floor_rows_attempts, floor_rows_jobs")
        conn.execute("INSERT INTO floor_rows_jobs (payload) SELECT jsonb_build_object('n', g)"
                     " FROM generate_series(0, %s - 1) g", (n,))


def _bounded(n: int) -> range:
    return range(n + 2)  # every loop ends after the last job; the bound only catches a runaway


def two_commits(dsn: str, n: int) -> float:
    """Seconds to drain n preloaded jobs, claim and complete in two commits."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        for _ in _bounded(n):
            row = conn.execute(CLAIM).fetchone()
            if row is None:
                break
            handler(row[1])
            conn.execute(COMPLETE, {"prev": row[0]})
        return time.perf_counter() - t0


def one_commit(dsn: str, n: int) -> float:
    """Seconds to drain n preloaded jobs, completing job N in the statement that claims job N+1."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        t0 = time.perf_counter()
        prev: int | None = None
        for _ in _bounded(n):
            row = conn.execute(COMPLETE_AND_CLAIM, {"prev": prev}).fetchone()
            if row is None:
                break
            handler(row[1])
            prev = row[0]
        return time.perf_counter() - t0


def contract_preload(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        truncate(conn)
        load_queued(conn, FLOOR_LANE, n)


def contract(dsn: str, n: int) -> float:
    """Seconds to drain n preloaded jobs through pglane.claim + pglane.complete_and_claim."""
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        return contract_drain(conn, n)


def contract_drain(conn: psycopg.Connection[dict[str, Any]], n: int) -> float:
    """contract's loop on a connection of the caller's: slot 1 of the floor lane is taken before the
    clock starts and released after it stops."""
    lid = lane_id(conn, FLOOR_LANE)
    conn.execute(queries.WAIT_SLOT, (lid, 1))
    t0 = time.perf_counter()
    row = conn.execute(queries.CLAIM, (FLOOR_LANE, "floor")).fetchone()
    for _ in _bounded(n):
        if row is None or row["job_id"] is None:
            break
        handler(row["payload"])
        row = conn.execute(queries.COMPLETE_AND_CLAIM, (row["attempt_id"], "null", FLOOR_LANE, "floor",
                                                        row["token"])).fetchone()
    elapsed = time.perf_counter() - t0
    conn.execute(queries.RELEASE_SLOT, (lid, 1))
    return elapsed


Loop = Callable[[str, int], float]
LOOPS: dict[str, tuple[Loop, Callable[[str, int], None], str]] = {  # name: (loop, preload, database)
    "floor_two_commits": (two_commits, preload, "floor"),
    "floor_one_commit": (one_commit, preload, "floor"),
    "floor_contract": (contract, contract_preload, "pglane"),
}


def throughput(server: BenchServer, name: str, n: int) -> float:
    loop, load, db = LOOPS[name]
    load(server.dsn(db), n)
    return n / loop(server.dsn(db), n)


def cost(server: BenchServer, name: str, n: int) -> dict[str, Any]:
    """Cost per job of one floor loop: a drain of n jobs minus a drain of none (see bench.real)."""
    loop, load, db = LOOPS[name]
    dsn = server.dsn(db)

    def run(count: int) -> Callable[[], int]:
        return lambda: (loop(dsn, count), 0)[1]

    load(dsn, 0)
    empty = measure_cost(server, f"bench_{db}", run(0))
    load(dsn, n)
    loaded = measure_cost(server, f"bench_{db}", run(n))
    return per_job(loaded, empty, n, server.statements)


class FloorListen(RealSystem):
    """The wake-latency floor as a consumer process."""

    name = "floor_listen"
    db = "floor"
    remaining_sql = "SELECT count(*) FROM floor_jobs WHERE status IN ('queued', 'running')"
    finished_sql = "SELECT extract(epoch FROM max(finished_at))::float8 FROM floor_jobs"

    def setup(self, dsn: str) -> None:
        setup(dsn)

    def reset(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute("TRUNCATE floor_jobs")

    def worker(self, dsn: str, handler: str) -> tuple[list[str], dict[str, str]]:
        return ["-m", "bench.floors", "listen", dsn], {}

    def bulk_enqueue(self, dsn: str, n: int) -> float:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO floor_jobs (payload) SELECT jsonb_build_object('n', g)"
                         " FROM generate_series(0, %s - 1) g", (n,))
            return time.time()

    def producer(self, dsn: str) -> AbstractAsyncContextManager[Put]:
        return sql_producer(dsn, "INSERT INTO floor_jobs (payload) VALUES (%s::jsonb)", lambda n: (f'{{"n": {n}}}',))


def listen_main(dsn: str) -> int:
    """The floor_listen consumer: LISTEN, drain on every wake-up, stamp each job. Ends on SIGTERM
    (default action) or after MAX_SECONDS."""
    deadline = time.monotonic() + MAX_SECONDS
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN floor_wake")
        prev: int | None = None
        while time.monotonic() < deadline:
            while True:
                row = conn.execute(COMPLETE_AND_CLAIM, {"prev": prev}).fetchone()
                if row is None:
                    prev = None
                    break
                procs.stamp(int(row[1].get("n", -1)))
                prev = row[0]
            for _ in conn.notifies(timeout=1.0, stop_after=1):
                pass
    return 0


class FloorListenContract(Pglane):
    """floor_listen's loop on pglane's schema and SQL, as a consumer process on the bench lane of a
    database of its own (bench_contract), so that it can listen while pglane's worker does."""

    name = "floor_listen_contract"
    db = "contract"

    def worker(self, dsn: str, handler: str, lane: str | None = None) -> tuple[list[str], dict[str, str]]:
        return ["-m", "bench.floors", "listen-contract", dsn], {}


def listen_contract_main(dsn: str) -> int:
    """The floor_listen_contract consumer: hold slot 1 of the bench lane, LISTEN on the lane's channel,
    claim on every wake-up and drain, stamp each job. Ends like listen_main."""
    deadline = time.monotonic() + MAX_SECONDS
    with psycopg.connect(dsn, autocommit=True, row_factory=dict_row) as conn:
        lid = lane_id(conn, LANE)
        conn.execute(queries.WAIT_SLOT, (lid, 1))
        conn.execute(f"LISTEN pglane_{lid}")
        while time.monotonic() < deadline:
            job = conn.execute(queries.CLAIM, (LANE, "listen")).fetchone()
            while job is not None and job["job_id"] is not None:
                procs.stamp(int(job["payload"].get("n", -1)))
                job = conn.execute(queries.COMPLETE_AND_CLAIM, (job["attempt_id"], "null", LANE, "listen",
                                                                job["token"])).fetchone()
            for _ in conn.notifies(timeout=1.0, stop_after=1):
                pass
    return 0


# ----- floors as standing consumer processes, one per slot (bench.throughput) --------------------

def _retrying(conn: psycopg.Connection[Any], statement: Any, params: Any) -> Any:
    """One autocommitted statement, run again if the server broke a deadlock by rolling it back: at
    8 processes the bare floors' statements meet one about once in 100,000 claims, and a rolled-back
    claim changed nothing, so running it again is what any consumer would do."""
    while True:
        try:
            cur = conn.execute(statement, params)
            return cur.fetchone() if cur.description is not None else None
        except psycopg.errors.DeadlockDetected:
            continue


def _drain_bare(conn: psycopg.Connection[Any], statement: Any) -> None:
    prev: int | None = None
    while True:
        row = _retrying(conn, statement, {"prev": prev})
        if row is None:
            return
        handler(row[1])
        prev = row[0]


def _drain_seq_flush(conn: psycopg.Connection[Any]) -> None:
    """floor_seq with its commit not waited for (the counters row lock is then released before the WAL
    flush), followed by a durable commit of its own (an xid, nothing written: its commit record's flush
    covers the claim's) before the job runs: a claim is still durable before its call, and the seq
    still gapless in the durable history (WAL is one sequence: a claim lost in a crash takes every
    later one with it). Two round trips; bench.lab.experiments measures whether it lifts the slots ceiling."""
    prev: int | None = None
    while True:
        with conn.transaction():
            conn.execute("SET LOCAL synchronous_commit = off")
            row = conn.execute(COMPLETE_AND_CLAIM_SEQ, {"prev": prev}).fetchone()
        if row is None:
            return
        conn.execute("SELECT txid_current()")  # autocommit, durable: flushes the claim's commit too
        handler(row[1])
        prev = row[0]


def _drain_two_commits(conn: psycopg.Connection[Any]) -> None:
    while (row := _retrying(conn, CLAIM, None)) is not None:
        handler(row[1])
        _retrying(conn, COMPLETE, {"prev": row[0]})


def _drain_rows(conn: psycopg.Connection[Any], worker: str) -> None:
    """floor_rows at several slots: the contract's rows per job and nothing else, claims of one lane
    ordered by the same gapless seq (what several slots of a lane could reach under the contract)."""
    prev: tuple[int, int] | tuple[None, None] = (None, None)
    while True:
        row = _retrying(conn, COMPLETE_AND_CLAIM_ROWS,
                        {"prev": prev[0], "prev_attempt": prev[1], "result": "null", "worker": worker})
        if row is None:
            return
        handler(row[2])
        prev = (row[0], row[1])


def _drain_contract(conn: psycopg.Connection[Any], lane: str) -> None:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(queries.CLAIM, (lane, "floor")).fetchone()
        while row is not None and row["job_id"] is not None:
            handler(row["payload"])
            row = cur.execute(queries.COMPLETE_AND_CLAIM, (row["attempt_id"], "null", lane, "floor",
                                                           row["token"])).fetchone()


SERVE_KINDS = ("one_commit", "seq", "rows", "two_commits", "contract", "plpgsql", "seq_flush")


def serve_main(bare_dsn: str, contract_dsn: str, slot: int, lane: str) -> int:
    """One standing floor consumer, for every floor kind: connect to the bare floor's database and to
    pglane's (there taking slot ``slot`` of ``lane``, as pglane worker does, and saying which slot in
    pglane.slot), print ``ready``; then for every line ``go KIND`` on stdin drain until a claim finds
    nothing and print ``done <time.time()>``. Ends at EOF or any other line. Several of them drain one
    table at once: each stops when its claim finds nothing left that it may take."""
    name = f"bench floor {lane} {slot}"
    with (psycopg.connect(bare_dsn, autocommit=True, application_name=name) as bare,
          psycopg.connect(contract_dsn, autocommit=True, application_name=name) as conn):
        conn.execute(queries.WAIT_SLOT, (lane_id(conn, lane), slot))
        conn.execute(queries.SLOT_HINT, (str(slot),))
        print("ready", flush=True)
        for line in sys.stdin:
            command, _, kind = line.strip().partition(" ")
            if command != "go" or kind not in SERVE_KINDS:
                break
            if kind == "one_commit":
                _drain_bare(bare, COMPLETE_AND_CLAIM)
            elif kind == "seq":
                _drain_bare(bare, COMPLETE_AND_CLAIM_SEQ)
            elif kind == "rows":
                _drain_rows(bare, name)
            elif kind == "two_commits":
                _drain_two_commits(bare)
            elif kind == "plpgsql":
                _drain_bare(bare, COMPLETE_AND_CLAIM_PLPGSQL)
            elif kind == "seq_flush":
                _drain_seq_flush(bare)
            else:
                _drain_contract(conn, lane)
            print(f"done {time.time():.6f}", flush=True)
    return 0


if __name__ == "__main__":
    consumers = {"listen": listen_main, "listen-contract": listen_contract_main}
    if len(sys.argv) == 3 and sys.argv[1] in consumers:
        raise SystemExit(consumers[sys.argv[1]](sys.argv[2]))
    if len(sys.argv) == 6 and sys.argv[1] == "serve":
        raise SystemExit(serve_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]))
    raise SystemExit("usage: python -m bench.floors listen|listen-contract DSN"
                     " | serve FLOOR_DSN PGLANE_DSN SLOT LANE")
