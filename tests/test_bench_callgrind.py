"""``python -m bench --only scale --only instructions`` runs end to end: a single-user backend under valgrind's
callgrind drains jobs through complete_and_claim in two databases (with and without lane_status's
counts), and what makes it worth having holds on any machine: the count repeats, round after round,
where the seconds do not. No figure of speed is asserted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import rates, scale


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian's package valgrind)")
def test_instructions_per_job_repeat_round_after_round(tmp_path: Path) -> None:
    out = tmp_path / "instructions.json"
    assert scale.main(["--only", "instructions", "--rounds", "3", "--ic-jobs", "40", "--json", str(out)]) == 0
    found = json.loads(out.read_text())["claim_complete_instructions"]
    counts = found["instructions_per_job"]
    assert len(counts["with_counts"]) == len(counts["without"]) == 3
    # A claim and a completion take hundreds of thousands of instructions on any PostgreSQL build here.
    assert all(100_000 < n < 10_000_000 for n in counts["with_counts"] + counts["without"])
    # Paired rounds repeat: the ratio moves by well under the 2 % the bench judges (seconds move by 20 %).
    low, high = counts["ratio_range"]
    assert high - low < 0.01, counts
    assert counts["verdict"].split(" ")[0] in ("met", "missed", "within")


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian's package valgrind)")
def test_a_rate_limit_is_counted_in_instructions_and_costs_the_server_something(tmp_path: Path) -> None:
    """``python -m bench --only rates --only instructions``: the generous lane records every start (in the
    counters row's pending starts, moved into lane_starts every 32nd start), so it costs more than the
    unlimited lane, by a repeatable amount."""
    out = tmp_path / "rates.json"
    assert rates.main(["--only", "instructions", "--ic-rounds", "2", "--ic-jobs", "40", "--json", str(out)]) == 0
    found = json.loads(out.read_text())["instructions"]
    assert 100_000 < found["unlimited"] < found["generous"] < 10_000_000, found
    low, high = found["interval_90"]
    # The rate path's work depends a little on the clock (which starts have left the window), and under
    # valgrind on a loaded machine the clock runs fast against the work: rounds then differ by up to ~1.5 %.
    assert 1.0 < low <= found["ratio"] <= high and high - low < 0.03, found
    assert found["verdict"] in ("met", "missed", "within noise"), found
