"""What tracing costs a worker (#36): `python -m bench --only otel [--jobs N] [--rounds R] [--json FILE]`.

One lane (``otel_bench``), drained by one real ``pglane worker otel_bench --handler bench.handlers:noop
--max-jobs N`` (default 3,000 jobs) in three ways, alternated round by round in an order rotated each round:

- ``without``: the OpenTelemetry API cannot be imported (the worker starts with ``opentelemetry``
  blocked in ``sys.modules``: as if ``pglane[otel]`` were not installed), so pglane.tracing is off;
- ``with``: the API installed, no SDK or exporter configured: ``pglane.tracing.active()`` is false, so
  no span is made (before it, every attempt made its wait, process and settle spans through the API's
  no-op tracer, and extracted the job's traceparent);
- ``sdk``: the OpenTelemetry SDK configured in the worker as an application would, before pglane runs
  (``sdk_worker``): a ``TracerProvider`` with a ``BatchSpanProcessor`` over ``DiscardingExporter``,
  which does an exporter's work on each span (its JSON text) and sends it nowhere. Tracing is active:
  every attempt records its wait, process and settle spans, and they are exported. The provider's
  own atexit hook shuts the processor down (exporting what it still holds) before the worker ends;
  then the worker writes ``EXPORTED <n>`` to its log, and the bench checks n is 3 spans a job.

Every job carries a traceparent (as a traced producer's would), set by the one INSERT that loads the N
jobs before the worker starts (untimed). Jobs per second on the database clock, first attempt's start
to last finish, and the worker process's CPU time per job (its rusage: steadier than a rate on a shared
machine); the ratios with/without and sdk/without per round, their medians and ranges. Issue #36's bound
(no SDK): within noise of without. It needs the dev extra (opentelemetry-api and opentelemetry-sdk). It
starts its own embedded PostgreSQL (fsync on) unless PGLANE_DSN is set.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import pglane
from pglane import schema

from .procs import RESULTS, spawn
from .server import env_or_embedded
from .stats import progress, progress_done, rotations

LANE = "otel_bench"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
# the worker's command line, with the OpenTelemetry API made unimportable first (``without``)
BLOCKED = ("import runpy, sys; sys.modules['opentelemetry'] = None; sys.argv = ['pglane', *sys.argv[1:]]; "
           "runpy.run_module('pglane', run_name='__main__')")
# the same with the SDK configured first (``sdk``)
WITH_SDK = ("import runpy, sys; from bench.otel import sdk_worker; sdk_worker(); sys.argv = ['pglane', *sys.argv[1:]]; "
            "runpy.run_module('pglane', run_name='__main__')")
MODES = ["without", "with", "sdk"]
EXPORTED = "EXPORTED"  # the sdk worker's last line in its log: EXPORTED <spans>
SPANS_PER_JOB = 3  # wait, process, settle


class DiscardingExporter(SpanExporter):
    """An exporter that serialises every span it is given (``to_json``, as a console or file exporter
    does) and discards the text: the export's work in the worker process, no I/O. Counts the spans."""

    def __init__(self) -> None:
        self.spans = 0
        self.chars = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self.chars += len(span.to_json())
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def sdk_worker() -> None:
    """In the ``sdk`` worker, before pglane runs: set a tracer provider with a batch processor over a
    DiscardingExporter (the SDK's defaults otherwise), and write how many spans it exported at exit."""
    exporter = DiscardingExporter()
    # atexit runs last what was registered first: this line comes after the provider's shutdown hook
    # (shutdown_on_exit, registered by TracerProvider()), which exports the batch processor's last spans
    atexit.register(lambda: print(f"{EXPORTED} {exporter.spans}", file=sys.stderr, flush=True))
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def exported(text: str) -> int:
    """The span count the sdk worker's log (``text``: this run's part) ends with."""
    counts = [int(line.split()[1]) for line in text.splitlines() if line.startswith(f"{EXPORTED} ")]
    if not counts:
        raise RuntimeError(f"the sdk worker wrote no '{EXPORTED} <spans>' line")
    return counts[-1]


