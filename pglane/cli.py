"""The command line (DESIGN §7). It uses only the public API; every PglaneError becomes one line on
stderr that says what was wrong and what to do, with exit status 1 (2 for usage and settings)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import psycopg

from . import client, replication, schema, timing
from .errors import ConfigurationError, PglaneError, WaitTimeout, first_line, translate
from .job import JOB_STATUSES

EXIT_FULL = 3  # enqueue --if-full skip met a full lane: nothing was written
EXIT_WAIT_TIMEOUT = 4  # enqueue --wait --timeout S: the job had not finished (it goes on)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, timedelta):
            return f"{value.total_seconds():.1f}s"
        text = str(value)
        return text if len(text) <= 100 else text[:97] + "..."

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(line.rstrip() for line in lines)


def _json(value: Any) -> str:
    return json.dumps(value, default=str, indent=2)


def _json_stream(rows: Iterable[dict[str, Any]]) -> None:
    """print(_json(list(rows))), written one row at a time: the same text, without the list."""
    out = sys.stdout
    first = True
    for row in rows:
        out.write("[\n  " if first else ",\n  ")
        out.write(_json(row).replace("\n", "\n  "))
        first = False
    out.write("[]\n" if first else "\n]\n")
    out.flush()


RATE_HELP = ("at most N starts (or N units of --cost) in any window of PERIOD, cluster-wide: 5/s, 60/min, "
             "1000/h, 100/10min")


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
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def _duration(text: str) -> float:
    try:
        return timing.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _payload(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"payload is not valid JSON ({exc.msg} at column {exc.colno}); quote it, e.g. '{{\"q\": 1}}'"
        ) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pglane", description="A PostgreSQL job queue for scarce, expensive work.")
    dsn_help = "libpq DSN or URI of the database (default: $PGLANE_DSN)"
    p.add_argument("--dsn", help=dsn_help)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("migrate", help="create or upgrade pglane's schema")

    lane = sub.add_parser("lane", help="manage lanes").add_subparsers(dest="lane_command", required=True)
    create = lane.add_parser("create", help="create a lane")
    create.add_argument("name")
    create.add_argument("--slots", type=int, default=1)
    create.add_argument("--job-timeout", type=_seconds, default=timing.DEFAULT_JOB_TIMEOUT)
    create.add_argument("--lease-timeout", type=_seconds, help="default: 10%% longer than --job-timeout")
    create.add_argument("--max-attempts", type=int, default=1)
    create.add_argument("--max-queued", type=int)
    create.add_argument("--takeover", choices=("immediate", "after-lease"), default="immediate",
                        help="after-lease: a slot freed by a lost session takes no job until that attempt's "
                        "lease ends, so no two calls ever overlap (default: immediate)")
    create.add_argument("--max-result-bytes", type=int, default=16 * 1024 * 1024,
                        help="a handler's result larger than this fails its attempt (default 16 MiB)")
    create.add_argument("--rate", help=RATE_HELP)
    change = lane.add_parser("set", help="change a lane while its workers run (each setting from its next use)")
    change.add_argument("name")
    change.add_argument("--slots", type=int)
    change.add_argument("--job-timeout", type=_seconds)
    change.add_argument("--lease-timeout", type=_seconds)
    change.add_argument("--max-attempts", type=int)
    change.add_argument("--max-queued", type=_count_or_none, default=argparse.SUPPRESS,
                        help="N, or none for an unbounded lane")
    change.add_argument("--rate", help=RATE_HELP + "; none removes it")
    change.add_argument("--takeover", choices=("immediate", "after-lease"))
    change.add_argument("--max-result-bytes", type=int)

    enq = sub.add_parser("enqueue", help="add a job; prints its id")
    enq.add_argument("lane")
    enq.add_argument("payload", type=_payload, help="a JSON object or array")
    enq.add_argument("--key", help="idempotency key: the same key returns the same job")
    enq.add_argument("--cost", type=int, default=1,
                     help="what the job's start counts against its lane's rate limit (default 1)")
    enq.add_argument("--if-full", choices=("error", "skip"), default="error",
                     help="on a full bounded lane: an error (default), or skip: exit 3, nothing written, "
                     "no ERROR in the server's log")
    enq.add_argument("--wait", action="store_true",
                     help="wait for the job to finish and print its result as JSON (a failed or cancelled job: "
                     "the reason and the next safe action on stderr, exit 1)")
    enq.add_argument("--timeout", type=_seconds,
                     help="with --wait: give up after this many seconds, saying where the job is (exit 4)")

    w = sub.add_parser("worker", help="run a worker for one lane")
    w.add_argument("lane")
    w.add_argument("--handler", required=True, help="MODULE:CALLABLE taking a pglane.Job")
    w.add_argument("--poll-interval", type=_seconds, default=5.0)
    w.add_argument("--max-jobs", type=int)
    w.add_argument("--max-lifetime", type=_seconds)
    w.add_argument("--timeout", type=_seconds, help="hard timeout; default: job_timeout + a margin")
    w.add_argument("--name", help="worker name recorded on attempts (default: host:pid)")
    w.add_argument("--recover-interval", type=_seconds, default=30.0,
                   help="how often the slot holder recovers attempts whose worker is gone (default 30)")
    w.add_argument("--liveness", type=_seconds, default=10.0,
                   help="a lock session silent this long is taken for lost (default 10)")
    w.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on 127.0.0.1:PORT (0: a free port, logged at start)")

    st = sub.add_parser("status", help="one row per lane, with the next safe action")
    st.add_argument("--json", action="store_true")

    js = sub.add_parser("jobs", help="list jobs, newest first")
    js.add_argument("--lane")
    js.add_argument("--status", choices=JOB_STATUSES)
    js.add_argument("--limit", type=int, default=50, help="at most this many jobs (default 50; 0: all)")
    js.add_argument("--json", action="store_true")

    sh = sub.add_parser("show", help="one job, its attempts and the next safe action")
    sh.add_argument("job", type=int)
    sh.add_argument("--json", action="store_true")

    for name, text in (("retry", "put a failed or cancelled job back in the queue"),
                       ("cancel", "cancel a queued job")):
        c = sub.add_parser(name, help=text)
        c.add_argument("job", type=int)
        c.add_argument("--json", action="store_true")

    rl = sub.add_parser("release-lease", help="end a strict lane's wait for the lease of a lost attempt whose "
                        "worker you know is stopped")
    rl.add_argument("attempt", type=int)

    rc = sub.add_parser("recover", help="mark lost the attempts whose worker is gone")
    rc.add_argument("lane", nargs="?")
    rc.add_argument("--terminate-stuck", action="store_true",
                    help="also end the sessions of attempts past their lease, then recover them")

    pr = sub.add_parser("prune", help="delete finished jobs (and their attempts) older than a duration")
    pr.add_argument("--older-than", required=True, type=_duration, help="e.g. 7d, 12h, 90m")
    pr.add_argument("--lane")
    pr.add_argument("--batch", type=int, default=5000,
                    help="delete at most this many jobs per transaction (default 5000); interrupt at will")
    pr.add_argument("--duty", type=_duty, default=0.5,
                    help="the share of its time the prune spends deleting: after each batch it pauses so that "
                    "the workers beside it keep the rest of the server's CPU (default 0.5; 1 never pauses)")
    pr.add_argument("--include-failed", action="store_true",
                    help="also delete failed jobs, whose attempts explain what may have been paid")

    ck = sub.add_parser("check", help="check that the four timeouts agree for every lane")
    ck.add_argument("--stop-grace", type=_seconds)
    ck.add_argument("--worker-timeout", type=_seconds)
    ck.add_argument("--liveness", type=_seconds, default=10.0, help="the workers' --liveness (default 10)")

    web = sub.add_parser("web", help="the operator's page (needs pglane[web]); read-only unless --allow-actions")
    web.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    web.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080; 0: a free one, logged)")
    web.add_argument("--allow-actions", action="store_true",
                     help="allow retry, cancel, recover and ending stuck sessions, each confirmed with the token "
                     "from $PGLANE_WEB_TOKEN or --token-file")
    web.add_argument("--token-file", help="a file whose first line is the action token")
    web.add_argument("--root-path", help="the path prefix a reverse proxy serves the page under, e.g. /pglane")

    demo = sub.add_parser("demo", help="the whole promise in under a minute, on an embedded PostgreSQL")
    demo.add_argument("--data-dir", help="keep the embedded server's data here (default: a temp dir)")
    srv = sub.add_parser("server", help="a local PostgreSQL for development that stays up, migrated (start "
                         "prints the PGLANE_DSN to export: eval \"$(pglane server start)\")")
    srv.add_argument("server_command", choices=("start", "stop", "status"))
    srv.add_argument("--data-dir", help="its data (default: $XDG_DATA_HOME/pglane/server, else "
                     "~/.local/share/pglane/server)")
    srv.add_argument("--port", type=int, help="the TCP port on 127.0.0.1 (start only; default 54329)")
    for command in (*sub.choices.values(), *lane.choices.values()):  # --dsn after the command too; it wins
        command.add_argument("--dsn", default=argparse.SUPPRESS, help=dsn_help)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
        with client.connect(dsn):
            pass  # a clear error for an unreachable database before alembic's traceback
        schema.upgrade(dsn)
        print(f"pglane schema at revision {schema.head()}")
        return 0
    if args.command == "worker":
        return _worker(dsn, args)
    if args.command == "web":
        return _web(dsn, args)
    with client.connect(dsn) as conn:
        schema.require_current(conn)
        return _command(conn, args)


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
    from .worker import Worker, WorkerOptions

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d] %(message)s")
    options = WorkerOptions(poll_interval=args.poll_interval, max_jobs=args.max_jobs,
                            max_lifetime=args.max_lifetime, timeout=args.timeout, name=args.name,
                            liveness=args.liveness,
                            recover_interval=args.recover_interval, metrics_port=args.metrics_port)
    with client.connect(dsn) as conn:
        schema.require_current(conn)
    return Worker(dsn, args.lane, handler.load(args.handler), options).run()


def _command(conn: Any, args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "lane" and args.lane_command == "set":
        print(client.set_lane(conn, args.name, **_lane_changes(args)))
    elif cmd == "lane":
        lane_id = client.create_lane(conn, args.name, slots=args.slots, job_timeout=args.job_timeout,
                                     lease_timeout=args.lease_timeout, max_attempts=args.max_attempts,
                                     max_queued=args.max_queued, max_result_bytes=args.max_result_bytes,
                                     takeover=args.takeover.replace("-", "_"), rate=args.rate)
        print(f"lane {args.name} created (id {lane_id})")
    elif cmd == "enqueue":
        if args.timeout is not None and not args.wait:
            raise ConfigurationError("--timeout is how long --wait waits: add --wait, or drop --timeout")
        job = client.enqueue(conn, args.lane, args.payload, key=args.key, if_full=args.if_full, cost=args.cost)
        if job is None:
            print(f"pglane: lane {args.lane} is full: nothing was enqueued; try again later", file=sys.stderr)
            return EXIT_FULL
        if not args.wait:
            print(job)
            return 0
        try:
            print(json.dumps(client.wait(conn, job, args.timeout)))
        except WaitTimeout as exc:
            print(f"pglane: {exc}", file=sys.stderr)
            return EXIT_WAIT_TIMEOUT
    elif cmd == "status":
        rows = client.lane_status(conn)
        print(_json(rows) if args.json else _table(rows, (
            "lane", "slots", "consumers", "queued", "running", "done", "failed", "cancelled",
            "oldest_queued_age", "next_safe_action")) if rows else "no lanes yet: pglane lane create NAME")
    elif cmd == "jobs":
        limit = args.limit or None  # 0: every job
        if args.json:  # streamed: a row is written as it comes, the listing is never held whole
            _json_stream(client.iter_jobs(conn, lane=args.lane, status=args.status, limit=limit))
        else:
            rows = client.jobs(conn, lane=args.lane, status=args.status, limit=limit)
            print(_table(rows, ("job_id", "lane", "status", "created_at", "queue_position", "attempts",
                                "next_safe_action")))
    elif cmd == "show":
        job = client.job_status(conn, args.job)
        job["result"] = client.result(conn, args.job)
        job["attempt_rows"] = client.attempts(conn, args.job)
        if args.json:
            print(_json(job))
        else:
            for key in ("job_id", "lane", "status", "created_at", "started_at", "finished_at", "attempts",
                        "seq", "idempotency_key", "queue_position", "waiting_for_worker", "result", "last_error"):
                print(f"{key:>18}: {'-' if job.get(key) is None else job[key]}")
            print()
            print(_table(job["attempt_rows"], ("id", "attempt_number", "status", "worker", "backend_pid",
                                               "backend_start", "started_at", "finished_at", "error")))
            print(f"\nnext safe action: {job['next_safe_action']}")
    elif cmd in ("retry", "cancel"):
        done = client.retry(conn, args.job) if cmd == "retry" else client.cancel(conn, args.job)
        print(_json({"job_id": args.job, cmd: done}) if args.json else f"job {args.job}: {cmd} done")
    elif cmd == "prune":
        print(_prune(conn, args))
    elif cmd == "recover":
        return _recover(conn, args)
    elif cmd == "release-lease":
        client.release_lease(conn, args.attempt)
        print(f"attempt {args.attempt}: the lane no longer waits for its lease")
    elif cmd == "check":
        return _check(conn, args)
    return 0


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
                           batch=args.batch, progress=progress)
    if sys.stderr.isatty() and deleted:
        print(file=sys.stderr)
    elapsed = time.monotonic() - started
    print(f"pruned {deleted} jobs in {elapsed:.2f}s, deleting for {busy:.2f}s of it (--duty {args.duty:g})",
          file=sys.stderr)
    return deleted


def _recover(conn: Any, args: argparse.Namespace) -> int:
    terminated = 0
    if args.terminate_stuck:
        terminated = client.terminate_stuck(conn, args.lane)
    marked = client.recover(conn, args.lane)
    stuck = client.stuck_attempts(conn, args.lane)
    print(marked)
    if terminated:
        print(f"ended {terminated} stuck session(s)", file=sys.stderr)
    for row in stuck:
        print(f"stuck: attempt {row['attempt_id']} of job {row['job_id']} (lane {row['lane']}, worker "
              f"{row['worker']}, pid {row['backend_pid']}) is past its lease and its worker is still connected;"
              f" end it with: pglane recover {row['lane']} --terminate-stuck", file=sys.stderr)
    return 0


def _lane_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The settings `lane set` was given (a given 'none' is kept: it removes max_queued or the rate)."""
    changes = {name: getattr(args, name) for name in ("slots", "job_timeout", "lease_timeout", "max_attempts",
                                                      "max_result_bytes")
               if getattr(args, name) is not None}
    if args.takeover is not None:
        changes["takeover"] = args.takeover.replace("-", "_")
    if args.rate is not None:
        changes["rate"] = None if args.rate.strip().lower() == "none" else args.rate
    if hasattr(args, "max_queued"):  # absent unless given; given none, it is None
        changes["max_queued"] = args.max_queued
    if not changes:
        raise ConfigurationError("lane set: give at least one setting to change, e.g. --rate 60/min or --slots 3")
    return changes


