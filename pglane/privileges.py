"""What the connected role may do with pglane, and what it lacks: `pglane check`'s privileges part.

pglane needs no superuser and no statistics role (docs/managed.md): the schema's owner needs CREATE
on the database (and CREATEROLE only if the three group roles do not exist yet); workers, producers
and operators need their group role; claims, completions and recovery read a session's identity
from pg_locks, which every role may read. One thing ends sessions and so needs more:
`pglane recover --terminate-stuck` (pg_signal_backend, or the same role as the stuck worker).

Read-only: each finding says what is missing and the statement an administrator runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, LiteralString

ROLE_FACTS: LiteralString = (
    "SELECT current_user::text AS role,"
    " (SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = current_user) AS superuser,"
    " pg_catalog.pg_has_role(current_user, n.nspowner, 'USAGE') AS owner,"
    " pg_catalog.pg_has_role(current_user, 'pglane_producer', 'USAGE') AS producer,"
    " pg_catalog.pg_has_role(current_user, 'pglane_worker', 'USAGE') AS worker,"
    " pg_catalog.pg_has_role(current_user, 'pglane_operator', 'USAGE') AS operator,"
    " pg_catalog.pg_has_role(current_user, 'pg_signal_backend', 'USAGE') AS signal"
    " FROM pg_catalog.pg_namespace n WHERE n.nspname = 'pglane'"
)


@dataclass(frozen=True)
class Finding:
    missing: bool  # True: the role lacks something a command it may run needs
    text: str


def findings(conn: Any) -> list[Finding]:
    """What the connected role is to pglane and what, if anything, it lacks (read-only)."""
    row = conn.execute(ROLE_FACTS).fetchone()
    if row is None:
        return [Finding(True, "schema pglane does not exist in this database: run pglane migrate as its owner")]
    role, facts = row["role"], dict(row)
    kinds = [kind for kind in ("owner", "producer", "worker", "operator") if facts[kind]]
    if not kinds:
        return [Finding(True, f"role {role} has no pglane role: an administrator runs one of "
                              f"GRANT pglane_producer | pglane_worker | pglane_operator TO {role}")]
    out = [Finding(False, f"role {role} is pglane's {', '.join(kinds)}; claims, completions and recovery need no "
                          "privilege beyond the pglane roles (no superuser, no pg_read_all_stats)")]
    if (facts["operator"] or facts["owner"]) and not (facts["signal"] or facts["superuser"]):
        out.append(Finding(True, f"role {role} cannot end other roles' sessions: pglane recover --terminate-stuck "
                                 f"needs GRANT pg_signal_backend TO {role} (or run it as the workers' login); "
                                 "everything else works without it"))
    return out
