"""Tenants in a lane (docs/design.md#groups-priorities-and-fair-service): a job's group, a per-group
limit that never overshoots (counted under the lane's counters lock, a lost attempt of a strict lane
until its lease ends), fair service between groups, and priorities — all in the claim's one pick."""

from __future__ import annotations

import collections
import functools
import json
import signal
from typing import Any

import psycopg
import pytest

import pglane
from tests.conftest import Ledger, Workers, claim, claimed, concurrently, console, take_slot, terminate, wait_until


def _slots(session: Any, lane: str, n: int) -> list[Any]:
    """n sessions, each holding one slot of the lane."""
    out = []
    for slot in range(1, n + 1):
        s = session()
        take_slot(s, lane, slot)
        out.append(s)
    return out


def _group_of(conn: Any, job_id: int) -> str:
    return str(conn.execute("SELECT group_key FROM pglane.jobs WHERE id = %s", (job_id,)).fetchone()["group_key"])


def _done(conn: Any, row: dict[str, Any]) -> None:
    conn.execute("SELECT pglane.complete(%s, '{}'::jsonb, %s)", (row["attempt_id"], row["token"]))


def test_a_plain_insert_carries_a_group_and_a_priority(conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key, priority) VALUES (%s, '{}', 'acme', 5)", (lane,))
    job = conn.execute("SELECT group_key, priority FROM pglane.jobs").fetchone()
    assert job == {"group_key": "acme", "priority": 5}
    job_id = pglane.enqueue(conn, lane, {}, group="globex", priority=-2)
    assert conn.execute("SELECT group_key, priority FROM pglane.jobs WHERE id = %s", (job_id,)).fetchone() == {
        "group_key": "globex", "priority": -2}
    plain = pglane.enqueue(conn, lane, {})
    assert conn.execute("SELECT group_key, priority FROM pglane.jobs WHERE id = %s", (plain,)).fetchone() == {
        "group_key": None, "priority": 0}


def test_a_group_longer_than_255_characters_is_refused_with_what_to_do_and_nothing_written(
        conn: Any, lane: str) -> None:
    with pytest.raises(pglane.PglaneError) as err:
        pglane.enqueue(conn, lane, {}, group="g" * 256)
    assert "255" in str(err.value) and "group" in str(err.value)
    with pytest.raises(psycopg.Error) as raw:
        conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) VALUES (%s, '{}', %s)", (lane, "g" * 256))
    assert "255" in str(raw.value)
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0


def test_a_full_group_is_passed_over_for_the_next_group_and_no_slot_idles(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "tenants", slots=3, job_timeout=60, group_slots=1)
    a1 = pglane.enqueue(conn, "tenants", {}, group="a")
    a2 = pglane.enqueue(conn, "tenants", {}, group="a")
    b1 = pglane.enqueue(conn, "tenants", {}, group="b")
    s1, s2, s3 = _slots(session, "tenants", 3)
    first = claimed(s1, "tenants")
    second = claimed(s2, "tenants")
    assert (first["job_id"], second["job_id"]) == (a1, b1)  # a2 waits: a is full
    assert claim(s3, "tenants") is None
    status = pglane.job_status(conn, a2)
    assert status["waiting_for_worker"] is False
    assert "group a" in status["next_safe_action"] and "1" in status["next_safe_action"]
    _done(s1, first)
    assert claimed(s3, "tenants")["job_id"] == a2


def test_the_group_limit_holds_when_slots_race(conn: Any, session: Any) -> None:
    # Three slots claim at once, again and again: never two running jobs of one group.
    pglane.create_lane(conn, "tenants", slots=3, job_timeout=60, group_slots=1)
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) SELECT 'tenants', '{}', 'g' || (i % 2)"
                 " FROM generate_series(1, 60) i")
    sessions = _slots(session, "tenants", 3)
    for _ in range(30):
        rows: dict[int, dict[str, Any]] = {}
        concurrently([functools.partial(_claim_into, rows, i, s) for i, s in enumerate(sessions)])
        taken = {i: r for i, r in rows.items() if r}
        groups = [_group_of(conn, r["job_id"]) for r in taken.values()]
        assert len(groups) == len(set(groups)), f"two jobs of one group running at once: {groups}"
        assert len(taken) == 2  # g0 and g1: one each, the third slot passed over both
        for i, r in taken.items():
            _done(sessions[i], r)


def _claim_into(rows: dict[int, dict[str, Any]], i: int, s: Any) -> None:
    rows[i] = claim(s, "tenants") or {}


