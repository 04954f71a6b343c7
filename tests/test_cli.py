"""The command line, run as a real process: the contract commands, one-line errors, and the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pglane
from pglane import schema
from tests.conftest import ROOT


def run(*args: str, dsn: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PGLANE_DSN"}
    if dsn is not None:
        env["PGLANE_DSN"] = dsn
    return subprocess.run([sys.executable, "-m", "pglane", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_dsn_may_follow_the_command_and_then_wins(dsn: str, tmp_path: Any) -> None:
    created = run("lane", "create", "after", "--dsn", dsn)
    assert created.returncode == 0, created.stderr
    unreachable = f"host={tmp_path} port=1 dbname=none connect_timeout=2"
    listed = run("--dsn", unreachable, "status", "--json", "--dsn", dsn)
    assert listed.returncode == 0, listed.stderr
    assert [row["lane"] for row in json.loads(listed.stdout)] == ["after"]


def test_a_missing_dsn_is_one_line_that_says_how_to_fix_it() -> None:
    done = run("status")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "pass --dsn" in done.stderr and "PGLANE_DSN" in done.stderr


def test_an_unreachable_database_is_one_line_that_says_how_to_fix_it(tmp_path: Any) -> None:
    done = run("--dsn", f"host={tmp_path} port=1 dbname=none connect_timeout=2", "status")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0
    assert "cannot connect to the database" in done.stderr and "--dsn / PGLANE_DSN" in done.stderr


def test_lane_create_enqueue_and_the_key_dedupe_from_the_command_line(dsn: str, conn: Any) -> None:
    created = run("lane", "create", "brain", "--job-timeout", "30", "--max-attempts", "2", dsn=dsn)
    assert created.returncode == 0, created.stderr
    first = run("enqueue", "brain", '{"q": 1}', "--key", "k1", dsn=dsn)
    again = run("enqueue", "brain", '{"q": 1}', "--key", "k1", dsn=dsn)
    assert first.returncode == again.returncode == 0
    assert first.stdout.strip() == again.stdout.strip() == "1"
    lane = conn.execute("SELECT job_timeout, lease_timeout, max_attempts FROM pglane.lanes").fetchone()
    assert (lane["job_timeout"].total_seconds(), lane["lease_timeout"].total_seconds(), lane["max_attempts"]) == (
        30, 33, 2)


def test_bad_input_on_the_command_line_is_refused_clearly(dsn: str, lane: str) -> None:
    bad_json = run("enqueue", "brain", "{nope", dsn=dsn)
    assert bad_json.returncode == 2 and "payload is not valid JSON" in bad_json.stderr
    unknown = run("enqueue", "ghost", "{}", dsn=dsn)
    assert unknown.returncode == 1 and "unknown lane 'ghost'" in unknown.stderr
    scalar = run("enqueue", "brain", "42", dsn=dsn)
    assert scalar.returncode == 1 and "must be a JSON object or array" in scalar.stderr
    contradictory = run("lane", "create", "odd", "--job-timeout", "60", "--lease-timeout", "30", dsn=dsn)
    assert contradictory.returncode == 1 and "lease_timeout must be longer than job_timeout" in contradictory.stderr


def test_status_jobs_and_show_tell_the_state_and_the_next_safe_action(dsn: str, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {"q": 1})
    status = run("status", dsn=dsn)
    assert status.returncode == 0
    assert "brain" in status.stdout and "start a worker for lane brain" in status.stdout
    rows = json.loads(run("status", "--json", dsn=dsn).stdout)
    assert rows[0]["lane"] == "brain" and rows[0]["queued"] == 1 and rows[0]["consumers"] == 0
    jobs = json.loads(run("jobs", "--lane", "brain", "--status", "queued", "--json", dsn=dsn).stdout)
    assert [j["job_id"] for j in jobs] == [job] and jobs[0]["queue_position"] == 1
    shown = run("show", str(job), dsn=dsn)
    assert shown.returncode == 0 and "next safe action:" in shown.stdout
    assert json.loads(run("show", str(job), "--json", dsn=dsn).stdout)["status"] == "queued"


def test_retry_and_cancel_only_where_allowed(dsn: str, conn: Any, lane: str) -> None:
    job = pglane.enqueue(conn, lane, {})
    assert run("cancel", str(job), dsn=dsn).returncode == 0
    assert pglane.job_status(conn, job)["status"] == "cancelled"
    again = run("cancel", str(job), dsn=dsn)
    assert again.returncode == 1 and "only queued jobs can be cancelled" in again.stderr
    assert run("retry", str(job), dsn=dsn).returncode == 0
    assert pglane.job_status(conn, job)["status"] == "queued"
    conn.execute("UPDATE pglane.jobs SET status = 'done' WHERE id = %s", (job,))
    done = run("retry", str(job), dsn=dsn)
    assert done.returncode == 1 and "only failed or cancelled jobs can be retried" in done.stderr
    assert "its result is stored" in done.stderr
    missing = run("show", "999", dsn=dsn)
    assert missing.returncode == 1 and "no job 999" in missing.stderr


def test_check_names_the_rule_that_breaks(dsn: str, conn: Any) -> None:
    pglane.create_lane(conn, "research", job_timeout=600, lease_timeout=660)
    ok = run("check", "--stop-grace", "660", dsn=dsn)
    assert ok.returncode == 0 and "lane research: ok" in ok.stdout
    short_grace = run("check", "--stop-grace", "30", dsn=dsn)
    assert short_grace.returncode == 1 and "R3 stop grace >= worker timeout" in short_grace.stdout
    slow_worker = run("check", "--worker-timeout", "700", dsn=dsn)
    assert slow_worker.returncode == 1 and "R2 worker timeout < lease_timeout" in slow_worker.stdout
    fast_worker = run("check", "--worker-timeout", "100", dsn=dsn)
    assert fast_worker.returncode == 1 and "R2 job_timeout <= worker timeout" in fast_worker.stdout
    unknown_grace = run("check", dsn=dsn)  # R3 needs the process manager's number: never a silent "ok"
    assert unknown_grace.returncode == 0
    assert "lane research: R3 not checked: give --stop-grace S" in unknown_grace.stdout
    assert "at least 620s" in unknown_grace.stdout
    assert "R3 not checked" not in ok.stdout


def test_migrate_command_reports_the_revision(dsn: str) -> None:
    done = run("migrate", dsn=dsn)
    assert done.returncode == 0 and f"revision {schema.head()}" in done.stdout


def test_the_demo_runs_on_the_embedded_default_and_shows_the_whole_promise() -> None:
    done = run("demo", timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "starting a throwaway embedded PostgreSQL" in out
    assert "the repeated request-2 returned job 2 again" in out
    assert "killed with SIGKILL" in out
    assert ": lost: " in out and "the paid call may have been made" in out
    assert "the paid service was called 1 time(s) for it" in out
    assert "retry only if you accept paying again" in out


def test_prune_paces_itself_to_its_duty_and_refuses_a_bad_one(dsn: str, conn: Any, lane: str) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, '{}' FROM generate_series(1, 6000)", (lane,))
    conn.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now() - interval '1 day' WHERE lane = %s",
                 (lane,))
    done = run("prune", "--older-than", "1h", "--batch", "500", "--duty", "0.25", "--json", dsn=dsn)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # milliseconds, where the line for a person rounds to 10 ms
    assert report["pruned"] == 6000, report
    # Paused three times as long as each batch took; the last, empty batch has no pause after it.
    assert 0.15 <= report["deleting_seconds"] / report["seconds"] <= 0.30, report
    bad = run("prune", "--older-than", "1h", "--duty", "0", dsn=dsn)
    assert bad.returncode == 2 and "not a share of time between 0 (exclusive) and 1" in bad.stderr
