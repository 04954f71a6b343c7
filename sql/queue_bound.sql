-- The bounded queue: a lane with max_queued holds at most that many queued jobs, new ones and
-- returning ones alike.
--
-- A bounded lane's queue depth is lane_admissions.admitted - lane_counters.left_queue: producers and
-- re-queues count in on the admissions row, under whose lock the bound is checked; claims, cancels
-- and late results count out on the counters row, which claims lock anyway. So a claim never waits
-- for a producer's open transaction. Both are maintained only while max_queued is set.
--
-- lanes_before_update (lanes.sql) recounts the depth when a lane becomes bounded; take (claim.sql)
-- counts a claim out with its seq bump.

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

-- queue_left: a job of a bounded lane left the queue other than by claim (cancel, a late result).
-- Caller holds the job's row lock.
CREATE OR REPLACE FUNCTION pglane.queue_left(p_lane text) RETURNS void
LANGUAGE sql AS $$
    UPDATE pglane.lane_counters c SET left_queue = c.left_queue + 1
      FROM pglane.lanes l
     WHERE l.name = p_lane AND c.lane_id = l.id AND l.max_queued IS NOT NULL;
$$;

-- queue_admit: a job that was admitted once goes back into the queue (a retry after a failure or a
-- lost worker, an operator's retry). On a bounded lane it takes one place under the admissions row
-- lock and, when the lane is full, takes none and returns false: max_queued holds for returning jobs
-- as it does for new ones, never more. Always true on an unbounded lane. Caller holds the job's row
-- lock. (It waits for a producer's open transaction on the lane, as producers wait for each other.)
CREATE OR REPLACE FUNCTION pglane.queue_admit(p_lane text) RETURNS boolean
LANGUAGE sql AS $$
    WITH lane AS (SELECT l.id, l.max_queued FROM pglane.lanes l WHERE l.name = p_lane),
         taken AS (UPDATE pglane.lane_admissions a SET admitted = a.admitted + 1
                     FROM lane
                    WHERE a.lane_id = lane.id AND lane.max_queued IS NOT NULL
                      AND a.admitted - (SELECT c.left_queue FROM pglane.lane_counters c WHERE c.lane_id = lane.id)
                          < lane.max_queued
                   RETURNING 1)
    SELECT lane.max_queued IS NULL OR EXISTS (SELECT 1 FROM taken) FROM lane;
$$;
