-- The claim: the one writer that makes a queued job running and gives its attempt to a worker.
--
-- claimed: the row a claim hands its worker, declared once for claim(), claim_impl() and
-- complete_and_claim(). `completed` is set by complete_and_claim() only (whether the result it
-- delivered was accepted); a plain claim leaves it NULL. With no eligible job, every other column is NULL
-- but wait_seconds and wait_reason: how long until a strict lane's lease ('lease'), a rate-limited
-- lane's window ('rate') or a pause's end ('paused', pause.sql; wait_seconds NULL: until resumed) lets
-- this slot start a job. job_timeout: the job's own call timeout in seconds, never above the lane's
-- (NULL: the job has none, the lane's applies). A rate-limited lane's claim that took a job sets
-- them too when this slot's next start must wait. traceparent and queued_at: the producer's trace
-- context and when the job was enqueued, for the worker's spans (the wait in the lane, the call).
-- (A type, so alembic owns it: see revision 0007.)

-- claim_impl: the body of claim(), claim_or_wait() and complete_and_claim(), so that the worker's
-- fast path switches its search_path once per job, not three times (complete_impl, jobs.sql, is
-- complete()'s). It runs only inside those SECURITY DEFINER functions: EXECUTE on it is granted to
-- nobody (nor on the claim's steps). claim_impl returns one row, all NULL when nothing is eligible
-- (cheaper to call than a set-returning function).
--
-- The claim is four steps, each a function, called by claim_impl in this order:
--   1. claim_slot (slots.sql): the calling session holds a slot of the lane (PGL06 otherwise);
--   2. admission: each policy the lane uses says yes, or no with when to ask again and why:
--      lease_admission (strict.sql: a strict lane's room for one more call in flight) and
--      rate_admission (rate.sql: its rate limit); a lane with group_slots also learns which groups
--      are full (full_groups, groups.sql), for the pick to pass over. A lane calls only the policies
--      it uses;
--   3. pick (below): the one query that chooses the job, in service order;
--   4. take (below): the job running, its attempt, the lane's gapless seq.
-- A rate-limited lane's start is recorded between 3 and 4 (rate_start, rate.sql): the exact check.

-- queue_head and pick: the head of lane p_lane's queue, the job its next claim starts: the first in
-- service order (priority, higher first; then fair_rank, the round of its group, groups.sql; then
-- created_at and id: the queue index jobs_queue) of the queued jobs whose run_after has come, passing
-- over any job that costs more than p_max_cost (a rate-limited lane's whole rate: such a job could
-- never start, however the lane came to hold it (a rate lowered, then a retry or a re-queue), so it is
-- never the head and cannot wedge the lane; job_status says what to do with it, views.sql), and pick
-- over the jobs of the groups p_full (p_shared_full: the jobs with no group) that are at their limit.
-- queue_head reads it without a lock (a rate-limited lane's admission: what the head costs, whether
-- there is one; a first look, which does not know the full groups: rate_start checks the job pick
-- takes); pick takes it. The two are the same query, but for pick's lock and groups: change them together.
CREATE OR REPLACE FUNCTION pglane.queue_head(p_lane text, p_max_cost integer) RETURNS TABLE (id bigint, cost integer)
LANGUAGE sql STABLE AS $$
    SELECT j.id, j.cost FROM pglane.jobs j
     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= p_max_cost
     ORDER BY j.priority DESC, j.fair_rank, j.created_at, j.id LIMIT 1;
$$;

-- pick: SKIP LOCKED lets the lane's slots claim at once without waiting on each other's candidate
-- rows: each takes the first job nobody holds. Returns NULLs when no job is eligible (a lock is taken
-- only on a job found: an empty claim writes nothing). A full group's jobs are walked over, not
-- taken: at most the lane's slots' worth of groups are full at once (one running job each, at least).
CREATE OR REPLACE FUNCTION pglane.pick(p_lane text, p_max_cost integer, p_full text[], p_shared_full boolean)
RETURNS pglane.picked
LANGUAGE plpgsql AS $$
DECLARE
    r pglane.picked;
BEGIN
    SELECT j.id, j.cost, j.fair_rank, j.group_key INTO r FROM pglane.jobs j
     WHERE j.lane = p_lane AND j.in_queue AND j.run_after <= now() AND j.cost <= p_max_cost
       AND NOT coalesce(j.group_key = ANY (p_full), p_shared_full)
     ORDER BY j.priority DESC, j.fair_rank, j.created_at, j.id LIMIT 1
       FOR UPDATE SKIP LOCKED;
    RETURN r;
END $$;

-- take: job p_job (picked, its row locked) starts at p_at for worker p_worker: the lane's seq is
-- bumped under the counters row lock (gapless: a claim that takes no job bumps nothing; a
-- rate-limited lane's start already recorded this seq, the lock held since, and hands in its window's
-- change and the row's pending starts, rate_start; any other lane hands in 0 and none), and with it
-- the lane's round (groups.sql); the job becomes running and its attempt row records the claiming
-- session's identity (pid and mark, sessions.sql), which recovery later checks. Lock order: the job,
-- then the counters row, then the attempt. The hold: every other slot of the lane waits for the
-- counters row from the bump until this claim's commit is flushed, so on a plain lane only what
-- carries the seq (the job's UPDATE, the attempt's INSERT) and a grouped job's round (served) follow
-- the bump; the session's mark, which a first claim takes and later claims check with three lock
-- calls, is read before it (a lock private to this session: no other session ever waits for it). A
-- strict, grouped (group_slots), weighted or rate-limited lane locks the counters row earlier, in its
-- admission (strict.sql, groups.sql, rate.sql), and holds it from there.
-- On a paused lane (pause.sql) the seq is not bumped and nothing is written: the claim answers with
-- the pause's end (the check is in the counters UPDATE's WHERE, so a claim that waited for a pause's
-- commit re-reads it). A job's own job_timeout is handed to the worker, never above the lane's.
CREATE OR REPLACE FUNCTION pglane.take(p_lane pglane.lanes, p_job pglane.picked, p_worker text, p_at timestamptz,
                                       p_window_change bigint, p_pending_starts timestamptz[]) RETURNS pglane.claimed
LANGUAGE plpgsql AS $$
DECLARE
    v_mark bigint;  -- the claiming session's mark (sessions.sql)
    r      pglane.claimed;
BEGIN
    v_mark := pglane.session_mark();  -- the claiming session's identity (sessions.sql), before the hold
    UPDATE pglane.lane_counters c
       SET last_seq = c.last_seq + 1,
           left_queue = c.left_queue + (p_lane.max_queued IS NOT NULL)::integer,
           window_cost = c.window_cost + p_window_change,
           pending_starts = p_pending_starts,
           served_rank = greatest(c.served_rank, p_job.fair_rank)
     WHERE c.lane_id = p_lane.id AND NOT coalesce(c.paused_until > p_at, false)
    RETURNING c.last_seq INTO r.seq;
    IF NOT FOUND THEN  -- the lane is paused (pause.sql): nothing written; the job stays queued, unlocked at commit
        SELECT w.wait_seconds, w.wait_reason INTO r.wait_seconds, r.wait_reason FROM pglane.pause_wait(p_lane.id) w;
        RETURN r;
    END IF;
    UPDATE pglane.jobs j
       SET status = 'running', started_at = p_at, attempts = j.attempts + 1, seq = r.seq
     WHERE j.id = p_job.id
    RETURNING j.id, j.attempts, j.payload, j.idempotency_key,
              CASE WHEN j.job_timeout IS NOT NULL THEN date_part('epoch', least(j.job_timeout, p_lane.job_timeout)) END,
              j.traceparent, j.created_at
         INTO r.job_id, r.attempt_number, r.payload, r.idempotency_key, r.job_timeout, r.traceparent, r.queued_at;
    r.lease_expires_at := p_at + p_lane.lease_timeout;
    INSERT INTO pglane.attempts AS a
           (job_id, attempt_number, worker, backend_pid, backend_start, session_mark, started_at, lease_expires_at,
            seq, token)
    VALUES (r.job_id, r.attempt_number, p_worker, pg_backend_pid(), pglane.mark_time(v_mark), v_mark,
            p_at, r.lease_expires_at, r.seq, gen_random_uuid())
    RETURNING a.id, a.token INTO r.attempt_id, r.token;
    IF p_job.group_key IS NOT NULL THEN
        PERFORM pglane.served(p_lane.id, p_job.group_key, p_at);  -- for group_status (groups.sql)
    END IF;
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
    v_full  text[] := '{}';        -- a lane with group_slots: its full groups (full_groups), passed over,
    v_shared boolean := false;     -- and whether the jobs with no group are full
    v_job   pglane.picked; -- the job picked
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
    IF v_lane.group_slots IS NOT NULL THEN
        SELECT f.groups, f.shared INTO v_full, v_shared FROM pglane.full_groups(v_lane) f;
    END IF;
    v_job := pglane.pick(p_lane, coalesce(v_lane.rate_limit, 2147483647), v_full, v_shared);  -- 3. pick
    IF v_job.id IS NULL THEN
        RETURN r;
    END IF;
    IF v_lane.rate_limit IS NULL THEN                                                 -- 4. take
        RETURN pglane.take(v_lane, v_job, p_worker, now(), 0, '{}');
    END IF;
    v_start := pglane.rate_start(v_lane, v_job.cost, v_slot);
    IF NOT v_start.admit THEN  -- refused after all, under the lock: the job stays queued, unlocked at commit
        r.wait_seconds := v_start.wait_seconds;
        r.wait_reason := v_start.wait_reason;
        RETURN r;
    END IF;
    r := pglane.take(v_lane, v_job, p_worker, v_start.at, v_start.window_change, v_start.pending_starts);
    IF r.job_id IS NULL THEN  -- paused: take's answer (rate_start checked the pause already, under the lock)
        RETURN r;
    END IF;
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
