"""Instructions, not seconds: what pglane's functions cost the server, counted by callgrind.

On 2 shared cores a round's CPU time moves by 20 % and more for the same work (other tenants, steal),
so a difference of a few percent between two schemas is out of reach of jobs/s or /proc CPU times
without hundreds of rounds. ``valgrind --tool=callgrind`` counts the instructions the backend
executes: the same figure for the same work, whatever else the machine does. Here it runs a
single-user backend (``postgres --single``, the cluster stopped) of the embedded PostgreSQL, counting
only inside ``CALL`` statements (``--toggle-collect=ExecuteCallStmt``) and writing one part per call
(``--dump-after``): the first call of a run warms the session's plan caches, the second is measured.

What it does not see: the client, the round trip and the kernel (the commit's WAL flush is a system
call: counted as the instructions that issue it, not the time it waits). Both sides of a comparison
pay those alike.

The same run reads the WAL position before and after the counted call: the WAL bytes the counted
jobs wrote (``Counted.wal_bytes``), exact too; full-page images included (the first change of a page
after a checkpoint logs the whole page, and a single-user backend checkpoints when it stops, so every
counted drain writes some).

A cluster may be made from any PostgreSQL installation (``cluster(bindir)``: the system's 15, say);
the default is pglane.pgbin's choice, the embedded server.

Used by ``python -m bench --only scale --only instructions`` (#19, point 2), ``python -m bench --only
rates --only instructions`` (#21), the cost part of a server's run and ``--only features``
(bench.costs, #35) and bench.lab.identity (#29).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from pglane import pgbin

from .server import with_db
from .stats import progress, progress_done

# A slot-holding consumer's loop, all inside the server: claim once, then complete_and_claim p_jobs
# times, each job its own transaction (a procedure may COMMIT), as pglane worker's fast path does.
DRAIN = """
CREATE OR REPLACE PROCEDURE public.callgrind_drain(p_lane text, p_jobs integer) LANGUAGE plpgsql AS $$
DECLARE
    r pglane.claimed;
BEGIN
    PERFORM pg_advisory_lock((SELECT l.id FROM pglane.lanes l WHERE l.name = p_lane), 1);
    PERFORM set_config('pglane.slot', '1', false);
    r := pglane.claim_or_wait(p_lane, 'callgrind');
    COMMIT;
    FOR i IN 1 .. p_jobs LOOP
        r := pglane.complete_and_claim(r.attempt_id, 'null', p_lane, 'callgrind', r.token);
        IF r.job_id IS NULL THEN
            RAISE EXCEPTION 'callgrind_drain: lane % ran dry after % jobs', p_lane, i;
        END IF;
        COMMIT;
    END LOOP;
    PERFORM pg_advisory_unlock_all();
END $$;
"""


def available() -> str | None:
    """Why instructions cannot be counted here (None when they can)."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (Debian's package valgrind)"
    return None


@dataclass(frozen=True)
class Counted:
    """What one counted call cost the server: instructions, WAL bytes (everything the WAL position
    moved by) and, of those, the full-page images' bytes (pg_waldump --stats)."""

    instructions: int
    wal_bytes: int
    wal_fpi_bytes: int


@dataclass(frozen=True)
class Drain:
    """How a database's jobs are drained in a counted run: ``call`` with ``{}`` for the number of
    jobs; ``setup`` runs before the warm call and ``between`` after it, neither counted."""

    call: str = "CALL public.callgrind_drain('cc', {})"
    setup: str = "VACUUM pglane.jobs;\nVACUUM pglane.attempts;"
    between: str = ""


WAL_AT = "SELECT pg_current_wal_insert_lsn() AS bench_wal_{};"
KEEP_WAL = "wal_keep_size=1GB"  # the counted range must still be there for pg_waldump after the backend stops


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return int(high, 16) << 32 | int(low, 16)


