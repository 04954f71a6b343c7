"""``python -m bench [--quick] [--json FILE] [--plot FILE] [--only PART ...]``

Runs, against a PostgreSQL it starts itself (or the one in PGLANE_DSN), in this order:
warm-up (one small untimed drain per consumer), throughput (interleaved repetitions), wake latency,
claim latency against backlog and history, standby takeover, enqueue throughput, cost per job.
Prints a markdown report; writes JSON (--json) and the claim-latency plot (--plot, default
bench/results/claim_latency[_quick].png). A part that fails is recorded under "errors" and the
others still run. See bench.real for the measuring protocols.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import floors, real, report
from .peers import Pgqueuer, Procrastinate
from .pglane_runs import Pglane, claim_latency, enqueue_throughput, takeover
from .server import bench_server, postgres_info
from .stats import Sizes, latency_ms, progress, progress_done, ratio_interval, rotations, summary

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("throughput", "wake", "claims", "takeover", "enqueue", "cost")
THROUGHPUT_ORDER = ("pglane", "procrastinate", "pgqueuer", "floor_two_commits", "floor_one_commit", "floor_contract")
WARMUP_JOBS = 200


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="pglane against its floors and peers")
    p.add_argument("--quick", action="store_true", help="smaller counts; finishes in under 3 minutes")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="claim latency PNG (default: bench/results/claim_latency*.png)")
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    return p


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sizes = Sizes.choose(args.quick)
    parts = set(args.only or PARTS)
    logs = RESULTS / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    started = time.monotonic()
    pglane, peers = Pglane(), [Procrastinate(), Pgqueuer()]
    listeners = [floors.FloorListen(), floors.FloorListenContract()]
    consumers: dict[str, real.RealSystem] = {s.name: s for s in (pglane, *peers)}
    results: dict[str, dict[str, Any]] = {name: {} for name in (*THROUGHPUT_ORDER, *(s.name for s in listeners))}
    doc: dict[str, Any] = {"mode": "quick" if args.quick else "full", "sizes": dataclasses.asdict(sizes),
                           "results": results, "errors": {}, "intervals": {},
                           "machine": {"loadavg_start": os.getloadavg()}}

    with bench_server() as server:
        doc["postgres"] = postgres_info(server.admin_dsn)
        doc["postgres"]["pg_stat_statements"] = server.statements
        progress("setting up schemas")
        for system in (pglane, *peers, *listeners):
            system.setup(server.dsn(system.db))

        def guarded(part: str, body: Callable[[], None]) -> None:
            if part not in parts:
                return
            try:
                body()
            except Exception as exc:  # one broken part must not lose the others' figures
                doc["errors"][part] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(file=sys.stderr)

        def drain(name: str, n: int) -> float:
            if name in consumers:
                return real.throughput(server, consumers[name], n, logs)
            return floors.throughput(server, name, n)

        def throughput() -> None:
            for name in THROUGHPUT_ORDER:
                progress(f"throughput: warm-up {name}")
                drain(name, WARMUP_JOBS)
            runs: dict[str, list[float]] = {name: [] for name in THROUGHPUT_ORDER}
            for rep, name in rotations(THROUGHPUT_ORDER, sizes.repetitions):
                progress(f"throughput: {name} (repetition {rep + 1}/{sizes.repetitions})")
                runs[name].append(drain(name, sizes.throughput_jobs))
            for name, values in runs.items():
                results[name]["throughput_jobs_per_s"] = summary(values)

        def wake() -> None:
            systems = [pglane, *peers, *listeners]
            samples = real.wake(server, systems, sizes.wake_jobs, logs, "wake: round")
            progress("wake: bootstrap interval of the p99 ratio")
            doc["intervals"]["wake_p99 pglane/floor_listen"] = ratio_interval(
                samples["pglane"], samples["floor_listen"], 99)
            for name, values in samples.items():
                stats = latency_ms(values)
                results[name].update({"wake_p50_ms": stats["p50_ms"], "wake_p95_ms": stats["p95_ms"],
                                      "wake_p99_ms": stats["p99_ms"], "wake_jobs": len(values)})

        def claims() -> None:
            doc["claim_latency"] = [
                claim_latency(server.dsn("pglane"), server.admin_dsn, queued, finished, sizes.claims_per_case,
                              f"claims: {queued:,} queued + {finished:,} finished")
                for queued, finished in sizes.claim_cases
            ]

        def takeovers() -> None:
            doc["takeover_s"] = takeover(server.dsn("pglane"), server.admin_dsn, sizes.takeover_kills, logs)

        def enqueue() -> None:
            doc["enqueue"] = enqueue_throughput(server.dsn("pglane"), server.admin_dsn, sizes.enqueue_jobs,
                                                sizes.bounded_backlog, sizes.repetitions)

        def cost() -> None:
            costs: dict[str, Any] = {}
            for name in THROUGHPUT_ORDER:
                progress(f"cost per job: {name}")
                if name in consumers:
                    costs[name] = real.cost(server, consumers[name], sizes.cost_jobs, logs)
                else:
                    costs[name] = floors.cost(server, name, sizes.cost_jobs)
            doc["cost_per_job"] = costs

        for part, body in (("throughput", throughput), ("wake", wake), ("claims", claims),
                           ("takeover", takeovers), ("enqueue", enqueue), ("cost", cost)):
            guarded(part, body)
        progress("stopping the server")
    progress_done()

    doc["ratios"] = report.ratios(doc)
    doc["targets"] = report.verdicts(doc["ratios"], doc["intervals"])
    doc["wake_split"] = report.wake_split(doc)
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    doc["machine"]["loadavg_end"] = os.getloadavg()
    doc = _jsonable(doc)
    print(report.markdown(doc))
    print(f"elapsed {doc['elapsed_s']} s" + (f"; errors: {doc['errors']}" if doc["errors"] else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if doc.get("claim_latency"):
        plot_path = args.plot or RESULTS / f"claim_latency{'_quick' if args.quick else ''}.png"
        report.plot(doc, plot_path)
        print(f"plot: {plot_path}")
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

