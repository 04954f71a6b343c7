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


def ratio_interval(a: Sequence[float], b: Sequence[float], q: float, level: float = 0.90,
                   rounds: int = 1000, seed: int = 1) -> tuple[float, float]:
    """A bootstrap interval for percentile(a, q) / percentile(b, q): both sample sets are resampled
    with replacement ``rounds`` times; the middle ``level`` of the ratios. It says how far a ratio of
    tail percentiles can move by the luck of which few samples landed in the tail."""
    rng = random.Random(seed)
    found = sorted(percentile(rng.choices(a, k=len(a)), q) / percentile(rng.choices(b, k=len(b)), q)
                   for _ in range(rounds))
    tail = (1.0 - level) / 2.0
    return percentile(found, 100.0 * tail), percentile(found, 100.0 * (1.0 - tail))


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

    throughput_jobs: int
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
            return Sizes(throughput_jobs=1500, repetitions=3, wake_jobs=200,
                         claim_cases=((1_000, 0), (100_000, 0), (1_000, 100_000)), claims_per_case=800,
                         takeover_kills=5, enqueue_jobs=800, bounded_backlog=100_000, cost_jobs=800)
        return Sizes(throughput_jobs=5000, repetitions=5, wake_jobs=1000,
                     claim_cases=((1_000, 0), (100_000, 0), (1_000_000, 0), (1_000, 1_000_000)),
                     claims_per_case=1000, takeover_kills=7, enqueue_jobs=2000, bounded_backlog=100_000,
                     cost_jobs=2000)
