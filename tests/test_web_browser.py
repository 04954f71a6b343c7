"""The operator's page in a real browser: headless Chromium (Debian's `chromium` package, driven by
Playwright without a browser download of its own) against `pglane web` run as a command, on a
database the test seeds with a real worker. It reads each page as a person would, takes the README's
screenshots (docs/screenshots/), retries a failed job end to end with the token and is refused
without it, sees the page refresh in place, and reads it with JavaScript off.

Without chromium these tests are skipped, saying so; they never pass without a browser."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the web page's tests need pglane[web]")
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the browser tests need Playwright: pip install -e '.[dev]'")
CHROMIUM = os.environ.get("PGLANE_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no chromium: the web page's browser tests were skipped; install Debian's chromium package "
                "(apt-get install chromium), as .ci/run does", allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

import pglane  # noqa: E402
from pglane import queries  # noqa: E402
from tests.conftest import ROOT, Ledger, Workers, take_slot, wait_until  # noqa: E402
from tests.test_web import TOKEN, WebServer, operator_dsn  # noqa: E402, F401 - operator_dsn: the fixture, shared

SCREENSHOTS = ROOT / "docs" / "screenshots"  # written by these tests: lanes.png, failed-job.png, confirm-retry.png
VIEWPORT = {"width": 1280, "height": 900}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM is not None
    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # chromium's sandbox refuses to run as root
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield b
        b.close()


@pytest.fixture
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WebServer]:
    """`pglane web --allow-actions` with the token in PGLANE_WEB_TOKEN, connected as the operator's login
    (tests.test_web's operator_dsn: a login holding pglane_operator only)."""
    dsn = request.getfixturevalue("operator_dsn")
    s = WebServer(dsn, tmp_path / "web.log", "--allow-actions", env={"PGLANE_WEB_TOKEN": TOKEN})
    yield s
    s.stop()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser tab; the test fails if the page broke its own Content-Security-Policy or its script.
    Tests ask for ``server`` before ``page``, so the tab closes before the server stops (a refresh of a
    stopped server is no fault of the page's)."""
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    tab = context.new_page()
    problems: list[str] = []
    tab.on("console", lambda m: problems.append(m.text) if m.type == "error" and "403" not in m.text else None)
    tab.on("pageerror", lambda e: problems.append(str(e)))
    yield tab
    context.close()
    assert not problems, problems


def seed_history(conn: Any, worker: Any, lane: str, count: int = 48) -> None:
    """An hour of a lane's past, for the charts: ``count`` jobs run through the worker's SQL functions
    (claim, then complete, or fail every ninth), then moved back in time, each with its own wait and
    length, as whole jobs (job and attempt together), so they read as the hour it would have been."""
    take_slot(worker, lane)
    for i in range(count):
        pglane.enqueue(conn, lane, {"report": i})
        with pglane.client.translated():
            row = worker.execute(queries.CLAIM, (lane, "worker-1")).fetchone()
        assert row is not None
        if i % 9 == 4:
            worker.execute(queries.FAIL, (row["attempt_id"], "RuntimeError: provider answered 503", False,
                                          row["token"]))
        else:
            worker.execute(queries.COMPLETE, (row["attempt_id"], '{"ok": true}', row["token"]))
        back = timedelta(minutes=58 * (count - i) / count)
        wait, length = timedelta(seconds=(i * 37) % 170), timedelta(seconds=20 + (i * 13) % 40)
        conn.execute("UPDATE pglane.jobs SET created_at = created_at - %(back)s - %(wait)s,"
                     " run_after = run_after - %(back)s - %(wait)s, started_at = started_at - %(back)s,"
                     " finished_at = finished_at - %(back)s + %(len)s WHERE id = %(job)s",
                     {"back": back, "wait": wait, "len": length, "job": row["job_id"]})
        conn.execute("UPDATE pglane.attempts SET started_at = started_at - %(back)s,"
                     " finished_at = finished_at - %(back)s + %(len)s, lease_expires_at = lease_expires_at - %(back)s"
                     " WHERE id = %(attempt)s", {"back": back, "len": length, "attempt": row["attempt_id"]})
    worker.execute(queries.RELEASE_SLOT, (int(conn.execute(queries.LANES, {"name": lane}).fetchone()["id"]), 1))


def failed_by_a_worker(conn: Any, workers: Workers, lane: str) -> int:
    """A job a real worker ran and whose handler raised: the failure an operator meets."""
    job = pglane.enqueue(conn, lane, {"q": "summarise report 7", "fail": "provider answered 402: payment required"},
                         key="report-7")
    workers.start(lane)
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "failed", 30, "the worker to fail the job")
    return job


def section(tab: Page, lane: str) -> Any:
    return tab.locator(f"#lane-{lane}")


def test_the_lanes_page_shows_what_each_lane_does_and_its_last_hour(
    server: WebServer, page: Page, conn: Any, lane: str, session: Callable[..., Any], workers: Workers
) -> None:
    seed_history(conn, session(), lane)
    pglane.create_lane(conn, "email", slots=2, job_timeout=60)
    for n in range(3):
        pglane.enqueue(conn, "email", {"to": f"customer-{n}"})
    conn.execute("UPDATE pglane.jobs SET created_at = created_at - interval '4 minutes' WHERE lane = 'email'")
    failed_by_a_worker(conn, workers, lane)
    running = pglane.enqueue(conn, lane, {"sleep": 60})
    for _ in range(2):
        pglane.enqueue(conn, lane, {})
    wait_until(lambda: pglane.job_status(conn, running)["status"] == "running", 30, "the worker to take the long job")

    page.goto(server.url + "/")
    brain, email = section(page, lane), section(page, "email")
    expect(email.locator(".action")).to_contain_text(
        "start a worker for lane email: pglane worker email --handler MODULE:CALLABLE")
    expect(email).to_contain_text("0 / 2")
    expect(email).to_contain_text("No session holds a slot of this lane")
    expect(brain).to_contain_text("1 / 1")
    expect(brain.locator("table.holders")).to_contain_text("holds")
    expect(brain.locator("svg")).to_have_count(3)
    expect(brain.locator("figure.chart").first).to_contain_text("started 50")  # 48 seeded, the failed one, the long one
    assert brain.locator("svg polyline.depth").get_attribute("points")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "lanes.png"), full_page=True)


