"""`pglane demo`: the whole promise in under a minute, on an embedded PostgreSQL when no DSN is given.

Scenes: a one-slot lane and a worker process in front of a simulated slow paid call; jobs served one
at a time in order, with a repeated request deduplicated by its idempotency key; the worker killed
(SIGKILL) in the middle of a paid call, a new worker taking the slot and recovering by evidence: the
attempt is lost, the job failed with the reason, nothing re-run; and the operator's view.

The "paid service" is ``paid_call``: it appends each call to a ledger file (the bill) before it
answers, so the demo can show how many calls were paid for. Uses only the public API and the CLI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import client, schema
from .job import Job

LEDGER_ENV = "PGLANE_DEMO_LEDGER"


def paid_call(job: Job) -> dict[str, Any]:
    """The demo's handler: a slow, paid call. Bills first (append + fsync), then takes its time."""
    ledger = os.environ.get(LEDGER_ENV)
    if ledger:
        with open(ledger, "a", encoding="utf-8") as bill:
            bill.write(f"{job.id} {job.attempt_id}\n")
            bill.flush()
            os.fsync(bill.fileno())
    time.sleep(float(job.payload.get("seconds", 0.3)) if isinstance(job.payload, dict) else 0.3)
    question = job.payload.get("q") if isinstance(job.payload, dict) else job.payload
    return {"answer": f"the answer to {question!r}", "seq": job.seq}


def _say(text: str = "") -> None:
    print(text, flush=True)


def _wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"the demo waited {timeout:g}s for {what}")


@contextlib.contextmanager
def _database(dsn: str | None, data_dir: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from .embedded import embedded_postgres

    _say("starting a throwaway embedded PostgreSQL (no DSN given) ...")
    with embedded_postgres(Path(data_dir) if data_dir else None) as embedded_dsn:
        yield embedded_dsn


def _worker(dsn: str, lane: str, ledger: Path, workers: list[subprocess.Popen[bytes]]) -> None:
    """Start a worker process; its log goes to a file beside the ledger, shown if the demo fails."""
    env = dict(os.environ, PGLANE_DSN=dsn, **{LEDGER_ENV: str(ledger)})
    with open(ledger.with_name(f"worker-{len(workers) + 1}.log"), "wb") as log:
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "pglane", "worker", lane, "--handler", "pglane.demo:paid_call",
             "--poll-interval", "1"],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        ))


def _show_worker_logs(ledger: Path) -> None:
    for log in sorted(ledger.parent.glob("worker-*.log")):
        print(f"--- {log.name} (last 20 lines) ---", *log.read_text(errors="replace").splitlines()[-20:],
              sep="\n", file=sys.stderr)


def run_demo(dsn: str | None = None, data_dir: str | None = None) -> int:
    dsn = dsn or os.environ.get("PGLANE_DSN")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pglane-demo-") as tmp, _database(dsn, data_dir) as db:
        ledger = Path(tmp) / "ledger"
        ledger.touch()
        schema.upgrade(db)
        lane = f"paid-api-{uuid.uuid4().hex[:6]}"
        workers: list[subprocess.Popen[bytes]] = []
        try:
            with client.connect(db) as conn:
                client.create_lane(conn, lane, job_timeout=20)
                _say(f"migrated; created lane {lane}: 1 slot, job timeout 20s, lease 22s, max 1 attempt")
                _scene_serve(conn, db, lane, ledger, workers)
                _scene_crash(conn, db, lane, ledger, workers)
                _scene_operator(conn, lane)
        except Exception:
            _show_worker_logs(ledger)
            raise
        finally:
            for w in workers:
                if w.poll() is None:
                    w.send_signal(signal.SIGTERM)
                    try:
                        w.wait(30)
                    except subprocess.TimeoutExpired:
                        w.kill()
        _say(f"\ndemo finished in {time.monotonic() - started:.1f}s")
    return 0


def _bill(ledger: Path) -> list[str]:
    return ledger.read_text(encoding="utf-8").split("\n")[:-1]


def _scene_serve(conn: Any, db: str, lane: str, ledger: Path, workers: list[subprocess.Popen[bytes]]) -> None:
    _say("\n== 1. one worker, one slot, a slow paid call ==")
    _worker(db, lane, ledger, workers)
    ids = [client.enqueue(conn, lane, {"q": f"question {n}"}, key=f"request-{n}") for n in range(1, 4)]
    again = client.enqueue(conn, lane, {"q": "question 2"}, key="request-2")
    _say(f"enqueued jobs {ids}; the repeated request-2 returned job {again} again: no second job, no second bill")
    _wait_for(lambda: all(client.job_status(conn, i)["status"] == "done" for i in ids), 60, "the jobs to finish")
    for i in ids:
        row = client.job_status(conn, i)
        _say(f"  job {i}: {row['status']}, seq {row['seq']}, result {client.result(conn, i)}")
    _say(f"paid calls so far: {len(_bill(ledger))} (one per job)")


def _scene_crash(conn: Any, db: str, lane: str, ledger: Path, workers: list[subprocess.Popen[bytes]]) -> None:
    _say("\n== 2. the worker dies in the middle of a paid call ==")
    before = len(_bill(ledger))  # read before the enqueue: an idle worker may bill within a millisecond of it
    job = client.enqueue(conn, lane, {"q": "an expensive question", "seconds": 15}, key="request-expensive")
    _wait_for(lambda: len(_bill(ledger)) > before, 30, "the paid call to start")
    victim = workers[-1]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    _say(f"job {job} was in its paid call; worker pid {victim.pid} killed with SIGKILL")
    _say(f"  the database says: job {client.job_status(conn, job)['status']} (nobody has looked yet)")
    _worker(db, lane, ledger, workers)
    _wait_for(lambda: client.job_status(conn, job)["status"] != "running", 30, "the new worker's recovery")
    row = client.job_status(conn, job)
    attempt = client.attempts(conn, job)[-1]
    _say("a new worker took the slot and recovered by evidence (the claiming session is gone):")
    _say(f"  attempt {attempt['id']}: {attempt['status']}: {attempt['error']}")
    _say(f"  job {job}: {row['status']}: {row['last_error']}")
    again = client.enqueue(conn, lane, {"q": "an expensive question", "seconds": 15}, key="request-expensive")
    calls = [line for line in _bill(ledger) if line.split()[0] == str(job)]
    _say(f"  the same request sent again returns job {again}; it is not re-run: the paid service was called "
         f"{len(calls)} time(s) for it")


def _scene_operator(conn: Any, lane: str) -> None:
    _say("\n== 3. the operator's view (pglane status / pglane jobs) ==")
    for row in client.lane_status(conn):
        if row["lane"] == lane:
            _say(f"  lane {lane}: consumers {row['consumers']}, queued {row['queued']}, done {row['done']}, "
                 f"failed {row['failed']}; next: {row['next_safe_action']}")
    for row in client.jobs(conn, lane=lane):
        _say(f"  job {row['job_id']} {row['status']:>7}: {row['next_safe_action']}")
