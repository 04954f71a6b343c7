"""Handlers that ``python -m pglane worker --handler bench.handlers:...`` runs.

``noop``: does nothing (async, so no thread hop): the throughput handler.
``stamp``: records when it started job ``payload.n`` (see bench.procs.stamp), then sleeps
``payload.sleep`` seconds if given: the wake-latency and takeover handler.
``ledger``: appends ``start GROUP JOB ATTEMPT NS`` to $BENCH_LEDGER (monotonic ns, fsynced), sleeps
``payload.sleep`` seconds, appends the same with ``end``: a record outside the database of when each
group's calls were in progress (``python -m bench --only groups``, bench.groups.read_ledger).

With BENCH_PROFILE=FILE the worker process that imports this module runs under cProfile from then on
and dumps its statistics to FILE at exit (a graceful SIGTERM stop runs atexit).

With BENCH_EXPERIMENT=lean-call (only ``python -m bench --only profile`` sets it) this worker process patches
its own copy of pglane's worker in memory: SlotLoop._call awaits the async handler directly (no
watchdog, no timeout, no session watcher). That is a lower bound for the call scaffolding, to measure
what it costs; nothing on disk changes.
"""

from __future__ import annotations

import asyncio
import atexit
import cProfile
import os
import time
from typing import Any

from bench.procs import stamp as _stamp
from pglane import Job
from pglane.job import Claim


async def noop(job: Job) -> None:
    return None


async def stamp(job: Job) -> None:
    payload: dict[str, Any] = job.payload if isinstance(job.payload, dict) else {}
    _stamp(int(payload.get("n", -1)))
    if payload.get("sleep"):
        await asyncio.sleep(float(payload["sleep"]))


def _ledger(event: str, job: Job, group: str) -> None:
    fd = os.open(os.environ["BENCH_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {group} {job.id} {job.attempt_id} {time.monotonic_ns()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def ledger(job: Job) -> None:
    """A sync handler (its own thread): the start and end of its call in the ledger, around the sleep."""
    payload: dict[str, Any] = job.payload if isinstance(job.payload, dict) else {}
    group = str(payload.get("group", "-"))
    _ledger("start", job, group)
    time.sleep(float(payload.get("sleep", 0)))
    _ledger("end", job, group)


def _start_profile(path: str) -> None:
    profile = cProfile.Profile()

    def dump() -> None:
        profile.disable()
        profile.dump_stats(path)

    profile.enable()
    atexit.register(dump)


def _experiment(name: str) -> None:
    from pglane import handler as handlers
    from pglane import slotloop

    async def lean_call(self: slotloop.SlotLoop, session: Any, claim: Claim) -> handlers.Outcome:
        return handlers.encode(await self.lane.caller.runner.handler(claim.job))

    if name == "lean-call":
        slotloop.SlotLoop._call = lean_call  # type: ignore[method-assign]


if os.environ.get("BENCH_EXPERIMENT"):
    _experiment(os.environ["BENCH_EXPERIMENT"])
if os.environ.get("BENCH_PROFILE"):
    _start_profile(os.environ["BENCH_PROFILE"])
