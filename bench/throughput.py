"""Drain throughput at several concurrencies: one consumer process per slot, every system standing.

For each slot count N (default 1, 3 and 8) every system runs N consumer processes, all started once
at the beginning and left idle between drains:

- pglane: N ``pglane worker`` processes on lane ``slotsN`` (N slots) of bench_pglane;
- procrastinate and pgqueuer: N worker processes of concurrency 1 each, in a database of their own
  per slot count (bench_procrastinate_s3, ...) so that one slot count's idle consumers never see
  another's jobs or notifications;
- the floors, N processes of ``python -m bench.floors serve`` (process i holds slot i of lane
  ``floor_slotsN``), each able to drain every floor: ``floor`` (floor_contract: pglane's own SQL in a
  bare loop), ``floor_rows`` (the contract's rows per job in bare tables, claims ordered by the gapless
  seq: bench.floors), ``floor_seq`` (a bare table with the lane's gapless seq bumped under a row lock in the
  claim's transaction: the guarantee that serialises a lane's claims, and nothing else) and
  ``floor_one_commit`` (the bare table without it); ``floor_two_commits`` at one slot only.

A drain: the system's tables are emptied; the real systems' consumers are waited for until all
their sessions have been idle for 0.3 s; N jobs go in with the system's own batch API (the clock
starts when that commit returns) and the clock stops at the system's own record of its last
completion; the floors' jobs are preloaded and the clock runs from the ``go`` sent to their processes
to the last one's ``done``. Repetitions run every (system, slot count) once, in an order rotated
each time, so that the machine's drift falls on all alike and every ratio can be taken within a
repetition. Each system's drain size is set from its untimed warm-up drain so that a drain lasts
about ``Sizes.drain_seconds`` (bounded): slow peers do not take the run's time.

After the timed repetitions, one untimed drain per slot count of pglane and of ``floor`` is watched:
the server sessions' wait events sampled every few ms and the CPU time of the consumer processes
and their backends (see ``Watch``): where the time goes with several slots.
"""

from __future__ import annotations

import abc
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import psycopg

from pglane import client

from . import floors, procs, real
from .pglane_runs import Pglane, load_queued, truncate
from .server import BenchServer
from .stats import BenchTimeout, Sizes, progress, rotations, summary, wait_until

SLOT_COUNTS = (1, 3, 8)
SYSTEMS = ("pglane", "procrastinate", "pgqueuer", "floor", "floor_rows", "floor_seq", "floor_one_commit",
           "floor_two_commits")
ONE_SLOT_ONLY = ("floor_two_commits",)
WARMUP_JOBS = 200
MIN_JOBS = 100  # a drain's end is the system's own timestamp: short drains lose no accuracy
READY_TIMEOUT = 60.0


def pglane_lane(slots: int) -> str:
    return f"slots{slots}"


def floor_lane(slots: int) -> str:
    return f"floor_slots{slots}"


def databases(slot_counts: tuple[int, ...]) -> list[str]:
    """The extra databases (keys of BenchServer.dsns) the peers need beyond one slot."""
    return [f"{peer}_s{n}" for n in slot_counts if n != 1 for peer in ("procrastinate", "pgqueuer")]


def setup(server: BenchServer, slot_counts: tuple[int, ...]) -> None:
    """pglane's lanes (the base databases are set up by the caller), the peers' extra databases."""
    from .peers import Pgqueuer, Procrastinate  # the bench extra: imported where the peers run

    with client.connect(server.dsn("pglane")) as conn:
        for n in slot_counts:
            client.create_lane(conn, pglane_lane(n), slots=n)
            client.create_lane(conn, floor_lane(n), slots=n)
    for n in slot_counts:
        if n != 1:
            Procrastinate(f"procrastinate_s{n}").setup(server.dsn(f"procrastinate_s{n}"))
            Pgqueuer(f"pgqueuer_s{n}").setup(server.dsn(f"pgqueuer_s{n}"))


