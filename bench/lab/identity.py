"""What the session identity costs a claim: revision 0008 read the claiming session's start from
pg_stat_activity (hidden from a non-superuser owner on managed PostgreSQL, and a snapshot of every
backend per claim); revision 0009 gives each session a mark, a session advisory lock checked by the
claim (docs/managed.md). Server instructions per job (bench.callgrind: a single-user backend drains
jobs through complete_and_claim), both revisions interleaved in one cluster.

    python -m bench.lab.identity [--rounds 3] [--jobs 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import psycopg

from pglane import schema

from .. import callgrind

BEFORE = "0008"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.identity", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per revision")
    p.add_argument("--jobs", type=int, default=300, help="jobs drained per round")
    args = p.parse_args(argv)
    missing = callgrind.available()
    if missing:
        print(f"bench.lab.identity: {missing}", file=sys.stderr)
        return 2

    def at(revision: str):  # type: ignore[no-untyped-def]
        def setup(dsn: str) -> None:
            schema.upgrade(dsn, revision)
            with psycopg.connect(dsn, autocommit=True) as conn:  # a plain INSERT: either revision takes it
                conn.execute("INSERT INTO pglane.lanes (name) VALUES ('cc')")
        return setup

    counts = callgrind.interleaved_drains({"identity_before": at(BEFORE), "identity_mark": at("head")},
                                          args.jobs, args.rounds)
    before, after = counts["identity_before"], counts["identity_mark"]
    ratios = [a / b for a, b in zip(after, before, strict=True)]
    print(json.dumps({"jobs_per_round": args.jobs, "rounds": args.rounds,
                      f"instructions_per_job_at_{BEFORE}": before, "instructions_per_job_with_marks": after,
                      "ratio_median": statistics.median(ratios), "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
