"""`pglane lane create|set|list|show|delete|pause|resume`: a lane's settings under their command-line names.

Settings are printed as the options that set them (``--job-timeout 10m``, ``--takeover after-lease``),
never as the database's column names; durations in the units the options take.
"""

from __future__ import annotations

import argparse
from typing import Any

import psycopg
from psycopg.rows import dict_row

from . import client, queries
from .cli_format import table, to_json
from .durations import format_seconds
from .errors import ConfigurationError, InvalidInput, UnknownLane

Row = dict[str, Any]
# (option, column, kind): the settings in the order they are shown; kind says how a value is written.
SETTINGS = (
    ("slots", "slots", "count"), ("job-timeout", "job_timeout", "duration"),
    ("lease-timeout", "lease_timeout", "duration"), ("max-attempts", "max_attempts", "count"),
    ("max-queued", "max_queued", "count"), ("rate", "rate", "text"), ("takeover", "takeover", "text"),
    ("max-result-bytes", "max_result_bytes", "count"), ("max-payload-bytes", "max_payload_bytes", "count"),
    ("waiting-grace", "waiting_grace", "duration"), ("retry-backoff", "retry_backoff", "duration"),
    ("key-retention", "key_retention", "duration"), ("group-slots", "group_slots", "count"),
    ("max-deferrals", "max_deferrals", "count"), ("on-retry-later", "on_retry_later", "text"),
    ("pause-after-failures", "pause_after_failures", "count"),
)
_PERIODS = {1.0: "s", 60.0: "min", 3600.0: "h", 86400.0: "d"}


def settings(conn: psycopg.Connection[Any], name: str | None = None) -> list[Row]:
    """Every lane's settings (or the one named), keyed by option name, JSON-ready (seconds as numbers)."""
    cur = conn.cursor(row_factory=dict_row)
    rows = cur.execute(queries.LANE_SETTINGS, {"name": name}, prepare=False).fetchall()
    out = []
    for r in rows:
        limit, period = r.pop("rate_limit"), r.pop("rate_period")
        r["rate"] = None if limit is None else f"{limit}/{_PERIODS.get(period, format_seconds(period))}"
        r["created_at"] = r["created_at"].isoformat()
        out.append({"lane": r["name"], **{option: r[column] for option, column, _ in SETTINGS},
                    "created_at": r["created_at"]})
    return out


def one(conn: psycopg.Connection[Any], name: str) -> Row:
    found = settings(conn, name)
    if not found:
        raise UnknownLane(f"unknown lane {name!r}; list the lanes with: pglane lane list")
    return found[0]


def shown(option: str, value: Any) -> str:
    kind = next(k for o, _, k in SETTINGS if o == option)
    if value is None:
        return "none"
    return format_seconds(value) if kind == "duration" else str(value)


def settings_text(lane: Row) -> str:
    return "\n".join(f"  --{option:<18} {shown(option, lane[option])}" for option, _, _ in SETTINGS)


