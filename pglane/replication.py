"""``pglane check``'s rule about replication: a standby that may be promoted without the claims the
primary acknowledged is a risk of paying twice.

With synchronous replication (``synchronous_standby_names`` naming the standby, ``synchronous_commit``
``on``, ``remote_apply`` or ``remote_write`` for every session that claims or enqueues) a commit is
acknowledged only once the standby has it, so a promoted standby holds every claim a worker acted on:
recovery finds the claiming session gone and marks the attempt lost, never runs the job again. With
asynchronous replication a claim the primary acknowledged may be missing on the promoted standby: the
job is ``queued`` there again and a paid call already made would be made again; an acknowledged
enqueue may vanish too.

Owns: ``findings(conn)``, read-only, from what this server shows: whether it is a standby itself, the
standbys streaming from it (``pg_stat_replication``: which are ``sync`` or ``quorum``), and the
``synchronous_commit`` that pglane's sessions get: the server's, the database's
(``ALTER DATABASE ... SET``) and each login role's (``ALTER ROLE ... SET``, per database or for all) for
the roles that are members of ``pglane_worker`` or ``pglane_producer`` and for the role running the
check. PostgreSQL applies the settings of the role that logs in, never those of the groups it belongs
to: a group role's setting (``ALTER ROLE pglane_worker SET ...``) counts only if that role can log in.

How it breaks: a standby that does not stream from this server (a cloud provider's storage-level
replica, a cascaded standby) cannot be seen; without ``pg_monitor`` (or ``pg_read_all_stats``) the
standbys' ``sync_state`` reads as NULL and the rule says it cannot tell; a ``SET synchronous_commit``
that a client sends in its own session cannot be seen at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, LiteralString

from psycopg.rows import dict_row

SAFE_COMMITS = ("on", "remote_apply", "remote_write")  # acknowledged once a synchronous standby has the commit
SYNCHRONOUS = ("sync", "quorum")  # pg_stat_replication.sync_state of a standby that every commit waits for
FIX_COMMIT = "synchronous_commit = on"
FIX_STANDBY = ("synchronous_standby_names = 'FIRST 1 (name)', naming the standby's application_name "
               "(Patroni: synchronous_mode: true), with synchronous_commit = on, and promote only a synchronous "
               "standby")

SERVER: LiteralString = (
    "SELECT pg_is_in_recovery() AS in_recovery, current_setting('synchronous_standby_names') AS standby_names,"
    " s.setting AS synchronous_commit, s.source, current_database() AS database, current_user AS checker"
    " FROM pg_settings s WHERE s.name = 'synchronous_commit'"
)
STANDBYS: LiteralString = (
    "SELECT application_name, host(client_addr) AS client_addr, state, sync_state FROM pg_stat_replication"
    " ORDER BY application_name"
)
# synchronous_commit set with ALTER DATABASE (setrole 0) for this database; NULL when it is not.
DATABASE_COMMIT: LiteralString = (
    "SELECT (SELECT substr(c, length('synchronous_commit=') + 1)"
    " FROM pg_db_role_setting s, unnest(s.setconfig) c"
    " WHERE s.setrole = 0 AND s.setdatabase = d.oid AND c LIKE 'synchronous\\_commit=%') AS value"
    " FROM pg_database d WHERE d.datname = current_database()"
)
# Every role whose sessions claim or enqueue (members of pglane_worker or pglane_producer, at any depth,
# the groups themselves) and the role running the check, with its synchronous_commit set by ALTER ROLE
# for this database (in_database) or for all (all_databases).
ROLE_COMMITS: LiteralString = (
    "WITH RECURSIVE member(oid, via) AS ("
    "  SELECT g.oid, g.rolname::text FROM pg_roles g WHERE g.rolname IN ('pglane_worker', 'pglane_producer')"
    "  UNION SELECT m.member, r.via FROM member r JOIN pg_auth_members m ON m.roleid = r.oid"
    "), scope AS ("
    "  SELECT oid, string_agg(DISTINCT via, ', ') AS via FROM member GROUP BY oid"
    "  UNION ALL SELECT r.oid, NULL FROM pg_roles r"
    "   WHERE r.rolname = current_user AND r.oid NOT IN (SELECT oid FROM member)"
    ")"
    " SELECT r.rolname, r.rolcanlogin, scope.via,"
    "  (SELECT substr(c, length('synchronous_commit=') + 1) FROM pg_db_role_setting s, unnest(s.setconfig) c"
    "    WHERE s.setrole = r.oid AND s.setdatabase = d.oid AND c LIKE 'synchronous\\_commit=%') AS in_database,"
    "  (SELECT substr(c, length('synchronous_commit=') + 1) FROM pg_db_role_setting s, unnest(s.setconfig) c"
    "    WHERE s.setrole = r.oid AND s.setdatabase = 0 AND c LIKE 'synchronous\\_commit=%') AS all_databases"
    " FROM scope JOIN pg_roles r ON r.oid = scope.oid"
    " JOIN pg_database d ON d.datname = current_database()"
    " ORDER BY r.rolname"
)
# Where the checking session's own synchronous_commit came from when it is not the server's (pg_settings.source).
OWN_SOURCES = ("database", "user", "database user", "session", "client")


@dataclass(frozen=True)
class Finding:
    risk: bool  # True: pglane could pay twice (or lose an acknowledged job) on a promotion; check fails
    text: str


def _rows(conn: Any, query: LiteralString) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, prepare=False)
        rows: list[dict[str, Any]] = cur.fetchall()
        return rows


def findings(conn: Any) -> list[Finding]:
    """What the server shows about replication and pglane's commits: risks first, each with the setting
    that removes it, then plain notes. Read-only; any role may run it (less is seen without pg_monitor)."""
    server = _rows(conn, SERVER)[0]
    if server["in_recovery"]:
        return [Finding(True, "this server is a standby (in recovery): workers and producers cannot write here; "
                              "point the DSN at the primary, e.g. host=a,b target_session_attrs=read-write")]
    out = _commit_findings(conn, server)
    out += _standby_findings(_rows(conn, STANDBYS), str(server["standby_names"]))
    return sorted(out, key=lambda f: not f.risk)


def _standby_findings(standbys: list[dict[str, Any]], standby_names: str) -> list[Finding]:
    names = f"synchronous_standby_names = '{standby_names}'"
    if not standbys:
        note = ("no standby streams from this server; a standby that pglane cannot see (a provider's replica) "
                "must be synchronous too")
        if standby_names:
            note = (f"{names} but no standby is connected: every commit waits for one (the lanes stall until it "
                    "is back)")
        return [Finding(False, note)]
    if any(s["sync_state"] is None for s in standbys):
        return [Finding(False, f"{len(standbys)} standby(s) stream from this server, but whether they are "
                               "synchronous cannot be read by this role: run pglane check as a member of pg_monitor")]
    out = []
    sync = [s for s in standbys if s["sync_state"] in SYNCHRONOUS]
    for s in standbys:
        if s["sync_state"] in SYNCHRONOUS:
            continue
        why = "synchronous_standby_names is empty" if not standby_names else f"{names} does not make it synchronous"
        out.append(Finding(True, (
            f"standby {s['application_name'] or '(no application_name)'} ({s['client_addr'] or 'local'}) is "
            f"{s['sync_state']} ({why}): if it is promoted, a claim the primary acknowledged may be missing on it, "
            "so the job is queued again and a paid call already made is made again (and an acknowledged enqueue "
            f"may vanish); remove the risk: {FIX_STANDBY}")))
    if sync:
        listed = ", ".join(f"{s['application_name']} ({s['sync_state']})" for s in sync)
        out.append(Finding(False, f"synchronous standby(s): {listed}; {names}: a commit is acknowledged once "
                                  "a synchronous standby has it"))
        if not standby_names:  # cannot happen on a real server: a standby is sync only when named
            out.append(Finding(False, "synchronous_standby_names reads empty: the role cannot see it"))
    elif not standby_names:
        out.append(Finding(False, "synchronous_standby_names is empty: no commit waits for a standby"))
    return out


def _commit_findings(conn: Any, server: dict[str, Any]) -> list[Finding]:
    """synchronous_commit as each of pglane's login roles gets it in this database: the role's setting for
    this database, else its setting for all databases, else the database's, else the server's."""
    database = _rows(conn, DATABASE_COMMIT)[0]["value"]
    server_value = None if server["source"] in OWN_SOURCES else str(server["synchronous_commit"])
    out: list[Finding] = []
    if database is not None and database not in SAFE_COMMITS:
        out.append(Finding(True, (
            f"database {server['database']} has synchronous_commit = {database} (ALTER DATABASE): its commits "
            "are acknowledged before a standby has them, so a claim can vanish on a promotion and its paid call "
            f"be made again; remove the risk: ALTER DATABASE {server['database']} RESET synchronous_commit "
            f"(with {FIX_COMMIT} on the server)")))
    base = database if database is not None else server_value
    if server_value is not None and server_value not in SAFE_COMMITS and database is None:
        out.append(Finding(True, (
            f"the server has synchronous_commit = {server_value}: commits are acknowledged before a standby has "
            "them, so a claim can vanish on a promotion and its paid call be made again; remove the risk: "
            f"{FIX_COMMIT} in postgresql.conf (ALTER SYSTEM SET {FIX_COMMIT}; SELECT pg_reload_conf())")))
    for role in _rows(conn, ROLE_COMMITS):
        if not role["rolcanlogin"]:
            continue  # no session ever runs as this role: its settings apply to nobody
        value, how = role["in_database"], f"ALTER ROLE {role['rolname']} IN DATABASE {server['database']} SET"
        if value is None:
            value, how = role["all_databases"], f"ALTER ROLE {role['rolname']} SET"
        if value is None or value in SAFE_COMMITS:
            continue
        who = f"a member of {role['via']}" if role["via"] else "the role running this check"
        reset = how.replace(" SET", " RESET synchronous_commit")
        out.append(Finding(True, (
            f"role {role['rolname']} ({who}) has synchronous_commit = {value} ({how}): its commits are "
            "acknowledged before a standby has them, so its claims (and enqueues) can vanish on a promotion and "
            f"a paid call be made again; remove the risk: {reset}")))
    if base is None:
        out.append(Finding(False, f"the server's own synchronous_commit cannot be read from this session (its "
                                  f"value came from the {server['source']}); it must be one of "
                                  f"{', '.join(SAFE_COMMITS)}"))
    return out
