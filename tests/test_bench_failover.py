"""``python -m bench --only failover`` runs end to end: one failover of a real primary and synchronous standby
with a real worker, its figures written as JSON. Speed is measured by the bench, never asserted here;
only what must hold on any machine is: no job can start on the promoted standby before its promotion
began."""

from __future__ import annotations

import json
from pathlib import Path

from bench import failover


def test_the_failover_bench_measures_one_run_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    assert failover.main(["--runs", "1", "--json", str(out), "--dir", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    [run] = report["runs"]
    assert set(failover.FIGURES) <= set(run)
    assert run["promotion_s"] > 0
    assert run["kill_to_next_job_s"] > run["kill_to_promote_s"] > 0
    assert report["median"] == {k: run[k] for k in failover.FIGURES}
