"""Rate limits (#21): at most N units of cost started in any window of PERIOD, cluster-wide, counted by
the claim on the database clock; `lane set` on a running lane. Real worker processes, a real server."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
from typing import Any

import psycopg
import pytest

from pglane import errors
from tests.conftest import ROOT, Workers, claimed, metrics_port, scrape, take_slot, wait_until

Conn = psycopg.Connection[dict[str, Any]]


def set_lane(conn: Conn, lane: str, **settings: Any) -> str:
    row = conn.execute("SELECT pglane.set_lane(%s, %s::jsonb) AS note", (lane, json.dumps(settings))).fetchone()
    assert row is not None
    return str(row["note"])


def enqueue_many(conn: Conn, lane: str, costs: list[int]) -> None:
    with conn.transaction():
        for i, cost in enumerate(costs):
            conn.execute("SELECT pglane.enqueue(%s, %s::jsonb, p_cost => %s)", (lane, json.dumps({"i": i}), cost))


def starts(conn: Conn, lane: str) -> list[tuple[dt.datetime, int]]:
    """Every recorded start of the lane (attempts, whatever became of them), with its job's cost."""
    return [(r["started_at"], r["cost"]) for r in conn.execute(
        "SELECT a.started_at, j.cost FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
        " WHERE j.lane = %s ORDER BY a.started_at", (lane,)).fetchall()]


def busiest_window(recorded: list[tuple[dt.datetime, int]], period: dt.timedelta) -> int:
    """The most cost started in any window of length ``period``, half open (t - period, t]: sliding
    its end over every start is enough, since the sum only grows at a start."""
    most, lo, total = 0, 0, 0
    for at, cost in recorded:
        total += cost
        while recorded[lo][0] <= at - period:
            total -= recorded[lo][1]
            lo += 1
        most = max(most, total)
    return most


def lane_row(conn: Conn, lane: str) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM pglane.lanes WHERE name = %s", (lane,)).fetchone()
    assert row is not None
    return row


def drained(conn: Conn, lane: str) -> bool:
    row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE lane = %s AND status IN ('queued', 'running')",
                       (lane,)).fetchone()
    return row is not None and row["n"] == 0


def start_rate_workers(workers: Workers, lane: str, n: int) -> list[subprocess.Popen[bytes]]:
    return [workers.start(lane, "tests.handlers:noop", "--metrics-port", "0", "--poll-interval", "30")
            for _ in range(n)]


def assert_window_books_balance(conn: Conn, lane: str) -> None:
    """The counter is the sum of the starts it has not yet purged, wherever they are kept (lane_starts,
    or the counters row's pending_starts): one drift and the limit would be off for good."""
    row = conn.execute(
        "SELECT c.window_cost, cardinality(c.pending_starts) AS pending,"
        " (SELECT coalesce(sum(s.cost), 0) FROM pglane.lane_starts s WHERE s.lane_id = l.id) AS kept"
        " FROM pglane.lanes l JOIN pglane.lane_counters c ON c.lane_id = l.id WHERE l.name = %s", (lane,)).fetchone()
    assert row is not None and row["pending"] < 32
    assert row["window_cost"] == row["kept"] + row["pending"], row


def claims_made(procs: list[subprocess.Popen[bytes]], lane: str) -> float:
    return sum(scrape(metrics_port(p), lane).get("pglane_claim_latency_seconds_count", 0.0) for p in procs)


# ----- the window is exact ----------------------------------------------------------------------------

def test_three_workers_never_exceed_the_rate_and_make_about_one_claim_per_job(
        conn: Conn, lane: str, workers: Workers) -> None:
    set_lane(conn, lane, slots=3, rate="10/s")
    enqueue_many(conn, lane, [1] * 60)
    procs = start_rate_workers(workers, lane, 3)
    wait_until(lambda: drained(conn, lane), 60, "the lane to drain")
    recorded = starts(conn, lane)
    assert len(recorded) == 60
    assert busiest_window(recorded, dt.timedelta(seconds=1)) == 10
    # Near the limit: start k + 10 comes at least a second after start k, so the last 50 need 5 s
    # after the first window's tenth start; a lane kept at its limit takes little more.
    span = (recorded[-1][0] - recorded[9][0]).total_seconds()
    assert 5.0 <= span <= 5.0 * 1.5, f"the last 50 starts at 10/s took {span:.2f}s"
    # No thundering herd: each refused claim told its slot its own opening. Counted by the workers'
    # claim metric once they have gone idle (each makes one empty claim at the end).
    made = wait_until(lambda: (c := claims_made(procs, lane)) >= 60 and c, 10, "the claim metrics")
    assert made / 60 <= 1.5, f"{made:.0f} claims for 60 jobs"
    assert_window_books_balance(conn, lane)


