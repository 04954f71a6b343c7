-- Jobs: the life of a job, from the one path into the queue to its outcome and a person's decisions
-- about it (docs/design.md: the states of a job and an attempt). The claim, which makes a job running,
-- is claim.sql; the recovery of an attempt whose worker is gone, recover.sql; a job's end in the
-- history, history.sql.
--
-- Lock order, everywhere: the job row first (FOR UPDATE), then its attempt. Every change to an
-- attempt happens while its job's row is locked, so a statement that runs after taking that lock
-- reads the attempt's latest committed state (READ COMMITTED takes a new snapshot per statement).

-- Whose job it is: the role that enqueued it (jobs.enqueued_by). Producers see only their own jobs.

-- caller: the role the calling session acts as (its SET ROLE, else its login), also from inside a
-- SECURITY DEFINER function, where current_user is pglane's owner. A producer's jobs are the ones
-- enqueued while acting as it.
CREATE OR REPLACE FUNCTION pglane.caller() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN current_setting('role') = 'none' THEN session_user::text ELSE current_setting('role') END;
$$;

-- sees_every_job: whether role p_role may see every job and the key of any: pglane's operators and
-- workers, and the owner of pglane's tables. Producers see only the jobs they enqueued (caller()).
CREATE OR REPLACE FUNCTION pglane.sees_every_job(p_role name) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pg_has_role(p_role, 'pglane_operator', 'USAGE') OR pg_has_role(p_role, 'pglane_worker', 'USAGE')
        OR pg_has_role(p_role, (SELECT c.relowner FROM pg_class c WHERE c.oid = 'pglane.jobs'::regclass), 'USAGE');
$$;

-- Enqueue: the one path into the queue, whether a job comes from pglane.enqueue() or from a plain
-- INSERT INTO pglane.jobs in any language. Both go through the same two triggers: jobs_before_insert
-- (below) and jobs_after_insert (queue_bound.sql: a bounded lane's check, and the lane's wake-up).

