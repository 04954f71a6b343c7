"""Hostile input and hostile sessions, as real login roles: nothing a producer sends stops a lane,
nothing another session forges is written, a producer reads only its own jobs, a squatter on a slot
is named, and a producer's open transaction holds up no claim."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pglane
from tests.conftest import ROOT
from tests.test_cli import run

LOGINS = {  # login role -> the pglane group it is granted (None: no pglane role at all)
    "hostile_producer_a": "pglane_producer",
    "hostile_producer_b": "pglane_producer",
    "hostile_worker_a": "pglane_worker",
    "hostile_worker_b": "pglane_worker",
    "hostile_operator": "pglane_operator",
    "hostile_squatter": None,
}


@pytest.fixture
def login(dsn: str, conn: Any) -> Iterator[Callable[[str], psycopg.Connection[dict[str, Any]]]]:
    """Connect as one of LOGINS: a real login of its own, not SET ROLE in a superuser's session."""
    for name, group in LOGINS.items():
        conn.execute(f"DO $$ BEGIN CREATE ROLE {name} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        if group is not None:
            conn.execute(f"GRANT {group} TO {name}")
    opened: list[psycopg.Connection[dict[str, Any]]] = []

    def connect(name: str) -> psycopg.Connection[dict[str, Any]]:
        c = pglane.connect(make_conninfo(dsn, user=name))
        opened.append(c)
        return c

    yield connect
    for c in opened:
        c.close()


def take_slot(c: Any, lane: str, mode: str = "") -> None:
    c.execute(f"SELECT pg_advisory_lock{mode}(id, 1) FROM pglane.lanes WHERE name = %s", (lane,))


def claim(c: Any, lane: str) -> dict[str, Any]:
    row = c.execute("SELECT * FROM pglane.claim(%s, 'w')", (lane,)).fetchone()
    assert row is not None
    return dict(row)


# ----- a payload no consumer could decode is refused at the door --------------------------------


@pytest.mark.parametrize(("payload", "why"), [
    ("[" * 2000 + "]" * 2000, "nested more than 64 levels"),
    ('{"a": ' + "[" * 65 + "]" * 65 + "}", "nested more than 64 levels"),
    ('{"n": 1' + "0" * 5000 + "}", "1000 or more digits"),
    ('{"n": -1e999}', "1000 or more digits"),
])
def test_a_payload_no_consumer_can_decode_is_refused_by_enqueue_and_plain_insert(
    login: Callable[[str], Any], conn: Any, lane: str, payload: str, why: str
) -> None:
    producer = login("hostile_producer_a")
    with pytest.raises(psycopg.Error, match=why) as by_function:
        producer.execute("SELECT pglane.enqueue(%s, %s::jsonb)", (lane, payload))
    assert by_function.value.sqlstate == "PGL02"
    with pytest.raises(psycopg.Error, match=why):
        producer.execute("INSERT INTO pglane.jobs (lane, payload) VALUES (%s, %s::jsonb)", (lane, payload))
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0


def test_the_deepest_and_largest_payload_allowed_is_taken(login: Callable[[str], Any], lane: str) -> None:
    producer = login("hostile_producer_a")
    deep = "[" * 64 + "]" * 64
    big = '{"n": 9' + "9" * 997 + "}"  # 998 digits
    for payload in (deep, big):
        assert producer.execute("SELECT pglane.enqueue(%s, %s::jsonb) AS id", (lane, payload)).fetchone()["id"]


def test_a_payload_is_measured_as_jsonb_before_compression(conn: Any, lane: str) -> None:
    conn.execute("UPDATE pglane.lanes SET max_payload_bytes = 2000 WHERE name = %s", (lane,))
    with pytest.raises(pglane.PayloadTooLarge, match="uncompressed"):
        pglane.enqueue(conn, lane, {"s": "x" * 5000})  # compresses to far less than 2000 bytes


# ----- only the claimer writes an outcome ---------------------------------------------------------


def test_another_worker_session_cannot_forge_an_outcome_and_changes_nothing(
    login: Callable[[str], Any], conn: Any, lane: str
) -> None:
    honest, forger = login("hostile_worker_a"), login("hostile_worker_b")
    job = pglane.enqueue(conn, lane, {"q": 1})
    take_slot(honest, lane)
    row = claim(honest, lane)
    attempt, token = row["attempt_id"], row["token"]
    before = conn.execute("SELECT * FROM pglane.jobs WHERE id = %s", (job,)).fetchone()
    forgeries = [
        ("SELECT pglane.complete(%s, '{\"forged\": 1}')", (attempt,)),
        ("SELECT pglane.fail(%s, 'forged')", (attempt,)),
        ("SELECT pglane.complete(%s, '{\"forged\": 1}', gen_random_uuid())", (attempt,)),
        ("SELECT pglane.fail(%s, 'forged', true, gen_random_uuid())", (attempt,)),
    ]
    for statement, args in forgeries:
        with pytest.raises(psycopg.Error, match="claimed by another session") as refused:
            forger.execute(statement, args)
        assert refused.value.sqlstate == "PGL12"
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        forger.execute("SELECT token FROM pglane.attempts")
    assert conn.execute("SELECT * FROM pglane.jobs WHERE id = %s", (job,)).fetchone() == before
    # The claimer's own completion is still accepted: with its token, from a new session too.
    late = login("hostile_worker_a")
    assert late.execute("SELECT pglane.complete(%s, '{\"ok\": 1}', %s) AS ok", (attempt, token)).fetchone()["ok"]
    assert pglane.result(conn, job) == {"ok": 1}


def test_the_claiming_session_needs_no_token(login: Callable[[str], Any], conn: Any, lane: str) -> None:
    worker = login("hostile_worker_a")
    job = pglane.enqueue(conn, lane, {})
    take_slot(worker, lane)
    attempt = claim(worker, lane)["attempt_id"]
    assert worker.execute("SELECT pglane.complete(%s, '1') AS ok", (attempt,)).fetchone()["ok"]
    assert pglane.job_status(conn, job)["status"] == "done"


# ----- a producer reads its own jobs only ---------------------------------------------------------


def test_a_producer_sees_its_own_jobs_keys_errors_and_results_only(
    login: Callable[[str], Any], conn: Any, lane: str
) -> None:
    a, b, operator = login("hostile_producer_a"), login("hostile_producer_b"), login("hostile_operator")
    mine = pglane.enqueue(a, lane, {"secret": "customer 1"}, key="order-1")
    pglane.enqueue(b, lane, {"other": 1}, key="order-2")
    take_slot(conn, lane)
    attempt = claim(conn, lane)["attempt_id"]
    conn.execute("SELECT pglane.fail(%s, 'Traceback: customer 1 said ...')", (attempt,))

    assert [r["job_id"] for r in b.execute("SELECT job_id FROM pglane.job_status")] != [mine]
    assert mine not in [r["job_id"] for r in b.execute("SELECT job_id FROM pglane.job_status")]
    assert b.execute("SELECT idempotency_key FROM pglane.jobs ORDER BY 1").fetchall() == [
        {"idempotency_key": "order-2"}]
    with pytest.raises(pglane.UnknownJob):
        pglane.job_status(b, mine)
    mine_as_a = pglane.job_status(a, mine)
    assert mine_as_a["status"] == "failed" and "customer 1" in mine_as_a["last_error"]
    assert {r["job_id"] for r in operator.execute("SELECT job_id FROM pglane.job_status")} == {mine, mine + 1}

    # The same key, with the same or another payload: one answer, which says nothing of that job.
    answers = []
    for payload in ({"secret": "customer 1"}, {"secret": "a guess"}):
        with pytest.raises(pglane.IdempotencyConflict) as refused:
            pglane.enqueue(b, lane, payload, key="order-1")
        answers.append(str(refused.value))
    assert answers[0] == answers[1] and f"job {mine}" not in answers[0] and "customer" not in answers[0]
    assert pglane.enqueue(a, lane, {"secret": "customer 1"}, key="order-1") == mine


def test_a_producer_cannot_claim_its_enqueued_by_another(login: Callable[[str], Any], conn: Any, lane: str) -> None:
    a = login("hostile_producer_a")
    a.execute("INSERT INTO pglane.jobs (lane, payload) VALUES (%s, '{}')", (lane,))
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        a.execute("INSERT INTO pglane.jobs (lane, payload, enqueued_by) VALUES (%s, '{}', 'someone')", (lane,))
    a.rollback()
    assert conn.execute("SELECT enqueued_by FROM pglane.jobs").fetchall() == [{"enqueued_by": "hostile_producer_a"}]


# ----- squatters and stalls are visible -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["", "_shared"])
def test_a_session_squatting_a_slot_is_named_with_the_way_out(
    login: Callable[[str], Any], conn: Any, lane: str, mode: str
) -> None:
    squatter = login("hostile_squatter")
    pid = squatter.execute("SELECT pg_backend_pid() AS pid").fetchone()["pid"]
    lane_id = conn.execute("SELECT id FROM pglane.lanes WHERE name = %s", (lane,)).fetchone()["id"]
    squatter.execute(f"SELECT pg_advisory_lock{mode}(%s, 1)", (lane_id,))  # no pglane role needed
    pglane.enqueue(conn, lane, {})
    row = next(r for r in pglane.lane_status(conn) if r["lane"] == lane)
    assert row["squatters"] == 1
    assert row["holders"] == [{"slot": 1, "pid": pid, "role": "hostile_squatter", "application": "",
                               "mode": "ShareLock" if mode else "ExclusiveLock", "granted": True,
                               "squatter": True}]
    assert f"end session {pid}" in row["next_safe_action"]
    assert f"pg_terminate_backend({pid})" in row["next_safe_action"]


def test_a_pglane_worker_holding_its_slot_is_no_squatter(login: Callable[[str], Any], conn: Any, lane: str) -> None:
    worker = login("hostile_worker_a")
    take_slot(worker, lane)
    row = next(r for r in pglane.lane_status(conn) if r["lane"] == lane)
    assert (row["squatters"], row["consumers"], row["next_safe_action"]) == (0, 1, "nothing to do")
    assert [h["role"] for h in row["holders"]] == ["hostile_worker_a"]


def test_a_producers_open_transaction_on_a_bounded_lane_holds_up_no_claim(
    login: Callable[[str], Any], conn: Any, lane: str
) -> None:
    conn.execute("UPDATE pglane.lanes SET max_queued = 10 WHERE name = %s", (lane,))
    first = pglane.enqueue(conn, lane, {})
    producer = login("hostile_producer_a")
    producer.autocommit = False
    pglane.enqueue(producer, lane, {})  # holds the lane's admissions row until it ends
    worker = login("hostile_worker_a")
    take_slot(worker, lane)
    worker.execute("SET lock_timeout = '2s'")
    assert claim(worker, lane)["job_id"] == first
    producer.rollback()


def test_the_bound_counts_a_producers_open_admission(login: Callable[[str], Any], conn: Any, lane: str) -> None:
    conn.execute("UPDATE pglane.lanes SET max_queued = 1 WHERE name = %s", (lane,))
    producer = login("hostile_producer_a")
    producer.autocommit = False
    pglane.enqueue(producer, lane, {})
    other = login("hostile_producer_b")
    other.execute("SET lock_timeout = '200ms'")  # it waits for the first producer: no place is certain yet
    with pytest.raises(psycopg.errors.LockNotAvailable):
        other.execute("SELECT pglane.enqueue(%s, '{}')", (lane,))
    producer.commit()
    with pytest.raises(pglane.LaneFull):
        pglane.enqueue(login("hostile_producer_b"), lane, {})


# ----- bounded texts, pinned helpers --------------------------------------------------------------


def test_a_huge_error_is_kept_to_its_head_and_tail(conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    take_slot(conn, lane)
    attempt = claim(conn, lane)["attempt_id"]
    error = "Traceback (most recent call last):\n" + "x" * 1_000_000 + "\nValueError: the real cause"
    assert conn.execute("SELECT pglane.fail(%s, %s) AS ok", (attempt, error)).fetchone()["ok"]
    stored = conn.execute("SELECT j.last_error, a.error FROM pglane.jobs j JOIN pglane.attempts a ON a.job_id = j.id"
                          " WHERE j.id = %s", (job,)).fetchone()
    for text in stored.values():
        assert len(text) < 66_000
        assert text.startswith("Traceback (most recent call last):")
        assert text.endswith("ValueError: the real cause")
        assert f"[... {len(error) - 65536} characters cut ...]" in text


def test_every_function_a_pglane_role_may_call_runs_with_a_fixed_search_path(conn: Any) -> None:
    loose = conn.execute(
        "SELECT p.oid::regprocedure::text AS name FROM pg_proc p"
        " WHERE p.pronamespace = 'pglane'::regnamespace"
        "   AND (has_function_privilege('pglane_producer', p.oid, 'EXECUTE')"
        "        OR has_function_privilege('pglane_worker', p.oid, 'EXECUTE')"
        "        OR has_function_privilege('pglane_operator', p.oid, 'EXECUTE'))"
        "   AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'search_path=%%')"
        " ORDER BY 1").fetchall()
    assert loose == []


# ----- the command line answers bad input in one line ---------------------------------------------


def test_a_null_payload_is_refused_like_any_other_scalar(dsn: str, conn: Any, lane: str) -> None:
    done = run("enqueue", lane, "null", dsn=dsn)
    assert done.returncode == 1 and "payload must be a JSON object or array, not null" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    with pytest.raises(pglane.InvalidPayload):
        pglane.enqueue(conn, lane, None)
    assert pglane.job_status(conn, pglane.enqueue(conn, lane))["status"] == "queued"  # no payload: {}
    assert conn.execute("SELECT payload FROM pglane.jobs").fetchall() == [{"payload": {}}]


def test_a_login_without_the_role_it_needs_gets_one_line_saying_which(
    login: Callable[[str], Any], dsn: str, lane: str
) -> None:
    login("hostile_squatter")  # creates the logins
    for args in (("status",), ("enqueue", lane, "{}"), ("retry", "1")):
        done = run(*args, dsn=make_conninfo(dsn, user="hostile_squatter"))
        assert done.returncode == 1, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "permission denied" in done.stderr and "GRANT pglane_" in done.stderr


def test_an_argument_that_is_not_utf8_gets_one_line(dsn: str, lane: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PGLANE_DSN"} | {"PGLANE_DSN": dsn}
    done = subprocess.run([sys.executable.encode(), b"-m", b"pglane", b"enqueue", b"br\xffin", b"{}"],
                          capture_output=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().strip().splitlines() == [
        "pglane: an argument is not valid UTF-8 (surrogates not allowed); pass names, keys and payloads as UTF-8 text"]
