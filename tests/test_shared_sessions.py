"""Slots on a few shared sessions (#34): `pglane worker LANE[=N] ... --sessions K`. Real worker processes
and real sessions: 200 lanes on at most 4 connections, each job once, in order, with a gapless seq per
lane; a shared session cut (every slot on it lost at once, its attempts lost and explained, nothing run
twice, the slots taken again); a SIGKILL mid-calls; a second process as standby for each slot; a hung
call on one lane beside the others; idle lanes that cost one statement per session, not one per lane."""

from __future__ import annotations

import itertools
import signal
import statistics
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any

import pglane
from tests.conftest import Ledger, Workers, metrics_port, slot_holder, wait_until
from tests.crash.conftest import check_invariants
from tests.test_many_lanes import PAID, all_done, create, held_by_one_process, start_delays, status


def connections(conn: Any, name: str) -> list[dict[str, Any]]:
    """The server sessions of the worker named ``name`` (its sessions' application_name carries it)."""
    rows: list[dict[str, Any]] = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE application_name LIKE %s", (f"%{name}%",)).fetchall()
    return rows


def test_200_lanes_on_4_sessions_run_each_job_once_in_order_with_a_gapless_seq(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {f"t{i:03}": 2 if i % 10 == 0 else 1 for i in range(200)}  # 220 slots
    proc = workers.start_lanes(create(conn, lanes), *PAID, "--sessions", "4", "--name", "many",
                               "--poll-interval", "30")
    wait_until(held_by_one_process(conn, lanes), 120, "the one process to hold all 220 slots")
    assert len(connections(conn, "many")) <= 4
    pids = {pid for name in lanes for pid in slot_holder(conn, name)}
    assert len(pids) == 4  # every slot on one of the 4 sessions
    assert all(len(set(slot_holder(conn, name))) == 2 for name, n in lanes.items() if n == 2)  # spread
    jobs: dict[str, list[int]] = {name: [] for name in lanes}
    for n, name in itertools.product(range(3), lanes):  # interleaved: every lane woken, again and again
        jobs[name].append(pglane.enqueue(conn, name, {"n": n}))
    every = [j for js in jobs.values() for j in js]
    wait_until(all_done(conn, every), 120, "every job of every lane")
    calls = ledger.calls()
    assert sorted(calls) == sorted(every)  # each job called once
    for name, ids in jobs.items():
        check_invariants(conn, name, ids, ledger)  # gapless seq, nothing running, nothing paid twice
        if lanes[name] == 1:
            assert [j for j in calls if j in ids] == ids, f"{name}: out of order"
    assert len(connections(conn, "many")) <= 4 and proc.poll() is None


def test_a_cut_shared_session_loses_each_attempt_on_it_and_its_slots_are_taken_again(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {f"c{i}": 1 for i in range(6)}
    spare = {"spare": 1}  # an idle lane: a slot of the process that is free to recover (busy ones recover between jobs)
    proc = workers.start_lanes(create(conn, lanes | spare), *PAID, "--sessions", "2", "--name", "cut",
                               "--recover-interval", "1s", "--poll-interval", "1s")
    wait_until(held_by_one_process(conn, lanes | spare), 30, "every slot")
    victim = slot_holder(conn, "c0")[0]
    on_victim = [name for name in lanes if slot_holder(conn, name) == [victim]]
    assert 0 < len(on_victim) < len(lanes)  # the lanes are spread over both sessions
    calls = {name: pglane.enqueue(conn, name, {"sleep": 8}) for name in lanes}
    wait_until(lambda: sorted(ledger.calls()) == sorted(calls.values()), 20, "a call on every lane")
    conn.execute("SELECT pg_terminate_backend(%s)", (victim,))
    # Every attempt claimed on the cut session is lost at once (its mark is gone: the process's other
    # session recovers them), while its calls go on: the lanes' next jobs wait for the slots again.
    for name in on_victim:
        job = calls[name]

        def lost(job: int = job) -> bool:
            return bool(pglane.attempts(conn, job)[0]["status"] == "lost")

        wait_until(lost, 6, "the lost attempt")
        assert "the paid call may have been made" in pglane.job_status(conn, job)["last_error"]
    assert not any(event == "end" for event, _, _, _ in ledger.events())  # all while the calls went on
    # The calls end: each result is delivered by the slot's next session (the attempt's token), a late
    # result kept because no newer attempt exists; the other session's calls were never disturbed.
    wait_until(all_done(conn, list(calls.values())), 30, "every call's result")
    wait_until(held_by_one_process(conn, lanes | spare), 30, "the cut session's slots taken again")
    after = [pglane.enqueue(conn, name, {}) for name in lanes]
    wait_until(all_done(conn, after), 30, "every lane served after the cut")
    for name in lanes:  # one attempt each (the lost ones were not re-run), its late result turning lost into done
        assert [a["status"] for a in pglane.attempts(conn, calls[name])] == ["done"], name
    made = ledger.calls()
    assert len(made) == len(set(made)) == len(lanes) * 2  # nothing ran twice
    assert len(connections(conn, "cut")) <= 2 and proc.poll() is None


def test_a_sigkill_mid_calls_loses_every_attempt_of_every_session_and_the_next_process_takes_every_slot(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {f"k{i}": 2 if i < 2 else 1 for i in range(10)}
    args = create(conn, lanes)
    cut = {name: [pglane.enqueue(conn, name, {"sleep": 60}) for _ in range(n)] for name, n in lanes.items()}
    after = {name: [pglane.enqueue(conn, name, {}) for _ in range(2)] for name in lanes}
    victim = workers.start_lanes(args, *PAID, "--sessions", "3")
    in_flight = [j for js in cut.values() for j in js]
    wait_until(lambda: sorted(ledger.calls()) == sorted(in_flight), 30, "a call in progress on every slot")
    victim.kill()
    victim.wait()
    successor = workers.start_lanes(args, *PAID, "--sessions", "3", "--recover-interval", "1s")
    wait_until(all_done(conn, [j for js in after.values() for j in js]), 60, "the next process to serve every lane")
    assert successor.poll() is None
    wait_until(held_by_one_process(conn, lanes), 30, "the next process to hold every slot")
    for name in lanes:
        check_invariants(conn, name, cut[name] + after[name], ledger)
        for job in cut[name]:
            assert [a["status"] for a in pglane.attempts(conn, job)] == ["lost"]
    calls = ledger.calls()
    assert len(calls) == len(set(calls)) == len(in_flight) + 2 * len(lanes)  # nothing ran twice


def test_a_second_process_on_shared_sessions_waits_as_standby_for_each_slot(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"a": 1, "b": 2, "c": 1, "d": 1, "e": 1}
    args = create(conn, lanes)
    first = workers.start_lanes(args, *PAID, "--sessions", "2")
    wait_until(held_by_one_process(conn, lanes), 30, "the first process to hold every slot")
    pids = {name: sorted(slot_holder(conn, name)) for name in lanes}
    second = workers.start_lanes(args, *PAID, "--sessions", "2", "--name", "standby")
    wait_until(lambda: Workers.log(second).count("standby: all") == 6, 30, "a standby for each of the 6 slots")
    wait_until(lambda: len(connections(conn, "standby")) == 2, 10, "the standby's 2 sessions")
    assert {name: sorted(slot_holder(conn, name)) for name in lanes} == pids  # it took none
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    wait_until(lambda: Workers.log(second).count("holding slot") == 6, 20, "the second process to take every slot")
    wait_until(held_by_one_process(conn, lanes), 10, "every slot held by the second process")
    jobs = [pglane.enqueue(conn, name, {}) for name in lanes for _ in range(3)]
    wait_until(all_done(conn, jobs), 30, "the second process to serve every lane")
    assert len(connections(conn, "standby")) <= 2


def test_a_hung_call_on_a_shared_session_never_holds_up_the_other_lanes_on_it(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"hung": 1, "a": 1, "b": 2, "c": 1}
    proc = workers.start_lanes(create(conn, lanes), *PAID, "--sessions", "1", "--poll-interval", "30")
    wait_until(held_by_one_process(conn, lanes), 30, "every slot")
    hung = pglane.enqueue(conn, "hung", {"sleep": 20})
    wait_until(lambda: ledger.calls() == [hung], 20, "the hung call to start")
    others = []
    for n in range(10):
        batch = [pglane.enqueue(conn, name, {"n": n}) for name in ("a", "b", "c")]
        wait_until(all_done(conn, batch), 20, "the other lanes' jobs")
        others += batch
    assert status(conn, hung) == "running"
    assert statistics.median(start_delays(conn, others)) < 0.1  # woken by their commits through the one reader
    assert proc.poll() is None


def test_idle_lanes_on_shared_sessions_cost_one_statement_per_session_not_one_per_lane(
    conn: Any, workers: Workers
) -> None:
    lanes = {f"i{i:02}": 1 for i in range(40)}
    proc = workers.start_lanes(create(conn, lanes), *PAID, "--sessions", "2", "--poll-interval", "0.5s",
                               "--recover-interval", "1s", "--metrics-port", "0")
    port = metrics_port(proc)
    wait_until(held_by_one_process(conn, lanes), 30, "every slot")

    def claims() -> float:
        """The claims the process has made, every lane together (its claim latency histogram's count), read
        from one scrape (forty, on a loaded machine, would miss some: a lane read as none)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith("pglane_claim_latency_seconds_count{"))

    wait_until(lambda: claims() >= len(lanes), 10, "each slot's first claim")

    def quiet_for_a_poll() -> bool:
        """No claim for a poll interval: the start's own wake-ups (the lanes' news read with a first claim)
        are answered. A poll per lane would never be quiet so long."""
        first = claims()
        time.sleep(0.6)
        return claims() == first

    wait_until(quiet_for_a_poll, 20, "the process's start to be answered")
    before = claims()
    time.sleep(3)  # the window measured: six poll intervals of 40 idle lanes
    # A poll per lane would claim 40 x 6 = 240 times in it, and a recovery timer that woke every slot
    # 40 x 3; the sessions' polls (one statement each per interval, asking which lanes have a job due, then
    # the process's recovery of every lane when due) claim for none of them.
    assert claims() == before
    job = pglane.enqueue(conn, "i17", {})  # a wake-up still reaches its lane: one claim, through the reader
    wait_until(all_done(conn, [job]), 10, "the woken lane's job")
    assert claims() - before <= 2  # the job's claim (and, after it, the claim that finds the lane empty)
    assert proc.poll() is None


def test_a_job_whose_run_after_comes_is_found_by_the_sessions_poll(conn: Any, workers: Workers) -> None:
    lanes = {f"p{i}": 1 for i in range(6)}
    workers.start_lanes(create(conn, lanes), *PAID, "--sessions", "1", "--poll-interval", "1s")
    wait_until(held_by_one_process(conn, lanes), 30, "every slot")
    job = pglane.enqueue(conn, "p3", {}, run_after=datetime.now(UTC) + timedelta(seconds=1))
    wait_until(all_done(conn, [job]), 10, "the delayed job, found by the poll (no notification comes when it is due)")
    waited = start_delays(conn, [job])[0]
    assert 1.0 <= waited < 4.0, waited


def test_two_slots_of_a_lane_on_one_session_are_two_consumers_and_run_two_calls(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {"two": 2, "one": 1}
    workers.start_lanes(create(conn, lanes), *PAID, "--sessions", "1")
    wait_until(lambda: len(slot_holder(conn, "two")) == 2 and len(slot_holder(conn, "one")) == 1, 30, "every slot")
    assert len(set(slot_holder(conn, "two") + slot_holder(conn, "one"))) == 1  # all three on the one session
    consumers = {r["lane"]: r["consumers"] for r in pglane.lane_status(conn)}
    assert consumers == {"two": 2, "one": 1}  # slots held, not sessions (revision 0015)
    jobs = [pglane.enqueue(conn, "two", {"sleep": 1}) for _ in range(2)]
    wait_until(all_done(conn, jobs), 20, "both jobs")
    (_, a_end, _), (b_start, _, _) = sorted(ledger.intervals())
    assert b_start < a_end  # the lane's two slots called side by side, on one session
    attempts = [pglane.attempts(conn, j)[0] for j in jobs]
    assert attempts[0]["backend_pid"] == attempts[1]["backend_pid"]


def test_max_jobs_ends_a_process_on_shared_sessions_at_its_last_job_not_at_the_next_poll(
    conn: Any, workers: Workers, ledger: Ledger
) -> None:
    lanes = {f"m{i}": 1 for i in range(8)}
    create(conn, lanes)
    proc = workers.start_lanes([], *PAID, "--lanes-like", "m%", "--max-jobs", "2", "--poll-interval", "30")
    wait_until(held_by_one_process(conn, lanes), 30, "every slot")
    jobs = [pglane.enqueue(conn, "m3", {}) for _ in range(3)]
    wait_until(all_done(conn, jobs[:2]), 20, "two jobs")
    assert proc.wait(10) == 0  # the seven idle slots were told at once, not after the 30 s poll
    assert status(conn, jobs[2]) == "queued" and len(ledger.calls()) == 2
