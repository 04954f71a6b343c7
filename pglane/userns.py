"""Run one program inside a new user namespace where the caller's uid is an ordinary user.

Owns: the only way pglane runs PostgreSQL binaries as root. PostgreSQL refuses to run with
euid 0 and has no flag to allow it; instead of adding a system user and opening up directory
modes, ``python -m pglane.userns PROGRAM ARGS...`` unshares a user namespace that maps the outer
euid/egid onto ``nobody`` (or another existing non-root passwd entry) and then execs PROGRAM.
Inside, PostgreSQL sees a normal user; on disk every file it makes is still owned by the outer
user, so root-owned 0700 temporary directories work and nothing on the host changes.

Invariant: the program runs with exactly one uid and one gid mapped, both non-zero inside the
namespace and both naming an entry that exists in /etc/passwd (initdb looks its own user up
even with ``-U``). Nothing outside the new namespace is modified: no /etc/passwd entry, no
chown, no chmod.

How it breaks: user namespaces may be forbidden (Docker's default seccomp profile,
``user.max_user_namespaces=0``, some hardened kernels, non-Linux systems); then
``enter_user_namespace`` raises OSError and the ``__main__`` entry exits with status 125.
Files owned by uids other than the caller's appear as the overflow uid inside and lose every
permission except "other". Only the standard library may be imported here: this module runs
before every PostgreSQL command and must not drag in the rest of pglane.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import sys

CLONE_NEWUSER = 0x10000000  # <linux/sched.h>
_PREFERRED_USER = "nobody"


def mapped_ids() -> tuple[int, int]:
    """The (uid, gid) the caller becomes inside the namespace: nobody's, else another non-root user.

    Raises LookupError if /etc/passwd holds no usable entry.
    """
    try:
        entry = pwd.getpwnam(_PREFERRED_USER)
    except KeyError:
        pass
    else:
        if entry.pw_uid != 0 and entry.pw_gid != 0:
            return entry.pw_uid, entry.pw_gid
    # Prefer the highest uid: system "nobody"-like accounts sit at the top, daemons at the bottom.
    candidates = sorted(
        (e for e in pwd.getpwall() if e.pw_uid != 0 and e.pw_gid != 0),
        key=lambda e: e.pw_uid,
        reverse=True,
    )
    if not candidates:
        raise LookupError("no non-root user in /etc/passwd to map the caller onto")
    return candidates[0].pw_uid, candidates[0].pw_gid


def _unshare_user_namespace() -> None:
    if sys.version_info >= (3, 12):
        os.unshare(os.CLONE_NEWUSER)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(CLONE_NEWUSER)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER): {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def enter_user_namespace() -> None:
    """Move this process into a new user namespace where it is ``nobody`` (see ``mapped_ids``).

    Must be called before the process starts threads (unshare(CLONE_NEWUSER) refuses
    multi-threaded callers). Raises OSError when user namespaces are unavailable.
    """
    outer_uid, outer_gid = os.geteuid(), os.getegid()
    inner_uid, inner_gid = mapped_ids()
    _unshare_user_namespace()
    # setgroups must be denied before gid_map can be written by an unprivileged writer; for root
    # it is merely harmless. PostgreSQL never calls setgroups().
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{inner_uid} {outer_uid} 1\n")
    _write("/proc/self/gid_map", f"{inner_gid} {outer_gid} 1\n")


def main(argv: list[str]) -> None:
    """``python -m pglane.userns PROGRAM [ARGS...]``: exec PROGRAM (an absolute path) as nobody."""
    if len(argv) < 2:
        sys.stderr.write("usage: python -m pglane.userns /path/to/program [args...]\n")
        raise SystemExit(2)
    try:
        enter_user_namespace()
    except (OSError, LookupError) as exc:
        sys.stderr.write(f"pglane.userns: cannot create a user namespace: {exc}\n")
        raise SystemExit(125) from None
    os.execv(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv)