class Group(abc.ABC):
    """N standing consumer processes of one system at one slot count."""

    system: str
    slots: int
    db: str
    procs: list[subprocess.Popen[bytes]]
    pids: list[int]

    @abc.abstractmethod
    def start(self, server: BenchServer, logs: Path) -> None: ...

    @abc.abstractmethod
    def ready(self, server: BenchServer) -> None:
        """Wait until every process is connected and idle."""

    @abc.abstractmethod
    def prepare(self, server: BenchServer, n: int) -> None:
        """Empty the tables (floors: preload n jobs) and wait until every process is idle."""

    @abc.abstractmethod
    def run(self, server: BenchServer, n: int) -> float:
        """Jobs per second of the drain of n no-op jobs that ``prepare`` set up."""

    def drain(self, server: BenchServer, n: int) -> float:
        self.prepare(server, n)
        return self.run(server, n)

    @property
    def sessions_like(self) -> str:
        return "%"


class RealGroup(Group):
    def __init__(self, system: real.RealSystem, slots: int) -> None:
        self.real, self.system, self.slots, self.db = system, system.name, slots, system.db
        self.procs, self.pids = [], []

    @property
    def sessions_like(self) -> str:
        return self.real.sessions_like

    def start(self, server: BenchServer, logs: Path) -> None:
        args, env = self.real.worker(server.dsn(self.db), "noop")
        self.procs = [procs.spawn(args, logs / f"{self.system}-s{self.slots}-{i}.log", env)
                      for i in range(self.slots)]
        self.pids = [p.pid for p in self.procs]

    def ready(self, server: BenchServer) -> None:
        with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
            wait_idle(admin, real.dbname(self.real), self.sessions_like, self.slots, self.procs)

    def prepare(self, server: BenchServer, n: int) -> None:
        with psycopg.connect(server.dsn(self.db), autocommit=True) as conn:
            self.real.reset(conn)
        self.ready(server)

    def run(self, server: BenchServer, n: int) -> float:
        dsn = server.dsn(self.db)
        with psycopg.connect(dsn, autocommit=True) as conn:
            t0 = self.real.bulk_enqueue(dsn, n)
            real.wait_drained(conn, self.real, _Any(self.procs), 120.0)
            row = conn.execute(self.real.finished_sql).fetchone()
        assert row is not None and row[0] is not None
        return n / (float(row[0]) - t0)


class _Any:
    """poll() of a group of processes: the status of the first that exited (None while all run)."""

    def __init__(self, group: list[subprocess.Popen[bytes]]) -> None:
        self.group = group
        self.returncode: int | None = None

    def poll(self) -> int | None:
        for proc in self.group:
            if proc.poll() is not None:
                self.returncode = proc.returncode
                return proc.returncode
        return None


