-- Claim and completion: the only writers of running jobs and their attempts.
--
-- Lock order, everywhere: the job row first (FOR UPDATE), then its attempt. Every change to an
-- attempt happens while its job's row is locked, so a statement that runs after taking that lock
-- reads the attempt's latest committed state (READ COMMITTED takes a new snapshot per statement).

-- claimed: the row a claim hands its worker, declared once for claim(), claim_impl() and
-- complete_and_claim(). `completed` is set by complete_and_claim() only (whether the result it
-- delivered was accepted); a plain claim leaves it NULL. With no eligible job, every other column is NULL
-- but wait_seconds and wait_reason: how long until a strict lane's lease ('lease') or a rate-limited
-- lane's window ('rate') lets this slot start a job. A rate-limited lane's claim that took a job sets
-- them too when this slot's next start must wait.
-- (A type, so alembic owns it: see revision 0007.)

-- claim_impl, complete_impl: the bodies of claim() and complete(), shared with complete_and_claim()
-- so that the worker's fast path switches its search_path once per job, not three times. They run
-- only inside those SECURITY DEFINER functions: EXECUTE on them is granted to nobody. claim_impl
-- returns one row, all NULL when nothing is eligible (cheaper to call than a set-returning function).
-- rate_refusal: a rate-limited claim that found no room: no job, and when this slot's turn comes. The
-- slot waits for the start numbered like itself (seq counts starts), so that the lane's idle workers
-- wake at successive openings, not all at the first.
CREATE OR REPLACE FUNCTION pglane.rate_refusal(r pglane.claimed, p_lane pglane.lanes, p_window bigint,
                                              p_cost integer, p_slot integer, p_last_seq bigint, p_at timestamptz)
RETURNS pglane.claimed LANGUAGE plpgsql AS $$
BEGIN
    r.job_id := NULL;
    r.wait_reason := 'rate';
    r.wait_seconds := greatest(0, extract(epoch FROM pglane.rate_wait(
        p_lane.id, p_lane.rate_limit, p_lane.rate_period, p_window, p_cost,
        (((p_slot - 1 - p_last_seq) % p_lane.slots + p_lane.slots) % p_lane.slots)::integer, p_at)
        - clock_timestamp()));
    RETURN r;
END $$;

CREATE OR REPLACE FUNCTION pglane.claim_impl(p_lane text, p_worker text) RETURNS pglane.claimed
LANGUAGE plpgsql AS $$
DECLARE
    v_lane    pglane.lanes;
    v_slot    integer;
    v_mine    integer;
    v_try     integer;
    v_in_flight bigint;
    v_lease_ends timestamptz;
    v_cost    integer;          -- a rate-limited lane's: the head job's cost
    v_at      timestamptz;      -- a rate-limited lane's: when this start happens (after the counters lock)
    v_window  bigint;           -- a rate-limited lane's: the cost started in the window ending at v_at
    v_last_seq bigint;
    v_expired bigint := 0;      -- a rate-limited lane's: the cost of the expired lane_starts deleted
    v_pending timestamptz[];    -- a rate-limited lane's: the counters row's pending_starts, as locked
    v_cut     timestamptz := '-infinity';  -- pending starts at or before it have left the window (purge)
    v_look    record;           -- the lane, and a rate-limited lane's look (below), read in one statement
    v_started boolean := false; -- a rate-limited lane's start already counted and recorded (the fast path)
    v_mark    bigint;           -- the claiming session's mark (sessions.sql)
    r         pglane.claimed;
