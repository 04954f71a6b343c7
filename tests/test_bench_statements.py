"""The bench sends pglane's own statements with parameters of its own making: when a statement gains a
parameter (enqueue's cost did), the bench's runs must not fail where no test looks (a full run's
wake, takeover and enqueue scenarios did, once). Each enqueue variant the bench times runs here, on a
real server, and queues exactly the jobs it was asked for."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from bench.pglane_runs import ENQ_LANES, ENQUEUE_VARIANTS, enqueue_params
from pglane import client, queries


@pytest.mark.parametrize("variant", sorted(ENQUEUE_VARIANTS))
def test_every_enqueue_variant_of_the_bench_queues_the_jobs_it_is_asked_for(
        conn: psycopg.Connection[dict[str, Any]], variant: str) -> None:
    for name, bound in ENQ_LANES.items():
        client.create_lane(conn, name, max_queued=bound)
    ENQUEUE_VARIANTS[variant](conn, 3)
    rows = conn.execute("SELECT lane, payload, cost FROM pglane.jobs ORDER BY id").fetchall()
    assert [r["payload"] for r in rows] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert len({r["lane"] for r in rows}) == 1 and all(r["cost"] == 1 for r in rows)


def test_the_wake_and_takeover_producers_parameters_fit_enqueue(conn: psycopg.Connection[dict[str, Any]]) -> None:
    client.create_lane(conn, "takeover")
    row = conn.execute(queries.ENQUEUE, enqueue_params("takeover", '{"n": 7, "sleep": 60}')).fetchone()
    assert row is not None
    job = conn.execute("SELECT lane, payload, status FROM pglane.jobs").fetchone()
    assert job == {"lane": "takeover", "payload": {"n": 7, "sleep": 60}, "status": "queued"}