def _check(conn: Any, args: argparse.Namespace) -> int:
    broken = 0
    for lane in client.lanes(conn):
        worker = args.worker_timeout or timing.default_worker_timeout(lane["job_timeout"], lane["lease_timeout"])
        rules = timing.Timeouts(job=lane["job_timeout"], lease=lane["lease_timeout"], worker=worker,
                                stop_grace=args.stop_grace,
                                liveness=args.liveness if lane["takeover"] == "after_lease" else None)
        problems = rules.violations()
        if problems:
            broken += 1
            for problem in problems:
                print(f"lane {lane['name']}: {problem}")
        else:
            grace = "" if args.stop_grace is None else f", stop grace {args.stop_grace:g}s"
            print(f"lane {lane['name']}: ok (job {lane['job_timeout']:g}s <= worker {worker:g}s < lease "
                  f"{lane['lease_timeout']:g}s{grace})")
        if args.stop_grace is None:  # owned by the process manager: pglane cannot read it
            print(f"lane {lane['name']}: R3 not checked: give --stop-grace S, your process manager's stop grace "
                  f"period (systemd TimeoutStopSec, Kubernetes terminationGracePeriodSeconds); it must be at "
                  f"least {worker:g}s, the worker timeout, or a deploy can cut a call off")
    for finding in replication.findings(conn):  # a standby promoted without acknowledged claims pays twice
        broken += finding.risk
        print(f"replication: {'RISK: ' if finding.risk else ''}{finding.text}")
    return 1 if broken else 0
