"""One worker process for many lanes and slots (#34): `pglane worker a b=2 ... --handler [LANE=]M:C`.
Real worker processes, real signals: each job once, in order and with a gapless seq per lane; a SIGKILL
mid-calls on several lanes recovered by the next process; one lane's hung call, standby wait or settings
never holding up another lane; a graceful stop and --max-jobs over the whole process."""

from __future__ import annotations

import asyncio
import itertools
import signal
import statistics
import threading
from collections.abc import Callable
from typing import Any

import pytest

import pglane
from pglane.worker import Worker, WorkerOptions
from tests.conftest import Ledger, Workers, console, metrics_port, scrape, slot_holder, take_slot, wait_until
from tests.crash.conftest import check_invariants

PAID = ("--handler", "tests.handlers:paid_call")


def create(conn: Any, lanes: dict[str, int], **settings: Any) -> list[str]:
    """Create each lane with its slots (and ``settings``); the worker's LANE[=N] arguments for all of them."""
    for name, slots in lanes.items():
        pglane.create_lane(conn, name, slots=slots, **{"job_timeout": 30, **settings})
    return [name if n == 1 else f"{name}={n}" for name, n in lanes.items()]


def status(conn: Any, job: int) -> str:
    return str(pglane.job_status(conn, job)["status"])


def all_done(conn: Any, jobs: list[int]) -> Callable[[], bool]:
    return lambda: all(status(conn, j) == "done" for j in jobs)


def holders(conn: Any, lanes: dict[str, int]) -> dict[str, int]:
    """How many sessions hold a slot of each lane now."""
    return {name: len(slot_holder(conn, name)) for name in lanes}


def held_by_one_process(conn: Any, lanes: dict[str, int]) -> Callable[[], bool]:
    return lambda: holders(conn, lanes) == lanes


def start_delays(conn: Any, jobs: list[int]) -> list[float]:
    """Seconds from each job's commit to its start, on the database clock."""
    rows = conn.execute("SELECT extract(epoch FROM started_at - created_at)::float8 AS d FROM pglane.jobs"
                        " WHERE id = ANY(%s)", (jobs,)).fetchall()
    return [r["d"] for r in rows]


def test_one_process_serves_20_lanes_each_job_once_in_order_with_a_gapless_seq(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {f"lane{i:02}": 2 if i < 5 else 1 for i in range(20)}
    proc = workers.start_lanes(create(conn, lanes), *PAID, "--poll-interval", "30")
    wait_until(held_by_one_process(conn, lanes), 60, "the one process to hold all 25 slots")
    jobs: dict[str, list[int]] = {name: [] for name in lanes}
    for n, name in itertools.product(range(8), lanes):  # interleaved: every lane is woken, again and again
        jobs[name].append(pglane.enqueue(conn, name, {"sleep": 0.02, "n": n}))
    every = [j for js in jobs.values() for j in js]
    wait_until(all_done(conn, every), 90, "every job of every lane")

    calls = ledger.calls()
    assert sorted(calls) == sorted(every)  # each job called once: none lost, none twice
    intervals = ledger.intervals()
    for name, ids in jobs.items():
        check_invariants(conn, name, ids, ledger)  # gapless seq, nothing running, nothing paid twice
        if lanes[name] == 1:  # a one-slot lane: in order, one call at a time
            assert [j for j in calls if j in ids] == ids, name
            mine = [(start, end) for start, end, job in intervals if job in ids]
            assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(mine)), f"{name}: calls overlapped"
    assert Workers.log(proc).count("holding slot") == 25 and proc.poll() is None


def test_each_lane_has_its_own_handler_and_a_handler_sees_job_lane(conn: Any, workers: Workers) -> None:
    lanes = {"echoed": 1, "paid": 1, "other": 1}
    workers.start_lanes(create(conn, lanes), "--handler", "echoed=tests.handlers:echo",
                        "--handler", "tests.handlers:lane_and_seq")
    jobs = {name: pglane.enqueue(conn, name, {"to": name}) for name in lanes}
    wait_until(all_done(conn, list(jobs.values())), 30, "a job of each lane")
    assert pglane.result(conn, jobs["echoed"]) == {"echo": {"to": "echoed"}}
    assert pglane.result(conn, jobs["paid"]) == {"lane": "paid", "seq": 1}
    assert pglane.result(conn, jobs["other"]) == {"lane": "other", "seq": 1}