def fpi_bytes(bindir: Path, wal: Path, start: str, end: str) -> int:
    """Bytes of full-page images in the WAL from ``start`` to ``end`` (pg_waldump --stats' total)."""
    done = subprocess.run([str(bindir / "pg_waldump"), "-p", str(wal), "-s", start, "-e", end, "--stats"],
                          capture_output=True, text=True, timeout=600)
    total = re.search(r"^Total\s+\d+\s+\d+ \[[\d.]+%\]\s+(\d+) \[", done.stdout, re.M)
    if done.returncode != 0 or total is None:
        raise RuntimeError(f"pg_waldump {start}..{end} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return int(total.group(1))


@contextlib.contextmanager
def binaries(bindir: Path | None) -> Iterator[Path]:
    """pglane.pgbin's choice of PostgreSQL binaries, or ``bindir`` while the context is open."""
    if bindir is None:
        yield pgbin.find_bindir()
        return
    before = os.environ.get("PGLANE_PG_BINDIR")
    os.environ["PGLANE_PG_BINDIR"] = str(bindir)
    try:
        yield pgbin.find_bindir()
    finally:
        if before is None:
            del os.environ["PGLANE_PG_BINDIR"]
        else:
            os.environ["PGLANE_PG_BINDIR"] = before


@dataclass
class Cluster:
    """A stopped cluster in ``root`` (of the binaries in ``bindir``; None: pglane.pgbin's choice);
    ``dsn(db)`` is valid only inside ``running()``."""

    root: Path
    bindir: Path | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        """The cluster started (fsync on), its admin DSN; stopped again at exit."""
        from pglane.embedded import embedded_server

        with binaries(self.bindir), embedded_server(self.data, fsync=True) as server:
            yield server.dsn

    def count(self, db: str, drain: Drain, jobs: int, warm: int = 20) -> Counted:
        """Instructions and WAL bytes of one warm counted call ``drain.call`` of ``jobs`` jobs in
        database ``db`` (a first call of ``warm`` jobs, not counted, warms the session)."""
        out = self.root / f"callgrind.{db}.out"
        for old in self.root.glob(f"callgrind.{db}.out*"):
            old.unlink()
        valgrind = shutil.which("valgrind")
        assert valgrind is not None, available()
        with binaries(self.bindir) as bindir:
            command = [*pgbin.root_prefix(), valgrind, "--tool=callgrind", "--collect-atstart=no",
                       "--toggle-collect=ExecuteCallStmt", "--dump-after=ExecuteCallStmt",
                       f"--callgrind-out-file={out}", str(bindir / "postgres"), "--single", "-D", str(self.data),
                       "-c", "autovacuum=off", "-c", KEEP_WAL, db]
        script = "\n".join([drain.setup, drain.call.format(warm), drain.between, WAL_AT.format("before"),
                            drain.call.format(jobs), WAL_AT.format("after"), ""])
        done = subprocess.run(command, input=script, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0 or "ERROR" in done.stdout + done.stderr:
            raise RuntimeError(f"callgrind run on {db} failed (exit {done.returncode}):\n"
                               f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        parts = sorted(self.root.glob(f"callgrind.{db}.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        totals = [total(p) for p in parts]
        if len(totals) < 2:
            raise RuntimeError(f"callgrind wrote {len(totals)} parts for {db}, expected 2: {parts}")
        wal = dict(re.findall(r'bench_wal_(before|after) = "([0-9A-F]+/[0-9A-F]+)"', done.stdout))
        if len(wal) != 2:
            raise RuntimeError(f"no WAL positions in the output of the callgrind run on {db}:\n{done.stdout[-2000:]}")
        return Counted(totals[1], _lsn(wal["after"]) - _lsn(wal["before"]),
                       fpi_bytes(bindir, self.data / "pg_wal", wal["before"], wal["after"]))

    def drain_instructions(self, db: str, lane: str, jobs: int, warm: int = 20, setup: str = "",
                           between: str = "") -> int:
        """Instructions of one warm ``callgrind_drain(lane, jobs)`` in database ``db`` (a first call of
        ``warm`` jobs, not counted, warms the session). ``setup`` runs first, not counted either (a
        VACUUM, say). Consumes warm + jobs + 2 queued jobs of the lane."""
        assert re.fullmatch(r"[a-z][a-z0-9_-]*", lane), lane  # a lane name, as pglane allows them
        drain = Drain(f"CALL public.callgrind_drain('{lane}', {{}});", setup, between)
        return self.count(db, drain, jobs, warm).instructions


def total(part: Path) -> int:
    """The instructions counted in one part callgrind wrote."""
    text = part.read_text(errors="replace")
    found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    if found is None:
        raise RuntimeError(f"no instruction total in {part}")
    return int(found.group(1))


@contextlib.contextmanager
def cluster(bindir: Path | None = None) -> Iterator[Cluster]:
    """A fresh cluster (of the binaries in ``bindir``; None: the embedded server's) in a temporary
    directory (removed at exit): set it up inside ``running()``, then count with ``count`` or
    ``drain_instructions`` while it is stopped."""
    root = Path(tempfile.mkdtemp(prefix="pglane-callgrind-"))
    os.chmod(root, 0o755)  # the server's user (a mapped one under root) must reach data/
    try:
        yield Cluster(root, bindir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def counted_rounds(found: Cluster, drains: Mapping[str, Drain], jobs: int, count: int,
                   label: str = "instructions") -> dict[str, list[Counted]]:
    """``count`` rounds of one counted drain of ``jobs`` jobs per database (``drains``' keys), the order
    reversed every other round so that a drift in the tables' state falls on every side alike."""
    names = list(drains)
    found_counts: dict[str, list[Counted]] = {name: [] for name in names}
    for r in range(count):
        for name in (names if r % 2 == 0 else names[::-1]):
            counted = found.count(name, drains[name], jobs)
            found_counts[name].append(counted)
            progress(f"{label} round {r + 1}/{count}: {name} {counted.instructions / jobs:,.0f}/job")
    return found_counts


HISTORY = 500  # jobs each database drains (uncounted) before the counted rounds
# The jobs a drain left running (its last claim), completed: one statement, not counted (no CALL).
FINISH = ("SELECT pglane.complete(a.id, 'null', a.token) FROM pglane.attempts a"
          " WHERE a.status = 'running' AND a.worker = 'callgrind';")


def interleaved_drains(setups: Mapping[str, Callable[[str], None]], jobs: int,
                       rounds: int, groups: Mapping[str, int] | None = None, backlog: int = 0,
                       finish: bool = False, bindir: Path | None = None, after_load: Mapping[str, str] | None = None
                       ) -> dict[str, list[float]]:
    """Instructions per job of lane ``cc`` drained through complete_and_claim, one database per entry
    of ``setups`` (named by its key), ``rounds`` times, the order reversed every other round so that
    a drift in the tables' state falls on every side alike. ``setups[name](dsn)`` makes the schema
    and creates lane cc in a fresh database; the jobs are queued here (``backlog`` more than the
    drains take, so that the queue stays that deep; with ``groups[name]`` = G, job i of that database
    in group ``g<i mod G>``), and each drain follows a VACUUM of the job tables (autovacuum does not
    run in a single-user backend). A drain ends with its last job claimed, still running; with
    ``finish`` the jobs left so (by worker ``callgrind``) are completed, uncounted, before each warm
    and each counted drain, so that it runs beside no running job but those the setup made (a lane
    with group_slots counts every one; a strict lane's slot waits for a lost job's lease).
    ``after_load[name]``: SQL run in that database once its jobs are queued. ``bindir``: the PostgreSQL
    installation (default: the embedded server's)."""
    names = list(setups)
    with cluster(bindir) as found:
        with found.running() as admin:
            with psycopg.connect(admin, autocommit=True) as conn:
                for name in names:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            for name in names:
                setups[name](with_db(admin, name))
                with psycopg.connect(with_db(admin, name), autocommit=True) as conn:
                    count = (groups or {}).get(name)
                    conn.execute("INSERT INTO pglane.jobs (lane, payload, group_key)"
                                 " SELECT 'cc', '{}', CASE WHEN %s::integer IS NOT NULL THEN 'g' || (i %% %s) END"
                                 " FROM generate_series(1, %s) i",
                                 (count, count, HISTORY + (jobs + 40) * (rounds + 1) + backlog))
                    if name in (after_load or {}):
                        conn.execute((after_load or {})[name].encode())
                    conn.execute(DRAIN)
                    # A history first, then the planner's statistics: analysed empty, the job tables
                    # would be planned as empty (sequential scans, cached for the session), unlike
                    # a server whose autovacuum has seen them.
                    conn.execute("CALL public.callgrind_drain('cc', %s)", (HISTORY,))
                    conn.execute("VACUUM ANALYZE")
        # finish: before the warm call too (a strict lane would not start a job beside a lost one)
        drain = Drain(setup=f"{FINISH}\n{Drain.setup}", between=FINISH) if finish else Drain()
        counted = counted_rounds(found, dict.fromkeys(names, drain), jobs, rounds)
    progress_done()
    return {name: [c.instructions / jobs for c in runs] for name, runs in counted.items()}
