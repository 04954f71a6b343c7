"""The operator's page as an ASGI application: routes, templates and the database pool.

Reads go through psycopg_pool's AsyncConnectionPool, opened with the application and closed with it;
they use the views and statements the CLI uses (pglane.queries) and the page's own (pglane.web.queries).
Actions (retry, cancel, recover, end stuck sessions) run pglane.client's own functions on a
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
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from jinja2 import Environment, FileSystemLoader, pass_context, select_autoescape
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from .. import client, queries
from ..errors import DatabaseUnavailable, PglaneError, first_line
from ..job import JOB_STATUSES
from . import charts
from . import queries as web_queries
from .security import CSRF_COOKIE, Guard, SecurityHeaders

HERE = Path(__file__).resolve().parent
APPLICATION_NAME = "pglane web"
JOBS_SHOWN = 100  # rows on the jobs page; the filter narrows it
SHOWN_BYTES = 64 * 1024  # a payload, result or error longer than this is cut on the page (pglane show has it all)
# The last hour's charts are read at most this often, whatever the number of open pages: a point is a
# minute, and the read scans pglane.jobs (about 0.8 s behind 1M finished jobs on 2 cores).
HISTORY_TTL = 30.0
POOL_WAIT = 5.0  # seconds a request waits for a connection before the page says the database is unreachable (503)
LANE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,47}$")

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
    "end-stuck": {
        "target": "lane", "button": "End the stuck sessions of lane {t}",
        "cost": "This ends the database sessions of lane {t}'s workers that run past their lease "
                "(pg_terminate_backend), then recovers their attempts as lost. Their calls may still be running "
                "at the provider and may have been paid; their jobs fail and run again only if you retry them.",
    },
}


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


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
    env.filters.update(when=_when, minute=_minute, duration=_duration, shown=_shown)
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

    def __init__(self, dsn: str, guard: Guard) -> None:
        self.dsn, self.guard = dsn, guard
        self.templates = _templates()
        self._history: tuple[float, dict[str, list[charts.Chart]]] | None = None  # (read at, charts): lanes()
        self.pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=4, open=False, name="pglane-web",
            kwargs={"autocommit": True, "prepare_threshold": None,
                    "application_name": APPLICATION_NAME},
        )

    async def rows(self, query: LiteralString, params: tuple[Any, ...] | dict[str, Any] | None = None
                   ) -> list[dict[str, Any]]:
        async with self.pool.connection(timeout=POOL_WAIT) as conn:
            with client.translated():
                async with conn.cursor(row_factory=dict_row) as cursor:
                    await cursor.execute(query, params, prepare=False)
                    return await cursor.fetchall()

    def render(self, request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        """The page, or only its refreshed part when asked with ?fragment=1."""
        fragment = request.query_params.get("fragment") == "1"
        base = {"actions": self.guard.actions_allowed, "page": name}
        return self.templates.TemplateResponse(request, f"_{name}.html" if fragment else f"{name}.html",
                                               {**base, **context}, status_code=status)

    async def lanes(self, request: Request) -> Response:
        lanes = await self.rows(queries.LANE_STATUS)
        history = await self.history()
        return self.render(request, "lanes", {"lanes": lanes, "charts": history, "chart_w": charts.WIDTH,
                                              "chart_h": charts.HEIGHT, "now": datetime.now(UTC)})

    async def history(self) -> dict[str, list[charts.Chart]]:
        if self._history is None or time.monotonic() - self._history[0] > HISTORY_TTL:
            self._history = (time.monotonic(), charts.lane_charts(await self.rows(web_queries.LAST_HOUR)))
        return self._history[1]

    async def jobs(self, request: Request) -> Response:
        params = request.query_params
        lane, status, key = (params.get(name) or None for name in ("lane", "status", "key"))
        if status is not None and status not in JOB_STATUSES:
            raise HTTPException(400, f"unknown status {status!r}: use one of {', '.join(JOB_STATUSES)}")
        rows = await self.rows(web_queries.JOBS, {"lane": lane, "status": status, "key": key, "limit": JOBS_SHOWN})
        names = [r["name"] for r in await self.rows(web_queries.LANE_NAMES)]
        return self.render(request, "jobs", {
            "jobs": rows, "lane_names": names, "statuses": JOB_STATUSES, "limit": JOBS_SHOWN,
            "filter": {"lane": lane or "", "status": status or "", "key": key or ""},
            "now": datetime.now(UTC)})

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
            raise HTTPException(404, f"no action {action!r}: retry, cancel, recover and end-stuck exist")
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
        job = None
        if ACTIONS[action]["target"] == "job":
            found = await self.rows(queries.JOB_STATUS, (int(target),))
            if not found:
                raise HTTPException(404, f"no job {target}: it never existed, or it was pruned")
            job = found[0]
        cookie = request.cookies.get(CSRF_COOKIE) or self.guard.new_cookie()
        spec = ACTIONS[action]
        response = self.templates.TemplateResponse(request, "confirm.html", {
            "actions": True, "page": "confirm", "action": action, "target": target, "kind": spec["target"],
            "cost": spec["cost"].format(t=target), "button": spec["button"].format(t=target), "job": job,
            "csrf": self.guard.csrf_field(cookie, action, target)})
        if request.cookies.get(CSRF_COOKIE) != cookie:
            response.set_cookie(CSRF_COOKIE, cookie, httponly=True, samesite="strict", path="/")
        return response

    async def act(self, request: Request) -> Response:
        """POST: the action, once the guard lets it through; 403 and nothing done otherwise."""
        action = request.path_params["action"]
        form = await request.form()

        def field(name: str) -> str | None:
            value = form.get(name)
            return value if isinstance(value, str) else None

        kind = ACTIONS.get(action, {}).get("target", "job")
        if not self.guard.actions_allowed:  # before anything else: a read-only page says so, whatever was sent
            raise HTTPException(403, "this page is read-only: start it with --allow-actions and a token")
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
        elif isinstance(exc, PoolTimeout | psycopg.OperationalError):
            status, message = 503, f"cannot reach the database ({first_line(exc)}); check the server and --dsn"
        else:
            status, message = 500, first_line(exc)
        return self.templates.TemplateResponse(request, "error.html", {
            "actions": self.guard.actions_allowed, "page": "error", "status": status, "message": message},
            status_code=status)


def _run_action(dsn: str, action: str, target: str) -> str:
    """One action through pglane.client, on a connection of its own; what happened, in one line."""
    with client.connect(dsn, application_name=APPLICATION_NAME) as conn:
        if action == "retry":
            client.retry(conn, int(target))
            return f"job {target} is queued again: a worker will make its call once more"
        if action == "cancel":
            client.cancel(conn, int(target))
            return f"job {target} is cancelled: it will not run"
        ended = client.terminate_stuck(conn, target) if action == "end-stuck" else 0
        marked = client.recover(conn, target)
        stuck = len(client.stuck_attempts(conn, target))
        said = f"lane {target}: {marked} attempt(s) marked lost"
        if action == "end-stuck":
            said = f"lane {target}: ended {ended} stuck session(s); {marked} attempt(s) marked lost"
        return said + (f"; {stuck} attempt(s) still stuck past their lease" if stuck else "")


def create_app(dsn: str, *, token: str | None = None, allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The page for the database at ``dsn``: read-only unless ``token`` is given (pglane.web.security's
    check_token decides whether actions may be allowed). ``allowed_hosts``: the Host headers answered
    (others get 400, so that a site rebinding its DNS name to 127.0.0.1 cannot read the page); None: any."""
    page = Page(dsn, Guard(token))

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
            Route("/jobs", page.jobs, name="jobs"),
            Route("/jobs/{job_id:int}", page.job, name="job"),
            Route("/confirm/{action}", page.confirm, name="confirm"),
            Route("/actions/{action}", page.act, methods=["POST"], name="act"),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        middleware=[Middleware(SecurityHeaders),
                    Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts or ["*"]))],
        exception_handlers={HTTPException: handler, PoolTimeout: handler, psycopg.OperationalError: handler,
                            PglaneError: handler},
        lifespan=lifespan,
    )
    app.state.page = page
    return app

