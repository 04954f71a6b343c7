"""Migrations own the schema: up from an empty database, down to empty, alembic's version table
inside the pglane schema, and a wheel that carries migrations and SQL to `pglane migrate`."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import pglane
from pglane import pgbin, schema
from tests.conftest import ROOT, claim, take_slot


def objects(conn: Any) -> dict[str, int]:
    row = conn.execute(
        "SELECT (SELECT count(*) FROM pg_namespace WHERE nspname = 'pglane') AS schemas,"
        " (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        "   WHERE n.nspname = 'pglane') AS relations,"
        " (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
        "   WHERE n.nspname = 'pglane') AS functions,"
        " (SELECT count(*) FROM pg_class WHERE relname = 'alembic_version'"
        "   AND relnamespace NOT IN (SELECT oid FROM pg_namespace WHERE nspname = 'pglane')) AS foreign_version_tables"
    ).fetchone()
    return dict(row)


def test_migrate_down_to_empty_and_up_again(dsn: str, conn: Any) -> None:
    migrated = objects(conn)
    assert migrated["schemas"] == 1 and migrated["relations"] > 5 and migrated["functions"] > 10
    schema.downgrade(dsn)
    assert objects(conn) == {"schemas": 0, "relations": 0, "functions": 0, "foreign_version_tables": 0}
    assert schema.current_revision(conn) is None
    schema.upgrade(dsn)
    assert objects(conn) == migrated
    assert schema.current_revision(conn) == schema.head()
    pglane.create_lane(conn, "again", job_timeout=10)
    assert pglane.enqueue(conn, "again", {}) == 1


def revisions() -> list[Any]:
    """Every revision alembic knows, oldest first."""
    from alembic.script import ScriptDirectory

    return list(reversed(list(ScriptDirectory(str(schema.migrations_dir())).walk_revisions())))


def test_each_revision_applies_only_the_files_it_changes_and_freezes_only_their_previous_text() -> None:
    # The rule of pglane.schema: a revision applies only the sql/ files it changes; every revision that
    # applies a file but the newest reads the text it installed from alembic/frozen/<revision>/, and
    # so does the newest once the file has left sql/; no frozen copy lies unused.
    frozen = schema.migrations_dir() / "frozen"
    in_sql = {p.name for p in schema.sql_dir().glob("*.sql")}
    applies = {r.revision: tuple(getattr(r.module, "APPLIES", ())) for r in revisions()}
    used = set()
    for name in sorted(in_sql | {n for names in applies.values() for n in names}):
        appliers = [revision for revision, names in applies.items() if name in names]
        assert appliers, f"no revision applies sql/{name}"
        for older in appliers if name not in in_sql else appliers[:-1]:
            assert (frozen / older / name).is_file(), f"revision {older} applies {name} unfrozen"
            used.add(frozen / older / name)
        if name in in_sql:
            assert not (frozen / appliers[-1] / name).exists(), f"the newest applier of {name} must read sql/"
        for before, after in itertools.pairwise(appliers):
            assert schema.sql_text(name, before) != schema.sql_text(name, after), (
                f"revision {after} applies {name} as {before} left it: a revision applies only the files it changes")
    assert set(frozen.glob("*/*.sql")) == used, "a frozen copy that no revision reads"


# sql/'s files in dependency order: a file's views and SQL-language functions use only objects of the
# files before it (and the revisions' tables and types). A new file goes in its place here.
SQL_ORDER = ("lanes.sql", "slots.sql", "sessions.sql", "queue_bound.sql", "rate.sql", "strict.sql", "groups.sql",
             "pause.sql", "jobs.sql", "claim.sql", "recover.sql", "history.sql", "tallies.sql", "views.sql", "wait.sql",
             "roles.sql")

DROP_CODE = """
DO $$
DECLARE
    v text;
BEGIN
    FOR v IN SELECT format('DROP VIEW IF EXISTS pglane.%I CASCADE', c.relname) FROM pg_class c
              WHERE c.relnamespace = 'pglane'::regnamespace AND c.relkind = 'v'
             UNION ALL
             SELECT format('DROP FUNCTION IF EXISTS pglane.%I(%s) CASCADE', p.proname,
                           pg_get_function_identity_arguments(p.oid))
               FROM pg_proc p WHERE p.pronamespace = 'pglane'::regnamespace
    LOOP
        EXECUTE v;
    END LOOP;
