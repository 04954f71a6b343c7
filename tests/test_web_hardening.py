"""The operator's page under load and attack (#30): paged job and lane lists that cost what they
show, a statement timeout and a bounded pool wait, refusals before a body is read, and the Host check
on every bind. Every test talks real HTTP to a real `pglane web` process or to the application served
by uvicorn, against the real database."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette", reason="the web page's tests need pglane[web]")
import uvicorn
from starlette.applications import Starlette

import pglane
from pglane.web import create_app, server
from tests.conftest import wait_until
from tests.test_web import TOKEN, WebServer, operator_dsn  # noqa: F401  (a fixture)

SEED_JOBS = 100_000
SEED_LANES = 2_000
# The queued jobs' index entries read (both queue indexes) and the rows of jobs read, in this transaction.
QUEUE_READS = ("SELECT pg_stat_get_xact_tuples_fetched('pglane.jobs_queue'::regclass)"
               " + pg_stat_get_xact_tuples_fetched('pglane.jobs_group_queue'::regclass)"
               " + pg_stat_get_xact_tuples_returned('pglane.jobs'::regclass) AS n")


def seed(conn: Any, jobs: int = SEED_JOBS, lanes: int = SEED_LANES, lane: str = "brain") -> None:
    """``lanes`` lanes l0.. and ``jobs`` queued jobs in ``lane``, each in one statement."""
    conn.execute("INSERT INTO pglane.lanes (name) SELECT 'l' || g FROM generate_series(0, %s - 1) g", (lanes,))
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(1, %s) g", (lane, jobs))
    conn.execute("ANALYZE pglane.jobs")
    conn.execute("ANALYZE pglane.lanes")


class Served:
    """The application served by uvicorn in a thread, on a free loopback port."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1") -> None:
        sock = server.bind(host, 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 20, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(app: Starlette, host: str = "127.0.0.1") -> Served:
        started.append(Served(app, host))
        return started[-1]

    yield start
    for one in started:
        one.stop()


def shown_jobs(body: str) -> list[int]:
    return [int(j) for j in re.findall(r'<a href="[^"]*/jobs/(\d+)">', body)]


def places(body: str) -> list[str]:
    """The 'place' column of each row of the jobs list ('' for a job not queued)."""
    return [m for m in re.findall(r'</td>\s*<td>([0-9]*)</td>\s*<td>\d+</td>\s*<td class="key">', body)]


def next_link(body: str) -> str | None:
    found = re.search(r'<a rel="next" class="next" href="([^"]+)"', body)
    return found.group(1).replace("&amp;", "&") if found else None


# --- 2. job lists that cost what they show -------------------------------------------------------------

def test_the_jobs_list_is_paged_and_its_next_links_walk_every_job_once_in_order(
    operator_dsn: str, conn: Any, lane: str, serve: Callable[..., Served]  # noqa: F811
) -> None:
    conn.execute("INSERT INTO pglane.jobs (lane) SELECT 'brain' FROM generate_series(1, 120)")
    scheduled = [r["id"] for r in conn.execute(
        "INSERT INTO pglane.jobs (lane, run_after) SELECT 'brain', now() + g * interval '1 hour'"
        " FROM generate_series(3, 1, -1) g RETURNING id").fetchall()]
    done = [r["id"] for r in conn.execute(
        "WITH made AS (INSERT INTO pglane.jobs (lane) SELECT 'brain' FROM generate_series(1, 40) RETURNING id)"
        " SELECT id FROM made ORDER BY id").fetchall()]
    conn.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now() WHERE id = ANY(%s)", (done,))
    eligible = [r["id"] for r in conn.execute(
        "SELECT id FROM pglane.jobs WHERE in_queue AND run_after <= now() ORDER BY id").fetchall()]
    expected = eligible + scheduled[::-1] + done[::-1]  # service order, then the rest newest first
    page = serve(create_app(operator_dsn))
    walked: list[int] = []
    where: list[str] = []
    path: str | None = "/jobs"
    with httpx.Client(base_url=page.url, timeout=30) as c:
        pages = 0
        while path is not None:
            response = c.get(path)
            assert response.status_code == 200, response.text
            rows = shown_jobs(response.text)
            assert 0 < len(rows) <= 50, path
            fragment = c.get(path + ("&" if "?" in path else "?") + "fragment=1")
            assert shown_jobs(fragment.text) == rows  # the refresh reads the same page
            walked += rows
            where += places(response.text)
            path = next_link(response.text)
            pages += 1
        assert pages == 4
        assert walked == expected
        assert where == [str(n) for n in range(1, 124)] + [""] * 40  # each queued job's place in its lane
        lane_only = c.get("/jobs", params={"lane": lane, "status": "queued", "after": str(eligible[99])}).text
        assert shown_jobs(lane_only) == eligible[100:] + scheduled[::-1]
        assert places(lane_only) == [str(n) for n in range(101, 124)]
        assert next_link(lane_only) is None


# Every read of pglane.jobs in this transaction: the entries of its indexes read, and its rows read (by a
# sequential scan, a bitmap scan, or an index scan: each index's tuples_fetched).
JOBS_READS = ("SELECT pg_stat_get_xact_tuples_fetched('pglane.jobs'::regclass)"
              " + pg_stat_get_xact_tuples_returned('pglane.jobs'::regclass)"
              " + (SELECT sum(pg_stat_get_xact_tuples_returned(i.indexrelid)"
              "                 + pg_stat_get_xact_tuples_fetched(i.indexrelid))"
              "     FROM pg_index i WHERE i.indrelid = 'pglane.jobs'::regclass) AS n")


def test_a_page_of_a_long_queue_reads_a_page_of_it_wherever_its_cursor_stands(dsn: str, conn: Any, lane: str) -> None:
    """Without timing (#32): the jobs list in service order (priority DESC, fair_rank, created_at, id)
    reads a few pages' worth of a 20,000-job queue for its page, from the first page, inside a priority,
    across a change of priority and from one lane to the next; a queued job's place costs its place, not
    the lane's queue, and is job_status's queue_position. Counted by PostgreSQL (this session's reads),
    through the page's own code (Page._job_ids)."""
    import asyncio

    import psycopg
    from psycopg.rows import dict_row

    from pglane.web.app import JOBS_SHOWN, Page
    from pglane.web.queries import JOB_POSITIONS
    from pglane.web.security import Guard

    for name in ("alpha", "zeta"):
        pglane.create_lane(conn, name, job_timeout=20)
        conn.execute("INSERT INTO pglane.jobs (lane, group_key) SELECT %s, 'g' || (g %% 3)"
                     " FROM generate_series(1, 60) g", (name,))
    conn.execute("INSERT INTO pglane.jobs (lane, group_key, priority, run_after)"
                 " SELECT %s, 'g' || (g %% 40), CASE WHEN g %% 7 = 0 THEN 3 WHEN g %% 11 = 0 THEN -1 ELSE 0 END,"
                 " now() + CASE WHEN g %% 50 = 0 THEN interval '1 hour' ELSE interval '0' END"
                 " FROM generate_series(1, 20000) g", (lane,))
    conn.execute("ANALYZE pglane.jobs")
    rows = conn.execute("SELECT id, lane, priority, fair_rank, created_at FROM pglane.jobs"
                        " WHERE in_queue AND run_after <= now()").fetchall()
    order = [r["id"] for r in sorted(rows, key=lambda r: (r["lane"], -r["priority"], r["fair_rank"],
                                                          r["created_at"], r["id"]))]
    brain = [r for r in rows if r["lane"] == lane]
    first_brain = order.index(min(brain, key=lambda r: (-r["priority"], r["fair_rank"], r["created_at"],
                                                        r["id"]))["id"])
    priority = {r["id"]: r["priority"] for r in brain}
    last_top = max(i for i, job in enumerate(order) if priority.get(job) == 3)
    last_middle = max(i for i, job in enumerate(order) if priority.get(job) == 0)
    last_brain = first_brain + len(brain) - 1
    page = Page(dsn, Guard(None))

    async def measure() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, row_factory=dict_row) as aconn:
            async def reads() -> int:
                return int((await (await aconn.execute(JOBS_READS)).fetchone())["n"])  # type: ignore[index]

            for at in (None, first_brain + 25, last_top, first_brain + 10_000, last_middle, last_brain):
                async with aconn.transaction():
                    before = await reads()
                    found = await page._job_ids(aconn, None, None, None, None if at is None else order[at], None)
                    used = await reads() - before
                start = 0 if at is None else at + 1
                assert [job for job, _, _ in found] == order[start:start + JOBS_SHOWN + 1], at
                # at most three ranges of a page, an index entry and a row each, and the scheduled jobs passed over
                assert used < 8 * (JOBS_SHOWN + 1), (at, used)
            for at in (first_brain + 25, last_top + 1, first_brain + 5_000):
                job = order[at]
                async with aconn.transaction():
                    before = await reads()
                    place = (await (await aconn.execute(JOB_POSITIONS, ([job],))).fetchone())["queue_position"]  # type: ignore[index]
                    used = await reads() - before
                assert place == at - first_brain + 1 == pglane.job_status(conn, job)["queue_position"]
                assert used < 3 * place + 100, (place, used)  # its place, not the lane's 20,000

    asyncio.run(measure())


