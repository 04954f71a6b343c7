-- Recovery and a person's decisions: evidence-based recovery of attempts whose worker is gone,
-- the stuck report, retry and cancel.

-- in_flight: the calls of lane p_lane that may be in flight right now: running attempts, and lost ones
-- whose lease has not passed on the database clock and that nobody released (release_lease): the
-- worker of such an attempt may still be calling. `lease_ends` and `lost_attempt` name the lost
-- attempt whose lease ends first. A strict lane's claim (takeover after_lease) counts this; the views
-- explain a wait with it. Read-only; runs as its owner so that a producer's job_status may call it.
CREATE OR REPLACE FUNCTION pglane.in_flight(p_lane text,
    OUT in_flight bigint, OUT lost_attempt bigint, OUT lease_ends timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT count(*),
           (array_agg(a.id ORDER BY a.lease_expires_at) FILTER (WHERE a.status = 'lost'))[1],
           min(a.lease_expires_at) FILTER (WHERE a.status = 'lost')
      FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id
     WHERE j.lane = p_lane
       AND (a.status = 'running'
            OR (a.status = 'lost' AND a.lease_released_at IS NULL AND a.lease_expires_at > now()));
$$;

-- release_lease: a person who knows the worker of lost attempt p_attempt_id is stopped ends the wait
-- for its lease on a strict lane: recorded on the attempt (who, when), and the lane is woken. Refused
-- (PGL08) for an attempt that is not lost with its lease still running.
CREATE OR REPLACE FUNCTION pglane.release_lease(p_attempt_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane text;
BEGIN
    UPDATE pglane.attempts a SET lease_released_at = now(), lease_released_by = pglane.caller()
     WHERE a.id = p_attempt_id AND a.status = 'lost' AND a.lease_released_at IS NULL
       AND a.lease_expires_at > now()
    RETURNING (SELECT j.lane FROM pglane.jobs j WHERE j.id = a.job_id) INTO v_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL08',
            MESSAGE = format('attempt %s is not a lost attempt whose lease still runs: there is no wait to end',
                             p_attempt_id),
            HINT = 'pglane status shows which attempt a strict lane waits for';
    END IF;
    PERFORM pglane.notify_lane((SELECT l.id FROM pglane.lanes l WHERE l.name = v_lane));
    RETURN true;
END $$;

-- running_attempts: every running attempt with the evidence about its worker. `alive` false means
-- recover() will mark it lost; `stuck` means past its lease with its worker still connected.
CREATE OR REPLACE VIEW pglane.running_attempts AS
SELECT a.id AS attempt_id, a.job_id, j.lane, l.id AS lane_id, a.attempt_number, a.worker,
       a.backend_pid, a.backend_start, a.started_at, a.lease_expires_at,
       pglane.session_alive(a.backend_pid, a.backend_start, a.session_mark, l.id, l.slots) AS alive,
       now() > a.lease_expires_at AS past_lease
  FROM pglane.jobs j
  JOIN pglane.lanes l ON l.name = j.lane
  JOIN pglane.attempts a ON a.job_id = j.id AND a.attempt_number = j.attempts
 WHERE j.status = 'running' AND a.status = 'running';

-- recover: mark lost the running attempts (of one lane, or all) whose session is provably gone;
-- returns how many. On a lane with attempts left the job goes back to the queue (at-least-once work),
-- or is failed with the reason when its bounded lane is full; otherwise it is failed with a reason saying the paid call may have been made, and never re-run
-- without a person's decision. Each job is re-checked under its row lock; one being completed right
-- now is skipped (its completion decides).
CREATE OR REPLACE FUNCTION pglane.recover(p_lane text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    r       record;
    v_count integer := 0;
    v_error text;
BEGIN
    FOR r IN SELECT ra.attempt_id, ra.job_id, ra.lane, ra.attempt_number, ra.worker, ra.backend_pid,
                    ra.backend_start, l.max_attempts
               FROM pglane.running_attempts ra JOIN pglane.lanes l ON l.id = ra.lane_id
              WHERE (p_lane IS NULL OR ra.lane = p_lane) AND NOT ra.alive
    LOOP
        PERFORM 1 FROM pglane.jobs j WHERE j.id = r.job_id AND j.status = 'running'
                   AND j.attempts = r.attempt_number FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;
        -- Re-check the evidence now that the job is locked.
        CONTINUE WHEN EXISTS (SELECT 1 FROM pglane.running_attempts ra
                               WHERE ra.attempt_id = r.attempt_id AND ra.alive);
        v_error := format('worker %s (session pid %s, started %s) was gone during attempt %s: '
                          'the paid call may have been made', r.worker, r.backend_pid, r.backend_start,
                          r.attempt_number);
        UPDATE pglane.attempts a SET status = 'lost', finished_at = now(), error = v_error
         WHERE a.id = r.attempt_id AND a.status = 'running';
        CONTINUE WHEN NOT FOUND;
        PERFORM pglane.requeue_or_fail(
            r.job_id, r.lane, r.attempt_number, v_error,
            '; re-queued: the lane allows ' || r.max_attempts || ' attempts',
            '; not re-run automatically: retry only if paying again is acceptable', interval '0');
        v_count := v_count + 1;
    END LOOP;
    RETURN v_count;
END $$;

-- stuck_attempts: running attempts past their lease whose worker is still connected: hung, never
-- handed to a second worker. The operator decides (pglane recover --terminate-stuck).
CREATE OR REPLACE FUNCTION pglane.stuck_attempts(p_lane text DEFAULT NULL)
RETURNS SETOF pglane.running_attempts
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT * FROM pglane.running_attempts ra
     WHERE (p_lane IS NULL OR ra.lane = p_lane) AND ra.alive AND ra.past_lease;
$$;

-- decided_job: the opening of retry() and cancel(), a person's decisions about one job: lock it, and
-- refuse (PGL09) an unknown job or (PGL08) one whose status is not in p_allowed, saying why and what
-- to do instead. Returns the locked job.
CREATE OR REPLACE FUNCTION pglane.decided_job(p_job_id bigint, p_allowed text[], p_refusal text)
RETURNS pglane.jobs
LANGUAGE plpgsql AS $$
DECLARE
    v_job pglane.jobs;
BEGIN
    SELECT * INTO v_job FROM pglane.jobs j WHERE j.id = p_job_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL09', MESSAGE = format('no job %s', p_job_id),
            HINT = 'list jobs with: pglane jobs';
    END IF;
    IF v_job.status <> ALL (p_allowed) THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL08',
            MESSAGE = format('job %s is %s; %s', p_job_id, v_job.status, p_refusal),
            HINT = CASE v_job.status
                       WHEN 'done' THEN 'its result is stored; enqueue a new job with a new key to run it again'
                       WHEN 'running' THEN 'a running call cannot be taken back; wait for it to finish'
                       WHEN 'queued' THEN 'it will run once a worker of its lane is free'
                       ELSE 'it is finished already' END;
    END IF;
    RETURN v_job;
END $$;

-- retry: a person's decision to spend again: a failed or cancelled job goes back to the queue for one
-- more attempt. Refused (PGL08) for any other status, with the reason, (PGL04) while its bounded
-- lane is full, and (PGL13) when it costs more than its lane's whole rate: the job stays as it was.
CREATE OR REPLACE FUNCTION pglane.retry(p_job_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_job  pglane.jobs := pglane.decided_job(p_job_id, '{failed,cancelled}',
                                             'only failed or cancelled jobs can be retried');
    v_lane pglane.lanes;
BEGIN
    SELECT * INTO v_lane FROM pglane.lanes l WHERE l.name = v_job.lane;
    IF v_job.cost > v_lane.rate_limit THEN  -- it could never start (the rate was lowered since)
        RAISE EXCEPTION USING ERRCODE = 'PGL13',
            MESSAGE = format('job %s costs %s, more than lane %s''s whole rate (%s): retried, it could never start; '
                             'it stays %s', p_job_id, v_job.cost, v_job.lane,
                             pglane.rate_text(v_lane.rate_limit, v_lane.rate_period), v_job.status),
            HINT = format('raise the rate first (pglane lane set %s --rate N/PERIOD), or enqueue the work again '
                          'with a lower cost and a new key', v_job.lane);
    END IF;
    IF NOT pglane.queue_admit(v_job.lane) THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL04',
            MESSAGE = format('lane %L is full: job %s stays %s (max_queued is %s)', v_job.lane, p_job_id,
                             v_job.status, (SELECT l.max_queued FROM pglane.lanes l WHERE l.name = v_job.lane)),
            HINT = 'retry it once workers have drained the lane, or raise the lane''s max_queued';
    END IF;
    UPDATE pglane.jobs j SET status = 'queued', failed_or_cancelled = false, run_after = now(), finished_at = NULL
     WHERE j.id = p_job_id;
    PERFORM pglane.notify_lane((SELECT l.id FROM pglane.lanes l WHERE l.name = v_job.lane));
    RETURN true;
END $$;

-- cancel: a queued job becomes cancelled. Refused (PGL08) for any other status, with the reason.
CREATE OR REPLACE FUNCTION pglane.cancel(p_job_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_job pglane.jobs := pglane.decided_job(p_job_id, '{queued}', 'only queued jobs can be cancelled');
BEGIN
    UPDATE pglane.jobs j SET status = 'cancelled', failed_or_cancelled = true, finished_at = now()
     WHERE j.id = p_job_id;
    PERFORM pglane.queue_left(v_job.lane);
    RETURN true;
END $$;