def test_a_sigkill_mid_calls_on_several_lanes_loses_each_running_attempt_and_the_next_process_explains_it(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"a": 1, "b": 1, "c": 1, "d": 2}
    args = create(conn, lanes)
    cut = {name: [pglane.enqueue(conn, name, {"sleep": 60}) for _ in range(n)] for name, n in lanes.items()}
    after = {name: [pglane.enqueue(conn, name, {}) for _ in range(2)] for name in lanes}
    victim = workers.start_lanes(args, *PAID)
    in_flight = [j for js in cut.values() for j in js]
    wait_until(lambda: sorted(ledger.calls()) == sorted(in_flight), 30, "a call in progress on every slot")
    victim.kill()
    victim.wait()
    assert all(status(conn, j) == "running" for j in in_flight)  # the database has not been told yet
    successor = workers.start_lanes(args, *PAID)
    wait_until(all_done(conn, [j for js in after.values() for j in js]), 60, "the next process to serve every lane")
    assert holders(conn, lanes) == lanes and successor.poll() is None  # it took every slot
    for name in lanes:
        check_invariants(conn, name, cut[name] + after[name], ledger)
        for job in cut[name]:
            assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
            assert "the paid call may have been made" in pglane.job_status(conn, job)["last_error"]
    calls = ledger.calls()
    assert len(calls) == len(set(calls)) == len(in_flight) + 2 * len(lanes)  # nothing ran twice
    assert not any(event == "end" and job in in_flight for event, job, _, _ in ledger.events())


def test_a_hung_call_on_one_lane_never_holds_up_the_other_lanes(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"hung": 1, "a": 1, "b": 2, "c": 1}
    proc = workers.start_lanes(create(conn, lanes), *PAID, "--poll-interval", "30")
    wait_until(held_by_one_process(conn, lanes), 30, "every slot")
    hung = pglane.enqueue(conn, "hung", {"sleep": 25})  # a sync handler, well within its 30 s timeout
    wait_until(lambda: ledger.calls() == [hung], 20, "the hung call to start")
    others = []
    for n in range(10):  # one after another: each must be woken, claimed, called and stored
        batch = [pglane.enqueue(conn, name, {"n": n}) for name in ("a", "b", "c")]
        wait_until(all_done(conn, batch), 20, "the other lanes' jobs")
        others += batch
    assert status(conn, hung) == "running"  # all while the hung call went on
    assert "end" not in [event for event, job, _, _ in ledger.events() if job == hung]
    assert statistics.median(start_delays(conn, others)) < 0.1  # woken by their commits, not held up
    assert proc.poll() is None


def test_a_standby_slot_never_blocks_the_other_lanes_and_takes_over_at_once(
    conn: Any, session: Callable[..., Any], workers: Workers
) -> None:
    lanes = {"taken": 1, "free": 1}
    holder = session()
    args = create(conn, lanes)
    take_slot(holder, "taken")  # another consumer holds the only slot: the process waits for it
    proc = workers.start_lanes(args, *PAID, "--poll-interval", "30")
    wait_until(lambda: "standby: all 1 slot(s) of lane taken" in Workers.log(proc), 30, "the standby")
    wait_until(lambda: len(slot_holder(conn, "free")) == 1, 30, "the free lane's slot")
    jobs = []
    for _ in range(15):
        jobs.append(pglane.enqueue(conn, "free", {}))
        wait_until(all_done(conn, jobs[-1:]), 20, "the free lane's job")
    # A blocking standby wait (500 ms a turn) on the event loop would hold each wake-up up to that long.
    assert statistics.median(start_delays(conn, jobs)) < 0.1
    job = pglane.enqueue(conn, "taken", {})
    holder.close()  # the holder's session ends: the standby takes over at once, in its current wait
    wait_until(all_done(conn, [job]), 5, "the takeover")
    assert "holding slot 1 of lane taken" in Workers.log(proc)


def test_a_second_process_with_the_same_lanes_waits_as_standby_for_each_slot(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"a": 1, "b": 2, "c": 1}
    args = create(conn, lanes)
    first = workers.start_lanes(args, *PAID)
    wait_until(held_by_one_process(conn, lanes), 30, "the first process to hold every slot")
    pids = {name: slot_holder(conn, name) for name in lanes}
    second = workers.start_lanes(args, *PAID)
    wait_until(lambda: Workers.log(second).count("standby: all") == 4, 30, "a standby for each of the 4 slots")
    assert {name: slot_holder(conn, name) for name in lanes} == pids  # it took none
    assert "holding slot" not in Workers.log(second)
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    wait_until(lambda: Workers.log(second).count("holding slot") == 4, 20, "the second process to take every slot")
    jobs = [pglane.enqueue(conn, name, {}) for name in lanes for _ in range(3)]
    wait_until(all_done(conn, jobs), 30, "the second process to serve every lane")


