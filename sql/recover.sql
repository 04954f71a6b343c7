-- Recovery: evidence-based recovery of attempts whose worker is gone, and the stuck report. The
-- evidence is the claiming session's (sessions.sql: its mark and its slot); where a recovered job
-- goes is requeue_or_fail's (jobs.sql).

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
