-- Lanes: the counters row each lane needs, and the recount when a lane becomes bounded.

-- lanes_after_insert: every lane gets its counters row in the same transaction, so claim() and the
-- bound check can rely on it existing.
CREATE OR REPLACE FUNCTION pglane.lanes_after_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    INSERT INTO pglane.lane_counters (lane_id) VALUES (NEW.id);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS lanes_after_insert ON pglane.lanes;
CREATE TRIGGER lanes_after_insert AFTER INSERT ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_after_insert();

-- lanes_before_update: lane names are the jobs' foreign key and ids are lock keys: neither changes.
-- When max_queued goes from unset to set, the queued counter (maintained only for bounded lanes) is
-- recounted under the counters row lock.
CREATE OR REPLACE FUNCTION pglane.lanes_before_update() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    IF NEW.name IS DISTINCT FROM OLD.name THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('lane %L cannot be renamed', OLD.name),
            HINT = 'create a new lane; jobs and lock keys refer to this one';
    END IF;
    IF OLD.max_queued IS NULL AND NEW.max_queued IS NOT NULL THEN
        UPDATE pglane.lane_counters c
           SET queued = (SELECT count(*) FROM pglane.jobs j WHERE j.lane = NEW.name AND j.in_queue)
         WHERE c.lane_id = NEW.id;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS lanes_before_update ON pglane.lanes;
CREATE TRIGGER lanes_before_update BEFORE UPDATE ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_before_update();

-- queue_delta: keep a bounded lane's queued counter right when a job leaves the queue other than by
-- claim (cancel, a late result). Jobs enter through the insert trigger or queue_admit, which check the
-- bound. Caller holds the job's row lock.
CREATE OR REPLACE FUNCTION pglane.queue_delta(p_lane text, p_delta integer) RETURNS void
LANGUAGE sql AS $$
    UPDATE pglane.lane_counters c SET queued = c.queued + p_delta
      FROM pglane.lanes l
     WHERE l.name = p_lane AND c.lane_id = l.id AND l.max_queued IS NOT NULL;
$$;

-- queue_admit: a job that was admitted once goes back into the queue (a retry after a failure or a
-- lost worker, an operator's retry). On a bounded lane it takes one place under the counters row lock
-- and, when the lane is full, takes none and returns false: max_queued holds for returning jobs as it
-- does for new ones, never more. Always true on an unbounded lane. Caller holds the job's row lock.
CREATE OR REPLACE FUNCTION pglane.queue_admit(p_lane text) RETURNS boolean
LANGUAGE sql AS $$
    WITH lane AS (SELECT l.id, l.max_queued FROM pglane.lanes l WHERE l.name = p_lane),
         taken AS (UPDATE pglane.lane_counters c SET queued = c.queued + 1
                     FROM lane
                    WHERE c.lane_id = lane.id AND lane.max_queued IS NOT NULL AND c.queued < lane.max_queued
                   RETURNING 1)
    SELECT lane.max_queued IS NULL OR EXISTS (SELECT 1 FROM taken) FROM lane;
$$;

-- lane_full_note: what last_error adds when a job that may run again is failed instead of re-queued
-- because queue_admit said its bounded lane is full.
CREATE OR REPLACE FUNCTION pglane.lane_full_note(p_lane text, p_job bigint) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT format('; not re-queued: lane %s is full (max_queued %s); run it again when there is room: '
                  'pglane retry %s', l.name, l.max_queued, p_job)
      FROM pglane.lanes l WHERE l.name = p_lane;
$$;

-- notify_lane: wake the lane's listening workers. The channel is derived from the lane's id, never
-- from its name; the payload is empty (no job data). Identical notifications in one transaction fold
-- into one, so a transaction wakes each lane at most once.
CREATE OR REPLACE FUNCTION pglane.notify_lane(p_lane_id integer) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('pglane_' || p_lane_id, '');
$$;
