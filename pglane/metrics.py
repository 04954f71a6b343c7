"""Prometheus metrics of one worker process (optional: ``pip install 'pglane[metrics]'``).

Owns the worker's metric objects and the one HTTP endpoint that serves them, for every lane the process
serves (each metric has a ``lane`` label). Counters count what this process did; the queue gauges are read
from the database (the queue and running-attempt indexes, so the cost does not grow with history) every
``refresh`` seconds, one query per lane, on a connection of their own, never a slot session.
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


class LaneMetrics:
    """One lane's metric children (every metric carries the ``lane`` label)."""

    def __init__(self, families: dict[str, Any], lane: str) -> None:
        self.lane = lane
        self.slot_held = families["slot_held"].labels(lane)
        self.queue_depth = families["queue_depth"].labels(lane)
        self.oldest_queued = families["oldest_queued"].labels(lane)
        self.running = families["running"].labels(lane)
        self.rate_window = families["rate_window"].labels(lane)
        self.paused = families["paused"].labels(lane)
        self.done = families["done"].labels(lane)
        self.failed = families["failed"].labels(lane)
        self.deferred = families["deferred"].labels(lane)
        self.duration = families["duration"].labels(lane)
        self.claim_latency = families["claim_latency"].labels(lane)
        self.wait = families["wait"].labels(lane)


class Metrics:
    """The process's registry and its one HTTP endpoint; ``lane()`` gives each lane its children."""

    def __init__(self, port: int, *, addr: str = "127.0.0.1") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise ConfigurationError(
                "--metrics-port needs prometheus-client: pip install 'pglane[metrics]'") from None
        self.registry = prom.CollectorRegistry()
        self.lanes: dict[str, LaneMetrics] = {}
        labels = ["lane"]

        def gauge(name: str, text: str) -> Any:
            return prom.Gauge(name, text, labels, registry=self.registry)

        self._families: dict[str, Any] = {
            "slot_held": gauge("pglane_slot_held", "slots of the lane this worker process holds (0: it waits as "
                               "a standby)"),
            "queue_depth": gauge("pglane_queue_depth", "queued jobs of the lane (eligible or not)"),
            "oldest_queued": gauge("pglane_oldest_queued_age_seconds", "age of the lane's oldest queued job"),
            "running": gauge("pglane_running_jobs", "running jobs of the lane, all workers"),
            "rate_window": gauge("pglane_rate_window_used", "cost the lane started in its rate window now "
                                 "(its rate limit is the most it may reach); 0 on a lane without one"),
            "paused": gauge("pglane_lane_paused", "1 while the lane is paused (it accepts jobs and starts none: "
                            "pglane lane resume), else 0"),
            "done": prom.Counter("pglane_jobs_done", "results this worker stored", labels, registry=self.registry),
            "failed": prom.Counter("pglane_jobs_failed", "attempts this worker recorded failed or timed out",
                                   labels, registry=self.registry),
            "deferred": prom.Counter("pglane_jobs_deferred", "attempts this worker recorded deferred (the handler "
                                     "raised RetryLater: nothing paid)", labels, registry=self.registry),
            "duration": prom.Histogram(
                "pglane_attempt_duration_seconds", "handler time per attempt", labels, registry=self.registry,
                buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800)),
            "claim_latency": prom.Histogram(
                "pglane_claim_latency_seconds", "round trip of a claim (alone or fused with a completion)", labels,
                registry=self.registry, buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5)),
            "wait": prom.Histogram(
                "pglane_job_wait_seconds", "from a job's enqueue to its claim (its wait in the lane: the queue, a "
                "pause, the rate limit, a strict lane's lease)", labels, registry=self.registry,
                buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600)),
        }
        self.server, self.thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics on http://%s:%s/metrics", addr, self.server.server_port)  # port 0: the one chosen

    def lane(self, name: str) -> LaneMetrics:
        """The lane's children, made on first use."""
        if name not in self.lanes:
            self.lanes[name] = LaneMetrics(self._families, name)
        return self.lanes[name]

    async def refresh_forever(self, dsn: str, every: float = 5.0) -> None:
        """Read every lane's queue gauges (one short query per lane) until cancelled; database errors only
        delay the next reading."""
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
                    for lane in tuple(self.lanes.values()):
                        cur = await conn.execute(queries.QUEUE_GAUGES, {"lane": lane.lane})
                        row = await cur.fetchone()
                        if row is not None:
                            lane.queue_depth.set(row[0])
                            lane.oldest_queued.set(row[1])
                            lane.running.set(row[2])
                            lane.rate_window.set(row[3] or 0)
                            lane.paused.set(1 if row[4] else 0)
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
