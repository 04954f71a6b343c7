"""Prometheus metrics of one worker process (optional: ``pip install 'pglane[metrics]'``).

Owns the worker's metric objects and the HTTP endpoint that serves them. Counters count what this
process did; the queue gauges are read from the database (the queue and running-attempt indexes, so the cost
does not grow with history) every ``refresh`` seconds on a connection of their own, never the slot session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from . import queries
from .errors import ConfigurationError

log = logging.getLogger("pglane.worker")


class Metrics:
    def __init__(self, lane: str, port: int, *, addr: str = "127.0.0.1") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise ConfigurationError(
                "--metrics-port needs prometheus-client: pip install 'pglane[metrics]'") from None
        self.lane = lane
        self.registry = prom.CollectorRegistry()
        labels = ["lane"]

        def gauge(name: str, text: str) -> Any:
            return prom.Gauge(name, text, labels, registry=self.registry).labels(lane)

        self.slot_held = gauge("pglane_slot_held", "1 while this worker holds a slot of the lane, 0 as a standby")
        self.queue_depth = gauge("pglane_queue_depth", "queued jobs of the lane (eligible or not)")
        self.oldest_queued = gauge("pglane_oldest_queued_age_seconds", "age of the lane's oldest queued job")
        self.running = gauge("pglane_running_jobs", "running jobs of the lane, all workers")
        self.rate_window = gauge("pglane_rate_window_used", "cost the lane started in its rate window now "
                                 "(its rate limit is the most it may reach); 0 on a lane without one")
        self.paused = gauge("pglane_lane_paused", "1 while the lane is paused (it accepts jobs and starts none: "
                            "pglane lane resume), else 0")
        self.done = prom.Counter("pglane_jobs_done", "results this worker stored", labels,
                                 registry=self.registry).labels(lane)
        self.failed = prom.Counter("pglane_jobs_failed", "attempts this worker recorded failed or timed out", labels,
                                   registry=self.registry).labels(lane)
        self.deferred = prom.Counter("pglane_jobs_deferred", "attempts this worker recorded deferred (the handler "
                                     "raised RetryLater: nothing paid)", labels, registry=self.registry).labels(lane)
        self.duration = prom.Histogram(
            "pglane_attempt_duration_seconds", "handler time per attempt", labels, registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800)).labels(lane)
        self.claim_latency = prom.Histogram(
            "pglane_claim_latency_seconds", "round trip of a claim (alone or fused with a completion)", labels,
            registry=self.registry,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5)).labels(lane)
        self.server, self.thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics on http://%s:%s/metrics", addr, self.server.server_port)  # port 0: the one chosen

    async def refresh_forever(self, dsn: str, every: float = 5.0) -> None:
        """Read the lane's queue gauges until cancelled; database errors only delay the next reading."""
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
                    cur = await conn.execute(queries.QUEUE_GAUGES, {"lane": self.lane})
                    row = await cur.fetchone()
                    if row is not None:
                        self.queue_depth.set(row[0])
                        self.oldest_queued.set(row[1])
                        self.running.set(row[2])
                        self.rate_window.set(row[3] or 0)
                        self.paused.set(1 if row[4] else 0)
                except psycopg.Error:
                    if conn is not None:
                        await conn.close()
                    conn = None
                await asyncio.sleep(every)
        finally:
            if conn is not None:
                with contextlib.suppress(psycopg.Error):
                    await conn.close()

    def close(self) -> None:
        self.server.shutdown()
