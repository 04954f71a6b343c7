"""``python -m bench [--quick] [--dsn DSN]... [--no-embedded] [--json FILE] [--plot FILE] [--only PART ...]
[--slots N ...]``

Measures every server in turn: the embedded PostgreSQL (started by the bench, unless --no-embedded),
then each --dsn (PGLANE_DSN set and no --dsn given: that server alone, as if --no-embedded --dsn
$PGLANE_DSN). On each server the scenarios of bench.runner run in order: throughput at every slot
count (default 1, 3, 8), wake latency, claim latency against backlog and history, standby takeover,
enqueue throughput, cost per job. Prints a markdown report per server and a table of the verdicts
of all servers side by side; writes JSON (--json: the first server's block at the top level, as
before, and every server's under ``versions``) and the claim-latency plot of the first server
(--plot, default bench/results/claim_latency[_quick].png). A scenario that fails is recorded under
"errors" and the others still run. See bench.real and bench.throughput for the measuring protocols.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import report, runner
from . import throughput as tp
from .server import bench_server, postgres_info
from .stats import Sizes, progress, progress_done

RESULTS = Path(__file__).resolve().parent / "results"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="pglane against its floors and peers")
    p.add_argument("--quick", action="store_true", help="smaller counts; under 3 minutes per server")
    p.add_argument("--dsn", action="append", default=[], metavar="DSN",
                   help="also measure this server (repeatable); its bench_* databases are dropped and made anew")
    p.add_argument("--no-embedded", action="store_true", help="do not measure the embedded server")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="claim latency PNG (default: bench/results/claim_latency*.png)")
    p.add_argument("--only", nargs="+", choices=list(runner.SCENARIOS), help="run only these scenarios")
    p.add_argument("--slots", nargs="+", type=int, default=list(tp.SLOT_COUNTS), metavar="N",
                   help="slot counts of the throughput scenario (default: 1 3 8; 1 must be among them)")
    return p


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def servers(args: argparse.Namespace) -> list[str | None]:
    """None for the embedded server, then the DSNs, in the order they are measured."""
    dsns: list[str] = list(args.dsn)
    embedded = not args.no_embedded
    if not dsns and os.environ.get("PGLANE_DSN"):
        dsns, embedded = [os.environ["PGLANE_DSN"]], False
    return ([None] if embedded else []) + list(dsns)


def measure(dsn: str | None, args: argparse.Namespace, sizes: Sizes, label: str) -> dict[str, Any]:
    """One server's block: every chosen scenario, its ratios and verdicts."""
    logs = RESULTS / "logs" / label
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    started = time.monotonic()
    slot_counts = tuple(sorted(set(args.slots)))
    block: dict[str, Any] = {"server": "embedded" if dsn is None else "dsn", "mode": "quick" if args.quick else "full",
                             "sizes": dataclasses.asdict(sizes), "results": {}, "errors": {}, "intervals": {},
                             "machine": {"loadavg_start": os.getloadavg()}}
    with bench_server(dsn, tp.databases(slot_counts), use_env=False) as server:
        block["postgres"] = postgres_info(server.admin_dsn)
        block["postgres"]["pg_stat_statements"] = server.statements
        ctx = runner.Context(server, sizes, logs, slot_counts, block)
        runner.run(ctx, set(args.only or runner.SCENARIOS))
        progress("stopping the server" if dsn is None else "done with this server")
    progress_done()
    block["ratios"] = report.ratios(block)
    block["targets"] = report.verdicts(block["ratios"], block["intervals"], list(slot_counts))
    block["wake_split"] = report.wake_split(block)
    block["elapsed_s"] = round(time.monotonic() - started, 1)
    block["machine"]["loadavg_end"] = os.getloadavg()
    result: dict[str, Any] = _jsonable(block)
    return result


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that every standing consumer and server is stopped on the way out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if 1 not in args.slots:
        raise SystemExit("--slots must include 1: the single-consumer figures and the slot ratios start from it")
    targets = servers(args)
    if not targets:
        raise SystemExit("nothing to measure: --no-embedded needs at least one --dsn")
    sizes = Sizes.choose(args.quick)
    blocks: list[dict[str, Any]] = []
    for i, dsn in enumerate(targets):
        label = "embedded" if dsn is None else f"dsn{i}"
        progress(f"server {i + 1}/{len(targets)}: {'embedded' if dsn is None else dsn}")
        progress_done()
        block = measure(dsn, args, sizes, label)
        blocks.append(block)
        print(report.markdown(block))
        print(f"elapsed {block['elapsed_s']} s" + (f"; errors: {block['errors']}" if block["errors"] else ""))
        print()
    if len(blocks) > 1:
        print(report.versions_table(blocks))
    doc = {**blocks[0], "versions": blocks}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    if doc.get("claim_latency"):
        plot_path = args.plot or RESULTS / f"claim_latency{'_quick' if args.quick else ''}.png"
        report.plot(doc, plot_path)
        print(f"plot: {plot_path}")
    return 1 if any(b["errors"] for b in blocks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
