"""The operator's page under load and attack (#30): paged job and lane lists that cost what they
show, a statement timeout and a bounded pool wait, refusals before a body is read, and the Host check
on every bind. Every test talks real HTTP to a real `pglane web` process or to the application served
by uvicorn, against the real database."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette", reason="the web page's tests need pglane[web]")

from tests.test_web import WebServer, operator_dsn  # noqa: F401  (a fixture)

SEED_JOBS = 100_000
SEED_LANES = 2_000


def seed(conn: Any, jobs: int = SEED_JOBS, lanes: int = SEED_LANES, lane: str = "brain") -> None:
    """``lanes`` lanes l0.. and ``jobs`` queued jobs in ``lane``, each in one statement."""
    conn.execute("INSERT INTO pglane.lanes (name) SELECT 'l' || g FROM generate_series(0, %s - 1) g", (lanes,))
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT %s, jsonb_build_object('n', g)"
                 " FROM generate_series(1, %s) g", (lane, jobs))
    conn.execute("ANALYZE pglane.jobs")
    conn.execute("ANALYZE pglane.lanes")


@pytest.mark.skipif(not os.environ.get("PGLANE_WEB_MEASURE"), reason="a measurement: set PGLANE_WEB_MEASURE=1")
def test_measure_page_times(operator_dsn: str, conn: Any, lane: str, tmp_path: Path) -> None:  # noqa: F811
    seed(conn)
    server = WebServer(operator_dsn, tmp_path / "web.log")
    try:
        with httpx.Client(base_url=server.url, timeout=float(os.environ.get("PGLANE_WEB_MEASURE_TIMEOUT", "120"))) as c:
            for path in ("/", "/?fragment=1", "/jobs", "/jobs?status=queued", "/jobs?lane=brain",
                         "/jobs?status=failed", "/jobs?key=nothing"):
                started = time.monotonic()
                try:
                    r = c.get(path)
                    said = f"{r.status_code} {len(r.content)} bytes"
                except httpx.TimeoutException:
                    said = "client timeout"
                print(f"MEASURE {path}: {time.monotonic() - started:.3f} s, {said}")
    finally:
        server.stop()