def test_a_failed_job_says_which_attempt_failed_why_and_what_to_do(
    server: WebServer, page: Page, conn: Any, lane: str, workers: Workers
) -> None:
    job = failed_by_a_worker(conn, workers, lane)
    attempt = pglane.job_status(conn, job)["attempt_id"]
    page.goto(server.url + "/jobs?status=failed")
    page.get_by_role("link", name=str(job), exact=True).click()
    expect(page.locator("h1")).to_contain_text(f"Job {job}")
    expect(page.locator(".action")).to_contain_text(
        f"inspect attempt {attempt}: the handler failed; fix the cause, then: pglane retry {job}")
    attempts = page.locator("table.attempts")
    expect(attempts).to_contain_text("failed")
    expect(attempts.locator("pre.error")).to_contain_text("RuntimeError: provider answered 402: payment required")
    expect(page.locator("pre.payload")).to_contain_text("summarise report 7")
    expect(page.get_by_role("link", name="Retry…")).to_be_visible()
    page.screenshot(path=str(SCREENSHOTS / "failed-job.png"), full_page=True)


def test_a_retry_runs_end_to_end_with_the_token_and_is_refused_without_it(
    server: WebServer, page: Page, conn: Any, lane: str, workers: Workers, ledger: Ledger
) -> None:
    job = failed_by_a_worker(conn, workers, lane)
    assert ledger.calls().count(job) == 1
    page.goto(f"{server.url}/jobs/{job}")
    page.get_by_role("link", name="Retry…").click()
    expect(page.locator(".cost")).to_contain_text("it makes the paid call again")
    page.screenshot(path=str(SCREENSHOTS / "confirm-retry.png"))

    page.get_by_label("action token").fill("not the token, but long enough")
    page.get_by_role("button", name=f"Retry job {job}").click()
    expect(page.locator("h1")).to_have_text("403")
    expect(page.locator(".outcome")).to_contain_text("a missing or wrong action token: nothing was done")
    assert pglane.job_status(conn, job)["status"] == "failed" and ledger.calls().count(job) == 1

    page.go_back()
    page.get_by_label("action token").fill(TOKEN)
    page.get_by_role("button", name=f"Retry job {job}").click()
    expect(page.locator(".outcome")).to_contain_text(f"job {job} is queued again")
    # The worker makes the paid call again (and this handler fails again): the cost the page named.
    wait_until(lambda: ledger.calls().count(job) == 2, 30, "the retried job's second call")
    wait_until(lambda: pglane.job_status(conn, job)["attempts"] == 2, 30, "the second attempt to be recorded")
    page.get_by_role("link", name=f"Back to job {job}").click()
    expect(page.locator("table.attempts tbody tr.status-failed")).to_have_count(2)


def test_the_page_refreshes_in_place(server: WebServer, page: Page, conn: Any, lane: str) -> None:
    page.goto(server.url + "/")
    queued = section(page, lane).locator("a[href$='status=queued']")
    expect(queued).to_have_text("0")
    page.evaluate("window.pglaneNotReloaded = true")
    for _ in range(3):
        pglane.enqueue(conn, lane, {})
    expect(queued).to_have_text("3", timeout=15_000)
    assert page.evaluate("window.pglaneNotReloaded === true"), "the page reloaded instead of refreshing its part"


def test_a_lanes_own_page_shows_its_busiest_groups_and_refreshes_them_in_place(
    server: WebServer, page: Page, conn: Any, lane: str
) -> None:
    for group, n in (("acme", 3), ("beta", 1)):
        for _ in range(n):
            pglane.enqueue(conn, lane, {}, group=group)
    page.goto(server.url + "/")
    section(page, lane).locator("a[href$='#groups']").click()  # its groups waiting: 2
    expect(page.locator("h1")).to_have_text(f"Lane {lane}")
    rows = page.locator("table.groups tbody tr")
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("acme")
    page.evaluate("window.pglaneNotReloaded = true")
    for _ in range(4):
        pglane.enqueue(conn, lane, {}, group="gamma")
    expect(rows).to_have_count(3, timeout=15_000)
    expect(rows.first).to_contain_text("gamma")  # the deepest queue first
    assert page.evaluate("window.pglaneNotReloaded === true"), "the page reloaded instead of refreshing its part"


def test_reading_works_with_javascript_off(
    browser: Browser, server: WebServer, conn: Any, lane: str, workers: Workers
) -> None:
    job = failed_by_a_worker(conn, workers, lane)
    context = browser.new_context(java_script_enabled=False, viewport=VIEWPORT)  # type: ignore[arg-type]
    try:
        tab = context.new_page()
        tab.goto(server.url + "/")
        expect(section(tab, lane).locator(".action")).to_contain_text("nothing to do")
        expect(section(tab, lane).locator("a[href$='status=failed']")).to_have_text("1")
        expect(section(tab, lane).locator("svg")).to_have_count(3)
        tab.goto(f"{server.url}/jobs?lane={lane}&status=failed")
        expect(tab.locator("table.jobs")).to_contain_text(f"pglane retry {job}")
        tab.goto(f"{server.url}/jobs/{job}")
        expect(tab.locator("table.attempts")).to_contain_text("provider answered 402")
    finally:
        context.close()
