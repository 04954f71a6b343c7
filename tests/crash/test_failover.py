"""Failover to a promoted synchronous standby: the primary's postmaster is killed with SIGKILL in the
middle of a run (during a paid call, between a claim and its call, at random moments), the standby is
promoted with ``pg_ctl promote``, and two workers on a one-slot lane and a producer, all on the
multi-host DSN ``host=a,b target_session_attrs=read-write``, go on by themselves.

After each run: every job acknowledged before the kill is on the new primary; every key the producer
retried through the failover made one job; no job's call was made twice; every attempt that was
running on the old primary is marked lost with its reason (or holds its late result); nothing is
left running; seq is gapless; the lane drains; and an idle worker is woken by a NOTIFY on the new
primary (so it LISTENs there: the poll interval is far longer than the test waits).
"""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest

import pglane
from pglane.errors import PglaneError
from tests.conftest import Ledger, Workers, free_port, slot_holder, wait_until
from tests.crash.conftest import check_invariants, drained
from tests.replica import Node, Pair, make_template, synchronous_pair

LANE = "failover"
JOBS = 100  # enqueued before the workers start; the producer adds more through the failover
HANDLER = "tests.gated:gated_call"
# An idle worker is woken within the test's deadlines only by a NOTIFY (polls every 60 s), and recovers
# only when it takes a slot (not every 600 s): what the test sees after the failover is their doing.
WORKER_ARGS = ("--poll-interval", "60", "--recover-interval", "600")
JOB_TIMEOUT = 60.0  # the lease is 66 s: anything that waited for it would miss every deadline below
RECOVERED_WITHIN = 30.0  # the old primary's running attempts are marked lost within this of the promotion

figures: list[dict[str, Any]] = []  # one line per run, printed at the end of the module


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield make_template(tmp_path_factory.mktemp("failover"))
    for line in figures:
        print("failover:", ", ".join(f"{k} {v}" for k, v in line.items()))


@pytest.fixture
def pair(template: Path, tmp_path: Path) -> Iterator[Pair]:
    with synchronous_pair(template, tmp_path / "servers") as p:
        yield p


class Producer(threading.Thread):
    """Enqueues jobs with idempotency keys through the multi-host DSN, one after another, until stopped.
    A call that fails (the connection died, or no server accepts writes yet) is retried with the same
    key on a new connection, as a careful producer does: whether or not the first try committed, the
    key gives one job."""

    def __init__(self, dsn: str, prefix: str) -> None:
        super().__init__(name=f"producer-{prefix}", daemon=True)
        self.dsn, self.prefix = dsn, prefix
        self.acked: dict[str, int] = {}  # key: the job id the database answered
        self.retried: set[str] = set()  # keys whose first try failed
        self.halt = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self.halt.is_set():  # checked between keys only: a key that failed is retried until it answers
            key = f"{self.prefix}-{len(self.acked)}"
            while True:
                try:
                    if conn is None:
                        conn = pglane.connect(self.dsn, connect_timeout=5)
                    self.acked[key] = pglane.enqueue(conn, LANE, {"sleep": 0.005}, key=key)
                    break
                except (PglaneError, psycopg.Error):
                    self.retried.add(key)
                    if conn is not None:
                        conn.close()
                    conn = None
                    time.sleep(0.05)
            self.halt.wait(0.01)
        if conn is not None:
            conn.close()


def value(conn: psycopg.Connection[Any], query: LiteralString, params: Any = None) -> Any:
    """The first column of the statement's one row."""
    row = conn.execute(query, params).fetchone()
    assert row is not None, query
    return next(iter(row.values()))


def job_status(conn: psycopg.Connection[Any], job: int) -> Any:
    return value(conn, "SELECT status FROM pglane.jobs WHERE id = %s", (job,))


def idle_holder(conn: psycopg.Connection[Any], other_than: int | None = None) -> int:
    """The backend pid of the lane's slot holder (not ``other_than``) once it waits, idle, after a claim:
    a job enqueued now can reach it only by a NOTIFY, never by a claim it was about to make."""
    def waiting() -> int | None:
        row = conn.execute("SELECT h.pid FROM pglane.slot_holders h JOIN pg_stat_activity s ON s.pid = h.pid"
                           " WHERE h.lane = %s AND h.granted AND s.state = 'idle' AND s.query LIKE '%%claim%%'",
                           (LANE,)).fetchone()
        return None if row is None or row["pid"] == other_than else int(row["pid"])

    pid: int = wait_until(waiting, 30, "a slot holder waiting idle after a claim")
    return pid


def woken_by_notify(conn: psycopg.Connection[Any], whom: str) -> None:
    """A job enqueued now runs long before the idle holder's 60 s poll: it LISTENs on this server."""
    job = pglane.enqueue(conn, LANE, {"sleep": 0})
    wait_until(lambda: job_status(conn, job) == "done", 20, f"a NOTIFY on the new primary to wake {whom}")