END $$;
"""


def code(conn: Any) -> dict[str, int]:
    return dict(conn.execute(
        "SELECT (SELECT count(*) FROM pg_proc WHERE pronamespace = 'pglane'::regnamespace) AS functions,"
        " (SELECT count(*) FROM pg_class WHERE relnamespace = 'pglane'::regnamespace AND relkind = 'v') AS views,"
        " (SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
        "   WHERE c.relnamespace = 'pglane'::regnamespace AND NOT t.tgisinternal) AS triggers").fetchone())


def test_each_function_view_trigger_and_policy_is_made_by_one_file_of_sql() -> None:
    made: dict[tuple[str, str], list[str]] = {}
    for path in sorted(schema.sql_dir().glob("*.sql")):
        for kind, name in re.findall(r"^CREATE (?:OR REPLACE )?(FUNCTION|VIEW|TRIGGER|POLICY) (?:pglane\.)?(\w+)",
                                     path.read_text(encoding="utf-8"), re.MULTILINE):
            made.setdefault((kind, name), []).append(path.name)
    assert len(made) > 80
    assert {what: files for what, files in made.items() if len(files) > 1} == {}


def test_sql_in_its_order_makes_every_function_view_trigger_and_privilege_of_the_head(dsn: str, conn: Any) -> None:
    # Together with the test above: each lives in exactly one file, and the order is a dependency order.
    assert sorted(SQL_ORDER) == sorted(p.name for p in schema.sql_dir().glob("*.sql"))
    head, granted, made = schema_dump(dsn), privileges(conn), code(conn)
    conn.execute(DROP_CODE)
    assert code(conn) == {"functions": 0, "views": 0, "triggers": 0}
    for name in SQL_ORDER:
        conn.execute((schema.sql_dir() / name).read_text(encoding="utf-8"))
    conn.execute("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pglane FROM PUBLIC")  # as apply_sql does
    assert code(conn) == made
    assert privileges(conn) == granted
    assert schema_dump(dsn) == head


def privileges(conn: Any) -> list[dict[str, Any]]:
    """Every privilege that PUBLIC and pglane's three roles hold on the pglane schema and on its
    relations, columns and functions (an ACL that was never set reads as its default)."""
    return list(conn.execute(
        """
        WITH acl (kind, object, acl) AS (
            SELECT 'schema', n.nspname::text, coalesce(n.nspacl, acldefault('n', n.nspowner))
              FROM pg_namespace n WHERE n.nspname = 'pglane'
            UNION ALL
            SELECT 'relation', c.oid::regclass::text,
                   coalesce(c.relacl, acldefault(CASE WHEN c.relkind = 'S' THEN 's' ELSE 'r' END::"char", c.relowner))
              FROM pg_class c WHERE c.relnamespace = 'pglane'::regnamespace
            UNION ALL
            SELECT 'column', c.oid::regclass::text || '.' || a.attname, a.attacl
              FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid
             WHERE c.relnamespace = 'pglane'::regnamespace AND a.attacl IS NOT NULL AND NOT a.attisdropped
            UNION ALL
            SELECT 'function', p.oid::regprocedure::text, coalesce(p.proacl, acldefault('f', p.proowner))
              FROM pg_proc p WHERE p.pronamespace = 'pglane'::regnamespace
        )
        SELECT a.kind, a.object, CASE WHEN x.grantee = 0 THEN 'PUBLIC' ELSE x.grantee::regrole::text END AS grantee,
               x.privilege_type, x.is_grantable
          FROM acl a CROSS JOIN LATERAL aclexplode(a.acl) x
         WHERE x.grantee = 0 OR x.grantee::regrole::text IN ('pglane_producer', 'pglane_worker', 'pglane_operator')
         ORDER BY 1, 2, 3, 4
        """))


def schema_dump(dsn: str) -> str:
    """pg_dump --schema-only of the pglane schema, with what differs by history alone normalised:
    pg_dump's random \\restrict key and the order of grants within one object's block."""
    done = subprocess.run([str(pgbin.find_bindir() / f"pg_dump{pgbin.EXE}"), "--schema-only", "--schema=pglane",
                           "--no-owner", "--dbname", dsn], capture_output=True, text=True, check=True)
    lines = [line for line in done.stdout.splitlines() if not line.startswith(("\\restrict", "\\unrestrict"))]
    out: list[str] = []
    grants: list[str] = []
    for line in [*lines, ""]:
        if line.startswith(("GRANT ", "REVOKE ")):
            grants.append(line)
            continue
        out += [*sorted(grants), line]
        grants = []
    return "\n".join(out)


@pytest.fixture
def second_dsn(dsn: str, conn: Any) -> Iterator[str]:
    """An empty database beside the test's own, on the same server."""
    name = f"{conn.info.dbname}_b"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield make_conninfo(dsn, dbname=name)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


OLDER = [r.revision for r in revisions()][:-1]