BEGIN
    SELECT l AS lane,
           CASE WHEN l.rate_limit IS NOT NULL THEN
               (SELECT c FROM pglane.lane_counters c WHERE c.lane_id = l.id) END AS counters,
           CASE WHEN l.rate_limit IS NOT NULL AND l.weighted THEN
               (SELECT ARRAY[j.id, j.cost] FROM pglane.jobs j
                 WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= l.rate_limit
                 ORDER BY j.created_at, j.id LIMIT 1) END AS head
      INTO v_look FROM pglane.lanes l WHERE l.name = p_lane;
    v_lane := v_look.lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'create it first: pglane lane create NAME';
    END IF;
    -- The slot check, exact and local, without reading pg_locks: the transaction-level try-lock pins
    -- the slot (it succeeds only if the slot is free or ours), the session-level unlock then says
    -- whether we held it at session level, and the re-lock gives it back while the pin keeps every
    -- waiting standby out. A transaction-level or shared lock is not a slot. If the statement is
    -- cancelled between unlock and re-lock, the session has lost its slot and every later claim is
    -- refused: it fails safe. (Nested IFs: SQL does not promise to evaluate AND left to right.)
    -- The slot the session says it holds (setting pglane.slot, which pglane worker sets) is checked
    -- first: the setting only orders the checks, each check is the same exact one. Without it, a free
    -- slot below the session's own is pinned for the rest of the transaction and its unlock logs a
    -- WARNING ("you don't own a lock"): harmless, but noise on every claim of a degraded lane.
    v_mine := substring(current_setting('pglane.slot', true) FROM '^([0-9]{1,9})$')::integer;
    FOR i IN 0 .. v_lane.slots LOOP
        v_try := CASE WHEN i = 0 THEN v_mine WHEN i IS DISTINCT FROM v_mine THEN i END;
        CONTINUE WHEN v_try IS NULL OR v_try > v_lane.slots OR v_try < 1;
        IF pg_try_advisory_xact_lock(v_lane.id, v_try) THEN
            IF pg_advisory_unlock(v_lane.id, v_try) THEN
                PERFORM pg_advisory_lock(v_lane.id, v_try);
                v_slot := v_try;
                EXIT;
            END IF;
        END IF;
    END LOOP;
    IF v_slot IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL06',
            MESSAGE = format('this session holds no slot of lane %L, so it may not claim', p_lane),
            HINT = 'take a slot first with pg_advisory_lock(lane id, slot number), as pglane worker does';
    END IF;

    -- A strict lane (takeover after_lease): the calls possibly in flight (running attempts, and lost
    -- ones whose lease runs on) never exceed its slots. Counted under the counters row lock, which
    -- every claim of the lane takes anyway, so that two slots cannot both count the same room. With
    -- no room, nothing is claimed and wait_seconds says when the first such lease ends.
    IF v_lane.takeover = 'after_lease' THEN
        PERFORM 1 FROM pglane.lane_counters c WHERE c.lane_id = v_lane.id FOR UPDATE;
        SELECT f.in_flight, f.lease_ends INTO v_in_flight, v_lease_ends FROM pglane.in_flight(p_lane) f;
        IF v_in_flight >= v_lane.slots THEN
            r.wait_seconds := greatest(0, extract(epoch FROM v_lease_ends - now()));
            r.wait_reason := 'lease';
            RETURN r;
        END IF;
    END IF;

    IF v_lane.rate_limit IS NULL THEN
        SELECT j.id INTO r.job_id
          FROM pglane.jobs j
         WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now()
         ORDER BY j.created_at, j.id
         LIMIT 1
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN r;
        END IF;
        UPDATE pglane.lane_counters c
           SET last_seq = c.last_seq + 1,
               left_queue = c.left_queue + (v_lane.max_queued IS NOT NULL)::integer
         WHERE c.lane_id = v_lane.id
        RETURNING c.last_seq INTO r.seq;
    ELSE
        -- A rate-limited lane: a start of the head job's cost must fit the window ending now (exact:
        -- under the counters row lock, which every claim of the lane takes, on the database clock read
        -- after it). A job that costs more than the whole rate could never start, however a lane came
        -- to hold it (a rate lowered, then a retry or a re-queue): it is passed over, never the head,
        -- so it cannot wedge the lane, and job_status says what to do with it (views.sql). The look
        -- (the statement that read the lane, above) saw the counters row without the lock: what it
        -- sees can only be less than the committed use (starts it misses only add to it), so a refusal
        -- made from it is right, and writes nothing, not even a row lock.
        -- A start's record is a row of lane_starts, or (the fast path's) an entry of the counters row's
        -- pending_starts, which the next slow claim moves into lane_starts: at most 31 of them, since
        -- every 32nd start takes the slow path.
        --
        -- The fast path: a lane none of whose jobs ever cost more than 1 (lanes.weighted false: every
        -- start costs 1) with room in plenty in the look (room for this start and one more, and no
        -- purge due, below). Its job is locked first, as on an unlimited lane, then the counters row is
        -- locked, checked again on the row as locked (an UPDATE re-reads a row another claim changed
        -- meanwhile) and bumped, and the start recorded in it with its time read once the lock is
        -- ours: one statement. If that check fails, the steps below decide, the job still held.
        IF NOT v_lane.weighted AND (v_look.counters).window_cost + 2 <= v_lane.rate_limit
           AND (v_look.counters).last_seq % 32 <> 31 THEN
            SELECT j.id, j.cost INTO r.job_id, v_cost FROM pglane.jobs j
             WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now()
             ORDER BY j.created_at, j.id LIMIT 1 FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN r;
            END IF;
            UPDATE pglane.lane_counters c
               SET last_seq = c.last_seq + 1,
                   left_queue = c.left_queue + (v_lane.max_queued IS NOT NULL)::integer,
                   window_cost = c.window_cost + 1,
                   pending_starts = c.pending_starts || clock_timestamp()
             WHERE c.lane_id = v_lane.id AND v_cost = 1 AND c.window_cost + 2 <= v_lane.rate_limit
               AND c.last_seq % 32 <> 31
            RETURNING c.last_seq, c.pending_starts[cardinality(c.pending_starts)] INTO r.seq, v_at;
            v_started := FOUND;
        END IF;
        IF NOT v_started THEN
            v_window := (v_look.counters).window_cost;
            v_last_seq := (v_look.counters).last_seq;
            IF r.job_id IS NULL THEN
                -- The look's refusal. The window's expired starts are summed only when the counter
                -- alone leaves no room (window_cost includes them: it can only overstate the use).
                -- With no room, nothing is claimed; wait_seconds says when this slot's turn comes.
                v_cost := CASE WHEN v_lane.weighted THEN v_look.head[2] ELSE 1 END;
                IF v_cost IS NULL THEN  -- nothing eligible
                    RETURN r;
                END IF;
                v_at := clock_timestamp();
                IF v_window + v_cost > v_lane.rate_limit THEN
                    v_window := v_window - coalesce((SELECT sum(s.cost) FROM pglane.lane_starts s
                                                      WHERE s.lane_id = v_lane.id
                                                        AND s.started_at <= v_at - v_lane.rate_period), 0)
                                         - (SELECT count(*) FROM unnest((v_look.counters).pending_starts) p(at)
                                             WHERE p.at <= v_at - v_lane.rate_period);
                    IF v_window + v_cost > v_lane.rate_limit THEN
                        IF NOT v_lane.weighted AND NOT EXISTS (
                                SELECT FROM pglane.jobs j WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now()) THEN
                            RETURN r;  -- nothing eligible: not held back by the rate
                        END IF;
                        RETURN pglane.rate_refusal(r, v_lane, v_window, v_cost, v_slot, v_last_seq, v_at);
                    END IF;
                END IF;
                -- A weighted lane locks the counters row before its job is looked for (the job's
                -- subquery refers to it, so it runs inside the join, once the lock is ours): a job
                -- locked by a claim that is refused after all is never skipped for the one behind
                -- it, so the lane starts in service order. The job looked for first is the head the
                -- look saw, by its key (one index probe, not a second walk of the queue); only when
                -- another claim took it meanwhile is the queue walked. An unweighted lane's job is
                -- locked before the counters row, as on an unlimited lane.
                IF v_lane.weighted THEN
                    SELECT c.last_seq, c.window_cost, c.pending_starts, h.id, h.cost
                      INTO v_last_seq, v_window, v_pending, r.job_id, v_cost
                      FROM (SELECT c.lane_id, c.last_seq, c.window_cost, c.pending_starts FROM pglane.lane_counters c
                             WHERE c.lane_id = v_lane.id FOR UPDATE) c
                      LEFT JOIN LATERAL (SELECT j.id, j.cost FROM pglane.jobs j
                                          WHERE j.id = v_look.head[1] AND j.in_queue AND j.run_after <= now()
                                            AND c.last_seq >= 0
                                            FOR UPDATE SKIP LOCKED) h ON true;
                END IF;
                IF r.job_id IS NULL THEN  -- unweighted, or the head the look saw was taken meanwhile
                    SELECT j.id, j.cost INTO r.job_id, v_cost FROM pglane.jobs j
                     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= v_lane.rate_limit
                     ORDER BY j.created_at, j.id LIMIT 1 FOR UPDATE SKIP LOCKED;
                END IF;
            END IF;
            IF NOT v_lane.weighted THEN
                IF r.job_id IS NULL THEN
                    RETURN r;
                END IF;
                SELECT c.last_seq, c.window_cost, c.pending_starts INTO v_last_seq, v_window, v_pending
                  FROM pglane.lane_counters c WHERE c.lane_id = v_lane.id FOR UPDATE;
            END IF;
            -- Under the lock: the window at v_at. Its expired starts are deleted (and taken off the
            -- counter in the bump below, or right here if the start is refused after all) when the
            -- counter alone would leave no room for this start and one more like it, and at every
            -- 32nd start: one DELETE for many, and the table stays as small as the window plus 32
            -- starts. The expired pending starts (before v_cut) are counted out with them, and left
            -- out when the bump moves the pending ones into lane_starts. Until then the counter
            -- overstates the use, never understates it; whenever the answer depends on it, it is
            -- exact. A start refused here leaves its job untouched, unlocked at commit.
            v_at := clock_timestamp();  -- read once the lock is ours: no start can commit before it now
            IF v_window + 2 * coalesce(v_cost, 0) > v_lane.rate_limit OR v_last_seq % 32 = 31 THEN
                WITH gone AS (DELETE FROM pglane.lane_starts s
                               WHERE s.lane_id = v_lane.id AND s.started_at <= v_at - v_lane.rate_period RETURNING s.cost)
                SELECT coalesce(sum(gone.cost), 0) INTO v_expired FROM gone;
                v_cut := v_at - v_lane.rate_period;
                v_window := v_window - v_expired - (SELECT count(*) FROM unnest(v_pending) p(at) WHERE p.at <= v_cut);
            END IF;
            IF r.job_id IS NULL OR v_window + v_cost > v_lane.rate_limit THEN
                IF v_expired > 0 THEN  -- the deleted starts leave the counter too (the lock is ours anyway)
                    UPDATE pglane.lane_counters c SET window_cost = c.window_cost - v_expired WHERE c.lane_id = v_lane.id;
                END IF;
                IF r.job_id IS NULL THEN
                    RETURN r;
                END IF;
                r.job_id := NULL;
                RETURN pglane.rate_refusal(r, v_lane, v_window, v_cost, v_slot, v_last_seq, v_at);
            END IF;
            -- The start, and the pending ones still in the window, recorded in the statement that
            -- bumps the counters (whose row is ours: the seq is the one after the locked last_seq).
            r.seq := v_last_seq + 1;
            WITH bumped AS (
                UPDATE pglane.lane_counters c
                   SET last_seq = r.seq,
                       left_queue = c.left_queue + (v_lane.max_queued IS NOT NULL)::integer,
                       window_cost = c.window_cost - v_expired + v_cost
                                     - (SELECT count(*) FROM unnest(v_pending) p(at) WHERE p.at <= v_cut),
                       pending_starts = '{}'
                 WHERE c.lane_id = v_lane.id
            )
            INSERT INTO pglane.lane_starts (lane_id, seq, started_at, cost)
            SELECT v_lane.id, v_last_seq - cardinality(v_pending) + p.i, p.at, 1
              FROM unnest(v_pending) WITH ORDINALITY p(at, i) WHERE p.at > v_cut
            UNION ALL
            SELECT v_lane.id, r.seq, v_at, v_cost;
            -- Already told: when this slot's next turn comes, if a start like this one would not fit
            -- before then; the worker then stores this job's outcome without claiming again too soon.
            IF v_window + 2 * v_cost > v_lane.rate_limit THEN
                r.wait_reason := 'rate';
                r.wait_seconds := greatest(0, extract(epoch FROM pglane.rate_wait(
                    v_lane.id, v_lane.rate_limit, v_lane.rate_period, v_window + v_cost, v_cost,
                    (((v_slot - 1 - r.seq) % v_lane.slots + v_lane.slots) % v_lane.slots)::integer, v_at)
                    - clock_timestamp()));
            END IF;
        END IF;
    END IF;

    UPDATE pglane.jobs j
       SET status = 'running', started_at = coalesce(v_at, now()), attempts = j.attempts + 1, seq = r.seq
     WHERE j.id = r.job_id
    RETURNING j.attempts, j.payload, j.idempotency_key INTO r.attempt_number, r.payload, r.idempotency_key;

    r.lease_expires_at := coalesce(v_at, now()) + v_lane.lease_timeout;
    v_mark := pglane.session_mark();  -- the claiming session's identity (sessions.sql)
    INSERT INTO pglane.attempts AS a
           (job_id, attempt_number, worker, backend_pid, backend_start, session_mark, started_at, lease_expires_at,
            seq, token)
    VALUES (r.job_id, r.attempt_number, p_worker, pg_backend_pid(), pglane.mark_time(v_mark), v_mark,
            coalesce(v_at, now()), r.lease_expires_at, r.seq, gen_random_uuid())
    RETURNING a.id, a.token INTO r.attempt_id, r.token;
    r.lane := p_lane;
    RETURN r;
