"""Traces: OpenTelemetry spans from the producer's enqueue, through the wait in the lane, to the handler's
call and its completion (the optional extra ``pglane[otel]``; docs/operations.md, "Traces and logs").

Without ``opentelemetry-api`` installed nothing here does more than test ``ENABLED``; with it and no tracer
provider set by the application (no SDK, no exporter), ``active()`` is false and no span is made. What a
trace holds, one per job attempt:

    send LANE      PRODUCER  the enqueue (pglane.enqueue and its aio twin): its context is the job's
                             ``traceparent``, which a plain INSERT from any language may also set
    wait LANE      INTERNAL  queued_at -> the claim (the lane's queue, its admission: pause, rate, lease);
                             an event for each spell of held-back claims it overlaps
                             (``pglane.paused``, ``pglane.rate_limited``, ``pglane.lease_wait``)
    process LANE   CONSUMER  the handler's call, current while it runs (a handler's own spans are its
                             children); ``pglane.outcome`` done, failed, timed_out or deferred
    settle LANE    INTERNAL  the outcome's write (on the fast path fused with the next claim)
    lost LANE      INTERNAL  written by the worker whose recovery marked the attempt lost (the worker
                             that made the call died with its spans), from its start to the recovery
    stuck LANE     INTERNAL  written once by a worker whose recovery found the attempt stuck (past its
                             lease, its worker still connected: a frozen process), from the lease's end
                             to then, with what the operator may do

The four of an attempt are children of the producer's ``send`` span (a job with no traceparent starts a
trace of its own). Attributes follow OpenTelemetry's messaging conventions where they name the thing
(``messaging.system``, ``messaging.destination.name``, ``messaging.message.id``,
``messaging.operation.type``), and ``pglane.*`` for the rest (attempt id and number, seq, group,
outcome). The trace id is also what the worker's JSON logs carry (pglane.logs).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import ProxyTracerProvider, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the extra is not installed: no spans, and no cost
    ENABLED = False
else:
    ENABLED = True
    _PROPAGATOR = TraceContextTextMapPropagator()
    _TRACER = trace.get_tracer("pglane")  # a proxy until the application sets its provider, then that one's


def active() -> bool:
    """Whether spans are recorded: the API is installed and the application has set a tracer provider (an
    SDK). Without one every span would be the API's no-op: none is made at all (bench: ``--only otel``)."""
    return ENABLED and not isinstance(trace.get_tracer_provider(), ProxyTracerProvider)

SYSTEM = "pglane"


def trace_id(traceparent: str | None) -> str | None:
    """The trace id a W3C traceparent names (32 hex), whether or not OpenTelemetry is installed."""
    return traceparent[3:35] if traceparent else None


def _attributes(lane: str, operation: str, **more: Any) -> dict[str, Any]:
    found = {"messaging.system": SYSTEM, "messaging.destination.name": lane, "messaging.operation.type": operation}
    found.update({k: v for k, v in more.items() if v is not None})
    return found


@dataclass
class Sending:
    """The producer's span of one enqueue, and the traceparent the job records (None: no trace)."""

    span: Any
    traceparent: str | None

    def sent(self, job_id: int | None) -> None:
        if self.span is not None:
            if job_id is None:
                self.span.set_attribute("pglane.skipped", True)  # if_full="skip" on a full lane
            else:
                self.span.set_attribute("messaging.message.id", str(job_id))


UNTRACED = Sending(None, None)


@contextlib.contextmanager
def sending(lane: str) -> Iterator[Sending]:
    """The ``send LANE`` span around an enqueue (a child of the caller's current span), ended when the
    enqueue returns or raises (the error recorded); its context is the traceparent to store."""
    if not active():
        yield UNTRACED
        return
    span = _TRACER.start_span(f"send {lane}", kind=SpanKind.PRODUCER,
                                attributes=_attributes(lane, "send", **{"messaging.operation.name": "enqueue"}))
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    try:
        yield Sending(span, carrier.get("traceparent"))
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)[:200]))
        raise
    finally:
        span.end()


def _parent(traceparent: str | None) -> Any:
    """The producer's context a job's traceparent names (a fresh root without one)."""
    if not traceparent:
        return otel_context.Context()
    return _PROPAGATOR.extract({"traceparent": traceparent}, context=otel_context.Context())


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1e9)


# The events of a wait span: what each reason a claim is held back for is called there (sql/claim.sql).
HELD_EVENTS = {"paused": "pglane.paused", "rate": "pglane.rate_limited", "lease": "pglane.lease_wait"}


@dataclass
class Held:
    """A spell in which the lane's claims were held back: from when (epoch ns) until when (None: still),
    why (``HELD_EVENTS``' keys), for how long at most the first claim was told (seconds; None: a pause
    until resumed); ``job``: the job that first claim took, if any (a rate-limited lane's claim that takes
    a job says when the slot's next start may come: it concerns the jobs after that one)."""

    at: int
    reason: str
    wait_seconds: float | None
    job: int | None
    until: int | None = None


