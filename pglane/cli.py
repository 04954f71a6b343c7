"""The command line (docs/commands.md). It uses only the public API; every PglaneError becomes one line on
stderr that says what was wrong and what to do, with exit status 1 (2 for usage and settings)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import psycopg

from . import cli_lanes, client, durations, lockwait, logs, privileges, queries, replication, schema, timing
from .cli_format import json_stream, pipe_closed, table, to_json
from .errors import (
    ConfigurationError,
    JobPruned,
    PermissionDenied,
    PglaneError,
    WaitTimeout,
    first_line,
    translate,
)
from .job import JOB_STATUSES
from .session import SESSIONS

EXIT_FULL = 3  # enqueue --if-full skip met a full lane: nothing was written
EXIT_WAIT_TIMEOUT = 4  # enqueue --wait --timeout S: the job had not finished (it goes on)
EXIT_PRUNED = 6  # enqueue: the key belonged to a job that was pruned (JobPruned): nothing was written
KEY_RETENTION_HELP = ("how long a pruned job's idempotency key is remembered: the same key then gets the pruned "
                      "job's id (exit 6), never a second paid call")
GROUP_SLOTS_HELP = ("at most N jobs of one group (a job's --group) run at once, cluster-wide; a job whose group is "
                    "full is passed over for another group's")
MAX_DEFERRALS_HELP = ("a job whose handler raises RetryLater (nothing paid) this many times in a row fails instead, "
                      "saying so (0..10000)")
ON_RETRY_LATER_HELP = ("what a handler's RetryLater holds back: lane, the whole lane (paused until the time it "
                       "asked), or job, that job only")
PAUSE_AFTER_FAILURES_HELP = ("the breaker: after K failed or timed-out attempts in a row the lane pauses until a "
                             "person resumes it (pglane lane resume)")
LANE_NAME_RULE = "a lowercase letter, then up to 47 lowercase letters, digits, '_' or '-'"

EPILOG = """durations: a number and a unit, or several: 250ms, 90s, 10m, 1h30m, 7d (a bare number is seconds,
except for prune --older-than, which needs a unit).

exit status: 0 done; 1 an error (one line on stderr: what was wrong and what to do); 2 a usage or
settings error; 3 enqueue --if-full skip met a full lane; 4 enqueue --wait --timeout ran out (the job
goes on); 6 enqueue: the key belonged to a job that was done and pruned since (nothing written: use a
new key to pay again); 130 interrupted; 141 stdout was closed early (e.g. piped into head): the output was cut,
nothing else failed, no traceback.

database: every command but demo and server takes --dsn (before or after the command) or $PGLANE_DSN."""


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default shown after its meaning; the epilog kept as written."""


class _Version(argparse.Action):
    """--version: read from the installed package's metadata, only when asked (importlib.metadata is slow)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("pglane")
        except PackageNotFoundError:
            found = "unknown (not installed; pip install -e .)"
        print(f"pglane {found}")
        parser.exit()


def _count_or_none(text: str) -> int | None:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor none") from None


def _duty(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share of time between 0 (exclusive) and 1, e.g. 0.5")
    return value


def _seconds(text: str) -> float:
    """A positive duration; a bare number is seconds (the established meaning for timeouts)."""
    try:
        return durations.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _age(text: str) -> float:
    """prune --older-than: a duration with its unit (a bare 7 could be days or seconds)."""
    try:
        return durations.parse(text, bare_seconds=False, allow_zero=True, example="7d")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _moment(text: str) -> datetime:
    """lane pause --until: an ISO-8601 time; without a UTC offset, this machine's local time."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO-8601 time, e.g. 2026-12-06T15:30:00Z or '2026-12-06 15:30+01:00'") from None
    return moment if moment.tzinfo is not None else moment.astimezone()


def _lane_name(text: str) -> str:
    import re

    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,47}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a lane name: {LANE_NAME_RULE}, e.g. brain or paid-api")
    return text


def _lane_slots(text: str) -> tuple[str, int]:
    """worker's LANE[=N]: the lane and how many of its slots the process takes."""
    name, sep, count = text.partition("=")
    try:
        slots = int(count) if sep else 1
    except ValueError:
        slots = 0
    if not name or slots < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give LANE or LANE=N, N a whole number of at least 1 (the slots "
                                         "of the lane this process takes), e.g. brain=2")
    return name, slots


