"""The handler runner on its own: sync and async handlers, eager first steps, failures, results that
are not JSON, and the two timeouts. No database is involved here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pglane import ConfigurationError, Job
from pglane.handler import Runner, load, outcome_of, settle

JOB = Job(id=1, lane="brain", payload={"q": 1}, attempt_id=7, attempt_number=1, seq=1, idempotency_key=None)


def run(handler: Any, job_timeout: float = 5.0, hard_timeout: float = 6.0) -> Any:
    async def main() -> Any:
        runner = Runner(handler)
        future, cancel = runner.start(JOB)
        now = time.monotonic()
        try:
            return await settle(future, cancel, job_timeout, now + job_timeout, now + hard_timeout)
        finally:
            runner.shutdown()

    return asyncio.run(main())


async def instant(job: Job) -> Any:
    return {"attempt": job.attempt_id}


async def suspends(job: Job) -> Any:
    await asyncio.sleep(0)
    await asyncio.sleep(0.01)
    values = await asyncio.gather(asyncio.sleep(0.01, result=1), asyncio.sleep(0, result=2))
    return {"values": values}


async def raises_at_once(job: Job) -> Any:
    raise ValueError("bad input")


async def raises_later(job: Job) -> Any:
    await asyncio.sleep(0.01)
    raise KeyError("missing")


async def too_slow(job: Job) -> Any:
    await asyncio.sleep(30)


async def stubborn(job: Job) -> Any:
    end = time.monotonic() + 1.5  # long past the hard timeout below, short enough to end the test
    while time.monotonic() < end:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            continue
    return None


def sync_handler(job: Job) -> Any:
    return [job.seq, "sync"]


def test_an_async_handler_that_never_suspends_is_done_without_a_turn_of_the_loop() -> None:
    async def main() -> bool:
        future, _ = Runner(instant).start(JOB)
        return future.done() and future.result() == {"attempt": 7}

    assert asyncio.run(main())


def test_an_async_handler_that_suspends_is_driven_to_its_result() -> None:
    assert run(suspends).result_json == '{"values": [1, 2]}'


def test_sync_handlers_run_in_a_thread() -> None:
    assert run(sync_handler).result_json == '[1, "sync"]'


@pytest.mark.parametrize(("handler", "text"), [(raises_at_once, "ValueError: bad input"),
                                               (raises_later, "KeyError: 'missing'")])
def test_an_exception_fails_the_attempt_with_type_message_and_traceback(handler: Any, text: str) -> None:
    outcome = run(handler)
    assert outcome.result_json is None and outcome.error.startswith(text) and "Traceback" in outcome.error


def test_a_result_that_is_not_json_is_a_failure_that_says_so() -> None:
    async def odd(job: Job) -> Any:
        return {1, 2}

    assert "not JSON-serialisable" in run(odd).error


def test_past_the_job_timeout_an_async_handler_is_cancelled_and_timed_out() -> None:
    started = time.monotonic()
    outcome = run(too_slow, job_timeout=0.2, hard_timeout=5)
    assert outcome.timed_out and "job_timeout of 0.2s" in outcome.error
    assert time.monotonic() - started < 4  # it stopped at the cancellation, not at the hard timeout


def test_a_handler_ignoring_cancellation_is_given_up_at_the_hard_timeout() -> None:
    assert run(stubborn, job_timeout=0.1, hard_timeout=0.4) is None


def test_outcome_of_a_cancelled_call() -> None:
    async def main() -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.cancel()
        return outcome_of(future)

    assert asyncio.run(main()).error == "the handler was cancelled"


@pytest.mark.parametrize(("spec", "message"), [("nocolon", "must look like MODULE:CALLABLE"),
                                               ("no_such_module_x:f", "cannot import handler module"),
                                               ("tests.handlers:missing", "has no 'missing'"),
                                               ("tests.handlers:NOT_CALLABLE", "is not callable")])
def test_handler_specs_that_cannot_work_are_refused_clearly(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        load(spec)
