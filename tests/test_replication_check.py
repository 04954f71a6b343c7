"""``pglane check``'s replication rule, on real primaries with a real standby (tests/replica.py): clean on a
synchronous setup; an asynchronous standby, and a role or database whose commits do not wait for the
standby, named as the risk of paying twice with the setting that removes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import pglane
from pglane import replication
from tests.replica import STANDBY_NAME, Pair, make_template, synchronous_pair
from tests.test_cli import run


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_template(tmp_path_factory.mktemp("replication-check"))


@pytest.fixture
def sync_pair(template: Path, tmp_path: Path) -> Iterator[Pair]:
    with synchronous_pair(template, tmp_path / "sync") as pair:
        yield pair


def risks(conn: Any) -> list[str]:
    return [f.text for f in replication.findings(conn) if f.risk]


def test_a_synchronous_standby_is_clean(sync_pair: Pair) -> None:
    with pglane.connect(sync_pair.primary.dsn) as conn:
        pglane.create_lane(conn, "brain")
    done = run("check", "--stop-grace", "700", dsn=sync_pair.primary.dsn)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"replication: synchronous standby(s): {STANDBY_NAME} (sync)" in done.stdout
    assert "RISK" not in done.stdout


def test_an_asynchronous_standby_is_named_with_the_setting_that_removes_the_risk(
    template: Path, tmp_path: Path
) -> None:
    with synchronous_pair(template, tmp_path / "async", synchronous=False) as pair:
        done = run("check", "--stop-grace", "700", dsn=pair.primary.dsn)
    assert done.returncode == 1, done.stdout + done.stderr
    line = next((line for line in done.stdout.splitlines() if line.startswith("replication: RISK")), done.stdout)
    assert f"standby {STANDBY_NAME} (127.0.0.1) is async (synchronous_standby_names is empty)" in line
    assert "a paid call already made is made again" in line
    assert "synchronous_standby_names = 'FIRST 1 (name)'" in line and "synchronous_commit = on" in line


def test_a_login_role_of_pglane_that_commits_asynchronously_is_named(sync_pair: Pair) -> None:
    with pglane.connect(sync_pair.primary.dsn) as conn:
        assert risks(conn) == []
        conn.execute("CREATE ROLE app_worker LOGIN IN ROLE pglane_worker")
        conn.execute("CREATE ROLE app_team NOLOGIN IN ROLE pglane_producer")
        conn.execute("CREATE ROLE app_web LOGIN IN ROLE app_team")  # a producer through a group of its own
        conn.execute("ALTER ROLE app_worker SET synchronous_commit = off")
        conn.execute("ALTER ROLE app_web SET synchronous_commit = local")
        found = risks(conn)
        assert len(found) == 2, found
        assert "role app_web (a member of pglane_producer) has synchronous_commit = local" in found[0]
        assert "remove the risk: ALTER ROLE app_web RESET synchronous_commit" in found[0]
        assert "role app_worker (a member of pglane_worker) has synchronous_commit = off" in found[1]

        # The setting for this database wins over the role's setting for all databases.
        conn.execute("ALTER ROLE app_worker IN DATABASE postgres SET synchronous_commit = remote_apply")
        conn.execute("ALTER ROLE app_web IN DATABASE template1 SET synchronous_commit = on")  # not this one
        assert [f for f in risks(conn) if "app_worker" in f] == []
        assert len(risks(conn)) == 1
        conn.execute("ALTER ROLE app_web RESET synchronous_commit")
        assert risks(conn) == []

        # A group role's settings apply to no session: only a login role's count.
        conn.execute("ALTER ROLE pglane_worker SET synchronous_commit = off")
        assert risks(conn) == []


def test_a_database_that_commits_asynchronously_is_named_and_a_role_setting_overrides_it(sync_pair: Pair) -> None:
    with pglane.connect(sync_pair.primary.dsn) as conn:
        conn.execute("ALTER DATABASE postgres SET synchronous_commit = local")
        conn.execute("CREATE ROLE app_worker LOGIN IN ROLE pglane_worker")
        found = risks(conn)
        assert len(found) == 1 and "database postgres has synchronous_commit = local" in found[0], found
        assert "ALTER DATABASE postgres RESET synchronous_commit" in found[0]
        conn.execute("ALTER ROLE app_worker SET synchronous_commit = local")
        assert any("role app_worker" in f for f in risks(conn))
        conn.execute("ALTER DATABASE postgres RESET synchronous_commit")
        conn.execute("ALTER ROLE app_worker SET synchronous_commit = on")
        assert risks(conn) == []


def test_a_standby_is_named_as_the_wrong_server_and_a_plain_role_is_told_it_cannot_see(sync_pair: Pair) -> None:
    with pglane.connect(sync_pair.standby.dsn) as conn:
        (only,) = replication.findings(conn)
    assert only.risk and "this server is a standby" in only.text and "target_session_attrs=read-write" in only.text
    with pglane.connect(sync_pair.primary.dsn) as conn:
        conn.execute("CREATE ROLE watcher LOGIN IN ROLE pglane_operator")
    with pglane.connect(sync_pair.primary.dsn + " user=watcher") as conn:
        notes = [f.text for f in replication.findings(conn)]
    assert any("cannot be read by this role: run pglane check as a member of pg_monitor" in n for n in notes), notes
