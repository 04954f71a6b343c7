"""Small shared pieces: percentiles, run summaries, the progress line, bounded waiting."""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99), "n": len(ms)}


def _middle(found: list[float], level: float) -> tuple[float, float]:
    found.sort()
    tail = (1.0 - level) / 2.0
    return percentile(found, 100.0 * tail), percentile(found, 100.0 * (1.0 - tail))


def ratio_interval(a: Sequence[float], b: Sequence[float] | Sequence[Sequence[float]], q: float,
                   level: float = 0.90, rounds: int = 1000, seed: int = 1, best: Callable[..., float] = min
                   ) -> tuple[float, float]:
    """A bootstrap interval for percentile(a, q) / percentile(b, q) of two sets of latency samples;
    ``b`` may be several sets (the peers), of which the ``best`` percentile (default: the lowest)
    counts. Sets of equal length are taken as paired (sample i of each came from the same round of
    the interleaved run) and resampled by round; otherwise each is resampled on its own. The middle
    ``level`` of the ratios: how far a ratio of percentiles can move by the luck of which samples
    landed where."""
    others: list[Sequence[float]] = (list(b) if b and isinstance(b[0], Sequence)  # type: ignore[arg-type]
                                     else [b])  # type: ignore[list-item]
    paired = all(len(o) == len(a) for o in others)
    rng = random.Random(seed)
    found = []
    for _ in range(rounds):
        if paired:
            idx = rng.choices(range(len(a)), k=len(a))
            pa, pbs = [a[i] for i in idx], [[o[i] for i in idx] for o in others]
        else:
            pa, pbs = rng.choices(a, k=len(a)), [rng.choices(o, k=len(o)) for o in others]
        found.append(percentile(pa, q) / best(percentile(pb, q) for pb in pbs))
    return _middle(found, level)


def sum_ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.90, rounds: int = 1000,
                       seed: int = 1) -> tuple[float, float]:
    """A bootstrap interval for sum(a) / sum(b) of two paired sets of samples (sample i of each from the
    same round of an interleaved run, resampled by round): the ratio of two mean costs, e.g. the time
    per job of two kinds of enqueue, whose inverse is the ratio of their throughputs."""
    assert len(a) == len(b) and a, "paired samples"
    rng = random.Random(seed)
    found = []
    for _ in range(rounds):
        idx = rng.choices(range(len(a)), k=len(a))
        found.append(sum(a[i] for i in idx) / sum(b[i] for i in idx))
    return _middle(found, level)


def median_interval(runs: Sequence[float], level: float = 0.90, rounds: int = 1000, seed: int = 1
                    ) -> tuple[float, float]:
    """A bootstrap interval of the median of ``runs`` (repetitions, or ratios taken within each
    repetition): the repetitions are resampled with replacement ``rounds`` times; the middle ``level``
    of the medians. With 3 repetitions it is about their range, as it should be."""
    rng = random.Random(seed)
    return _middle([statistics.median(rng.choices(runs, k=len(runs))) for _ in range(rounds)], level)


def verdict(interval: tuple[float, float] | None, value: float | None, op: str, bound: float) -> str:
    """"met" or "missed" when the whole interval (or, with none, the value) is on one side of the
    bound; "within noise" when the interval spans it: another run on the same machine could as well
    give the other answer. "-" when nothing was measured."""
    def ok(x: float) -> bool:
        return {"<": x < bound, "<=": x <= bound, ">=": x >= bound, ">": x > bound}[op]

    if value is None:
        return "-"
    if interval is None:
        return "met" if ok(value) else "missed"
    low, high = interval
    if ok(low) and ok(high):
        return "met"
    if not ok(low) and not ok(high):
        return "missed"
    return "within noise"


def summary(runs: Sequence[float]) -> dict[str, Any]:
    """Median and range of repeated runs, with the runs themselves."""
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs), "runs": list(runs)}


def rotations(names: Sequence[str], repetitions: int) -> list[tuple[int, str]]:
    """(repetition, name) in interleaved order: every repetition runs all names, each time starting
    one further along, so slow drift of the machine hits every system alike."""
    order: list[tuple[int, str]] = []
    for rep in range(repetitions):
        shift = rep % len(names)
        order.extend((rep, name) for name in [*names[shift:], *names[:shift]])
    return order


def progress(text: str) -> None:
    """One status line on stderr: which part, system and repetition is running."""
    sys.stderr.write(f"\r\033[K[bench {time.strftime('%H:%M:%S')}] {text}")
    sys.stderr.flush()


def progress_done() -> None:
    sys.stderr.write("\n")
    sys.stderr.flush()


class BenchTimeout(RuntimeError):
    pass


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.02) -> None:
    """Poll ``check`` until it is true; BenchTimeout after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise BenchTimeout(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Sizes:
    """How much work each part does: --quick shrinks all of it."""

    throughput_jobs: int  # at most this many jobs per drain
    drain_seconds: float  # each system's drain size is set to last about this long
    repetitions: int
    wake_jobs: int
    claim_cases: tuple[tuple[int, int], ...]  # (queued, finished)
    claims_per_case: int
    takeover_kills: int
    enqueue_jobs: int
    bounded_backlog: int
    cost_jobs: int

    @staticmethod
    def choose(quick: bool) -> Sizes:
        if quick:
            return Sizes(throughput_jobs=2000, drain_seconds=0.6, repetitions=3, wake_jobs=150,
                         claim_cases=((1_000, 0), (100_000, 0), (1_000, 100_000)), claims_per_case=800,
                         takeover_kills=5, enqueue_jobs=800, bounded_backlog=100_000, cost_jobs=800)
        return Sizes(throughput_jobs=8000, drain_seconds=4.0, repetitions=5, wake_jobs=1000,
                     claim_cases=((1_000, 0), (100_000, 0), (1_000_000, 0), (1_000, 1_000_000)),
                     claims_per_case=1000, takeover_kills=7, enqueue_jobs=2000, bounded_backlog=100_000,
                     cost_jobs=2000)
