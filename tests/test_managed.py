"""pglane where nobody is superuser, as on managed PostgreSQL (RDS, Cloud SQL, Azure, Supabase, Neon):
the schema's owner is a login with neither SUPERUSER, nor CREATEROLE, nor pg_read_all_stats (an
administrator made the three group roles and gave it CREATE on the database); workers, producers and
operators are other logins granted the group roles; a stranger is a login with no pglane role. Every
process here is real: `pglane migrate` and `pglane enqueue` as console scripts, worker processes
killed with SIGKILL, recovery read from pg_locks by roles that cannot see each other's sessions."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import pglane
from pglane import queries
from tests.conftest import Ledger, Workers, claim, console, lane_id, take_slot, wait_until

LOGINS = {"owner": None, "worker": "pglane_worker", "operator": "pglane_operator", "producer": "pglane_producer",
          "stranger": None}
_databases = itertools.count()


@dataclass
class Managed:
    """A database migrated by a plain owner login; ``dsn(login)`` connects as one of LOGINS."""

    admin: Any  # psycopg.Connection: the server's superuser, for the test's own checks only
    base: str

    def dsn(self, login: str) -> str:
        return make_conninfo(self.base, user=f"managed_{login}")

    def connect(self, login: str) -> Any:  # psycopg.Connection with dict rows
        conn = pglane.connect(self.dsn(login))
        conn.autocommit = True
        return conn

    def cli(self, login: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The real console script, as ``login``."""
        done = console(self.dsn(login), *args)
        if check:
            assert done.returncode == 0, done.stderr
        return done


@pytest.fixture(scope="module")
def managed(postgresql_proc: Any) -> Iterator[Managed]:
    admin_dsn = make_conninfo(host=postgresql_proc.host, port=postgresql_proc.port, user=postgresql_proc.user,
                              dbname="postgres", password=postgresql_proc.password or None)
    admin: Any = psycopg.connect(admin_dsn, autocommit=True, row_factory=psycopg.rows.dict_row)
    if not admin.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("making the managed server's logins needs a superuser test connection")
    # What an administrator does once (docs/managed.md): the group roles (the template's migration made
    # them already), then plain logins.
    for login, group in LOGINS.items():
        name = f"managed_{login}"
        admin.execute(f"DROP OWNED BY {name} CASCADE" if _role_exists(admin, name) else "SELECT 1")
        admin.execute(f"DROP ROLE IF EXISTS {name}")
        admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB NOINHERIT"
                      if login == "owner" else f"CREATE ROLE {name} LOGIN")
        if group:
            admin.execute(f"GRANT {group} TO {name}")
    dbname = f"pglane_managed_{os.getpid()}_{next(_databases)}"
    admin.execute(f"CREATE DATABASE {dbname}")
    admin.execute(f"GRANT CREATE ON DATABASE {dbname} TO managed_owner")
    base = make_conninfo(admin_dsn, dbname=dbname, user="managed_owner")
    env = Managed(admin, base)
    env.cli("owner", "migrate")
    yield env
    admin.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
    admin.close()


def _role_exists(admin: Any, name: str) -> bool:
    return admin.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone() is not None


@pytest.fixture
def workers_as_login(managed: Managed, tmp_path: Path) -> Iterator[tuple[Workers, Ledger]]:
    ledger = Ledger(tmp_path / "ledger")
    w = Workers(managed.dsn("worker"), ledger, tmp_path)
    yield w, ledger
    w.stop_all()


_lanes = itertools.count()


def new_lane(managed: Managed, *args: str) -> str:
    """A lane of its own for each test (one database serves the module), created by the owner."""
    name = f"m{next(_lanes)}"
    managed.cli("owner", "lane", "create", name, "--job-timeout", "20", *args)
    return name


def enqueue(managed: Managed, lane: str, payload: dict[str, Any], *args: str) -> int:
    """A job enqueued by the producer login through the console script; its id."""
    return int(managed.cli("producer", "enqueue", lane, json.dumps(payload), *args).stdout.split()[-1])


def job(managed: Managed, job_id: int) -> dict[str, Any]:
    with managed.connect("operator") as op:
        row = op.execute("SELECT * FROM pglane.job_status WHERE job_id = %s", (job_id,)).fetchone()
    assert row is not None
    return dict(row)


def session_gone(managed: Managed, pid: int) -> None:
    wait_until(lambda: managed.admin.execute(queries.LIVE_SESSIONS, ([pid],)).fetchone()["n"] == 0, 10,
               f"session {pid} to end")


