"""``python -m bench --only soak`` (bench.soak): a small soak against the suite's server (real worker,
real producer), and the verdict rules on series built by hand (pure computation)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import psycopg
import pytest

from bench import soak

pytest.importorskip("matplotlib")


def test_small_soak_runs_every_job_and_writes_its_report(dsn: str, tmp_path: Path) -> None:
    samples, judged = soak.soak(dsn, jobs=2000, producers=1, out=tmp_path, interval=0.25, backlog=200)
    summary = {"settings": {"jobs": 2000, "producers": 1, "interval": 0.25, "backlog": 200}, "postgres": "test",
               "elapsed_s": samples[-1]["t"], "jobs_done": samples[-1]["jobs_done"], "samples": len(samples),
               "verdicts": judged}
    soak.write(samples, summary, tmp_path)

    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FILTER (WHERE status = 'done'), count(*) FROM pglane.jobs"
                           " WHERE lane = %s", (soak.LANE,)).fetchone()
    assert row == (2000, 2000)
    assert samples[-1]["jobs_done"] == 2000 and samples[-1]["queued"] == 0
    assert len(samples) >= 6
    # every finished job falls in some window after the first sample
    rates = [s["rate"] for s in samples[1:]]
    windows = [s["t"] - p["t"] for p, s in itertools.pairwise(samples)]
    assert sum(r * w for r, w in zip(rates, windows, strict=True)) == pytest.approx(2000, abs=5)
    first = samples[0]
    assert first["worker_rss_mb"] > 5 and first["worker_fds"] >= 3 and first["worker_sessions"] >= 1
    assert {"jobs", "attempts", "lane_counters"} <= set(first["tables"])
    assert "jobs_queue" in first["indexes"] and first["indexes"]["jobs_queue"]["partial"]

    flat = judged["must_be_flat"]
    assert {"worker_rss_mb", "worker_fds", "worker_sessions", "connections", "table lane_counters",
            "index jobs_queue"} <= set(flat)
    assert "index jobs_pkey" not in flat and "index jobs_pkey" in judged["history"]
    assert judged["history"]["jobs"]["bytes_per_job"] > 0
    assert set(judged["dead_tuples"]) >= {"jobs", "attempts"}
    assert judged["throughput"]["windows"] >= 1 and judged["throughput"]["first_third"] > 0
    assert flat["worker_fds"]["verdict"] == "flat", flat["worker_fds"]

    text = soak.report(summary)
    for needle in ("must stay flat", "worker_rss_mb", "dead tuples", "history (may grow)", "throughput per",
                   "verdict:"):
        assert needle in text
    assert json.loads((tmp_path / "summary.json").read_text())["jobs_done"] == 2000
    assert (tmp_path / "soak.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "samples.csv").read_text().splitlines()[0].startswith("t,")


TIMES = [3.0 * i for i in range(60)]  # three minutes sampled every 3 s


def rss(i: int) -> float:
    return 39.7 + (0.1 if i % 3 == 0 else -0.05 if i % 3 == 1 else 0.0)  # noise of a tenth of a MB


def judge_rss(values: list[float]) -> dict[str, object]:
    return soak.judge(TIMES, values, unit="MB", abs_tol=1.0, rel_tol=0.05, warmup=18.0)


def test_judge_flat_noisy_series_is_flat() -> None:
    assert judge_rss([rss(i) for i in range(60)])["verdict"] == "flat"


def test_judge_flags_a_steady_leak() -> None:
    judged = judge_rss([rss(i) + 0.1 * i for i in range(60)])  # +6 MB over the run
    assert judged["grew"] is True
    # after the 18 s warm-up, 54 samples: medians of samples 6-23 and 42-59, 36 samples (3.6 MB) apart
    assert str(judged["verdict"]).startswith("grew by 3.6 MB")


def test_judge_ignores_warmup_growth_and_a_single_spike() -> None:
    warm = [30.0 + i if i < 6 else 39.7 for i in range(60)]  # the first 18 s: caches fill
    assert judge_rss(warm)["verdict"] == "flat"
    spike = [rss(i) for i in range(60)]
    spike[55] = 80.0
    assert judge_rss(spike)["verdict"] == "flat"


def test_judge_counts_a_growing_fd_count_and_a_step() -> None:
    fds = [11.0 + i // 20 for i in range(60)]  # one more every minute
    judged = soak.judge(TIMES, fds, unit="fds", abs_tol=1.0, rel_tol=0.0, warmup=18.0)
    assert judged["grew"] and judged["delta"] == 2.0
    assert soak.judge(TIMES, [11.0] * 60, unit="fds", abs_tol=1.0, rel_tol=0.0, warmup=18.0)["verdict"] == "flat"


def test_judge_throughput() -> None:
    steady = [600.0 + (10 if i % 2 else -10) for i in range(60)]
    assert soak.judge_throughput(TIMES, steady, 18.0)["stable"] is True
    falling = [600.0 - 6 * i for i in range(60)]
    judged = soak.judge_throughput(TIMES, falling, 18.0)
    assert judged["stable"] is False and judged["verdict"].startswith("fell to 0.")
