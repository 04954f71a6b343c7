-- History: finished jobs are kept until an operator prunes them.

-- prune: delete the finished jobs of one lane (or all) that finished before now() - p_older_than,
-- with their attempts (ON DELETE CASCADE); returns how many jobs went. Done and cancelled jobs go;
-- failed jobs stay, because their attempts explain what happened and what may have been paid,
-- unless p_include_failed. A pruned job's idempotency key is forgotten: the same key makes a new job.
CREATE OR REPLACE FUNCTION pglane.prune(p_older_than interval, p_lane text DEFAULT NULL,
                                        p_include_failed boolean DEFAULT false)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_count bigint;
BEGIN
    IF p_older_than IS NULL OR p_older_than < interval '0' THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('prune needs a non-negative age, not %s', coalesce(p_older_than::text, 'NULL')),
            HINT = 'e.g. pglane prune --older-than 7d';
    END IF;
    DELETE FROM pglane.jobs j
     WHERE j.finished_at < now() - p_older_than
       AND (p_lane IS NULL OR j.lane = p_lane)
       AND (j.status IN ('done', 'cancelled') OR (p_include_failed AND j.status = 'failed'));
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END $$;
