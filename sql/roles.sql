-- Roles: what each of pglane's three group roles may do, the whole set, in one place.
--
-- pglane_producer, pglane_worker and pglane_operator are NOLOGIN group roles (made by revision 0006
-- when missing; cluster-wide, so a downgrade keeps them): an administrator grants them to login roles
-- (docs/security.md). A role may do exactly what this file grants it: the file first takes back
-- everything the three roles hold on pglane's schema and its objects, then gives the set below, so
-- applying it again changes nothing. A revision that changes a right changes this file and applies
-- it, after the files whose functions it names (a grant names a function by its signature).
--
-- PUBLIC has nothing: no table, view or function of pglane (PostgreSQL gives PUBLIC EXECUTE on every
-- new function; every revision takes it back, pglane.schema.apply_sql). Nobody but the owner may
-- UPDATE or DELETE jobs and attempts. Every function a role may call that writes is SECURITY DEFINER
-- with a fixed search_path.

REVOKE ALL ON SCHEMA pglane FROM pglane_producer, pglane_worker, pglane_operator;
REVOKE ALL ON ALL TABLES IN SCHEMA pglane FROM pglane_producer, pglane_worker, pglane_operator;  -- views, columns too
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pglane FROM pglane_producer, pglane_worker, pglane_operator;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pglane FROM pglane_producer, pglane_worker, pglane_operator;
REVOKE ALL ON ALL TABLES IN SCHEMA pglane FROM PUBLIC;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pglane FROM PUBLIC;

-- Every role: the schema; the version check (pglane's commands refuse a database at another
-- revision); slot_holders; the read-only helpers that the views call (a view's functions are checked
-- as the role that queries it) and that listings and metrics read; and waiting for a job's result
-- (await_job marks the job awaited, and a producer may mark only its own jobs).
GRANT USAGE ON SCHEMA pglane TO pglane_producer, pglane_worker, pglane_operator;
GRANT SELECT ON pglane.alembic_version, pglane.slot_holders TO pglane_producer, pglane_worker, pglane_operator;
GRANT EXECUTE ON FUNCTION
    pglane.caller(), pglane.sees_every_job(name),                                          -- jobs.sql
    pglane.lane_consumers(integer, integer), pglane.lanes_consumers(),                     -- slots.sql
    pglane.holds_mark(integer, bigint),
    pglane.session_alive(integer, timestamptz, bigint, integer, integer),                  -- sessions.sql
    pglane.in_flight(text), pglane.lease_wait_note(text, bigint, timestamptz),
    pglane.lanes_in_flight(),                                                              -- strict.sql
    pglane.parse_rate(text), pglane.rate_text(integer, interval), pglane.rate_window_use(text),
    pglane.rate_next_start(text), pglane.lanes_next_start(),                               -- rate.sql
    pglane.group_in_flight(pglane.lanes, text), pglane.groups_waiting(text),               -- groups.sql
    pglane.pause_note(text, timestamptz, text, text, text, bigint[]),                      -- pause.sql
    pglane.queue_positions(text),                                                          -- views.sql
    pglane.notifications_skipped(),                                                        -- lanes.sql
    pglane.await_job(bigint)                                                               -- wait.sql
    TO pglane_producer, pglane_worker, pglane_operator;

-- pglane_producer: enqueue (the function, or a plain INSERT of the input columns), wait for a job
-- (await_job, above) and read the status of its own jobs: job_status shows a producer only the jobs
-- it enqueued, and the policies below only its own rows of jobs.
GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer, interval, text)
    TO pglane_producer;
GRANT INSERT (lane, payload, idempotency_key, run_after, cost, group_key, priority, job_timeout, traceparent)
    ON pglane.jobs TO pglane_producer;
-- INSERT ... ON CONFLICT (lane, idempotency_key) DO NOTHING reads the conflict target's columns.
GRANT SELECT (lane, idempotency_key) ON pglane.jobs TO pglane_producer;
GRANT SELECT ON pglane.job_status TO pglane_producer;

-- pglane_worker: claim, complete, fail, defer (a handler's RetryLater), recover, and list the stuck
-- attempts (a traced worker's recovery writes their spans: pglane.tracing); read the lanes, the jobs and
-- their attempts (the worker's queue gauges count running attempts), every column of attempts but token:
-- the secret claim() tells only the claiming session, which complete() and fail() from elsewhere need.
GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.claim_or_wait(text, text),
                          pglane.complete(bigint, jsonb, uuid), pglane.fail(bigint, text, boolean, uuid),
                          pglane.complete_and_claim(bigint, jsonb, text, text, uuid), pglane.recover(text),
                          pglane.defer(bigint, interval, text, uuid), pglane.stuck_attempts(text)
    TO pglane_worker;
GRANT SELECT ON pglane.lanes, pglane.jobs TO pglane_worker;
GRANT SELECT (lane_id, paused_until) ON pglane.lane_counters TO pglane_worker;  -- the pause gauge (metrics)
GRANT SELECT (id, job_id, attempt_number, status, worker, backend_pid, backend_start, session_mark, started_at,
              finished_at, lease_expires_at, error, seq, lease_released_at, lease_released_by)
    ON pglane.attempts TO pglane_worker;

-- pglane_operator: read the lanes, the jobs, their attempts, the recorded starts, the tallies, the
-- remembered keys and every view; decide about a job (retry, cancel) or a lost attempt's lease
-- (release_lease); recover, prune, change a lane's settings (set_lane), pause and resume a lane
-- (pause.sql), count the tallies again.
GRANT SELECT ON pglane.lanes, pglane.jobs, pglane.attempts, pglane.lane_starts, pglane.lane_tallies,
                pglane.pruned_keys, pglane.lane_status, pglane.job_status, pglane.running_attempts,
                pglane.slot_sessions, pglane.lane_groups, pglane.lane_pauses
    TO pglane_operator;
GRANT EXECUTE ON FUNCTION pglane.retry(bigint), pglane.cancel(bigint), pglane.release_lease(bigint),
                          pglane.recover(text), pglane.stuck_attempts(text),
                          pglane.prune(interval, text, boolean, boolean),
                          pglane.prune_batch(interval, text, boolean, bigint, integer, boolean),
                          pglane.set_lane(text, jsonb), pglane.lane_flow(text), pglane.lane_queue(text),
                          pglane.recount_tallies(), pglane.group_status(text, integer),
                          pglane.pause_lane(text, timestamptz, text), pglane.resume_lane(text)
    TO pglane_operator;

-- Rows of jobs: a producer reads only the jobs it enqueued (enqueued_by = caller(), jobs.sql) and may
-- insert any; workers and operators see every job. (The owner, whom row-level security does not
-- bind, sees every row as well.)
ALTER TABLE pglane.jobs ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS jobs_producer_reads_own ON pglane.jobs;
CREATE POLICY jobs_producer_reads_own ON pglane.jobs FOR SELECT TO pglane_producer
    USING (enqueued_by = pglane.caller());
DROP POLICY IF EXISTS jobs_producer_inserts ON pglane.jobs;
CREATE POLICY jobs_producer_inserts ON pglane.jobs FOR INSERT TO pglane_producer WITH CHECK (true);
DROP POLICY IF EXISTS jobs_workers_and_operators ON pglane.jobs;
CREATE POLICY jobs_workers_and_operators ON pglane.jobs TO pglane_worker, pglane_operator USING (true);