def test_every_start_is_recorded_once_with_its_seq_and_time(conn: Conn, lane: str) -> None:
    """A generous lane takes rate_start's fast path (the start kept in the counters row) but at every
    32nd start, which moves the kept ones into lane_starts: whichever path recorded it, each start is
    there once, with the seq and time its attempt got, and the counter and the operator's figure agree."""
    set_lane(conn, lane, rate="100000/h")
    enqueue_many(conn, lane, [1] * 70)
    take_slot(conn, lane)
    for _ in range(70):
        claimed(conn, lane)
    recorded = conn.execute(
        "SELECT w.seq, w.started_at FROM pglane.lanes l, pglane.lane_window_starts(l.id, '-infinity') w"
        " WHERE l.name = %s ORDER BY w.seq", (lane,)).fetchall()
    attempts = conn.execute(
        "SELECT a.seq, a.started_at FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
        " WHERE j.lane = %s ORDER BY a.seq", (lane,)).fetchall()
    assert [r["seq"] for r in attempts] == list(range(1, 71))
    assert recorded == attempts
    kept = conn.execute("SELECT count(*) AS n FROM pglane.lane_starts").fetchone()
    assert kept is not None and kept["n"] == 64  # moved by the slow starts of seq 32 and 64
    assert_window_books_balance(conn, lane)
    use = conn.execute("SELECT pglane.rate_window_use(%s) AS n", (lane,)).fetchone()
    assert use is not None and use["n"] == 70


def test_kept_starts_that_left_the_window_make_room_for_a_heavier_job(conn: Conn, lane: str) -> None:
    """Starts kept in the counters row (the fast path) stop counting once they leave the window, also for
    a job that costs more than the counter alone leaves room for: the unlocked look sums them out (else
    it would refuse the lane, writing nothing, until some other start purged them: never)."""
    set_lane(conn, lane, rate="10/s")
    enqueue_many(conn, lane, [1] * 8)
    take_slot(conn, lane)
    for _ in range(8):
        claimed(conn, lane)
    kept = conn.execute("SELECT c.window_cost, cardinality(c.pending_starts) AS pending FROM pglane.lane_counters c"
                        " JOIN pglane.lanes l ON l.id = c.lane_id WHERE l.name = %s", (lane,)).fetchone()
    assert kept == {"window_cost": 8, "pending": 8}
    # Until all eight have left the window on the database clock (the counter still says 8).
    left = ("SELECT clock_timestamp() - max(p.at) > interval '1 second' AS gone FROM pglane.lane_counters c"
            " JOIN pglane.lanes l ON l.id = c.lane_id, unnest(c.pending_starts) p(at) WHERE l.name = %s")
    wait_until(lambda: (conn.execute(left, (lane,)).fetchone() or {}).get("gone"), 5,
               "the kept starts to leave the window")
    enqueue_many(conn, lane, [5])
    assert claimed(conn, lane)["job_id"] is not None
    assert_window_books_balance(conn, lane)


def test_weighted_costs_count_in_the_window(conn: Conn, lane: str, workers: Workers) -> None:
    set_lane(conn, lane, slots=3, rate="12/s")
    costs = [1, 3, 2, 4, 1, 1, 5, 2, 3, 1] * 4
    enqueue_many(conn, lane, costs)
    start_rate_workers(workers, lane, 3)
    wait_until(lambda: drained(conn, lane), 60, "the lane to drain")
    recorded = starts(conn, lane)
    assert sorted(c for _, c in recorded) == sorted(costs)
    assert busiest_window(recorded, dt.timedelta(seconds=1)) <= 12
    assert_window_books_balance(conn, lane)
    # Started in service order (a costly head job is waited for, never skipped).
    order = conn.execute("SELECT id FROM pglane.jobs WHERE lane = %s ORDER BY seq", (lane,)).fetchall()
    assert [r["id"] for r in order] == sorted(r["id"] for r in order)


