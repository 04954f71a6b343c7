"""Push-back from the command line (#33), through the real console script against the test database:
lane pause and resume (their notes, lane_status, --for, --until, the refusals), the push-back settings
of lane create and lane set, enqueue --job-timeout, status's PAUSED marker, and the worker's
pglane_lane_paused gauge."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, timedelta, timezone
from typing import Any

from psycopg.conninfo import make_conninfo

import pglane
from tests.conftest import ROOT, Workers, metrics_port, scrape, wait_until


def run(*args: str, dsn: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m pglane ARGS` against ``dsn``, run to its end."""
    return subprocess.run([sys.executable, "-m", "pglane", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PGLANE_DSN": dsn, **(env or {})}, cwd=ROOT, check=False)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def refused(done: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line a refusal writes on stderr, after checking its exit status."""
    assert done.returncode == code, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    return done.stderr.strip()


def pause_row(conn: Any, lane: str = "brain") -> dict[str, Any]:
    """The lane's pause as lane_status says it (paused_until NULL: until resumed), with the seconds left by
    the database clock."""
    row: dict[str, Any] = conn.execute(
        "SELECT paused, paused_until, extract(epoch FROM paused_until - now())::float8 AS left,"
        " paused_by, pause_reason, next_safe_action FROM pglane.lane_status WHERE lane = %s", (lane,)).fetchone()
    return row


def pause_state(conn: Any) -> Any:
    """Everything a pause writes: the counters' paused_until ('infinity' as text) and the pause records."""
    return conn.execute("SELECT (SELECT json_agg(c.paused_until::text ORDER BY c.lane_id) FROM pglane.lane_counters c)"
                        " AS until, (SELECT json_agg(p ORDER BY p.lane_id) FROM pglane.lane_pauses p) AS pauses"
                        ).fetchone()


def test_pause_and_resume_print_their_note_and_change_lane_status(dsn: str, conn: Any, lane: str) -> None:
    paused = ok(run("lane", "pause", lane, "--reason", "provider down", dsn=dsn))
    assert "lane brain paused until resumed" in paused and "pglane lane resume brain" in paused
    row = pause_row(conn)
    assert (row["paused"], row["paused_until"], row["pause_reason"]) == (True, None, "provider down")
    assert row["paused_by"] == conn.execute("SELECT current_user AS u").fetchone()["u"]
    assert row["next_safe_action"].startswith("paused until resumed by")

    table = ok(run("status", dsn=dsn))
    assert "brain PAUSED" in table
    assert "paused until resumed by" in " ".join(table.split()) and "provider down" in " ".join(table.split())
    [shown] = json.loads(ok(run("status", "--json", dsn=dsn)))
    assert (shown["paused"], shown["paused_until"], shown["pause_reason"]) == (True, None, "provider down")
    assert "PAUSED until resumed" in ok(run("lane", "show", lane, dsn=dsn))

    resumed = ok(run("lane", "resume", lane, dsn=dsn))
    assert resumed.strip() == "lane brain resumed: its workers start jobs again"
    assert not pause_row(conn)["paused"]
    assert "PAUSED" not in ok(run("status", dsn=dsn))
    [shown] = json.loads(ok(run("status", "--json", dsn=dsn)))
    assert (shown["paused"], shown["paused_until"]) == (False, None)
    again = ok(run("lane", "resume", lane, dsn=dsn))
    assert again.strip() == "lane brain is not paused: nothing changed"


def test_pause_for_a_duration_ends_that_long_after_now(dsn: str, conn: Any, lane: str) -> None:
    for given, seconds in (("30s", 30), ("10m", 600), ("2h", 7200), ("90", 90)):
        said = json.loads(ok(run("lane", "pause", lane, "--for", given, "--json", dsn=dsn)))
        assert said["paused"] is True and said["note"].startswith("lane brain paused until ")
        row = pause_row(conn)
        assert said["paused_until"] == row["paused_until"].isoformat(sep=" ")
        assert seconds - 60 < row["left"] <= seconds, (given, row)  # the test's own minute of slack
        assert row["pause_reason"] == "paused by hand, no reason given"
        ok(run("lane", "resume", lane, dsn=dsn))


def test_pause_until_a_time_takes_its_offset_or_else_local_time(dsn: str, conn: Any, lane: str) -> None:
    now = conn.execute("SELECT date_trunc('second', now()) AS t").fetchone()["t"]
    end = now + timedelta(hours=1)
    given = end.astimezone(timezone(timedelta(hours=2)))
    ok(run("lane", "pause", lane, "--until", given.isoformat(), "--reason", "maintenance window", dsn=dsn))
    exact = conn.execute("SELECT paused_until = %s AS same FROM pglane.lane_counters", (end,)).fetchone()
    assert exact["same"] and pause_row(conn)["pause_reason"] == "maintenance window"
    ok(run("lane", "resume", lane, dsn=dsn))
    local = (end.astimezone(UTC) + timedelta(hours=3)).replace(tzinfo=None).isoformat()  # in a zone 3 hours east of UTC
    ok(run("lane", "pause", lane, "--until", local, dsn=dsn, env={"TZ": "XYZ-3"}))
    assert conn.execute("SELECT paused_until = %s AS same FROM pglane.lane_counters", (end,)).fetchone()["same"]


def test_a_pause_ending_in_the_past_or_of_an_unknown_lane_is_refused_and_changes_nothing(
    dsn: str, conn: Any, lane: str
) -> None:
    ok(run("lane", "pause", lane, "--reason", "provider down", dsn=dsn))
    before = pause_state(conn)
    past = refused(run("lane", "pause", lane, "--until", "2020-01-01T00:00:00Z", dsn=dsn), 1)
    assert "a pause must end in the future" in past and "--for DURATION" in past
    assert pause_state(conn) == before
    assert pause_row(conn)["pause_reason"] == "provider down"
    ghost = refused(run("lane", "pause", "ghost", "--for", "10m", dsn=dsn), 1)
    assert "unknown lane 'ghost'" in ghost
    assert "unknown lane 'ghost'" in refused(run("lane", "resume", "ghost", dsn=dsn), 1)
    both = run("lane", "pause", lane, "--for", "10m", "--until", "2099-01-01T00:00:00Z", dsn=dsn)
    assert both.returncode == 2 and "argument --until: not allowed with argument --for" in both.stderr
    bad = run("lane", "pause", lane, "--until", "tomorrow", dsn=dsn)
    assert bad.returncode == 2 and "'tomorrow' is not an ISO-8601 time" in bad.stderr
    assert pause_state(conn) == before


def test_lane_create_and_set_take_the_push_back_settings(dsn: str, conn: Any) -> None:
    def stored(name: str) -> tuple[Any, ...]:
        row = conn.execute("SELECT max_deferrals, on_retry_later, pause_after_failures FROM pglane.lanes"
                           " WHERE name = %s", (name,)).fetchone()
        return row["max_deferrals"], row["on_retry_later"], row["pause_after_failures"]

    ok(run("lane", "create", "plain", dsn=dsn))
    assert stored("plain") == (20, "lane", None)
    created = ok(run("lane", "create", "paid", "--max-deferrals", "5", "--on-retry-later", "job",
                     "--pause-after-failures", "3", dsn=dsn))
    assert stored("paid") == (5, "job", 3)
    assert "--pause-after-failures 3" in created and re.search(r"--on-retry-later +job", created)
    changed = ok(run("lane", "set", "paid", "--max-deferrals", "7", "--on-retry-later", "lane", dsn=dsn))
    assert stored("paid") == (7, "lane", 3)
    assert "--max-deferrals 5 -> 7" in changed and "--on-retry-later job -> lane" in changed
    removed = ok(run("lane", "set", "paid", "--pause-after-failures", "none", dsn=dsn))
    assert stored("paid") == (7, "lane", None) and "--pause-after-failures 3 -> none" in removed
    ok(run("lane", "set", "paid", "--pause-after-failures", "4", dsn=dsn))
    assert stored("paid") == (7, "lane", 4)
    shown = json.loads(ok(run("lane", "show", "paid", "--json", dsn=dsn)))["settings"]
    assert (shown["max-deferrals"], shown["on-retry-later"], shown["pause-after-failures"]) == (7, "lane", 4)
    assert run("lane", "set", "paid", "--on-retry-later", "never", dsn=dsn).returncode == 2
    assert run("lane", "set", "paid", "--max-deferrals", "10001", dsn=dsn).returncode == 1
    assert stored("paid") == (7, "lane", 4)


def test_enqueue_job_timeout_is_stored_and_above_the_lanes_refused_with_nothing_written(
    dsn: str, conn: Any, lane: str
) -> None:
    job = int(ok(run("enqueue", lane, "{}", "--job-timeout", "1.5s", dsn=dsn)))
    stored = conn.execute("SELECT job_timeout FROM pglane.jobs WHERE id = %s", (job,)).fetchone()["job_timeout"]
    assert stored == timedelta(seconds=1.5)
    plain = int(ok(run("enqueue", lane, "{}", dsn=dsn)))
    assert conn.execute("SELECT job_timeout FROM pglane.jobs WHERE id = %s", (plain,)).fetchone()["job_timeout"] is None
    above = refused(run("enqueue", lane, "{}", "--job-timeout", "21s", dsn=dsn), 1)  # the lane's is 20 s
    assert "whose job_timeout is 00:00:20" in above
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 2
    wait_timeout = refused(run("enqueue", lane, "{}", "--timeout", "5", dsn=dsn), 2)  # --timeout is --wait's
    assert "--timeout is how long --wait waits" in wait_timeout
    assert conn.execute("SELECT count(*) AS n FROM pglane.jobs").fetchone()["n"] == 2


def test_the_worker_reports_pglane_lane_paused_while_the_lane_is_paused(
    dsn: str, conn: Any, lane: str, workers: Workers
) -> None:
    ok(run("lane", "pause", lane, "--reason", "provider down", dsn=dsn))
    port = metrics_port(workers.start(lane, "tests.handlers:noop", "--metrics-port", "0", "--poll-interval", "1"))
    wait_until(lambda: scrape(port).get("pglane_lane_paused") == 1, 20, "pglane_lane_paused 1")
    ok(run("lane", "resume", lane, dsn=dsn))
    wait_until(lambda: scrape(port).get("pglane_lane_paused") == 0, 20, "pglane_lane_paused 0")


def test_a_worker_with_only_the_worker_role_reports_the_paused_gauge(
    dsn: str, conn: Any, lane: str, workers: Workers
) -> None:
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_test_login LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    conn.execute("GRANT pglane_worker TO pglane_test_login")
    proc = workers.start(lane, "tests.handlers:noop", "--metrics-port", "0", "--poll-interval", "1",
                         env={"PGLANE_DSN": make_conninfo(dsn, user="pglane_test_login")})
    port = metrics_port(proc)
    wait_until(lambda: scrape(port).get("pglane_lane_paused") == 0, 20, "the gauge at 0")
    pglane.pause_lane(conn, lane, reason="maintenance")
    wait_until(lambda: scrape(port).get("pglane_lane_paused") == 1, 20, "the gauge at 1 while paused")
    pglane.resume_lane(conn, lane)
    wait_until(lambda: scrape(port).get("pglane_lane_paused") == 0, 20, "the gauge back at 0")