def test_a_strict_lanes_lost_attempt_holds_its_groups_room_until_its_lease_ends(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "strict", slots=2, job_timeout=60, takeover="after_lease", group_slots=1)
    a1 = pglane.enqueue(conn, "strict", {}, group="a")
    a2 = pglane.enqueue(conn, "strict", {}, group="a")
    b1 = pglane.enqueue(conn, "strict", {}, group="b")
    s1, s2 = _slots(session, "strict", 2)
    lost = claimed(s1, "strict")
    assert lost["job_id"] == a1
    terminate(conn, s1.info.backend_pid)
    wait_until(lambda: conn.execute("SELECT pglane.recover('strict') AS n").fetchone()["n"], 10, "recovery")
    # The lane has room (2 slots, 1 lost lease), but group a's lost call may still be running.
    b = claimed(s2, "strict")
    assert b["job_id"] == b1
    assert "group a" in pglane.job_status(conn, a2)["next_safe_action"]
    _done(s2, b)
    assert claim(s2, "strict") is None  # a2 still waits: the lost call's lease runs on
    pglane.release_lease(conn, lost["attempt_id"])  # the operator's word that the call is over
    assert claimed(s2, "strict")["job_id"] == a2


def test_2000_of_one_group_then_10_of_another_the_newcomer_is_served_within_slots_and_20_starts(
        conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "fair", slots=3, job_timeout=60)
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) SELECT 'fair', '{}', 'A'"
                 " FROM generate_series(1, 2000)")
    sessions = _slots(session, "fair", 3)
    running = [claimed(s, "fair") for s in sessions]
    for _ in range(10):  # the lane has been serving A for a while
        _done(sessions[0], running[0])
        running[0] = claimed(sessions[0], "fair")
    b_jobs = {pglane.enqueue(conn, "fair", {"i": i}, group="B") for i in range(10)}
    starts: list[int] = []
    turn = 0
    while not b_jobs <= set(starts):
        i = turn % 3
        _done(sessions[i], running[i])
        running[i] = claimed(sessions[i], "fair")
        starts.append(running[i]["job_id"])
        turn += 1
        assert turn <= 40, f"B's jobs still waiting after 40 starts: {starts}"
    seqs = conn.execute("SELECT seq FROM pglane.jobs WHERE seq IS NOT NULL ORDER BY seq").fetchall()
    assert [r["seq"] for r in seqs] == list(range(1, len(seqs) + 1))  # gapless, in claim order
    first_b = next(n for n, job in enumerate(starts, 1) if job in b_jobs)
    assert first_b <= 3, f"B's first job started {first_b} starts after its enqueue"
    assert len(starts) <= 20, f"B's 10 jobs took {len(starts)} starts"


def test_one_group_alone_is_served_in_queue_order(conn: Any, lane: str) -> None:
    ids = [pglane.enqueue(conn, lane, {"i": i}, group="only") for i in range(5)]
    take_slot(conn, lane)
    order = []
    for _ in ids:
        row = claimed(conn, lane)
        order.append(row["job_id"])
        _done(conn, row)
    assert order == ids


def test_a_higher_priority_starts_first_then_fairness_then_queue_order(conn: Any, lane: str) -> None:
    low = [pglane.enqueue(conn, lane, {}, group="a") for _ in range(3)]
    urgent_b = pglane.enqueue(conn, lane, {}, group="b", priority=10)
    urgent_a = pglane.enqueue(conn, lane, {}, group="a", priority=10)
    later = pglane.enqueue(conn, lane, {}, group="b", priority=-1)
    take_slot(conn, lane)
    order = []
    for _ in range(6):
        row = claimed(conn, lane)
        order.append(row["job_id"])
        _done(conn, row)
    assert order[:2] in ([urgent_b, urgent_a], [urgent_a, urgent_b])
    assert order[2:5] == low
    assert order[5] == later


def test_lane_set_group_slots_applies_to_the_next_claim_and_none_removes_it(conn: Any, session: Any) -> None:
    pglane.create_lane(conn, "tenants", slots=2, job_timeout=60)
    for _ in range(4):
        pglane.enqueue(conn, "tenants", {}, group="a")
    s1, s2 = _slots(session, "tenants", 2)
    first = claimed(s1, "tenants")
    out = console(conn.info.dsn, "lane", "set", "tenants", "--group-slots", "1")
    assert out.returncode == 0, out.stderr
    assert "group" in out.stdout
    assert claim(s2, "tenants") is None
    shown = json.loads(console(conn.info.dsn, "lane", "show", "tenants", "--json").stdout)
    assert shown["settings"]["group-slots"] == 1
    out = console(conn.info.dsn, "lane", "set", "tenants", "--group-slots", "none")
    assert out.returncode == 0, out.stderr
    assert claimed(s2, "tenants")["job_id"] != first["job_id"]