def create(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    client.create_lane(conn, args.name, slots=args.slots, job_timeout=args.job_timeout,
                       lease_timeout=args.lease_timeout, max_attempts=args.max_attempts,
                       max_queued=args.max_queued, max_result_bytes=args.max_result_bytes,
                       waiting_grace=args.waiting_grace, retry_backoff=args.retry_backoff,
                       takeover=args.takeover.replace("-", "_"), rate=args.rate, key_retention=args.key_retention,
                       group_slots=args.group_slots, max_deferrals=args.max_deferrals,
                       on_retry_later=args.on_retry_later, pause_after_failures=args.pause_after_failures)
    lane = one(conn, args.name)
    print(to_json(lane) if args.json else f"lane {args.name} created:\n{settings_text(lane)}")
    return 0


def changes(args: argparse.Namespace) -> dict[str, Any]:
    """The settings `lane set` was given, as set_lane names them (a given 'none' removes max_queued,
    the rate, group_slots or pause_after_failures)."""
    found = {name: getattr(args, name) for name in ("slots", "job_timeout", "lease_timeout", "max_attempts",
                                                    "max_result_bytes", "waiting_grace", "retry_backoff",
                                                    "key_retention", "max_deferrals", "on_retry_later")
             if getattr(args, name) is not None}
    if args.takeover is not None:
        found["takeover"] = args.takeover.replace("-", "_")
    if args.rate is not None:
        found["rate"] = None if args.rate.strip().lower() == "none" else args.rate
    for name in ("max_queued", "group_slots", "pause_after_failures"):  # absent unless given; given none, None
        if hasattr(args, name):
            found[name] = getattr(args, name)
    if not found:
        raise ConfigurationError("lane set: give at least one setting to change, e.g. --rate 60/min or --slots 3")
    return found


def change(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    wanted = changes(args)
    before = one(conn, args.name)
    above: list[Row] = []
    if "slots" in wanted and wanted["slots"] < before["slots"]:  # read before: the view stops at the lane's slots
        above = conn.cursor(row_factory=dict_row).execute(queries.SLOTS_ABOVE, (args.name, wanted["slots"]),
                                                          prepare=False).fetchall()
    client.set_lane(conn, args.name, **wanted)
    after = one(conn, args.name)
    changed = {o: {"from": before[o], "to": after[o]} for o, _, _ in SETTINGS if before[o] != after[o]}
    notes = [f"the worker holding slot {s['slot']} ({_worker_of(s)}) is above the new {after['slots']} slot(s): it "
             f"finishes the job it runs, its next claim is refused, and it waits as a standby" for s in above]
    if args.json:
        print(to_json({"lane": args.name, "changed": changed, "settings": after, "notes": notes}))
        return 0
    what = ", ".join(f"--{o} {shown(o, c['from'])} -> {shown(o, c['to'])}" for o, c in changed.items())
    print(f"lane {args.name} changed: {what}" if what else
          f"lane {args.name}: nothing changed (each setting already had that value)")
    for note in notes:
        print(note)
    if changed:
        print("each setting applies from its next use: slots, rate and takeover at the next claim, the timeouts "
              "to each new attempt (a running attempt keeps its lease)")
    return 0


def _worker_of(session: Row) -> str:
    app = str(session.get("application_name") or "")
    who = f"worker {app.removeprefix('pglane ')}" if app.startswith("pglane ") else "a session that is no worker"
    return f"{who}, server session pid {session['pid']}"


LIST_COLUMNS = ("lane", "slots", "job-timeout", "lease-timeout", "max-attempts", "max-queued", "takeover", "rate")


def listing(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    lanes = settings(conn)
    if args.json:
        print(to_json(lanes))
    elif not lanes:
        print("no lanes yet: pglane lane create NAME")
    else:
        print(table([{c: shown(c, r[c]) if c != "lane" else r[c] for c in LIST_COLUMNS} for r in lanes],
                    LIST_COLUMNS))
    return 0


def show(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    lane = one(conn, args.name)
    status = _status_of(conn, args.name)
    if args.json:
        print(to_json({"lane": args.name, "settings": lane, "status": status,
                       "next_safe_action": status.get("next_safe_action")}))
        return 0
    counts = ", ".join(f"{k} {status.get(k, 0)}" for k in ("consumers", "queued", "running", "done", "failed",
                                                           "cancelled"))
    print(f"lane {args.name} (created {lane['created_at']})\n{settings_text(lane)}\n\nnow: {counts}")
    if status.get("paused"):
        print(f"PAUSED {pause_end(status['paused_until'])}: {status['pause_reason'] or 'no reason given'}")
    print(f"next safe action: {status.get('next_safe_action') or '-'}")
    return 0


def delete(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    """Delete a lane with its jobs and their attempts, in one transaction; refused while it has queued or
    running jobs unless --force."""
    cur = conn.cursor(row_factory=dict_row)
    with client.translated(), conn.transaction():
        if cur.execute(queries.LOCK_LANE, (args.name,), prepare=False).fetchone() is None:
            raise UnknownLane(f"unknown lane {args.name!r}; list the lanes with: pglane lane list")
        held = cur.execute(queries.LANE_HOLDINGS, {"name": args.name}, prepare=False).fetchone() or {}
        counts = {k: int(held.get(k) or 0) for k in ("queued", "running", "finished", "attempts")}
        what = (f"{counts['queued']} queued, {counts['running']} running and {counts['finished']} finished job(s) "
                f"with their {counts['attempts']} attempt(s)")
        if (counts["queued"] or counts["running"]) and not args.force:
            raise InvalidInput(f"lane {args.name} has {counts['queued']} queued and {counts['running']} running "
                               f"job(s); nothing was deleted. Stop its workers and let them finish (or cancel the "
                               f"queued jobs), or delete it anyway, dropping {what}: pglane lane delete "
                               f"{args.name} --force")
        cur.execute(queries.DELETE_LANE_ATTEMPTS, (args.name,), prepare=False)
        cur.execute(queries.DELETE_LANE_JOBS, (args.name,), prepare=False)
        cur.execute(queries.DELETE_LANE, (args.name,), prepare=False)
    print(to_json({"lane": args.name, "deleted": True, **counts}) if args.json else
          f"lane {args.name} deleted, with {what}")
    return 0


def pause_end(until: Any) -> str:
    """A pause's end as a person reads it (lane_status's paused_until: NULL while paused until resumed)."""
    return "until resumed" if until is None else f"until {until}"


def _status_of(conn: psycopg.Connection[Any], name: str) -> Row:
    return next((r for r in client.lane_status(conn) if r["lane"] == name), {})


def pause(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    """Pause a lane for --for, until --until, or (neither) until resumed; prints what pause_lane said."""
    note = client.pause_lane(conn, args.name, for_seconds=args.for_seconds, until=args.until, reason=args.reason)
    return _paused_or_resumed(conn, args, note)


def resume(conn: psycopg.Connection[Any], args: argparse.Namespace) -> int:
    return _paused_or_resumed(conn, args, client.resume_lane(conn, args.name))


def _paused_or_resumed(conn: psycopg.Connection[Any], args: argparse.Namespace, note: str) -> int:
    if args.json:
        status = _status_of(conn, args.name)
        print(to_json({"lane": args.name, "note": note,
                       **{k: status.get(k)
                          for k in ("paused", "paused_until", "paused_by", "pause_reason", "pause_kind")}}))
    else:
        print(note)
    return 0
