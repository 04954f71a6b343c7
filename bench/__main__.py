"""``python -m bench [--quick] [--dsn DSN]... [--no-embedded] [--json FILE] [--plot FILE] [--only SCENARIO ...]
[--slots N ...]``, ``python -m bench --only NAME [its options]``, ``python -m bench --list``

The one entry of the benchmark: every scenario of bench.runner.SCENARIOS is a choice of ``--only``;
``--list`` (or ``--only`` with no name) names each with one line. A scenario that sets up its own
servers or takes options of its own (scale, rates, contention, failover, soak, startup, profile) runs
alone: ``--only NAME`` hands every other argument to ``bench.NAME.main`` (``--only NAME --help`` shows
its options).

The others are the parts of a server's run, all of them unless --only names some. It measures every
server in turn: the embedded PostgreSQL (started by the bench, unless --no-embedded), then each --dsn
(PGLANE_DSN set and no --dsn given: that server alone, as if --no-embedded --dsn $PGLANE_DSN). On
each server they run in order: throughput at every slot count (default 1, 3, 8), wake latency, claim
latency against backlog and history, standby takeover, enqueue throughput, cost per job. Prints a
markdown report per server and a table of the verdicts of all servers side by side; writes JSON
(--json: the first server's block at the top level, as before, and every server's under
``versions``) and the claim-latency plot of the first server (--plot, default
bench/results/claim_latency[_quick].png). A scenario that fails is recorded under "errors" and the
others still run. See bench.real and bench.throughput for the measuring protocols.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import itertools
import json
import math
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import report, runner
from . import throughput as tp
from .procs import RESULTS
from .server import bench_server, postgres_info
from .stats import Sizes, progress, progress_done

PEER_MODULES = ("procrastinate", "pgqueuer", "asyncpg")  # the bench extra, for a server's run


def scenario_list() -> str:
    """Every scenario, one line each: the parts of a server's run, then those that run alone."""
    width = max(map(len, runner.SCENARIOS))
    lines = ["the parts of a server's run (python -m bench runs them all, in this order):"]
    lines += [f"  {name:<{width}}  {s.about}" for name, s in runner.SCENARIOS.items() if s.measure is not None]
    lines.append("run alone, with options of their own (python -m bench --only NAME --help):")
    lines += [f"  {name:<{width}}  {s.about}" for name, s in runner.SCENARIOS.items() if s.measure is None]
    lines.append("past investigations: python -m bench.lab.NAME, what each found in bench/lab/README.md")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="pglane against its floors and peers",
                                epilog=scenario_list(), formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--list", action="store_true", help="name every scenario, one line each, and stop")
    p.add_argument("--quick", action="store_true", help="smaller counts; under 3 minutes per server")
    p.add_argument("--dsn", action="append", default=[], metavar="DSN",
                   help="also measure this server (repeatable); its bench_* databases are dropped and made anew")
    p.add_argument("--no-embedded", action="store_true", help="do not measure the embedded server")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="claim latency PNG (default: bench/results/claim_latency*.png)")
    p.add_argument("--only", nargs="*", choices=list(runner.SCENARIOS), metavar="SCENARIO",
                   help="run only these scenarios (one that runs alone: --only NAME [its options])")
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
        runner.run(ctx, set(args.only or runner.PER_SERVER))
        progress("stopping the server" if dsn is None else "done with this server")
    progress_done()
    block["ratios"] = report.ratios(block)
    block["targets"] = report.verdicts(block["ratios"], block["intervals"], list(slot_counts))
    block["wake_split"] = report.wake_split(block)
    block["elapsed_s"] = round(time.monotonic() - started, 1)
    block["machine"]["loadavg_end"] = os.getloadavg()
    result: dict[str, Any] = _jsonable(block)
    return result


def alone(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[str, list[str]] | None:
    """(NAME, the other arguments) when the first ``--only`` names a scenario that runs alone."""
    for i, arg in enumerate(argv):
        if arg == "--only":
            names = list(itertools.takewhile(lambda a: not a.startswith("-"), argv[i + 1:]))
            rest = list(argv[i + 1 + len(names):])
        elif arg.startswith("--only="):
            names, rest = [arg.partition("=")[2]], list(argv[i + 1:])
        else:
            continue
        own = [n for n in names if n in runner.SCENARIOS and runner.SCENARIOS[n].module is not None]
        if not own:
            return None
        if len(names) > 1:
            parser.error(f"{own[0]} runs alone, with options of its own: python -m bench --only {own[0]} [options]")
        return names[0], [*argv[:i], *rest]
    return None


def run_alone(name: str, argv: list[str]) -> int:
    module = importlib.import_module(f"bench.{runner.SCENARIOS[name].module}")
    entry: Callable[[list[str]], int] = module.main
    return entry(argv)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that every standing consumer and server is stopped on the way out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    chosen = alone(argv, parser)
    if chosen is not None:
        return run_alone(*chosen)
    args = parser.parse_args(argv)
    if args.list or args.only == []:
        print(scenario_list())
        return 0
    own = [n for n in args.only or () if runner.SCENARIOS[n].measure is None]
    if own:
        parser.error(f"{own[0]} runs alone, with options of its own: python -m bench --only {own[0]} [options]")
    missing = [m for m in PEER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"a server's run measures pglane against its peers: pip install -e '.[bench]'"
                         f" (missing: {', '.join(missing)})")
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
