"""Handlers the tests run in real worker processes. ``paid_call`` is the fake paid service: it
records in the ledger (append + fsync, outside the database) that the handler got the job
("claimed"), that the paid call began ("start") and that it answered ("end"), and behaves as the
payload asks: {"hold_before": s} waits between claim and call, {"sleep": s} is the call's length,
{"hold_after": s} waits between the answer and returning it, {"fail": "message"} raises,
{"poison": true} kills its own process in the middle of the call, {"result": value}."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from pglane import Job, RetryLater

LEDGER_ENV = "PGLANE_TEST_LEDGER"  # the ledger file's path, set by tests.conftest.Workers


def _record(event: str, job: Job) -> None:
    path = os.environ[LEDGER_ENV]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{event} {job.id} {job.attempt_id} {time.monotonic_ns()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def paid_call(job: Job) -> Any:
    payload = job.payload if isinstance(job.payload, dict) else {}
    _record("claimed", job)
    time.sleep(float(payload.get("hold_before", 0)))
    _record("start", job)
    if payload.get("poison"):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(payload.get("sleep", 0)))
    if "fail" in payload:
        raise RuntimeError(payload["fail"])
    _record("end", job)
    time.sleep(float(payload.get("hold_after", 0)))
    return payload.get("result", {"job": job.id, "seq": job.seq})


async def async_paid_call(job: Job) -> Any:
    _record("start", job)
    payload = job.payload if isinstance(job.payload, dict) else {}
    await asyncio.sleep(float(payload.get("sleep", 0)))
    _record("end", job)
    return {"job": job.id, "seq": job.seq}


async def ignores_cancellation(job: Job) -> Any:
    _record("start", job)
    deadline = time.monotonic() + float(job.payload.get("sleep", 60))
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue
    _record("end", job)
    return {"job": job.id}


async def slow_first(job: Job) -> Any:
    """Overruns any job timeout on its first attempt (cancellable), answers at once on the next."""
    _record("start", job)
    if job.attempt_number == 1:
        await asyncio.sleep(60)
    _record("end", job)
    return {"attempt": job.attempt_number}


def not_json(job: Job) -> Any:
    _record("start", job)
    _record("end", job)
    return {"when": object()}


def unstorable(job: Job) -> Any:
    """A JSON result that jsonb refuses (a NUL character): the database cannot store it."""
    _record("start", job)
    _record("end", job)
    return {"text": "a\x00b"}


def noop(job: Job) -> Any:
    return None


async def noop_async(job: Job) -> Any:
    """Returns without ever suspending: the worker's event loop gets no turn from the call."""
    return None


def echo(job: Job) -> Any:
    return {"echo": job.payload}


def lane_and_seq(job: Job) -> Any:
    """What a handler serving many lanes tells them apart by: job.lane (and the lane's seq)."""
    return {"lane": job.lane, "seq": job.seq}


NOT_CALLABLE = {"a": "dict"}  # a handler spec naming this is refused: not callable


def hostile(job: Job) -> Any:
    """Records its call, then answers as the payload asks: {"nest": n} a list nested n deep,
    {"chars": n} a string of n characters, {"raise_chars": n} raises an error of n characters,
    {"raise": text} raises it, else {"result": value} that value (anything the payload holds)."""
    _record("start", job)
    payload = job.payload if isinstance(job.payload, dict) else {}
    if "raise" in payload:
        raise ValueError(str(payload["raise"]))
    if "raise_chars" in payload:
        raise ValueError("x" * int(payload["raise_chars"]) + " the real cause")
    _record("end", job)
    if "nest" in payload:
        value: Any = []
        for _ in range(int(payload["nest"])):
            value = [value]
        return value
    if "chars" in payload:
        return "y" * int(payload["chars"])
    return payload.get("result")


def provider(job: Job) -> Any:
    """The fake paid provider that pushes back: {"refuse": n, "after": s, "reason": r} refuses the job's
    first n attempts before any paid work (ledger "refused", then RetryLater), then calls as paid_call."""
    payload = job.payload if isinstance(job.payload, dict) else {}
    if job.attempt_number <= int(payload.get("refuse", 0)):
        _record("refused", job)
        reason = str(payload.get("reason", "429 Too Many Requests"))
        raise RetryLater(after=float(payload.get("after", 0)), reason=reason)
    return paid_call(job)


async def async_provider(job: Job) -> Any:
    """provider, as an async handler: RetryLater raised from a coroutine."""
    payload = job.payload if isinstance(job.payload, dict) else {}
    if job.attempt_number <= int(payload.get("refuse", 0)):
        _record("refused", job)
        await asyncio.sleep(0)
        raise RetryLater(after=float(payload.get("after", 0)), reason=str(payload.get("reason", "429")))
    return await async_paid_call(job)