def _count(text: str) -> int:
    """A whole number of at least 1 (worker's --slots-each)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def _payload(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"payload is not valid JSON ({exc.msg} at column {exc.colno}); quote it, e.g. '{{\"q\": 1}}'"
        ) from None


RATE_HELP = ("at most N starts (or N units of --cost) in any window of PERIOD, cluster-wide: 5/s, 60/min, "
             "1000/h, 100/10min")
JSON_HELP = "print JSON instead of text"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pglane", description="A PostgreSQL job queue for scarce, expensive work.",
                                epilog=EPILOG, formatter_class=_Help)
    dsn_help = "libpq DSN or URI of the database (default: $PGLANE_DSN)"
    p.add_argument("--dsn", help=dsn_help)
    p.add_argument("--version", action=_Version, help="print pglane's version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="the command to run")

    def command(name: str, text: str, into: Any = sub, json_flag: bool = True) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = into.add_parser(name, help=text, description=text, formatter_class=_Help,
                                                     epilog=EPILOG)
        if json_flag:
            c.add_argument("--json", action="store_true", help=JSON_HELP)
        return c

    command("migrate", "create or upgrade pglane's schema (needs CREATE on the database and CREATEROLE)")

    lane = _lane_commands(command)
    _work_commands(command)
    _operator_commands(command)
    _local_commands(command)
    for c in (*sub.choices.values(), *lane.choices.values()):  # --dsn after the command too; it wins
        c.add_argument("--dsn", default=argparse.SUPPRESS, help=dsn_help)
    for name, c in (*sub.choices.items(), *lane.choices.items()):
        if name not in ("lane", "worker", "web", "demo", "server", "migrate"):
            c.add_argument("--lock-wait", type=_seconds, default="10s",
                           help="wait at most this long for a lock another session holds, then name that session "
                           "and stop with nothing changed")
    return p


def _lane_commands(command: Callable[..., argparse.ArgumentParser]) -> Any:
    """lane create|set|list|show|delete|pause|resume; returns the lane subcommands' parsers."""
    lane = command("lane", "manage lanes: create, set, list, show, delete, pause, resume",
                   json_flag=False).add_subparsers(
        dest="lane_command", required=True, metavar="LANE_COMMAND", help="what to do with lanes")
    create = command("create", "create a lane; prints its settings", lane)
    create.add_argument("name", type=_lane_name, help=f"the lane's name: {LANE_NAME_RULE}")
    create.add_argument("--slots", type=int, default=1, help="consumer slots, cluster-wide: jobs run at once")
    create.add_argument("--job-timeout", type=_seconds, default=f"{timing.DEFAULT_JOB_TIMEOUT:g}s",
                        help="the handler's budget per attempt; past it the attempt is timed_out")
    create.add_argument("--lease-timeout", type=_seconds,
                        help="past it a still-connected holder is stuck (reported, never re-run); default: 10%% "
                        "longer than --job-timeout")
    create.add_argument("--max-attempts", type=int, default=1,
                        help="attempts per job: more than 1 re-runs a failed job (never a lost one) by itself")
    create.add_argument("--max-queued", type=int, help="bound the queue: an enqueue beyond it is refused "
                        "(default: unbounded)")
    create.add_argument("--takeover", choices=("immediate", "after-lease"), default="immediate",
                        help="after-lease: a slot freed by a lost session takes no job until that attempt's "
                        "lease ends, so no two calls ever overlap")
    create.add_argument("--max-result-bytes", type=int, default=16 * 1024 * 1024,
                        help="a handler's result larger than this fails its attempt")
    create.add_argument("--waiting-grace", type=_duration0, default="5s",
                        help="a job queued this long with no worker is shown as waiting for a worker")
    create.add_argument("--retry-backoff", type=_duration0, default="2s",
                        help="pause before a failed job's next attempt (with --max-attempts above 1)")
    create.add_argument("--rate", help=RATE_HELP + " (default: unlimited)")
    create.add_argument("--key-retention", type=_duration0, default="30d", help=KEY_RETENTION_HELP)
    create.add_argument("--group-slots", type=_count_or_none, help=GROUP_SLOTS_HELP + " (default: none)")
    create.add_argument("--max-deferrals", type=int, default=20, help=MAX_DEFERRALS_HELP)
    create.add_argument("--on-retry-later", choices=("job", "lane"), default="lane", help=ON_RETRY_LATER_HELP)
    create.add_argument("--pause-after-failures", type=_count_or_none, metavar="K",
                        help=PAUSE_AFTER_FAILURES_HELP + " (default: none, no breaker)")
    change = command("set", "change a lane while its workers run (each setting from its next use)", lane)
    change.add_argument("name", help="the lane to change")
    change.add_argument("--slots", type=int, help="consumer slots, cluster-wide")
    change.add_argument("--job-timeout", type=_seconds, help="the handler's budget per attempt")
    change.add_argument("--lease-timeout", type=_seconds, help="past it a still-connected holder is stuck")
    change.add_argument("--max-attempts", type=int, help="attempts per job")
    change.add_argument("--max-queued", type=_count_or_none, default=argparse.SUPPRESS,
                        help="N, or none for an unbounded lane")
    change.add_argument("--rate", help=RATE_HELP + "; none removes it")
    change.add_argument("--takeover", choices=("immediate", "after-lease"),
                        help="after-lease: a freed slot waits for a lost attempt's lease")
    change.add_argument("--max-result-bytes", type=int, help="a larger result fails its attempt")
    change.add_argument("--waiting-grace", type=_duration0, help="queued this long with no worker: shown waiting")
    change.add_argument("--retry-backoff", type=_duration0, help="pause before a failed job's next attempt")
    change.add_argument("--key-retention", type=_duration0, help=KEY_RETENTION_HELP)
    change.add_argument("--group-slots", type=_count_or_none, default=argparse.SUPPRESS,
                        help=GROUP_SLOTS_HELP + "; none removes it")
    change.add_argument("--max-deferrals", type=int, help=MAX_DEFERRALS_HELP)
    change.add_argument("--on-retry-later", choices=("job", "lane"), help=ON_RETRY_LATER_HELP)
    change.add_argument("--pause-after-failures", type=_count_or_none, default=argparse.SUPPRESS, metavar="K",
                        help=PAUSE_AFTER_FAILURES_HELP + "; none removes it")
    command("list", "every lane and its settings", lane)
    shown = command("show", "one lane: its settings, what it holds now and the next safe action", lane)
    shown.add_argument("name", help="the lane to show")
    gone = command("delete", "delete a lane, with its jobs and their attempts, in one transaction", lane)
    gone.add_argument("name", help="the lane to delete")
    gone.add_argument("--force", action="store_true",
                      help="delete it even while it has queued or running jobs (says how many it drops)")
    held = command("pause", "pause a lane: it accepts jobs and starts none (calls in flight finish), until "
                   "resumed, for a while (--for) or until a time (--until)", lane)
    held.add_argument("name", help="the lane to pause")
    end = held.add_mutually_exclusive_group()
    end.add_argument("--for", dest="for_seconds", type=_seconds, metavar="DURATION",
                     help="pause this long: 30s, 10m, 2h (a bare number is seconds)")
    end.add_argument("--until", type=_moment, metavar="TIME",
                     help="pause until this ISO-8601 time, e.g. 2026-12-06T15:30:00Z (without an offset: this "
                     "machine's local time)")
    held.add_argument("--reason", help="why, shown with the pause by status, lane show and the page")
    back = command("resume", "end a lane's pause now, whatever paused it (a person, RetryLater, the breaker); "
                   "its workers start jobs at once", lane)
    back.add_argument("name", help="the lane to resume")
    return lane


