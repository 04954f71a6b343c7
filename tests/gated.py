"""A paid call that stops at a gate the test opens, so that a fault lands at a chosen moment of it.

``gated_call`` records in the ledger as tests.handlers.paid_call does ("claimed" when the handler gets
the job, "start" when the paid call begins, "end" when it answered). With {"gate": PATH, "at": "before"}
in the payload it waits until the file PATH exists between the claim and the call; with "at": "during",
in the middle of the call. A test waits for the ledger's "claimed" or "start" of that job, does its
damage, then creates the file. Without a gate, {"sleep": s} is the call's length.
"""

from __future__ import annotations

import os
import time
from typing import Any

from pglane import Job
from tests.handlers import _record

GATE_LIMIT = 120.0  # a gate nobody opens lets the call go on after this long: a broken test still ends


def _wait_gate(path: str) -> None:
    deadline = time.monotonic() + GATE_LIMIT
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def gated_call(job: Job) -> Any:
    payload = job.payload if isinstance(job.payload, dict) else {}
    gate, at = payload.get("gate"), payload.get("at")
    _record("claimed", job)
    if isinstance(gate, str) and at == "before":
        _wait_gate(gate)
    _record("start", job)
    if isinstance(gate, str) and at == "during":
        _wait_gate(gate)
    time.sleep(float(payload.get("sleep", 0)))
    _record("end", job)
    return {"job": job.id, "seq": job.seq}