@pytest.mark.parametrize("older", OLDER)
def test_every_path_through_an_older_revision_ends_in_the_schema_of_a_fresh_install(
    dsn: str, second_dsn: str, older: str
) -> None:
    fresh_head = schema_dump(dsn)
    schema.upgrade(second_dsn, older)
    fresh_older = schema_dump(second_dsn)
    schema.upgrade(second_dsn)
    assert schema_dump(second_dsn) == fresh_head, f"upgrading from {older} differs from a fresh install"
    schema.downgrade(second_dsn, older)
    assert schema_dump(second_dsn) == fresh_older, f"downgrading to {older} differs from a fresh {older}"


def test_revision_0010_moves_the_sql_and_changes_no_object_and_no_privilege(second_dsn: str) -> None:
    # sql/ by capability: the schema at 0010 is 0009's (the ACLs of the schema, relations, columns and
    # functions too, and the policies), but for the one comment that named the file of the tallies;
    # its downgrade gives 0009's back.
    schema.upgrade(second_dsn, "0009")
    with pglane.connect(second_dsn) as c:
        at_0009 = schema_dump(second_dsn), privileges(c)
        schema.upgrade(second_dsn, "0010")
        at_0010 = schema_dump(second_dsn), privileges(c)
        schema.downgrade(second_dsn, "0009")
        back = schema_dump(second_dsn), privileges(c)
    assert len(at_0009[1]) > 100 and "CREATE POLICY jobs_producer_reads_own" in at_0009[0]
    moved = at_0009[0].replace("(not generated: see views.sql)", "(not generated: see tallies.sql)")
    assert moved != at_0009[0]
    assert at_0010[1] == at_0009[1]
    assert at_0010[0] == moved
    assert back == at_0009


def test_a_database_at_the_baseline_upgrades_with_its_jobs_and_runs_them(dsn: str, conn: Any) -> None:
    schema.downgrade(dsn)
    schema.upgrade(dsn, revisions()[0].revision)
    conn.execute("INSERT INTO pglane.lanes (name) VALUES ('old')")
    job = conn.execute("SELECT pglane.enqueue('old', '{\"q\": 1}') AS id").fetchone()["id"]
    schema.upgrade(dsn)
    assert schema.current_revision(conn) == schema.head()
    take_slot(conn, "old")
    claimed = claim(conn, "old")
    assert claimed is not None and claimed["job_id"] == job and claimed["payload"] == {"q": 1}
    assert conn.execute("SELECT pglane.complete(%s, '1') AS ok", (claimed["attempt_id"],)).fetchone()["ok"]


def test_no_pglane_function_or_relation_is_open_to_public(conn: Any) -> None:
    # PostgreSQL grants EXECUTE to PUBLIC on every new function; each revision must take it back.
    public = conn.execute(
        "SELECT p.oid::regprocedure::text AS name FROM pg_proc p"
        " WHERE p.pronamespace = 'pglane'::regnamespace AND EXISTS (SELECT 1 FROM"
        "  aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a WHERE a.grantee = 0)"
        " UNION ALL SELECT c.oid::regclass::text FROM pg_class c WHERE c.relnamespace = 'pglane'::regnamespace"
        " AND EXISTS (SELECT 1 FROM aclexplode(coalesce(c.relacl, acldefault('r', c.relowner))) a"
        "  WHERE a.grantee = 0)").fetchall()
    assert public == []


def test_alembic_version_table_lives_in_the_pglane_schema(conn: Any) -> None:
    row = conn.execute("SELECT to_regclass('pglane.alembic_version') AS inside,"
                       " to_regclass('public.alembic_version') AS outside").fetchone()
    assert row["inside"] is not None and row["outside"] is None


def test_migrating_twice_is_a_no_op(dsn: str, conn: Any) -> None:
    before = objects(conn)
    schema.upgrade(dsn)
    assert objects(conn) == before


def test_commands_refuse_an_unmigrated_database_with_what_to_do(dsn: str, conn: Any) -> None:
    schema.downgrade(dsn)
    with pytest.raises(pglane.SchemaError, match="run: pglane migrate"):
        schema.require_current(conn)