def _work_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """enqueue and worker: what producers and workers run."""
    enq = command("enqueue", "add a job; prints its id")
    enq.add_argument("lane", help="the lane to add the job to")
    enq.add_argument("payload", type=_payload, help="a JSON object or array")
    enq.add_argument("--key", help="idempotency key: the same key returns the same job")
    enq.add_argument("--cost", type=int, default=1, help="what the job's start counts against its lane's rate limit")
    enq.add_argument("--group", help="the tenant the job belongs to (at most 255 characters): the lane's "
                     "--group-slots limits each group, and groups are served in turn")
    enq.add_argument("--priority", type=int, default=0, help="a higher priority starts first (default 0)")
    enq.add_argument("--job-timeout", type=_seconds,
                     help="this job's own call timeout, at most its lane's --job-timeout (default: the lane's)")
    enq.add_argument("--if-full", choices=("error", "skip"), default="error",
                     help="on a full bounded lane: an error, or skip: exit 3, nothing written, no ERROR in the "
                     "server's log")
    enq.add_argument("--wait", action="store_true",
                     help="wait for the job to finish and print its result as JSON (a failed or cancelled job: "
                     "the reason and the next safe action on stderr, exit 1)")
    enq.add_argument("--timeout", type=_seconds,
                     help="with --wait: give up after this long, saying where the job is (exit 4; default: wait "
                     "as long as it takes)")

    w = command("worker", "run a worker: one or more lanes, up to N slots of each, in one process",
                json_flag=False)
    w.add_argument("lanes", nargs="*", type=_lane_slots, metavar="LANE[=N]",
                   help="a lane to serve and how many of its slots this process takes (default 1; a slot it cannot "
                   "take it waits for as a standby); name several and one process serves them all")
    w.add_argument("--lanes-like", metavar="PATTERN",
                   help="also serve every lane whose name matches this SQL LIKE pattern (e.g. 'tenant_%%'), the lanes "
                   "created later included, and let go of each one deleted; a lane named as well is served as named")
    w.add_argument("--slots-each", type=_count, default=1, metavar="N",
                   help="how many slots of each lane found by --lanes-like this process takes (default 1)")
    w.add_argument("--handler", action="append", required=True, metavar="[LANE=]MODULE:CALLABLE",
                   help="a callable taking a pglane.Job, imported from the current directory first (as Celery does), "
                   "then from sys.path: LANE=MODULE:CALLABLE for that lane only, MODULE:CALLABLE for every lane "
                   "without its own (repeatable; the handler sees job.lane)")
    w.add_argument("--sessions", type=_count, default=SESSIONS, metavar="K",
                   help=f"a process with more slots than K (or serving --lanes-like) holds them all on K shared "
                   f"database sessions; with at most K, each slot has its own session (default {SESSIONS})")
    w.add_argument("--poll-interval", type=_seconds, default="5s",
                   help="how often an idle worker looks for work it was not woken for")
    w.add_argument("--max-jobs", type=int, help="exit after this many jobs, of all its lanes together (default: never)")
    w.add_argument("--max-lifetime", type=_seconds, help="exit after this long, each call in progress finished "
                   "(default: never)")
    w.add_argument("--timeout", type=_seconds, help="hard timeout of a call (default: the lane's job timeout + "
                   "a margin inside its lease)")
    w.add_argument("--name", help="worker name recorded on attempts (default: host:pid)")
    w.add_argument("--recover-interval", type=_seconds, default="30s",
                   help="how often the slot holder recovers attempts whose worker is gone")
    w.add_argument("--liveness", type=_seconds, default="10s",
                   help="a lock session silent this long is taken for lost")
    w.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on 127.0.0.1:PORT (0: a free port, logged at start)")
    w.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="text: readable lines (default); json: one JSON object per line, with the lane, job, "
                   "attempt and trace id of the slot that logged it")
    loud = w.add_mutually_exclusive_group()
    loud.add_argument("--quiet", "-q", action="store_true", help="log warnings and errors only")
    loud.add_argument("--verbose", "-v", action="store_true", help="log debugging detail too")


