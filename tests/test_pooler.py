"""Through PgBouncer (Debian's package, started by the tests): a worker refuses a transaction-mode pool
(exit 2, the cause and the fix named, no slot taken), idle or busy; it runs through a session-mode pool;
producers (CLI, plain INSERT, the SQL function, pglane.enqueue) work through a transaction-mode pool."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglane
from pglane import pgbin, pooler
from tests.conftest import ROOT, Workers, free_port, slot_holder, wait_until

PGBOUNCER_MISSING = "needs Debian's pgbouncer package (apt-get install pgbouncer); not run"


def _pgbouncer_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    return "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None


class Bouncer:
    """One PgBouncer process in front of the test's database, listening on a loopback port."""

    def __init__(self, binary: str, dsn: str, directory: Path, pool_mode: str, settings: dict[str, Any]) -> None:
        self.binary, self.directory, self.pool_mode = binary, directory, pool_mode
        target = conninfo_to_dict(dsn)
        self.user = str(target.get("user") or "postgres")
        self.dbname = str(target["dbname"])
        password = str(target.get("password") or "")
        host = str(target.get("host") or "127.0.0.1")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "users.txt").write_text(f'"{self.user}" "{password}"\n')
        self.port = free_port()
        options = {
            "listen_addr": "127.0.0.1", "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": directory / "users.txt", "pool_mode": pool_mode,
            "max_client_conn": 200, "default_pool_size": 20, "logfile": directory / "pgbouncer.log",
            "pidfile": "", **settings,
        }
        lines = ["[databases]",
                 f"{self.dbname} = host={host} port={target.get('port', 5432)} dbname={self.dbname}", "",
                 "[pgbouncer]", *(f"{k} = {v}" for k, v in options.items())]
        self.ini = directory / "pgbouncer.ini"
        self.ini.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        return make_conninfo(host="127.0.0.1", port=self.port, user=self.user, dbname=self.dbname)

    def start(self) -> None:
        # PgBouncer refuses to run as root: as root, run it as nobody in a user namespace (as the suite
        # runs PostgreSQL, pglane.userns), which also keeps the root-owned temporary files readable to it.
        prefix = pgbin.root_prefix() if pgbin.is_root() else ()
        out = open(self.directory / "stdout.log", "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen([*prefix, self.binary, str(self.ini)], stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as c:
                    c.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.directory / "stdout.log",
                                                                 self.directory / "pgbouncer.log") if p.exists())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def pgbouncer(dsn: str, tmp_path: Path) -> Iterator[Callable[..., Bouncer]]:
    """Start PgBouncer in front of this test's database: ``pgbouncer("transaction", key=value...)``."""
    binary = _pgbouncer_binary()
    if binary is None:
        pytest.skip(PGBOUNCER_MISSING)
    started: list[Bouncer] = []

    def start(pool_mode: str = "transaction", **settings: Any) -> Bouncer:
        bouncer = Bouncer(binary, dsn, tmp_path / f"pgbouncer-{len(started)}", pool_mode, settings)
        started.append(bouncer)
        bouncer.start()
        return bouncer

    yield start
    for bouncer in started:
        bouncer.stop()



