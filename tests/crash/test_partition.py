"""Network faults between real worker processes and the database, injected at random moments of paid
calls: a silent partition (both directions), a one-way partition each way, added latency, a reset.
Each worker talks to PostgreSQL through a loopback proxy of its own (tests/netproxy.py), so a fault
cuts one worker off, as a partitioned host would be.

On a strict lane (takeover after_lease) no two calls ever overlap in time; on an immediate lane they
may, by at most the cut-off worker's hard timeout counted from its claim (README). On both, no job's
call is made twice, no job is lost, every attempt is explained, and seq stays gapless."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

import pglane
from tests.conftest import Ledger, Workers, slot_holder, wait_until
from tests.crash.conftest import check_invariants, drained
from tests.netproxy import NetProxy

CUTS = 20
JOB_TIMEOUT, HARD_TIMEOUT, LIVENESS, LEASE = 1.0, 1.3, 1.0, 2.5  # S1: lease >= hard timeout + liveness
FAULTS = ("silent", "to_server", "to_client", "latency", "reset")


@pytest.fixture
def proxied(dsn: str, workers: Workers) -> Iterator[dict[int, NetProxy]]:
    """Two workers of the lane given later, each through its own proxy: {worker pid: its proxy}."""
    proxies: dict[int, NetProxy] = {}
    yield proxies
    for proxy in proxies.values():
        proxy.close()


def start_workers(dsn: str, lane: str, workers: Workers, proxies: dict[int, NetProxy]) -> None:
    for _ in range(2):
        proxy = NetProxy.for_dsn(dsn)
        proc = workers.start(lane, "tests.handlers:paid_call", "--timeout", str(HARD_TIMEOUT),
                             "--liveness", str(LIVENESS), "--poll-interval", "1", "--recover-interval", "1",
                             env={"PGLANE_DSN": proxy.dsn_through(dsn)})
        proxies[proc.pid] = proxy


def holder_proxy(conn: Any, lane: str, proxies: dict[int, NetProxy]) -> NetProxy:
    """The proxy of the worker holding the lane's slot (its application_name ends with host:pid)."""
    def find() -> NetProxy | None:
        for pid in slot_holder(conn, lane):
            row = conn.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
            if row and (worker := int(row["application_name"].rsplit(":", 1)[-1])) in proxies:
                return proxies[worker]
        return None

    found: NetProxy = wait_until(find, 30, "a worker holding the slot")
    return found


def started(ledger: Ledger, job: int) -> bool:
    return job in ledger.calls()


@contextlib.contextmanager
def fault(proxy: NetProxy, kind: str) -> Iterator[None]:
    if kind == "silent":
        proxy.blackhole()
    elif kind in ("to_server", "to_client"):
        proxy.one_way(kind)  # type: ignore[arg-type]
    elif kind == "latency":
        proxy.latency(0.3)
    else:
        proxy.reset()
    try:
        yield
    finally:
        proxy.forward()


def overlaps(ledger: Ledger) -> list[tuple[int, int, float]]:
    """(job, next job, seconds) for every two finished calls that overlapped in time."""
    out = []
    for (s1, e1, j1), (s2, _, j2) in itertools.combinations(ledger.intervals(), 2):
        if s2 < e1 and s1 < s2:
            out.append((j1, j2, (e1 - s2) / 1e9))
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("takeover", ["after_lease", "immediate"])
def test_network_faults_at_random_moments_of_paid_calls(
    dsn: str, conn: Any, workers: Workers, ledger: Ledger, proxied: dict[int, NetProxy], takeover: str
) -> None:
    rng = random.Random(f"partition-{takeover}")
    lane = "cut"
    pglane.create_lane(conn, lane, job_timeout=JOB_TIMEOUT, lease_timeout=LEASE, takeover=takeover)
    start_workers(dsn, lane, workers, proxied)
    jobs: list[int] = []
    seen = {kind: 0 for kind in FAULTS}
    for cut in range(CUTS):
        kind = FAULTS[cut % len(FAULTS)]
        seen[kind] += 1
        proxy = holder_proxy(conn, lane, proxied)
        length = rng.uniform(0.6, 0.95)  # most of the job timeout: a takeover can start beside it
        job = pglane.enqueue(conn, lane, {"sleep": length})
        jobs.append(job)
        wait_until(lambda: started(ledger, job), 30, f"the call of job {job} to start")  # noqa: B023
        time.sleep(rng.uniform(0, length / 3))  # a random moment of the call, early enough to matter
        with fault(proxy, kind):
            time.sleep(rng.uniform(0.2, 2.5))  # the fault lasts, then the network heals
        drained(conn, lane, jobs, timeout=60)
    more = [pglane.enqueue(conn, lane, {"sleep": 0.05}) for _ in range(5)]  # the lane goes on
    drained(conn, lane, jobs + more, timeout=60)

    check_invariants(conn, lane, jobs + more, ledger)  # nothing lost or paid twice, explained, seq gapless
    seen_overlaps = overlaps(ledger)
    if takeover == "after_lease":
        assert seen_overlaps == [], f"calls overlapped on a strict lane: {seen_overlaps}"
    else:  # README: a cut-off call may overlap the next by at most its hard timeout from its claim
        assert all(seconds <= HARD_TIMEOUT for _, _, seconds in seen_overlaps), seen_overlaps
    outcomes = conn.execute("SELECT a.status, count(*) AS n FROM pglane.attempts a JOIN pglane.jobs j"
                            " ON j.id = a.job_id WHERE j.lane = %s GROUP BY 1 ORDER BY 1", (lane,)).fetchall()
    print(f"{takeover}: {CUTS} cuts {seen}, attempts {outcomes}, overlaps {seen_overlaps}")