def _operator_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """status, jobs, show, retry, cancel, release-lease, recover, prune, check: what operators run."""
    st = command("status", "one row per lane, with the next safe action")
    st.add_argument("--groups", metavar="LANE", help="instead: LANE's groups, the deepest queue first")
    st.add_argument("--limit", type=int, default=20, help="with --groups: at most this many groups (0: all)")

    js = command("jobs", "list jobs: queued ones first, in service order, then the newest")
    js.add_argument("--lane", help="only this lane's jobs")
    js.add_argument("--status", choices=JOB_STATUSES, help="only jobs with this status")
    js.add_argument("--group", help="only this group's jobs")
    js.add_argument("--limit", type=int, default=50, help="at most this many jobs (0: all)")

    sh = command("show", "one job, its attempts and the next safe action")
    sh.add_argument("job", type=int, help="the job's id")

    for name, text in (("retry", "put a failed or cancelled job back in the queue"),
                       ("cancel", "cancel a queued job")):
        command(name, text).add_argument("job", type=int, help="the job's id")

    rl = command("release-lease", "end a strict lane's wait for the lease of a lost attempt whose worker you "
                 "know is stopped")
    rl.add_argument("attempt", type=int, help="the lost attempt's id")

    rc = command("recover", "mark lost the attempts whose worker is gone")
    rc.add_argument("lane", nargs="?", help="only this lane (default: every lane)")
    rc.add_argument("--terminate-stuck", action="store_true",
                    help="also end the sessions of attempts past their lease, then recover them")

    pr = command("prune", "delete finished jobs (and their attempts) older than a duration")
    pr.add_argument("--older-than", required=True, type=_age,
                    help="finished at least this long ago, with its unit: 7d, 12h, 90m")
    pr.add_argument("--lane", help="only this lane's jobs (default: every lane)")
    pr.add_argument("--batch", type=int, default=5000,
                    help="delete at most this many jobs per transaction; interrupt at will")
    pr.add_argument("--duty", type=_duty, default=0.5,
                    help="the share of its time the prune spends deleting: after each batch it pauses so that "
                    "the workers beside it keep the rest of the server's CPU (1 never pauses)")
    pr.add_argument("--include-failed", action="store_true",
                    help="also delete failed jobs, whose attempts explain what may have been paid")
    pr.add_argument("--forget-keys", action="store_true",
                    help="also forget the pruned jobs' idempotency keys, which are otherwise remembered for "
                    "their lane's --key-retention: the same key then makes a new job, and pays again")

    ck = command("check", "check that the four timeouts agree for every lane, and the replication risk")
    ck.add_argument("--stop-grace", type=_seconds,
                    help="your process manager's stop grace period (systemd TimeoutStopSec, Kubernetes "
                    "terminationGracePeriodSeconds); default: not checked")
    ck.add_argument("--worker-timeout", type=_seconds,
                    help="the workers' --timeout (default: each lane's job timeout + the default margin)")
    ck.add_argument("--liveness", type=_seconds, default="10s", help="the workers' --liveness")


