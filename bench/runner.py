"""Every scenario of ``python -m bench`` (SCENARIOS, each a choice of ``--only``), and one server's run.

Two kinds of scenario:

- a part of every server's run (``Scenario.measure``, a function ``(Context) -> None``): it measures
  on ``ctx.server`` and writes into ``ctx.block`` (the server's part of the JSON: ``results[system]``
  for per-system figures, its own key for anything else) and, for a ratio the report judges, the
  ratio's bootstrap interval into ``ctx.block["intervals"]`` (bench.stats.ratio_interval /
  median_interval). ``python -m bench`` runs all of them, in SCENARIOS' order, on every server; one
  that raises is recorded under ``errors`` and the others still run.
- a module of its own (``Scenario.module``): it needs servers set up its own way (a standby, a
  single-user backend under valgrind, a long soak) or options of its own, so it runs alone:
  ``python -m bench --only NAME [its options]`` calls ``bench.NAME.main`` with those options.

To add one (a rate-limited lane, waiters, a prune beside a worker, ...): write the function here or in
a module of its own (its lanes made in its own setup, or in Pglane.setup), add it to SCENARIOS with
one line on what it measures, and, if the report should judge a ratio of it, compute the ratio in
``report.ratios`` and add its bound to ``report.TARGETS``. Investigations that answered one past
question live in bench.lab, not here.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import costs, floors, real
from . import throughput as tp
from .pglane_runs import Pglane, claim_latency, enqueue_throughput, takeover
from .server import BenchServer
from .stats import Sizes, latency_ms, median_interval, progress, ratio_interval

PEERS = ("procrastinate", "pgqueuer")


def _peers() -> list[real.RealSystem]:
    from .peers import Pgqueuer, Procrastinate  # the bench extra: imported where the peers run

    return [Procrastinate(), Pgqueuer()]


@dataclass
class Context:
    server: BenchServer
    sizes: Sizes
    logs: Path
    slot_counts: tuple[int, ...]
    block: dict[str, Any]
    pglane: Pglane = field(default_factory=Pglane)
    peers: list[real.RealSystem] = field(default_factory=_peers)
    listeners: list[real.RealSystem] = field(
        default_factory=lambda: [floors.FloorListen(), floors.FloorListenContract()])

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = self.block["results"]
        return found

    def interval(self, name: str, value: tuple[float, float]) -> None:
        self.block["intervals"][name] = list(value)


def setup(ctx: Context) -> None:
    progress("setting up schemas")
    for system in (ctx.pglane, *ctx.peers, *ctx.listeners):
        system.setup(ctx.server.dsn(system.db))
    tp.setup(ctx.server, ctx.slot_counts)


# ----- the scenarios -----------------------------------------------------------------------------

def throughput(ctx: Context) -> None:
    """Every system at every slot count (bench.throughput); the one-slot figures are also the
    single-consumer ones of ``results`` (floor_contract is ``floor`` at one slot)."""
    found = tp.measure(ctx.server, ctx.sizes, ctx.slot_counts, ctx.logs)
    ctx.block["concurrency"] = found["concurrency"]
    ctx.block["where_the_time_goes"] = found["where_the_time_goes"]
    one = next((e for e in found["concurrency"] if e["slots"] == 1), None)
    if one is not None:
        for name, entry in one["results"].items():
            ctx.results.setdefault("floor_contract" if name == "floor" else name, {}).update(entry)


def wake(ctx: Context) -> None:
    systems = [ctx.pglane, *ctx.peers, *ctx.listeners]
    samples = real.wake(ctx.server, systems, ctx.sizes.wake_jobs, ctx.logs, "wake: round")
    progress("wake: bootstrap intervals")
    ctx.interval("wake_p50 pglane/floor_listen_contract",
                 ratio_interval(samples["pglane"], samples["floor_listen_contract"], 50))
    ctx.interval("wake_p50 pglane/best_peer", ratio_interval(samples["pglane"], [samples[p] for p in PEERS], 50))
    ctx.interval("wake_p99 pglane/floor_listen_contract",
                 ratio_interval(samples["pglane"], samples["floor_listen_contract"], 99))
    ctx.interval("wake_p99 pglane/floor_listen", ratio_interval(samples["pglane"], samples["floor_listen"], 99))
    for name, values in samples.items():
        stats = latency_ms(values)
        ctx.results.setdefault(name, {}).update({
            "wake_p50_ms": stats["p50_ms"], "wake_p95_ms": stats["p95_ms"], "wake_p99_ms": stats["p99_ms"],
            "wake_jobs": len(values)})


def claims(ctx: Context) -> None:
    cases = []
    samples = []
    for queued, finished in ctx.sizes.claim_cases:
        case, times = claim_latency(ctx.server.dsn("pglane"), ctx.server.admin_dsn, queued, finished,
                                    ctx.sizes.claims_per_case, f"claims: {queued:,} queued + {finished:,} finished")
        cases.append(case)
        samples.append(times)
    ctx.block["claim_latency"] = cases
    base = next((i for i, c in enumerate(cases) if c["queued"] == 1_000 and c["finished"] == 0), None)
    if base is None:
        return
    deepest = max((i for i, c in enumerate(cases) if c["finished"] == 0), key=lambda i: cases[i]["queued"])
    history = max((i for i, c in enumerate(cases) if c["finished"] > 0), key=lambda i: cases[i]["finished"],
                  default=None)
    ctx.interval("claim_p50 max_backlog/1k", ratio_interval(samples[deepest], samples[base], 50))
    if history is not None:
        ctx.interval("claim_p50 history/1k", ratio_interval(samples[history], samples[base], 50))


def takeovers(ctx: Context) -> None:
    found = takeover(ctx.server.dsn("pglane"), ctx.server.admin_dsn, ctx.sizes.takeover_kills, ctx.logs)
    ctx.block["takeover_s"] = found
    ctx.interval("takeover_s", median_interval(found["runs"]))


def enqueue(ctx: Context) -> None:
    found = enqueue_throughput(ctx.server.dsn("pglane"), ctx.server.admin_dsn, ctx.sizes.enqueue_jobs,
                               ctx.sizes.bounded_backlog, ctx.sizes.repetitions)
    ctx.block["enqueue"] = found
    unbounded = found["insert_unbounded_100k"]["jobs_per_s"]["runs"]
    bounded = found["insert_bounded_100k"]["jobs_per_s"]["runs"]
    per_rep = [u / b for u, b in zip(unbounded, bounded, strict=True)]
    ctx.interval("enqueue_time bounded/unbounded", median_interval(per_rep))


def cost(ctx: Context) -> None:
    """Per system: what a real drain of the system's consumer costs (``real_drain``: WAL bytes, commits,
    round trips; bench.real) and, counted in a single-user backend of the server's own binaries
    (bench.costs), server instructions and WAL bytes per job with their spread over rounds; beside
    them (``cost_counted``) whether a claim's cost grows with the server's connections."""
    consumers: dict[str, real.RealSystem] = {s.name: s for s in (ctx.pglane, *ctx.peers)}
    found: dict[str, Any] = {}
    for name in ("pglane", *PEERS, "floor_two_commits", "floor_one_commit", "floor_contract"):
        progress(f"cost per job: {name}")
        if name in consumers:
            drained = real.cost(ctx.server, consumers[name], ctx.sizes.cost_jobs, ctx.logs)
        else:
            drained = floors.cost(ctx.server, name, ctx.sizes.cost_jobs)
        found[name] = {"real_drain": drained}
    ctx.block["cost_per_job"] = found
    counted = costs.counted(ctx.server.admin_dsn, ctx.sizes.repetitions)
    for name, figures in counted.pop("per_job", {}).items():
        found.setdefault(name, {}).update(figures)
    ctx.block["cost_counted"] = counted


@dataclass(frozen=True)
class Scenario:
    """One choice of ``--only``: a part of every server's run (``measure``) or a module that runs alone
    with options of its own (``module``: ``bench.<module>.main(argv)``)."""
    about: str  # one line: what it measures (``python -m bench --list``)
    measure: Callable[[Context], None] | None = None
    module: str | None = None


SCENARIOS: dict[str, Scenario] = {  # the parts of a server's run first, in the order they run
    "throughput": Scenario("drain throughput at 1, 3 and 8 slots against the peers and the floors; where the"
                           " time goes", throughput),
    "wake": Scenario("wake latency, commit to handler start, every consumer listening at once", wake),
    "claims": Scenario("claim latency at 1k, 100k and 1M queued and behind 1M finished jobs", claims),
    "takeover": Scenario("a standby worker takes over after the active one is SIGKILLed mid-call", takeovers),
    "enqueue": Scenario("enqueue throughput: INSERT, pglane.enqueue, a batch; a bounded lane at 100k queued",
                        enqueue),
    "cost": Scenario("server instructions (callgrind) and WAL bytes per job of every system's own SQL; a"
                     " claim at 100 and 1,000 connections; WAL, commits and round trips of real drains", cost),
    "scale": Scenario("listings and lane_status behind 1M jobs; what the counts cost a claim (also in"
                      " instructions)", module="scale"),
    "rates": Scenario("what a rate limit costs a worker and a claim, and how close a limited lane gets to"
                      " its limit", module="rates"),
    "contention": Scenario("a worker beside producers hammering a full lane, and beside a prune of 1M jobs",
                           module="contention"),
    "failover": Scenario("a worker resuming after its primary dies and a synchronous standby is promoted",
                         module="failover"),
    "soak": Scenario("one worker through 100,000 jobs beside producers: does anything grow that must stay"
                     " flat", module="soak"),
    "startup": Scenario("`pglane status` against a bare psycopg connect and query, fresh processes",
                        module="startup"),
    "profile": Scenario("where the worker loses against floor_contract: driver, call scaffolding, cProfile,"
                        " statements", module="profile"),
    "groups": Scenario("what a lane's groups cost: claim latency and a worker's throughput with 10,000 groups"
                       " and 100k queued, enqueue; 6 workers never run two of a group", module="groups"),
    "features": Scenario("server instructions per job of a plain lane and what a rate limit, a bound, a strict"
                         " lane, groups and waiters add (callgrind)", module="costs"),
    "lanes": Scenario("1,000 one-slot lanes in one process: its connections, idle CPU, wake against a one-lane"
                      " worker; 100 busy lanes in one process against 100 processes and floor_one_commit",
                      module="lanes"),
    "clients": Scenario("the consumer's own instructions per job (callgrind): the worker against"
                        " floor_contract's bare loop, with and without its line per job", module="clients"),
    "otel": Scenario("a worker's throughput and CPU per job without the OpenTelemetry API, with it and no SDK,"
                     " and with an SDK exporting every span (#36)", module="otel"),
}
PER_SERVER = tuple(name for name, s in SCENARIOS.items() if s.measure is not None)


def run(ctx: Context, only: set[str]) -> None:
    """The chosen parts of a server's run in SCENARIOS' order; one that raises is recorded under ``errors``."""
    setup(ctx)
    for name, scenario in SCENARIOS.items():
        if name not in only or scenario.measure is None:
            continue
        try:
            scenario.measure(ctx)
        except Exception as exc:  # one broken scenario must not lose the others' figures
            ctx.block["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
