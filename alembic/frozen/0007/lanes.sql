-- Lanes: who holds their slots, the counters row each lane needs, the recount when a lane becomes
-- bounded, and where a job goes when it may run again.

-- slot_holders: every session-level advisory lock on a lane's slot key (lane id, slot number) right
-- now: held or waited for, exclusive or shared, by whatever session. The one place that knows how a
-- slot lock looks in pg_locks; a slot is held by a granted ExclusiveLock (pglane worker takes it so).
CREATE OR REPLACE VIEW pglane.slot_holders AS
SELECT l.id AS lane_id, l.name AS lane, k.objid::integer AS slot, k.pid, k.mode, k.granted
  FROM pg_catalog.pg_locks k
  JOIN pglane.lanes l ON k.classid = l.id::oid AND k.objid::bigint BETWEEN 1 AND l.slots
 WHERE k.locktype = 'advisory' AND k.objsubid = 2
   AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database());

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

-- lanes_after_insert: every lane gets its counters and admissions rows in the same transaction, so
-- claim() and the bound check can rely on them existing.
CREATE OR REPLACE FUNCTION pglane.lanes_after_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    INSERT INTO pglane.lane_counters (lane_id) VALUES (NEW.id);
    INSERT INTO pglane.lane_admissions (lane_id) VALUES (NEW.id);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS lanes_after_insert ON pglane.lanes;
CREATE TRIGGER lanes_after_insert AFTER INSERT ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_after_insert();

-- lanes_before_update: lane names are the jobs' foreign key and ids are lock keys: neither changes.
-- When max_queued goes from unset to set, the queue depth (admitted - left_queue, maintained only for
-- bounded lanes) is recounted under both rows' locks.
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
        UPDATE pglane.lane_counters c SET left_queue = 0 WHERE c.lane_id = NEW.id;
        UPDATE pglane.lane_admissions a
           SET admitted = (SELECT count(*) FROM pglane.jobs j WHERE j.lane = NEW.name AND j.in_queue)
         WHERE a.lane_id = NEW.id;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS lanes_before_update ON pglane.lanes;
CREATE TRIGGER lanes_before_update BEFORE UPDATE ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_before_update();

-- A bounded lane's queue depth is lane_admissions.admitted - lane_counters.left_queue: producers and
-- re-queues count in on the admissions row, under whose lock the bound is checked; claims, cancels
-- and late results count out on the counters row, which claims lock anyway. So a claim never waits
-- for a producer's open transaction. Both are maintained only while max_queued is set.

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

-- requeue_or_fail: where a job goes after its attempt failed or was lost: back to the queue after
-- p_delay while the lane allows more attempts and (on a bounded lane) has room, else failed. The
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
    IF p_attempt_number < v_lane.max_attempts THEN  -- nested: queue_admit takes a place when it says yes
        IF pglane.queue_admit(p_lane) THEN
            UPDATE pglane.jobs j SET status = 'queued', run_after = now() + p_delay,
                   last_error = p_error || p_requeued_note
             WHERE j.id = p_job_id;
            IF p_delay <= interval '0' THEN
                PERFORM pglane.notify_lane(v_lane.id);
            END IF;
            RETURN true;
        END IF;
        p_final_note := format('; not re-queued: lane %s is full (max_queued %s); run it again when there is '
                               'room: pglane retry %s', p_lane, v_lane.max_queued, p_job_id);
    END IF;
    UPDATE pglane.jobs j SET status = 'failed', finished_at = now(), last_error = p_error || p_final_note
     WHERE j.id = p_job_id;
    RETURN false;
END $$;

-- notify_lane: wake the lane's listening workers. The channel is derived from the lane's id, never
-- from its name; the payload is empty (no job data). Identical notifications in one transaction fold
-- into one, so a transaction wakes each lane at most once.
CREATE OR REPLACE FUNCTION pglane.notify_lane(p_lane_id integer) RETURNS void
LANGUAGE sql AS $$
    SELECT pg_notify('pglane_' || p_lane_id, '');
$$;