def test_a_worker_killed_mid_window_does_not_let_the_lane_exceed_the_rate(
        conn: Conn, lane: str, workers: Workers) -> None:
    set_lane(conn, lane, slots=2, rate="5/s", max_attempts=3)
    enqueue_many(conn, lane, [1] * 30)
    victim, other = (workers.start(lane, "tests.handlers:noop", "--poll-interval", "30") for _ in range(2))
    wait_until(lambda: len(starts(conn, lane)) >= 8, 30, "a few windows of starts")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    workers.start(lane, "tests.handlers:noop", "--poll-interval", "30")  # takes the freed slot and recovers
    wait_until(lambda: drained(conn, lane), 60, "the lane to drain")
    assert other.poll() is None
    assert busiest_window(starts(conn, lane), dt.timedelta(seconds=1)) <= 5
    assert_window_books_balance(conn, lane)


# ----- a refused start writes nothing, and says when ------------------------------------------------

def test_a_refused_claim_writes_nothing_and_says_when_the_next_start_is(
        conn: Conn, lane: str, session: Any) -> None:
    set_lane(conn, lane, rate="2/min")
    enqueue_many(conn, lane, [1, 1, 1])
    worker = session()
    take_slot(worker, lane)
    for _ in range(2):
        row = worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
        assert row is not None and row["job_id"] is not None
    worker.autocommit = False
    row = worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
    assert row is not None and row["job_id"] is None and row["wait_reason"] == "rate"
    assert 55 <= row["wait_seconds"] <= 60
    written = worker.execute("SELECT pg_current_xact_id_if_assigned() AS xid").fetchone()
    assert written is not None and written["xid"] is None  # no row written, not even locked
    worker.rollback()
    status = conn.execute("SELECT * FROM pglane.lane_status WHERE lane = %s", (lane,)).fetchone()
    assert status is not None
    assert (status["rate"], status["rate_window_used"]) == ("2/min", 2)
    assert status["rate_next_start_at"] is not None
    assert status["next_safe_action"].startswith("nothing to do: rate limited (2/min")
    job = conn.execute("SELECT * FROM pglane.job_status WHERE lane = %s AND status = 'queued'", (lane,)).fetchone()
    assert job is not None
    assert "rate limited" in job["next_safe_action"]
    conn.execute("UPDATE pglane.lanes SET waiting_grace = '0' WHERE name = %s", (lane,))
    job = conn.execute("SELECT * FROM pglane.job_status WHERE lane = %s AND status = 'queued'", (lane,)).fetchone()
    assert job is not None and job["waiting_for_worker"] is False  # held by the rate, not by a missing worker


def weighted(conn: Conn, lane: str) -> bool:
    row = conn.execute("SELECT weighted FROM pglane.lanes WHERE name = %s", (lane,)).fetchone()
    assert row is not None
    return bool(row["weighted"])


def claim_writes(worker: Any, lane: str) -> tuple[dict[str, Any], Any]:
    """One claim in an open transaction: its row, and the transaction id it took (None: it wrote nothing,
    not even a row lock); rolled back."""
    worker.autocommit = False
    try:
        row = worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
        xid = worker.execute("SELECT pg_current_xact_id_if_assigned() AS xid").fetchone()["xid"]
    finally:
        worker.rollback()
        worker.autocommit = True
    return row, xid


def test_a_lane_is_weighted_from_its_first_job_costing_more_than_one(conn: Conn, lane: str) -> None:
    set_lane(conn, lane, rate="10/min")
    enqueue_many(conn, lane, [1, 1])
    assert not weighted(conn, lane)
    with pytest.raises(psycopg.errors.RaiseException), conn.transaction():
        enqueue_many(conn, lane, [3])
        conn.execute("DO $$ BEGIN RAISE EXCEPTION 'changed my mind'; END $$")
    assert not weighted(conn, lane)  # rolled back with the insert
    conn.execute("INSERT INTO pglane.jobs (lane, payload, cost) VALUES (%s, '{}', 2)", (lane,))
    assert weighted(conn, lane)


@pytest.mark.parametrize("costs", [[1, 1, 1], [1, 1, 2]], ids=["unweighted", "weighted"])
def test_an_empty_or_full_limited_lane_is_refused_without_a_write(
        conn: Conn, lane: str, session: Any, costs: list[int]) -> None:
    set_lane(conn, lane, rate="2/min")
    worker = session()
    take_slot(worker, lane)
    row, xid = claim_writes(worker, lane)  # empty: nothing eligible, nothing written, not a rate wait
    assert row["job_id"] is None and row["wait_reason"] is None and xid is None
    enqueue_many(conn, lane, costs)
    assert weighted(conn, lane) is (max(costs) > 1)
    for _ in range(2):
        row = worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
        assert row is not None and row["job_id"] is not None
    row, xid = claim_writes(worker, lane)  # the window is full: held back by the rate, nothing written
    assert row["job_id"] is None and row["wait_reason"] == "rate" and xid is None
    conn.execute("DELETE FROM pglane.jobs WHERE lane = %s AND status = 'queued'", (lane,))
    row, xid = claim_writes(worker, lane)  # full window, empty queue: nothing eligible, not the rate
    assert row["job_id"] is None and row["wait_reason"] is None and xid is None


