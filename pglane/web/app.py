"""The operator's page as an ASGI application: routes, templates and the database pool.

Reads go through psycopg_pool's AsyncConnectionPool, opened with the application and closed with it;
they use the views and statements the CLI uses (pglane.queries) and the page's own (pglane.web.queries).
Actions (retry, cancel, recover, resume a paused lane, end stuck sessions) run pglane.client's own functions on a
connection of their own in a thread: the same statements, the same waits, the same errors as the CLI.

Invariants (pglane.web.security has the rest): a GET reads only; every value from the database
reaches the page through Jinja2 with autoescape on; a page that is refreshed in place is rendered by
the same template as its fragment (?fragment=1), so reading never needs JavaScript.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, LiteralString
from urllib.parse import parse_qsl

import psycopg
from jinja2 import Environment, FileSystemLoader, pass_context, select_autoescape
from psycopg import errors as pg_errors
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import client, queries
from ..errors import DatabaseUnavailable, PglaneError, first_line
from ..job import JOB_STATUSES
from . import charts
from . import queries as web_queries
from .security import CSRF_COOKIE, Guard, HostCheck, SecurityHeaders

HERE = Path(__file__).resolve().parent
APPLICATION_NAME = "pglane web"
JOBS_SHOWN = 50  # jobs on a page of the jobs list; 'next' shows the following ones
LANES_SHOWN = 50  # lanes on a page of the lanes page
SHOWN_BYTES = 64 * 1024  # a payload, result or error longer than this is cut on the page (pglane show has it all)
# The last hour's charts are read at most this often, whatever the number of open pages: a point is a
# minute, and the read scans pglane.jobs (about 0.8 s behind 1M finished jobs on 2 cores).
HISTORY_TTL = 30.0
POOL_SIZE = 4  # database connections of one page process
POOL_WAIT = 5.0  # seconds a request waits for a connection before the page answers 503
# No query of the page runs longer than this (statement_timeout on every pooled connection): a slow one
# answers 503 and gives its connection back, so one slow page cannot hold the pool for long.
STATEMENT_TIMEOUT = 5.0
MAX_FORM_BYTES = 64 * 1024  # an action's form is a few hundred bytes; a longer body is refused (413)
FORM_TYPE = "application/x-www-form-urlencoded"
LANE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,47}$")
GROUPS_SHOWN = 5  # a lane's busiest groups on its own page (pglane.group_status, deepest queue first)
# Where the queued jobs' sections start (web_queries.JOBS_ELIGIBLE, JOBS_SCHEDULED): before every lane
# name (''), every priority (a job's is an integer) and every time.
FIRST_CURSOR: dict[str, Any] = {"c_lane": "", "c_priority": 2**31 - 1, "c_rank": 0, "c_created": "-infinity",
                                "c_run_after": "-infinity", "c_id": 0}

# What each action costs, said on its confirmation page before anything is done.
ACTIONS: dict[str, dict[str, str]] = {
    "retry": {
        "target": "job", "button": "Retry job {t}",
        "cost": "Retry puts job {t} back in its lane's queue for one more attempt: it makes the paid call again. "
                "If an earlier attempt reached the provider (a lost or timed-out attempt may have), you pay twice.",
    },
    "cancel": {
        "target": "job", "button": "Cancel job {t}",
        "cost": "Cancel takes queued job {t} out of the queue: it will not run, and nothing is paid. "
                "A retry later runs it after all.",
    },
    "recover": {
        "target": "lane", "button": "Recover lane {t}",
        "cost": "Recover marks lost the running attempts of lane {t} whose worker is provably gone. Their jobs "
                "fail, or go back to the queue on a lane that allows more attempts, which makes the paid call "
                "again. A call such a worker started may already have been paid.",
    },
    "resume": {
        "target": "lane", "button": "Resume lane {t}",
        "cost": "Resume ends lane {t}'s pause now, whatever paused it (a person, a handler's RetryLater, the "
                "breaker after failures in a row): its workers start its queued jobs at once, and each start may "
                "be a paid call. If what the pause waited for is not over, they may fail or be refused again.",
    },
    "end-stuck": {
        "target": "lane", "button": "End the stuck sessions of lane {t}",
        "cost": "This ends the database sessions of lane {t}'s workers that run past their lease "
                "(pg_terminate_backend), then recovers their attempts as lost. Their calls may still be running "
                "at the provider and may have been paid; their jobs fail and run again only if you retry them.",
    },
}


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pause_end(value: datetime | None) -> str:
    """lane_status's paused_until of a paused lane: NULL while it is paused until a person resumes it."""
    return "until resumed" if value is None else f"until {_when(value)}"