def worker_of(conn: psycopg.Connection[Any], pid: int, fleet: Workers) -> subprocess.Popen[bytes]:
    """The worker process whose lock session is backend ``pid`` (its application_name ends with host:pid)."""
    name = value(conn, "SELECT application_name FROM pg_stat_activity WHERE pid = %s", (pid,))
    return next(p for p in fleet.procs if p.pid == int(name.rsplit(":", 1)[-1]))


def events_of(ledger: Ledger, event: str, job: int) -> list[int]:
    return [t for e, j, _, t in ledger.events() if e == event and j == job]


def caught_up(standby: Node) -> dict[int, str]:
    """Once the standby has replayed all it received (the primary is dead: nothing more comes), every
    attempt on it: {id: status}. Read on the hot standby before its promotion, when no worker can
    reach it."""
    with pglane.connect(standby.dsn) as c:
        wait_until(lambda: value(c, "SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()"), 30,
                   "the standby to replay what it received")
        return {r["id"]: r["status"] for r in c.execute("SELECT id, status FROM pglane.attempts")}


def old_primary_leftovers(pair: Pair, tmp_path: Path) -> dict[str, Any]:
    """Start the killed primary's data directory alone (never again as the primary of these workers) and
    compare it with the new primary: what only the old one holds was committed there but never
    acknowledged to anyone (synchronous replication did not confirm it)."""
    old = Node("old-primary", pair.primary.data_dir, free_port())
    # Its postmaster is dead (maybe an unreaped zombie, which PostgreSQL would take for a live one).
    (old.data_dir / "postmaster.pid").unlink()
    old.start()
    try:
        with pglane.connect(old.dsn) as o, pglane.connect(pair.standby.dsn) as n:
            query = "SELECT a.id, a.job_id, a.status, a.worker FROM pglane.attempts a"
            only_old = {r["id"]: r for r in o.execute(query)}
            for r in n.execute(query):
                only_old.pop(r["id"], None)
            jobs_new = {r["id"] for r in n.execute("SELECT id FROM pglane.jobs")}
            jobs_only_old = [r["id"] for r in o.execute("SELECT id FROM pglane.jobs") if r["id"] not in jobs_new]
    finally:
        old.stop()
    return {"attempts": only_old, "jobs": jobs_only_old}


@pytest.mark.parametrize(("kill_at", "seed"), [("during_call", 1), ("between_claim_and_call", 2),
                                               ("random", 3), ("random", 4)])