@pytest.mark.parametrize("shared", [False, True], ids=["dedicated", "shared"])
@pytest.mark.parametrize("kind", ["silent", "to_server", "to_client"])
def test_a_silent_or_one_way_partition_during_a_call_is_noticed_within_the_liveness_deadline(
    dsn: str, conn: Any, workers: Workers, ledger: Ledger, kind: str, shared: bool
) -> None:
    liveness = 2.0
    pglane.create_lane(conn, "quiet", job_timeout=20)
    pglane.create_lane(conn, "idle", job_timeout=20)  # shared: two lanes on one session (--sessions 1)
    with NetProxy.for_dsn(dsn) as proxy:
        env = {"PGLANE_DSN": proxy.dsn_through(dsn)}
        if shared:
            proc = workers.start_lanes(["quiet", "idle"], "--handler", "tests.handlers:paid_call", "--sessions", "1",
                                       "--liveness", str(liveness), env=env)
        else:
            proc = workers.start("quiet", "tests.handlers:paid_call", "--liveness", str(liveness), env=env)
        job = pglane.enqueue(conn, "quiet", {"sleep": 8})
        wait_until(lambda: started(ledger, job), 30, "the call to start")
        with fault(proxy, kind):
            cut = time.monotonic()
            wait_until(lambda: "the slot session died during attempt" in Workers.log(proc), 10,
                       "the worker to notice")
            noticed = time.monotonic() - cut
        print(f"{kind}: noticed after {noticed:.2f}s (liveness {liveness:g}s)")
        assert noticed <= liveness + 1.0  # a quarter of it quiet, three quarters for an answer; 1 s for the loop
        wait_until(lambda: pglane.job_status(conn, job)["status"] == "done", 30, "the result, delivered late")
        assert ledger.calls() == [job]


@pytest.mark.parametrize("shared", [False, True], ids=["dedicated", "shared"])
def test_a_cut_off_call_ends_before_its_lease_ends_on_the_server(
    dsn: str, conn: Any, workers: Workers, ledger: Ledger, shared: bool
) -> None:
    # Self-fencing: a handler that ignores cancellation, on a worker whose network goes silent. The
    # call's hard timeout counts from the claim's sending, so the process (and with it the call) ends
    # before the lease the server started at the claim: by then nobody may have taken the job's slot.
    pglane.create_lane(conn, "fenced", job_timeout=JOB_TIMEOUT, lease_timeout=LEASE, takeover="after_lease")
    with NetProxy.for_dsn(dsn) as proxy:
        args = ("--timeout", str(HARD_TIMEOUT), "--liveness", str(LIVENESS))
        env = {"PGLANE_DSN": proxy.dsn_through(dsn)}
        if shared:  # two lanes on one shared session
            pglane.create_lane(conn, "beside", job_timeout=JOB_TIMEOUT, lease_timeout=LEASE)
            proc = workers.start_lanes(["fenced", "beside"], "--handler", "tests.handlers:ignores_cancellation",
                                       "--sessions", "1", *args, env=env)
        else:
            proc = workers.start("fenced", "tests.handlers:ignores_cancellation", *args, env=env)
        job = pglane.enqueue(conn, "fenced", {"sleep": 30})
        wait_until(lambda: started(ledger, job), 30, "the call to start")
        with fault(proxy, "silent"):
            wait_until(lambda: proc.poll() is not None, 30, "the worker to end its hung call")
            ended = conn.execute("SELECT now() AS t").fetchone()["t"]
    assert proc.returncode == 75
    lease = conn.execute("SELECT a.lease_expires_at FROM pglane.attempts a WHERE a.job_id = %s",
                         (job,)).fetchone()["lease_expires_at"]
    assert ended < lease, f"the call outlived its lease ({ended} >= {lease})" + Workers.log(proc)
