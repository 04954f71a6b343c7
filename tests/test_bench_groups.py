"""``python -m bench --only groups`` (bench.groups) runs end to end as a real subprocess against the suite's
server, in its smallest mode: every part writes its figures, and the ledger outside the database saw
at most one call of a group in progress at once on a lane with group_slots 1 (six real workers). No
timing is asserted: speed is the bench's to measure. The ledger's arithmetic is checked on intervals
built by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import groups

ROOT = Path(__file__).resolve().parent.parent
LEDGER_JOBS, LEDGER_GROUPS, OTHERS = 48, 10, 5


def test_the_groups_bench_runs_every_part_and_no_group_runs_twice_at_once(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "groups.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "groups", "--queued", "600", "--groups", "60", "--claims", "30",
         "--others", str(OTHERS), "--rounds", "2", "--drain-jobs", "40", "--ledger-jobs", str(LEDGER_JOBS),
         "--ledger-groups", str(LEDGER_GROUPS), "--enqueue-jobs", "20", "--bulk", "300", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PGLANE_DSN": dsn}, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["mode"] == "custom" and found["postgres"].startswith("PostgreSQL ")
    verdicts = {"met", "missed", "within noise"}

    claim = found["claim"]
    for phase in ("idle", "busy"):
        for case in groups.LANES:
            assert claim[phase][case]["n"] == 30 and claim[phase][case]["p50_ms"] > 0
        for pair in ("limit/plain", "fair/plain", "limit/fair"):
            low, high = claim[phase][pair]["interval_90"]
            assert 0 < low <= high and claim[phase][pair]["p50_ratio"] > 0
        assert claim[phase]["limit/plain"]["verdict"] in verdicts
    # the busy phase's claims passed over full groups: one running job in each of 5 distinct groups
    assert len(set(claim["busy"]["full_groups_on_limit"])) == OTHERS
    where = claim["server_time_per_claim"]
    if where["limit"] is not None:  # a superuser's session may count its functions
        assert "claim_impl" in where["limit"] and "full_groups" in where["limit"]
        assert "full_groups" not in where["plain"] and "full_groups" not in where["fair"]

    tp = found["throughput"]
    for case in groups.LANES:
        assert len(tp["jobs_per_s"][case]["runs"]) == 2
    assert tp["limit/plain"]["verdict"] in verdicts and len(tp["limit/plain"]["per_round"]) == 2

    ledger = found["ledger"]
    limited, control = ledger["limited"], ledger["control"]
    assert limited["group_slots"] == 1 and control["group_slots"] is None
    for run in (limited, control):
        assert run["calls"] == run["finished"] == run["jobs_done"] == LEDGER_JOBS
        assert run["groups"] == LEDGER_GROUPS and run["workers"] == 6
    assert limited["most_at_once_per_group"] == 1, limited
    assert ledger["verdict"] == "met"

    enqueue = found["enqueue"]
    for pair in ("insert_groups/insert_plain", "enqueue_groups/enqueue_plain", "bulk_groups/bulk_plain"):
        low, high = enqueue[pair]["interval_90"]
        assert 0 < low <= high and enqueue[pair]["ratio"] > 0
    for kind in ("insert_groups", "insert_plain", "enqueue_groups", "enqueue_plain"):
        assert enqueue[kind]["n"] == 20 and enqueue[kind]["jobs_per_s"] > 0
    assert len(enqueue["bulk_groups"]["jobs_per_s"]["runs"]) == 2

    assert "most at once of one group 1 (" in done.stdout
    assert "limit/plain p50" in done.stdout and "<= 1.3:" in done.stdout and ">= 0.8:" in done.stdout


def test_the_ledger_counts_overlapping_calls() -> None:
    assert groups.most_at_once([]) == 0
    assert groups.most_at_once([(0, 10), (10, 20), (20, 30)]) == 1  # one ends as the next starts
    assert groups.most_at_once([(0, 10), (5, 15), (9, 30), (16, 17)]) == 3
    events = [("start", "a", 1, 0), ("end", "a", 1, 10), ("start", "a", 2, 10), ("end", "a", 2, 20),
              ("start", "b", 3, 5), ("end", "b", 3, 6), ("start", "b", 4, 5)]  # attempt 4 never ended
    found = groups.ledger_figures(events)
    assert found["calls"] == 4 and found["finished"] == 3 and found["groups"] == 2
    assert found["most_at_once_per_group"] == 2 and found["busiest_group"] == "b"
    assert found["most_at_once"] == 3
    assert groups.ledger_figures(events[:4])["most_at_once_per_group"] == 1


def test_the_ledger_reads_the_handlers_lines(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    path.write_text("start g0 7 70 100\nend g0 7 70 200\nstart g1 8 80 150\nend g1 8")  # the last line cut short
    assert groups.read_ledger(path) == [("start", "g0", 70, 100), ("end", "g0", 70, 200), ("start", "g1", 80, 150)]