def test_the_window_starts_when_the_rate_is_set(conn: Conn, lane: str, session: Any) -> None:
    enqueue_many(conn, lane, [1] * 5)
    worker = session()
    take_slot(worker, lane)
    for _ in range(2):  # two starts while the lane has no limit
        row = worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
        assert row is not None and row["job_id"] is not None
    set_lane(conn, lane, rate="2/h")
    status = conn.execute("SELECT rate_window_used FROM pglane.lane_status WHERE lane = %s", (lane,)).fetchone()
    assert status is not None and status["rate_window_used"] == 0
    taken = [worker.execute("SELECT * FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone() for _ in range(3)]
    assert [t is not None and t["job_id"] is not None for t in taken] == [True, True, False]  # 2 in the window
    assert taken[2] is not None and taken[2]["wait_reason"] == "rate"  # a job is left: the rate holds it


def test_each_slot_is_told_its_own_opening(conn: Conn, lane: str, session: Any) -> None:
    set_lane(conn, lane, slots=3, rate="3/min")
    enqueue_many(conn, lane, [1] * 6)
    sessions = []
    for slot in (1, 2, 3):
        s = session()
        take_slot(s, lane, slot)
        sessions.append(s)
    for s in sessions:  # one start each, 50 ms apart on the server's clock: the window is full
        row = s.execute("SELECT *, pg_sleep(0.05) FROM pglane.claim_or_wait(%s, 'w')", (lane,)).fetchone()
        assert row is not None and row["job_id"] is not None
    recorded = [at for at, _ in starts(conn, lane)]
    openings = []
    for s in sessions:
        row = s.execute("SELECT c.job_id, clock_timestamp() + make_interval(secs => c.wait_seconds) AS opening"
                        " FROM pglane.claim_or_wait(%s, 'w') c", (lane,)).fetchone()
        assert row is not None and row["job_id"] is None
        openings.append(row["opening"])
    # Slot k waits for the k-th opening: the start k a minute ago leaves the window. One claim each.
    for opening, start in zip(openings, recorded, strict=True):
        assert abs((opening - (start + dt.timedelta(minutes=1))).total_seconds()) < 0.02, (openings, recorded)


# ----- cost at enqueue ----------------------------------------------------------------------------

def test_a_job_costing_more_than_the_rate_is_refused_at_enqueue(conn: Conn, lane: str) -> None:
    set_lane(conn, lane, rate="10/min")
    with pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT pglane.enqueue(%s, '{}', p_cost => 11)", (lane,))
    assert refused.value.sqlstate == "PGL13" and "could never start" in str(refused.value)
    with pytest.raises(psycopg.Error) as plain:
        conn.execute("INSERT INTO pglane.jobs (lane, payload, cost) VALUES (%s, '{}', 11)", (lane,))
    assert plain.value.sqlstate == "PGL13"
    with pytest.raises(psycopg.Error) as zero:
        conn.execute("INSERT INTO pglane.jobs (lane, payload, cost) VALUES (%s, '{}', 0)", (lane,))
    assert (zero.value.sqlstate, zero.value.diag.constraint_name) == ("23514", "job_cost_positive")
    assert "a job's cost is a whole number of at least 1" in str(errors.translate(zero.value))
    assert isinstance(errors.translate(refused.value), errors.CostOverRate)
    row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE lane = %s", (lane,)).fetchone()
    assert row is not None and row["n"] == 0
    conn.execute("INSERT INTO pglane.jobs (lane, payload, cost) VALUES (%s, '{}', 10)", (lane,))


# ----- lane set ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("settings", "code", "says"), [
    ({"rate": "10 per second"}, "PGL10", "is not N/PERIOD"),
    ({"rate": "0/s"}, "PGL10", "is not N/PERIOD"),
    ({"rate": "5/fortnight"}, "PGL10", "is not N/PERIOD"),
    ({"slots": 0}, "23514", "lane_slots_range"),
    ({"slots": "three"}, "PGL10", "invalid input syntax"),
    ({"job_timeout": 900}, "23514", "lane_lease_exceeds_job_timeout"),
    ({"colour": "red"}, "PGL10", "unknown lane setting"),
    ({"slots": None}, "PGL10", "cannot be removed"),
    ({"takeover": "sometimes"}, "23514", "lane_takeover_valid"),
])
def test_lane_set_refuses_bad_values_and_changes_nothing(
        conn: Conn, lane: str, settings: dict[str, Any], code: str, says: str) -> None:
    before = lane_row(conn, lane)
    with pytest.raises(psycopg.Error) as refused:
        set_lane(conn, lane, **settings)
    assert refused.value.sqlstate == code
    assert says in str(refused.value) + str(refused.value.diag.constraint_name)
    assert lane_row(conn, lane) == before


