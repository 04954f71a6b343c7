"""Crash-suite helpers: the invariants every crash must leave intact, checked from the database and
from the fake paid service's ledger (which lives outside the database and survives everything)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pglane
from tests.conftest import Ledger, wait_until


def drained(conn: Any, lane: str, jobs: list[int], timeout: float = 60) -> None:
    """Wait until every job of ``jobs`` is finished (done, failed or cancelled)."""
    def finished() -> bool:
        row = conn.execute("SELECT count(*) AS n FROM pglane.jobs WHERE id = ANY(%s)"
                           " AND status IN ('done', 'failed', 'cancelled')", (jobs,)).fetchone()
        return bool(row["n"] == len(jobs))

    wait_until(finished, timeout, f"{len(jobs)} jobs of lane {lane} to finish")


def check_invariants(conn: Any, lane: str, jobs: list[int], ledger: Ledger, *, at_most_once: bool = True) -> None:
    """After a crash and a recovery: no job lost, no call made twice (on at-most-once lanes), no
    attempt left running, every failed job explained by its attempts, the lane's seq gapless."""
    pglane.recover(conn, lane)
    rows = conn.execute("SELECT id, status, last_error, attempts FROM pglane.jobs WHERE lane = %s", (lane,)).fetchall()
    by_id = {r["id"]: r for r in rows}
    assert set(jobs) <= set(by_id), f"lost jobs: {sorted(set(jobs) - set(by_id))}"
    assert all(by_id[j]["status"] in ("done", "failed") for j in jobs), Counter(by_id[j]["status"] for j in jobs)

    running = conn.execute("SELECT count(*) AS n FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
                           " WHERE j.lane = %s AND a.status = 'running'", (lane,)).fetchone()["n"]
    assert running == 0, "an attempt was left running after recovery"

    calls = Counter(ledger.calls())
    if at_most_once:
        twice = {job: n for job, n in calls.items() if n > 1}
        assert not twice, f"paid twice: {twice}"
    for job in jobs:
        if by_id[job]["status"] == "done":
            continue
        last = conn.execute("SELECT status, error FROM pglane.attempts WHERE job_id = %s"
                            " ORDER BY attempt_number DESC LIMIT 1", (job,)).fetchone()
        assert last is not None, f"job {job} failed without an attempt"
        assert last["status"] in ("lost", "failed", "timed_out") and last["error"], (job, last)
        assert by_id[job]["last_error"], f"job {job} failed without a reason"
        if last["status"] == "lost":
            assert "may have been made" in by_id[job]["last_error"]
    # Every job whose paid call answered is done (its output was stored) unless the crash came
    # between the answer and the store, where it is failed as "may have been made".
    seqs = [r["seq"] for r in conn.execute(
        "SELECT a.seq FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id WHERE j.lane = %s"
        " ORDER BY a.seq", (lane,))]
    assert seqs == list(range(1, len(seqs) + 1)), "seq has gaps or repeats"
    last_seq = conn.execute("SELECT c.last_seq FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
                            " WHERE l.name = %s", (lane,)).fetchone()["last_seq"]
    assert last_seq == len(seqs)
