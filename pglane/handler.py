"""Handlers: load ``MODULE:CALLABLE`` and run it on one job under the lane's job timeout.

Owns the handler: loading it, running it, what became of it (``Outcome``) and ``settle()``, the two
deadlines of a started call; pglane.call makes the worker's calls with these. Invariant: a handler's
outcome is always one of ``Outcome``'s three shapes, and a result that cannot be stored as JSON is a
failure of the attempt, never a crash of the worker. A sync handler runs in a dedicated thread (it
cannot be cancelled: past the worker's hard timeout the process recycles itself, see pglane.call); an
async one runs on the event loop and is cancelled at the job timeout. No database is involved here.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError
from .job import Job
from .retry_later import RetryLater

Handler = Callable[[Job], Any]


def search_cwd() -> None:
    """Put the current working directory first on sys.path, as Celery does: a worker started where the
    project is finds its handler module (an installed console script's sys.path starts at its bin/)."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def load(spec: str) -> Handler:
    """Import ``package.module:callable``; a ConfigurationError that says what is wrong otherwise."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"handler {spec!r} must look like MODULE:CALLABLE, e.g. myapp.jobs:summarise")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        where = f"the current directory {os.getcwd()}, then sys.path"
        raise ConfigurationError(f"cannot import handler module {module_name!r} ({type(exc).__name__}: {exc}); "
                                 f"looked in {where}: run the worker from your project's directory or set "
                                 "PYTHONPATH") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigurationError(f"module {module_name!r} has no {attr!r}")
    if not callable(target):
        raise ConfigurationError(f"handler {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


# The longest error kept: its head and its tail, as pglane.bounded_error() keeps them in the database
# (an error is sent whole only up to this size, so a 50 MB exception costs no 50 MB round trip).
ERROR_HEAD = ERROR_TAIL = 32768


def bounded_error(text: str) -> str:
    """``text`` kept to its first and last 32 kB, with how much was cut between them."""
    if len(text) <= ERROR_HEAD + ERROR_TAIL:
        return text
    return f"{text[:ERROR_HEAD]}\n[... {len(text) - ERROR_HEAD - ERROR_TAIL} characters cut ...]\n{text[-ERROR_TAIL:]}"


@dataclass(frozen=True)
class Outcome:
    """What became of one call: ``result_json`` when it succeeded, else ``error`` (and ``timed_out``),
    or, when the handler raised RetryLater, ``retry_after`` (seconds) with the reason in ``error``.
    ``error`` never holds a NUL character, which PostgreSQL text cannot store, and is bounded in size."""

    result_json: str | None = None
    error: str | None = None
    timed_out: bool = False
    retry_after: float | None = None  # deferred: nothing was paid, run it again this many seconds later

    def __post_init__(self) -> None:
        if self.error is not None:
            object.__setattr__(self, "error", bounded_error(self.error.replace("\x00", "\\x00")))

    @property
    def name(self) -> str:
        """What the attempt becomes: done, failed, timed_out or deferred."""
        if self.retry_after is not None:
            return "deferred"
        if self.result_json is not None:
            return "done"
        return "timed_out" if self.timed_out else "failed"


def _describe(exc: BaseException) -> str:
    lines = traceback.format_exception(exc)
    return f"{type(exc).__name__}: {exc}\n" + "".join(lines[-12:])


def encode(value: Any) -> Outcome:
    """A handler's return value as the outcome to store: its JSON, or the reason it has none (a
    RecursionError for nesting too deep to encode included): never an exception."""
    try:
        return Outcome(result_json=json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        return Outcome(
            error=f"handler returned a result that is not JSON-serialisable ({type(value).__name__}: "
            f"{type(exc).__name__}: {str(exc)[:500]}); the call itself completed"
        )


class Runner:
    """Runs one handler; knows whether it is async and owns the threads for a sync one: ``threads``, one
    for each call that may run at once (a worker's slots of one lane), so that no call waits for a thread."""

    def __init__(self, handler: Handler, threads: int = 1) -> None:
        self.handler = handler
        self.is_async = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 - an object with an async __call__
        )
        self._thread = None if self.is_async else ThreadPoolExecutor(threads, thread_name_prefix="pglane-handler")

    def start(self, job: Job) -> tuple[asyncio.Future[Any], Callable[[], object]]:
        """Start the call: the future holds the raw return value or the handler's exception, and the
        callable asks the handler to stop (a no-op for a sync handler: a thread cannot be stopped)."""
        if self.is_async:
            return _start_eagerly(self.handler(job))
        assert self._thread is not None
        # In a copy of the slot's context: the handler's own spans are children of the call's, and its log
        # lines name the job (pglane.tracing, pglane.logs).
        return asyncio.wrap_future(self._thread.submit(contextvars.copy_context().run, self.handler, job)), _nothing

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)


def _nothing() -> None:
    return None


def _start_eagerly(awaitable: Awaitable[Any]) -> tuple[asyncio.Future[Any], Callable[[], object]]:
    """Run a coroutine's first step at once, as Python 3.12's eager tasks do: a handler that finishes
    without suspending then costs no task and no turn of the event loop (bench: worker overhead per
    job). One that suspends continues in a task that drives it exactly as asyncio's own would."""
    loop = asyncio.get_running_loop()
    if not inspect.iscoroutine(awaitable):
        task = asyncio.ensure_future(awaitable)
        return task, task.cancel
    done: asyncio.Future[Any] = loop.create_future()
    try:
        yielded = awaitable.send(None)
    except StopIteration as finished:
        done.set_result(finished.value)
        return done, _nothing
    except asyncio.CancelledError:
        done.cancel()
        return done, _nothing
    except Exception as exc:
        done.set_exception(exc)
        return done, _nothing
    task = loop.create_task(_resume(awaitable, yielded))
    return task, task.cancel


async def _resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Drive a coroutine whose first step already ran, the way an asyncio task does: wait for the
    future it yielded (or give the loop one turn for a bare yield), then send; a cancellation of
    this task cancels that future and is thrown into the coroutine, which may handle it."""
    while True:
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                yielded._asyncio_future_blocking = False
                await asyncio.wait((yielded,))
        except asyncio.CancelledError as cancel:
            if yielded is not None:
                yielded.cancel()
            try:
                yielded = coro.throw(cancel)
            except StopIteration as finished:
                return finished.value
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as finished:
            return finished.value


def outcome_of(future: asyncio.Future[Any]) -> Outcome:
    """The outcome of a finished call."""
    if future.cancelled():
        return Outcome(error="the handler was cancelled")
    exc = future.exception()
    if isinstance(exc, RetryLater):
        return Outcome(error=exc.reason, retry_after=exc.after)
    if exc is not None:
        return Outcome(error=_describe(exc))
    return encode(future.result())


async def settle(future: asyncio.Future[Any], cancel: Callable[[], object], job_timeout: float,
                 job_deadline: float, hard_deadline: float) -> Outcome | None:
    """Wait for a started call until ``job_deadline`` (time.monotonic), then ask it to stop and wait
    until ``hard_deadline``. Returns None only when the handler outlived the hard deadline (it ignored
    cancellation, or is a sync handler): the caller must then recycle the process."""
    if not future.done():
        await asyncio.wait((future,), timeout=max(0.0, job_deadline - time.monotonic()))
    if future.done():
        return outcome_of(future)
    cancel()  # async handlers stop here; a thread cannot be stopped, it is waited for
    await asyncio.wait((future,), timeout=max(0.0, hard_deadline - time.monotonic()))
    if not future.done():
        return None
    return Outcome(error=f"timed out: the handler ran past its job_timeout of {job_timeout:g}s", timed_out=True)