def test_a_slow_query_is_cut_by_the_statement_timeout_and_the_pool_keeps_serving(
    operator_dsn: str, conn: Any, lane: str, serve: Callable[..., Served]  # noqa: F811
) -> None:
    """The lanes page made slow on purpose (its tallies locked): each of its requests gets a 503 once the
    statement timeout cuts its query, and the jobs pages asked meanwhile, more than the pool's
    connections, all get their answer."""
    pglane_job = conn.execute("INSERT INTO pglane.jobs (lane) VALUES ('brain') RETURNING id").fetchone()["id"]
    page = serve(create_app(operator_dsn, statement_timeout=1.0))
    with httpx.Client(base_url=page.url, timeout=30) as c:
        assert c.get("/").status_code == 200  # the pool is open and warm
        with conn.transaction():
            conn.execute("LOCK TABLE pglane.lane_tallies IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with ThreadPoolExecutor(12) as pool:
                slow = [pool.submit(c.get, "/") for _ in range(6)]
                fast = [pool.submit(c.get, path) for path in ["/jobs", f"/jobs/{pglane_job}"] * 3]
                slow_answers = [f.result() for f in slow]
                fast_answers = [f.result() for f in fast]
            took = time.monotonic() - started
    for response in slow_answers:
        assert response.status_code == 503 and "statement timeout" in response.text
    for response in fast_answers:
        assert response.status_code == 200, response.text
    assert took < 15, took
    with httpx.Client(base_url=page.url, timeout=30) as c:
        assert c.get("/").status_code == 200  # every connection came back usable


def test_a_client_that_goes_away_takes_its_query_with_it(
    operator_dsn: str, dsn: str, conn: Any, lane: str, serve: Callable[..., Served]  # noqa: F811
) -> None:
    page = serve(create_app(operator_dsn, statement_timeout=120.0))

    def waiting() -> int:
        return int(conn.execute("SELECT count(*) AS n FROM pg_stat_activity WHERE application_name = 'pglane web'"
                                " AND state = 'active' AND wait_event_type = 'Lock'").fetchone()["n"])

    with httpx.Client(base_url=page.url, timeout=30) as c:
        assert c.get("/").status_code == 200
    with pglane.connect(dsn) as locker, locker.transaction():
        locker.execute("LOCK TABLE pglane.lane_tallies IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(httpx.TimeoutException), httpx.Client(base_url=page.url, timeout=1.0) as c:
            c.get("/")  # the client gives up after 1 s and closes its connection
        wait_until(lambda: waiting() == 0, 10, "the page to cancel the query of the client that left")
    with httpx.Client(base_url=page.url, timeout=30) as c:
        assert c.get("/").status_code == 200


# --- 7. refusals before a body is read ------------------------------------------------------------------

def post_head_first(port: int, headers: dict[str, str], body_chunk: bytes, chunks: int,
                    host: str = "127.0.0.1", first: bytes = b"") -> tuple[str, int]:
    """A POST /actions/retry whose headers announce a large body; the body is sent a chunk at a time, and
    after each the socket is checked for an answer: (the answer's status line, the body bytes sent)."""
    sent = 0
    with socket.create_connection((host, port), timeout=10) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items())
        sock.sendall(f"POST /actions/retry HTTP/1.1\r\n{head}\r\n".encode() + first)
        sent = len(first)
        sock.settimeout(0.2)
        for _ in range(chunks):
            try:
                answer = sock.recv(65536)
            except TimeoutError:
                answer = b""
            if answer:
                return answer.split(b"\r\n")[0].decode(), sent
            try:
                sock.sendall(body_chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(body_chunk)
        sock.settimeout(10)
        try:
            answer = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            answer = b""
        return answer.split(b"\r\n")[0].decode(), sent


MIB = 1024 * 1024
MULTIPART = {"Content-Type": "multipart/form-data; boundary=xx", "Content-Length": str(500 * MIB)}
# A well-formed upload's start: a parser reading it spools the file's bytes that follow.
UPLOAD = (b'--xx\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n'
          b"Content-Type: application/octet-stream\r\n\r\n")


def test_a_read_only_page_refuses_an_upload_before_reading_it(
    operator_dsn: str, lane: str, tmp_path: Path  # noqa: F811
) -> None:
    web = WebServer(operator_dsn, tmp_path / "web.log")
    try:
        status, sent = post_head_first(web.port, MULTIPART, b"x" * 65536, chunks=40, first=UPLOAD)
        assert status.startswith("HTTP/1.1 403 "), status
        assert sent <= 2 * MIB  # answered with 498 of its 500 MiB still unsent
    finally:
        web.stop()


def test_an_action_is_a_small_urlencoded_form_or_refused_before_its_body(
    operator_dsn: str, lane: str, serve: Callable[..., Served]  # noqa: F811
) -> None:
    page = serve(create_app(operator_dsn, token=TOKEN))
    status, sent = post_head_first(page.port, MULTIPART, b"x" * 65536, chunks=40, first=UPLOAD)
    assert status.startswith("HTTP/1.1 415 ") and sent <= 2 * MIB
    large = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(500 * MIB)}
    status, sent = post_head_first(page.port, large, b"x" * 65536, chunks=40)
    assert status.startswith("HTTP/1.1 413 ") and sent <= 2 * MIB
    chunked = {"Content-Type": "application/x-www-form-urlencoded", "Transfer-Encoding": "chunked"}
    status, sent = post_head_first(page.port, chunked, b"4000\r\n" + b"x" * 0x4000 + b"\r\n", chunks=40)
    assert status.startswith("HTTP/1.1 413 ") and sent <= 2 * MIB  # cut once past 64 KiB
    with httpx.Client(base_url=page.url, timeout=30) as c:  # a form as the page sends it still gets through
        refused = c.post("/actions/retry", data={"job": "1", "csrf": "x", "token": TOKEN})
        assert refused.status_code == 403 and "CSRF" in refused.text


# --- 8. the Host check on every bind --------------------------------------------------------------------

def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_page_on_ipv6_loopback_refuses_a_foreign_host(operator_dsn: str, lane: str, tmp_path: Path) -> None:  # noqa: F811
    web = WebServer(operator_dsn, tmp_path / "web.log", "--host", "::1")
    try:
        assert web.host == "[::1]"
        with httpx.Client(base_url=web.url, timeout=30) as c:
            for host in (f"rebound.example:{web.port}", "rebound.example", f"[::2]:{web.port}",
                         f"localhost:{web.port + 1}"):
                refused = c.get("/", headers={"Host": host})
                assert refused.status_code == 400 and "lane-brain" not in refused.text, host
            for host in (f"[::1]:{web.port}", f"localhost:{web.port}", f"127.0.0.1:{web.port}"):
                assert c.get("/", headers={"Host": host}).status_code == 200, host
    finally:
        web.stop()


def test_beyond_loopback_the_page_needs_allowed_hosts_and_says_what_protects_it(
    operator_dsn: str, lane: str, tmp_path: Path  # noqa: F811
) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PGLANE_DSN": operator_dsn}
    env.pop(server.ALLOWED_HOSTS_ENV, None)
    run = subprocess.run([sys.executable, "-m", "pglane", "web", "--host", "0.0.0.0", "--port", "0"], env=env,
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2 and server.ALLOWED_HOSTS_ENV in run.stderr, run.stderr
    web = WebServer(operator_dsn, tmp_path / "web.log", "--host", "0.0.0.0", "--allowed-host", "pglane.example")
    try:
        # The line that says what protects it comes just after the one WebServer waits for.
        wait_until(lambda: "Host check" in web.log(), 30, "pglane web to say what protects it")
        assert "Host check" in web.log() and "pglane.example" in web.log() and "read-only" in web.log()
        with httpx.Client(base_url=f"http://127.0.0.1:{web.port}", timeout=30) as c:
            assert c.get("/", headers={"Host": f"pglane.example:{web.port}"}).status_code == 200
            assert c.get("/", headers={"Host": f"127.0.0.1:{web.port}"}).status_code == 400
    finally:
        web.stop()


# --- 9. paged lanes -------------------------------------------------------------------------------------

def test_two_thousand_lanes_make_pages_of_fifty_with_working_next_links(
    operator_dsn: str, conn: Any, lane: str, serve: Callable[..., Served]  # noqa: F811
) -> None:
    conn.execute("INSERT INTO pglane.lanes (name) SELECT 'l' || g FROM generate_series(0, 1999) g")
    every = [r["name"] for r in conn.execute("SELECT name FROM pglane.lanes ORDER BY name").fetchall()]
    page = serve(create_app(operator_dsn))
    walked: list[str] = []
    with httpx.Client(base_url=page.url, timeout=60) as c:
        path: str | None = "/"
        for _ in range(3):
            assert path is not None
            response = c.get(path)
            assert response.status_code == 200
            assert len(response.content) < 1_000_000  # 2,000 lanes made 12 MB
            names = re.findall(r'<section class="lane" id="lane-([^"]+)">', response.text)
            assert len(names) == 50
            refreshed = c.get(path + ("&" if "?" in path else "?") + "fragment=1")
            assert re.findall(r'<section class="lane" id="lane-([^"]+)">', refreshed.text) == names
            walked += names
            path = next_link(response.text)
        assert walked == every[:150]
        last = c.get("/", params={"after": every[-3]}).text
        assert re.findall(r'<section class="lane" id="lane-([^"]+)">', last) == every[-2:]
        assert next_link(last) is None
        prefixed = c.get("/", params={"prefix": "l19"}).text  # l19, l190-l199, l1900-l1999: 111
        names = re.findall(r'<section class="lane" id="lane-([^"]+)">', prefixed)
        assert names == [n for n in every if n.startswith("l19")][:50]
        following = c.get(next_link(prefixed) or "/nowhere").text
        assert re.findall(r'<section class="lane" id="lane-([^"]+)">', following) == [
            n for n in every if n.startswith("l19")][50:100]


PER_LANE_FUNCTIONS = ("pglane.lane_queue(text)", "pglane.in_flight(text)", "pglane.lane_consumers(integer, integer)",
                      "pglane.rate_next_start(text)")


def per_lane_calls(conn: Any, query: str, params: dict[str, Any] | tuple[Any, ...] | None = None) -> dict[str, int]:
    """How many times ``query`` calls each function lane_status calls once per lane it computes:
    counted by PostgreSQL itself (track_functions = 'all', this transaction's counts)."""
    def calls() -> dict[str, int]:  # this session's counts not yet sent to the statistics (so: a difference)
        return {f: int(conn.execute("SELECT coalesce(pg_stat_get_xact_function_calls(%s::regprocedure), 0) AS n",
                                    (f,)).fetchone()["n"]) for f in PER_LANE_FUNCTIONS}

    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        before = calls()
        conn.execute(query, params).fetchall()
        return {f: n - before[f] for f, n in calls().items()}


def test_a_page_of_lanes_computes_its_lanes_only(conn: Any, lane: str) -> None:
    """Without timing (#30): the lanes page's statement computes the statuses of the lanes it shows (51:
    a page and the one telling whether there is a next), not of every lane, counted in function calls;
    the queue of a lane that holds most jobs is not read for the others; the view read whole still
    computes each lane once, and the page's rows equal the view's."""
    from pglane.web.app import LANES_SHOWN
    from pglane.web.queries import LANE_PAGE

    seed(conn, jobs=5_000, lanes=2_000)
    page = {"after": "", "prefix": "", "limit": LANES_SHOWN + 1}
    a_page = {f: LANES_SHOWN + 1 for f in PER_LANE_FUNCTIONS}
    assert per_lane_calls(conn, LANE_PAGE, page) == a_page
    assert per_lane_calls(conn, LANE_PAGE, {**page, "after": "l1500"}) == a_page
    assert per_lane_calls(conn, LANE_PAGE, {**page, "prefix": "l19"}) == a_page
    assert per_lane_calls(conn, "SELECT * FROM pglane.lane_status") == {f: SEED_LANES + 1 for f in PER_LANE_FUNCTIONS}
    # A page without the big lane reads none of its 5,000 queued jobs (the queue index, lane by lane).
    with conn.transaction():
        before = conn.execute(QUEUE_READS).fetchone()["n"]
        conn.execute(LANE_PAGE, {**page, "after": "l1500"}).fetchall()
        after = conn.execute(QUEUE_READS).fetchone()["n"]
        assert after - before < 100, after - before
    with conn.transaction():  # one now() for both
        whole = {r["lane"]: r for r in conn.execute("SELECT * FROM pglane.lane_status").fetchall()}
        shown = conn.execute(LANE_PAGE, page).fetchall()
    assert [r["lane"] for r in shown] == sorted(whole)[:LANES_SHOWN + 1]
    for row in shown:
        assert row == whole[row["lane"]]
    assert whole[lane]["queued"] == 5_000 and whole["l7"]["queued"] == 0


def test_a_lanes_own_page_computes_that_lane_only_and_asks_for_groups_with_one_probe(conn: Any, lane: str) -> None:
    """The lane's page (#32) reads its one lane's status among 2,000 lanes, and whether the lane has
    grouped jobs from an index probe or two, not from its 5,000 queued jobs; group_status, which reads
    the lane's queue, is asked only by that page, for that lane."""
    from pglane.web.queries import LANE_GROUPED, LANE_ONE

    seed(conn, jobs=5_000, lanes=2_000)
    assert per_lane_calls(conn, LANE_ONE, (lane,)) == {f: 1 for f in PER_LANE_FUNCTIONS}
    for grouped in (False, True):
        with conn.transaction():
            before = conn.execute(JOBS_READS).fetchone()["n"]
            assert conn.execute(LANE_GROUPED, {"lane": lane}).fetchone()["grouped"] is grouped
            assert conn.execute(JOBS_READS).fetchone()["n"] - before < 10
        pglane.enqueue(conn, lane, {}, group="acme")


def test_the_charts_of_a_long_queue_count_it_without_reading_its_jobs_one_by_one(
    conn: Any, lane: str
) -> None:
    """The last hour of a lane with a backlog never tried (#30: 100,000 queued jobs took 1.9 s): such
    jobs are counted by minute of enqueue in one pass, not expanded and joined to attempts, and the
    depth they make is still exact."""
    import json

    from pglane.web.queries import LAST_HOUR

    seed(conn, jobs=5_000, lanes=10)
    pglane.enqueue(conn, lane, {"n": "tried"})
    plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + LAST_HOUR, {"lanes": [lane, "l1"]}).fetchone()
    plan = plan["QUERY PLAN"] if isinstance(plan["QUERY PLAN"], list) else json.loads(plan["QUERY PLAN"])

    def nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    every = list(nodes(plan[0]["Plan"]))
    recent = [n for n in every if n.get("CTE Name") == "recent" or n.get("Subplan Name") == "CTE recent"]
    assert recent and all(n["Actual Rows"] * n["Actual Loops"] == 0 for n in recent), recent
    rows = conn.execute(LAST_HOUR, {"lanes": [lane, "l1"]}).fetchall()
    assert [r["depth"] for r in rows if r["lane"] == lane][-1] == 5_001
    assert {r["depth"] for r in rows if r["lane"] == "l1"} == {0}


@pytest.mark.skipif(not os.environ.get("PGLANE_WEB_MEASURE"), reason="a measurement: set PGLANE_WEB_MEASURE=1")
def test_measure_page_times(operator_dsn: str, conn: Any, lane: str, tmp_path: Path) -> None:  # noqa: F811
    seed(conn)
    server = WebServer(operator_dsn, tmp_path / "web.log")
    try:
        with httpx.Client(base_url=server.url, timeout=float(os.environ.get("PGLANE_WEB_MEASURE_TIMEOUT", "120"))) as c:
            # "/?prefix=b": the big lane's page again, with its charts read anew (kept 30 s per page)
            for path in ("/", "/?fragment=1", "/?after=l1500", "/?prefix=l19", "/?prefix=b", "/jobs",
                         "/jobs?fragment=1", "/jobs?status=queued", "/jobs?lane=brain", "/jobs?lane=brain&after=90000",
                         "/jobs?status=done", "/jobs?status=failed", "/jobs?key=nothing"):
                started = time.monotonic()
                try:
                    r = c.get(path)
                    said = f"{r.status_code} {len(r.content)} bytes"
                except httpx.TimeoutException:
                    said = "client timeout"
                print(f"MEASURE {path}: {time.monotonic() - started:.3f} s, {said}")
    finally:
        server.stop()