def test_the_owner_is_plain_and_migrate_needed_nothing_more(managed: Managed) -> None:
    with managed.connect("owner") as owner:
        me = owner.execute(
            "SELECT r.rolsuper, r.rolcreaterole, pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') AS stats,"
            " (SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'pglane') AS schema_owner"
            " FROM pg_roles r WHERE r.rolname = current_user").fetchone()
        assert me == {"rolsuper": False, "rolcreaterole": False, "stats": False, "schema_owner": "managed_owner"}
        # What the owner cannot see, and what the old claim read: another role's session start.
        with managed.connect("worker") as worker:
            hidden = owner.execute("SELECT backend_start FROM pg_stat_activity WHERE pid = %s",
                                   (worker.info.backend_pid,)).fetchone()
            assert hidden == {"backend_start": None}


def test_jobs_run_as_logins_that_are_not_the_owner(managed: Managed,
                                                   workers_as_login: tuple[Workers, Ledger]) -> None:
    workers, ledger = workers_as_login
    lane = new_lane(managed)
    proc = workers.start(lane)
    done = managed.cli("producer", "enqueue", lane, '{"result": {"answer": 42}}', "--key", "r-1", "--wait",
                       "--timeout", "60")
    assert json.loads(done.stdout) == {"answer": 42}
    again = managed.cli("producer", "enqueue", lane, '{"result": {"answer": 42}}', "--key", "r-1", "--wait",
                        "--timeout", "60")
    assert json.loads(again.stdout) == {"answer": 42}
    assert len(ledger.calls()) == 1, "a repeated key made a second paid call"
    with managed.connect("operator") as op:
        attempt = op.execute("SELECT a.backend_pid, a.backend_start, a.session_mark, a.status FROM pglane.attempts a"
                             " JOIN pglane.jobs j ON j.id = a.job_id WHERE j.lane = %s", (lane,)).fetchone()
    assert attempt["status"] == "done" and attempt["session_mark"] is not None
    assert attempt["backend_start"] == _mark_time(managed, attempt["session_mark"])
    assert proc.poll() is None, Workers.log(proc)


def _mark_time(managed: Managed, mark: int) -> Any:
    """The time a mark stands for: microseconds since the epoch (only the owner may call pglane.mark_time)."""
    return managed.admin.execute("SELECT 'epoch'::timestamptz + %s * interval '1 microsecond' AS t",
                                 (mark,)).fetchone()["t"]


def test_a_live_worker_mid_call_is_never_found_lost_by_any_role(managed: Managed,
                                                                 workers_as_login: tuple[Workers, Ledger]) -> None:
    workers, ledger = workers_as_login
    lane = new_lane(managed)
    workers.start(lane)
    job_id = enqueue(managed, lane, {"sleep": 30})
    wait_until(lambda: job_id in ledger.calls(), 20, "the paid call to start")
    for login in ("operator", "owner", "worker"):
        with managed.connect(login) as c:
            assert pglane.recover(c, lane) == 0, f"recover as {login} marked a live worker's attempt lost"
    with managed.connect("operator") as op:
        row = op.execute("SELECT alive FROM pglane.running_attempts WHERE job_id = %s", (job_id,)).fetchone()
    assert row == {"alive": True}
    assert job(managed, job_id)["next_safe_action"] == "nothing to do: running"


def test_a_sigkilled_workers_call_is_found_lost_and_never_run_again(managed: Managed,
                                                                    workers_as_login: tuple[Workers, Ledger]) -> None:
    workers, ledger = workers_as_login
    lane = new_lane(managed)
    holder = workers.start(lane)
    first = enqueue(managed, lane, {"sleep": 60})
    wait_until(lambda: first in ledger.calls(), 20, "the paid call to start")
    with managed.connect("operator") as op:
        pid = op.execute("SELECT backend_pid FROM pglane.running_attempts WHERE job_id = %s",
                         (first,)).fetchone()["backend_pid"]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    session_gone(managed, pid)
    assert "pglane recover" in job(managed, first)["next_safe_action"]
    with managed.connect("operator") as op:
        assert pglane.recover(op, lane) == 1
    lost = job(managed, first)
    assert lost["status"] == "failed" and "may have been made" in lost["last_error"]
    # A new worker takes the slot and serves the next job; the lost one is never run again.
    workers.start(lane)
    second = enqueue(managed, lane, {})
    wait_until(lambda: job(managed, second)["status"] == "done", 30, "the next job to run")
    assert ledger.calls().count(first) == 1 and job(managed, first)["status"] == "failed"


def test_a_standby_recovers_a_killed_holders_attempt_on_taking_its_slot(
        managed: Managed, workers_as_login: tuple[Workers, Ledger]) -> None:
    workers, ledger = workers_as_login
    lane = new_lane(managed)
    holder = workers.start(lane)
    first = enqueue(managed, lane, {"sleep": 60})
    wait_until(lambda: first in ledger.calls(), 20, "the paid call to start")
    standby = workers.start(lane)
    wait_until(lambda: "standby" in Workers.log(standby), 20, "the second worker to wait as a standby")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    wait_until(lambda: job(managed, first)["status"] == "failed", 30, "the standby to recover the lost attempt")
    assert ledger.calls().count(first) == 1


