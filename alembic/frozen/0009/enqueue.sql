-- Enqueue: the one path into the queue, whether a job comes from pglane.enqueue() or from a plain
-- INSERT INTO pglane.jobs in any language. Both go through the same two triggers.

-- jobs_before_insert: validate one new job. Runs before the unique check, so a refused row is never
-- written, and a duplicate key with a bad payload is still refused for its payload.
CREATE OR REPLACE FUNCTION pglane.jobs_before_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_max_bytes integer;
    v_size      integer;
    v_rate      integer;
    v_period    interval;
    v_weighted  boolean;
BEGIN
    -- FOR KEY SHARE, as the foreign key's check takes anyway: a set_lane lowering the rate holds the
    -- row FOR UPDATE until it commits, and this read then sees the new rate (lanes.sql, set_lane).
    SELECT l.max_payload_bytes, l.rate_limit, l.rate_period, l.weighted INTO v_max_bytes, v_rate, v_period, v_weighted
      FROM pglane.lanes l WHERE l.name = NEW.lane FOR KEY SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01',
            MESSAGE = format('unknown lane %L', NEW.lane),
            HINT = 'create it first: pglane lane create NAME (or check the spelling)';
    END IF;
    IF NEW.status IS DISTINCT FROM 'queued' OR NEW.attempts IS DISTINCT FROM 0 OR NEW.seq IS NOT NULL
       OR NEW.started_at IS NOT NULL OR NEW.finished_at IS NOT NULL OR NEW.result IS NOT NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = 'a new job must be inserted queued',
            HINT = 'insert only lane, payload, idempotency_key, run_after and cost; pglane sets the rest';
    END IF;
    IF NEW.payload IS NULL OR jsonb_typeof(NEW.payload) NOT IN ('object', 'array') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = format('payload must be a JSON object or array, not %s',
                             coalesce(jsonb_typeof(NEW.payload), 'NULL')),
            HINT = 'wrap the value, e.g. {"value": ...}';
    END IF;
    -- The size in jsonb's binary form, before the compression that storing may add.
    v_size := pg_column_size(NEW.payload);
    IF v_size > v_max_bytes THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL03',
            MESSAGE = format('payload of %s bytes (in jsonb form, uncompressed) exceeds the %s-byte limit of lane %L',
                             v_size, v_max_bytes, NEW.lane),
            HINT = 'store large inputs elsewhere and enqueue a reference to them';
    END IF;
    -- What every consumer can decode: no value nested deeper than 64 levels, no number of 1000 or
    -- more digits before the point (JSON decoders, Python's among them, refuse or overflow on them).
    IF jsonb_path_exists(NEW.payload, 'strict $.**{65}') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = 'payload is nested more than 64 levels deep',
            HINT = 'flatten the payload; consumers cannot be relied on to decode deeper nesting';
    END IF;
    IF jsonb_path_exists(NEW.payload, 'strict $.** ? (@.type() == "number" && (@ >= 1e999 || @ <= -1e999))') THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL02',
            MESSAGE = 'payload holds a number with 1000 or more digits before the point',
            HINT = 'send such a number as a string';
    END IF;
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
    NEW.created_at := now();  -- service order is the server's, not the client's
    NEW.enqueued_by := pglane.caller();  -- producers see their own jobs only
    NEW.run_after := coalesce(NEW.run_after, NEW.created_at);
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS jobs_before_insert ON pglane.jobs;
CREATE TRIGGER jobs_before_insert BEFORE INSERT ON pglane.jobs
    FOR EACH ROW EXECUTE FUNCTION pglane.jobs_before_insert();

-- full_lane_retry_after: how long until a full lane has made room for p_excess more jobs, from the
-- rate at which its workers started jobs lately: this lane's share of the last 1,000 attempts of any
-- lane (newest first by id: a bounded read, paid only when an enqueue is refused with an error).
-- NULL when they show fewer than two starts of the lane; between 0.1 s and 1 h otherwise.
CREATE OR REPLACE FUNCTION pglane.full_lane_retry_after(p_lane text, p_excess bigint) RETURNS double precision
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN count(*) >= 2 AND max(r.started_at) > min(r.started_at)
                THEN least(3600, greatest(0.1, p_excess / (count(*) / extract(epoch FROM now() - min(r.started_at)))))
           END
      FROM (SELECT a.started_at, j.lane
              FROM (SELECT a.job_id, a.started_at FROM pglane.attempts a ORDER BY a.id DESC LIMIT 1000) a
              JOIN pglane.jobs j ON j.id = a.job_id) r
     WHERE r.lane = p_lane AND r.started_at > now() - interval '10 minutes';
$$;

-- jobs_after_insert: once per statement, per lane touched: enforce max_queued and wake the lane.
-- The bound holds under concurrent producers because the admissions update takes that row's lock
-- until commit; an excess raises and rolls the whole statement back, so nothing is written. Claims
-- count what left the queue on another row (lane_counters), so a producer's open transaction never
-- holds up a claim; a count read here that a claim has not yet committed only makes the check
-- stricter, never looser.
CREATE OR REPLACE FUNCTION pglane.jobs_after_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    r       record;
    v_depth bigint;
    v_retry double precision;
BEGIN
    FOR r IN SELECT l.id, l.name, l.max_queued, n.added
               FROM (SELECT lane, count(*) AS added FROM new_jobs GROUP BY lane) n
               JOIN pglane.lanes l ON l.name = n.lane
    LOOP
        IF r.max_queued IS NOT NULL THEN
            UPDATE pglane.lane_admissions a SET admitted = a.admitted + r.added
             WHERE a.lane_id = r.id RETURNING a.admitted INTO v_depth;
            v_depth := v_depth - (SELECT c.left_queue FROM pglane.lane_counters c WHERE c.lane_id = r.id);
            IF v_depth > r.max_queued THEN
                v_retry := pglane.full_lane_retry_after(r.name, v_depth - r.max_queued);
                RAISE EXCEPTION USING ERRCODE = 'PGL04',
                    MESSAGE = format('lane %L is full: max_queued is %s and %s job(s) are queued',
                                     r.name, r.max_queued, v_depth - r.added),
                    DETAIL = CASE WHEN v_retry IS NULL THEN 'retry_after_seconds='
                                  ELSE format('retry_after_seconds=%s', round(v_retry::numeric, 1)) END,
                    HINT = CASE WHEN v_retry IS NULL
                                THEN 'retry later, once workers have drained the lane, or raise its max_queued'
                                ELSE format('retry in about %s s (what the lane''s workers started lately takes '
                                            'that long to make room), or raise its max_queued', ceil(v_retry))
                           END;
            END IF;
        END IF;
        PERFORM pglane.notify_lane(r.id);
    END LOOP;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS jobs_after_insert ON pglane.jobs;
CREATE TRIGGER jobs_after_insert AFTER INSERT ON pglane.jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pglane.jobs_after_insert();

-- lane_is_full: whether bounded lane p_lane holds max_queued queued jobs; takes the admissions row
-- lock (until the caller's transaction ends), so that the answer holds until it inserts.
CREATE OR REPLACE FUNCTION pglane.lane_is_full(p_lane text) RETURNS boolean
LANGUAGE sql AS $$
    SELECT l.max_queued IS NOT NULL
           AND (SELECT a.admitted FROM pglane.lane_admissions a WHERE a.lane_id = l.id FOR UPDATE)
               - (SELECT c.left_queue FROM pglane.lane_counters c WHERE c.lane_id = l.id) >= l.max_queued
      FROM pglane.lanes l WHERE l.name = p_lane;
$$;

-- refuse_pruned_key: raise JobPruned (PGL14) when key p_key of lane p_lane belonged to a job that was
-- pruned within the lane's key retention; nothing otherwise.
CREATE OR REPLACE FUNCTION pglane.refuse_pruned_key(p_lane text, p_key text) RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    k pglane.pruned_keys;
BEGIN
    SELECT * INTO k FROM pglane.pruned_keys p
     WHERE p.lane = p_lane AND p.idempotency_key = p_key AND p.forget_after > now();
    IF NOT FOUND THEN
        RETURN;
    END IF;
    IF k.enqueued_by IS DISTINCT FROM pglane.caller() AND NOT pglane.sees_every_job(pglane.caller()::name) THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL05',
            MESSAGE = format('idempotency key %L of lane %L is in use by another producer', p_key, p_lane),
            HINT = 'keys are shared by every producer of a lane: prefix yours with your application''s name';
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'PGL14',
        MESSAGE = format('idempotency key %L of lane %L belonged to job %s, which was %s and has been pruned: '
                         'it is not run again', p_key, p_lane, k.job_id, k.status),
        DETAIL = format('job_id=%s', k.job_id),
        HINT = format('use a new key to make a new request; this key is remembered until %s', k.forget_after);
END $$;

-- enqueue: add a job and return its id (p_if_full 'skip': NULL when the bounded lane is full, nothing
-- written, no error; p_cost: what its start counts against the lane's rate). The same key again returns the existing job's id, whatever
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
    p_cost integer DEFAULT 1
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
    INSERT INTO pglane.jobs AS j (lane, payload, idempotency_key, run_after, cost)
    VALUES (p_lane, p_payload, p_idempotency_key, p_run_after, p_cost)
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