-- check_payload: what a job's payload must be (jobs_before_insert): a JSON object or array, within its
-- lane's max_payload_bytes, and decodable by every consumer; raises what is wrong and what to do.
CREATE OR REPLACE FUNCTION pglane.check_payload(p_payload jsonb, p_max_bytes integer, p_lane text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_size integer;
BEGIN
    IF p_payload IS NULL OR jsonb_typeof(p_payload) NOT IN ('object', 'array') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = format('payload must be a JSON object or array, not %s',
                             coalesce(jsonb_typeof(p_payload), 'NULL')),
            HINT = 'wrap the value, e.g. {"value": ...}';
    END IF;
    -- The size in jsonb's binary form, before the compression that storing may add.
    v_size := pg_column_size(p_payload);
    IF v_size > p_max_bytes THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL03',
            MESSAGE = format('payload of %s bytes (in jsonb form, uncompressed) exceeds the %s-byte limit of lane %L',
                             v_size, p_max_bytes, p_lane),
            HINT = 'store large inputs elsewhere and enqueue a reference to them';
    END IF;
    -- What every consumer can decode: no value nested deeper than 64 levels, no number of 1000 or
    -- more digits before the point (JSON decoders, Python's among them, refuse or overflow on them).
    IF jsonb_path_exists(p_payload, 'strict $.**{65}') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = 'payload is nested more than 64 levels deep',
            HINT = 'flatten the payload; consumers cannot be relied on to decode deeper nesting';
    END IF;
    IF jsonb_path_exists(p_payload, 'strict $.** ? (@.type() == "number" && (@ >= 1e999 || @ <= -1e999))') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = 'payload holds a number with 1000 or more digits before the point',
            HINT = 'send such a number as a string';
    END IF;
END $$;

-- check_traceparent: what a job's traceparent must be (jobs_before_insert): a W3C trace context header of
-- version 00, 00-<trace id: 32 lower-case hex, not all zero>-<parent span id: 16, not all zero>-<flags: 2>;
-- raises what is wrong and what to send instead.
CREATE OR REPLACE FUNCTION pglane.check_traceparent(p_value text) RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF p_value ~ '^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
       AND substr(p_value, 4, 32) <> repeat('0', 32) AND substr(p_value, 37, 16) <> repeat('0', 16) THEN
        RETURN;
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'PGL10',
        MESSAGE = format('traceparent %L is not a W3C trace context (00-<32 hex trace id>-<16 hex span id>-'
                         '<2 hex flags>, lower case, ids not all zero)', left(p_value, 80)),
        HINT = 'send the traceparent your tracer propagates (OpenTelemetry: TraceContextTextMapPropagator), or none';
END $$;

-- jobs_before_insert: validate one new job. Runs before the unique check, so a refused row is never
-- written, and a duplicate key with a bad payload is still refused for its payload.
CREATE OR REPLACE FUNCTION pglane.jobs_before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_max_bytes integer;
    v_rate      integer;
    v_period    interval;
    v_weighted  boolean;
    v_lane_id   integer;
    v_timeout   interval;  -- the lane's job_timeout
BEGIN
    -- FOR KEY SHARE, as the foreign key's check takes anyway: a set_lane lowering the rate holds the
    -- row FOR UPDATE until it commits, and this read then sees the new rate (lanes.sql, set_lane).
    SELECT l.max_payload_bytes, l.rate_limit, l.rate_period, l.weighted, l.id, l.job_timeout
      INTO v_max_bytes, v_rate, v_period, v_weighted, v_lane_id, v_timeout
      FROM pglane.lanes l WHERE l.name = NEW.lane FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01',
            MESSAGE = format('unknown lane %L', NEW.lane),
            HINT = 'create it first: pglane lane create NAME (or check the spelling)';
    END IF;
    IF NEW.status IS DISTINCT FROM 'queued' OR NEW.attempts IS DISTINCT FROM 0 OR NEW.seq IS NOT NULL
       OR NEW.started_at IS NOT NULL OR NEW.finished_at IS NOT NULL OR NEW.result IS NOT NULL
       OR NEW.deferrals_in_row IS DISTINCT FROM 0 THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = 'a new job must be inserted queued',
            HINT = 'insert only lane, payload, idempotency_key, run_after, cost, group_key, priority, '
                   'job_timeout and traceparent; pglane sets the rest';
    END IF;
    IF NEW.traceparent IS NOT NULL THEN  -- the producer's trace context, for the worker's spans; set here only
        PERFORM pglane.check_traceparent(NEW.traceparent);
    END IF;
    -- A job's own call timeout: at most its lane's, which sizes the lease and the worker's timeouts.
    IF NEW.job_timeout <= interval '0' OR NEW.job_timeout > v_timeout THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('a job timeout of %s on lane %L, whose job_timeout is %s: a job''s own timeout is '
                             'above zero and at most its lane''s', NEW.job_timeout, NEW.lane, v_timeout),
            HINT = format('give at most %s seconds, or raise the lane''s: pglane lane set %s --job-timeout SECONDS '
                          '(its lease grows with it)', extract(epoch FROM v_timeout), NEW.lane);
    END IF;
    PERFORM pglane.check_payload(NEW.payload, v_max_bytes, NEW.lane);
    IF NEW.idempotency_key IS NOT NULL AND length(NEW.idempotency_key) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL07',
            MESSAGE = format('idempotency key of %s characters; keys are 1 to 255 characters',
                             length(NEW.idempotency_key)),
            HINT = 'hash a long request identity down to a short key';
    END IF;
    -- A key whose job was pruned is remembered for the lane's key_retention (history.sql, keep_keys):
    -- the request was served once, and is not served again, whatever the payload (PGL14). Another
    -- producer's pruned key is refused as a key in use is (PGL05), revealing nothing of its job.
    IF NEW.idempotency_key IS NOT NULL THEN
        PERFORM pglane.refuse_pruned_key(NEW.lane, NEW.idempotency_key);
    END IF;
    -- cost: what the job's start counts against its lane's rate limit (1 unless given; below 1 its
    -- domain, pglane.job_cost, refused it already: check_violation job_cost_positive).
    NEW.cost := coalesce(NEW.cost, 1);
    IF NEW.cost > v_rate THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL13',
            MESSAGE = format('job cost %s exceeds the rate of lane %L (%s): it could never start',
                             NEW.cost, NEW.lane, pglane.rate_text(v_rate, v_period)),
            HINT = 'split the job, or raise the lane''s rate: pglane lane set NAME --rate N/PERIOD';
    END IF;
    -- The first job of the lane that costs more than 1 makes it weighted, for good: its claims then
    -- look at the head job's cost before they take the counters row (claim_impl). Rolled back with
    -- this insert if it is.
    IF NEW.cost > 1 AND NOT v_weighted THEN
        UPDATE pglane.lanes l SET weighted = true WHERE l.name = NEW.lane AND NOT l.weighted;
    END IF;
    NEW.priority := coalesce(NEW.priority, 0);
    NEW.fair_rank := pglane.fair_rank(v_lane_id, NEW.lane, NEW.group_key);  -- its round (groups.sql)
    NEW.created_at := now();  -- service order is the server's, not the client's
    NEW.enqueued_by := pglane.caller();  -- producers see their own jobs only
    NEW.run_after := coalesce(NEW.run_after, NEW.created_at);
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS jobs_before_insert ON pglane.jobs;
CREATE TRIGGER jobs_before_insert BEFORE INSERT ON pglane.jobs
    FOR EACH ROW EXECUTE FUNCTION pglane.jobs_before_insert();

-- enqueue: add a job and return its id (p_if_full 'skip': NULL when the bounded lane is full, nothing
-- written, no error; p_cost: what its start counts against the lane's rate; p_group: the tenant it
-- belongs to, p_priority: higher first, groups.sql; p_job_timeout: its call's own timeout, at most
-- the lane's; p_traceparent: the producer's W3C trace context, which the worker's spans continue). The same key again returns the existing job's id, whatever
-- its status, and writes nothing; the same key with another payload is an error. A concurrent twin
-- waits on the unique index for the first insert to commit, then finds it. A key another login
-- enqueued is refused alike whatever the payload (PGL05), so that the answer reveals nothing of that
-- job; operators and workers, who see every job, get the job id as usual. (A role that was never
-- granted pglane_producer cannot call this at all.)
CREATE OR REPLACE FUNCTION pglane.enqueue(
    p_lane text,
    p_payload jsonb DEFAULT '{}',
    p_idempotency_key text DEFAULT NULL,
    p_run_after timestamptz DEFAULT NULL,
    p_if_full text DEFAULT 'error',
    p_cost integer DEFAULT 1,
    p_group text DEFAULT NULL,
    p_priority integer DEFAULT 0,
    p_job_timeout interval DEFAULT NULL,
    p_traceparent text DEFAULT NULL
) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_id       bigint;
    v_existing jsonb;
    v_owner    text;
BEGIN
    IF p_if_full IS DISTINCT FROM 'error' THEN
        IF p_if_full IS DISTINCT FROM 'skip' THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL10',
                MESSAGE = format('p_if_full must be error or skip, not %L', p_if_full),
                HINT = 'skip: return NULL when the lane is full; error (the default): raise PGL04';
        END IF;
        -- Skip: look at the bound under the admissions row lock, which the insert's check takes next
        -- anyway, and stop before writing anything (and before any ERROR reaches the server log). A
        -- repeated key still returns its job, full lane or not.
        IF pglane.lane_is_full(p_lane) AND NOT EXISTS (
               SELECT 1 FROM pglane.jobs j WHERE j.lane = p_lane AND j.idempotency_key = p_idempotency_key) THEN
            RETURN NULL;
        END IF;
    END IF;
    INSERT INTO pglane.jobs AS j (lane, payload, idempotency_key, run_after, cost, group_key, priority, job_timeout,
                                  traceparent)
    VALUES (p_lane, p_payload, p_idempotency_key, p_run_after, p_cost, p_group, p_priority, p_job_timeout,
            p_traceparent)
    ON CONFLICT (lane, idempotency_key) DO NOTHING
    RETURNING j.id INTO v_id;
    IF v_id IS NOT NULL THEN
        RETURN v_id;
    END IF;
    SELECT j.id, j.payload, j.enqueued_by INTO v_id, v_existing, v_owner
      FROM pglane.jobs j WHERE j.lane = p_lane AND j.idempotency_key = p_idempotency_key;
    IF NOT FOUND THEN  -- the holder of the key was deleted (pruned) between the two statements
        RAISE EXCEPTION USING ERRCODE = '40001',
            MESSAGE = format('job with idempotency key %L vanished while enqueueing', p_idempotency_key),
            HINT = 'retry the enqueue';
    END IF;
    IF v_owner IS DISTINCT FROM pglane.caller() AND NOT pglane.sees_every_job(pglane.caller()::name) THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL05',
            MESSAGE = format('idempotency key %L of lane %L is in use by another producer', p_idempotency_key, p_lane),
            HINT = 'keys are shared by every producer of a lane: prefix yours with your application''s name';
    END IF;
    IF v_existing IS DISTINCT FROM p_payload THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL05',
            MESSAGE = format('idempotency key %L of lane %L belongs to job %s, which has a different payload',
                             p_idempotency_key, p_lane, v_id),
            HINT = 'send the same payload to get that job back, or use a new key for a new request';
    END IF;
    RETURN v_id;
END $$;

-- Outcomes: complete() and fail(), the only writers of a running job's end and of its attempt's.

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

-- complete_impl: the body of complete(), shared with complete_and_claim() (claim.sql) so that the
-- worker's fast path switches its search_path once per job, not three times. It runs only inside
-- those SECURITY DEFINER functions: EXECUTE on it is granted to nobody.
CREATE OR REPLACE FUNCTION pglane.complete_impl(p_attempt_id bigint, p_result jsonb, p_token uuid)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_job    bigint;
    v_number integer;
    v_late   record;
    v_proof  boolean;
    v_lane   text;
    v_breaker boolean;  -- the lane has one (pause.sql)
BEGIN
    -- The usual case: the job is running and this is its latest attempt. The UPDATE takes the job's
    -- row lock and, had it to wait, re-checks the guard on the newest row version (the attempt's
    -- job_id and attempt_number never change). A running job's latest attempt is running (every
    -- transition of that attempt moves the job too).
    -- The lane's row tells whether it has a breaker (pause.sql), whose run of failures a success ends.
    UPDATE pglane.jobs j SET status = 'done', finished_at = now(), result = p_result
      FROM pglane.attempts a, pglane.lanes l
     WHERE a.id = p_attempt_id AND j.id = a.job_id AND j.status = 'running' AND j.attempts = a.attempt_number
       AND (a.token = p_token OR pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start, a.session_mark))
       AND l.name = j.lane
    RETURNING j.lane, l.pause_after_failures IS NOT NULL INTO v_lane, v_breaker;
    IF FOUND THEN
        UPDATE pglane.attempts a SET status = 'done', finished_at = now()
         WHERE a.id = p_attempt_id AND a.status = 'running';
        IF NOT FOUND THEN
            RAISE EXCEPTION 'pglane invariant broken: a running job''s latest attempt % is finished', p_attempt_id;
        END IF;
        IF v_breaker THEN
            PERFORM pglane.breaker_success(v_lane);
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

-- outcome_job: the opening of fail() and defer(): the job of attempt p_attempt_id, locked, when the
-- caller may write the attempt's outcome (it holds the token, or is the claiming session; PGL12
-- otherwise, nothing written) and the job is running; NULL otherwise (no such attempt, or its job no
-- longer running). complete_impl has its own, fused into its UPDATE (the fast path).
CREATE OR REPLACE FUNCTION pglane.outcome_job(p_attempt_id bigint, p_token uuid) RETURNS pglane.jobs
LANGUAGE plpgsql AS $$
DECLARE
    v_job pglane.jobs;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pglane.attempts a WHERE a.id = p_attempt_id
                      AND (a.token = p_token OR pglane.may_write(p_token, a.token, a.backend_pid, a.backend_start, a.session_mark))) THEN
        IF EXISTS (SELECT 1 FROM pglane.attempts a WHERE a.id = p_attempt_id) THEN
            PERFORM pglane.not_the_claimer(p_attempt_id);
        END IF;
        RETURN NULL;
    END IF;
    SELECT j.* INTO v_job FROM pglane.jobs j
     WHERE j.id = (SELECT a.job_id FROM pglane.attempts a WHERE a.id = p_attempt_id)
       FOR UPDATE;
    IF NOT FOUND OR v_job.status <> 'running' THEN
        RETURN NULL;
    END IF;
    RETURN v_job;
