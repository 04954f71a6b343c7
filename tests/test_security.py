"""Least privilege and hostile input: a privilege matrix over the three group roles, a search_path
hijack that changes nothing, and hostile lane names and payloads (Hypothesis) that never run SQL,
never crash a worker and never leave rows behind."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pglane
from pglane import queries
from tests.conftest import Workers, claim, claimed, metrics_port, scrape, take_slot, wait_until

ROLES = ("producer", "worker", "operator", "nobody")


@pytest.fixture
def as_role(dsn: str, conn: Any) -> Iterator[Callable[[str], Any]]:
    """Connections acting as a member of pglane_<role> (or of no pglane role: 'nobody')."""
    if not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("the privilege matrix needs a superuser test connection to switch roles")
    for role in ROLES:
        name = f"pglane_test_{role}"
        conn.execute(f"DO $$ BEGIN CREATE ROLE {name} NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        if role != "nobody":
            conn.execute(f"GRANT pglane_{role} TO {name}")
    opened: list[Any] = []

    def connect(role: str) -> Any:
        c = pglane.connect(dsn)
        c.execute(f"SET ROLE pglane_test_{role}")
        opened.append(c)
        return c

    yield connect
    for c in opened:
        c.close()


def _claimed(conn: Any, session: Any) -> tuple[int, str]:
    """A running attempt claimed by ``session`` (which takes the slot), as the owner sets it up: its id
    and its token, which any session may use to write its outcome."""
    pglane.enqueue(conn, "brain", {})
    take_slot(session, "brain")
    row = claimed(session, "brain")
    return int(row["attempt_id"]), str(row["token"])


def _failed(conn: Any) -> int:
    job = pglane.enqueue(conn, "brain", {})
    conn.execute("UPDATE pglane.jobs SET status = 'failed', failed_or_cancelled = true, finished_at = now()"
                 " WHERE id = %s", (job,))
    return job


OPERATIONS: dict[str, tuple[set[str], Callable[[Any, Any, Any], Any]]] = {
    "enqueue()": ({"producer"}, lambda c, admin, new: c.execute("SELECT pglane.enqueue('brain', '{}')")),
    "plain INSERT": ({"producer"}, lambda c, admin, new: c.execute(
        "INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES ('brain', '{}', 'k')")),
    "INSERT ON CONFLICT DO NOTHING": ({"producer"}, lambda c, admin, new: c.execute(
        "INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES ('brain', '{}', 'k')"
        " ON CONFLICT (lane, idempotency_key) DO NOTHING")),
    "INSERT a status": (set(), lambda c, admin, new: c.execute(
        "INSERT INTO pglane.jobs (lane, payload, status) VALUES ('brain', '{}', 'queued')")),
    "read job status": ({"producer", "operator"}, lambda c, admin, new: c.execute(
        "SELECT * FROM pglane.job_status")),
    "claim": ({"worker"}, lambda c, admin, new: (pglane.enqueue(admin, "brain", {}),
                                                 c.execute("SELECT pg_advisory_lock(1, 1)"),
                                                 c.execute("SELECT * FROM pglane.claim('brain', 'w')"))),
    "complete": ({"worker"}, lambda c, admin, new: c.execute(
        "SELECT pglane.complete(%s, '{}', %s)", _claimed(admin, new()))),
    "fail": ({"worker"}, lambda c, admin, new: c.execute(
        "SELECT pglane.fail(%s, 'boom', false, %s)", _claimed(admin, new()))),
    "recover": ({"worker", "operator"}, lambda c, admin, new: c.execute("SELECT pglane.recover('brain')")),
    "retry": ({"operator"}, lambda c, admin, new: c.execute("SELECT pglane.retry(%s)", (_failed(admin),))),
    "cancel": ({"operator"}, lambda c, admin, new: c.execute(
        "SELECT pglane.cancel(%s)", (pglane.enqueue(admin, "brain", {}),))),
    "read payloads": ({"worker", "operator"}, lambda c, admin, new: c.execute("SELECT payload FROM pglane.jobs")),
    "read attempts": ({"worker", "operator"}, lambda c, admin, new: c.execute(
        "SELECT id, job_id, status, worker, backend_pid, error FROM pglane.attempts")),
    "read attempt tokens": ({"operator"}, lambda c, admin, new: c.execute("SELECT token FROM pglane.attempts")),
    "read lane status": ({"operator"}, lambda c, admin, new: c.execute("SELECT * FROM pglane.lane_status")),
    "prune": ({"operator"}, lambda c, admin, new: c.execute("SELECT pglane.prune(interval '1 day')")),
    "call a function body directly": (set(), lambda c, admin, new: c.execute(
        "SELECT * FROM pglane.claim_impl('brain', 'w')")),
    "UPDATE jobs": (set(), lambda c, admin, new: c.execute("UPDATE pglane.jobs SET status = 'done'")),
    "DELETE jobs": (set(), lambda c, admin, new: c.execute("DELETE FROM pglane.jobs")),
    "UPDATE attempts": (set(), lambda c, admin, new: c.execute("UPDATE pglane.attempts SET error = 'x'")),
    "DELETE attempts": (set(), lambda c, admin, new: c.execute("DELETE FROM pglane.attempts")),
    "change a lane": (set(), lambda c, admin, new: c.execute("UPDATE pglane.lanes SET slots = 5")),
    "bump the seq": (set(), lambda c, admin, new: c.execute("UPDATE pglane.lane_counters SET last_seq = 0")),
}


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_privilege_matrix(as_role: Callable[[str], Any], conn: Any, lane: str, role: str, operation: str) -> None:
    allowed, run = OPERATIONS[operation]
    session = as_role(role)
    if role in allowed:
        run(session, conn, lambda: as_role("worker"))
    else:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
            run(session, conn, lambda: as_role("worker"))
        assert "permission denied" in str(refused.value)


def test_a_worker_role_reads_its_own_queue_gauges(as_role: Callable[[str], Any], conn: Any, lane: str) -> None:
    for _ in range(2):
        pglane.enqueue(conn, lane, {})
    worker = as_role("worker")
    take_slot(worker, lane)
    assert claim(worker, lane) is not None
    row = worker.execute(queries.QUEUE_GAUGES, {"lane": lane}).fetchone()
    assert (row["queued"], row["running"]) == (1, 1)


def test_a_worker_process_logged_in_as_a_worker_role_runs_jobs_and_reports_its_gauges(
    as_role: Callable[[str], Any], dsn: str, conn: Any, lane: str, workers: Workers
) -> None:
    from psycopg.conninfo import make_conninfo

    conn.execute("DO $$ BEGIN CREATE ROLE pglane_test_login LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    conn.execute("GRANT pglane_worker TO pglane_test_login")
    long_call = pglane.enqueue(conn, lane, {"sleep": 60})
    for _ in range(2):
        pglane.enqueue(conn, lane, {})
    proc = workers.start(lane, "tests.handlers:paid_call", "--metrics-port", "0",
                         env={"PGLANE_DSN": make_conninfo(dsn, user="pglane_test_login")})
    port = metrics_port(proc)
    wait_until(lambda: pglane.job_status(conn, long_call)["status"] == "running", 20, "the worker's first claim")
    metrics = wait_until(lambda: (m := scrape(port)) and m.get("pglane_running_jobs") == 1 and m, 20, "the gauges")
    assert metrics["pglane_queue_depth"] == 2
    assert conn.execute("SELECT usename FROM pg_stat_activity WHERE application_name LIKE 'pglane %%'"
                        ).fetchone()["usename"] == "pglane_test_login"


def test_the_roles_migration_is_safe_to_run_again_after_a_downgrade(dsn: str, conn: Any) -> None:
    from pglane import schema

    schema.downgrade(dsn)  # to base: the schema goes, the roles stay
    roles = conn.execute("SELECT count(*) AS n FROM pg_roles WHERE rolname LIKE 'pglane\\_%%'"
                         " AND rolname NOT LIKE 'pglane\\_test\\_%%'").fetchone()["n"]
    assert roles == 3  # cluster-wide roles stay for the other databases
    schema.upgrade(dsn)
    schema.upgrade(dsn)
    acl = conn.execute("SELECT has_function_privilege('pglane_producer',"
                       " 'pglane.enqueue(text,jsonb,text,timestamptz,text,integer,text,integer,interval,text)',"
                       " 'EXECUTE') AS p,"
                       " has_function_privilege('public', 'pglane.claim(text,text)', 'EXECUTE') AS q").fetchone()
    assert (acl["p"], acl["q"]) == (True, False)


def test_a_search_path_hijack_changes_nothing(as_role: Callable[[str], Any], conn: Any, lane: str) -> None:
    conn.execute("DROP SCHEMA IF EXISTS evil CASCADE")
    conn.execute("CREATE SCHEMA evil AUTHORIZATION pglane_test_producer")
    producer = as_role("producer")
    # Shadows of what pglane's functions use, in a writable schema and in pg_temp.
    producer.execute("CREATE FUNCTION evil.jsonb_typeof(jsonb) RETURNS text LANGUAGE sql AS $$ SELECT 'object' $$")
    producer.execute("CREATE FUNCTION evil.pg_column_size(jsonb) RETURNS integer LANGUAGE sql AS $$ SELECT 1 $$")
    producer.execute("CREATE FUNCTION evil.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT 'epoch'::timestamptz $$")
    producer.execute("CREATE TEMP TABLE lanes (id integer, name text, max_payload_bytes integer)")
    producer.execute("INSERT INTO pg_temp.lanes VALUES (1, 'ghost', 100000000)")
    producer.execute("CREATE TEMP TABLE jobs (id bigint)")
    producer.execute("SET search_path = evil, pg_temp, pglane, public, pg_catalog")
    refusals = [
        ("SELECT pglane.enqueue('brain', '3')", (), "PGL02"),  # a scalar is still refused
        ("SELECT pglane.enqueue('ghost', '{}')", (), "PGL01"),  # the temp 'lanes' is not consulted
        ("INSERT INTO pglane.jobs (lane, payload) VALUES ('brain', %s::jsonb)",
         (json.dumps({"x": "y" * 2_000_000}),), "PGL03"),  # the size check is the real one
    ]
    for statement, params, code in refusals:
        with pytest.raises(psycopg.Error) as refused:
            producer.execute(statement, params)
        assert refused.value.sqlstate == code
    producer.execute("SELECT pglane.enqueue('brain', '{\"ok\": true}')")
    row = conn.execute("SELECT count(*) AS n, min(created_at) > now() - interval '1 minute' AS recent"
                       " FROM pglane.jobs").fetchone()
    assert (row["n"], row["recent"]) == (1, True)  # and its timestamp came from the real now()
    conn.execute("DROP SCHEMA evil CASCADE")


lane_names = st.one_of(
    st.text(min_size=0, max_size=80),
    st.sampled_from(["brain'; DROP TABLE pglane.jobs; --", 'x"; SELECT 1; --', "Brain", "a b", "é", "a" * 49,
                     "pglane_1", "1abc", "-a", "lane\x00", "$$", "a;b"]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=lane_names)
def test_hostile_lane_names_are_refused_or_accepted_by_the_pattern_and_run_no_sql(conn: Any, name: str) -> None:
    import re

    valid = re.fullmatch(r"[a-z][a-z0-9_-]{0,47}", name) is not None
    before = conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"]
    try:
        pglane.create_lane(conn, name, job_timeout=10)
    except pglane.InvalidInput:
        assert not valid
        assert conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"] == before
    else:
        assert valid
        conn.execute("DELETE FROM pglane.lanes WHERE name = %s", (name,))
    with pytest.raises(pglane.InvalidInput):
        pglane.enqueue(conn, name + "~", {})  # never a lane (the pattern has no '~')
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0
    assert conn.execute("SELECT to_regclass('pglane.jobs') IS NOT NULL AS ok").fetchone()["ok"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63) | st.floats(allow_nan=False,
    allow_infinity=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
payloads = st.one_of(json_values, st.sampled_from([float("nan"), b"bytes", {1: object()}, "'; DROP TABLE x; --"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=payloads)
def test_hostile_payloads_are_stored_exactly_or_refused_with_nothing_written(
    conn: Any, lane: str, payload: Any
) -> None:
    conn.execute("DELETE FROM pglane.jobs")
    try:
        job = pglane.enqueue(conn, lane, payload)
    except pglane.InvalidInput as exc:
        assert str(exc)
        assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0
        return
    expected = {} if payload is None else payload  # no payload means the empty object
    assert isinstance(expected, (dict, list))
    same = conn.execute("SELECT payload = %s::jsonb AS same FROM pglane.jobs WHERE id = %s",
                        (json.dumps(expected), job)).fetchone()["same"]
    assert same  # jsonb equality: numbers compare as the decimals that were sent


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(json_values.filter(lambda v: isinstance(v, (dict, list))), min_size=30, max_size=30))
def test_hostile_payloads_never_crash_a_worker(conn: Any, lane: str, workers: Workers, batch: list[Any]) -> None:
    batch = [*batch, {"nul": "a\u0000b"}, ["\ud7ff", "\U0001f600"], {"deep": [[[[[[]]]]]]}]
    accepted = []
    for payload in batch:
        with contextlib.suppress(pglane.InvalidInput):
            accepted.append(pglane.enqueue(conn, lane, payload))
    proc = workers.start(lane, "tests.handlers:echo")
    wait_until(lambda: conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status = 'queued'")
               .fetchone()["n"] == 0 and conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE status"
                                                      " = 'running'").fetchone()["n"] == 0, 60, "the batch")
    assert proc.poll() is None, Workers.log(proc)
    done = {r["id"]: r for r in conn.execute("SELECT id, status, payload, result FROM pglane.jobs")}
    for job in accepted:
        assert done[job]["status"] == "done" and done[job]["result"] == {"echo": done[job]["payload"]}


def test_migrating_a_second_database_of_the_cluster_reuses_the_roles(dsn: str, conn: Any) -> None:
    from psycopg.conninfo import make_conninfo

    from pglane import schema

    conn.execute("DROP DATABASE IF EXISTS pglane_second")
    conn.execute("CREATE DATABASE pglane_second")
    try:
        second = make_conninfo(dsn, dbname="pglane_second")
        schema.upgrade(second)
        with pglane.connect(second) as other:
            granted = other.execute("SELECT has_function_privilege('pglane_worker', 'pglane.claim(text,text)',"
                                    " 'EXECUTE') AS ok").fetchone()
            assert granted is not None and granted["ok"]
    finally:
        conn.execute("DROP DATABASE IF EXISTS pglane_second WITH (FORCE)")