def _minute(value: datetime | None) -> str:
    return "" if value is None else value.astimezone(UTC).strftime("%H:%M")


def _duration(value: timedelta | float | None) -> str:
    if value is None:
        return "-"
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


def _shown(value: Any) -> str:
    """A JSON value or text as the page shows it: indented, cut past SHOWN_BYTES with a note."""
    text = value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False, default=str)
    if len(text) > SHOWN_BYTES:
        return f"{text[:SHOWN_BYTES]}\n… cut: {len(text) - SHOWN_BYTES} more characters (pglane show has them all)"
    return text


def _templates() -> Jinja2Templates:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters.update(when=_when, minute=_minute, duration=_duration, shown=_shown, pause_end=_pause_end)
    env.globals["url_for"] = _path_for  # before Jinja2Templates, which would set Starlette's absolute one
    return Jinja2Templates(env=env)


@pass_context
def _path_for(context: dict[str, Any], name: str, /, **params: Any) -> str:
    """A route's path under the page's root path, never an absolute URL: behind a reverse proxy the scheme
    and host the browser used are the proxy's, which this process cannot know."""
    request: Request = context["request"]
    return str(request.scope.get("root_path", "")).rstrip("/") + str(request.app.url_path_for(name, **params))


class Page:
    """The routes of one server process, over one pool."""

    def __init__(self, dsn: str, guard: Guard, statement_timeout: float = STATEMENT_TIMEOUT) -> None:
        self.dsn, self.guard, self.statement_timeout = dsn, guard, statement_timeout
        self.templates = _templates()
        # The last hour's charts per page of lanes: {lanes shown: (read at, charts)}: history().
        self._history: dict[tuple[str, ...], tuple[float, dict[str, list[charts.Chart]]]] = {}
        self.pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=POOL_SIZE, open=False, name="pglane-web", configure=self._configure,
            kwargs={"autocommit": True, "prepare_threshold": None,
                    "application_name": APPLICATION_NAME},
        )

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Every pooled connection: no statement of the page's runs past statement_timeout (a SET, not a
        startup option, which some poolers refuse)."""
        await conn.execute("SELECT set_config('statement_timeout', %s, false)",
                           (f"{int(self.statement_timeout * 1000)}ms",))

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A pooled connection, waited for at most POOL_WAIT; the page's 503s say why there was none or
        why its query was cut."""
        try:
            async with self.pool.connection(timeout=POOL_WAIT) as conn:
                with client.translated():
                    yield conn
        except PoolTimeout as exc:
            stats = self.pool.get_stats()
            if stats.get("pool_size", 0) >= POOL_SIZE and not stats.get("pool_available", 0):
                raise HTTPException(503, f"every one of the page's {POOL_SIZE} database connections stayed busy "
                                         f"for {POOL_WAIT:g} s: try again shortly") from exc
            raise
        except pg_errors.QueryCanceled as exc:
            raise HTTPException(503, f"a query of this page ran past its {self.statement_timeout:g} s "
                                     "statement timeout and was cut; try again, or narrow the filter") from exc

    @staticmethod
    async def fetch(conn: psycopg.AsyncConnection[Any], query: LiteralString,
                    params: tuple[Any, ...] | dict[str, Any] | None = None) -> list[dict[str, Any]]:
        async with conn.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(query, params, prepare=False)
            return await cursor.fetchall()

    async def rows(self, query: LiteralString, params: tuple[Any, ...] | dict[str, Any] | None = None
                   ) -> list[dict[str, Any]]:
        async with self.connection() as conn:
            return await self.fetch(conn, query, params)

    def render(self, request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        """The page, or only its refreshed part when asked with ?fragment=1."""
        fragment = request.query_params.get("fragment") == "1"
        base = {"actions": self.guard.actions_allowed, "page": name}
        return self.templates.TemplateResponse(request, f"_{name}.html" if fragment else f"{name}.html",
                                               {**base, **context}, status_code=status)

    async def lanes(self, request: Request) -> Response:
        """One page of lanes (LANES_SHOWN, by name after ?after=, those starting with ?prefix=)."""
        after = _param(request, "after", 48)
        prefix = _param(request, "prefix", 48)
        lanes = await self.rows(web_queries.LANE_PAGE, {"after": after, "prefix": prefix, "limit": LANES_SHOWN + 1})
        more = len(lanes) > LANES_SHOWN
        lanes = lanes[:LANES_SHOWN]
        history = await self.history(tuple(lane["lane"] for lane in lanes))
        return self.render(request, "lanes", {"lanes": lanes, "charts": history, "chart_w": charts.WIDTH,
                                              "chart_h": charts.HEIGHT, "now": datetime.now(UTC),
                                              "after": after, "prefix": prefix,
                                              "next_after": lanes[-1]["lane"] if more else None})

    async def lane(self, request: Request) -> Response:
        """One lane: its state as on the lanes page, and its busiest groups (GROUPS_SHOWN, from
        pglane.group_status) when any of its queued or running jobs has a group. group_status reads the
        lane's queue once (its backlog), so only this page asks for it, for its one lane: the lanes page's
        cost stays its lanes' statuses."""
        name = request.path_params["lane"]
        if not LANE_NAME.match(name):
            raise HTTPException(404, f"no lane {name!r}: lane names are a-z, 0-9, _ and -, starting with a letter")
        async with self.connection() as conn:
            found = await self.fetch(conn, web_queries.LANE_ONE, (name,))
            if not found:
                raise HTTPException(404, f"no lane {name}: list the lanes with: pglane lane list")
            lane = found[0]
            grouped = lane["groups_waiting"] > 1 or bool(
                (await self.fetch(conn, web_queries.LANE_GROUPED, {"lane": name}))[0]["grouped"])
            groups = await self.fetch(conn, queries.GROUP_STATUS, (name, GROUPS_SHOWN)) if grouped else []
        history = await self.history((name,))
        return self.render(request, "lane", {"l": lane, "groups": groups, "charts": history,
                                             "chart_w": charts.WIDTH, "chart_h": charts.HEIGHT,
                                             "now": datetime.now(UTC)})

    async def history(self, lanes: tuple[str, ...]) -> dict[str, list[charts.Chart]]:
        """The last hour of the lanes shown, read at most every HISTORY_TTL seconds per page of lanes."""
        now = time.monotonic()
        for shown in [k for k, (at, _) in self._history.items() if now - at > HISTORY_TTL]:
            del self._history[shown]
        if lanes not in self._history:
            if len(self._history) >= 64:  # many pages read at once: forget the oldest
                del self._history[min(self._history, key=lambda k: self._history[k][0])]
            try:
                rows = await self.rows(web_queries.LAST_HOUR, {"lanes": list(lanes)}) if lanes else []
            except HTTPException as exc:  # cut by the statement timeout: the page goes without its charts
                if exc.status_code != 503:
                    raise
                rows = []
            self._history[lanes] = (now, charts.lane_charts(rows))
        return self._history[lanes][1]

    async def jobs(self, request: Request) -> Response:
        """One page of jobs (JOBS_SHOWN): queued ones first, then the rest newest first (web_queries'
        JOBS_* say the order); ?after=ID continues the queued ones after job ID, ?before=ID the rest."""
        params = request.query_params
        lane, status, key = (_param(request, name, 255) or None for name in ("lane", "status", "key"))
        if status is not None and status not in JOB_STATUSES:
            raise HTTPException(400, f"unknown status {status!r}: use one of {', '.join(JOB_STATUSES)}")
        after, before = (_job_id(params.get(name)) for name in ("after", "before"))
        async with self.connection() as conn, conn.transaction():
            # One snapshot and one now() for the page's reads: the positions agree with the rows.
            await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            found = await self._job_ids(conn, lane, status, key, after, before)
            shown = found[:JOBS_SHOWN]
            details = {r["job_id"]: r for r in await self.fetch(conn, web_queries.JOB_ROWS,
                                                                ([job for job, _, _ in shown],))}
            firsts: dict[str, int] = {}
            for job, job_lane, queued in shown:
                if queued:
                    firsts.setdefault(job_lane, job)
            positions = {r["job_id"]: r["queue_position"] for r in await self.fetch(
                conn, web_queries.JOB_POSITIONS, (list(firsts.values()),))} if firsts else {}
        rows: list[dict[str, Any]] = []
        index: dict[str, int] = {}
        for job, job_lane, queued in shown:
            row = details.get(job)
            if row is None:  # pruned meanwhile
                continue
            row["queue_position"] = None
            if queued:  # the lane's shown queued jobs follow each other in its queue
                index[job_lane] = index.get(job_lane, -1) + 1
                start = positions.get(firsts[job_lane])
                if start is not None and row["status"] == "queued":
                    row["queue_position"] = start + index[job_lane]
            rows.append(row)
        nxt: dict[str, str] | None = None
        if len(found) > JOBS_SHOWN and shown:
            last, _, queued = shown[-1]
            nxt = {k: v for k, v in (("lane", lane), ("status", status), ("key", key)) if v}
            nxt["after" if queued and key is None else "before"] = str(last)
        return self.render(request, "jobs", {
            "jobs": rows, "statuses": JOB_STATUSES, "limit": JOBS_SHOWN, "next": nxt,
            "first_page": after is None and before is None,
            "filter": {"lane": lane or "", "status": status or "", "key": key or ""},
            "now": datetime.now(UTC)})

    async def _job_ids(self, conn: psycopg.AsyncConnection[Any], lane: str | None, status: str | None,
                       key: str | None, after: int | None, before: int | None) -> list[tuple[int, str, bool]]:
        """Up to JOBS_SHOWN + 1 jobs of the page, in its order: (id, lane, read from the queue)."""
        want = JOBS_SHOWN + 1
        top = 2**63 - 1
        if key is not None:
            rows = await self.fetch(conn, web_queries.JOBS_KEYED, {
                "key": key, "lane": lane, "status": status, "before": before or top, "limit": want})
            return [(r["id"], r["lane"], False) for r in rows]
        found: list[tuple[int, str, bool]] = []
        if status in (None, "queued") and before is None:
            cursor = FIRST_CURSOR
            scheduled = False
            if after is not None:
                at = await self.fetch(conn, web_queries.JOB_CURSOR, (after,))
                if at:  # a job that left the queue keeps its place as a cursor
                    scheduled = bool(at[0]["scheduled"])
                    cursor = {"c_lane": at[0]["lane"], "c_priority": at[0]["priority"], "c_rank": at[0]["fair_rank"],
                              "c_created": at[0]["created_at"], "c_run_after": at[0]["run_after"], "c_id": after}
            if not scheduled:
                rows = await self.fetch(conn, web_queries.JOBS_ELIGIBLE, {"lane": lane, "limit": want, **cursor})
                found += [(r["id"], r["lane"], True) for r in rows]
                cursor = FIRST_CURSOR
            if len(found) < want:
                rows = await self.fetch(conn, web_queries.JOBS_SCHEDULED,
                                        {"lane": lane, "limit": want - len(found), **cursor})
                found += [(r["id"], r["lane"], True) for r in rows]
        if status != "queued" and len(found) < want:
            rows = await self.fetch(conn, web_queries.JOBS_SETTLED, {
                "lane": lane, "status": status, "before": before or top, "limit": want - len(found),
                "settled": status in ("failed", "cancelled"), "running": status == "running"})
            found += [(r["id"], r["lane"], False) for r in rows]
        return found

    async def job(self, request: Request) -> Response:
        job_id = int(request.path_params["job_id"])
        found = await self.rows(queries.JOB_STATUS, (job_id,))
        if not found:
            raise HTTPException(404, f"no job {job_id}: it never existed, or it was pruned")
        attempts = await self.rows(queries.ATTEMPTS, (job_id,))
        payload = await self.rows(web_queries.JOB_PAYLOAD, (job_id,))
        return self.render(request, "job", {"job": found[0], "attempts": attempts,
                                            "payload": payload[0]["payload"] if payload else None,
                                            "now": datetime.now(UTC)})

    def _target(self, action: str, value: str | None) -> str:
        """The action's target as text (a job id or a lane name); 400 for anything else."""
        if action not in ACTIONS:
            raise HTTPException(404, f"no action {action!r}: retry, cancel, recover, resume and end-stuck exist")
        kind = ACTIONS[action]["target"]
        value = (value or "").strip()
        if kind == "job" and value.isdigit() and len(value) <= 18:
            return str(int(value))
        if kind == "lane" and LANE_NAME.match(value):
            return value
        raise HTTPException(400, f"{action} needs a {kind} ({'a job id' if kind == 'job' else 'a lane name'})")

    async def confirm(self, request: Request) -> Response:
        """GET: says what the action costs and asks for the token. Changes nothing."""
        action = request.path_params["action"]
        target = self._target(action, request.query_params.get(ACTIONS.get(action, {}).get("target", "job")))
        if not self.guard.actions_allowed:
            raise HTTPException(403, "this page is read-only: start it with --allow-actions and a token")
        job = lane = None
        if ACTIONS[action]["target"] == "job":
            found = await self.rows(queries.JOB_STATUS, (int(target),))
            if not found:
                raise HTTPException(404, f"no job {target}: it never existed, or it was pruned")
            job = found[0]
        elif action == "resume":  # what is resumed: the pause, its end and why
            found = await self.rows(web_queries.LANE_ONE, (target,))
            if not found:
                raise HTTPException(404, f"no lane {target}: list the lanes with: pglane lane list")
            lane = found[0]
        cookie = request.cookies.get(CSRF_COOKIE) or self.guard.new_cookie()
        spec = ACTIONS[action]
        response = self.templates.TemplateResponse(request, "confirm.html", {
            "actions": True, "page": "confirm", "action": action, "target": target, "kind": spec["target"],
            "cost": spec["cost"].format(t=target), "button": spec["button"].format(t=target), "job": job,
            "lane": lane, "csrf": self.guard.csrf_field(cookie, action, target)})
        if request.cookies.get(CSRF_COOKIE) != cookie:
            response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict", path="/")
        return response

    async def act(self, request: Request) -> Response:
        """POST: the action, once the guard lets it through; 403 and nothing done otherwise. Every refusal
        that needs no form comes before a byte of the body is read: a read-only page (403), a body that
        is not a small urlencoded form (415, 413); the form itself is read into memory up to
        MAX_FORM_BYTES, never spooled to disk."""
        action = request.path_params["action"]
        if not self.guard.actions_allowed:  # before anything else: a read-only page says so, whatever was sent
            raise HTTPException(403, "this page is read-only: start it with --allow-actions and a token")
        form = await _small_form(request)

        def field(name: str) -> str | None:
            return form.get(name)

        kind = ACTIONS.get(action, {}).get("target", "job")
        target = self._target(action, field(kind))
        refusal = self.guard.refusal(cookie=request.cookies.get(CSRF_COOKIE), csrf=field("csrf"),
                                     token=field("token"), action=action, target=target)
        if refusal is not None:
            raise HTTPException(403, refusal)
        try:
            said = await asyncio.to_thread(_run_action, self.dsn, action, target)
        except DatabaseUnavailable as exc:
            raise HTTPException(503, str(exc)) from None
        except PglaneError as exc:
            return self.templates.TemplateResponse(request, "outcome.html", {
                "actions": True, "page": "outcome", "ok": False, "message": str(exc), "action": action,
                "target": target, "kind": kind}, status_code=409)
        return self.templates.TemplateResponse(request, "outcome.html", {
            "actions": True, "page": "outcome", "ok": True, "message": said, "action": action, "target": target,
            "kind": kind})

    async def error(self, request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            status, message = exc.status_code, str(exc.detail)
        elif isinstance(exc, pg_errors.QueryCanceled):
            status, message = 503, f"a query of this page ran past its statement timeout ({first_line(exc)})"
        elif isinstance(exc, PoolTimeout | psycopg.OperationalError):
            status, message = 503, f"cannot reach the database ({first_line(exc)}); check the server and --dsn"
        else:
            status, message = 500, first_line(exc)
        return self.templates.TemplateResponse(request, "error.html", {
            "actions": self.guard.actions_allowed, "page": "error", "status": status, "message": message},
            status_code=status)


def _param(request: Request, name: str, longest: int) -> str:
    """A query parameter as text ('' when absent); 400 when longer than ``longest``."""
    value = request.query_params.get(name) or ""
    if len(value) > longest:
        raise HTTPException(400, f"?{name}= takes at most {longest} characters")
    return value


def _job_id(value: str | None) -> int | None:
    """A job id cursor (?after=, ?before=), or None; 400 for anything else."""
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 18):
        raise HTTPException(400, "?after= and ?before= take a job id")
    return int(value)


async def _small_form(request: Request) -> dict[str, str]:
    """The urlencoded form of a POST, refused before its body is read when its type or declared length
    is wrong, and cut off at MAX_FORM_BYTES when it runs longer than it said (or said nothing)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != FORM_TYPE:
        raise HTTPException(415, f"an action is a form posted as {FORM_TYPE}, not {media or 'no content type'}")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_FORM_BYTES):
        raise HTTPException(413, f"an action's form is at most {MAX_FORM_BYTES // 1024} KiB")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise HTTPException(413, f"an action's form is at most {MAX_FORM_BYTES // 1024} KiB")
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=32))
    except (UnicodeDecodeError, ValueError):
        raise HTTPException(400, "the form is not UTF-8 urlencoded text") from None


class CancelOnDisconnect:
    """ASGI middleware: a GET whose client goes away is cancelled, and with it its query (psycopg sends
    the server a cancel when the task awaiting it is cancelled), so a closed tab or a client's timeout
    gives the connection back instead of leaving a query running for no one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        first = await receive()  # a GET's (empty) body
        if first["type"] != "http.request" or first.get("more_body"):
            await self.app(scope, _replay(first, receive), send)
            return
        gone = asyncio.Event()

        async def app_receive() -> Message:
            await gone.wait()
            return {"type": "http.disconnect"}

        served = asyncio.ensure_future(self.app(scope, _replay(first, app_receive), send))
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({served, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not served.done():  # the client went away first (or this task is cancelled)
                gone.set()
                served.cancel()
            watch.cancel()
            with suppress(asyncio.CancelledError):
                await watch
        with suppress(asyncio.CancelledError):
            await served
        if not served.cancelled() and served.exception() is not None:
            raise served.exception()  # type: ignore[misc]


def _replay(first: Message, receive: Receive) -> Receive:
    """``receive`` that gives ``first`` once, then what ``receive`` gives."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return replayed


def _run_action(dsn: str, action: str, target: str) -> str:
    """One action through pglane.client, on a connection of its own; what happened, in one line."""
    with client.connect(dsn, application_name=APPLICATION_NAME) as conn:
        if action == "retry":
            client.retry(conn, int(target))
            return f"job {target} is queued again: a worker will make its call once more"
        if action == "cancel":
            client.cancel(conn, int(target))
            return f"job {target} is cancelled: it will not run"
        if action == "resume":
            return client.resume_lane(conn, target)
        ended = client.terminate_stuck(conn, target) if action == "end-stuck" else 0
        marked = client.recover(conn, target)
        stuck = len(client.stuck_attempts(conn, target))
        said = f"lane {target}: {marked} attempt(s) marked lost"
        if action == "end-stuck":
            said = f"lane {target}: ended {ended} stuck session(s); {marked} attempt(s) marked lost"
        return said + (f"; {stuck} attempt(s) still stuck past their lease" if stuck else "")


def create_app(dsn: str, *, token: str | None = None, allowed_hosts: Sequence[str] | None = None,
               statement_timeout: float = STATEMENT_TIMEOUT) -> Starlette:
    """The page for the database at ``dsn``: read-only unless ``token`` is given (pglane.web.security's
    check_token decides whether actions may be allowed). ``allowed_hosts``: the Host headers answered,
    each NAME or NAME:PORT (others get 400, so that a site rebinding its DNS name to this address cannot
    read the page; see HostCheck); None: any. ``statement_timeout``: seconds any query may run."""
    page = Page(dsn, Guard(token), statement_timeout)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await page.pool.open(wait=False)
        try:
            yield
        finally:
            await page.pool.close()

    handler: Callable[[Request, Exception], Any] = page.error
    app = Starlette(
        routes=[
            Route("/", page.lanes, name="lanes"),
            Route("/lanes/{lane}", page.lane, name="lane"),
            Route("/jobs", page.jobs, name="jobs"),
            Route("/jobs/{job_id:int}", page.job, name="job"),
            Route("/confirm/{action}", page.confirm, name="confirm"),
            Route("/actions/{action}", page.act, methods=["POST"], name="act"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        middleware=[Middleware(SecurityHeaders), Middleware(HostCheck, allowed=allowed_hosts),
                    Middleware(CancelOnDisconnect)],
        exception_handlers={HTTPException: handler, PoolTimeout: handler, psycopg.OperationalError: handler,
                            PglaneError: handler},
        lifespan=lifespan,
    )
    app.state.page = page
    return app

