"""``python -m bench --only lanes`` (bench.lanes) runs end to end as a real subprocess against the suite's
server at a tiny scale (20 lanes in one process, 5 busy): every part writes its figures, and every job
it enqueued ran exactly once. No timing is asserted: speed is the bench's to measure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import lanes

ROOT = Path(__file__).resolve().parent.parent
LANES, BUSY, JOBS, SAMPLES, ROUNDS = 20, 5, 20, 5, 2


def test_the_lanes_bench_measures_every_part_and_runs_each_job_once(dsn: str, tmp_path: Path) -> None:
    out = tmp_path / "lanes.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--only", "lanes", "--lanes", str(LANES), "--busy", str(BUSY), "--jobs",
         str(JOBS), "--samples", str(SAMPLES), "--window", "1", "--rounds", str(ROUNDS), "--logs",
         str(tmp_path / "logs"), "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PGLANE_DSN": dsn}, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["mode"] == "custom" and found["postgres"].startswith("PostgreSQL ")
    verdicts = {"met", "missed", "within noise"}

    c = found["connections"]
    assert c["lanes"] == LANES and c["one_lane"] >= 1 and c["ready_s"] > 0
    assert c["rss_mb"]["many"] > 10 and c["rss_mb"]["one"] > 10  # a Python process with psycopg loaded
    if found["settings"]["sessions_passed"]:  # K shared sessions and the lanes watcher's connection
        assert 1 <= c["many"] <= found["settings"]["sessions"] + 2, c
    else:  # a connection per slot
        assert c["many"] >= LANES, c

    idle = found["idle"]
    assert idle["window_s"] >= 1 and idle["transactions_per_s"] is not None
    for key in (f"{lanes.MANY}_cpu_per_s", f"{lanes.ONE}_cpu_per_s", f"{lanes.MANY}_backends_cpu_per_s"):
        assert idle[key] >= 0, key
    assert idle["server_cpu_per_s"] is None or idle["server_cpu_per_s"] >= 0

    wake = found["wake"]
    for who in ("many", "one"):
        assert wake[who]["n"] == SAMPLES and wake[who]["p50_ms"] > 0
    low, high = wake["many/one"]["interval_90"]
    # A sample may be negative: the producer reads its clock after its commit returns, and on a loaded
    # machine the worker can start the job before that (bench.lanes.wake): so may a resampled ratio.
    assert low <= high and wake["many/one"]["p50_ratio"] > 0 and wake["many/one"]["verdict"] in verdicts

    tp = found["throughput"]
    assert len(tp["rounds"]) == ROUNDS
    for r in tp["rounds"]:
        for how in ("one_process", "processes"):
            assert r[how]["jobs"] == r[how]["done_once"] == BUSY * JOBS and r[how]["jobs_per_s"] > 0
        assert r["floor_one_commit"]["jobs_per_s"] > 0
    for pair in ("one_process/processes", "one_process/floor_one_commit", "processes/floor_one_commit"):
        assert len(tp[pair]["per_round"]) == ROUNDS and tp[pair]["ratio"] > 0
    assert tp["one_process/processes"]["verdict"] in verdicts

    enqueued = 2 * (lanes.WARMUP + SAMPLES) + ROUNDS * 2 * BUSY * JOBS
    assert found["jobs"] == {"enqueued": enqueued, "done": enqueued, "attempts": enqueued, "not_once": 0}
    assert "one_process/processes" in done.stdout and "<= 1.5:" in done.stdout and ">= 0.8:" in done.stdout