def test_a_promoted_synchronous_standby_loses_no_job_and_pays_for_nothing_twice(
    pair: Pair, tmp_path: Path, kill_at: str, seed: int
) -> None:
    rng = random.Random(seed)
    ledger = Ledger(tmp_path / "ledger")
    gate = tmp_path / "gate"
    with pglane.connect(pair.primary.dsn) as c:
        pglane.create_lane(c, LANE, job_timeout=JOB_TIMEOUT)
        jobs = [pglane.enqueue(c, LANE, {"sleep": 0.005}) for _ in range(JOBS // 2)]
        gated = None
        if kill_at != "random":
            gated = pglane.enqueue(c, LANE, {"gate": str(gate), "at": "during" if kill_at == "during_call" else
                                             "before"})
            jobs.append(gated)
        jobs += [pglane.enqueue(c, LANE, {"sleep": 0.005}) for _ in range(JOBS // 2)]
        if gated is None:  # a random kill must find the worker busy: work left for seconds after the moment,
            # even if this process is held up while the worker runs on (a loaded machine)
            jobs += [pglane.enqueue(c, LANE, {"sleep": 0.005}) for _ in range(3 * JOBS)]
    fleet = Workers(pair.dsn, ledger, tmp_path)
    producer = Producer(pair.dsn, f"p{seed}")
    try:
        with pglane.connect(pair.primary.dsn) as c:
            fleet.start(LANE, HANDLER, *WORKER_ARGS)
            wait_until(lambda: slot_holder(c, LANE), 30, "the first worker's slot")
            second = fleet.start(LANE, HANDLER, *WORKER_ARGS)
            wait_until(lambda: "standby" in Workers.log(second) or "holding slot" in Workers.log(second), 30,
                       "the second worker to wait as a standby")
        producer.start()

        # The moment of the kill.
        if gated is not None:
            event = "start" if kill_at == "during_call" else "claimed"
            wait_until(lambda: events_of(ledger, event, gated), 60, f"the {event} of the gated job")
        else:
            calls = rng.randint(5, JOBS - 20)
            wait_until(lambda: len(ledger.calls()) >= calls, 60, f"{calls} calls")
            time.sleep(rng.uniform(0, 0.02))  # the random moment itself
        killed_ns = time.monotonic_ns()
        pair.kill_primary()
        before = caught_up(pair.standby)
        running_at_kill = {a for a, status in before.items() if status == "running"}
        promote_ns = time.monotonic_ns()
        pair.standby.promote()
        promoted_ns = time.monotonic_ns()

        with pglane.connect(pair.standby.dsn) as new:
            def recovered() -> bool:
                return bool(value(new, "SELECT count(*) FROM pglane.attempts WHERE id = ANY(%s) AND status = 'running'",
                                  (list(running_at_kill),)) == 0)

            wait_until(recovered, RECOVERED_WITHIN, "the old primary's running attempts to be marked lost")
            gate.touch()  # a call held at the gate goes on, and its worker delivers its late result
            acked_at_promotion = len(producer.acked)
            wait_until(lambda: len(producer.acked) >= acked_at_promotion + 10, 30, "the producer to go on")
            producer.halt.set()
            producer.join(30)
            assert not producer.is_alive()

            everything = jobs + list(producer.acked.values())
            drained(new, LANE, everything, timeout=90)
            if gated is not None:  # its worker, cut off during the call, delivers the result it holds
                wait_until(lambda: job_status(new, gated) == "done", 30, "the gated job's late result")

            # Every job acknowledged before the kill is there, and every key made exactly one job.
            rows = {r["id"]: r for r in new.execute("SELECT id, idempotency_key FROM pglane.jobs WHERE lane = %s",
                                                    (LANE,))}
            assert set(everything) <= set(rows), f"lost jobs: {sorted(set(everything) - set(rows))}"
            assert all(rows[job]["idempotency_key"] == key for key, job in producer.acked.items())
            keyed = [r for r in rows.values() if r["idempotency_key"] is not None]
            assert len(keyed) == len(producer.acked), "a retried key made a second job, or a job nobody asked for"

            # Every attempt running on the old primary is lost with its reason, or holds its result: the
            # worker that kept it delivered it on the new primary, before recovery (the attempt's token
            # lets a new session write it) or after (a late result).
            assert running_at_kill, "the kill found no attempt running: it missed the run"
            answered = set(ledger.attempts_of("end"))
            for a in new.execute("SELECT id, status, error FROM pglane.attempts WHERE id = ANY(%s)",
                                 (list(running_at_kill),)):
                if a["status"] == "lost":
                    assert "may have been made" in a["error"], a
                else:
                    assert a["status"] == "done" and a["id"] in answered, a
                    assert a["error"] is None or a["error"].startswith("late result accepted"), a
            if gated is not None:
                assert len(events_of(ledger, "start", gated)) == 1
                row = new.execute("SELECT a.status, a.error, j.result FROM pglane.attempts a JOIN pglane.jobs j"
                                  " ON j.id = a.job_id WHERE a.job_id = %s", (gated,)).fetchall()
                assert len(row) == 1 and row[0]["status"] == "done" and row[0]["result"]["job"] == gated, row

            check_invariants(new, LANE, everything, ledger)

            # Both workers are on the new primary, untouched by anyone: one holds the slot, the other waits
            # as a standby; each LISTENs there once it holds the slot: a job enqueued while the holder is
            # idle runs long before its 60 s poll. The holder is stopped, so that the other one shows it too.
            assert all(p.poll() is None for p in fleet.procs), "a worker exited"
            holder = idle_holder(new)
            # A standby shows in pg_locks while its lock request is pending: between two of its 500 ms
            # waits (it reads the lane, tries every slot) it shows nowhere, so this is polled, not read once.
            wait_until(lambda: value(new, "SELECT count(*) FROM pglane.slot_holders WHERE lane = %s AND NOT granted",
                                     (LANE,)) == 1, 10, "the other worker waiting as a standby on the new primary")
            woken_by_notify(new, "the holder")
            worker = worker_of(new, holder, fleet)
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0
            idle_holder(new, other_than=holder)
            woken_by_notify(new, "the standby that took over")

        # Resumption: the first job claimed on the new primary, counted from the kill.
        resumed = min(t for e, _, attempt, t in ledger.events() if e == "claimed" and attempt not in before)
        wait_until(lambda: not pair.left_behind(), 30, "the old primary's processes to end")
        leftovers = old_primary_leftovers(pair, tmp_path)
        # What only the old primary holds was never acknowledged: no call was made on the strength of it.
        paid_attempts = set(ledger.attempts_of("claimed"))
        assert not paid_attempts & set(leftovers["attempts"]), "a call ran on a claim the standby never had"
        assert not set(leftovers["jobs"]) & set(producer.acked.values())
        figures.append({
            "run": f"{kill_at}/{seed}", "promotion_s": round((promoted_ns - promote_ns) / 1e9, 3),
            "kill_to_next_job_s": round((resumed - killed_ns) / 1e9, 3),
            "promoted_to_next_job_s": round((resumed - promoted_ns) / 1e9, 3),
            "running_at_kill": len(running_at_kill), "producer_keys_retried": len(producer.retried),
            "only_on_old_primary": f"{len(leftovers['attempts'])} attempt(s), {len(leftovers['jobs'])} job(s)",
        })
    finally:
        producer.halt.set()
        fleet.stop_all()