END $$;

-- claim: take the lane's oldest eligible queued job for the calling session, which must hold a slot
-- of the lane (raises PGL06 otherwise). One short transaction: the job becomes running, its attempt
-- row records the session identity (pid and mark, sessions.sql) that recovery later checks, and the lane's
-- gapless seq is bumped under the counters row lock. SKIP LOCKED lets several slots claim at once
-- without waiting on each other's candidate rows. Returns no row when nothing is eligible.
-- The row's `token` is the attempt's secret: complete() and fail() from any other session need it
-- (pglane_worker cannot read attempts.token; only the claimer was told).
CREATE OR REPLACE FUNCTION pglane.claim(p_lane text, p_worker text) RETURNS SETOF pglane.claimed
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT * FROM pglane.claim_impl(p_lane, p_worker) c WHERE c.job_id IS NOT NULL;
$$;

-- claim_or_wait: claim() as pglane worker calls it: always one row, the job, or (none eligible) all
-- NULL but wait_seconds, which a strict lane sets to how long until the lease it waits for ends.
CREATE OR REPLACE FUNCTION pglane.claim_or_wait(p_lane text, p_worker text) RETURNS pglane.claimed
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT pglane.claim_impl(p_lane, p_worker);
$$;


-- may_write: whether the caller may write an outcome of an attempt whose token and claiming session
-- are given: it holds the token, or, giving none, it is the claiming session itself (a consumer that
-- claims and completes on one connection needs no token; a late result after a reconnect does). Not
-- inlined: the guards below test a matching token first, so the worker's completions never call it.
CREATE OR REPLACE FUNCTION pglane.may_write(p_token uuid, p_attempt_token uuid, p_pid integer,
                                            p_backend_start timestamptz, p_session_mark bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN p_token IS NOT NULL THEN p_token = p_attempt_token
                ELSE pglane.is_claiming_session(p_pid, p_backend_start, p_session_mark)
           END;
$$;

-- not_the_claimer: refuse (PGL12) an outcome for attempt p_attempt_id from a caller without its proof.
CREATE OR REPLACE FUNCTION pglane.not_the_claimer(p_attempt_id bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'PGL12',
        MESSAGE = format('attempt %s was claimed by another session: nothing was written', p_attempt_id),
        HINT = 'only the claimer may write an outcome: pass the token that claim() returned to it';
END $$;

-- bounded_error: an error text kept to at most about 64 kB: its head and its tail (where a traceback
-- names the failing line), with how much was cut between them.
CREATE OR REPLACE FUNCTION pglane.bounded_error(p_error text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN length(p_error) <= 65536 THEN p_error
                ELSE left(p_error, 32768) || format(E'\n[... %s characters cut ...]\n', length(p_error) - 65536)
                     || right(p_error, 32768)
           END;
$$;

CREATE OR REPLACE FUNCTION pglane.complete_impl(p_attempt_id bigint, p_result jsonb, p_token uuid)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_job    bigint;
    v_number integer;
    v_late   record;
    v_proof  boolean;
BEGIN
    -- The usual case: the job is running and this is its latest attempt. The UPDATE takes the job's
    -- row lock and, had it to wait, re-checks the guard on the newest row version (the attempt's
    -- job_id and attempt_number never change). A running job's latest attempt is running (every
    -- transition of that attempt moves the job too).
    UPDATE pglane.jobs j SET status = 'done', finished_at = now(), result = p_result
      FROM pglane.attempts a
     WHERE a.id = p_attempt_id AND j.id = a.job_id AND j.status = 'running' AND j.attempts = a.attempt_number
       AND (a.token = p_token OR pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start, a.session_mark));
    IF FOUND THEN
        UPDATE pglane.attempts a SET status = 'done', finished_at = now()
         WHERE a.id = p_attempt_id AND a.status = 'running';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pglane invariant broken: a running job''s latest attempt % is finished', p_attempt_id;
        END IF;
        RETURN true;
    END IF;

    SELECT a.job_id, a.attempt_number, pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start, a.session_mark)
      INTO v_job, v_number, v_proof FROM pglane.attempts a WHERE a.id = p_attempt_id;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT v_proof THEN
        PERFORM pglane.not_the_claimer(p_attempt_id);
    END IF;
    -- A late result: accepted from an attempt that recovery marked lost, while it is still the job's
    -- latest and the job is failed or back in the queue (the paid output is kept).
    SELECT j.status, j.lane INTO v_late FROM pglane.jobs j
     WHERE j.id = v_job AND j.attempts = v_number AND j.status IN ('failed', 'queued')
       FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE pglane.attempts a
       SET status = 'done', finished_at = now(),
           error = 'late result accepted after recovery had marked this attempt lost: ' || a.error
     WHERE a.id = p_attempt_id AND a.status = 'lost';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE pglane.jobs j SET status = 'done', failed_or_cancelled = false, finished_at = now(), result = p_result
     WHERE j.id = v_job;
    IF v_late.status = 'queued' THEN
        PERFORM pglane.queue_left(v_late.lane);
    END IF;
    RETURN true;