def test_sigterm_while_calls_run_on_several_lanes_finishes_every_call_and_exits_0(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"a": 1, "b": 1, "c": 1, "d": 2}
    args = create(conn, lanes)
    running = [pglane.enqueue(conn, name, {"sleep": 2, "result": name}) for name, n in lanes.items()
               for _ in range(n)]
    queued = [pglane.enqueue(conn, name, {}) for name in lanes]
    proc = workers.start_lanes(args, *PAID)
    wait_until(lambda: sorted(ledger.calls()) == sorted(running), 30, "a call in progress on every slot")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert [status(conn, j) for j in running] == ["done"] * len(running)  # every call finished and stored
    assert [pglane.result(conn, j) for j in running] == [name for name, n in lanes.items() for _ in range(n)]
    assert [status(conn, j) for j in queued] == ["queued"] * len(queued)  # and no new one started
    leftover = conn.execute("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory'").fetchone()["n"]
    assert leftover == 0  # every slot released


@pytest.mark.parametrize("max_jobs", [1, 7])
def test_max_jobs_counts_the_jobs_of_every_lane_of_the_process(
    conn: Any, workers: Workers, ledger: Ledger, max_jobs: int
) -> None:
    lanes = {"a": 2, "b": 1, "c": 2}
    args = create(conn, lanes)
    jobs = [pglane.enqueue(conn, name, {"sleep": 0.2}) for _ in range(5) for name in lanes]
    proc = workers.start_lanes(args, *PAID, "--max-jobs", str(max_jobs))
    assert proc.wait(60) == 0
    assert len(ledger.calls()) == max_jobs  # five slots side by side, never a claim more between them
    statuses = [status(conn, j) for j in jobs]
    assert statuses.count("done") == max_jobs and statuses.count("queued") == len(jobs) - max_jobs


# Each slot on its own session (a process with no more slots than --sessions), or all on one shared session.
SESSIONS = pytest.mark.parametrize("sessions", [[], ["--sessions", "1"]], ids=["dedicated", "shared"])


@SESSIONS
def test_each_lane_keeps_its_own_timeouts_rate_and_pause(
    conn: Any, workers: Workers, ledger: Ledger, sessions: list[str]
) -> None:
    pglane.create_lane(conn, "quick", job_timeout=1, lease_timeout=3)
    pglane.create_lane(conn, "long", job_timeout=20)
    pglane.create_lane(conn, "rated", job_timeout=20, rate="1/2s")
    pglane.create_lane(conn, "paused", job_timeout=20)
    pglane.pause_lane(conn, "paused")
    workers.start_lanes(["quick", "long", "rated", "paused"], "--handler", "tests.handlers:async_paid_call", *sessions)
    quick, long = pglane.enqueue(conn, "quick", {"sleep": 2.5}), pglane.enqueue(conn, "long", {"sleep": 2.5})
    rated = [pglane.enqueue(conn, "rated", {}) for _ in range(3)]
    paused = pglane.enqueue(conn, "paused", {})
    wait_until(lambda: all_done(conn, [long, *rated])() and status(conn, quick) == "failed", 30, "the lanes' jobs")
    assert pglane.attempts(conn, quick)[0]["status"] == "timed_out"  # its 1 s, not the other lane's 20 s
    starts = [r["started_at"] for r in conn.execute(
        "SELECT started_at FROM pglane.jobs WHERE id = ANY(%s) ORDER BY started_at", (rated,))]
    assert all((b - a).total_seconds() >= 1.9 for a, b in itertools.pairwise(starts))  # its rate only
    assert status(conn, paused) == "queued"  # its pause held back nothing else
    pglane.resume_lane(conn, "paused")
    wait_until(all_done(conn, [paused]), 20, "the resumed lane's job")


@SESSIONS
def test_a_call_past_its_hard_timeout_stops_every_lane_and_exits_75_once_the_other_calls_finished(
    conn: Any, workers: Workers, ledger: Ledger, sessions: list[str]
) -> None:
    pglane.create_lane(conn, "stuck", job_timeout=1, lease_timeout=3)  # hard timeout 2 s
    pglane.create_lane(conn, "busy", job_timeout=20)
    stuck = pglane.enqueue(conn, "stuck", {"sleep": 60})  # a sync handler: it cannot be cancelled
    busy = pglane.enqueue(conn, "busy", {"sleep": 5, "result": "paid"})
    waiting = pglane.enqueue(conn, "busy", {})
    proc = workers.start_lanes(["stuck", "busy"], *PAID, *sessions)
    assert proc.wait(60) == 75
    attempt = pglane.attempts(conn, stuck)[0]
    assert attempt["status"] == "timed_out" and "hard timeout" in attempt["error"]
    assert (status(conn, busy), pglane.result(conn, busy)) == ("done", "paid")  # finished, not cut off
    assert status(conn, waiting) == "queued"  # no new job started once the process was to recycle
    assert "lane stuck: the handler of attempt" in Workers.log(proc) and "exiting 75" in Workers.log(proc)
    wait_until(lambda: slot_holder(conn, "stuck") == [] and slot_holder(conn, "busy") == [], 10, "the slots freed")