def test_lane_set_refuses_a_rate_below_a_queued_jobs_cost(conn: Conn, lane: str) -> None:
    conn.execute("SELECT pglane.enqueue(%s, '{}', p_cost => 7)", (lane,))
    with pytest.raises(psycopg.Error) as refused:
        set_lane(conn, lane, rate="5/s")
    assert refused.value.sqlstate == "PGL13"
    assert lane_row(conn, lane)["rate_limit"] is None


def test_lane_set_on_a_running_lane_takes_effect_at_the_next_claim(
        conn: Conn, lane: str, workers: Workers) -> None:
    set_lane(conn, lane, rate="1/h")
    enqueue_many(conn, lane, [1] * 4)
    workers.start(lane, "tests.handlers:noop", "--poll-interval", "3600")
    wait_until(lambda: len(starts(conn, lane)) == 1, 20, "the first start")
    note = set_lane(conn, lane, rate=None, max_attempts=2)  # the worker sleeps till the opening: news wakes it
    assert "rate_limit 1 -> none" in note and "max_attempts 1 -> 2" in note
    wait_until(lambda: drained(conn, lane), 20, "the rest to start once the limit is gone")
    assert lane_row(conn, lane)["max_attempts"] == 2
    row = conn.execute("SELECT count(*) AS n FROM pglane.lane_starts").fetchone()
    assert row is not None and row["n"] == 0


def test_lowering_slots_below_a_holder_says_what_happens_to_it(conn: Conn, lane: str, workers: Workers) -> None:
    set_lane(conn, lane, slots=2)
    first = workers.start(lane, "tests.handlers:paid_call")
    wait_until(lambda: "holding slot 1" in Workers.log(first), 20, "the first worker's slot")
    second = workers.start(lane, "tests.handlers:paid_call")
    wait_until(lambda: "holding slot 2" in Workers.log(second), 20, "the second worker's slot")
    note = set_lane(conn, lane, slots=1)
    assert "slots 2 -> 1" in note and "slot 2 (server session pid" in note and "waits as a standby" in note
    conn.execute("SELECT pglane.enqueue(%s, '{\"hold_before\": 0}')", (lane,))
    wait_until(lambda: drained(conn, lane), 20, "the job to run in slot 1")
    wait_until(lambda: "standby" in Workers.log(second), 20, "the worker above the slots to wait as a standby")
    assert first.poll() is None and second.poll() is None


def test_lane_set_from_the_cli(dsn: str, conn: Conn, lane: str) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pglane", "--dsn", dsn, *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)

    done = cli("lane", "set", lane, "--rate", "60/min", "--max-queued", "5", "--slots", "2")
    assert done.returncode == 0, done.stderr
    assert "--rate none -> 60/min" in done.stdout and "rate_limit" not in done.stdout
    row = lane_row(conn, lane)
    assert (row["rate_limit"], row["rate_period"], row["max_queued"], row["slots"]) == (
        60, dt.timedelta(minutes=1), 5, 2)
    bad = cli("lane", "set", lane, "--job-timeout", "900")
    assert bad.returncode != 0 and "R1" in bad.stderr and "Traceback" not in bad.stderr
    assert lane_row(conn, lane) == row
    cleared = cli("lane", "set", lane, "--rate", "none", "--max-queued", "none")
    assert cleared.returncode == 0, cleared.stderr
    assert (lane_row(conn, lane)["rate_limit"], lane_row(conn, lane)["max_queued"]) == (None, None)
    created = cli("lane", "create", "limited", "--rate", "5/s")
    assert created.returncode == 0, created.stderr
    assert lane_row(conn, "limited")["rate_limit"] == 5
    enq = cli("enqueue", "limited", "{}", "--cost", "6")
    assert enq.returncode != 0 and "could never start" in enq.stderr