END $$;

-- complete: store the result of attempt p_attempt_id; true if it was accepted.
-- Guard: the caller holds the attempt's token (or is the claiming session; PGL12 otherwise, nothing
-- written); the attempt must be its job's latest, and either still running on a running job, or marked
-- lost by recovery with the job failed or back in the queue and no newer attempt (a late result:
-- the paid output is kept). Anything else (a newer attempt exists, the job was cancelled, the
-- attempt already finished) returns false and changes nothing.
CREATE OR REPLACE FUNCTION pglane.complete(p_attempt_id bigint, p_result jsonb DEFAULT NULL,
                                           p_token uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE sql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT pglane.complete_impl(p_attempt_id, p_result, p_token);
$$;

-- fail: record that attempt p_attempt_id failed (or timed out); true if it was accepted.
-- Same guard as complete for a running attempt. The job goes back to the queue after the lane's
-- retry_backoff (doubling per attempt, capped at one hour) while attempts remain, else it is failed;
-- it is failed too when its bounded lane is full, with the reason and the command to run it later.
-- A failure always says why: given no reason (NULL or blank), it records that none was given; a
-- reason longer than 64 kB keeps its head and tail (bounded_error).
CREATE OR REPLACE FUNCTION pglane.fail(p_attempt_id bigint, p_error text, p_timed_out boolean DEFAULT false,
                                       p_token uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_job pglane.jobs;
BEGIN
    p_error := pglane.bounded_error(coalesce(nullif(btrim(p_error, E' \t\r\n'), ''),
                        'failed without a reason: the consumer called pglane.fail() with an empty error'));
    IF NOT EXISTS (SELECT 1 FROM pglane.attempts a WHERE a.id = p_attempt_id
                      AND (a.token = p_token OR pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start, a.session_mark))) THEN
        IF EXISTS (SELECT 1 FROM pglane.attempts a WHERE a.id = p_attempt_id) THEN
            PERFORM pglane.not_the_claimer(p_attempt_id);
        END IF;
        RETURN false;
    END IF;
    SELECT j.* INTO v_job FROM pglane.jobs j
     WHERE j.id = (SELECT a.job_id FROM pglane.attempts a WHERE a.id = p_attempt_id)
       FOR UPDATE;
    IF NOT FOUND OR v_job.status <> 'running' THEN
        RETURN false;
    END IF;

    UPDATE pglane.attempts a
       SET status = CASE WHEN p_timed_out THEN 'timed_out' ELSE 'failed' END,
           finished_at = now(), error = p_error
     WHERE a.id = p_attempt_id AND a.attempt_number = v_job.attempts AND a.status = 'running';
    IF NOT FOUND THEN
        RETURN false;
    END IF;

    PERFORM pglane.requeue_or_fail(v_job.id, v_job.lane, v_job.attempts, p_error, '', '',
                                   least(l.retry_backoff * 2 ^ (v_job.attempts - 1), interval '1 hour'))
       FROM pglane.lanes l WHERE l.name = v_job.lane;
    RETURN true;
END $$;

-- complete_and_claim: the worker's fast path: complete attempt p_attempt_id and claim the lane's next
-- job in one round trip and one commit. Same guards as complete() and claim(); `completed` says
-- whether the result was accepted, the other columns are the next job (NULL when none is eligible).
CREATE OR REPLACE FUNCTION pglane.complete_and_claim(p_attempt_id bigint, p_result jsonb, p_lane text, p_worker text,
                                                     p_token uuid DEFAULT NULL)
RETURNS pglane.claimed
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_completed boolean;
    r           pglane.claimed;
BEGIN
    v_completed := pglane.complete_impl(p_attempt_id, p_result, p_token);  -- first: the claim may take its slot's next job
    r := pglane.claim_impl(p_lane, p_worker);
    r.completed := v_completed;
    RETURN r;
END $$;
