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
-- only inside those SECURITY DEFINER functions: EXECUTE on them is granted to nobody (nor on the
-- claim's steps below). claim_impl returns one row, all NULL when nothing is eligible (cheaper to call
-- than a set-returning function).
--
-- The claim is four steps, each a function below, called by claim_impl in this order:
--   1. claim_slot: the calling session holds a slot of the lane (PGL06 otherwise);
--   2. admission: each policy the lane uses says yes, or no with when to ask again and why:
--      lease_admission (a strict lane's room for one more call in flight) and rate_admission
--      (lanes.sql: its rate limit). A lane calls only the policies it uses;
--   3. pick: the one query that chooses the job;
--   4. take: the job running, its attempt, the lane's gapless seq.
-- A rate-limited lane's start is recorded between 3 and 4 (rate_start, lanes.sql): the exact check.

-- claim_slot: the slot of lane p_lane that the calling session holds; PGL06 if it holds none.
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
CREATE OR REPLACE FUNCTION pglane.claim_slot(p_lane pglane.lanes) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_said text := current_setting('pglane.slot', true);
    v_mine integer;  -- the setting, if it is 1 to 9 ASCII digits (a caller's setting: untrusted)
    v_try  integer;
BEGIN
    -- Digits checked without a regular expression (one cost some 100,000 instructions per claim).
    IF length(v_said) BETWEEN 1 AND 9 AND ltrim(v_said, '0123456789') = '' THEN
        v_mine := v_said::integer;
    END IF;
    FOR i IN 0 .. p_lane.slots LOOP
        v_try := CASE WHEN i = 0 THEN v_mine WHEN i IS DISTINCT FROM v_mine THEN i END;
        CONTINUE WHEN v_try IS NULL OR v_try > p_lane.slots OR v_try < 1;
        IF pg_try_advisory_xact_lock(p_lane.id, v_try) THEN
            IF pg_advisory_unlock(p_lane.id, v_try) THEN
                PERFORM pg_advisory_lock(p_lane.id, v_try);
                RETURN v_try;
            END IF;
        END IF;
    END LOOP;
    RAISE EXCEPTION USING ERRCODE = 'PGL06',
        MESSAGE = format('this session holds no slot of lane %L, so it may not claim', p_lane.name),
        HINT = 'take a slot first with pg_advisory_lock(lane id, slot number), as pglane worker does';
END $$;

-- lease_admission: a strict lane (takeover after_lease): the calls possibly in flight (running
-- attempts, and lost ones whose lease runs on) never exceed its slots. Counted under the counters row
-- lock, which every claim of the lane takes anyway, so that two slots cannot both count the same room.
-- With no room, nothing is claimed and wait_seconds says when the first such lease ends.
CREATE OR REPLACE FUNCTION pglane.lease_admission(p_lane pglane.lanes,
    OUT admit boolean, OUT wait_seconds double precision, OUT wait_reason text)
LANGUAGE plpgsql AS $$
DECLARE
    v_in_flight  bigint;
    v_lease_ends timestamptz;
BEGIN
    PERFORM 1 FROM pglane.lane_counters c WHERE c.lane_id = p_lane.id FOR UPDATE;
    SELECT f.in_flight, f.lease_ends INTO v_in_flight, v_lease_ends FROM pglane.in_flight(p_lane.name) f;
    admit := v_in_flight < p_lane.slots;
    IF NOT admit THEN
        wait_seconds := greatest(0, extract(epoch FROM v_lease_ends - now()));
        wait_reason := 'lease';
    END IF;
END $$;

-- queue_head and pick: the head of lane p_lane's queue, the job its next claim starts: the oldest
-- (created_at, then id: service order) queued job whose run_after has come, passing over any job
-- that costs more than p_max_cost (a rate-limited lane's whole rate: such a job could never start,
-- however the lane came to hold it (a rate lowered, then a retry or a re-queue), so it is never the
-- head and cannot wedge the lane; job_status says what to do with it, views.sql). queue_head reads it
-- without a lock (a rate-limited lane's admission: what the head costs, whether there is one); pick
-- takes it. The two are the same query, but for pick's lock: change them together.
CREATE OR REPLACE FUNCTION pglane.queue_head(p_lane text, p_max_cost integer) RETURNS TABLE (id bigint, cost integer)
LANGUAGE sql STABLE AS $$
    SELECT j.id, j.cost FROM pglane.jobs j
     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= p_max_cost
     ORDER BY j.created_at, j.id LIMIT 1;
$$;

-- pick: SKIP LOCKED lets the lane's slots claim at once without waiting on each other's candidate
-- rows: each takes the first job nobody holds. Returns NULLs when no job is eligible (a lock is taken
-- only on a job found: an empty claim writes nothing).
CREATE OR REPLACE FUNCTION pglane.pick(p_lane text, p_max_cost integer, OUT id bigint, OUT cost integer)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT j.id, j.cost INTO id, cost FROM pglane.jobs j
     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= p_max_cost
     ORDER BY j.created_at, j.id LIMIT 1
       FOR UPDATE SKIP LOCKED;
END $$;

-- take: job p_job_id (picked, its row locked) starts at p_at for worker p_worker: the lane's seq is
-- bumped under the counters row lock (gapless: a claim that takes no job bumps nothing; a
-- rate-limited lane's start already recorded this seq, the lock held since, and hands in its window's
-- change and the row's pending starts, rate_start; any other lane hands in 0 and none), the job
-- becomes running and its attempt row records the claiming session's identity (pid and mark,
-- sessions.sql), which recovery later checks. Lock order: the job, then the counters row, then the
-- attempt.
CREATE OR REPLACE FUNCTION pglane.take(p_lane pglane.lanes, p_job_id bigint, p_worker text, p_at timestamptz,
                                       p_window_change bigint, p_pending_starts timestamptz[]) RETURNS pglane.claimed
LANGUAGE plpgsql AS $$
DECLARE
    v_mark bigint;  -- the claiming session's mark (sessions.sql)
    r      pglane.claimed;
BEGIN
    UPDATE pglane.lane_counters c
       SET last_seq = c.last_seq + 1,
           left_queue = c.left_queue + (p_lane.max_queued IS NOT NULL)::integer,
           window_cost = c.window_cost + p_window_change,
           pending_starts = p_pending_starts
     WHERE c.lane_id = p_lane.id
    RETURNING c.last_seq INTO r.seq;
    UPDATE pglane.jobs j
       SET status = 'running', started_at = p_at, attempts = j.attempts + 1, seq = r.seq
     WHERE j.id = p_job_id
    RETURNING j.id, j.attempts, j.payload, j.idempotency_key INTO r.job_id, r.attempt_number, r.payload, r.idempotency_key;
    r.lease_expires_at := p_at + p_lane.lease_timeout;
    v_mark := pglane.session_mark();  -- the claiming session's identity (sessions.sql)
    INSERT INTO pglane.attempts AS a
           (job_id, attempt_number, worker, backend_pid, backend_start, session_mark, started_at, lease_expires_at,
            seq, token)
    VALUES (r.job_id, r.attempt_number, p_worker, pg_backend_pid(), pglane.mark_time(v_mark), v_mark,
            p_at, r.lease_expires_at, r.seq, gen_random_uuid())
    RETURNING a.id, a.token INTO r.attempt_id, r.token;
    r.lane := p_lane.name;
    RETURN r;
END $$;

-- claim_impl: the four steps. A policy's no ends the claim with its answer: no job, and when this slot
-- may ask again (wait_seconds) and why (wait_reason); with nothing eligible, no answer at all.
CREATE OR REPLACE FUNCTION pglane.claim_impl(p_lane text, p_worker text) RETURNS pglane.claimed
LANGUAGE plpgsql AS $$
DECLARE
    v_look  record;        -- the lane, and a rate-limited lane's counters row as last committed (no lock)
    v_lane  pglane.lanes;
    v_slot  integer;
    v_say   record;        -- a policy's answer: admit, wait_seconds, wait_reason
    v_job   record;        -- the job picked: id, cost
    v_start record;        -- a rate-limited lane's start (rate_start): admit, at, window_change, pending_...
    r       pglane.claimed;
BEGIN
    SELECT l AS lane, CASE WHEN l.rate_limit IS NOT NULL THEN
               (SELECT c FROM pglane.lane_counters c WHERE c.lane_id = l.id) END AS counters
      INTO v_look FROM pglane.lanes l WHERE l.name = p_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'create it first: pglane lane create NAME';
    END IF;
    v_lane := v_look.lane;
    v_slot := pglane.claim_slot(v_lane);                                             -- 1. the slot
    IF v_lane.takeover = 'after_lease' THEN                                           -- 2. admission
        v_say := pglane.lease_admission(v_lane);
        IF NOT v_say.admit THEN
            r.wait_seconds := v_say.wait_seconds;
            r.wait_reason := v_say.wait_reason;
            RETURN r;
        END IF;
    END IF;
    IF v_lane.rate_limit IS NOT NULL THEN
        -- The rate policy is asked unless its answer is yes at first sight: every start costs 1 (not
        -- weighted) and the counter as the look saw it has room for one (rate_admission's first test;
        -- rate_start checks again under the lock). Asking costs some 29,000 server instructions per
        -- claim, a fifth of what the limit costs (bench/README.md, bench.rates).
        IF v_lane.weighted OR (v_look.counters).window_cost >= v_lane.rate_limit THEN
            v_say := pglane.rate_admission(v_lane, (v_look.counters).window_cost, (v_look.counters).last_seq, v_slot);
            IF NOT v_say.admit THEN
                r.wait_seconds := v_say.wait_seconds;
                r.wait_reason := v_say.wait_reason;
                RETURN r;
            END IF;
        END IF;
        -- A weighted lane locks the counters row before its job is picked: a job held by a claim that
        -- is refused after all (rate_start) is never skipped for the one behind it, so the lane starts
        -- in service order. Any other lane's job is locked first, then the counters row.
        IF v_lane.weighted THEN
            PERFORM 1 FROM pglane.lane_counters c WHERE c.lane_id = v_lane.id FOR UPDATE;
        END IF;
    END IF;
    v_job := pglane.pick(p_lane, coalesce(v_lane.rate_limit, 2147483647));          -- 3. pick
    IF v_job.id IS NULL THEN
        RETURN r;
    END IF;
    IF v_lane.rate_limit IS NULL THEN                                                 -- 4. take
        RETURN pglane.take(v_lane, v_job.id, p_worker, now(), 0, '{}');
    END IF;
    v_start := pglane.rate_start(v_lane, v_job.cost, v_slot);
    IF NOT v_start.admit THEN  -- refused after all, under the lock: the job stays queued, unlocked at commit
        r.wait_seconds := v_start.wait_seconds;
        r.wait_reason := v_start.wait_reason;
        RETURN r;
    END IF;
    r := pglane.take(v_lane, v_job.id, p_worker, v_start.at, v_start.window_change, v_start.pending_starts);
    r.wait_seconds := v_start.wait_seconds;  -- already told when this slot's next turn comes (rate_start)
    r.wait_reason := v_start.wait_reason;
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