def _local_commands(command: Callable[..., argparse.ArgumentParser]) -> None:
    """web, demo, server: processes that run on this machine."""
    web = command("web", "the operator's page (needs pglane[web]); read-only unless --allow-actions",
                  json_flag=False)
    web.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    web.add_argument("--port", type=int, default=8080, help="port to listen on (0: a free one, logged)")
    web.add_argument("--allow-actions", action="store_true",
                     help="allow retry, cancel, recover, resuming a paused lane and ending stuck sessions, each "
                     "confirmed with the token from $PGLANE_WEB_TOKEN or --token-file")
    web.add_argument("--token-file", help="a file whose first line is the action token")
    web.add_argument("--root-path", help="the path prefix a reverse proxy serves the page under, e.g. /pglane")
    web.add_argument("--allowed-host", action="append", dest="allowed_host", metavar="NAME[:PORT]",
                     help="a Host header the page answers when bound beyond loopback (repeatable; also "
                     "$PGLANE_WEB_ALLOWED_HOSTS, comma-separated); required there, against DNS rebinding")

    demo = command("demo", "the whole promise in under a minute, on an embedded PostgreSQL", json_flag=False)
    demo.add_argument("--data-dir", help="keep the embedded server's data here (default: a temp dir)")
    srv = command("server", "a local PostgreSQL for development that stays up, migrated (start prints the "
                  "PGLANE_DSN to export: eval \"$(pglane server start)\")", json_flag=False)
    srv.add_argument("server_command", choices=("start", "stop", "status"), help="what to do with it")
    srv.add_argument("--data-dir", help="its data (default: $XDG_DATA_HOME/pglane/server, else "
                     "~/.local/share/pglane/server)")
    srv.add_argument("--port", type=int, help="the TCP port on 127.0.0.1 (start only; default 54329)")