@contextlib.contextmanager
def busy(dsn: str, clients: int) -> Iterator[list[int]]:
    """Other clients running statements through the pool without pause while the body runs; yields the
    count of statements each has run (the body may wait for it to grow)."""
    counts = [0] * clients
    stop = threading.Event()
    conns = [psycopg.connect(dsn, autocommit=True, prepare_threshold=None) for _ in range(clients)]

    def spin(i: int) -> None:
        while not stop.is_set():
            conns[i].execute("SELECT pg_sleep(random() / 2000)" if i % 2 else "SELECT 1")
            counts[i] += 1

    threads = [threading.Thread(target=spin, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(c > 20 for c in counts), 20, "the load clients to run")
        yield counts
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for c in conns:
            c.close()


def no_lock_left(conn: Any, lane: str) -> None:
    """No slot of the lane is held, and no advisory lock at all is held on the server: a lock taken through
    a transaction pool would stay on a pooled server session after the worker's exit."""
    assert slot_holder(conn, lane) == []
    row = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'").fetchone()
    assert row["n"] == 0


def assert_refused(proc: Any, conn: Any, lane: str) -> str:
    """The worker exited 2 with one line naming the cause and the fix, having taken no slot."""
    assert proc.wait(60) == 2, Workers.log(proc)
    log = Workers.log(proc)
    assert "transaction-mode pooler" in log and "session-mode pool" in log and "directly" in log, log
    assert "holding slot" not in log and "standby" not in log, log
    assert "Traceback" not in log, log
    no_lock_left(conn, lane)
    return log


# ----- the worker refuses a transaction pool --------------------------------------------------------


@pytest.mark.parametrize("reuse", ["lifo", "round_robin"])
def test_a_worker_refuses_an_idle_transaction_pool_and_takes_no_slot(
        pgbouncer: Callable[..., Any], conn: Any, lane: str, workers: Workers, reuse: str) -> None:
    bouncer = pgbouncer("transaction", server_round_robin=int(reuse == "round_robin"))
    pglane.enqueue(conn, lane, {"q": 1})
    proc = workers.start(lane, env={"PGLANE_DSN": bouncer.dsn})
    log = assert_refused(proc, conn, lane)
    assert "pglane: the worker's connection goes through a transaction-mode pooler" in log
    assert workers.ledger.calls() == []
    row = conn.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()
    assert row["n"] == 0


@pytest.mark.parametrize(("pool_size", "clients"), [(20, 4), (3, 8)], ids=["spare_sessions", "saturated"])
def test_a_worker_refuses_a_busy_transaction_pool_and_takes_no_slot(
        pgbouncer: Callable[..., Any], conn: Any, lane: str, workers: Workers, pool_size: int, clients: int) -> None:
    """Other clients run statements through the pool throughout: with sessions to spare (the one a client
    released is often taken by another in between) and with every session busy and clients waiting."""
    bouncer = pgbouncer("transaction", default_pool_size=pool_size)
    with busy(bouncer.dsn, clients):
        found = [pooler.probe(bouncer.dsn) for _ in range(40)]
        proc = workers.start(lane, env={"PGLANE_DSN": bouncer.dsn})
        assert proc.wait(60) == 2, Workers.log(proc)
    assert all(v.pooled and v.evidence is not None for v in found), [v for v in found if v.evidence is None]
    assert_refused(proc, conn, lane)


def test_the_refusal_is_a_configuration_error_with_the_cause_and_the_fix(pgbouncer: Callable[..., Any]) -> None:
    bouncer = pgbouncer("transaction")
    with pytest.raises(pglane.ConfigurationError) as raised:
        pooler.refuse_transaction_pooler(bouncer.dsn)
    assert isinstance(raised.value, pglane.errors.PoolerDetected)
    message = str(raised.value)
    assert "same server session" in message  # idle, LIFO reuse: B runs on A's session at once
    assert "connect the worker directly to PostgreSQL, or through a session-mode pool" in message
    assert "\n" not in message


# ----- what passes: a direct connection, a session pool ---------------------------------------------


def test_a_direct_connection_passes_in_five_statements(dsn: str) -> None:
    verdict = pooler.probe(dsn)
    assert verdict == pooler.Verdict(evidence=None, statements=5, pooled=False)
    pooler.refuse_transaction_pooler(dsn)


def test_a_worker_runs_through_a_session_pool(
        pgbouncer: Callable[..., Any], conn: Any, lane: str, workers: Workers) -> None:
    bouncer = pgbouncer("session")
    with busy(bouncer.dsn, 4):  # a session pool passes however busy
        found = [pooler.probe(bouncer.dsn) for _ in range(10)]
    assert all(v.pooled and v.evidence is None for v in found), found
    proc = workers.start(lane, env={"PGLANE_DSN": bouncer.dsn})
    wait_until(lambda: slot_holder(conn, lane), 30, "the worker's slot through the session pool")
    job = pglane.enqueue(conn, lane, {"result": "through the pool"})
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 30, "the job to run")
    assert pglane.result(conn, job) == "through the pool"
    assert proc.poll() is None, Workers.log(proc)


# ----- producers through a transaction pool ---------------------------------------------------------


def test_producers_work_through_a_transaction_pool(pgbouncer: Callable[..., Any], conn: Any, lane: str) -> None:
    bouncer = pgbouncer("transaction")
    env = {**os.environ, "PGLANE_DSN": bouncer.dsn}
    done = subprocess.run([sys.executable, "-m", "pglane", "enqueue", lane, '{"via": "cli"}'], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    ids = [int(done.stdout)]
    # Any language: a plain INSERT and the SQL function (its driver set not to prepare, as PgBouncer's
    # transaction mode asks of every client).
    with psycopg.connect(bouncer.dsn, autocommit=True, prepare_threshold=None) as other:
        for i in range(6):
            row = other.execute("INSERT INTO pglane.jobs (lane, payload) VALUES (%s, %s::jsonb) RETURNING id",
                                (lane, json.dumps({"via": "insert", "i": i}))).fetchone()
            assert row is not None
            ids.append(row[0])
            row = other.execute("SELECT pglane.enqueue(%s, %s::jsonb)", (lane, json.dumps({"via": "sql", "i": i}))
                                ).fetchone()
            assert row is not None
            ids.append(row[0])
    # The Python API on one connection made as usual (psycopg prepares a statement from its 5th use),
    # interleaved with other clients so that its statements move between server sessions.
    with pglane.connect(bouncer.dsn) as producer, busy(bouncer.dsn, 2):
        for i in range(20):
            job = pglane.enqueue(producer, lane, {"via": "api", "i": i})
            ids.append(job)
            assert pglane.job_status(producer, job)["status"] == "queued"
            assert pglane.result(producer, job) is None
            assert pglane.attempts(producer, job) == []
            assert pglane.jobs(producer, lane=lane, limit=1)
            assert [r["lane"] for r in pglane.lane_status(producer)] == [lane]
        assert pglane.enqueue(producer, lane, {"via": "api", "i": 0}, key="k1") == pglane.enqueue(
            producer, lane, {"via": "api", "i": 0}, key="k1")
    rows = conn.execute("SELECT id FROM pglane.jobs WHERE lane = %s ORDER BY id", (lane,)).fetchall()
    assert len(ids) == 1 + 12 + 20 and len(set(ids)) == len(ids)
    assert set(ids) <= {r["id"] for r in rows} and len(rows) == len(ids) + 1