def test_bad_group_slots_are_refused_with_what_to_do(conn: Any) -> None:
    out = console(conn.info.dsn, "lane", "create", "tenants", "--group-slots", "0")
    assert out.returncode != 0 and "group-slots" in out.stderr
    assert conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"] == 0


def test_the_console_enqueues_with_a_group_and_a_priority_and_lists_and_counts_by_group(
        conn: Any, lane: str) -> None:
    dsn = conn.info.dsn
    for group, n in (("big", 3), ("small", 1)):
        for _ in range(n):
            out = console(dsn, "enqueue", lane, "{}", "--group", group, "--priority", "2")
            assert out.returncode == 0, out.stderr
    assert conn.execute("SELECT DISTINCT priority FROM pglane.jobs").fetchone()["priority"] == 2
    listed = json.loads(console(dsn, "jobs", "--lane", lane, "--group", "small", "--json").stdout)
    assert [j["group_key"] for j in listed] == ["small"]
    groups = json.loads(console(dsn, "status", "--groups", lane, "--json").stdout)
    assert [(g["group_key"], g["queued"], g["running"]) for g in groups] == [("big", 3, 0), ("small", 1, 0)]
    text = console(dsn, "status", "--groups", lane).stdout
    assert "big" in text and "small" in text
    status = next(s for s in pglane.lane_status(conn) if s["lane"] == lane)
    assert status["groups_waiting"] == 2 and status["group_slots"] is None


def test_group_status_reads_only_the_top_groups_of_a_lane(conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) SELECT %s, '{}', 'g' || (i %% 50)"
                 " FROM generate_series(1, 1000) i", (lane,))
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) SELECT %s, '{}', 'deep'"
                 " FROM generate_series(1, 100)", (lane,))
    rows = conn.execute("SELECT * FROM pglane.group_status(%s, 5)", (lane,)).fetchall()
    assert len(rows) == 5
    assert (rows[0]["group_key"], rows[0]["queued"]) == ("deep", 100)
    assert all(r["oldest_wait"] is not None for r in rows)


# ----- real worker processes -------------------------------------------------------------------


def _most_at_once(ledger: Ledger, key_of: dict[int, Any]) -> dict[Any, int]:
    """The most calls in progress at once per key (key_of: job id -> key), from the ledger, outside
    the database. A call with no end (its process was killed mid-call) ends where it started: the
    poison payload kills its process right after the start is recorded."""
    starts = {a: (t, job) for e, job, a, t in ledger.events() if e == "start"}
    ends = {a: t for e, _, a, t in ledger.events() if e == "end"}
    points: list[tuple[int, int, Any]] = []
    for attempt, (t, job) in starts.items():
        points += [(t, 1, key_of[job]), (ends.get(attempt, t), -1, key_of[job])]
    points.sort(key=lambda p: (p[0], p[1]))  # an end before a start at the same instant
    now: collections.Counter[Any] = collections.Counter()
    most: collections.Counter[Any] = collections.Counter()
    for _, delta, key in points:
        now[key] += delta
        most[key] = max(most[key], now[key])
    return dict(most)


