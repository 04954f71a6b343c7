"""bench.costs at tiny scale (#35): every system's statements, as its own client sends them, become a
procedure that really drains its jobs (checked in its own tables, no valgrind needed); with valgrind,
each system is counted per job with its spread, a claim's instructions at 100 and 1,000 connections
(revision 0008's claim, which read pg_stat_get_activity, grows with them; head's does not), and what
each feature of a lane adds. No figure of speed is asserted: only what must hold on any machine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bench import costs, report
from bench.server import with_db
from pglane import pgbin

needs_valgrind = pytest.mark.skipif(shutil.which("valgrind") is None,
                                    reason="needs valgrind (Debian's package valgrind)")


def test_placeholders_are_numbered_in_order_and_a_name_used_twice_is_one_number() -> None:
    assert costs.numbered("SELECT f(%s, %s::jsonb)") == ("SELECT f($1, $2::jsonb)", [None, None])
    assert costs.numbered("SELECT %(a)s, %(b)s, %(a)s") == ("SELECT $1, $2, $1", ["a", "b"])
    assert costs.numbered("SELECT $2, $1") == ("SELECT $2, $1", [None, None])


def _drain(dsn: str, name: str, queued: int, jobs: int) -> None:
    costs.consumer(name).setup(dsn, queued)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(costs.consumer(name).drain.call.format(jobs).rstrip(";"))


def test_the_floors_statements_drain_their_jobs_one_transaction_each(dsn: str) -> None:
    _drain(dsn, "floor_two_commits", 30, 10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows: dict[str, int] = dict(conn.execute("SELECT status, count(*) FROM floor_jobs GROUP BY status").fetchall())
        assert rows == {"done": 10, "queued": 20}
        text = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'cost_drain'").fetchone()
    assert text is not None
    body = text[0]
    # the floor's own statements, their placeholders plpgsql variables, each followed by a COMMIT
    assert "UPDATE floor_jobs SET status = 'done', finished_at = now() WHERE id = bench_a2_1" in body
    assert body.count("COMMIT;") == 2


def test_floor_rows_writes_the_contracts_rows_per_job(dsn: str) -> None:
    _drain(dsn, "floor_rows", 30, 10)
    with psycopg.connect(dsn, autocommit=True) as conn:
        jobs: dict[str, int] = dict(conn.execute("SELECT status, count(*) FROM floor_rows_jobs"
                                                 " GROUP BY status").fetchall())
        attempts: dict[str, int] = dict(conn.execute("SELECT status, count(*) FROM floor_rows_attempts"
                                                     " GROUP BY status").fetchall())
        seqs = conn.execute("SELECT array_agg(j.seq ORDER BY j.seq) = array_agg(a.seq ORDER BY a.seq)"
                            " AND array_agg(j.seq ORDER BY j.seq) = array(SELECT generate_series(1, 10)::bigint)"
                            " FROM floor_rows_jobs j JOIN floor_rows_attempts a ON a.job_id = j.id").fetchone()
    # 10 claims: the first 9 completed by the next claim's statement, the last left running
    assert jobs == {"done": 9, "running": 1, "queued": 20} and attempts == {"done": 9, "running": 1}
    assert seqs == (True,)


def test_the_peers_own_statements_drain_their_jobs(dsn: str) -> None:
    pytest.importorskip("procrastinate")
    pytest.importorskip("pgqueuer")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for db in ("costs_procrastinate", "costs_pgqueuer"):
            conn.execute(f"DROP DATABASE IF EXISTS {db}")
            conn.execute(f"CREATE DATABASE {db}")
    procrastinate = with_db(dsn, "costs_procrastinate")
    pgqueuer = with_db(dsn, "costs_pgqueuer")
    _drain(procrastinate, "procrastinate", 12, 5)
    _drain(pgqueuer, "pgqueuer", 12, 5)
    with psycopg.connect(procrastinate, autocommit=True) as conn:
        rows: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM procrastinate_jobs"
                                                 " GROUP BY status").fetchall())
        assert rows == {"succeeded": 5, "todo": 7}
    with psycopg.connect(pgqueuer, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        logged: dict[str, int] = dict(conn.execute("SELECT status::text, count(*) FROM pgqueuer_log"
                                                   " GROUP BY status").fetchall())
    assert left == (7,) and logged == {"queued": 12, "picked": 5, "successful": 5}


def test_the_servers_binaries_are_found_by_its_major_version(dsn: str) -> None:
    bindir, why = costs.bindir_of(dsn)
    assert bindir is not None, why
    with psycopg.connect(dsn) as conn:
        major = conn.execute("SELECT current_setting('server_version_num')::integer / 10000").fetchone()
    assert major is not None and costs.version(bindir).startswith(f"PostgreSQL {major[0]}.")


@needs_valgrind
def test_every_system_is_counted_per_job_with_its_spread() -> None:
    found = costs.per_job(pgbin.find_bindir(), 2, 10, [costs.consumer("pglane"), costs.consumer("floor_one_commit")])
    for name in ("pglane", "floor_one_commit"):
        figures = found[name]
        for key in ("instructions_per_job", "wal_bytes_per_job", "wal_bytes_per_job_no_fpi"):
            spread = figures[key]
            assert len(spread["runs"]) == 2 and spread["min"] <= spread["median"] <= spread["max"], (name, key)
        assert 50_000 < figures["instructions_per_job"]["min"] < 20_000_000, figures
        assert 0 < figures["wal_bytes_per_job_no_fpi"]["max"] <= figures["wal_bytes_per_job"]["max"], figures
    # pglane's claim and completion does more than the bare floor's one UPDATE pair, on any build
    assert found["pglane"]["instructions_per_job"]["min"] > found["floor_one_commit"]["instructions_per_job"]["max"]


@needs_valgrind
def test_a_claims_instructions_do_not_grow_with_the_servers_connections() -> None:
    found = costs.connections(pgbin.find_bindir(), 1, 10, claims=20, idle=5)
    assert set(found["instructions_per_job"]) == {"head", "0008", "floor_one_commit"}
    for rev in ("head", "0008", "floor_one_commit"):
        assert set(found["instructions_per_job"][rev]) == {"100", "1000"}
    head, before = found["instructions_ratio"]["head"]["median"], found["instructions_ratio"]["0008"]["median"]
    # 0008 read pg_stat_get_activity, whose snapshot is as long as max_connections; head's claim does not
    assert abs(head - 1) < 0.01 and before > head + 0.005, found["instructions_ratio"]
    assert abs(found["beyond_floor_ratio"]["median"] - 1) < 0.01, found["beyond_floor_ratio"]
    assert found["claim_latency"]["100"]["n"] == found["claim_latency"]["1000"]["n"] == 20
    assert found["claim_p50_ratio"]["value"] > 0


@needs_valgrind
def test_what_each_feature_adds_to_a_plain_lane(tmp_path: Path) -> None:
    out = tmp_path / "features.json"
    assert costs.main(["--rounds", "1", "--jobs", "20", "--json", str(out)]) == 0
    found: dict[str, Any] = json.loads(out.read_text())["features"]
    assert set(found) == set(costs.FEATURES)
    plain = found["plain"]["instructions_per_job"]["median"]
    for name in ("rate", "strict", "groups", "waiters"):  # each runs more SQL per claim or completion
        assert found[name]["added"]["median"] > 0.005 * plain, (name, found[name])
    assert abs(found["bound"]["ratio"]["median"] - 1) < 0.02, found["bound"]  # a counter bumped in a row written anyway


def _counted(*runs: float) -> dict[str, Any]:
    return {"median": sorted(runs)[len(runs) // 2], "min": min(runs), "max": max(runs), "runs": list(runs)}


def test_the_cost_targets_take_the_better_peer_within_each_round_and_say_met_or_not() -> None:
    block: dict[str, Any] = {"results": {}, "intervals": {}, "postgres": {}, "cost_per_job": {
        "pglane": {"instructions_per_job": _counted(1000.0, 1010.0, 990.0), "jobs_per_round": 300,
                   "wal_bytes_per_job_no_fpi": _counted(100.0, 100.0, 100.0),
                   "wal_bytes_per_job": _counted(150.0, 300.0, 200.0)},
        "procrastinate": {"instructions_per_job": _counted(1100.0, 1111.0, 1089.0),
                          "wal_bytes_per_job_no_fpi": _counted(400.0, 400.0, 400.0),
                          "wal_bytes_per_job": _counted(800.0, 500.0, 600.0)},
        "pgqueuer": {"instructions_per_job": _counted(5000.0, 5000.0, 5000.0),
                     "wal_bytes_per_job_no_fpi": _counted(150.0, 150.0, 150.0),
                     "wal_bytes_per_job": _counted(150.0, 150.0, 150.0)},
        "floor_one_commit": {"instructions_per_job": _counted(250.0, 252.5, 247.5)}}}
    values = report.ratios(block)
    assert values["cost_instructions pglane/best_peer"] == pytest.approx(1000 / 1100)  # procrastinate, every round
    assert values["cost_wal pglane/best_peer"] == pytest.approx(100 / 150)  # pgqueuer writes less
    assert values["cost_instructions pglane/floor_one_commit"] == pytest.approx(4.0)
    targets = report.verdicts(values, block["intervals"])
    assert targets["cost_instructions pglane/best_peer"]["verdict"] == "missed"
    assert targets["cost_wal_fpi pglane/best_peer"]["target"] == "reported"
    text = "\n".join(report.cost_markdown({**block, "targets": targets, "cost_counted": {"skipped": "no valgrind"}}))
    assert "skipped: no valgrind" in text and "1,000 (990-1,010)" in text
    names = ("head", "0008", "floor_one_commit")
    block["cost_counted"] = {"postgres": "PostgreSQL 18.6", "bindir": "/x", "connections": {
        "idle_sessions": {"100": 0, "1000": 500},
        "instructions_per_job": {name: {"100": _counted(1.0), "1000": _counted(1.0)} for name in names},
        "instructions_ratio": {"head": {"median": 1.013, "interval_90": [1.012, 1.014]}, "0008": {"median": 1.2},
                               "floor_one_commit": {"median": 1.06}},
        "instructions_added": {name: {"median": 13000.0} for name in names},
        "beyond_floor_ratio": {"median": 1.0005, "interval_90": [0.9999, 1.0009]},
        "claim_latency": {"100": {"p50_ms": 1.0}, "1000": {"p50_ms": 1.1}},
        "claim_p50_ratio": {"value": 1.1, "interval_90": [1.0, 1.2]}}}
    targets = report.verdicts(report.ratios(block), block["intervals"])
    assert targets["connections_beyond_floor 1000/100"]["verdict"] == "met"
    assert targets["connections_instructions 1000/100"]["verdict"] == "not judged"
    text = "\n".join(report.cost_markdown({**block, "targets": targets}))
    assert "cost_instructions pglane/procrastinate" in text and "**not met**" in text and "**met**" in text
    assert "cost_instructions pglane/floor_one_commit" in text and "1000 + 500 idle sessions" in text
