"""Turning measurements into the ratios against the targets, a markdown report and the claim plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .stats import median_interval, verdict

PEERS = ("procrastinate", "pgqueuer")

# name: (how the ratio reads, the target's comparison, the bound); comparison None: reported with its
# interval, not judged. Every judged ratio has a bootstrap interval (from its repetitions, or from its
# samples for latencies) and its verdict is "met", "missed" or "within noise" (bench.stats.verdict).
# The slot-count ratios are added per slot count measured (see targets_for).
TARGETS: dict[str, tuple[str, str | None, float | None]] = {
    "pglane/floor_contract": ("throughput, one slot", ">=", 0.9),
    "floor_contract/floor_one_commit": ("throughput, one slot", ">=", 0.6),
    "pglane/best_peer": ("throughput, one slot", ">=", 3.0),
    "wake_p50 pglane/floor_listen_contract": ("wake p50 latency", "<=", 1.2),
    "wake_p50 pglane/best_peer": ("wake p50 latency", "<=", 0.5),
    "wake_p99 pglane/floor_listen_contract": ("wake p99 latency", None, None),
    "wake_p99 pglane/floor_listen": ("wake p99 latency", None, None),
    "claim_p50 max_backlog/1k": ("claim p50 latency", "<=", 1.3),
    "claim_p50 history/1k": ("claim p50 latency", "<=", 1.3),
    "enqueue_time bounded/unbounded": ("time per enqueue at 100k queued", "<=", 1.5),
    "takeover_s": ("median seconds", "<", 1.0),
    # #35, counted in a single-user backend of the server's binaries (bench.costs): ratios within each round
    "cost_instructions pglane/best_peer": ("server instructions per job", "<=", 0.5),
    "cost_wal pglane/best_peer": ("WAL bytes per job, full-page images excluded", "<=", 0.5),
    "cost_wal_fpi pglane/best_peer": ("WAL bytes per job, full-page images included", None, None),
    "cost_instructions pglane/floor_one_commit": ("server instructions per job", "<=", 2.0),
    # a claim and completion at max_connections 1,000 with 500 idle sessions over 100 (bench.costs.connections)
    "connections_instructions 1000/100": ("claim + completion instructions", None, None),
    "connections_beyond_floor 1000/100": ("the same, less what floor_one_commit's transaction gains", "<=", 1.01),
    "connections_claim_p50 1000/100": ("claim p50 latency, a real backend", None, None),
}
# the counted cost's figures (bench.costs): the judged WAL is without full-page images (a drain that
# starts right after a checkpoint logs a whole page at the first change of every page it touches)
COUNTED = {"cost_instructions": "instructions_per_job", "cost_wal": "wal_bytes_per_job_no_fpi",
           "cost_wal_fpi": "wal_bytes_per_job"}


def targets_for(slot_counts: list[int]) -> dict[str, tuple[str, str | None, float | None]]:
    """TARGETS plus, for every slot count N > 1: pglane at N slots over pglane at one (never slower:
    >= 0.95) and pglane over the better peer at the same concurrency (>= 3)."""
    found = dict(TARGETS)
    for n in slot_counts:
        if n > 1:
            found[f"pglane slots{n}/slots1"] = (f"throughput, {n} slots", ">=", 0.95)
            found[f"pglane/best_peer @{n} slots"] = (f"throughput, {n} slots", ">=", 3.0)
    return found


# Where the wake-latency gap is (reported beside the targets, no bound): floor_listen_contract runs
# pglane's SQL in floor_listen's bare loop, so it splits pglane/floor_listen into what the claim SQL
# costs over one UPDATE and what the worker's Python costs over the SQL.
WAKE_SPLIT = (("wake_p50 floor_listen_contract/floor_listen", "floor_listen_contract", "floor_listen", "wake_p50_ms"),
              ("wake_p50 pglane/floor_listen_contract", "pglane", "floor_listen_contract", "wake_p50_ms"),
              ("wake_p99 floor_listen_contract/floor_listen", "floor_listen_contract", "floor_listen", "wake_p99_ms"),
              # pglane's SQL alone (no worker) against the better peer: what wake_p50 pglane/best_peer can reach
              ("wake_p50 floor_listen_contract/best_peer", "floor_listen_contract", "best_peer", "wake_p50_ms"),
              ("wake_p99 pglane/floor_listen_contract", "pglane", "floor_listen_contract", "wake_p99_ms"))


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _runs(block: dict[str, Any], name: str, slots: int) -> list[float] | None:
    for entry in block.get("concurrency", []):
        if entry["slots"] == slots:
            found = entry["results"].get(name, {}).get("throughput_jobs_per_s", {}).get("runs")
            return list(found) if found else None
    return None


def paired(block: dict[str, Any], a: tuple[str, int], b: list[tuple[str, int]]
           ) -> tuple[float | None, tuple[float, float] | None]:
    """Throughput of system ``a`` at its slot count over the best of ``b``: the median of the ratios
    taken within each repetition (every (system, slots) drain of one repetition ran in one rotation,
    so they share the machine's state), and the bootstrap 90% interval of that median."""
    runs_a = _runs(block, *a)
    runs_b = [r for r in (_runs(block, *x) for x in b) if r]
    if not runs_a or not runs_b or any(len(r) != len(runs_a) for r in runs_b):
        return None, None
    per_rep = [x / max(r[i] for r in runs_b) for i, x in enumerate(runs_a)]
    return float(statistics.median(per_rep)), median_interval(per_rep)


def better_peer(cost: dict[str, Any], key: str) -> str | None:
    """The peer with the lower median of a counted figure (bench.costs), if any was counted."""
    found = [p for p in PEERS if key in cost.get(p, {})]
    return min(found, key=lambda p: float(cost[p][key]["median"])) if found else None


def counted_ratios(block: dict[str, Any]) -> dict[str, tuple[float, tuple[float, float]]]:
    """The counted cost's ratios (COUNTED, against the better peer and floor_one_commit) and the
    connections' ratios: the median of the ratios within each round and its interval."""
    cost = block.get("cost_per_job", {})
    out: dict[str, tuple[float, tuple[float, float]]] = {}

    def paired(name: str, a: list[float], b: list[float]) -> None:
        per_round = [x / y for x, y in zip(a, b, strict=True)]
        out[name] = (float(statistics.median(per_round)), median_interval(per_round))

    for prefix, key in COUNTED.items():
        if key not in cost.get("pglane", {}):
            continue
        peer = better_peer(cost, key)
        if peer is not None:
            paired(f"{prefix} pglane/best_peer", cost["pglane"][key]["runs"], cost[peer][key]["runs"])
        if prefix == "cost_instructions" and key in cost.get("floor_one_commit", {}):
            paired(f"{prefix} pglane/floor_one_commit", cost["pglane"][key]["runs"],
                   cost["floor_one_commit"][key]["runs"])
    conns = block.get("cost_counted", {}).get("connections")
    if conns:
        for name, found in (("connections_instructions", conns["instructions_ratio"]["head"]),
                            ("connections_beyond_floor", conns["beyond_floor_ratio"])):
            out[f"{name} 1000/100"] = (float(found["median"]), tuple(found["interval_90"]))
        p50 = conns["claim_p50_ratio"]
        out["connections_claim_p50 1000/100"] = (float(p50["value"]), tuple(p50["interval_90"]))
    return out


def ratios(block: dict[str, Any]) -> dict[str, float | None]:
    """Every ratio of targets_for; the throughput ones' intervals go into block["intervals"]."""
    results = block["results"]
    intervals = block.setdefault("intervals", {})
    claims = block.get("claim_latency", [])
    base = next((c for c in claims if c["queued"] == 1_000 and c["finished"] == 0), None)
    deepest = max((c for c in claims if c["finished"] == 0), key=lambda c: c["queued"], default=None)
    history = max((c for c in claims if c["finished"] > 0), key=lambda c: c["finished"], default=None)
    enqueue = block.get("enqueue", {})

    def rate(name: str) -> float | None:
        value = enqueue.get(name, {}).get("jobs_per_s", {}).get("median")
        return None if value is None else float(value)

    def wake(a: str, b: str | list[str], key: str) -> float | None:
        others = [results.get(x, {}).get(key) for x in ([b] if isinstance(b, str) else b)]
        found = [x for x in others if x is not None]
        return _div(results.get(a, {}).get(key), min(found) if found else None)

    out: dict[str, float | None] = {}

    def throughput(name: str, a: tuple[str, int], b: list[tuple[str, int]]) -> None:
        value, interval = paired(block, a, b)
        out[name] = value
        if interval is not None:
            intervals[name] = list(interval)

    throughput("pglane/floor_contract", ("pglane", 1), [("floor", 1)])
    throughput("floor_contract/floor_one_commit", ("floor", 1), [("floor_one_commit", 1)])
    throughput("pglane/best_peer", ("pglane", 1), [(p, 1) for p in PEERS])
    for entry in block.get("concurrency", []):
        n = entry["slots"]
        if n > 1:
            throughput(f"pglane slots{n}/slots1", ("pglane", n), [("pglane", 1)])
            throughput(f"pglane/best_peer @{n} slots", ("pglane", n), [(p, n) for p in PEERS])
    out.update({
        "wake_p50 pglane/floor_listen_contract": wake("pglane", "floor_listen_contract", "wake_p50_ms"),
        "wake_p50 pglane/best_peer": wake("pglane", list(PEERS), "wake_p50_ms"),
        "wake_p99 pglane/floor_listen_contract": wake("pglane", "floor_listen_contract", "wake_p99_ms"),
        "wake_p99 pglane/floor_listen": wake("pglane", "floor_listen", "wake_p99_ms"),
        "claim_p50 max_backlog/1k": _div(deepest["p50_ms"] if deepest else None, base["p50_ms"] if base else None),
        "claim_p50 history/1k": _div(history["p50_ms"] if history else None, base["p50_ms"] if base else None),
        # time per enqueue, bounded over unbounded = unbounded rate over bounded rate
        "enqueue_time bounded/unbounded": _div(rate("insert_unbounded_100k"), rate("insert_bounded_100k")),
        "takeover_s": block.get("takeover_s", {}).get("median"),
    })
    for name, (value, interval) in counted_ratios(block).items():
        out[name] = value
        intervals[name] = list(interval)
    return out


# Reported beside the targets, not judged: how each system scales with slots, and pglane against the
# floors at the same concurrency (floor keeps all of pglane's guarantees: it is pglane's SQL;
# floor_rows writes only the contract's rows; floor_seq keeps only the gapless seq; floor_one_commit none),
# and what pglane's SQL (floor) and the contract's rows alone (floor_rows) reach against the better peer:
# the bound on pglane/best_peer at that concurrency.
SCALING = ("pglane", "floor", "floor_rows", "floor_seq", "floor_one_commit", "procrastinate", "pgqueuer")
FLOORS = ("floor", "floor_rows", "floor_seq", "floor_one_commit")


def concurrency_ratios(block: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for entry in block.get("concurrency", []):
        n = entry["slots"]
        row: dict[str, Any] = {"slots": n}
        for name in FLOORS:
            value, interval = paired(block, ("pglane", n), [(name, n)])
            row[f"pglane/{name}"] = {"value": value, "interval_90": list(interval) if interval else None}
        for name in ("floor", "floor_rows"):
            value, interval = paired(block, (name, n), [(peer, n) for peer in PEERS])
            row[f"{name}/best_peer"] = {"value": value, "interval_90": list(interval) if interval else None}
        for name in SCALING:
            value, interval = paired(block, (name, n), [(name, 1)])
            row[f"{name} slots{n}/slots1"] = {"value": value, "interval_90": list(interval) if interval else None}
        rows.append(row)
    return rows


def wake_split(doc: dict[str, Any]) -> dict[str, float | None]:
    results = doc["results"]

    def value(name: str, key: str) -> float | None:
        if name == "best_peer":
            found = [v for v in (results.get(p, {}).get(key) for p in PEERS) if v is not None]
            return min(found) if found else None
        return results.get(name, {}).get(key)  # type: ignore[no-any-return]

    return {name: _div(value(a, key), value(b, key)) for name, a, b, key in WAKE_SPLIT}


def verdicts(values: dict[str, float | None], intervals: dict[str, Any] | None = None,
             slot_counts: list[int] | None = None) -> dict[str, dict[str, Any]]:
    """Each target: its value, the target, the 90% bootstrap interval and the verdict ("met", "missed",
    "within noise" when the interval spans the bound, "not judged" for the reported-only p99 ratios,
    "-" when not measured)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (what, op, bound) in targets_for(slot_counts or [1]).items():
        if name not in values:
            continue
        value = values.get(name)
        found = (intervals or {}).get(name)
        interval = (float(found[0]), float(found[1])) if found else None
        if op is None or bound is None:
            text, target = ("-" if value is None else "not judged"), "reported"
        else:
            text, target = verdict(interval, value, op, bound), f"{op} {bound:g}"
        out[name] = {"value": value, "target": target, "interval_90": list(interval) if interval else None,
                     "verdict": text, "of": what}
    return out


def _verdict(v: dict[str, Any]) -> str:
    text = str(v["verdict"])
    return "**missed**" if text == "missed" else text


def _f(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _interval(v: Any) -> str:
    return "{:.2f}-{:.2f}".format(*v) if v else ""


def markdown(doc: dict[str, Any]) -> str:
    parts: list[str] = []
    pg = doc["postgres"]
    settings = pg["settings"]
    sizes = doc["sizes"]
    parts.append(f"## {pg['version'].split(' on ')[0]}\n\n{pg.get('cpus')} CPUs, synchronous_commit="
                 f"{settings.get('synchronous_commit')}, fsync={settings.get('fsync')}, shared_buffers="
                 f"{settings.get('shared_buffers')}; mode: {doc['mode']}, drains of about {sizes['drain_seconds']:g} s"
                 f" (at most {sizes['throughput_jobs']} jobs) x {sizes['repetitions']} interleaved repetitions")
    load = doc.get("machine", {})
    if load.get("loadavg_start"):
        busy = max(load["loadavg_start"][0], (load.get("loadavg_end") or [0])[0])
        parts.append(f"load average (1 min) at start {load['loadavg_start'][0]:.2f}, at end "
                     f"{(load.get('loadavg_end') or [0])[0]:.2f}" + (" - other work shared this machine: read"
                     " absolute figures with care" if busy > 1.5 else ""))
    rows = []
    for name, entry in doc["results"].items():
        tp = entry.get("throughput_jobs_per_s")
        rows.append([name,
                     _f(tp["median"], 0) if tp else "-",
                     f"{tp['min']:,.0f}-{tp['max']:,.0f}" if tp else "-",
                     _f(entry.get("wake_p50_ms")), _f(entry.get("wake_p95_ms")), _f(entry.get("wake_p99_ms"))])
    parts.append(_table(["system (one slot)", "jobs/s (median)", "range", "wake p50 ms", "p95 ms", "p99 ms"], rows))
    conc = doc.get("concurrency", [])
    if conc:
        names = [n for n in ("pglane", "procrastinate", "pgqueuer", *FLOORS)
                 if any(n in e["results"] for e in conc)]
        crow = []
        for e in conc:
            cells = []
            for n in names:
                tp = e["results"].get(n, {}).get("throughput_jobs_per_s")
                cells.append(f"{tp['median']:,.0f} ({tp['min']:,.0f}-{tp['max']:,.0f})" if tp else "-")
            crow.append([str(e["slots"]), *cells])
        parts.append(_table(["slots", *[f"{n} jobs/s" for n in names]], crow))
        rrows = []
        for row in concurrency_ratios(doc):
            rrows.append([str(row["slots"]), *[
                f"{_f(v['value'])} ({_interval(v['interval_90'])})" for k, v in row.items() if k != "slots"]])
        header = [k for k in concurrency_ratios(doc)[0] if k != "slots"]
        parts.append(_table(["slots", *header], rrows))
    watched = doc.get("where_the_time_goes", {})
    if watched:
        wrows = []
        for key, w in watched.items():
            states = ", ".join(f"{k} {v:.0%}" for k, v in list(w["backend_states"].items())[:5])
            wrows.append([key, _f(w["jobs_per_s"], 0), _f(w["consumer_cpu_us_per_job"], 0),
                          _f(w["backend_cpu_us_per_job"], 0), f"{w['machine_cpu_busy']:.0%}", states])
        parts.append(_table(["watched drain", "jobs/s", "consumer CPU us/job", "backend CPU us/job",
                             "machine CPU busy", "server sessions' states (share of samples)"], wrows))
    claims = [[f"{c['queued']:,}", f"{c['finished']:,}", _f(c["p50_ms"], 3), _f(c["p99_ms"], 3)]
              for c in doc.get("claim_latency", [])]
    parts.append(_table(["queued", "finished", "claim p50 ms", "claim p99 ms"], claims))
    enqueue = doc.get("enqueue", {})
    enq_rows = [[name, _f(v["jobs_per_s"]["median"], 0), f"{v['jobs_per_s']['min']:,.0f}-{v['jobs_per_s']['max']:,.0f}"]
                for name, v in enqueue.items() if isinstance(v, dict) and "jobs_per_s" in v]
    parts.append(_table(["enqueue variant", "jobs/s (median)", "range"], enq_rows))
    parts += cost_markdown(doc)
    take = doc.get("takeover_s", {})
    if take:
        parts.append(f"takeover after SIGKILL: median {take['median']:.3f} s (range {take['min']:.3f}-"
                     f"{take['max']:.3f} s, {len(take['runs'])} kills)")
    target_rows = [[name, _f(v["value"], 3), _interval(v.get("interval_90")), v["target"], v["of"], _verdict(v)]
                   for name, v in doc.get("targets", {}).items()]
    parts.append(_table(["ratio", "value", "90% interval", "target", "of", "verdict"], target_rows))
    split = doc.get("wake_split", {})
    if any(v is not None for v in split.values()):
        parts.append(_table(["where the wake latency goes", "ratio"], [[k, _f(v, 3)] for k, v in split.items()]))
    return "\n\n".join(parts) + "\n"


def _spread(v: dict[str, Any] | None) -> str:
    return "-" if not v else f"{v['median']:,.0f} ({v['min']:,.0f}-{v['max']:,.0f})"


def cost_markdown(doc: dict[str, Any]) -> list[str]:
    """The cost per job (counted and drained), the #35 targets stated plainly, the connections."""
    cost = doc.get("cost_per_job", {})
    counted = doc.get("cost_counted", {})
    parts = []
    rows = []
    for name, c in cost.items():
        d = c.get("real_drain", {})
        rows.append([name, _spread(c.get("instructions_per_job")), _spread(c.get("wal_bytes_per_job_no_fpi")),
                     _spread(c.get("wal_bytes_per_job")), _f(d.get("round_trips_per_job")),
                     _f(d.get("commits_per_job")), _f(d.get("write_commits_per_job")),
                     _f(d.get("wal_bytes_per_job"), 0)])
    if rows:
        parts.append(_table(["cost per job", "server instructions (median, min-max)", "WAL bytes, no full-page images",
                             "WAL bytes", "real drain: round trips", "commits (all)", "write commits", "WAL bytes"],
                            rows))
    if "skipped" in counted:
        parts.append(f"server instructions and counted WAL: skipped: {counted['skipped']}")
    elif counted:
        lines = [f"Counted in a single-user backend of {counted['postgres']} ({counted['bindir']}), "
                 f"{len(cost['pglane']['instructions_per_job']['runs'])} rounds of "
                 f"{cost['pglane']['jobs_per_round']} jobs. #35's targets:"]
        for name, v in doc.get("targets", {}).items():
            if not name.startswith(("cost_", "connections_")) or v["value"] is None:
                continue
            peer = better_peer(cost, COUNTED.get(name.split(" ")[0], "")) if "best_peer" in name else None
            judged = {"met": "**met**", "missed": "**not met**"}.get(v["verdict"], v["verdict"])
            low, high = v.get("interval_90") or (v["value"], v["value"])
            lines.append(f"- {name.replace('best_peer', peer or 'best_peer')} ({v['of']}): {v['value']:.3f} "
                         f"[{low:.3f}-{high:.3f}], target {v['target']}: {judged}")
        parts.append("\n".join(lines))
        conns = counted["connections"]
        ipj = conns["instructions_per_job"]
        crow = [[f"{n}" + (f" + {conns['idle_sessions'][n]} idle sessions" if conns["idle_sessions"][n] else ""),
                 *[_spread(ipj[name][n]) for name in ipj], _f(conns["claim_latency"][n]["p50_ms"], 3)]
                for n in conns["idle_sessions"]]
        crow.append(["added per job (median of rounds)",
                     *[f"{conns['instructions_added'][name]['median']:+,.0f}" for name in ipj], ""])
        crow.append(["ratio (median of rounds)",
                     *[f"{conns['instructions_ratio'][name]['median']:.4f}" for name in ipj],
                     f"{conns['claim_p50_ratio']['value']:.3f}"])
        parts.append(_table(["max_connections", *[f"instructions per job, {name}" for name in ipj],
                             "claim p50 ms (real backend)"], crow))
    return parts


def versions_table(blocks: list[dict[str, Any]]) -> str:
    """Every server's verdicts side by side: one row per target, one column per server."""
    names: list[str] = []
    for b in blocks:
        names += [n for n in b.get("targets", {}) if n not in names]
    header = ["ratio", *[b["postgres"]["version"].split(" on ")[0].split(" (")[0] for b in blocks]]
    rows = []
    for name in names:
        cells = []
        for b in blocks:
            v = b.get("targets", {}).get(name)
            cells.append("-" if v is None or v["value"] is None else
                         f"{v['value']:.2f} [{_interval(v.get('interval_90'))}] {_verdict(v)}")
        rows.append([name, *cells])
    return "## every server\n\n" + _table(header, rows) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Claim latency p50/p99 per backlog case (linear y from 0), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    claims = doc.get("claim_latency", [])
    labels = [f"{c['queued']:,} queued" + (f"\n+ {c['finished']:,} finished" if c["finished"] else "") for c in claims]
    xs = list(range(len(claims)))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [c["p50_ms"] for c in claims], marker="o", label="p50")
    ax.plot(xs, [c["p99_ms"] for c in claims], marker="s", label="p99")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("pglane.claim() latency, ms (client side, incl. commit)")
    ax.set_title("pglane claim latency vs backlog and history")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