def _duration0(text: str) -> float:
    """A duration that may be zero (a grace or a backoff); a bare number is seconds."""
    try:
        return durations.parse(text, allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        code = _main(args)
        sys.stdout.flush()  # inside the try: a closed pipe is found here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return pipe_closed()


def _main(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigurationError as exc:
        print(f"pglane: {exc}", file=sys.stderr)
        return 2
    except PglaneError as exc:
        print(f"pglane: {exc}", file=sys.stderr)
        return 1
    except psycopg.OperationalError as exc:
        print(f"pglane: the database connection failed ({first_line(exc)}); check --dsn / PGLANE_DSN and the server",
              file=sys.stderr)
        return 1
    except psycopg.Error as exc:  # one line, whatever the database refused
        mapped = translate(exc)
        print(f"pglane: {mapped if mapped is not None else first_line(exc)}", file=sys.stderr)
        return 1
    except UnicodeEncodeError as exc:
        print(f"pglane: an argument is not valid UTF-8 ({exc.reason}); pass names, keys and payloads as UTF-8 text",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.dsn, args.data_dir)
    if args.command == "server":
        from . import devserver

        return devserver.main(args.server_command, args.data_dir, args.port)
    dsn = client.resolve_dsn(args.dsn)
    if args.command == "migrate":
        return _migrate(dsn, args)
    if args.command == "worker":
        return _worker(dsn, args)
    if args.command == "web":
        return _web(dsn, args)
    with client.connect(dsn) as conn:
        try:
            schema.require_current(conn)
            with lockwait.bounded(conn, dsn, args.lock_wait):
                return _command(conn, args)
        except (PermissionDenied, psycopg.errors.InsufficientPrivilege) as exc:
            raise PermissionDenied(_true_grant_hint(conn, args, exc)) from None


# The pglane role each command needs; lane create and delete write pglane.lanes: its owner only.
_ROLE_FOR = {"enqueue": "pglane_producer", "worker": "pglane_worker"}


def _true_grant_hint(conn: Any, args: argparse.Namespace, exc: Exception) -> str:
    """The refusal with a hint that is true for this login: which role to grant, or, when it has that role
    already, that the command needs the schema's owner (the role that ran pglane migrate)."""
    what = first_line(exc).split(":")[0]
    role = _ROLE_FOR.get(args.command, "pglane_operator")
    owner_only = args.command == "lane" and args.lane_command in ("create", "delete")
    row = conn.execute(queries.HAS_ROLE, {"role": role}).fetchone()
    user = conn.execute("SELECT current_user AS u").fetchone()["u"]
    if owner_only or (row is not None and row["member"]):
        return (f"{what}: {user} may not do this{' although it has ' + role if row and row['member'] else ''}; "
                f"run it as the role that owns schema pglane (the one that ran pglane migrate)")
    return f"{what}: {user} needs the role {role} for this; an administrator grants it: GRANT {role} TO {user}"


def _migrate(dsn: str, args: argparse.Namespace) -> int:
    with client.connect(dsn) as conn:  # a clear error for an unreachable database before alembic's
        before = schema.current_revision(conn)
    schema.upgrade(dsn)
    head = schema.head()
    if args.json:
        print(to_json({"revision": head, "previous": before, "changed": before != head}))
    elif before == head:
        print(f"pglane schema at revision {head}: already current, nothing to do")
    else:
        print(f"pglane schema at revision {head} ({'created' if before is None else f'upgraded from {before}'})")
    return 0


def _web(dsn: str, args: argparse.Namespace) -> int:
    try:  # the extra's libraries are imported only here: every other command works without them
        from .web import server
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in ("starlette", "jinja2", "uvicorn", "multipart", "python_multipart"):
            raise
        raise ConfigurationError(f"pglane web needs its extra ({missing} is missing): pip install 'pglane[web]'"
                                 ) from None
    with client.connect(dsn) as conn:
        schema.require_current(conn)
    return server.main(dsn, args)


def _worker(dsn: str, args: argparse.Namespace) -> int:
    from . import handler
    from .worker import Worker, WorkerOptions, plan

    if args.slots_each != 1 and args.lanes_like is None:
        raise ConfigurationError("--slots-each is the slot count of the lanes --lanes-like finds; give --lanes-like "
                                 "PATTERN, or name each lane as LANE=N")
    lanes: dict[str, int] = {}
    for name, slots in args.lanes:
        if name in lanes:
            raise ConfigurationError(f"lane {name} is named twice; name it once, with its slots: {name}=N")
        lanes[name] = slots
    default, specs = _handler_specs(args.handler)
    # every lane has a handler, every handler a lane: before anything is imported
    plan(lanes, default, specs, args.lanes_like, args.slots_each)
    logs.configure(logging.INFO if args.verbose else logging.WARNING, args.log_format)
    pglane_level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    logging.getLogger("pglane").setLevel(pglane_level)  # libraries log warnings only, unless --verbose
    options = WorkerOptions(poll_interval=args.poll_interval, max_jobs=args.max_jobs,
                            max_lifetime=args.max_lifetime, timeout=args.timeout, name=args.name,
                            liveness=args.liveness, sessions=args.sessions,
                            recover_interval=args.recover_interval, metrics_port=args.metrics_port)
    with client.connect(dsn) as conn:
        schema.require_current(conn)
    handler.search_cwd()
    loaded = {spec: handler.load(spec) for spec in {*specs.values(), *([default] if default else [])}}
    return Worker(dsn, options=options, lanes=lanes, handler=loaded[default] if default else None,
                  handlers={lane: loaded[spec] for lane, spec in specs.items()}, lanes_like=args.lanes_like,
                  slots_each=args.slots_each).run()


def _handler_specs(given: list[str]) -> tuple[str | None, dict[str, str]]:
    """worker's --handler [LANE=]MODULE:CALLABLE, repeated: the one for every lane without its own (or
    None), and each lane's own. A module path holds no '=', so the first '=' before any ':' names a lane."""
    default: str | None = None
    specs: dict[str, str] = {}
    for text in given:
        lane, sep, spec = text.partition("=")
        if not sep or ":" in lane:
            if default is not None:
                raise ConfigurationError(f"two handlers for every lane ({default} and {text}); give one, and "
                                         "LANE=MODULE:CALLABLE for a lane that needs another")
            default = text
        elif lane in specs:
            raise ConfigurationError(f"two handlers for lane {lane} ({specs[lane]} and {spec}); give one")
        else:
            specs[lane] = spec
    return default, specs


def _command(conn: Any, args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "lane":
        run = {"create": cli_lanes.create, "set": cli_lanes.change, "list": cli_lanes.listing,
               "show": cli_lanes.show, "delete": cli_lanes.delete, "pause": cli_lanes.pause,
               "resume": cli_lanes.resume}[args.lane_command]
        return run(conn, args)
    if cmd == "enqueue":
        return _enqueue(conn, args)
    if cmd == "status" and args.groups is not None:
        rows = client.group_status(conn, args.groups, args.limit or None)
        print(to_json(rows) if args.json else table(rows, (
            "group_key", "queued", "running", "oldest_wait", "served_last")) if rows else
            f"lane {args.groups} has no queued or running jobs")
    elif cmd == "status":
        rows = client.lane_status(conn)
        shown = [{**r, "lane": f"{r['lane']} PAUSED" if r["paused"] else r["lane"]} for r in rows]
        print(to_json(rows) if args.json else table(shown, (
            "lane", "slots", "consumers", "queued", "running", "done", "failed", "cancelled",
            "oldest_queued_age", "next_safe_action")) if rows else "no lanes yet: pglane lane create NAME")
    elif cmd == "jobs":
        limit = args.limit or None  # 0: every job
        if args.json:  # streamed: a row is written as it comes, the listing is never held whole
            json_stream(client.iter_jobs(conn, lane=args.lane, status=args.status, limit=limit, group=args.group))
        else:
            rows = client.jobs(conn, lane=args.lane, status=args.status, limit=limit, group=args.group)
            print(table(rows, ("job_id", "lane", "status", "created_at", "queue_position", "attempts",
                               "next_safe_action")))
    elif cmd == "show":
        _show(conn, args)
    elif cmd in ("retry", "cancel"):
        done = client.retry(conn, args.job) if cmd == "retry" else client.cancel(conn, args.job)
        print(to_json({"job_id": args.job, cmd: done}) if args.json else f"job {args.job}: {cmd} done")
    elif cmd == "prune":
        return _prune(conn, args)
    elif cmd == "recover":
        return _recover(conn, args)
    elif cmd == "release-lease":
        client.release_lease(conn, args.attempt)
        print(to_json({"attempt_id": args.attempt, "lease_released": True}) if args.json else
              f"attempt {args.attempt}: the lane no longer waits for its lease")
    elif cmd == "check":
        return _check(conn, args)
    return 0


def _enqueue(conn: Any, args: argparse.Namespace) -> int:
    if args.timeout is not None and not args.wait:
        raise ConfigurationError("--timeout is how long --wait waits: add --wait, or drop --timeout")
    try:
        job = client.enqueue(conn, args.lane, args.payload, key=args.key, if_full=args.if_full, cost=args.cost,
                             group=args.group, priority=args.priority, job_timeout=args.job_timeout)
    except JobPruned as exc:  # the request was served once: never paid for again by a repeated key
        if args.json:
            print(to_json({"job_id": exc.job_id, "pruned": True}))
        print(f"pglane: {exc}", file=sys.stderr)
        return EXIT_PRUNED
    if job is None:
        if args.json:
            print(to_json({"job_id": None, "skipped": "lane full"}))
        print(f"pglane: lane {args.lane} is full: nothing was enqueued; try again later", file=sys.stderr)
        return EXIT_FULL
    if not args.wait:
        print(to_json({"job_id": job}) if args.json else job)
        return 0
    try:
        result = client.wait(conn, job, args.timeout)
    except WaitTimeout as exc:
        print(f"pglane: {exc}", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    print(to_json({"job_id": job, "result": result}) if args.json else json.dumps(result))
    return 0


def _show(conn: Any, args: argparse.Namespace) -> None:
    job = client.job_status(conn, args.job)
    job["result"] = client.result(conn, args.job)
    job["attempt_rows"] = client.attempts(conn, args.job)
    if args.json:
        print(to_json(job))
        return
    for key in ("job_id", "lane", "status", "created_at", "started_at", "finished_at", "attempts",
                "seq", "idempotency_key", "queue_position", "waiting_for_worker", "result", "last_error"):
        value = job.get(key)
        text = "-" if value is None else json.dumps(value) if key == "result" else str(value)
        print(f"{key:>18}: {text}")
    print()
    print(table(job["attempt_rows"], ("id", "attempt_number", "status", "worker", "backend_pid",
                                      "backend_start", "started_at", "finished_at", "error")))
    print(f"\nnext safe action: {job['next_safe_action']}")


def _prune(conn: Any, args: argparse.Namespace) -> int:
    """Prune in batches, showing progress on stderr: a bar with rate and ETA on a terminal, a plain
    line per 10 % elsewhere."""
    if args.batch < 1:
        raise ConfigurationError("--batch must be at least 1")
    total = client.prunable(conn, args.older_than, lane=args.lane, include_failed=args.include_failed)
    started, shown = time.monotonic(), -1
    batch_began, busy = started, 0.0

    def progress(done: int) -> None:
        nonlocal shown, batch_began, busy
        took = time.monotonic() - batch_began
        busy += took
        if args.duty < 1.0:  # pause after each batch in proportion to it: deleting takes args.duty of the time
            time.sleep(took * (1.0 / args.duty - 1.0))
        batch_began = time.monotonic()
        elapsed = max(time.monotonic() - started, 1e-6)
        rate = done / elapsed
        share = min(done / total, 1.0) if total else 1.0
        eta = (total - done) / rate if rate > 0 and total > done else 0.0
        if sys.stderr.isatty():
            bar = "#" * int(share * 30)
            print(f"\rpruning [{bar:<30}] {done}/{total} jobs, {rate:,.0f}/s, ETA {eta:.0f}s", end="",
                  file=sys.stderr, flush=True)
        elif int(share * 10) > shown:
            shown = int(share * 10)
            print(f"pruned {done} of {total} jobs ({share:.0%}), {rate:,.0f}/s, ETA {eta:.0f}s", file=sys.stderr)

    deleted = client.prune(conn, args.older_than, lane=args.lane, include_failed=args.include_failed,
                           batch=args.batch, progress=progress, forget_keys=args.forget_keys)
    if sys.stderr.isatty() and deleted:
        print(file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"pruned {deleted} jobs in {elapsed:.2f}s, deleting for {busy:.2f}s of it (--duty {args.duty:g})",
          file=sys.stderr)
    age = durations.format_seconds(args.older_than)
    print(to_json({"pruned": deleted, "older_than_seconds": args.older_than, "seconds": round(elapsed, 3),
                   "deleting_seconds": round(busy, 3)}) if args.json else
          f"pruned {deleted} finished job(s) older than {age}, with their attempts; "
          + ("their idempotency keys are forgotten: the same key makes a new job" if args.forget_keys else
             "their idempotency keys are remembered for each lane's --key-retention (a repeated key is refused"
             " with the pruned job's id)"))
    return 0


def _recover(conn: Any, args: argparse.Namespace) -> int:
    terminated = 0
    if args.terminate_stuck:
        terminated = client.terminate_stuck(conn, args.lane)
    marked = client.recover(conn, args.lane)
    stuck = client.stuck_attempts(conn, args.lane)
    if args.json:
        print(to_json({"marked_lost": marked, "sessions_ended": terminated, "stuck": stuck}))
        return 0
    where = f" of lane {args.lane}" if args.lane else ""
    print(f"marked {marked} attempt(s){where} lost: their worker was gone" if marked else
          f"nothing to recover{where}: every running attempt's worker is connected")
    if terminated:
        print(f"ended {terminated} stuck session(s)", file=sys.stderr)
    for row in stuck:
        print(f"stuck: attempt {row['attempt_id']} of job {row['job_id']} (lane {row['lane']}, worker "
              f"{row['worker']}, server session pid {row['backend_pid']}) is past its lease and its worker is still "
              f"connected; end it with: pglane recover {row['lane']} --terminate-stuck", file=sys.stderr)
    return 0


def _check(conn: Any, args: argparse.Namespace) -> int:
    broken = 0
    report: list[dict[str, Any]] = []
    lines: list[str] = []
    for lane in client.lanes(conn):
        worker = args.worker_timeout or timing.default_worker_timeout(lane["job_timeout"], lane["lease_timeout"])
        rules = timing.Timeouts(job=lane["job_timeout"], lease=lane["lease_timeout"], worker=worker,
                                stop_grace=args.stop_grace,
                                liveness=args.liveness if lane["takeover"] == "after_lease" else None)
        problems = rules.violations()
        notes = []
        if problems:
            broken += 1
            lines += [f"lane {lane['name']}: {problem}" for problem in problems]
        else:
            grace = "" if args.stop_grace is None else f", stop grace {args.stop_grace:g}s"
            lines.append(f"lane {lane['name']}: ok (job {lane['job_timeout']:g}s <= worker {worker:g}s < lease "
                         f"{lane['lease_timeout']:g}s{grace})")
        if args.stop_grace is None:  # owned by the process manager: pglane cannot read it
            notes.append(f"R3 not checked: give --stop-grace S, your process manager's stop grace period (systemd "
                         f"TimeoutStopSec, Kubernetes terminationGracePeriodSeconds); it must be at least {worker:g}s, "
                         f"the worker timeout, or a deploy can cut a call off")
            lines.append(f"lane {lane['name']}: {notes[-1]}")
        report.append({"lane": lane["name"], "ok": not problems, "problems": problems, "notes": notes,
                       "job_timeout": lane["job_timeout"], "worker_timeout": worker,
                       "lease_timeout": lane["lease_timeout"], "stop_grace": args.stop_grace})
    replicas = []
    for finding in replication.findings(conn):  # a standby promoted without acknowledged claims pays twice
        broken += finding.risk
        replicas.append({"risk": bool(finding.risk), "text": finding.text})
        lines.append(f"replication: {'RISK: ' if finding.risk else ''}{finding.text}")
    rights = []
    for found in privileges.findings(conn):  # what this role lacks, if anything (never a failure of check)
        rights.append({"missing": found.missing, "text": found.text})
        lines.append(f"privileges: {'MISSING: ' if found.missing else ''}{found.text}")
    if args.json:
        print(to_json({"ok": not broken, "lanes": report, "replication": replicas, "privileges": rights}))
    elif lines:
        print("\n".join(lines))
    return 1 if broken else 0
