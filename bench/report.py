"""Turning measurements into the ratios against the targets, a markdown report and the claim plot."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

PEERS = ("procrastinate", "pgqueuer")

# name: (how the ratio reads, the target's comparison, the bound)
TARGETS: dict[str, tuple[str, str, float]] = {
    "pglane/floor_contract": ("throughput", ">=", 0.9),
    "floor_contract/floor_one_commit": ("throughput", ">=", 0.6),
    "pglane/best_peer": ("throughput", ">=", 3.0),
    "wake_p99 pglane/floor_listen": ("wake p99 latency", "<=", 1.5),
    "claim_p50 max_backlog/1k": ("claim p50 latency", "<=", 1.3),
    "claim_p50 history/1k": ("claim p50 latency", "<=", 1.3),
    "enqueue_time bounded/unbounded": ("time per enqueue at 100k queued", "<=", 1.5),
    "takeover_s": ("median seconds", "<", 1.0),
}


# Where the wake-latency gap is (reported beside the targets, no bound): floor_listen_contract runs
# pglane's SQL in floor_listen's bare loop, so it splits pglane/floor_listen into what the claim SQL
# costs over one UPDATE and what the worker's Python costs over the SQL.
WAKE_SPLIT = (("wake_p50 floor_listen_contract/floor_listen", "floor_listen_contract", "floor_listen", "wake_p50_ms"),
              ("wake_p50 pglane/floor_listen_contract", "pglane", "floor_listen_contract", "wake_p50_ms"),
              ("wake_p99 floor_listen_contract/floor_listen", "floor_listen_contract", "floor_listen", "wake_p99_ms"),
              ("wake_p99 pglane/floor_listen_contract", "pglane", "floor_listen_contract", "wake_p99_ms"))


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def _throughput(results: dict[str, Any], name: str) -> float | None:
    entry = results.get(name, {}).get("throughput_jobs_per_s")
    return None if entry is None else float(entry["median"])


def _paired(results: dict[str, Any], a: str, b: str | list[str]) -> float | None:
    """Throughput of ``a`` over ``b`` (or the best of several), as the median of the ratios taken within
    each repetition: the runs of one repetition ran back to back, so they share the machine's state
    (slow drifts of the disk's fsync time cancel out). Falls back to the ratio of the medians."""
    runs_a = results.get(a, {}).get("throughput_jobs_per_s", {}).get("runs")
    names = [b] if isinstance(b, str) else b
    runs_b = [results.get(n, {}).get("throughput_jobs_per_s", {}).get("runs") for n in names]
    runs_b = [r for r in runs_b if r]
    if runs_a and runs_b and all(len(r) == len(runs_a) for r in runs_b):
        return float(statistics.median(x / max(r[i] for r in runs_b) for i, x in enumerate(runs_a)))
    best = [t for t in (_throughput(results, n) for n in names) if t is not None]
    return _div(_throughput(results, a), max(best) if best else None)


def ratios(doc: dict[str, Any]) -> dict[str, float | None]:
    results = doc["results"]
    peers = [t for t in (_throughput(results, p) for p in PEERS) if t is not None]
    claims = doc.get("claim_latency", [])
    base = next((c for c in claims if c["queued"] == 1_000 and c["finished"] == 0), None)
    deepest = max((c for c in claims if c["finished"] == 0), key=lambda c: c["queued"], default=None)
    history = max((c for c in claims if c["finished"] > 0), key=lambda c: c["finished"], default=None)
    enqueue = doc.get("enqueue", {})

    def rate(name: str) -> float | None:
        value = enqueue.get(name, {}).get("jobs_per_s", {}).get("median")
        return None if value is None else float(value)

    return {
        "pglane/floor_contract": _paired(results, "pglane", "floor_contract"),
        "floor_contract/floor_one_commit": _paired(results, "floor_contract", "floor_one_commit"),
        "pglane/best_peer": _paired(results, "pglane", list(PEERS)) if peers else None,
        "wake_p99 pglane/floor_listen": _div(results.get("pglane", {}).get("wake_p99_ms"),
                                             results.get("floor_listen", {}).get("wake_p99_ms")),
        "claim_p50 max_backlog/1k": _div(deepest["p50_ms"] if deepest else None, base["p50_ms"] if base else None),
        "claim_p50 history/1k": _div(history["p50_ms"] if history else None, base["p50_ms"] if base else None),
        # time per enqueue, bounded over unbounded = unbounded rate over bounded rate
        "enqueue_time bounded/unbounded": _div(rate("insert_unbounded_100k"), rate("insert_bounded_100k")),
        "takeover_s": doc.get("takeover_s", {}).get("median"),
    }


def wake_split(doc: dict[str, Any]) -> dict[str, float | None]:
    results = doc["results"]
    return {name: _div(results.get(a, {}).get(key), results.get(b, {}).get(key)) for name, a, b, key in WAKE_SPLIT}


def verdicts(values: dict[str, float | None],
             intervals: dict[str, tuple[float, float]] | None = None) -> dict[str, dict[str, Any]]:
    """Each target met or not by its measured value; where the ratio has a bootstrap interval
    (the wake p99), ``within_noise`` says whether the bound lies inside it, i.e. whether another run
    on the same machine could as well have given the other verdict."""
    out: dict[str, dict[str, Any]] = {}
    for name, (what, op, bound) in TARGETS.items():
        value = values.get(name)
        met = None if value is None else {"<": value < bound, "<=": value <= bound, ">=": value >= bound}[op]
        out[name] = {"value": value, "target": f"{op} {bound:g}", "of": what, "met": met}
        interval = (intervals or {}).get(name)
        if interval is not None:
            out[name].update({"interval_90": list(interval), "within_noise": interval[0] <= bound <= interval[1]})
    return out


def _verdict(v: dict[str, Any]) -> str:
    text = {True: "met", False: "**missed**", None: "-"}[v["met"]]
    return text + (" (within noise: the interval spans the target)" if v.get("within_noise") else "")


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


def markdown(doc: dict[str, Any]) -> str:
    parts: list[str] = []
    pg = doc["postgres"]
    settings = pg["settings"]
    parts.append(f"**{pg['version'].split(' on ')[0]}**, {pg.get('cpus')} CPUs, synchronous_commit="
                 f"{settings.get('synchronous_commit')}, fsync={settings.get('fsync')}, shared_buffers="
                 f"{settings.get('shared_buffers')}; mode: {doc['mode']}, {doc['sizes']['throughput_jobs']} jobs"
                 f" per drain x {doc['sizes']['repetitions']} interleaved runs")
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
    parts.append(_table(["system", "jobs/s (median)", "range", "wake p50 ms", "p95 ms", "p99 ms"], rows))
    claims = [[f"{c['queued']:,}", f"{c['finished']:,}", _f(c["p50_ms"], 3), _f(c["p99_ms"], 3)]
              for c in doc.get("claim_latency", [])]
    parts.append(_table(["queued", "finished", "claim p50 ms", "claim p99 ms"], claims))
    enqueue = doc.get("enqueue", {})
    enq_rows = [[name, _f(v["jobs_per_s"]["median"], 0), f"{v['jobs_per_s']['min']:,.0f}-{v['jobs_per_s']['max']:,.0f}"]
                for name, v in enqueue.items() if isinstance(v, dict) and "jobs_per_s" in v]
    parts.append(_table(["enqueue variant", "jobs/s (median)", "range"], enq_rows))
    cost_rows = [[name, _f(c.get("round_trips_per_job")), _f(c.get("commits_per_job")),
                  _f(c.get("write_commits_per_job")), _f(c.get("wal_bytes_per_job"), 0)]
                 for name, c in doc.get("cost_per_job", {}).items()]
    parts.append(_table(["cost per job", "round trips", "commits (all)", "write commits", "WAL bytes"], cost_rows))
    take = doc.get("takeover_s", {})
    if take:
        parts.append(f"takeover after SIGKILL: median {take['median']:.3f} s (range {take['min']:.3f}-"
                     f"{take['max']:.3f} s, {len(take['runs'])} kills)")
    target_rows = [[name, _f(v["value"], 3),
                    "{:.2f}-{:.2f}".format(*v["interval_90"]) if v.get("interval_90") else "",
                    v["target"], v["of"], _verdict(v)]
                   for name, v in doc.get("targets", {}).items()]
    parts.append(_table(["ratio", "value", "90% interval", "target", "of", "verdict"], target_rows))
    split = doc.get("wake_split", {})
    if any(v is not None for v in split.values()):
        parts.append(_table(["where the wake latency goes", "ratio"], [[k, _f(v, 3)] for k, v in split.items()]))
    return "\n\n".join(parts) + "\n"


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
