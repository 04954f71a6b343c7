"""The operator's page at the HTTP level, against the real database, connected as a login that holds
pglane_operator and nothing else: what each page shows, that every value from the database is
escaped, that no GET changes anything, that an action needs actions allowed, the CSRF field and the
token (403 and nothing changed otherwise), the security headers, the last hour's charts, and the
command itself (127.0.0.1 by default, the token's rules, the missing extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

pytest.importorskip("starlette", reason="the web page's tests need pglane[web]")
from starlette.testclient import TestClient

import pglane
from pglane import queries
from pglane.web import create_app
from pglane.web import queries as web_queries
from tests.conftest import ROOT, claimed, take_slot, wait_until

TOKEN = "test-token-0123456789abcdef"
XSS = "<script>alert('pglane')</script>"
WEB_LOGIN = "pglane_test_web"


@pytest.fixture
def operator_dsn(dsn: str, conn: Any) -> str:
    """The DSN of a login role that is a member of pglane_operator and of nothing else."""
    if not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()["rolsuper"]:
        pytest.skip("the web tests need a superuser test connection to make the operator's login role")
    conn.execute(f"DO $$ BEGIN CREATE ROLE {WEB_LOGIN} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    conn.execute(f"GRANT pglane_operator TO {WEB_LOGIN}")
    member_of = conn.execute("SELECT array_agg(r.rolname::text) AS roles FROM pg_auth_members m"
                             " JOIN pg_roles r ON r.oid = m.roleid JOIN pg_roles u ON u.oid = m.member"
                             " WHERE u.rolname = %s", (WEB_LOGIN,)).fetchone()["roles"]
    assert member_of == ["pglane_operator"]
    return make_conninfo(dsn, user=WEB_LOGIN)


@pytest.fixture
def page(operator_dsn: str) -> Iterator[TestClient]:
    """The page as `pglane web` serves it by default: read-only."""
    with TestClient(create_app(operator_dsn)) as c:
        yield c


@pytest.fixture
def acting(operator_dsn: str) -> Iterator[TestClient]:
    """The page started with --allow-actions and a token."""
    with TestClient(create_app(operator_dsn, token=TOKEN)) as c:
        yield c


def snapshot(conn: Any) -> tuple[Any, Any, Any]:
    """Every job, attempt and lane as it is now: compared before and after to prove nothing changed."""
    row = conn.execute("SELECT (SELECT json_agg(j ORDER BY j.id) FROM pglane.jobs j) AS jobs,"
                       " (SELECT json_agg(a ORDER BY a.id) FROM pglane.attempts a) AS attempts,"
                       " (SELECT json_agg(l ORDER BY l.id) FROM pglane.lanes l) AS lanes").fetchone()
    return row["jobs"], row["attempts"], row["lanes"]


def failed_job(conn: Any, worker_session: Any, lane: str = "brain", *, payload: Any = None, key: str | None = None,
               error: str = "RuntimeError: the provider answered 500", worker: str = "worker-a") -> tuple[int, int]:
    """A job whose one attempt was claimed by ``worker_session`` (which takes the slot) and failed with
    ``error``, through the SQL functions a worker calls: (job id, attempt id)."""
    job = pglane.enqueue(conn, lane, payload if payload is not None else {"q": "summarise report 7"}, key=key)
    take_slot(worker_session, lane)
    with pglane.client.translated():
        row = worker_session.execute(queries.CLAIM, (lane, worker)).fetchone()
    assert row is not None and row["job_id"] == job
    worker_session.execute(queries.FAIL, (row["attempt_id"], error, False, row["token"]))
    worker_session.execute(queries.RELEASE_SLOT, (_lane_id(conn, lane), 1))
    return job, int(row["attempt_id"])


def _lane_id(conn: Any, lane: str) -> int:
    return int(conn.execute(queries.LANES, {"name": lane}).fetchone()["id"])


def confirm_form(client: TestClient, action: str, **target: str) -> dict[str, str]:
    """Open the action's confirmation page and return its form's hidden fields (the CSRF field among them)."""
    response = client.get(f"/confirm/{action}", params=target)
    assert response.status_code == 200, response.text
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', response.text))


def test_the_lanes_page_shows_each_lane_its_next_safe_action_slots_consumers_and_depth(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    pglane.create_lane(conn, "email", slots=3, job_timeout=60, max_queued=50)
    for _ in range(2):
        pglane.enqueue(conn, "email", {})
    holder = session()
    take_slot(holder, lane)
    body = page.get("/").text
    email = body[body.index('id="lane-email"'):]
    assert "start a worker for lane email: pglane worker email --handler MODULE:CALLABLE" in email
    assert re.search(r"consumers / slots</dt><dd>0 / 3<", email)
    assert re.search(r">2</a> of 50<", email)  # the depth and the lane's bound
    brain = body[body.index('id="lane-brain"'):body.index('id="lane-email"')]
    assert re.search(r"consumers / slots</dt><dd>1 / 1<", brain)
    assert f"<td>{holder.info.backend_pid}</td>" in brain and "holds" in brain
    assert brain.count("<svg") == 3 and "attempts per minute" in brain and "queue depth" in brain
    assert "wait before start" in brain


def test_the_page_reads_as_a_login_holding_only_pglane_operator(page: TestClient, conn: Any, lane: str) -> None:
    assert page.get("/").status_code == 200
    rows = conn.execute("SELECT usename FROM pg_stat_activity WHERE application_name = 'pglane web'").fetchall()
    assert rows and {r["usename"] for r in rows} == {WEB_LOGIN}


def test_jobs_filter_by_lane_status_and_key_queued_first_in_service_order(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    pglane.create_lane(conn, "email", job_timeout=60)
    queued = [pglane.enqueue(conn, lane, {"n": n}) for n in range(3)]
    failed, _ = failed_job(conn, session(), "email")
    other = pglane.enqueue(conn, "email", {}, key="invoice-42")
    body = page.get("/jobs", params={"lane": lane}).text
    shown = [int(j) for j in re.findall(r'<a href="[^"]*/jobs/(\d+)">', body)]
    assert shown == queued  # queued in the order they will be served
    assert ">1</td>" in body and "nothing to do: just queued" in body
    every = [int(j) for j in re.findall(r'<a href="[^"]*/jobs/(\d+)">', page.get("/jobs").text)]
    assert every == [*queued, other, failed]  # queued first, then the rest newest first
    by_key = page.get("/jobs", params={"key": "invoice-42"}).text
    assert [int(j) for j in re.findall(r'/jobs/(\d+)">', by_key)] == [other]
    by_status = page.get("/jobs", params={"status": "failed"}).text
    assert [int(j) for j in re.findall(r'/jobs/(\d+)">', by_status)] == [failed]
    refused = page.get("/jobs", params={"status": "lost"})
    assert refused.status_code == 400 and "use one of queued, running, done, failed, cancelled" in refused.text


def _rows(body: str) -> list[dict[str, str]]:
    """The jobs list's rows: job id, group, priority and place, as the page shows them."""
    rows = []
    for row in re.findall(r'<tr class="status-\w+">(.*?)</tr>', body, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        rows.append({"job": cells[0], "group": cells[2], "priority": cells[3], "place": cells[6]})
    return rows


def test_queued_jobs_are_listed_in_the_order_the_claim_serves_them_priority_then_groups_by_rounds(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    """Service order is priority DESC, then the groups' rounds (fair_rank), then enqueue order: the page
    lists the queue so, with each job's group, priority and place (job_status's queue_position), and a
    worker then claims the jobs in exactly the order the page showed."""
    acme = [pglane.enqueue(conn, lane, {"n": n}, group="acme") for n in range(4)]
    beta = [pglane.enqueue(conn, lane, {"n": n}, group="beta") for n in range(2)]
    shared = pglane.enqueue(conn, lane, {})
    urgent = pglane.enqueue(conn, lane, {}, group="beta", priority=5)
    # urgent first (priority 5); then round 0 (each group's first job, in enqueue order), round 1, ...:
    # acme's 4 jobs interleave with beta's 2 instead of going all before them.
    expected = [urgent, acme[0], beta[0], shared, acme[1], beta[1], acme[2], acme[3]]
    rows = _rows(page.get("/jobs", params={"lane": lane}).text)
    assert [int(r["job"]) for r in rows] == expected
    assert [(r["group"], r["priority"]) for r in rows] == [
        ("beta", "5"), ("acme", "0"), ("beta", "0"), ("", "0"), ("acme", "0"), ("beta", "0"), ("acme", "0"),
        ("acme", "0")]
    assert [r["place"] for r in rows] == [str(n) for n in range(1, 9)]
    assert [pglane.job_status(conn, job)["queue_position"] for job in expected] == list(range(1, 9))
    assert "<th>group</th><th>priority</th>" in page.get("/jobs").text
    worker = session()
    take_slot(worker, lane)
    served = []
    for _ in expected:
        row = claimed(worker, lane)
        served.append(row["job_id"])
        worker.execute(queries.COMPLETE, (row["attempt_id"], "{}", row["token"]))
    assert served == expected


def test_the_jobs_pages_walk_every_lanes_queue_in_service_order_across_priorities_and_rounds(
    page: TestClient, conn: Any, lane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages of three jobs, so that the next links' cursors fall inside a priority, on the change from one
    priority to the next, from one lane to the next and into the scheduled jobs: every job is shown
    once, in service order, each queued one at job_status's queue_position."""
    from datetime import UTC, datetime, timedelta

    import pglane.web.app as web_app

    monkeypatch.setattr(web_app, "JOBS_SHOWN", 3)
    pglane.create_lane(conn, "email", job_timeout=60)
    later = datetime.now(UTC) + timedelta(hours=1)
    for n in range(14):
        pglane.enqueue(conn, lane, {"n": n}, group=("acme", "beta", "acme", None)[n % 4],
                       priority=(0, 2, 0, -1, 0)[n % 5])
    for n in range(5):
        pglane.enqueue(conn, "email", {"n": n}, group=("x", "y")[n % 2], priority=n % 2)
    for priority in (0, 4, 0):  # one run_after: the scheduled ones' priority orders them
        pglane.enqueue(conn, lane, {}, run_after=later, priority=priority, group="acme")
    pglane.enqueue(conn, "email", {}, run_after=later - timedelta(minutes=1))
    done = pglane.enqueue(conn, lane, {})
    conn.execute("UPDATE pglane.jobs SET status = 'done', finished_at = now() WHERE id = %s", (done,))

    jobs = conn.execute("SELECT id, lane, priority, fair_rank, created_at, run_after, run_after > now() AS later"
                        " FROM pglane.jobs WHERE in_queue").fetchall()

    def order(j: dict[str, Any]) -> tuple[Any, ...]:
        return (-j["priority"], j["fair_rank"], j["created_at"], j["id"])

    eligible = [j["id"] for name in sorted({j["lane"] for j in jobs})
                for j in sorted((j for j in jobs if j["lane"] == name and not j["later"]), key=order)]
    scheduled = [j["id"] for j in sorted((j for j in jobs if j["later"]), key=lambda j: (j["run_after"], *order(j)))]
    expected = [*eligible, *scheduled, done]
    assert eligible != sorted(eligible)  # service order is not enqueue order here

    def walk(path: str | None) -> list[dict[str, str]]:
        walked: list[dict[str, str]] = []
        while path is not None:
            body = page.get(path).text
            rows = _rows(body)
            assert 0 < len(rows) <= 3, path
            walked += rows
            found = re.search(r'<a rel="next" class="next" href="([^"]+)"', body)
            path = found.group(1).replace("&amp;", "&") if found else None
        return walked

    walked = walk("/jobs")
    assert [int(r["job"]) for r in walked] == expected
    places = {int(r["job"]): r["place"] for r in walked}
    for job in expected:
        position = pglane.job_status(conn, job)["queue_position"]
        assert places[job] == ("" if position is None else str(position)), job
    only_brain = walk(f"/jobs?lane={lane}&status=queued")
    assert [int(r["job"]) for r in only_brain] == [j for j in expected if j != done and
                                                  next(x for x in jobs if x["id"] == j)["lane"] == lane]


def test_one_failed_job_shows_its_attempts_error_result_and_next_safe_action(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    worker = session()
    job, attempt = failed_job(conn, worker, key="report-7")
    body = page.get(f"/jobs/{job}").text
    assert f"inspect attempt {attempt}: the handler failed; fix the cause, then: pglane retry {job}" in body
    assert "RuntimeError: the provider answered 500" in body and "worker-a" in body
    assert f"{worker.info.backend_pid}, " in body and "report-7" in body and "summarise report 7" in body
    assert "No result stored (failed)." in body
    assert "Retry" not in body  # read-only: no action offered
    assert page.get("/jobs/999999").status_code == 404


def test_a_queued_job_says_why_it_waits_and_where_it_stands(page: TestClient, conn: Any, lane: str) -> None:
    conn.execute("UPDATE pglane.lanes SET waiting_grace = '0' WHERE name = %s", (lane,))
    first = pglane.enqueue(conn, lane, {})
    second = pglane.enqueue(conn, lane, {})
    body = page.get(f"/jobs/{second}").text
    assert "start a worker for lane brain: pglane worker brain --handler MODULE:CALLABLE" in body
    assert re.search(r"place in the queue</dt><dd>2 — waiting past the lane's grace", body)
    assert first < second


def _section(body: str, lane: str) -> str:
    """One lane's section of the lanes page."""
    start = body.index(f'id="lane-{lane}"')
    end = body.find('<section class="lane"', start)
    return body[start:end if end >= 0 else len(body)]


def _groups(body: str) -> list[list[str]]:
    """The busiest groups table of a lane's page: its rows' cells as text."""
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r'<tr class="group">(.*?)</tr>', body, re.S)]


def test_the_lanes_page_shows_each_lanes_group_limit_and_waiting_groups_and_links_to_the_lane(
    page: TestClient, conn: Any, lane: str
) -> None:
    pglane.create_lane(conn, "email", job_timeout=60, group_slots=2)
    for group in ("acme", "beta", "beta", None):
        pglane.enqueue(conn, "email", {}, group=group)
    pglane.enqueue(conn, lane, {})
    body = page.get("/").text
    email, brain = _section(body, "email"), _section(body, lane)
    assert re.search(r'groups waiting</dt><dd><a href="/lanes/email#groups">3</a>', email)  # acme, beta, no group
    assert "group slots</dt><dd>2 a group</dd>" in email
    assert re.search(r'groups waiting</dt><dd><a href="/lanes/brain#groups">1</a>', brain)
    assert "group slots</dt><dd>no limit</dd>" in brain
    # each lane's groups are on its own page: the lanes page does not read them for every lane
    assert 'class="groups"' not in body and "Busiest groups" not in body
    assert "group slots</dt><dd>2 a group</dd>" in _section(page.get("/?fragment=1").text, "email")


def test_a_lanes_own_page_shows_its_five_busiest_groups(
    page: TestClient, conn: Any, session: Callable[..., Any]
) -> None:
    pglane.create_lane(conn, "tenants", job_timeout=60, group_slots=2)
    depth = {"g2": 6, "g4": 4, "g6": 3, "g3": 2, "g5": 1, "g1": 1}  # g2 first: the claim below takes its job
    for group, n in depth.items():
        for _ in range(n):
            pglane.enqueue(conn, "tenants", {}, group=group)
    for _ in range(7):
        pglane.enqueue(conn, "tenants", {})
    worker = session()
    take_slot(worker, "tenants")
    assert pglane.job_status(conn, claimed(worker, "tenants")["job_id"])["group_key"] == "g2"
    conn.execute("UPDATE pglane.jobs SET created_at = created_at - interval '10 minutes' WHERE group_key = 'g4'")
    response = page.get("/lanes/tenants")
    assert response.status_code == 200
    body = response.text
    assert "<h1>Lane tenants</h1>" in body and 'id="lane-tenants"' in body
    assert re.search(r'groups waiting</dt><dd><a href="/lanes/tenants#groups">7</a>', body)
    groups = _groups(body)
    # the deepest queues first: no group (7), g2 (5 queued, 1 running), g4, g6, g3; g5 and g1 not shown
    assert [g[:3] for g in groups] == [["no group (shared)", "7", "0 of 2"], ["g2", "5", "1 of 2"],
                                       ["g4", "4", "0 of 2"], ["g6", "3", "0 of 2"], ["g3", "2", "0 of 2"]]
    assert groups[2][3].startswith("10 min")  # g4's oldest job, moved 10 minutes back
    assert groups[0][4] == "not recorded" and groups[1][4].endswith(" UTC") and groups[2][4] == "never"
    assert "7 waiting" in body
    fragment = page.get("/lanes/tenants", params={"fragment": "1"}).text
    assert "<html" not in fragment and [g[:3] for g in _groups(fragment)] == [g[:3] for g in groups]


def test_a_lanes_page_shows_groups_only_for_a_lane_with_grouped_jobs(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    for _ in range(3):
        pglane.enqueue(conn, lane, {})
    plain = page.get(f"/lanes/{lane}").text
    assert '<table class="groups">' not in plain and f"No queued or running job of lane {lane} has a group." in plain
    pglane.create_lane(conn, "solo", job_timeout=60)  # one group waiting, and it has a name
    for _ in range(2):
        pglane.enqueue(conn, "solo", {}, group="acme")
    solo = _groups(page.get("/lanes/solo").text)
    assert [g[:3] + g[4:] for g in solo] == [["acme", "2", "0", "never"]] and solo[0][3].endswith(" s")
    pglane.create_lane(conn, "busy", job_timeout=60)  # nothing waiting: its one grouped job runs
    pglane.enqueue(conn, "busy", {}, group="acme")
    worker = session()
    take_slot(worker, "busy")
    claimed(worker, "busy")
    assert [g[:3] for g in _groups(page.get("/lanes/busy").text)] == [["acme", "0", "1"]]
    assert page.get("/lanes/nowhere").status_code == 404
    assert page.get("/lanes/Not a lane").status_code == 404


def test_a_job_shows_its_group_and_priority_and_when_it_waits_for_its_group(
    page: TestClient, conn: Any, session: Callable[..., Any]
) -> None:
    pglane.create_lane(conn, "tenants", job_timeout=60, slots=2, group_slots=1)
    first = pglane.enqueue(conn, "tenants", {}, group="acme", priority=3)
    second = pglane.enqueue(conn, "tenants", {}, group="acme")
    plain = pglane.enqueue(conn, "tenants", {})
    worker = session()
    take_slot(worker, "tenants")
    assert claimed(worker, "tenants")["job_id"] == first
    body = page.get(f"/jobs/{first}").text
    assert '<dt>group</dt><dd class="key">acme</dd>' in body
    assert "<dt>priority</dt><dd>3 (higher starts first)</dd>" in body
    assert '<a href="/lanes/tenants">tenants</a>' in body
    waiting = page.get(f"/jobs/{second}").text
    assert "<dt>priority</dt><dd>0</dd>" in waiting
    assert "group acme is at its limit of 1 running job(s)" in waiting
    assert "none (the lane&#39;s shared group)" in page.get(f"/jobs/{plain}").text


def test_every_value_from_the_database_is_shown_as_text(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    job, _ = failed_job(conn, session(), payload={"q": XSS}, key=XSS, error=f"ValueError: {XSS}", worker=XSS)
    conn.execute("SELECT set_config('application_name', %s, false)", (XSS,))  # shown among the slot's holders
    take_slot(conn, lane)
    for path in ("/", f"/jobs/{job}", "/jobs", f"/jobs?key={XSS}", f"/jobs/{job}?fragment=1"):
        body = page.get(path).text
        assert "<script>alert" not in body, path
    job_page = page.get(f"/jobs/{job}").text
    escaped = "&lt;script&gt;alert(&#39;pglane&#39;)&lt;/script&gt;"
    assert job_page.count(escaped) >= 4  # key, error (last error and the attempt's), worker, payload
    assert escaped in page.get("/").text


def test_read_only_by_default_offers_no_action_and_refuses_every_post(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    job, _ = failed_job(conn, session())
    before = snapshot(conn)
    assert "read-only" in page.get("/").text and "Retry" not in page.get(f"/jobs/{job}").text
    assert page.get("/confirm/retry", params={"job": job}).status_code == 403
    for action, target in (("retry", {"job": str(job)}), ("cancel", {"job": str(job)}), ("recover", {"lane": lane}),
                           ("end-stuck", {"lane": lane})):
        response = page.post(f"/actions/{action}", data={**target, "csrf": "x", "token": TOKEN})
        assert response.status_code == 403 and "read-only" in response.text
    assert snapshot(conn) == before


@pytest.mark.parametrize("spoil", ["no token", "wrong token", "no csrf", "wrong csrf", "csrf of another job",
                                   "no cookie"])
def test_a_post_without_the_token_or_its_csrf_field_gets_403_and_changes_nothing(
    acting: TestClient, conn: Any, lane: str, session: Callable[..., Any], spoil: str
) -> None:
    worker = session()
    job, _ = failed_job(conn, worker)
    other, _ = failed_job(conn, worker)
    form = {**confirm_form(acting, "retry", job=str(job)), "token": TOKEN}
    if spoil == "no token":
        del form["token"]
    elif spoil == "wrong token":
        form["token"] = TOKEN + "x"
    elif spoil == "no csrf":
        del form["csrf"]
    elif spoil == "wrong csrf":
        form["csrf"] = "0" * 64
    elif spoil == "csrf of another job":
        form["csrf"] = confirm_form(acting, "retry", job=str(other))["csrf"]
    else:
        acting.cookies.clear()
    before = snapshot(conn)
    response = acting.post("/actions/retry", data=form)
    assert response.status_code == 403, response.text
    assert ("token" in response.text) if "token" in spoil else ("CSRF" in response.text)
    assert snapshot(conn) == before


def test_a_retry_with_the_token_puts_the_failed_job_back_in_the_queue(
    acting: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    job, _ = failed_job(conn, session())
    assert f"/confirm/retry?job={job}" in acting.get(f"/jobs/{job}").text
    confirm = acting.get("/confirm/retry", params={"job": job}).text
    assert "it makes the paid call again" in confirm and 'type="password" name="token"' in confirm
    response = acting.post("/actions/retry", data={**confirm_form(acting, "retry", job=str(job)), "token": TOKEN})
    assert response.status_code == 200 and f"job {job} is queued again" in response.text
    assert pglane.job_status(conn, job)["status"] == "queued"
    again = acting.post("/actions/retry", data={**confirm_form(acting, "retry", job=str(job)), "token": TOKEN})
    assert again.status_code == 409 and "only failed or cancelled jobs can be retried" in again.text


def test_cancel_and_recover_with_the_token(
    acting: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    queued = pglane.enqueue(conn, lane, {})
    acted = acting.post("/actions/cancel", data={**confirm_form(acting, "cancel", job=str(queued)), "token": TOKEN})
    assert acted.status_code == 200 and pglane.job_status(conn, queued)["status"] == "cancelled"
    worker = session()
    job = pglane.enqueue(conn, lane, {})
    take_slot(worker, lane)
    attempt = claimed(worker, lane)["attempt_id"]
    pid = worker.info.backend_pid
    worker.close()  # the worker's session is gone: the evidence recovery needs
    wait_until(lambda: not conn.execute(queries.LIVE_SESSIONS, ([pid],)).fetchone()["n"], 10, "the session to end")
    assert "run: pglane recover brain" in acting.get("/").text
    form = {**confirm_form(acting, "recover", lane=lane), "token": TOKEN}
    recovered = acting.post("/actions/recover", data=form)
    assert recovered.status_code == 200 and "1 attempt(s) marked lost" in recovered.text
    assert conn.execute("SELECT status FROM pglane.attempts WHERE id = %s", (attempt,)).fetchone()["status"] == "lost"
    assert pglane.job_status(conn, job)["status"] == "failed"


def test_ending_stuck_sessions_with_the_token(acting: TestClient, dsn: str, conn: Any) -> None:
    """A worker hung past its lease with its session alive: the page ends that session (the operator's login
    also needs pg_signal_backend for this, as `pglane recover --terminate-stuck` does) and recovers it."""
    conn.execute("DO $$ BEGIN CREATE ROLE pglane_test_web_worker LOGIN; EXCEPTION WHEN duplicate_object THEN NULL;"
                 " END $$")
    conn.execute("GRANT pglane_worker TO pglane_test_web_worker")
    conn.execute(f"GRANT pg_signal_backend TO {WEB_LOGIN}")
    try:
        pglane.create_lane(conn, "slow", job_timeout=1, lease_timeout=2)
        job = pglane.enqueue(conn, "slow", {})
        with pglane.connect(make_conninfo(dsn, user="pglane_test_web_worker")) as hung:
            take_slot(hung, "slow")
            attempt = claimed(hung, "slow")["attempt_id"]
            wait_until(lambda: next(r for r in pglane.lane_status(conn) if r["lane"] == "slow")["stuck"] == 1, 10,
                       "the attempt to pass its lease")
            assert "/confirm/end-stuck?lane=slow" in acting.get("/").text
            form = {**confirm_form(acting, "end-stuck", lane="slow"), "token": TOKEN}
            ended = acting.post("/actions/end-stuck", data=form)
            assert ended.status_code == 200, ended.text
            assert "ended 1 stuck session(s); 1 attempt(s) marked lost" in ended.text
            with pytest.raises(psycopg.OperationalError):  # its session was ended
                hung.execute("SELECT 1")
    finally:
        conn.execute(f"REVOKE pg_signal_backend FROM {WEB_LOGIN}")
    assert conn.execute("SELECT status FROM pglane.attempts WHERE id = %s", (attempt,)).fetchone()["status"] == "lost"
    assert pglane.job_status(conn, job)["status"] == "failed"

def test_no_get_changes_anything(acting: TestClient, conn: Any, lane: str, session: Callable[..., Any]) -> None:
    failed, _ = failed_job(conn, session())
    queued = pglane.enqueue(conn, lane, {})
    before = snapshot(conn)
    paths = ["/", "/?fragment=1", "/jobs", "/jobs?status=failed&fragment=1", f"/jobs/{failed}", f"/jobs/{queued}",
             f"/confirm/retry?job={failed}", f"/confirm/cancel?job={queued}", f"/confirm/recover?lane={lane}",
             f"/confirm/end-stuck?lane={lane}", f"/actions/retry?job={failed}&token={TOKEN}",
             f"/actions/cancel?job={queued}&token={TOKEN}", f"/actions/recover?lane={lane}&token={TOKEN}"]
    for path in paths:
        response = acting.get(path)
        assert response.status_code == (405 if path.startswith("/actions/") else 200), path
    assert snapshot(conn) == before


def test_every_response_carries_the_security_headers_and_no_inline_script(page: TestClient, lane: str) -> None:
    for path in ("/", "/jobs", "/jobs/1", "/static/refresh.js", "/static/pglane.css", "/nowhere"):
        response = page.get(path)
        csp = response.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        if response.headers["content-type"].startswith("text/html"):
            assert not re.search(r"<script(?![^>]*\bsrc=)", response.text), path


def test_the_refreshed_fragment_is_the_pages_inner_part(page: TestClient, conn: Any, lane: str) -> None:
    whole = page.get("/").text
    part = page.get("/?fragment=1").text
    assert "<html" in whole and 'data-refresh="5"' in whole and "refresh.js" in whole
    assert "<html" not in part and 'id="lane-brain"' in part
    pglane.enqueue(conn, lane, {})
    assert re.search(r"status=queued\">1</a>", page.get("/?fragment=1").text)


def test_the_last_hour_counts_attempts_per_minute_depth_and_wait(
    page: TestClient, conn: Any, lane: str, session: Callable[..., Any]
) -> None:
    pglane.create_lane(conn, "email", job_timeout=60)
    worker = session()
    before_the_hour = pglane.enqueue(conn, "email", {})  # waiting since before the hour began
    conn.execute("UPDATE pglane.jobs SET created_at = now() - interval '2 hours' WHERE id = %s", (before_the_hour,))
    waiting = [pglane.enqueue(conn, lane, {}) for _ in range(3)]
    conn.execute("UPDATE pglane.jobs SET created_at = created_at - interval '3 seconds' WHERE id = ANY(%s)",
                 (waiting,))
    take_slot(worker, lane)
    first = claimed(worker, lane)
    worker.execute(queries.COMPLETE, (first["attempt_id"], "{}", first["token"]))
    second = claimed(worker, lane)
    worker.execute(queries.FAIL, (second["attempt_id"], "boom", False, second["token"]))
    every = conn.execute(web_queries.LAST_HOUR, {"lanes": ["email", lane]}).fetchall()
    assert [r["depth"] for r in every if r["lane"] == "email"] == [1] * 60
    rows = [r for r in every if r["lane"] == lane]
    assert len(rows) == 60 and rows[0]["depth"] == 0
    assert sum(r["started"] for r in rows) == 2 and sum(r["finished"] for r in rows) == 1
    assert sum(r["failed"] for r in rows) == 1
    assert rows[-1]["depth"] == 1  # one job still queued now
    assert max(r["wait_max"] or 0 for r in rows) >= 3  # they waited at least the 3 s moved back
    body = page.get("/").text
    assert "started 2" in body and "finished 1" in body and "failed 1" in body


class WebServer:
    """`pglane web` as a subprocess on a free port (--port 0), its log in a file: for the command's own
    tests and the browser's."""

    def __init__(self, dsn: str, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pglane", "web", "--port", "0", *args],
            env={**os.environ, "PGLANE_DSN": dsn, **(env or {})}, cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=log.open("wb"),
        )
        found = wait_until(lambda: self.proc.poll() is not None or re.search(
            r"pglane web on http://([^ ]+):(\d+)/", self.log()), 30, "pglane web to say where it listens")
        assert not isinstance(found, bool), f"pglane web exited: {self.log()}"
        self.host, self.port = found.group(1), int(found.group(2))
        self.url = f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(15)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses listening on ``port``, from the kernel's own table (IPv4)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hexport = local.split(":")
        if int(hexport, 16) == port and state == "0A":  # LISTEN
            out.add(".".join(str(int(address[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_pglane_web_listens_on_127_0_0_1_only_by_default(operator_dsn: str, lane: str, tmp_path: Path) -> None:
    server = WebServer(operator_dsn, tmp_path / "web.log")
    try:
        assert server.host == "127.0.0.1" and "read-only" in server.log()
        assert _listening_addresses(server.port) == {"127.0.0.1"}
        import urllib.error
        import urllib.request

        with urllib.request.urlopen(server.url + "/", timeout=10) as response:
            assert 'id="lane-brain"' in response.read().decode()
        rebound = urllib.request.Request(server.url + "/", headers={"Host": f"rebound.example:{server.port}"})
        with pytest.raises(urllib.error.HTTPError) as refused:  # a DNS name rebound to 127.0.0.1 reads nothing
            urllib.request.urlopen(rebound, timeout=10)
        assert refused.value.code == 400
    finally:
        server.stop()


def test_behind_a_proxy_that_strips_a_path_prefix_the_links_keep_it(
    operator_dsn: str, lane: str, tmp_path: Path
) -> None:
    import urllib.request

    server = WebServer(operator_dsn, tmp_path / "web.log", "--root-path", "/pglane")
    try:  # the proxy passes /pglane/jobs on as /jobs (nginx: location /pglane/ { proxy_pass http://127.0.0.1:PORT/; })
        with urllib.request.urlopen(server.url + "/jobs", timeout=10) as response:
            body = response.read().decode()
        assert 'href="/pglane/static/pglane.css"' in body and 'href="/pglane/jobs"' in body
    finally:
        server.stop()


def test_an_unreachable_database_is_a_503_that_says_so(lane: str) -> None:
    with TestClient(create_app("host=127.0.0.1 port=1 dbname=nowhere connect_timeout=1")) as c:
        response = c.get("/")
    assert response.status_code == 503 and "cannot reach the database" in response.text

def test_allow_actions_needs_a_token(operator_dsn: str, tmp_path: Path) -> None:
    env = {**os.environ, "PGLANE_DSN": operator_dsn}
    env.pop("PGLANE_WEB_TOKEN", None)
    for extra, token_env in (([], None), ([], "short"), (["--token-file", str(tmp_path / "missing")], None)):
        run = subprocess.run([sys.executable, "-m", "pglane", "web", "--port", "0", "--allow-actions", *extra],
                             env={**env, **({"PGLANE_WEB_TOKEN": token_env} if token_env else {})},
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert run.returncode == 2, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1 and "token" in run.stderr


def test_pglane_web_without_its_extra_says_what_to_install(dsn: str) -> None:
    code = ("import sys; sys.modules['starlette'] = None; from pglane.cli import main; "
            "sys.exit(main(['web', '--port', '0']))")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PGLANE_DSN": dsn},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.strip() == ("pglane: pglane web needs its extra (starlette is missing): "
                                  "pip install 'pglane[web]'")


def test_the_readmes_screenshots_are_the_ones_the_browser_tests_take() -> None:
    readme = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"\(screenshots/([\w.-]+\.png)\)", readme))
    taken = set(re.findall(r'SCREENSHOTS / "([\w.-]+\.png)"', (ROOT / "tests" / "test_web_browser.py").read_text()))
    assert {"lanes.png", "failed-job.png"} <= shown <= taken