def test_one_metrics_server_serves_every_lane_of_the_process(conn: Any, workers: Workers) -> None:
    lanes = {"a": 1, "b": 2}
    port = metrics_port(workers.start_lanes(create(conn, lanes), *PAID, "--metrics-port", "0"))
    jobs = [pglane.enqueue(conn, "b", {}) for _ in range(3)]
    wait_until(all_done(conn, jobs), 30, "lane b's jobs")

    def reported() -> bool:
        a, b = scrape(port, "a"), scrape(port, "b")
        return (a.get("pglane_slot_held"), b.get("pglane_slot_held")) == (1, 2) and \
            (a.get("pglane_jobs_done_total"), b.get("pglane_jobs_done_total")) == (0, 3)

    wait_until(reported, 20, "each lane's slots and jobs, each under its own label")


@pytest.mark.parametrize(("args", "says"), [
    (["a", "b", "--handler", "a=tests.handlers:echo"], "no handler for lane b"),
    (["a", "--handler", "tests.handlers:echo", "--handler", "z=tests.handlers:echo"],
     "a handler is given for z, which this worker does not serve"),
    (["a=0", "--handler", "tests.handlers:echo"], "'a=0': give LANE or LANE=N, N a whole number of at least 1"),
    (["a=two", "--handler", "tests.handlers:echo"], "'a=two': give LANE or LANE=N"),
    (["a", "a=2", "--handler", "tests.handlers:echo"], "lane a is named twice"),
    (["a", "--handler", "tests.handlers:echo", "--handler", "tests.handlers:noop"], "two handlers for every lane"),
    (["a", "--handler", "a=tests.handlers:echo", "--handler", "a=tests.handlers:noop"], "two handlers for lane a"),
])
def test_the_worker_command_refuses_a_plan_it_cannot_serve(dsn: str, args: list[str], says: str) -> None:
    done = console(dsn, "worker", *args)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_the_worker_command_names_every_unknown_lane(dsn: str, conn: Any) -> None:
    pglane.create_lane(conn, "known")
    done = console(dsn, "worker", "known", "nope", "gone=2", "--handler", "tests.handlers:echo")
    assert done.returncode == 1 and "unknown lanes 'nope', 'gone'" in done.stderr, done.stderr
    assert not slot_holder(conn, "known")


def test_the_python_api_serves_many_lanes_with_a_handler_each_or_one_for_all(conn: Any, dsn: str) -> None:
    create(conn, {"a": 1, "b": 2})
    worker = Worker(dsn, lanes={"a": 1, "b": 2}, handler=lambda job: {"by": "all", "lane": job.lane},
                    handlers={"a": lambda job: {"by": "a", "lane": job.lane}}, options=WorkerOptions(poll_interval=30))
    loops: list[asyncio.AbstractEventLoop] = []
    codes: list[int] = []

    async def serve() -> None:
        loops.append(asyncio.get_running_loop())
        codes.append(await worker.main())

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        jobs = {name: [pglane.enqueue(conn, name, {}) for _ in range(3)] for name in ("a", "b")}
        wait_until(all_done(conn, jobs["a"] + jobs["b"]), 30, "both lanes' jobs")
    finally:
        wait_until(lambda: loops, 10, "the worker's loop")
        loops[0].call_soon_threadsafe(worker.stop)
        thread.join(20)
    assert codes == [0]
    assert [pglane.result(conn, j) for j in jobs["a"]] == [{"by": "a", "lane": "a"}] * 3
    assert [pglane.result(conn, j) for j in jobs["b"]] == [{"by": "all", "lane": "b"}] * 3


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"lane": "a", "handler": print, "lanes": {"b": 1}}, "one lane, or lanes="),
    ({"lanes": {"a": 0}, "handler": print}, "a=0: a worker takes at least 1 slot"),
    ({"lanes": ["a", "b"], "handlers": {"a": print}}, "no handler for lane b"),
    ({"lanes": ["a"], "handler": print, "handlers": {"b": print}}, "a handler is given for b"),
    ({"lanes": {}, "handler": print}, "name at least one lane"),
])
def test_the_python_api_refuses_a_plan_it_cannot_serve(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(pglane.ConfigurationError, match=says):
        Worker("dbname=unused", **kwargs)
