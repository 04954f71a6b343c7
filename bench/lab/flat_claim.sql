-- bench/lab/flat_claim.py's variant of pglane.complete_and_claim (sql/claim.sql at revision 0018): the
-- plain lane's completion and claim flattened into this one plpgsql function, with the fast paths of
-- complete_impl (a matching token), claim_slot (the slot the session says it holds), pick, take and
-- session_mark (the mark the session says it holds) written out in it instead of called. Any other
-- lane, and any slower path (no token or a wrong one, a slot or mark the session does not hold), calls
-- the layered functions after its own try, which reads again (and may log a second "you don't own a
-- lock" WARNING). The same rows written and answers as head; on the fast path the same locks too: a
-- measurement of what the layering costs, never installed by a migration.
CREATE OR REPLACE FUNCTION pglane.complete_and_claim(p_attempt_id bigint, p_result jsonb, p_lane text, p_worker text,
                                                     p_token uuid DEFAULT NULL)
RETURNS pglane.claimed
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_completed boolean := false;
    v_done_lane text;
    v_breaker boolean;
    v_lane  pglane.lanes;
    v_said  text;
    v_mine  integer;
    v_slot  integer;
    v_job   pglane.picked;
    v_mark  bigint;
    v_at    timestamptz := now();
    r       pglane.claimed;
BEGIN
    UPDATE pglane.jobs j SET status = 'done', finished_at = now(), result = p_result
      FROM pglane.attempts a, pglane.lanes l
     WHERE a.id = p_attempt_id AND j.id = a.job_id AND j.status = 'running' AND j.attempts = a.attempt_number
       AND a.token = p_token AND l.name = j.lane
    RETURNING j.lane, l.pause_after_failures IS NOT NULL INTO v_done_lane, v_breaker;
    IF FOUND THEN
        UPDATE pglane.attempts a SET status = 'done', finished_at = now()
         WHERE a.id = p_attempt_id AND a.status = 'running';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pglane invariant broken: a running job''s latest attempt % is finished', p_attempt_id;
        END IF;
        IF v_breaker THEN
            PERFORM pglane.breaker_success(v_done_lane);
        END IF;
        v_completed := true;
    ELSE
        v_completed := pglane.complete_impl(p_attempt_id, p_result, p_token);
    END IF;
    SELECT * INTO v_lane FROM pglane.lanes l WHERE l.name = p_lane;
    IF NOT FOUND OR v_lane.takeover <> 'immediate' OR v_lane.rate_limit IS NOT NULL OR v_lane.group_slots IS NOT NULL THEN
        r := pglane.claim_impl(p_lane, p_worker);
        r.completed := v_completed;
        RETURN r;
    END IF;
    v_said := current_setting('pglane.slot', true);
    IF length(v_said) BETWEEN 1 AND 9 AND ltrim(v_said, '0123456789') = '' THEN
        v_mine := v_said::integer;
    END IF;
    IF v_mine BETWEEN 1 AND v_lane.slots THEN
        IF pg_try_advisory_xact_lock(v_lane.id, v_mine) THEN
            IF pg_advisory_unlock(v_lane.id, v_mine) THEN
                PERFORM pg_advisory_lock(v_lane.id, v_mine);
                v_slot := v_mine;
            END IF;
        END IF;
    END IF;
    IF v_slot IS NULL THEN
        v_slot := pglane.claim_slot(v_lane);
    END IF;
    SELECT j.id, j.cost, j.fair_rank, j.group_key INTO v_job FROM pglane.jobs j
     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now()
     ORDER BY j.priority DESC, j.fair_rank, j.created_at, j.id LIMIT 1
       FOR UPDATE SKIP LOCKED;
    IF v_job.id IS NULL THEN
        r.completed := v_completed;
        RETURN r;
    END IF;
    v_said := current_setting('pglane.session_mark', true);
    IF length(v_said) BETWEEN 1 AND 18 AND ltrim(v_said, '0123456789') = '' THEN
        v_mark := v_said::bigint;
        IF pg_try_advisory_xact_lock(v_mark) THEN
            IF pg_advisory_unlock(v_mark) THEN
                PERFORM pg_advisory_lock(v_mark);
            ELSE
                v_mark := NULL;
            END IF;
        ELSE
            v_mark := NULL;
        END IF;
    END IF;
    IF v_mark IS NULL THEN
        v_mark := pglane.session_mark();
    END IF;
    UPDATE pglane.lane_counters c
       SET last_seq = c.last_seq + 1,
           left_queue = c.left_queue + (v_lane.max_queued IS NOT NULL)::integer,
           window_cost = c.window_cost + 0,
           pending_starts = '{}',
           served_rank = greatest(c.served_rank, v_job.fair_rank)
     WHERE c.lane_id = v_lane.id AND NOT coalesce(c.paused_until > v_at, false)
    RETURNING c.last_seq INTO r.seq;
    IF NOT FOUND THEN
        SELECT w.wait_seconds, w.wait_reason INTO r.wait_seconds, r.wait_reason FROM pglane.pause_wait(v_lane.id) w;
        r.completed := v_completed;
        RETURN r;
    END IF;
    UPDATE pglane.jobs j
       SET status = 'running', started_at = v_at, attempts = j.attempts + 1, seq = r.seq
     WHERE j.id = v_job.id
    RETURNING j.id, j.attempts, j.payload, j.idempotency_key,
              CASE WHEN j.job_timeout IS NOT NULL THEN date_part('epoch', least(j.job_timeout, v_lane.job_timeout)) END,
              j.traceparent, j.created_at
         INTO r.job_id, r.attempt_number, r.payload, r.idempotency_key, r.job_timeout, r.traceparent, r.queued_at;
    r.lease_expires_at := v_at + v_lane.lease_timeout;
    INSERT INTO pglane.attempts AS a
           (job_id, attempt_number, worker, backend_pid, backend_start, session_mark, started_at, lease_expires_at,
            seq, token)
    VALUES (r.job_id, r.attempt_number, p_worker, pg_backend_pid(), pglane.mark_time(v_mark), v_mark,
            v_at, r.lease_expires_at, r.seq, gen_random_uuid())
    RETURNING a.id, a.token INTO r.attempt_id, r.token;
    IF v_job.group_key IS NOT NULL THEN
        PERFORM pglane.served(v_lane.id, v_job.group_key, v_at);
    END IF;
    r.lane := v_lane.name;
    r.completed := v_completed;
    RETURN r;
END $$;
