"""The worker's logs: readable text (the default), or one JSON object per line (``pglane worker
--log-format json``) that names the lane, the job, the attempt and the trace of the line's slot.

Each slot loop runs in an asyncio task of its own, and sets ``LANE`` once and ``JOB`` for each claim it
holds (pglane.slotloop): context variables, so a line knows its slot's lane and job whichever slot logs
it, with nothing passed to each log call. A sync handler's thread runs in a copy of that context
(pglane.handler), so a handler's own lines carry them too.

Every JSON line has ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``pid`` and ``message``; a slot's
lines add ``lane``; while a job is held ``job``, ``attempt`` and ``trace_id`` (the producer's, from the
job's traceparent: null when it sent none); a traceback, when there is one, is ``exception``.
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import UTC, datetime

LANE: contextvars.ContextVar[str | None] = contextvars.ContextVar("pglane_lane", default=None)
# (job id, attempt id, trace id) of the claim the slot holds; None between claims
JOB: contextvars.ContextVar[tuple[int, int, str | None] | None] = contextvars.ContextVar("pglane_job", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "pid": record.process, "message": record.getMessage(),
        }
        if (lane := LANE.get()) is not None:
            entry["lane"] = lane
        if (job := JOB.get()) is not None:
            entry["job"], entry["attempt"], entry["trace_id"] = job
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: int, log_format: str) -> None:
    """Log to stderr at ``level``, as text or as JSON lines (``log_format``: text or json)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
