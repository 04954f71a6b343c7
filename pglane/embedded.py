"""A throwaway (or reusable) local PostgreSQL server, for ``pglane demo`` and the tests.

Owns: the life cycle of one PostgreSQL server on one data directory: initdb when the directory
is new, ``pg_ctl start`` on a Unix socket only (``listen_addresses=''``, so no TCP port can
clash), and ``pg_ctl stop -m fast`` at the end. ``embedded_server`` yields an
``EmbeddedServer`` (DSN, paths, start/stop/restart for crash tests); ``embedded_postgres``
yields only the DSN.

Invariant: when the context exits, by return, exception, KeyboardInterrupt or SIGTERM (mapped to
SystemExit while the context is open, if nobody else handles SIGTERM and we are in the main
thread), no postmaster started or adopted by the context is left running, and a temporary
directory made by the context is gone. Every PostgreSQL command is prefixed with
``pgbin.root_prefix()`` so it also works as root, and ``pg_ctl start`` always gets ``-l`` (without
it the postmaster inherits our stdout and a captured ``subprocess.run`` never returns).

How it breaks: SIGKILL of the Python process leaves the server running; with a ``data_dir``
the next ``embedded_server(data_dir)`` adopts that server (socket dir read from line 5 of
postmaster.pid) and stops it at exit, which also means two contexts sharing one data dir stop
each other's server. Without ``data_dir`` an orphan keeps its ``pglane-*`` temp dir. A socket
path longer than ~107 bytes cannot be bound (AF_UNIX limit), which is why sockets go to a short
``mkdtemp()`` path whenever the data dir's path is long. Unix sockets only: no Windows support.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from pglane import pgbin
from pglane.errors import EmbeddedServerError

PORT = 5432  # only names the socket file (.s.PGSQL.5432); there is no TCP listener
USER = "postgres"
LOG_NAME = "server.log"
_SOCKET_FILE = f".s.PGSQL.{PORT}"
_SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux; macOS allows 103
_SOCKET_DIR_PREFIX = "pglane-sock-"
_START_TIMEOUT = 60
_STOP_TIMEOUT = 60

ShutdownMode = Literal["smart", "fast", "immediate"]


def _socket_path_fits(directory: pathlib.Path) -> bool:
    return len(os.fsencode(directory / _SOCKET_FILE)) <= _SUN_PATH_MAX - 4  # keep a margin for macOS


def _plain_path(directory: pathlib.Path) -> bool:
    # unix_socket_directories is a comma-separated list that understands double quotes.
    return not any(ch in str(directory) for ch in ",\"'\\ \t\n")


def _short_tempdir(prefix: str) -> pathlib.Path:
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    if not _socket_path_fits(path) and os.path.isdir("/tmp"):
        path.rmdir()
        path = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return path


def _read_postmaster_pid(data_dir: pathlib.Path) -> list[str] | None:
    try:
        return (data_dir / "postmaster.pid").read_text(encoding="utf-8", errors="replace").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a postmaster that exited but was not reaped yet is a zombie: not running
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def running_postmaster(data_dir: pathlib.Path) -> tuple[int, pathlib.Path] | None:
    """(pid, socket dir) of the postmaster running on data_dir, or None if none runs there."""
    lines = _read_postmaster_pid(data_dir)
    if not lines or not lines[0].strip().lstrip("-").isdigit():
        return None
    pid = abs(int(lines[0]))
    if pid <= 0 or not _alive(pid):
        return None
    # postmaster.pid: 1 pid, 2 data dir, 3 start time, 4 port, 5 first socket dir, 6 listen addr, ...
    socket_dir = lines[4].strip() if len(lines) > 4 else ""
    return pid, pathlib.Path(socket_dir or data_dir)


def _log_tail(log: pathlib.Path, lines: int = 30) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"(no log at {log})"
    return "\n".join(text.splitlines()[-lines:]) or f"({log} is empty)"


def _run(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise EmbeddedServerError(f"{what} did not finish within {timeout:.0f}s: {shlex.join(cmd)}") from exc
    except OSError as exc:
        raise EmbeddedServerError(f"{what} could not be run: {shlex.join(cmd)}: {exc}") from exc


def pg_ctl_command(data_dir: pathlib.Path, *args: str) -> list[str]:
    """``[*root_prefix, pg_ctl, *args, "-D", data_dir]``; e.g. ``pg_ctl_command(d, "stop", "-m", "fast")``.

    For ``start``/``restart`` pass ``-l`` too (``EmbeddedServer.start``/``restart`` do), or a
    captured subprocess hangs on the postmaster's inherited stdout.
    """
    pg_ctl = pgbin.find_bindir() / f"pg_ctl{pgbin.EXE}"
    return [*pgbin.root_prefix(), str(pg_ctl), *args, "-D", str(data_dir)]


@dataclass(frozen=True)
class EmbeddedServer:
    """One local server: where it lives, how to reach it, and how to stop/start/crash it."""

    data_dir: pathlib.Path
    socket_dir: pathlib.Path
    fsync: bool = True
    port: int = PORT  # names the socket file; with listen, the TCP port too
    listen: str = ""  # listen_addresses: none (a Unix socket only) unless given, e.g. 127.0.0.1

    @property
    def dsn(self) -> str:
        return f"host={self.socket_dir} port={self.port} user={USER} dbname=postgres"

    @property
    def log_path(self) -> pathlib.Path:
        return self.data_dir / LOG_NAME

    def server_options(self) -> str:
        """The ``pg_ctl -o`` string: socket only, durability as configured, quiet enough logs."""
        settings = {
            "listen_addresses": self.listen,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            "fsync": "on" if self.fsync else "off",
            "full_page_writes": "on" if self.fsync else "off",
            "max_connections": "200",
            "log_min_messages": "warning",
            "log_line_prefix": "%m [%p] ",
        }
        # pg_ctl hands -o to /bin/sh, hence the shell quoting.
        return " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in settings.items())

    def pg_ctl(self, *args: str, timeout: float = _START_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run ``pg_ctl ARGS -D data_dir`` (root-safe) and return the result; never raises on exit status."""
        return _run(pg_ctl_command(self.data_dir, *args), f"pg_ctl {' '.join(args)}", timeout)

    def is_running(self) -> bool:
        return running_postmaster(self.data_dir) is not None

    def start(self) -> None:
        """Start the server on the existing data dir and wait until it accepts connections."""
        result = self.pg_ctl(
            "start",
            "-w",
            "-t",
            str(_START_TIMEOUT),
            "-l",
            str(self.log_path),
            "-o",
            self.server_options(),
            timeout=_START_TIMEOUT + 15,
        )
        if result.returncode != 0:
            raise EmbeddedServerError(
                f"PostgreSQL did not start on {self.data_dir} (pg_ctl exit {result.returncode}: "
                f"{result.stderr.strip() or result.stdout.strip()}); last lines of {self.log_path}:\n"
                f"{_log_tail(self.log_path)}"
            )

    def stop(self, mode: ShutdownMode = "fast") -> None:
        """Stop the server (``immediate`` simulates a crash: recovery runs at the next start).

        Does nothing when no server runs on the data dir.
        """
        if not self.is_running():
            return
        result = self.pg_ctl("stop", "-w", "-t", str(_STOP_TIMEOUT), "-m", mode, timeout=_STOP_TIMEOUT + 15)
        if result.returncode != 0 and self.is_running():
            raise EmbeddedServerError(
                f"pg_ctl stop -m {mode} failed on {self.data_dir}: {result.stderr.strip()}; "
                f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}"
            )

    def restart(self, mode: ShutdownMode = "immediate") -> None:
        """Stop with ``mode`` (default: immediate, i.e. a crash) and start again with the same settings."""
        self.stop(mode)
        self.start()


