"""The bench's verdicts: a ratio is "met" or "missed" only when its whole bootstrap interval is on one
side of the target, "within noise" when the interval spans it (bench.stats, bench.report)."""

from __future__ import annotations

from typing import Any

from bench import report
from bench.stats import median_interval, ratio_interval, verdict


def test_a_verdict_is_given_only_when_the_whole_interval_is_on_one_side() -> None:
    assert verdict((0.92, 0.99), 0.95, ">=", 0.9) == "met"
    assert verdict((0.80, 0.88), 0.85, ">=", 0.9) == "missed"
    assert verdict((0.85, 0.97), 0.95, ">=", 0.9) == "within noise"
    assert verdict((1.05, 1.19), 1.1, "<=", 1.2) == "met"
    assert verdict(None, 1.3, "<=", 1.2) == "missed"  # no interval: the value decides
    assert verdict(None, None, "<=", 1.2) == "-"


def test_the_median_interval_of_repetitions_spans_their_middle_and_is_a_point_when_they_agree() -> None:
    low, high = median_interval([1.0, 2.0, 3.0])
    assert 1.0 <= low <= 2.0 <= high <= 3.0 and low < high
    assert median_interval([2.0, 2.0, 2.0]) == (2.0, 2.0)


def test_a_paired_latency_ratio_resamples_rounds_and_takes_the_better_of_several_peers() -> None:
    pglane = [1.0 + (i % 10) / 100 for i in range(200)]
    fast_peer = [2 * x for x in pglane]
    slow_peer = [4 * x for x in pglane]
    # paired by round: every resample keeps pglane at exactly half the better peer's
    low, high = ratio_interval(pglane, [fast_peer, slow_peer], 50)
    assert abs(low - 0.5) < 1e-9 and abs(high - 0.5) < 1e-9
    noisy = [x * (1.5 if i % 2 else 0.6) for i, x in enumerate(fast_peer)]
    low, high = ratio_interval(pglane, noisy, 50)
    assert low < high


def _entry(runs: list[float]) -> dict[str, Any]:
    return {"throughput_jobs_per_s": {"median": sorted(runs)[1], "runs": runs}}


def test_throughput_ratios_are_taken_within_each_repetition_and_judged_with_their_interval() -> None:
    block: dict[str, Any] = {"results": {}, "intervals": {}, "concurrency": [
        {"slots": 1, "results": {"pglane": _entry([1000.0, 1500.0, 800.0]), "floor": _entry([1050.0, 1560.0, 850.0]),
                                 "floor_one_commit": _entry([2000.0, 2600.0, 1500.0]),
                                 "procrastinate": _entry([300.0, 450.0, 250.0]),
                                 "pgqueuer": _entry([200.0, 300.0, 150.0])}},
        {"slots": 3, "results": {"pglane": _entry([700.0, 1600.0, 500.0]),
                                 "procrastinate": _entry([310.0, 320.0, 330.0]), "pgqueuer": _entry([1.0, 1.0, 1.0])}},
    ]}
    values = report.ratios(block)
    # each repetition's pglane/floor is 0.94-0.96 although the runs move by 2x between repetitions
    assert values["pglane/floor_contract"] is not None and 0.94 < values["pglane/floor_contract"] < 0.96
    targets = report.verdicts(values, block["intervals"], [1, 3])
    assert targets["pglane/floor_contract"]["verdict"] == "met"
    assert targets["pglane/best_peer"]["verdict"] == "met"  # 3.2-3.33 in every repetition
    assert targets["pglane slots3/slots1"]["verdict"] in ("missed", "within noise")
    assert set(targets["pglane slots3/slots1"]) == {"value", "target", "interval_90", "verdict", "of"}
    assert targets["wake_p99 pglane/floor_listen"]["target"] == "reported"
    table = report.versions_table([{**block, "postgres": {"version": "PostgreSQL 15.18 on x"}, "targets": targets}])
    assert "PostgreSQL 15.18" in table and "pglane slots3/slots1" in table


def test_what_pglanes_sql_and_the_contracts_rows_reach_against_the_better_peer_is_reported_per_slot_count() -> None:
    # floor (pglane's SQL, no worker) and floor_rows (the contract's rows alone) bound pglane/best_peer at
    # a slot count: their ratios are taken within each repetition, against the better peer of that repetition
    # the better peer changes between repetitions (pgqueuer in the second and third): the median of the
    # per-repetition ratios (2.0, 1.6, 1.5) is not the ratio of the medians (700 / 300 = 2.33)
    block: dict[str, Any] = {"concurrency": [
        {"slots": 8, "results": {"pglane": _entry([500.0, 700.0, 300.0]), "floor": _entry([600.0, 800.0, 600.0]),
                                 "floor_rows": _entry([900.0, 1300.0, 1200.0]),
                                 "procrastinate": _entry([300.0, 300.0, 200.0]),
                                 "pgqueuer": _entry([100.0, 500.0, 400.0])}},
    ]}
    [row] = report.concurrency_ratios(block)
    assert row["floor/best_peer"]["value"] == 1.6  # 600/300, 800/500, 600/400
    assert row["floor_rows/best_peer"]["value"] == 3.0  # 900/300, 1300/500, 1200/400
    assert row["pglane/floor_rows"]["value"] == 700.0 / 1300.0  # the median of 0.556, 0.538, 0.25
    assert row["floor_rows/best_peer"]["interval_90"] is not None
