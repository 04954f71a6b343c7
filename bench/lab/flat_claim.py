"""#35: what does the claim's layering cost, and would a flattened claim reach 3x the better peer?

The worker's fast path, complete_and_claim, calls complete_impl, claim_impl, and through it claim_slot,
pick, take and session_mark: seven plpgsql functions a job, one step one function (sql/claim.sql).
This counts the server instructions per job (bench.callgrind: a single-user backend drains a plain
lane through complete_and_claim) of three databases, interleaved in one cluster:

- ``layered``: pglane at head;
- ``flat``: head with complete_and_claim replaced by bench/lab/flat_claim.sql, the same work for a
  plain lane written out in one function (the fast paths of the six it calls), checked first to drain
  jobs on that fast path as head does (every job done once, one attempt each, seqs gapless; its slower
  paths call head's functions and are not exercised here);
- ``flat_unguarded``: ``flat`` without two of the guarantees beside the contract's rows, the attempts'
  CHECK (an attempt is never both finished and running) and the waiters' trigger (``enqueue --wait``
  is told when its job ends): what a claim flattened and stripped of those would cost.

The flattened text follows head's functions of revision 0018: it stops with an error, not a wrong
figure, once any of them has changed (their text is compared with the hashes below).

    python -m bench.lab.flat_claim [--rounds 3] [--jobs 300] [--bindir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg

from pglane import schema

from .. import callgrind

FLAT = Path(__file__).with_name("flat_claim.sql")

# The functions flat_claim.sql writes out, as revision 0018 installs them: sha256 of prosrc.
INLINED = {
    "complete_and_claim": "1caba39332cc4659321a3273bb8f31efcda167aa3a54e76d358747cc71f0c312",
    "complete_impl": "46a33e67b518f0efdfe73a338f3d56bfa1746ea79c3fe56385d261331844e116",
    "claim_impl": "44fa6cc0b9bf087c9af0b7187435cad957f45b305ec46ace9fd32f99df499561",
    "claim_slot": "90f890155b5f46b7e8ec79ba47c53a896c93fd34bac52b276e42aa79df222229",
    "pick": "78ccd155236e6780af1646646cdd046ecc2023445e702c9589bf46cd831cb815",
    "take": "da770bf5712024858b945236e307279132c90efd93fb77db01e7c242c2025785",
    "session_mark": "f28e0c0c4e256c901ecf0ca659b4bd5f8b0c1f380a5824b9c904f7b2f0fc43af",
}

UNGUARD = ("ALTER TABLE pglane.attempts DROP CONSTRAINT attempt_finished_when_not_running;"
           " DROP TRIGGER jobs_awaited_finished ON pglane.jobs;")

CHECK_JOBS = 40  # drained through the flattened function before it is counted


def installed_hashes(conn: psycopg.Connection[tuple[object, ...]]) -> dict[str, str]:
    """sha256 of the installed text (prosrc) of each function flat_claim.sql writes out."""
    rows = conn.execute("SELECT p.proname, p.prosrc FROM pg_proc p WHERE p.pronamespace = 'pglane'::regnamespace"
                        " AND p.proname = ANY (%s)", (list(INLINED),)).fetchall()
    return {str(name): hashlib.sha256(str(src).encode()).hexdigest() for name, src in rows}


def check_drain(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Drain CHECK_JOBS jobs of a lane of their own through the installed complete_and_claim and
    raise unless each finished once, with one attempt, its seq that attempt's, the seqs gapless."""
    conn.execute("INSERT INTO pglane.lanes (name) VALUES ('flat_check')")
    conn.execute("INSERT INTO pglane.jobs (lane, payload) SELECT 'flat_check', '{}' FROM generate_series(1, %s)",
                 (CHECK_JOBS + 1,))
    conn.execute(callgrind.DRAIN)
    conn.execute("CALL public.callgrind_drain('flat_check', %s)", (CHECK_JOBS,))
    found = conn.execute(
        "SELECT count(*) FILTER (WHERE j.status = 'done'), count(*) FILTER (WHERE j.status = 'running'),"
        " bool_and(j.attempts = 1),"
        " array_agg(j.seq ORDER BY j.seq) = ARRAY(SELECT generate_series(1, %s)::bigint),"
        " bool_and(a.seq = j.seq AND a.status = CASE WHEN j.status = 'done' THEN 'done' ELSE 'running' END)"
        " FROM pglane.jobs j JOIN pglane.attempts a ON a.job_id = j.id WHERE j.lane = 'flat_check'",
        (CHECK_JOBS + 1,)).fetchone()
    if found != (CHECK_JOBS, 1, True, True, True):
        raise SystemExit(f"the flattened complete_and_claim drained {CHECK_JOBS} jobs wrongly: done, running,"
                         f" one attempt each, seqs gapless, attempts' seqs = {found}")


def setup(flat: bool, unguarded: bool) -> Callable[[str], None]:
    def make(dsn: str) -> None:
        schema.upgrade(dsn, "head")
        with psycopg.connect(dsn, autocommit=True) as conn:
            if flat:
                hashes = installed_hashes(conn)
                moved = sorted(n for n, h in INLINED.items() if hashes.get(n) != h)
                if moved:
                    raise SystemExit(f"bench.lab.flat_claim: {', '.join(moved)} changed since revision 0018,"
                                     " which bench/lab/flat_claim.sql writes out: run it at that revision")
                conn.execute(FLAT.read_text(encoding="utf-8").encode())
                check_drain(conn)
            if unguarded:
                conn.execute(UNGUARD)
            conn.execute("INSERT INTO pglane.lanes (name) VALUES ('cc')")
    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.flat_claim", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    p.add_argument("--jobs", type=int, default=300, help="jobs drained per round")
    p.add_argument("--bindir", type=Path, help="PostgreSQL's bin directory (default: the embedded server's)")
    args = p.parse_args(argv)
    missing = callgrind.available()
    if missing:
        print(f"bench.lab.flat_claim: {missing}", file=sys.stderr)
        return 2
    counts = callgrind.interleaved_drains({"layered": setup(False, False), "flat": setup(True, False),
                                           "flat_unguarded": setup(True, True)}, args.jobs, args.rounds,
                                          bindir=args.bindir)
    layered = counts["layered"]
    out: dict[str, object] = {"jobs_per_round": args.jobs, "rounds": args.rounds}
    for name, runs in counts.items():
        ratios = [a / b for a, b in zip(runs, layered, strict=True)]
        out[name] = {"instructions_per_job": runs, "median": statistics.median(runs),
                     "of_layered_median": statistics.median(ratios)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