END $$;

-- fail: record that attempt p_attempt_id failed (or timed out); true if it was accepted.
-- Same guard as complete for a running attempt. It counts toward the lane's breaker (pause.sql). The job goes back to the queue after the lane's
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
    v_job := pglane.outcome_job(p_attempt_id, p_token);
    IF v_job.id IS NULL THEN
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
    PERFORM pglane.breaker_failure(v_job.lane, p_attempt_id, p_error);  -- pause.sql
    RETURN true;
END $$;

-- defer: the handler of attempt p_attempt_id said "not paid, try later" (pglane.RetryLater): the
-- attempt ends deferred, with the reason; the job goes back to the queue to run after p_after, and
-- a deferral does not count toward max_attempts (requeue_or_fail). The handler's word is the evidence
-- that nothing was paid. After the lane's max_deferrals deferrals in a row the job fails instead,
-- with the reason, so that nothing loops for ever. On a lane whose on_retry_later is 'lane' the whole
-- lane pauses until the same moment (pause.sql). Same guard as fail(); true if it was accepted.
-- Refused (PGL10) with what to do: a delay that is negative, unknown or longer than a week.
CREATE OR REPLACE FUNCTION pglane.defer(p_attempt_id bigint, p_after interval, p_reason text,
                                        p_token uuid DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_job  pglane.jobs;
    v_lane pglane.lanes;
BEGIN
    IF p_after IS NULL OR p_after < interval '0' OR p_after > interval '7 days' THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('a deferral of %s: retry later takes 0 seconds to 7 days', coalesce(p_after::text, 'NULL')),
            HINT = 'give the provider''s Retry-After; for longer, pause the lane: pglane lane pause LANE --for DURATION';
    END IF;
    p_reason := 'deferred: ' || pglane.bounded_error(coalesce(nullif(btrim(p_reason, E' \t\r\n'), ''),
                                                              'no reason given'));
    v_job := pglane.outcome_job(p_attempt_id, p_token);
    IF v_job.id IS NULL THEN
        RETURN false;
    END IF;
    UPDATE pglane.attempts a SET status = 'deferred', finished_at = now(), error = p_reason
     WHERE a.id = p_attempt_id AND a.attempt_number = v_job.attempts AND a.status = 'running';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT * INTO v_lane FROM pglane.lanes l WHERE l.name = v_job.lane;
    IF v_job.deferrals_in_row + 1 > v_lane.max_deferrals THEN
        UPDATE pglane.jobs j SET status = 'failed', failed_or_cancelled = true, finished_at = now(),
               deferrals_in_row = 0,
               last_error = format('%s; failed: deferred %s times in a row, more than lane %s allows '
                                   '(--max-deferrals %s); when the provider takes calls again: pglane retry %s',
                                   p_reason, v_job.deferrals_in_row + 1, v_job.lane, v_lane.max_deferrals, v_job.id)
         WHERE j.id = v_job.id;
        RETURN true;
    END IF;
    PERFORM pglane.requeue_or_fail(v_job.id, v_job.lane, v_job.attempts, p_reason, '', '', p_after);
    -- requeue_or_fail ends a run of deferrals, as a failure does; this one goes on.
    UPDATE pglane.jobs j SET deferrals_in_row = v_job.deferrals_in_row + 1 WHERE j.id = v_job.id;
    IF v_lane.on_retry_later = 'lane' THEN
        PERFORM pglane.pause_for(v_lane.id, NULL, p_after, 'retry_later', pglane.caller(),
                                 format('attempt %s of job %s: %s', p_attempt_id, v_job.id, p_reason),
                                 ARRAY[p_attempt_id]);
    END IF;
    RETURN true;
END $$;

-- deferrals: how many of job p_job_id's attempts were deferred (they do not count toward max_attempts).
CREATE OR REPLACE FUNCTION pglane.deferrals(p_job_id bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT count(*) FROM pglane.attempts a WHERE a.job_id = p_job_id AND a.status = 'deferred';
$$;

-- requeue_or_fail: where a job goes after its attempt failed or was lost: back to the queue after
-- p_delay while the lane allows more attempts (its deferred attempts do not count: defer) and (on a
-- bounded lane) has room, else failed. Either way its run of deferrals in a row ends. The
-- reason p_error is kept in last_error, with p_requeued_note or p_final_note after it; a job failed
-- only because its lane was full says so, with the command to run it later. A job eligible at once
-- wakes the lane. Returns whether it was re-queued. Caller holds the job's row lock and has finished
-- the attempt.
CREATE OR REPLACE FUNCTION pglane.requeue_or_fail(
    p_job_id bigint, p_lane text, p_attempt_number integer, p_error text,
    p_requeued_note text, p_final_note text, p_delay interval
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_lane pglane.lanes;
BEGIN
    SELECT * INTO v_lane FROM pglane.lanes l WHERE l.name = p_lane;
    IF p_attempt_number - pglane.deferrals(p_job_id) < v_lane.max_attempts THEN  -- nested: queue_admit
        IF pglane.queue_admit(p_lane) THEN                                      -- takes a place on yes
            UPDATE pglane.jobs j SET status = 'queued', run_after = now() + p_delay,
                   last_error = p_error || p_requeued_note, deferrals_in_row = 0
             WHERE j.id = p_job_id;
            IF p_delay <= interval '0' THEN
                PERFORM pglane.notify_lane(v_lane.id);
            END IF;
            RETURN true;
        END IF;
        p_final_note := format('; not re-queued: lane %s is full (max_queued %s); run it again when there is '
                               'room: pglane retry %s', p_lane, v_lane.max_queued, p_job_id);
    END IF;
    UPDATE pglane.jobs j SET status = 'failed', failed_or_cancelled = true, finished_at = now(),
           last_error = p_error || p_final_note, deferrals_in_row = 0
     WHERE j.id = p_job_id;
    RETURN false;
END $$;

-- A person's decisions about one job: run it again (retry), or not at all (cancel).

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
    UPDATE pglane.jobs j SET status = 'queued', failed_or_cancelled = false, run_after = now(), finished_at = NULL,
           deferrals_in_row = 0
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