def test_a_strict_lane_waits_for_a_lost_attempts_lease_as_logins(
        managed: Managed, workers_as_login: tuple[Workers, Ledger]) -> None:
    workers, ledger = workers_as_login
    lane = f"s{next(_lanes)}"
    managed.cli("owner", "lane", "create", lane, "--job-timeout", "3", "--lease-timeout", "4",
                "--takeover", "after-lease")
    holder = workers.start(lane, "tests.handlers:paid_call", "--timeout", "3.5")
    first = enqueue(managed, lane, {"sleep": 60})
    wait_until(lambda: first in ledger.calls(), 20, "the paid call to start")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    second = enqueue(managed, lane, {})
    workers.start(lane, "tests.handlers:paid_call", "--timeout", "3.5")
    wait_until(lambda: job(managed, second)["status"] == "done", 30, "the next job after the lease")
    with managed.connect("operator") as op:
        rows = {r["job_id"]: r for r in op.execute(
            "SELECT a.job_id, a.status, a.started_at, a.lease_expires_at FROM pglane.attempts a"
            " WHERE a.job_id = ANY(%s)", ([first, second],))}
    assert rows[first]["status"] == "lost"
    assert rows[second]["started_at"] >= rows[first]["lease_expires_at"], "a call started inside a lost lease"


def test_a_strangers_lock_on_a_slot_is_shown_as_a_squatter(managed: Managed) -> None:
    lane = new_lane(managed)
    with managed.connect("operator") as op, managed.connect("stranger") as stranger:
        ident, pid = lane_id(op, lane), stranger.info.backend_pid
        stranger.execute("SELECT pg_advisory_lock(%s, 1)", (ident,))
        status = op.execute("SELECT squatters, next_safe_action FROM pglane.lane_status WHERE lane = %s",
                            (lane,)).fetchone()
    assert status["squatters"] == 1
    assert str(pid) in status["next_safe_action"], status


def test_a_worker_cannot_claim_under_another_sessions_identity(managed: Managed) -> None:
    lane = new_lane(managed, "--slots", "2")
    with managed.connect("worker") as first, managed.connect("worker") as second:
        for job_id in (enqueue(managed, lane, {}), enqueue(managed, lane, {})):
            assert job_id
        take_slot(first, lane, 1)
        mine = claim(first, lane)
        assert mine is not None
        theirs = first.execute("SELECT session_mark FROM pglane.attempts WHERE id = %s",
                               (mine["attempt_id"],)).fetchone()["session_mark"]
        # The second session says it is the first (the setting only orders the checks): the claim
        # finds that it does not hold that mark and gives it one of its own.
        second.execute("SELECT set_config('pglane.session_mark', %s, false)", (str(theirs),))
        take_slot(second, lane, 2)
        row = claim(second, lane)
        assert row is not None
        forged = second.execute("SELECT backend_pid, session_mark FROM pglane.attempts WHERE id = %s",
                                (row["attempt_id"],)).fetchone()
        assert forged["session_mark"] != theirs and forged["backend_pid"] == second.info.backend_pid
        # Nor may it write the first session's outcome without its token (PGL12, nothing written).
        with pytest.raises(pglane.errors.NotTheClaimer), pglane.client.translated():
            second.execute("SELECT pglane.complete(%s, '{}')", (mine["attempt_id"],))
        assert first.execute("SELECT pglane.complete(%s, '{}') AS ok", (mine["attempt_id"],)).fetchone()["ok"]


def test_check_says_plainly_what_each_role_lacks(managed: Managed) -> None:
    new_lane(managed)  # check reads the lanes too
    for login in ("owner", "operator", "worker"):
        done = managed.cli(login, "check", "--json", check=False)
        report = json.loads(done.stdout)
        rights = {r["text"].split(";")[0]: r["missing"] for r in report["privileges"]}
        assert any("need no privilege" in text or "pglane's" in text for text in rights), report
        signal_missing = any("pg_signal_backend" in r["text"] and r["missing"] for r in report["privileges"])
        # Ending a stuck worker's session is the one thing that needs more, and only operators do it.
        assert signal_missing == (login in ("owner", "operator")), (login, report["privileges"])
        assert report["ok"] == (done.returncode == 0)
    managed.admin.execute("GRANT pg_signal_backend TO managed_operator")
    try:
        report = json.loads(managed.cli("operator", "check", "--json", check=False).stdout)
        assert not any(r["missing"] for r in report["privileges"]), report["privileges"]
    finally:
        managed.admin.execute("REVOKE pg_signal_backend FROM managed_operator")
    stranger = managed.cli("stranger", "check", check=False)
    assert stranger.returncode != 0 and "Traceback" not in stranger.stderr
    assert "GRANT pglane_" in stranger.stderr + stranger.stdout, stranger
