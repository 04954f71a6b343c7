"""The embedded server against a real PostgreSQL: what it serves, what it leaves behind, and root."""

from __future__ import annotations

import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import psycopg
import pytest

from pglane import pgbin
from pglane.embedded import EmbeddedServer, embedded_postgres, embedded_server
from pglane.errors import EmbeddedServerError
from tests.conftest import ROOT  # whose import also puts ROOT on the subprocesses' PYTHONPATH

root_only = pytest.mark.skipif(not pgbin.is_root(), reason="only meaningful when running as root")


def _gone(pid: int, wait: float = 5.0) -> bool:
    """True once pid is no longer a running process (a zombie awaiting its reaper counts as gone)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _postmaster_pid(dsn: str) -> tuple[int, pathlib.Path]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    assert row is not None
    data_dir = pathlib.Path(row[0])
    return int((data_dir / "postmaster.pid").read_text().splitlines()[0]), data_dir


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedServer]:
    with embedded_server() as s:
        yield s


def test_dsn_answers_select_one(server: EmbeddedServer) -> None:
    with psycopg.connect(server.dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


def test_notify_from_one_connection_reaches_a_listener_on_another(server: EmbeddedServer) -> None:
    with (
        psycopg.connect(server.dsn, autocommit=True) as listener,
        psycopg.connect(server.dsn, autocommit=True) as sender,
    ):
        listener.execute("LISTEN pglane_test")
        sender.execute("SELECT pg_notify('pglane_test', 'hello')")
        received = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in received] == [("pglane_test", "hello")]


def test_advisory_lock_is_exclusive_across_connections(server: EmbeddedServer) -> None:
    with (
        psycopg.connect(server.dsn, autocommit=True) as a,
        psycopg.connect(server.dsn, autocommit=True) as b,
    ):
        assert a.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)
        assert b.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (False,)
        assert a.execute("SELECT pg_advisory_unlock(42)").fetchone() == (True,)
        assert b.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)


def test_server_listens_on_a_unix_socket_only(server: EmbeddedServer) -> None:
    with psycopg.connect(server.dsn) as conn:
        assert conn.execute("SHOW listen_addresses").fetchone() == ("",)
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
    assert (server.socket_dir / ".s.PGSQL.5432").exists()


def test_exit_stops_the_server_and_removes_the_temp_dir() -> None:
    with embedded_postgres() as dsn:
        pid, data_dir = _postmaster_pid(dsn)
        assert not _gone(pid, wait=0)
    assert not data_dir.parent.exists()
    assert _gone(pid)


def test_failed_start_raises_with_the_server_log_and_leaves_no_temp_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tmp_root = pathlib.Path(tempfile.mkdtemp(prefix="pgl-t-"))  # short: AF_UNIX paths are capped
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_root))
        monkeypatch.setattr(EmbeddedServer, "server_options", lambda self: "-c pglane_no_such_setting=1")
        with pytest.raises(EmbeddedServerError, match="pglane_no_such_setting"), embedded_postgres():
            pytest.fail("the context must not be entered")
        assert list(tmp_root.iterdir()) == []
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)


def test_data_dir_keeps_committed_rows_across_a_crash_and_a_running_server_is_adopted(
    tmp_path: pathlib.Path,
) -> None:
    data_dir = tmp_path / "data"
    with embedded_server(data_dir) as s:
        with psycopg.connect(s.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int); INSERT INTO t VALUES (7)")
        s.restart("immediate")  # crash + recovery
        with psycopg.connect(s.dsn) as conn:
            assert conn.execute("SELECT x FROM t").fetchone() == (7,)
        # A second launcher on the same data dir (e.g. after the first was SIGKILLed) adopts the server.
        pid, _ = _postmaster_pid(s.dsn)
        with embedded_postgres(data_dir) as dsn:
            assert dsn == s.dsn
            assert _postmaster_pid(dsn)[0] == pid
        assert not s.is_running()  # the adopter stops what it adopted
    assert data_dir.is_dir()
    with embedded_postgres(data_dir) as dsn, psycopg.connect(dsn) as conn:  # restarts, no initdb
        assert conn.execute("SELECT x FROM t").fetchone() == (7,)


def test_sigterm_inside_the_context_stops_the_server_and_removes_the_temp_dir() -> None:
    script = (
        "import sys, time\n"
        "from pglane.embedded import embedded_server\n"
        "with embedded_server() as s:\n"
        "    pid = (s.data_dir / 'postmaster.pid').read_text().split()[0]\n"
        "    print(s.socket_dir, pid, flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        temp_root, pid = proc.stdout.readline().split()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    assert not pathlib.Path(temp_root).exists()
    assert _gone(int(pid))


def _ancestor_modes(*paths: pathlib.Path) -> dict[pathlib.Path, tuple[int, int, int]]:
    modes = {}
    for path in paths:
        for p in [path, *path.parents]:
            if p.exists():
                st = p.stat()
                modes[p] = (st.st_mode, st.st_uid, st.st_gid)
    return modes


@root_only
def test_as_root_nothing_outside_the_data_dir_changes(tmp_path: pathlib.Path) -> None:
    data_dir = tmp_path / "data"
    watched = (data_dir.parent, pgbin.find_bindir(), pathlib.Path(sys.prefix), pathlib.Path(sys.executable))
    accounts = {p: p.read_bytes() for p in map(pathlib.Path, ("/etc/passwd", "/etc/group"))}
    before = _ancestor_modes(*watched)
    with embedded_postgres(data_dir) as dsn, psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert data_dir.stat().st_uid == 0  # on disk the files stay root's: nothing was chowned
    assert _ancestor_modes(*watched) == before
    assert {p: p.read_bytes() for p in accounts} == accounts


@root_only
def test_userns_module_runs_the_program_as_nobody() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pglane.userns", "/usr/bin/id", "-u"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
        timeout=30,
    ).stdout
    assert out.strip() == str(pwd.getpwnam("nobody").pw_uid)


@root_only
def test_pg_ctl_wrapper_lets_root_query_the_server(server: EmbeddedServer) -> None:
    env = {**os.environ, "PGLANE_PYTHON": sys.executable, "PGLANE_REAL_PG_CTL": str(pgbin.find_bindir() / "pg_ctl")}
    result = subprocess.run(
        [str(ROOT / "tests" / "pg_ctl_as_root.sh"), "status", "-D", str(server.data_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "server is running" in result.stdout


@root_only
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_as_root_without_user_namespaces_the_error_says_what_to_do() -> None:
    # Inside `unshare -r` we are root of a child namespace whose own user-namespace limit is set to 0,
    # like Docker's seccomp profile forbidding unshare. Nothing on the host changes.
    script = (
        "from pglane import pgbin\n"
        "from pglane.errors import EmbeddedServerError\n"
        "try:\n"
        "    pgbin.root_prefix()\n"
        "except EmbeddedServerError as e:\n"
        "    print(e)\n"
    )
    shell = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    result = subprocess.run(
        ["unshare", "-r", "sh", "-c", shell, sys.executable, script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    if result.returncode != 0 and "max_user_namespaces" in result.stderr:
        pytest.skip(f"cannot limit user namespaces here: {result.stderr.strip()}")
    assert "running as root" in result.stdout
    assert "no user namespace could be created" in result.stdout
    assert "PGLANE_DSN" in result.stdout
