"""The Grafana dashboard (docs/grafana/pglane.json) reads what a real worker exports: every metric its
queries name is one a worker process serves on --metrics-port, and every panel filters by the lane."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pglane
from tests.conftest import Workers, metrics_port, wait_until

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana" / "pglane.json"


def test_every_metric_the_dashboard_queries_is_one_a_worker_exports(conn: Any, workers: Workers) -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    wanted = {name for expr in exprs for name in re.findall(r"\bpglane_[a-z_]+", expr)}
    # what issue #36 asked the dashboard to show
    assert {"pglane_queue_depth", "pglane_job_wait_seconds_bucket", "pglane_jobs_done_total",
            "pglane_jobs_failed_total", "pglane_jobs_deferred_total", "pglane_slot_held", "pglane_rate_window_used",
            "pglane_lane_paused"} <= wanted
    assert all('lane=~"$lane"' in expr for expr in exprs)

    pglane.create_lane(conn, "watched", job_timeout=20)
    port = metrics_port(workers.start("watched", "tests.handlers:paid_call", "--metrics-port", "0"))
    job = pglane.enqueue(conn, "watched", {})
    wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 30, "the job")

    def exported() -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("pglane_")}

    missing = wanted - exported()
    assert missing == set(), f"the dashboard queries metrics no worker exports: {sorted(missing)}"