def drain(dsn: str, mode: str, jobs: int, log: Path) -> tuple[float, float, int | None]:
    """Load ``jobs`` jobs, drain them with one worker in ``mode``: jobs per second on the database clock,
    the worker process's CPU time per job (user + system, microseconds: its own work, which the
    machine's other load does not change as much as it changes a rate), and (``sdk``) the spans it
    exported."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pglane.jobs WHERE lane = %s", (LANE,))
        conn.execute("INSERT INTO pglane.jobs (lane, payload, traceparent)"
                     " SELECT %s, '{}', %s FROM generate_series(1, %s)", (LANE, TRACEPARENT, jobs))
    args = ["worker", LANE, "--handler", "bench.handlers:noop", "--max-jobs", str(jobs), "--quiet",
            "--dsn", dsn]
    start = log.stat().st_size if log.exists() else 0
    program = {"without": ["-c", BLOCKED], "with": ["-m", "pglane"], "sdk": ["-c", WITH_SDK]}[mode]
    proc = spawn([*program, *args], log)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} worker exited {proc.returncode}: see {log}")
    cpu_us = (usage.ru_utime + usage.ru_stime) * 1e6 / jobs
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) AS n, extract(epoch FROM max(finished_at) - min(started_at))::float8 AS s"
                           " FROM pglane.jobs WHERE lane = %s AND status = 'done'", (LANE,)).fetchone()
    assert row is not None and row[0] == jobs, f"{mode}: {row} of {jobs} jobs done"
    spans = None
    if mode == "sdk":
        with log.open("rb") as f:
            f.seek(start)
            spans = exported(f.read().decode(errors="replace"))
        if spans != SPANS_PER_JOB * jobs:
            raise RuntimeError(f"the sdk worker exported {spans} spans for {jobs} jobs (not {SPANS_PER_JOB} a job):"
                               f" see {log}")
    return float(row[0] / row[1]), cpu_us, spans


def _range(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench --only otel", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    log = RESULTS / "otel" / "worker.log"
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    spans: list[int] = []
    with env_or_embedded() as dsn:
        schema.upgrade(dsn)
        with pglane.connect(dsn) as conn:
            if not any(lane["name"] == LANE for lane in conn.execute("SELECT name FROM pglane.lanes")):
                pglane.create_lane(conn, LANE, job_timeout=60)
        order = rotations(MODES, args.rounds)
        for i, (_, mode) in enumerate(order):
            progress(f"otel: {mode} ({i + 1}/{len(order)})")
            rate, cpu_us, exported_spans = drain(dsn, mode, args.jobs, log)
            rates[mode].append(rate)
            cpu[mode].append(cpu_us)
            if exported_spans is not None:
                spans.append(exported_spans)
        progress_done()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM pglane.jobs WHERE lane = %s", (LANE,))
    ratios = [w / wo for w, wo in zip(rates["with"], rates["without"], strict=True)]
    cpu_ratios = [w / wo for w, wo in zip(cpu["with"], cpu["without"], strict=True)]
    sdk_ratios = [s / wo for s, wo in zip(rates["sdk"], rates["without"], strict=True)]
    sdk_cpu_ratios = [s / wo for s, wo in zip(cpu["sdk"], cpu["without"], strict=True)]
    report: dict[str, Any] = {"jobs": args.jobs, "rounds": args.rounds, "jobs_per_second": rates,
                              "ratio_with_over_without": ratios, "median_ratio": statistics.median(ratios),
                              "worker_cpu_us_per_job": cpu, "cpu_ratio_with_over_without": cpu_ratios,
                              "median_cpu_ratio": statistics.median(cpu_ratios),
                              "ratio_sdk_over_without": sdk_ratios, "median_ratio_sdk": statistics.median(sdk_ratios),
                              "cpu_ratio_sdk_over_without": sdk_cpu_ratios,
                              "median_cpu_ratio_sdk": statistics.median(sdk_cpu_ratios),
                              "sdk_spans_exported": spans, "load": os.getloadavg()}
    print(f"jobs/s without the API: {', '.join(f'{r:.0f}' for r in rates['without'])}")
    print(f"jobs/s with the API, no exporter: {', '.join(f'{r:.0f}' for r in rates['with'])}")
    print(f"with/without per round: {', '.join(f'{r:.3f}' for r in ratios)}; median {report['median_ratio']:.3f} "
          f"[{min(ratios):.3f}-{max(ratios):.3f}]; load {report['load'][0]:.2f}")
    print(f"worker CPU us per job without / with: {statistics.median(cpu['without']):.0f} / "
          f"{statistics.median(cpu['with']):.0f}; with/without per round: {', '.join(f'{r:.3f}' for r in cpu_ratios)};"
          f" median {report['median_cpu_ratio']:.3f} [{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}]")
    print(f"jobs/s with the SDK, batch processor, discarding exporter: {', '.join(f'{r:.0f}' for r in rates['sdk'])}")
    print(f"sdk/without per round: {', '.join(f'{r:.3f}' for r in sdk_ratios)}; {_range(sdk_ratios)}")
    print(f"worker CPU us per job sdk: {statistics.median(cpu['sdk']):.0f}; sdk/without per round: "
          f"{', '.join(f'{r:.3f}' for r in sdk_cpu_ratios)}; {_range(sdk_cpu_ratios)}")
    print(f"spans exported by the sdk worker per round: {', '.join(map(str, spans))} "
          f"({SPANS_PER_JOB} a job: {SPANS_PER_JOB * args.jobs})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