def test_the_claim_uses_the_queue_index_whatever_the_history(conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', '{}' FROM generate_series(1, 2000)")
    conn.execute("UPDATE pglane.jobs SET status = 'done' WHERE id <= 1990")
    conn.execute("ANALYZE pglane.jobs")
    take_slot(conn, lane)
    # The backend's own counters for this transaction: index scans of jobs_queue, sequential scans of jobs.
    scans = ("SELECT pg_stat_get_xact_numscans('pglane.jobs_queue'::regclass) AS queue,"
             " pg_stat_get_xact_numscans('pglane.jobs'::regclass) AS seq")
    with conn.transaction():
        before = conn.execute(scans).fetchone()
        assert claim(conn, lane) is not None
        after = conn.execute(scans).fetchone()
    assert (after["queue"] - before["queue"], after["seq"] - before["seq"]) == (1, 0)


def test_a_queued_jobs_position_is_counted_through_the_queue_index_whatever_the_history(
    conn: Any, lane: str
) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', '{}' FROM generate_series(1, 2000)")
    conn.execute("UPDATE pglane.jobs SET status = 'done' WHERE id <= 1990")
    conn.execute("ANALYZE pglane.jobs")
    # Either queue index will do (both hold the queued jobs only): the service-order one, or the groups'.
    scans = ("SELECT pg_stat_get_xact_numscans('pglane.jobs_queue'::regclass)"
             " + pg_stat_get_xact_numscans('pglane.jobs_group_queue'::regclass) AS queue,"
             " pg_stat_get_xact_numscans('pglane.jobs'::regclass) AS seq")
    with conn.transaction():
        before = conn.execute(scans).fetchone()
        row = conn.execute("SELECT queue_position FROM pglane.job_status WHERE job_id = 1995").fetchone()
        after = conn.execute(scans).fetchone()
    assert row["queue_position"] == 5
    # Two ranges of the index (the higher priorities, then its own priority up to the job), no history.
    assert (after["queue"] - before["queue"], after["seq"] - before["seq"]) == (2, 0)


def claim_one(conn: Any, lane: str) -> dict[str, Any]:
    take_slot(conn, lane)
    row = claim(conn, lane)
    assert row is not None
    return row


def test_completing_a_job_writes_no_new_job_index_entries(conn: Any, lane: str) -> None:
    # A HOT update: completion changes no column any index of pglane.jobs uses (key or predicate).
    pglane.enqueue(conn, lane, {})
    attempt = claim_one(conn, lane)["attempt_id"]
    # The backend's not yet flushed counters (they may still hold the claim's update): compare.
    counters = ("SELECT pg_stat_get_xact_tuples_updated('pglane.jobs'::regclass) AS updated,"
                " pg_stat_get_xact_tuples_hot_updated('pglane.jobs'::regclass) AS hot")
    with conn.transaction():
        before = conn.execute(counters).fetchone()
        assert conn.execute("SELECT pglane.complete(%s, '{}') AS ok", (attempt,)).fetchone()["ok"]
        after = conn.execute(counters).fetchone()
    assert (after["updated"] - before["updated"], after["hot"] - before["hot"]) == (1, 1)


def test_recovery_finds_running_attempts_through_an_index_whatever_the_history(conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'brain', '{}' FROM generate_series(1, 2000)")
    conn.execute("UPDATE pglane.jobs SET status = 'done', attempts = 1 WHERE id <= 1999")
    conn.execute("INSERT INTO pglane.attempts (job_id, attempt_number, status, worker, backend_pid, backend_start,"
                 " finished_at, lease_expires_at, seq) SELECT id, 1, 'done', 'w', 1, now(), now(), now(), id"
                 " FROM pglane.jobs WHERE id <= 1999")
    claim_one(conn, lane)
    conn.execute("ANALYZE pglane.jobs; ANALYZE pglane.attempts")
    plan = "\n".join(r["QUERY PLAN"] for r in conn.execute("EXPLAIN SELECT * FROM pglane.running_attempts"))
    assert "attempts_running" in plan and "Seq Scan on attempts" not in plan
    assert [r["job_id"] for r in conn.execute("SELECT job_id FROM pglane.running_attempts")] == [2000]


@pytest.mark.timeout(600)
def test_the_built_wheel_ships_migrations_and_sql_and_migrates_from_a_fresh_venv(
    dsn: str, tmp_path: Path
) -> None:
    wheels, source = tmp_path / "wheels", tmp_path / "source"
    # Built from a copy: setuptools' build/ folder in the checkout may hold files git no longer has.
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(source)], check=True, cwd=tmp_path)
    wheel = next(wheels.glob("pglane-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = next(env_dir.glob("lib/python*/site-packages"))
    # Dependencies come from the test environment (no network); pglane itself only from the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no pglane but the wheel's
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
                    "--no-deps", "-q", str(wheel)], check=True, env=env)
    deps = [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_deps.pth").write_text("\n".join(deps) + "\n")
    python = env_dir / "bin" / "python"
    where = subprocess.run([python, "-c", "import pglane; print(pglane.__file__)"], capture_output=True,
                           text=True, check=True, cwd=tmp_path, env=env).stdout
    assert where.startswith(str(site))
    schema.downgrade(dsn)
    done = subprocess.run([env_dir / "bin" / "pglane", "--dsn", dsn, "migrate"], capture_output=True, text=True,
                          cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(dsn) as c:
        assert schema.current_revision(c) == schema.head()
