"""`pglane server start|stop|status`: the embedded PostgreSQL as a local development server that stays
up between commands, migrated, so that the quick start runs on a machine with no PostgreSQL.

Owns: one server per data directory (default ``$XDG_DATA_HOME/pglane/server``, else
``~/.local/share/pglane/server``), listening on 127.0.0.1 at ``--port`` (default 54329) and on a Unix
socket, with a password made at its first start (stored beside its files, in ``pglane-dsn``, readable
by its owner only); `start` prints the line to export (``export PGLANE_DSN='...'``) on stdout and
everything else on stderr, so ``eval "$(pglane server start)"`` works.

Invariants: only `stop` (or the machine) ends the server; `start` on a running server changes nothing
and prints its DSN again. Root is handled as for `pglane demo` (pglane.embedded, pglane.userns).

How it breaks: a port another program holds is refused before anything starts, naming --port; a
data directory made by something else than `pglane server` has no ``pglane-dsn`` and is refused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import socket
import sys
import tempfile
from pathlib import Path

from . import embedded, schema
from .errors import ConfigurationError, EmbeddedServerError

DEFAULT_PORT = 54329
HOST = "127.0.0.1"
DSN_FILE = "pglane-dsn"
EXIT_NOT_RUNNING = 3  # `status` of a stopped server, as an init script's status says it


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "pglane" / "server"


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _dsn(data_dir: Path) -> str:
    try:
        return (data_dir / DSN_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ConfigurationError(f"{data_dir} holds a PostgreSQL that `pglane server` did not make (no {DSN_FILE});"
                                 " pass another --data-dir") from None


def _port_free(port: int) -> bool:
    """Whether PostgreSQL could listen on the port. It binds with SO_REUSEADDR, and so does the probe: a
    server just stopped leaves its closed connections in TIME_WAIT on the port for a minute, which a
    bind without it takes for a listener (a stop then start refused its own port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
    return True


def _running_port(data_dir: Path) -> int | None:
    found = embedded.running_postmaster(data_dir)
    if found is None:
        return None
    lines = (data_dir / "postmaster.pid").read_text(encoding="utf-8").splitlines()  # line 4: the port
    return int(lines[3]) if len(lines) > 3 and lines[3].strip().isdigit() else None


def _export(dsn: str) -> None:
    print(f"export PGLANE_DSN={shlex.quote(dsn)}", flush=True)


def start(data_dir: Path | None = None, port: int = DEFAULT_PORT) -> int:
    data_dir = (data_dir or default_data_dir()).absolute()
    if not 1 <= port <= 65535:
        raise ConfigurationError(f"--port must be between 1 and 65535, not {port}")
    running = _running_port(data_dir)
    if running is not None:
        _say(f"pglane server: already running on {data_dir} (port {running})")
        _export(_dsn(data_dir))
        return 0
    if not _port_free(port):
        raise ConfigurationError(f"port {port} on {HOST} is in use (another PostgreSQL?); pass --port P")
    fresh = not (data_dir / "PG_VERSION").exists()
    if fresh:
        password = secrets.token_urlsafe(18)
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="pglane-pw-") as tmp:
            secret = Path(tmp) / "pw"
            secret.write_text(password + "\n", encoding="utf-8")
            _say(f"pglane server: creating a PostgreSQL cluster in {data_dir} ...")
            embedded.initdb(data_dir, no_sync=False, password_file=secret)
        dsn_file = data_dir / DSN_FILE
        dsn_file.touch(mode=0o600)
        dsn_file.write_text(f"postgresql://{embedded.USER}:{password}@{HOST}:{port}/postgres\n", encoding="utf-8")
    dsn = _dsn(data_dir)
    if f"@{HOST}:{port}/" not in dsn:  # started before on another port: the DSN follows --port
        dsn = dsn.rsplit("@", 1)[0] + f"@{HOST}:{port}/postgres"
        (data_dir / DSN_FILE).write_text(dsn + "\n", encoding="utf-8")
    server = embedded.EmbeddedServer(data_dir, _socket_dir(data_dir), fsync=True, port=port, listen=HOST)
    server.start()
    try:
        schema.upgrade(dsn)
    except Exception:
        server.stop("fast")
        raise
    _say(f"pglane server: running on {data_dir}, port {port}, migrated to revision {schema.head()};"
         f" its log: {server.log_path}. Stop it with: pglane server stop{_data_dir_option(data_dir)}")
    _export(dsn)
    return 0


def _data_dir_option(data_dir: Path) -> str:
    """The --data-dir a later command needs to find this server (none for the default folder)."""
    return "" if data_dir == default_data_dir().absolute() else f" --data-dir {shlex.quote(str(data_dir))}"


def _socket_dir(data_dir: Path) -> Path:
    """The data directory itself when its path can hold a socket, else a short directory of our own."""
    if embedded._socket_path_fits(data_dir) and embedded._plain_path(data_dir):
        return data_dir
    return embedded._short_tempdir(embedded._SOCKET_DIR_PREFIX)


def stop(data_dir: Path | None = None) -> int:
    data_dir = (data_dir or default_data_dir()).absolute()
    found = embedded.running_postmaster(data_dir)
    if found is None:
        _say(f"pglane server: not running on {data_dir}; nothing to stop")
        return 0
    embedded.EmbeddedServer(data_dir, found[1]).stop("fast")
    if found[1].name.startswith(embedded._SOCKET_DIR_PREFIX):
        with contextlib.suppress(OSError):
            found[1].rmdir()
    _say(f"pglane server: stopped (its data stays in {data_dir}; pglane server start brings it back)")
    return 0


def status(data_dir: Path | None = None) -> int:
    data_dir = (data_dir or default_data_dir()).absolute()
    port = _running_port(data_dir)
    if port is None:
        made = "" if (data_dir / "PG_VERSION").exists() else " (no cluster there yet)"
        _say(f"pglane server: not running on {data_dir}{made}; start it with: pglane server start")
        return EXIT_NOT_RUNNING
    _say(f"pglane server: running on {data_dir}, port {port}")
    _export(_dsn(data_dir))
    return 0


def main(command: str, data_dir: str | None, port: int | None) -> int:
    path = Path(data_dir) if data_dir else None
    try:
        if command == "start":
            return start(path, DEFAULT_PORT if port is None else port)
        if port is not None:
            raise ConfigurationError(f"--port is for `pglane server start`; {command} finds the port itself")
        return stop(path) if command == "stop" else status(path)
    except EmbeddedServerError as exc:
        raise EmbeddedServerError(f"pglane server {command}: {exc}") from None