def test_six_workers_on_two_lanes_never_run_a_group_over_its_limit_even_when_one_is_killed_mid_call(
        conn: Any, workers: Workers, ledger: Ledger) -> None:
    # Three slots each, one running job per group: on "strict" two groups share three slots, so the
    # third slot must idle rather than start a second job of a group; on "open" seven groups share them.
    # A poisoned job kills its worker mid-call on each lane: on the strict lane its group may not start
    # another call until the lost attempt's lease ends (its worker might, for all the lane knows, run on).
    pglane.create_lane(conn, "open", slots=3, job_timeout=30, group_slots=1)
    pglane.create_lane(conn, "strict", slots=3, job_timeout=4, lease_timeout=5, takeover="after_lease",
                       group_slots=1)
    conn.execute(
        "INSERT INTO pglane.jobs (lane, payload, group_key)"
        " SELECT 'open', '{\"sleep\": 0.01}'::jsonb, 'tenant' || (i % 7) FROM generate_series(1, 260) i"
        " UNION ALL SELECT 'strict', '{\"sleep\": 0.01}'::jsonb, 'tenant' || (i % 2) FROM generate_series(1, 260) i")
    poisoned = {lane: pglane.enqueue(conn, lane, {"poison": True}, group="tenant0", priority=1)
                for lane in ("open", "strict")}
    options = ("--poll-interval", "1", "--recover-interval", "1")
    procs = {lane: [workers.start(lane, "tests.handlers:paid_call", *options) for _ in range(3)]
             for lane in ("open", "strict")}
    for lane in ("open", "strict"):
        wait_until(lambda lane=lane: any(p.poll() == -signal.SIGKILL for p in procs[lane]), 60,  # type: ignore[misc]
                   f"the poisoned call to kill a worker of lane {lane}")
        workers.start(lane, "tests.handlers:paid_call", *options)

    def finished() -> bool:
        return bool(conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status IN ('done', 'failed')"
                                 ).fetchone()["n"] == 522)
    wait_until(finished, 240, "every job to finish")
    key_of = {r["id"]: (r["lane"], r["group_key"]) for r in conn.execute("SELECT id, lane, group_key FROM pglane.jobs")}
    most = _most_at_once(ledger, key_of)
    assert {lane for lane, _ in most} == {"open", "strict"}
    assert max(most.values()) == 1, f"a group ran over its limit of 1: {most}"
    assert sorted(ledger.calls()) == sorted(key_of)  # every job called once: the poisoned ones were not retried
    lost = {lane: conn.execute("SELECT status, lease_expires_at FROM pglane.attempts WHERE job_id = %s",
                               (job,)).fetchone() for lane, job in poisoned.items()}
    assert {a["status"] for a in lost.values()} == {"lost"}
    after_lease = conn.execute(  # tenant0's first start on the strict lane after the lost one
        "SELECT min(started_at) AS t FROM pglane.jobs WHERE lane = 'strict' AND group_key = 'tenant0'"
        " AND id <> %s AND started_at > (SELECT started_at FROM pglane.jobs WHERE id = %s)",
        (poisoned["strict"], poisoned["strict"])).fetchone()["t"]
    assert after_lease >= lost["strict"]["lease_expires_at"], "the strict lane's group started during the lease"


def test_priorities_are_honoured_on_a_busy_lane(conn: Any, workers: Workers, ledger: Ledger) -> None:
    pglane.create_lane(conn, "busy", slots=2, job_timeout=30)
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key) SELECT 'busy', '{\"sleep\": 0.02}', 'bulk'"
                 " FROM generate_series(1, 300)")
    for _ in range(2):
        workers.start("busy")
    wait_until(lambda: len(ledger.calls()) >= 20, 60, "the lane to be busy")
    urgent = [pglane.enqueue(conn, "busy", {"sleep": 0.02}, group="bulk", priority=100) for _ in range(5)]
    wait_until(lambda: all(pglane.job_status(conn, j)["status"] == "done" for j in urgent), 60, "the urgent jobs")
    enqueued_at = conn.execute("SELECT max(created_at) AS t FROM pglane.jobs WHERE priority = 100").fetchone()["t"]
    started_after = conn.execute(
        "SELECT count(*) AS n FROM pglane.jobs WHERE priority = 0 AND started_at > %s"
        " AND started_at < (SELECT max(started_at) FROM pglane.jobs WHERE priority = 100)", (enqueued_at,)
    ).fetchone()["n"]
    assert started_after <= 2, f"{started_after} low-priority jobs started before the urgent ones"


def test_a_bulk_insert_finds_each_jobs_round_with_one_index_probe_not_a_walk_of_the_queue(
        conn: Any, lane: str) -> None:
    # Statistics of an empty table, as on a lane's first day: the probe must not walk the queue.
    conn.execute("ANALYZE pglane.jobs")
    reads = ("SELECT pg_stat_get_xact_tuples_fetched('pglane.jobs_group_queue'::regclass) AS probe,"
             " pg_stat_get_xact_tuples_fetched('pglane.jobs_queue'::regclass) AS queue,"
             " pg_stat_get_xact_tuples_returned('pglane.jobs'::regclass) AS seq")
    with conn.transaction():
        before = conn.execute(reads).fetchone()
        conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key)"
                     " SELECT %s, '{}', CASE WHEN i %% 3 = 0 THEN NULL ELSE 'g' || (i %% 3) END"
                     " FROM generate_series(1, 3000) i", (lane,))
        after = conn.execute(reads).fetchone()
    assert after["queue"] - before["queue"] == 0 and after["seq"] - before["seq"] == 0
    assert after["probe"] - before["probe"] <= 3000  # at most the one entry before it, per job
    ranks = conn.execute("SELECT coalesce(group_key, '') AS g, min(fair_rank) AS lo, max(fair_rank) AS hi,"
                         " count(*) AS n FROM pglane.jobs GROUP BY 1 ORDER BY 1").fetchall()
    assert [(r["lo"], r["hi"], r["n"]) for r in ranks] == [(0, 999, 1000)] * 3  # each group its own rounds