class FloorPool:
    """N ``python -m bench.floors serve`` processes (slot i held by process i on the floor lane of N
    slots); ``go KIND`` on their stdin makes each drain that floor's jobs."""

    def __init__(self, slots: int, bare_db: str = "floor", contract_db: str = "pglane") -> None:
        self.slots, self.bare_db, self.contract_db = slots, bare_db, contract_db
        self.lane = floor_lane(slots)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.started = False

    def start(self, server: BenchServer, logs: Path) -> None:
        env = procs.child_env()
        for i in range(self.slots):
            args = ["-m", "bench.floors", "serve", server.dsn(self.bare_db), server.dsn(self.contract_db), str(i + 1),
                    self.lane]
            with (logs / f"floors-{self.contract_db}-s{self.slots}-{i}.log").open("ab") as err:
                self.procs.append(subprocess.Popen([sys.executable, *args], cwd=procs.ROOT, env=env,
                                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err))

    def _line(self, proc: subprocess.Popen[bytes], timeout: float) -> str:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().decode() if ready else ""
        if not line:
            raise BenchTimeout(f"floor process {proc.pid} gave no answer (exit {proc.poll()}); see its log")
        return line.strip()

    def ready(self) -> None:
        if not self.started:
            for proc in self.procs:
                if self._line(proc, READY_TIMEOUT) != "ready":
                    raise BenchTimeout(f"floor process {proc.pid} did not get ready")
            self.started = True

    def go(self, kind: str) -> list[float]:
        """Every process drains ``kind``; their time.time() at the end of their drain."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"go {kind}\n".encode())
            proc.stdin.flush()
        return [float(self._line(proc, 120.0).split()[1]) for proc in self.procs]


class FloorGroup(Group):
    KINDS: ClassVar[dict[str, str]] = {"floor": "contract", "floor_rows": "rows", "floor_seq": "seq",
                                       "floor_one_commit": "one_commit",
                                       "floor_two_commits": "two_commits", "floor_plpgsql": "plpgsql",
                                       "floor_seq_flush": "seq_flush"}

    def __init__(self, system: str, pool: FloorPool, kind: str | None = None) -> None:
        self.system, self.slots, self.pool = system, pool.slots, pool
        self.kind = kind or self.KINDS[system]
        self.db = pool.contract_db if self.kind == "contract" else pool.bare_db
        self.procs = []  # the pool's, stopped by standing()

    @property
    def pids(self) -> list[int]:  # type: ignore[override]
        return [p.pid for p in self.pool.procs]

    @property
    def sessions_like(self) -> str:
        return f"bench floor {self.pool.lane} %"

    def start(self, server: BenchServer, logs: Path) -> None:
        """The pool's processes are started (and stopped) by whoever made the pool."""

    def ready(self, server: BenchServer) -> None:
        self.pool.ready()

    def prepare(self, server: BenchServer, n: int) -> None:
        self.pool.ready()
        with psycopg.connect(server.dsn(self.db), autocommit=True) as conn:
            if self.kind == "contract":
                truncate(conn)
                load_queued(conn, self.pool.lane, n)
            elif self.kind == "rows":
                floors.preload_rows(server.dsn(self.db), n)
            else:
                conn.execute("TRUNCATE floor_jobs")
                conn.execute("INSERT INTO floor_jobs (payload) SELECT jsonb_build_object('n', g)"
                             " FROM generate_series(0, %s - 1) g", (n,))

    def run(self, server: BenchServer, n: int) -> float:
        t0 = time.time()
        return n / (max(self.pool.go(self.kind)) - t0)


def wait_idle(admin: psycopg.Connection[Any], dbname: str, like: str, sessions: int,
              group: list[subprocess.Popen[bytes]], quiet: float = 0.3, timeout: float = 60.0) -> None:
    """Wait until at least ``sessions`` sessions named ``like`` are on ``dbname`` and all of them have
    been idle for ``quiet`` seconds (started, listening, nothing left to do)."""
    def settled() -> bool:
        for proc in group:
            if proc.poll() is not None:
                raise BenchTimeout(f"a consumer exited early with status {proc.returncode}; see its log")
        rows = admin.execute(
            "SELECT coalesce(state, ''), extract(epoch FROM clock_timestamp() - state_change)::float8"
            " FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend'"
            " AND application_name LIKE %s AND pid <> pg_backend_pid()", (dbname, like)).fetchall()
        return len(rows) >= sessions and all(state == "idle" and (age or 0.0) >= quiet for state, age in rows)

    wait_until(settled, timeout, f"{sessions} consumer session(s) on {dbname} to settle", interval=0.05)


def groups(slot_counts: tuple[int, ...]) -> tuple[list[Group], list[FloorPool]]:
    from .peers import Pgqueuer, Procrastinate  # the bench extra: imported where the peers run

    found: list[Group] = []
    pools = []
    for n in slot_counts:
        suffix = "" if n == 1 else f"_s{n}"
        found += [RealGroup(Pglane(pglane_lane(n)), n), RealGroup(Procrastinate(f"procrastinate{suffix}"), n),
                  RealGroup(Pgqueuer(f"pgqueuer{suffix}"), n)]
        pools.append(FloorPool(n))
        found += [FloorGroup(name, pools[-1]) for name in SYSTEMS[3:] if n == 1 or name not in ONE_SLOT_ONLY]
    return found, pools


@contextlib.contextmanager
def standing(server: BenchServer, slot_counts: tuple[int, ...], logs: Path) -> Iterator[list[Group]]:
    """Every group's processes, started and ready; all stopped at exit (asked at once, then reaped)."""
    found, pools = groups(slot_counts)
    everyone: list[subprocess.Popen[bytes]] = []
    try:
        for pool in pools:
            pool.start(server, logs)
            everyone += pool.procs
        for g in found:
            g.start(server, logs)
            everyone += g.procs
        for g in found:
            progress(f"throughput: starting {g.system} x {g.slots}")
            g.ready(server)
        yield found
    finally:
        progress("throughput: stopping the consumers")
        for proc in everyone:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            elif proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for proc in everyone:
            procs.stop(proc)


