"""Handlers that ``python -m pglane worker --handler bench.handlers:...`` runs.

``noop``: does nothing (async, so no thread hop): the throughput handler.
``stamp``: records when it started job ``payload.n`` (see bench.procs.stamp), then sleeps
``payload.sleep`` seconds if given: the wake-latency and takeover handler.

With BENCH_PROFILE=FILE the worker process that imports this module runs under cProfile from then on
and dumps its statistics to FILE at exit (a graceful SIGTERM stop runs atexit).
"""

from __future__ import annotations

import asyncio
import atexit
import cProfile
import os
from typing import Any

from bench.procs import stamp as _stamp
from pglane import Job


async def noop(job: Job) -> None:
    return None


async def stamp(job: Job) -> None:
    payload: dict[str, Any] = job.payload if isinstance(job.payload, dict) else {}
    _stamp(int(payload.get("n", -1)))
    if payload.get("sleep"):
        await asyncio.sleep(float(payload["sleep"]))


def _start_profile(path: str) -> None:
    profile = cProfile.Profile()
    profile.enable()
    atexit.register(lambda: (profile.disable(), profile.dump_stats(path)))


if os.environ.get("BENCH_PROFILE"):
    _start_profile(os.environ["BENCH_PROFILE"])
