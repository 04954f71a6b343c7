"""A new user's first hour (#29), each through the real console script as a subprocess against the
test database: one-line refusals of migrate, a closed pipe, the handler found from the current
directory, units on every duration, lane list/show/delete, --json everywhere, true hints, start-up
without alembic, and a worker log a person reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import make_conninfo

import pglane
from pglane import cli, cli_format, durations, schema
from tests.conftest import ROOT

PGLANE = str(Path(sys.executable).with_name("pglane"))  # the installed console script


def run(*args: str, dsn: str | None = None, cwd: Path = ROOT, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PGLANE_DSN", "PYTHONPATH")}
    if dsn is not None:
        base["PGLANE_DSN"] = dsn
    return subprocess.run([PGLANE, *args], capture_output=True, text=True, env={**base, **(env or {})},
                          timeout=timeout, cwd=cwd)


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().count("\n") == 0, done.stderr
    return done.stderr.strip()


@pytest.fixture
def blank_db(dsn: str, conn: Any) -> Any:
    """A second, empty database of the cluster (never migrated), dropped afterwards."""
    conn.execute("DROP DATABASE IF EXISTS pglane_blank WITH (FORCE)")
    conn.execute("CREATE DATABASE pglane_blank")
    yield make_conninfo(dsn, dbname="pglane_blank")
    conn.execute("DROP DATABASE IF EXISTS pglane_blank WITH (FORCE)")


@pytest.fixture
def login(conn: Any) -> Any:
    """Make a login role (no CREATEROLE, no pglane role); dropped afterwards."""
    made: list[str] = []

    def make(name: str, *grants: str) -> str:
        conn.execute(f"DROP ROLE IF EXISTS {name}")
        conn.execute(f"CREATE ROLE {name} LOGIN PASSWORD 'pw'")
        for grant in grants:
            conn.execute(grant.format(role=name))
        made.append(name)
        return name

    yield make
    for name in made:  # DROP OWNED also revokes its privileges on databases
        conn.execute(f"DROP OWNED BY {name}")
        conn.execute(f"DROP ROLE IF EXISTS {name}")


# --- 1. errors in one line --------------------------------------------------------------------------

def test_migrate_without_create_on_the_database_says_what_to_grant(blank_db: str, login: Any) -> None:
    role = login("pgl_nocreate")
    done = run("migrate", dsn=make_conninfo(blank_db, user=role, password="pw"))
    assert done.returncode == 1
    assert f'GRANT CREATE ON DATABASE "pglane_blank" TO "{role}"' in one_line(done)


def test_migrate_without_createrole_is_one_line_with_the_hint(blank_db: str, conn: Any, login: Any) -> None:
    role = login("pgl_nocr", "GRANT CREATE ON DATABASE pglane_blank TO {role}")
    conn.execute("ALTER ROLE pglane_producer RENAME TO pglane_producer_aside")  # cluster-wide: put back below
    try:
        done = run("migrate", dsn=make_conninfo(blank_db, user=role, password="pw"))
    finally:
        conn.execute("ALTER ROLE pglane_producer_aside RENAME TO pglane_producer")
    assert done.returncode == 1
    line = one_line(done)
    assert "lacks CREATEROLE" in line and "CREATE ROLE pglane_producer NOLOGIN" in line, line


def test_migrate_upgrades_an_older_database_and_refuses_a_newer_one_in_one_line(blank_db: str, dsn: str,
                                                                                conn: Any) -> None:
    oldest = min(schema.revisions())
    schema.upgrade(blank_db, oldest)
    done = run("migrate", dsn=blank_db)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"pglane schema at revision {schema.head()} (upgraded from {oldest})"
    again = run("migrate", "--json", dsn=blank_db)
    assert json.loads(again.stdout) == {"revision": schema.head(), "previous": schema.head(), "changed": False}

    conn.execute("UPDATE pglane.alembic_version SET version_num = '9999'")
    for command in (("migrate",), ("status",)):
        refused = run(*command, dsn=dsn)
        assert refused.returncode == 1
        assert "revision 9999, newer than this pglane knows" in one_line(refused)
        assert "upgrade pglane" in refused.stderr


@pytest.mark.parametrize("command", [("jobs", "--limit", "0"), ("jobs", "--json", "--limit", "0"), ("status",)])
def test_a_closed_pipe_ends_the_command_quietly_with_141(dsn: str, conn: Any, lane: str,
                                                           command: tuple[str, ...]) -> None:
    conn.execute("INSERT INTO pglane.lanes (name) SELECT 'l' || i FROM generate_series(1, 600) i")
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, '{}' FROM generate_series(1, 3000)", (lane,))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PGLANE_DSN": dsn}
    proc = subprocess.Popen([PGLANE, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert err == "", err


# --- 2. the handler is found where the worker runs --------------------------------------------------

def test_the_worker_finds_its_handler_in_the_current_directory_and_logs_one_line_per_job(
        dsn: str, conn: Any, lane: str, tmp_path: Path) -> None:
    (tmp_path / "myjobs.py").write_text("def run(job):\n    return {'echo': job.payload}\n")
    job = pglane.enqueue(conn, lane, {"q": 1})
    done = run("worker", lane, "--handler", "myjobs:run", "--max-jobs", "1", "--poll-interval", "250ms",
               dsn=dsn, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert pglane.result(conn, job) == {"echo": {"q": 1}}
    log = done.stderr.splitlines()
    per_job = [line for line in log if f"lane {lane} job {job} attempt " in line]
    assert len(per_job) == 1 and " INFO pglane.worker[" in per_job[0] and "(#1) done in " in per_job[0], log
    assert not [line for line in log if " INFO " in line and " pglane." not in line], log  # no library noise
    assert "alembic" not in done.stderr

    quiet_job = pglane.enqueue(conn, lane, {"q": 2})
    quiet = run("worker", lane, "--handler", "myjobs:run", "--max-jobs", "1", "--quiet", dsn=dsn, cwd=tmp_path)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert pglane.result(conn, quiet_job) == {"echo": {"q": 2}}
    assert "current directory" in run("worker", "--help").stdout


def test_a_handler_that_cannot_be_imported_says_where_it_looked(dsn: str, lane: str, tmp_path: Path) -> None:
    done = run("worker", lane, "--handler", "nowhere:run", "--max-jobs", "1", dsn=dsn, cwd=tmp_path)
    assert done.returncode == 2
    assert f"looked in the current directory {tmp_path}" in one_line(done)


# --- 3. units everywhere ----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90), ("90s", 90), ("10m", 600), ("10min", 600), ("1h30m", 5400), ("250ms", 0.25), ("7d", 604800),
    ("2w", 1209600), ("1.5h", 5400), (" 2H ", 7200), ("1d2h3m4s5ms", 93784.005),
])
def test_durations_take_units(text: str, seconds: float) -> None:
    assert durations.parse(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "1x", "m10", "1m1h", "1s1s", "-5s", "inf", "nan", "1e3s", "0", "1 h"])
def test_durations_refuse_what_they_cannot_read(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|unit"):
        durations.parse(text)


@given(st.lists(st.integers(0, 10_000), min_size=5, max_size=5).filter(any))
def test_a_duration_reads_back_as_written_and_as_printed(parts: list[int]) -> None:
    d, h, m, s, ms = parts
    text = "".join(f"{n}{u}" for n, u in zip(parts, ("d", "h", "m", "s", "ms"), strict=True) if n)
    seconds = d * 86400 + h * 3600 + m * 60 + s + ms / 1000
    assert durations.parse(text) == pytest.approx(seconds)
    assert durations.parse(durations.format_seconds(seconds)) == pytest.approx(seconds)


def test_every_duration_option_takes_units_and_prune_refuses_a_bare_number(dsn: str, conn: Any) -> None:
    created = run("lane", "create", "units", "--job-timeout", "1m30s", "--lease-timeout", "2m", "--waiting-grace",
                  "500ms", dsn=dsn)
    assert created.returncode == 0, created.stderr
    assert "--job-timeout        1m30s" in created.stdout and "--waiting-grace      500ms" in created.stdout
    row = conn.execute("SELECT job_timeout, lease_timeout, waiting_grace FROM pglane.lanes").fetchone()
    assert [v.total_seconds() for v in row.values()] == [90, 120, 0.5]
    assert run("lane", "set", "units", "--job-timeout", "100", dsn=dsn).returncode == 0  # bare: seconds
    checked = run("check", "--stop-grace", "10m", "--worker-timeout", "1m50s", "--json", dsn=dsn)
    assert json.loads(checked.stdout)["lanes"][0]["stop_grace"] == 600
    bare = run("prune", "--older-than", "7", dsn=dsn)
    assert bare.returncode == 2 and "'7' has no unit: say which, e.g. 7d" in bare.stderr
    assert "Traceback" not in bare.stderr
    assert run("prune", "--older-than", "7d", dsn=dsn).returncode == 0
    bad = run("enqueue", "units", "{}", "--wait", "--timeout", "soon", dsn=dsn)
    assert bad.returncode == 2 and "is not a duration; use a number and a unit" in bad.stderr
    parser = cli._parser()
    options = [a for sub in _subparsers(parser) for a in sub._actions if a.type in (cli._seconds, cli._age,
                                                                                     cli._duration0)]
    assert len(options) >= 14
    for action in options:
        assert action.type is not None and action.type("1h30m") == 5400


# --- 4. a CLI people like ---------------------------------------------------------------------------

def _subparsers(parser: Any) -> list[Any]:
    found = [parser]
    for action in parser._actions:
        if action.choices and isinstance(action.choices, dict):
            for child in action.choices.values():
                found += _subparsers(child)
    return found


def test_version_and_help_that_explains_every_option() -> None:
    version = run("--version")
    from importlib.metadata import version as installed

    assert version.returncode == 0 and version.stdout.strip() == f"pglane {installed('pglane')}"
    for sub in _subparsers(cli._parser()):
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.option_strings or action.dest} has no help"
    worker = run("worker", "--help").stdout
    assert "(default: 5s)" in worker and "(default: 30s)" in worker
    top = run("--help").stdout
    assert "141 stdout was closed early" in top and "1h30m" in top


def test_lane_list_show_and_delete(dsn: str, conn: Any) -> None:
    assert run("lane", "create", "paid-api", "--slots", "2", "--rate", "60/min", "--json", dsn=dsn).returncode == 0
    listed = json.loads(run("lane", "list", "--json", dsn=dsn).stdout)
    assert [(r["lane"], r["slots"], r["rate"], r["job-timeout"]) for r in listed] == [("paid-api", 2, "60/min", 600)]
    table = run("lane", "list", dsn=dsn).stdout
    assert "paid-api" in table and "10m" in table and "60/min" in table
    job = pglane.enqueue(conn, "paid-api", {})
    shown = json.loads(run("lane", "show", "paid-api", "--json", dsn=dsn).stdout)
    assert shown["status"]["queued"] == 1 and "pglane worker paid-api" in shown["next_safe_action"]
    assert "next safe action: start a worker" in run("lane", "show", "paid-api", dsn=dsn).stdout

    refused = run("lane", "delete", "paid-api", dsn=dsn)
    assert refused.returncode == 1
    assert "1 queued and 0 running job(s); nothing was deleted" in one_line(refused)
    assert "pglane lane delete paid-api --force" in refused.stderr
    conn.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now() WHERE id = %s", (job,))
    pglane.enqueue(conn, "paid-api", {})
    conn.execute("INSERT INTO pglane.attempts (job_id, attempt_number, status, worker, backend_pid, backend_start,"
                 " started_at, finished_at, lease_expires_at, seq)"
                 " VALUES (%s, 1, 'done', 'w', pg_backend_pid(), now(), now(), now(), now(), 1)", (job,))
    forced = run("lane", "delete", "paid-api", "--force", dsn=dsn)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == ("lane paid-api deleted, with 1 queued, 0 running and 1 finished job(s) with "
                                     "their 1 attempt(s)")
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM pglane.attempts").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM pglane.lanes").fetchone()["n"] == 0
    gone = run("lane", "delete", "paid-api", "--json", dsn=dsn)
    assert gone.returncode == 1 and "unknown lane 'paid-api'" in one_line(gone)


def test_every_printing_command_speaks_json(dsn: str, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    for args in (("status",), ("jobs",), ("show", str(job)), ("lane", "list"), ("lane", "show", lane),
                 ("check",), ("recover",), ("prune", "--older-than", "1d"), ("migrate",),
                 ("lane", "set", lane, "--slots", "2"), ("enqueue", lane, "{}"), ("cancel", str(job)),
                 ("retry", str(job)), ("lane", "create", "other"), ("lane", "delete", "other")):
        done = run(*args, "--json", dsn=dsn)
        assert done.returncode == 0, (args, done.stderr)
        json.loads(done.stdout)
    assert json.loads(run("recover", "--json", dsn=dsn).stdout)["marked_lost"] == 0
    assert json.loads(run("prune", "--older-than", "0s", "--json", dsn=dsn).stdout)["pruned"] == 0


def test_output_is_sentences_json_and_option_names_never_reprs(dsn: str, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    conn.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now(), result = %s WHERE id = %s",
                 ('{"ok": true, "n": null}', job))
    shown = run("show", str(job), dsn=dsn).stdout
    assert ' result: {"n": null, "ok": true}' in shown, shown
    changed = run("lane", "set", lane, "--takeover", "after-lease", "--job-timeout", "15s", dsn=dsn).stdout
    assert changed.startswith(f"lane {lane} changed: --job-timeout 20s -> 15s, --takeover immediate -> after-lease")
    assert "job_timeout" not in changed and "after_lease" not in changed
    assert run("recover", dsn=dsn).stdout.startswith("nothing to recover")
    pruned = run("prune", "--older-than", "0s", dsn=dsn)
    assert pruned.stdout.startswith("pruned 1 finished job(s) older than 0s, with their attempts;"
                                    " their idempotency keys are remembered")


def test_tables_fit_the_terminal_and_wrap_the_next_safe_action(dsn: str, conn: Any) -> None:
    pglane.create_lane(conn, "a-lane-with-a-long-name-for-the-table-width", job_timeout=20)
    for width in (80, 120, 200):
        out = run("status", dsn=dsn, env={"COLUMNS": str(width)}).stdout
        action = next(r for r in pglane.lane_status(conn))["next_safe_action"]
        assert "".join(action.split()) in "".join(out.split())  # never cut (a long word may be broken)
        header = out.splitlines()[0]
        floor = header.index("next_safe_action") + cli_format.LAST_MIN  # the fixed columns, the last's least
        assert max(len(line) for line in out.splitlines()) <= max(width, floor)
    narrow = cli_format.table([{"a": "x", "b": "word " * 30}], ("a", "b"), width=40)
    assert max(len(line) for line in narrow.splitlines()) <= 40 and len(narrow.splitlines()) > 4


def test_hints_are_true_for_the_login(dsn: str, conn: Any, lane: str, login: Any) -> None:
    stranger = login("pgl_stranger", "GRANT CONNECT ON DATABASE " + conn.info.dbname + " TO {role}")
    refused = run("jobs", dsn=make_conninfo(dsn, user=stranger, password="pw"))
    assert refused.returncode == 1
    assert f"GRANT pglane_operator TO {stranger}" in one_line(refused)
    operator = login("pgl_op", "GRANT pglane_operator TO {role}")
    op_dsn = make_conninfo(dsn, user=operator, password="pw")
    assert run("status", dsn=op_dsn).returncode == 0
    create = run("lane", "create", "mine", dsn=op_dsn)
    assert create.returncode == 1
    line = one_line(create)
    assert "GRANT" not in line and "the role that owns schema pglane" in line, line


# --- 5. start-up --------------------------------------------------------------------------------------

def test_head_without_alembic_is_alembics_head() -> None:
    from alembic.script import ScriptDirectory

    assert schema.head() == ScriptDirectory(str(schema.migrations_dir())).get_current_head()


def test_status_imports_neither_alembic_nor_sqlalchemy(dsn: str, lane: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PGLANE_DSN": dsn}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "pglane", "status"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=60)
    assert done.returncode == 0 and "brain" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "pglane.cli" in imported
    assert not {m for m in imported if m.split(".")[0] in ("alembic", "sqlalchemy")}