class Admissions:
    """What the claims of one lane in this process were told while they could start no job (a pause, the
    rate limit's turn, a strict lane's lease), kept for the ``wait`` spans of the jobs claimed after: one
    spell per run of the same answer (a hundred claims told "paused" are one pause), the last KEEP."""

    KEEP = 16

    def __init__(self) -> None:
        self._said: deque[Held] = deque(maxlen=self.KEEP)
        self._open: Held | None = None  # the spell the latest answer continues

    def heard(self, reason: str | None, wait_seconds: float | None, job: int | None) -> None:
        """A claim answered, having taken ``job`` (None: none), held back for ``reason`` (None: not held back)."""
        if self._open is not None and self._open.reason == reason:
            return
        now = time.time_ns()
        if self._open is not None:
            self._open.until = now
            self._open = None
        if reason in HELD_EVENTS:
            self._open = Held(now, str(reason), wait_seconds, job)
            self._said.append(self._open)

    def explaining(self, job: int, queued_at: datetime | None) -> list[Held]:
        """The spells that overlap ``job``'s wait (from its enqueue on), but for one its own claim began."""
        start = _ns(queued_at) if queued_at is not None else 0
        return [h for h in self._said if (h.until is None or h.until >= start) and h.job != job]


class Attempt:
    """The spans of one attempt in the worker that claimed it: ``wait`` (ended at once), ``process``
    (current in the slot's task while the handler runs), ``settle``. Made only when ``active()``."""

    def __init__(self, lane: str, job_id: int, attempt_id: int, attempt_number: int, seq: int,
                 traceparent: str | None, queued_at: datetime | None, *, group: str | None = None,
                 held: list[Held] | None = None) -> None:
        self.lane = lane
        parent = _parent(traceparent)
        now = time.time_ns()
        ids = {"messaging.message.id": str(job_id), "pglane.attempt.id": attempt_id,
               "pglane.attempt.number": attempt_number, "pglane.seq": seq, "pglane.group": group}
        tracer = _TRACER
        if queued_at is not None:
            start = min(_ns(queued_at), now)
            wait = tracer.start_span(f"wait {lane}", context=parent, start_time=start,
                                     attributes=_attributes(lane, "receive", **ids))
            for h in held or ():  # at the spell's start, or the job's enqueue if it came in the middle of one
                wait.add_event(HELD_EVENTS[h.reason], {"pglane.wait_reason": h.reason}
                               | ({} if h.wait_seconds is None else {"pglane.wait_seconds": h.wait_seconds}),
                               timestamp=min(max(h.at, start), now))
            wait.end(end_time=now)
        self.span = tracer.start_span(f"process {lane}", context=parent, kind=SpanKind.CONSUMER, start_time=now,
                                      attributes=_attributes(lane, "process", **ids))
        self._token: Any = otel_context.attach(trace.set_span_in_context(self.span))
        self._settle: Any = None

    def called(self, outcome: str, error: str | None = None, retry_after: float | None = None) -> None:
        """The handler's call ended with ``outcome`` (done, failed, timed_out, deferred); the write begins."""
        self._detach()
        self.span.set_attribute("pglane.outcome", outcome)
        if retry_after is not None:
            self.span.set_attribute("pglane.retry_after", retry_after)
        if error is not None and outcome != "deferred":
            self.span.set_status(Status(StatusCode.ERROR, error.partition("\n")[0][:200]))
        self._settle = _TRACER.start_span(f"settle {self.lane}", context=trace.set_span_in_context(self.span),
                                            attributes=_attributes(self.lane, "settle"))

    def settled(self, stored: bool) -> None:
        """The outcome's write returned (``stored``: the database took it; False: it is held for the next
        session, or was refused)."""
        self._detach()
        if self._settle is not None:
            self._settle.set_attribute("pglane.stored", stored)
            self._settle.end()
        self.span.end()

    def _detach(self) -> None:
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None


def lost(rows: list[dict[str, Any]]) -> None:
    """A ``lost LANE`` span for each attempt this worker's recovery just marked lost (queries.LOST_AT's
    objects; times in epoch seconds), in its job's trace, from the attempt's start to its recovery."""
    for row in rows:
        _found(row, "lost", row["started"], row["finished"], row["error"] or "lost")


class Stuck:
    """The stuck attempts this process has written a ``stuck LANE`` span for: each once, however many of
    its recoveries see it stuck (the last KEEP remembered)."""

    KEEP = 1024

    def __init__(self) -> None:
        # (attempt id, lease end): an id alone is one database's; a process may serve several (or, in tests,
        # databases cloned one after another, whose ids start again)
        self._told: deque[tuple[int, float]] = deque(maxlen=self.KEEP)

    def found(self, rows: list[dict[str, Any]]) -> None:
        """A span for each attempt of queries.STUCK_TRACED's objects not written yet: from its lease's end
        to now (this recovery), with what the operator may do."""
        for row in rows:
            key = (row["attempt_id"], row["lease_ends"])
            if key in self._told:
                continue
            self._told.append(key)
            _found(row, "stuck", row["lease_ends"], time.time(),
                   f"stuck: past its lease and its worker ({row['worker']}) still connected; it is never given "
                   f"to another worker. End it with: pglane recover {row['lane']} --terminate-stuck")


def _found(row: dict[str, Any], what: str, start: float, end: float, why: str) -> None:
    """A span another worker's recovery writes into an attempt's trace (``what``: lost, stuck)."""
    ids = {"messaging.message.id": str(row["job_id"]), "pglane.attempt.id": row["attempt_id"],
           "pglane.attempt.number": row["attempt_number"], "pglane.seq": row["seq"],
           "pglane.group": row["group_key"], "pglane.outcome" if what == "lost" else "pglane.state": what}
    span = _TRACER.start_span(f"{what} {row['lane']}", context=_parent(row["traceparent"]),
                              start_time=int(start * 1e9), attributes=_attributes(row["lane"], "process", **ids))
    span.set_status(Status(StatusCode.ERROR, why[:200]))
    span.end(end_time=int(max(start, end) * 1e9))
