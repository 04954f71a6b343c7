-- Waiting for a job's result (pglane.wait, pglane.aio.wait, pglane enqueue --wait).
--
-- A completion notifies only the jobs somebody waits for: await_job() marks the job (jobs.awaited),
-- and the trigger below sends the job's id on channel pglane_done when a marked job finishes. On a
-- lane where nobody waits, an update of a job costs the trigger's WHEN test and nothing else: no
-- function call, no NOTIFY. complete(), fail(), cancel(), recover() and prune need no change.
-- The WHEN test is one column, NEW.awaited, and the rest of the test is in the function: PostgreSQL
-- reads a trigger's WHEN expression again from its stored text for every UPDATE statement, and the
-- whole test (statuses, OLD against NEW) cost about 45,000 instructions per statement, about 8 % of
-- a claim and completion (bench.callgrind); one column costs a few thousand.
--
-- A waiter LISTENs on pglane_done first, then calls await_job(): a completion committed after
-- await_job() marked the row is notified (the completion's UPDATE waits for the mark's row lock and
-- then sees awaited); one committed before is seen by await_job()'s own read.

-- notify_awaited: the trigger's body: tell the waiters which job finished (its id, nothing else).
-- Finished means done, failed or cancelled, entered by this update (a late result turning a failed
-- job done notifies again; a retried job that finishes again does too); an awaited job's other
-- updates (its claim, the mark itself) send nothing. Identical notifications of one transaction fold
-- into one.
CREATE OR REPLACE FUNCTION pglane.notify_awaited() RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NEW.status IN ('done', 'failed', 'cancelled') AND OLD.status IS DISTINCT FROM NEW.status THEN
        PERFORM pg_notify('pglane_done', NEW.id::text);
    END IF;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS jobs_awaited_finished ON pglane.jobs;
CREATE TRIGGER jobs_awaited_finished AFTER UPDATE ON pglane.jobs
    FOR EACH ROW WHEN (NEW.awaited) EXECUTE FUNCTION pglane.notify_awaited();

-- await_job: mark job p_job_id awaited (if the caller may see it and it is not finished yet) and
-- return where it is: one row with its status, result, last error, latest attempt, next safe action,
-- queue position and start time; a row with status 'pruned' and pruned_at for a job that a prune
-- deleted (its id lies in a range pruned_jobs recorded); no row for a job the caller may not see or
-- that never existed. Producers see, and so mark, only their own jobs (caller(), as job_status).
--
-- Marking locks the job's row for the length of this statement's transaction. A claim that meets a
-- queued row in that moment skips it (SKIP LOCKED) and takes the next eligible one, or none: so a
-- marked queued job wakes its lane's workers (at commit) and no claim is left waiting for its poll.
CREATE OR REPLACE FUNCTION pglane.await_job(p_job_id bigint,
    OUT job_id bigint, OUT status text, OUT result jsonb, OUT last_error text, OUT attempts integer,
    OUT attempt_id bigint, OUT next_safe_action text, OUT queue_position bigint, OUT waiting_for_worker boolean,
    OUT started_at timestamptz, OUT pruned_at timestamptz)
RETURNS SETOF record
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_caller text := pglane.caller();
    v_all    boolean := pglane.sees_every_job(pglane.caller()::name);
    v_marked record;
BEGIN
    UPDATE pglane.jobs j SET awaited = true
     WHERE j.id = p_job_id AND NOT j.awaited AND j.status IN ('queued', 'running')
       AND (v_all OR j.enqueued_by = v_caller)
    RETURNING j.status, j.lane INTO v_marked;
    IF FOUND AND v_marked.status = 'queued' THEN
        PERFORM pglane.notify_lane(l.id) FROM pglane.lanes l WHERE l.name = v_marked.lane;
    END IF;

    RETURN QUERY
    SELECT s.job_id, s.status::text, s.result, s.last_error, s.attempts, s.attempt_id, s.next_safe_action,
           s.queue_position, s.waiting_for_worker, s.started_at, NULL::timestamptz
      FROM pglane.job_status s
     WHERE s.job_id = p_job_id AND (v_all OR s.enqueued_by = v_caller);
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT p_job_id, 'pruned'::text, NULL::jsonb, NULL::text, NULL::integer, NULL::bigint,
           'nothing to do: it finished and was pruned; its result is no longer stored'::text, NULL::bigint,
           NULL::boolean, NULL::timestamptz, p.pruned_at
      FROM pglane.pruned_jobs p
     WHERE p_job_id BETWEEN p.first_id AND p.last_id
     ORDER BY p.pruned_at DESC
     LIMIT 1;
END $$;
