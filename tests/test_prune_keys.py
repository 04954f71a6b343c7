"""Keys outlive prune: a pruned job's idempotency key is remembered for its lane's key retention (30 days
by default), so a repeated request gets the pruned job's id and JobPruned (PGL14), never a second
paid call; through pglane.enqueue() and a plain INSERT alike, batched or not. --forget-keys, a
retention that has passed, or a deleted lane forget it."""

from __future__ import annotations

from typing import Any

import pytest

import pglane
from pglane.errors import IdempotencyConflict, JobPruned
from tests.conftest import claimed, console, take_slot


def done_job(conn: Any, lane: str, key: str, payload: dict[str, Any] | None = None) -> int:
    """A job with ``key`` run to done by this session (which holds the lane's slot)."""
    job = pglane.enqueue(conn, lane, payload or {"q": key}, key=key)
    row = claimed(conn, lane)
    assert row["job_id"] == job
    assert conn.execute("SELECT pglane.complete(%s, '{\"paid\": 1}') AS ok", (row["attempt_id"],)).fetchone()["ok"]
    return job


def jobs(conn: Any) -> int:
    return int(conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"])


@pytest.mark.parametrize("batch", [None, 1])
def test_a_repeated_key_after_prune_gets_the_pruned_job_and_no_new_one(conn: Any, lane: str, batch: int | None) -> None:
    take_slot(conn, lane)
    job = done_job(conn, lane, "report-7")
    assert pglane.prune(conn, 0, batch=batch) == 1
    assert jobs(conn) == 0
    with pytest.raises(JobPruned) as refused:
        pglane.enqueue(conn, lane, {"q": "report-7"}, key="report-7")
    assert refused.value.job_id == job
    assert f"job {job}" in str(refused.value) and "new key" in str(refused.value)
    # Whatever the payload, and by a plain INSERT too (ON CONFLICT cannot see a pruned job).
    with pytest.raises(JobPruned), pglane.client.translated():
        conn.execute("INSERT INTO pglane.jobs (lane, payload, idempotency_key) VALUES (%s, '{}', 'report-7')"
                     " ON CONFLICT (lane, idempotency_key) DO NOTHING", (lane,))
    assert jobs(conn) == 0, "a pruned key made a new job"
    assert pglane.enqueue(conn, lane, {"q": "report-7"}, key="report-8") > job  # a new key is a new request


def test_forget_keys_lets_the_same_key_make_a_new_job(conn: Any, lane: str) -> None:
    take_slot(conn, lane)
    job = done_job(conn, lane, "k")
    assert pglane.prune(conn, 0, forget_keys=True) == 1
    again = pglane.enqueue(conn, lane, {"q": "k"}, key="k")
    assert again != job and jobs(conn) == 1


def test_a_key_is_remembered_for_its_lanes_retention_only(conn: Any, lane: str) -> None:
    take_slot(conn, lane)
    old, recent = done_job(conn, lane, "old"), done_job(conn, lane, "recent")
    conn.execute("UPDATE pglane.jobs SET finished_at = now() - interval '31 days' WHERE id = %s", (old,))
    assert pglane.prune(conn, 0) == 2
    assert pglane.enqueue(conn, lane, {"q": "old"}, key="old") > recent  # past the 30 days: forgotten
    with pytest.raises(JobPruned):
        pglane.enqueue(conn, lane, {"q": "recent"}, key="recent")
    # A lane whose retention is lowered keeps later pruned keys only as long.
    pglane.set_lane(conn, lane, key_retention="0")
    take_slot(conn, lane)
    conn.execute("UPDATE pglane.jobs SET status = 'cancelled', failed_or_cancelled = true, finished_at = now()"
                 " WHERE idempotency_key = 'old'")
    assert pglane.prune(conn, 0) == 1
    assert pglane.enqueue(conn, lane, {"q": "old"}, key="old")


def test_expired_keys_are_forgotten_by_the_next_prune(conn: Any, lane: str) -> None:
    take_slot(conn, lane)
    done_job(conn, lane, "a")
    pglane.prune(conn, 0)
    conn.execute("UPDATE pglane.pruned_keys SET forget_after = now() - interval '1 second'")
    done_job(conn, lane, "b")
    pglane.prune(conn, 0)
    kept = [r["idempotency_key"] for r in conn.execute("SELECT idempotency_key FROM pglane.pruned_keys")]
    assert kept == ["b"]


def test_another_producers_pruned_key_is_refused_as_in_use_revealing_nothing(conn: Any, lane: str) -> None:
    if not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("acting as two producers needs a superuser test connection to switch roles")
    for name in ("pglane_test_keys_a", "pglane_test_keys_b"):
        conn.execute(f"DO $$ BEGIN CREATE ROLE {name} NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute(f"GRANT pglane_producer TO {name}")
    conn.execute("SET ROLE pglane_test_keys_a")
    pglane.enqueue(conn, lane, {"q": 1}, key="shared")
    conn.execute("RESET ROLE")
    take_slot(conn, lane)
    row = claimed(conn, lane)
    conn.execute("SELECT pglane.complete(%s, '{}')", (row["attempt_id"],))
    pglane.prune(conn, 0)
    conn.execute("SET ROLE pglane_test_keys_b")
    try:
        with pytest.raises(IdempotencyConflict) as refused:
            pglane.enqueue(conn, lane, {"q": 1}, key="shared")
        assert "another producer" in str(refused.value) and str(row["job_id"]) not in str(refused.value)
        conn.execute("SET ROLE pglane_test_keys_a")
        with pytest.raises(JobPruned):  # its own producer is told
            pglane.enqueue(conn, lane, {"q": 1}, key="shared")
    finally:
        conn.execute("RESET ROLE")


def test_deleting_a_lane_forgets_its_keys(conn: Any, lane: str) -> None:
    take_slot(conn, lane)
    done_job(conn, lane, "k")
    pglane.prune(conn, 0)
    conn.execute("SELECT pg_advisory_unlock_all()")
    conn.execute("DELETE FROM pglane.lanes WHERE name = %s", (lane,))
    assert conn.execute("SELECT count(*) AS n FROM pglane.pruned_keys").fetchone()["n"] == 0


def test_the_console_script_says_pruned_with_exit_6_and_forgets_only_when_told(dsn: str, conn: Any) -> None:
    import json

    def pglane_cli(*args: str) -> Any:
        return console(dsn, *args)

    created = pglane_cli("lane", "create", "keys", "--key-retention", "2d", "--json")
    assert created.returncode == 0 and json.loads(created.stdout)["key-retention"] == 2 * 86400, created.stderr
    take_slot(conn, "keys")
    job = done_job(conn, "keys", "report-7", {"q": 7})
    pruned = pglane_cli("prune", "--older-than", "0s")
    assert pruned.returncode == 0 and "keys are remembered" in pruned.stdout, pruned.stderr
    again = pglane_cli("enqueue", "keys", '{"q": 7}', "--key", "report-7")
    assert again.returncode == 6 and f"job {job}" in again.stderr and "Traceback" not in again.stderr, again
    assert len(again.stderr.strip().splitlines()) == 1
    forgot = pglane_cli("prune", "--older-than", "0s", "--forget-keys")
    assert forgot.returncode == 0 and "forgotten" in forgot.stdout, forgot.stderr
    made = pglane_cli("enqueue", "keys", '{"q": 7}', "--key", "report-7")
    assert made.returncode == 0 and int(made.stdout) != job
    changed = pglane_cli("lane", "set", "keys", "--key-retention", "7d")
    assert changed.returncode == 0 and "--key-retention 2d -> 7d" in changed.stdout, changed