def initdb(data_dir: pathlib.Path, *, no_sync: bool, password_file: pathlib.Path | None = None) -> None:
    """initdb; with ``password_file``, the superuser gets that password and TCP connections must give
    it (scram-sha-256), while the Unix socket (in a directory only its owner reaches) stays trusted."""
    initdb = pgbin.find_bindir() / f"initdb{pgbin.EXE}"
    auth = ["--auth=trust"] if password_file is None else [
        "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={password_file}"]
    cmd = [
        *pgbin.root_prefix(),
        str(initdb),
        "-D",
        str(data_dir),
        "-U",
        USER,
        *auth,
        "-E",
        "UTF8",
        "--locale=C",
        "--no-instructions",
    ]
    if no_sync:
        cmd.append("--no-sync")
    result = _run(cmd, "initdb", timeout=120)
    if result.returncode != 0:
        raise EmbeddedServerError(
            f"initdb failed on {data_dir} (exit {result.returncode}):\n"
            f"{(result.stderr or result.stdout).strip()}"
        )


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """While open, SIGTERM raises SystemExit(143) once, so ``finally`` blocks run; later ones wait."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield  # someone else owns SIGTERM; leave it alone
        return
    fired = False

    def on_sigterm(signum: int, frame: types.FrameType | None) -> None:
        nonlocal fired
        if not fired:  # a second SIGTERM must not interrupt the cleanup the first one started
            fired = True
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def embedded_server(data_dir: pathlib.Path | None = None, *, fsync: bool = True) -> Iterator[EmbeddedServer]:
    """Run a local PostgreSQL for the duration of the context; see the module docstring.

    data_dir None: a fresh cluster in a ``mkdtemp()`` dir, removed at exit. data_dir given: it is
    created/initialised if empty, started if stopped, adopted if a server already runs on it
    (left in place at exit, server stopped). ``fsync=False`` is faster but a crash test that
    restarts the server could then lose committed data only in an OS crash, never in a
    PostgreSQL one.
    """
    temp_root: pathlib.Path | None = None
    extra_socket_dir: pathlib.Path | None = None
    server: EmbeddedServer | None = None
    with _sigterm_as_exit():
        try:
            if data_dir is None:
                temp_root = _short_tempdir("pglane-")
                server = EmbeddedServer(temp_root / "data", temp_root, fsync)
                initdb(server.data_dir, no_sync=True)
                server.start()
            else:
                data_dir = data_dir.absolute()
                adopted = running_postmaster(data_dir)
                if adopted is not None:
                    server = EmbeddedServer(data_dir, adopted[1], fsync)
                    if adopted[1].name.startswith(_SOCKET_DIR_PREFIX):
                        extra_socket_dir = adopted[1]
                else:
                    socket_dir = data_dir
                    if not (_socket_path_fits(data_dir) and _plain_path(data_dir)):
                        extra_socket_dir = socket_dir = _short_tempdir(_SOCKET_DIR_PREFIX)
                    server = EmbeddedServer(data_dir, socket_dir, fsync)
                    if not (data_dir / "PG_VERSION").exists():
                        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                        initdb(data_dir, no_sync=not fsync)
                    server.start()
            yield server
        finally:
            try:
                if server is not None:
                    try:
                        server.stop("fast")
                    except EmbeddedServerError:
                        server.stop("immediate")  # raises again if even that cannot stop it
            finally:
                if extra_socket_dir is not None:
                    with contextlib.suppress(OSError):
                        extra_socket_dir.rmdir()  # empty once the server is gone; never forced
                if temp_root is not None and (server is None or not server.is_running()):
                    shutil.rmtree(temp_root, ignore_errors=True)


@contextlib.contextmanager
def embedded_postgres(data_dir: pathlib.Path | None = None, *, fsync: bool = True) -> Iterator[str]:
    """Yield a libpq DSN (``host=<sockdir> port=5432 user=postgres dbname=postgres``) of a local server."""
    with embedded_server(data_dir, fsync=fsync) as server:
        yield server.dsn
