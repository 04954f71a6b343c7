"""The operator's page and a paused lane (#33), against the real database as a login holding only
pglane_operator: a paused lane is shown paused with its end, who paused it and why (escaped); with
--allow-actions its Resume action, confirmed with the token and the CSRF field as every action is,
ends the pause; without either, or on a read-only page, it is refused with 403 and nothing changes."""

from __future__ import annotations

import re
from datetime import UTC
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web page's tests need pglane[web]")
from starlette.testclient import TestClient

import pglane
from tests import test_web
from tests.test_web import TOKEN, XSS, confirm_form

# test_web's fixtures: the operator's login (pglane_operator only), the read-only page and the acting one.
operator_dsn, page, acting = test_web.operator_dsn, test_web.page, test_web.acting


def section(body: str, lane: str) -> str:
    """One lane's section of the lanes page."""
    start = body.index(f'id="lane-{lane}"')
    end = body.find('<section class="lane"', start)
    return body[start:end if end != -1 else len(body)]


def pause_state(conn: Any) -> Any:
    """Everything a pause or a resume writes: the counters' ends ('infinity' as text) and the records."""
    return conn.execute("SELECT (SELECT json_agg(c.paused_until::text ORDER BY c.lane_id) FROM pglane.lane_counters c)"
                        " AS until, (SELECT json_agg(p ORDER BY p.lane_id) FROM pglane.lane_pauses p) AS pauses"
                        ).fetchone()


def paused(conn: Any, lane: str = "brain") -> bool:
    return bool(conn.execute("SELECT paused FROM pglane.lane_status WHERE lane = %s", (lane,)).fetchone()["paused"])


def test_a_paused_lane_is_shown_paused_with_its_end_who_and_why(page: TestClient, conn: Any, lane: str) -> None:
    pglane.create_lane(conn, "email", job_timeout=60)
    pglane.create_lane(conn, "free", job_timeout=60)
    pglane.pause_lane(conn, lane, reason=f"provider answers 429 {XSS}")
    pglane.pause_lane(conn, "email", for_seconds=3600, reason="maintenance window")
    until = conn.execute("SELECT paused_until FROM pglane.lane_status WHERE lane = 'email'").fetchone()["paused_until"]
    me = conn.execute("SELECT current_user AS u").fetchone()["u"]
    body = page.get("/").text
    brain = section(body, lane)
    assert '<span class="tag warn">paused</span>' in brain
    assert f"paused until resumed by {me}</span> provider answers 429 &lt;script&gt;" in brain
    assert XSS not in body
    assert "resume it now with: pglane lane resume brain" in brain  # the next safe action says so too
    email = section(body, "email")
    assert f"paused until {until.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC by {me}</span> maintenance window" in email
    free = section(body, "free")
    assert "paused" not in free
    assert "Resume" not in body  # read-only: no action offered
    own = page.get(f"/lanes/{lane}").text
    assert '<span class="tag warn">paused</span>' in own and "provider answers 429 &lt;script&gt;" in own
    pglane.resume_lane(conn, lane)
    assert '<span class="tag warn">paused</span>' not in section(page.get("/").text, lane)


def test_resume_with_the_token_and_its_csrf_field_ends_the_pause(acting: TestClient, conn: Any, lane: str) -> None:
    pglane.create_lane(conn, "free", job_timeout=60)
    pglane.pause_lane(conn, lane, reason="provider down")
    body = acting.get("/").text
    assert f"/confirm/resume?lane={lane}" in section(body, lane)
    assert "/confirm/resume" not in section(body, "free")  # nothing to resume there
    confirm = acting.get("/confirm/resume", params={"lane": lane}).text
    assert "Resume ends lane brain&#39;s pause now" in confirm and 'type="password" name="token"' in confirm
    assert "lane brain now: paused until resumed" in confirm and "provider down" in confirm
    assert paused(conn)  # opening the confirmation changes nothing
    response = acting.post("/actions/resume", data={**confirm_form(acting, "resume", lane=lane), "token": TOKEN})
    assert response.status_code == 200, response.text
    assert "Done: resume lane brain" in response.text
    assert "lane brain resumed: its workers start jobs again" in response.text
    assert not paused(conn)
    resumed_by = conn.execute("SELECT resumed_by FROM pglane.lane_pauses").fetchone()["resumed_by"]
    assert resumed_by == "pglane_test_web"  # the page's own login, recorded on the pause
    again = acting.post("/actions/resume", data={**confirm_form(acting, "resume", lane=lane), "token": TOKEN})
    assert again.status_code == 200 and "lane brain is not paused: nothing changed" in again.text
    assert acting.get("/confirm/resume", params={"lane": "ghost"}).status_code == 404


@pytest.mark.parametrize("spoil", ["no token", "wrong token", "no csrf", "wrong csrf", "csrf of another lane",
                                   "csrf of another action", "no cookie"])
def test_a_resume_without_the_token_or_its_csrf_field_gets_403_and_changes_nothing(
    acting: TestClient, conn: Any, lane: str, spoil: str
) -> None:
    pglane.create_lane(conn, "email", job_timeout=60)
    pglane.pause_lane(conn, lane, reason="provider down")
    pglane.pause_lane(conn, "email", reason="provider down")
    form = {**confirm_form(acting, "resume", lane=lane), "token": TOKEN}
    if spoil == "no token":
        del form["token"]
    elif spoil == "wrong token":
        form["token"] = TOKEN + "x"
    elif spoil == "no csrf":
        del form["csrf"]
    elif spoil == "wrong csrf":
        form["csrf"] = "0" * 64
    elif spoil == "csrf of another lane":
        form["csrf"] = confirm_form(acting, "resume", lane="email")["csrf"]
    elif spoil == "csrf of another action":
        form["csrf"] = confirm_form(acting, "recover", lane=lane)["csrf"]
    else:
        acting.cookies.clear()
    before = pause_state(conn)
    response = acting.post("/actions/resume", data=form)
    assert response.status_code == 403, response.text
    assert ("token" in response.text) if "token" in spoil else ("CSRF" in response.text)
    assert pause_state(conn) == before and paused(conn) and paused(conn, "email")


def test_a_read_only_page_offers_no_resume_and_refuses_it(page: TestClient, conn: Any, lane: str) -> None:
    pglane.pause_lane(conn, lane, reason="provider down")
    before = pause_state(conn)
    assert "/confirm/resume" not in page.get("/").text
    assert page.get("/confirm/resume", params={"lane": lane}).status_code == 403
    response = page.post("/actions/resume", data={"lane": lane, "csrf": "x", "token": TOKEN})
    assert response.status_code == 403 and "read-only" in response.text
    assert pause_state(conn) == before and paused(conn)


def test_no_get_resumes_a_lane(acting: TestClient, conn: Any, lane: str) -> None:
    pglane.pause_lane(conn, lane, reason="provider down")
    before = pause_state(conn)
    for path in ("/", f"/lanes/{lane}", f"/confirm/resume?lane={lane}", f"/actions/resume?lane={lane}&token={TOKEN}"):
        response = acting.get(path)
        assert response.status_code == (405 if path.startswith("/actions/") else 200), path
    assert re.search(r'name="lane" value="brain"', acting.get(f"/confirm/resume?lane={lane}").text)
    assert pause_state(conn) == before and paused(conn)