def test_lane_set_group_slots_on_a_running_lane_holds_from_the_next_start(
        conn: Any, workers: Workers, ledger: Ledger) -> None:
    pglane.create_lane(conn, "live", slots=3, job_timeout=30)
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key)"
                 " SELECT 'live', '{\"sleep\": 0.05}'::jsonb, 'one' FROM generate_series(1, 150)")
    for _ in range(3):
        workers.start("live")

    def calls_at_once() -> int:  # the most calls in progress at once so far (a call not ended runs on)
        events = sorted((t, 1 if e == "start" else -1) for e, _, _, t in ledger.events() if e in ("start", "end"))
        now = most = 0
        for _, delta in events:
            now += delta
            most = max(most, now)
        return most
    wait_until(lambda: calls_at_once() >= 2, 60, "two calls of the group at once, before the limit")
    out = console(conn.info.dsn, "lane", "set", "live", "--group-slots", "1")
    assert out.returncode == 0, out.stderr
    committed = conn.execute("SELECT clock_timestamp() AS t").fetchone()["t"]  # after set_lane's commit
    wait_until(lambda: pglane.lane_status(conn)[0]["done"] == 150, 120, "the lane to drain")
    starts = {a: t for e, _, a, t in ledger.events() if e == "start"}
    spans = {a: (starts[a], t) for e, _, a, t in ledger.events() if e == "end"}
    # Claims whose transaction began after the change read it: none of their calls overlaps another.
    after = [r["id"] for r in conn.execute("SELECT a.id FROM pglane.attempts a WHERE a.started_at > %s",
                                           (committed,))]
    assert len(after) > 10
    for attempt in after:
        start, end = spans[attempt]
        overlapping = [a for a, (s, e) in spans.items() if a != attempt and s < end and start < e]
        assert overlapping == [], f"attempt {attempt} ran beside {overlapping} after --group-slots 1"


def test_the_group_limit_reads_the_calls_in_flight_not_the_attempts_finished_before(
        conn: Any, session: Any) -> None:
    # 300 finished attempts leave dead entries in attempts_running until a vacuum (300 is far below
    # autovacuum's threshold). The limit's count must read past them once and mark them, not at every
    # claim (a bitmap scan marks nothing), and must not reach them through the lane's jobs either
    # (bench/README.md "Groups").
    pglane.create_lane(conn, "tenants", slots=2, job_timeout=60, group_slots=1)
    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key)"
                 " SELECT 'tenants', '{}', 'g' || (i % 7) FROM generate_series(1, 302) i")
    s1, s2 = _slots(session, "tenants", 2)
    for _ in range(300):
        _done(s1, claimed(s1, "tenants"))
    held = claimed(s2, "tenants")  # one call in flight: its group is full
    reads = ("SELECT c.relname, pg_stat_get_xact_tuples_returned(c.oid) AS n FROM pg_class c"  # rows scanned,
             " WHERE c.relnamespace = 'pglane'::regnamespace AND c.relkind IN ('r', 'i')")  # index entries read
    full = "SELECT (pglane.full_groups(l)).* FROM pglane.lanes l WHERE l.name = 'tenants'"
    with s1.transaction():
        before = {r["relname"]: r["n"] for r in s1.execute(reads)}
        answers = [s1.execute(full).fetchone() for _ in range(10)]
        after = {r["relname"]: r["n"] for r in s1.execute(reads)}
    assert answers == [{"groups": [_group_of(conn, held["job_id"])], "shared": False}] * 10
    read = {name: after[name] - before[name] for name in after if after[name] > before[name]}
    assert sum(read.values()) <= 300 + 10 * 10, f"10 counts of the calls in flight read {read}"
