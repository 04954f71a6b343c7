"""`pglane server start|stop|status`: a real embedded PostgreSQL that outlives the command, migrated,
reachable with the DSN it prints (and only with its password over TCP), kept across stop and start."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pglane
from pglane import schema
from tests.conftest import ROOT, free_port


def server(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PGLANE_DSN"}
    return subprocess.run([sys.executable, "-m", "pglane", "server", *args], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env=env, check=False)


def exported(out: str) -> str:
    """The DSN of the `export PGLANE_DSN=...` line, as a shell would read it."""
    [line] = out.splitlines()
    words = shlex.split(line)
    assert words[0] == "export" and words[1].startswith("PGLANE_DSN=")
    return words[1].removeprefix("PGLANE_DSN=")


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "server"
    yield path
    server("stop", "--data-dir", str(path))


def test_start_leaves_a_migrated_server_up_and_prints_its_dsn(data_dir: Path) -> None:
    port = free_port()
    started = server("start", "--data-dir", str(data_dir), "--port", str(port))
    assert started.returncode == 0, started.stderr
    assert f"pglane server stop --data-dir {data_dir.absolute()}" in started.stderr  # a hint that works as given
    dsn = exported(started.stdout)
    assert f"@127.0.0.1:{port}/" in dsn
    with pglane.connect(dsn) as conn:  # the command has exited: the server stays
        assert schema.current_revision(conn) == schema.head()
        pglane.create_lane(conn, "brain")
        job = pglane.enqueue(conn, "brain", {"q": 1})
    again = server("start", "--data-dir", str(data_dir), "--port", str(port))
    assert again.returncode == 0 and "already running" in again.stderr and exported(again.stdout) == dsn
    status = server("status", "--data-dir", str(data_dir))
    assert status.returncode == 0 and exported(status.stdout) == dsn

    assert server("stop", "--data-dir", str(data_dir)).returncode == 0
    stopped = server("status", "--data-dir", str(data_dir))
    assert stopped.returncode == 3 and "not running" in stopped.stderr and stopped.stdout == ""
    with pytest.raises(pglane.DatabaseUnavailable):
        pglane.connect(dsn)

    restarted = server("start", "--data-dir", str(data_dir), "--port", str(port))
    assert restarted.returncode == 0, restarted.stderr
    with pglane.connect(exported(restarted.stdout)) as conn:
        assert pglane.job_status(conn, job)["status"] == "queued"  # its data was kept


def test_tcp_needs_the_password_it_made(data_dir: Path) -> None:
    started = server("start", "--data-dir", str(data_dir), "--port", str(free_port()))
    assert started.returncode == 0, started.stderr
    info = conninfo_to_dict(exported(started.stdout))
    info["password"] = "wrong"
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(make_conninfo(**info)).close()  # type: ignore[arg-type]
    mode = (data_dir / "pglane-dsn").stat().st_mode & 0o777
    assert mode == 0o600


def test_a_port_in_use_is_refused_before_anything_starts(data_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = server("start", "--data-dir", str(data_dir), "--port", str(port))
    assert refused.returncode == 2
    assert f"port {port}" in refused.stderr and "--port" in refused.stderr
    assert not (data_dir / "PG_VERSION").exists()


def test_stop_and_status_take_no_port(data_dir: Path) -> None:
    done = server("stop", "--data-dir", str(data_dir), "--port", "5432")
    assert done.returncode == 2 and "--port is for `pglane server start`" in done.stderr
