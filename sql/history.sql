-- History: finished jobs are kept until an operator prunes them. A pruned job's idempotency key is
-- remembered for its lane's key_retention (keep_keys), and an enqueue that brings it again is refused
-- (refuse_pruned_key, called by jobs_before_insert: jobs.sql).

-- note_pruned: record that a prune deleted p_count jobs whose ids lie from p_first to p_last, so that
-- a wait for one of them says it was pruned rather than unknown (pglane.await_job). One row per
-- prune or batch: ids in the range that were not deleted (still queued, failed, another lane) are
-- found in pglane.jobs first; an id that never made a job (a rolled back insert) reads as pruned.
CREATE OR REPLACE FUNCTION pglane.note_pruned(p_first bigint, p_last bigint, p_count bigint) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    INSERT INTO pglane.pruned_jobs (first_id, last_id, jobs) SELECT p_first, p_last, p_count WHERE p_count > 0;
$$;

-- keep_keys: after a prune deleted the jobs in p_gone, remember the keys of those that had one, each
-- until its job's finished_at + its lane's key_retention (lanes whose retention has passed already
-- keep nothing), so that a repeated request gets the pruned job's id (PGL14), never a second paid
-- call; and forget the remembered keys whose time has come. p_forget_keys (the operator's
-- --forget-keys: the same key then makes a new job): remember none of these, and forget the keys of
-- the lane's (or every lane's) jobs that finished before p_cut, pruned earlier.
CREATE OR REPLACE FUNCTION pglane.keep_keys(p_gone pglane.jobs[], p_forget_keys boolean, p_lane text,
                                            p_cut timestamptz) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    DELETE FROM pglane.pruned_keys k
     WHERE p_forget_keys AND k.finished_at < p_cut AND (p_lane IS NULL OR k.lane = p_lane);
    INSERT INTO pglane.pruned_keys AS k (lane, idempotency_key, job_id, status, enqueued_by, finished_at,
                                         forget_after)
    SELECT g.lane, g.idempotency_key, g.id, g.status, g.enqueued_by, g.finished_at,
           g.finished_at + l.key_retention
      FROM unnest(p_gone) g JOIN pglane.lanes l ON l.name = g.lane
     WHERE NOT p_forget_keys AND g.idempotency_key IS NOT NULL AND g.finished_at + l.key_retention > now()
    ON CONFLICT (lane, idempotency_key) DO UPDATE
       SET job_id = excluded.job_id, status = excluded.status, enqueued_by = excluded.enqueued_by,
           finished_at = excluded.finished_at, forget_after = excluded.forget_after;
    DELETE FROM pglane.pruned_keys k WHERE k.forget_after <= now();
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

-- prune: delete the finished jobs of one lane (or all) that finished before now() - p_older_than,
-- with their attempts (ON DELETE CASCADE); returns how many jobs went. Done and cancelled jobs go;
-- failed jobs stay, because their attempts explain what happened and what may have been paid,
-- unless p_include_failed. A pruned job's idempotency key is remembered for its lane's key_retention
-- (keep_keys) unless p_forget_keys, which also forgets the keys of those pruned earlier.
CREATE OR REPLACE FUNCTION pglane.prune(p_older_than interval, p_lane text DEFAULT NULL,
                                        p_include_failed boolean DEFAULT false, p_forget_keys boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_count bigint;
    v_first bigint;
    v_last  bigint;
    v_gone  pglane.jobs[];
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('prune needs a non-negative age, not %s', coalesce(p_older_than::text, 'NULL')),
            HINT = 'e.g. pglane prune --older-than 7d';
    END IF;
    WITH gone AS (
        DELETE FROM pglane.jobs j
         WHERE j.finished_at < now() - p_older_than
           AND (p_lane IS NULL OR j.lane = p_lane)
           AND (j.status IN ('done', 'cancelled') OR (p_include_failed AND j.status = 'failed'))
        RETURNING j.*
    )
    SELECT count(*), min(g.id), max(g.id), array_agg(g) FILTER (WHERE g.idempotency_key IS NOT NULL)
      INTO v_count, v_first, v_last, v_gone FROM gone g;
    PERFORM pglane.note_pruned(v_first, v_last, v_count);
    PERFORM pglane.keep_keys(coalesce(v_gone, '{}'), p_forget_keys, p_lane, now() - p_older_than);
    RETURN v_count;
END $$;

-- prune_batch: one bounded step of a prune, in a transaction of its own: delete at most p_batch of the
-- jobs prune() would delete whose id is above p_after_id, oldest id first, skipping rows locked right
-- now; returns how many went and the highest id deleted (NULL: nothing left above p_after_id). A
-- prune of any size is a loop of these (pglane prune --batch N): each step short, the worker never
-- waits long behind it, and an interrupted prune loses nothing and starts again where it likes.
CREATE OR REPLACE FUNCTION pglane.prune_batch(p_older_than interval, p_lane text, p_include_failed boolean,
                                              p_after_id bigint, p_batch integer, p_forget_keys boolean DEFAULT false,
                                              OUT deleted bigint, OUT last_id bigint)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_first bigint;
    v_gone  pglane.jobs[];
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' OR p_batch IS NULL OR p_batch < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('prune needs a non-negative age and a batch of at least 1, not %s and %s',
                             coalesce(p_older_than::text, 'NULL'), coalesce(p_batch::text, 'NULL')),
            HINT = 'e.g. pglane prune --older-than 7d --batch 5000';
    END IF;
    WITH chosen AS (
        SELECT j.id FROM pglane.jobs j
         WHERE j.id > coalesce(p_after_id, 0) AND j.finished_at < now() - p_older_than
           AND (p_lane IS NULL OR j.lane = p_lane)
           AND (j.status IN ('done', 'cancelled') OR (p_include_failed AND j.status = 'failed'))
         ORDER BY j.id
         LIMIT p_batch
           FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM pglane.jobs j USING chosen c WHERE j.id = c.id RETURNING j.*
    )
    SELECT count(*), min(g.id), max(g.id), array_agg(g) FILTER (WHERE g.idempotency_key IS NOT NULL)
      INTO deleted, v_first, last_id, v_gone FROM gone g;
    PERFORM pglane.note_pruned(v_first, last_id, deleted);
    PERFORM pglane.keep_keys(coalesce(v_gone, '{}'), p_forget_keys, p_lane, now() - p_older_than);
END $$;