def measure(server: BenchServer, sizes: Sizes, slot_counts: tuple[int, ...], logs: Path) -> dict[str, Any]:
    """The concurrency entries ``[{"slots": N, "results": {system: {"throughput_jobs_per_s": ...}}}]``
    and, under "where_the_time_goes", the watched drains (see the module doc)."""
    with standing(server, slot_counts, logs) as found:
        by_key = {f"{g.system}@{g.slots}": g for g in found}
        jobs: dict[str, int] = {}
        for key, g in by_key.items():
            progress(f"throughput: warm-up {key}")
            rate = g.drain(server, WARMUP_JOBS if g.system == "pglane" or g.system.startswith("floor") else MIN_JOBS)
            jobs[key] = max(MIN_JOBS, min(sizes.throughput_jobs, round(rate * sizes.drain_seconds)))
        runs: dict[str, list[float]] = {key: [] for key in by_key}
        for rep, key in rotations(list(by_key), sizes.repetitions):
            progress(f"throughput: {key} (repetition {rep + 1}/{sizes.repetitions})")
            runs[key].append(by_key[key].drain(server, jobs[key]))
        watched: dict[str, Any] = {}
        for n in slot_counts:
            for system in ("pglane", "floor"):
                key = f"{system}@{n}"
                progress(f"throughput: watching {key}")
                watched[key] = watch(server, by_key[key], jobs[key])
    entries = []
    for n in slot_counts:
        results = {key.split("@")[0]: {"throughput_jobs_per_s": {**summary(values), "jobs_per_drain": jobs[key]}}
                   for key, values in runs.items() if key.endswith(f"@{n}")}
        entries.append({"slots": n, "results": results})
    return {"concurrency": entries, "where_the_time_goes": watched}


# ----- where the time goes ---------------------------------------------------------------------

def _ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _busy() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def watch(server: BenchServer, group: Group, n: int) -> dict[str, Any]:
    """One untimed drain of ``group``, watched: the wait events of its server sessions (sampled every
    ~5 ms by a thread on its own connection; an idle session waits on ClientRead: the consumer's own
    time, or the round trip), the CPU seconds per job of its processes and of their backends, and how
    busy the machine's CPUs were. Linux only (/proc); returns what it could read."""
    hz = os.sysconf("SC_CLK_TCK")
    waits: Counter[str] = Counter()
    stop = threading.Event()
    dbname = f"bench_{group.db}"

    def sample() -> None:
        with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
            while not stop.is_set():
                for (event,) in conn.execute(
                        "SELECT CASE WHEN state = 'idle' THEN 'idle (consumer or round trip)'"
                        " WHEN wait_event IS NULL THEN 'CPU' ELSE wait_event_type || ':' || wait_event END"
                        " FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s"
                        " AND backend_type = 'client backend'", (dbname, group.sessions_like)).fetchall():
                    waits[str(event)] += 1
                time.sleep(0.005)

    group.prepare(server, n)
    with psycopg.connect(server.admin_dsn, autocommit=True) as admin:
        backends = [int(pid) for (pid,) in admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s",
            (dbname, group.sessions_like)).fetchall()]
    before_procs = sum(_ticks(p) for p in group.pids)
    before_backends = sum(_ticks(p) for p in backends)
    busy0, total0 = _busy()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        rate = group.run(server, n)
    finally:
        stop.set()
        thread.join(5.0)
    busy1, total1 = _busy()
    cpu_procs = (sum(_ticks(p) for p in group.pids) - before_procs) / hz
    cpu_backends = (sum(_ticks(p) for p in backends) - before_backends) / hz
    samples = sum(waits.values()) or 1
    return {
        "jobs": n, "jobs_per_s": rate,
        "consumer_cpu_us_per_job": 1e6 * cpu_procs / n,
        "backend_cpu_us_per_job": 1e6 * cpu_backends / n,
        "machine_cpu_busy": (busy1 - busy0) / max(1, total1 - total0),
        "backend_states": {k: round(v / samples, 3) for k, v in waits.most_common()},
    }
