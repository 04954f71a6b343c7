"""Worker subprocesses, the stamp file their handlers write, and the database probes that say when a
worker is ready and when a queue is drained.

Every consumer of a real system (pglane, procrastinate, pgqueuer, floor_listen) runs in its own
process, started from the repository root so that ``bench`` and ``pglane`` import. Its stderr goes to
a log file under the results directory. A stamp is one line ``<n> <time.time()>`` appended by a
handler when it starts job ``n``; producer and handler read the same wall clock of this machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

from .stats import BenchTimeout, wait_until

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"  # not in git: every writer makes the folder it writes to
STOP_TIMEOUT = 15.0


def stamp(n: int) -> None:
    """Append ``n time`` to $BENCH_STAMPS (if set): called first thing in every bench handler."""
    path = os.environ.get("BENCH_STAMPS")
    if path:
        now = time.time()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{n} {now:.6f}\n".encode())
        finally:
            os.close(fd)


def read_stamps(path: Path) -> dict[int, float]:
    stamps: dict[int, float] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            n, _, t = line.partition(" ")
            if t:
                stamps.setdefault(int(n), float(t))
    return stamps


def has_stamp(path: Path, n: int) -> Callable[[], bool]:
    return lambda: n in read_stamps(path)


def child_env(env: dict[str, str] | None = None, *, without: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a ``python`` child run from the repository root: this one's, less ``without``,
    plus ``env``, the root first on PYTHONPATH (so the checkout's pglane and bench are the ones imported)."""
    found = {k: v for k, v in os.environ.items() if k not in without}
    found.update(env or {})
    found["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return found


def spawn(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``python ARGS`` from the repository root, stderr and stdout to ``log``."""
    full_env = child_env(env)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    """Ask the process to stop (SIGTERM: graceful) and reap it; SIGKILL if it does not go in time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)


@contextlib.contextmanager
def running(args: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = spawn(args, log, env)
    try:
        yield proc
    finally:
        stop(proc)


def backends(conn: psycopg.Connection[Any], dbname: str) -> list[tuple[int, str, float]]:
    """(pid, state, seconds in that state) of the client sessions on ``dbname`` other than ``conn``'s."""
    rows = conn.execute(
        "SELECT pid, coalesce(state, ''), extract(epoch FROM clock_timestamp() - state_change)::float8"
        " FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
        (dbname,),
    ).fetchall()
    return [(int(pid), str(state), float(age or 0.0)) for pid, state, age in rows]


def wait_settled(conn: psycopg.Connection[Any], dbname: str, proc: subprocess.Popen[bytes],
                 *, sessions: int = 1, quiet: float = 0.3, timeout: float = 30.0) -> None:
    """Wait until the worker has at least ``sessions`` sessions on ``dbname`` and all of them have
    been idle for ``quiet`` seconds: it has started, listens, and found nothing to do."""

    def settled() -> bool:
        if proc.poll() is not None:
            raise BenchTimeout(f"worker exited early with status {proc.returncode}; see its log")
        found = backends(conn, dbname)
        return len(found) >= sessions and all(state == "idle" and age >= quiet for _, state, age in found)

    wait_until(settled, timeout, f"a worker on {dbname} to settle", interval=0.05)


def wait_no_backends(conn: psycopg.Connection[Any], dbname: str, timeout: float = 15.0) -> None:
    """Wait until no other session is connected to ``dbname`` (their statistics are then flushed)."""
    wait_until(lambda: not backends(conn, dbname), timeout, f"sessions on {dbname} to end", interval=0.02)
