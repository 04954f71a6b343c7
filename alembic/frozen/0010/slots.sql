-- Slots: a lane's consumer places (lanes.slots of them), each a session-level advisory lock keyed
-- (lane id, slot number) that a worker takes and keeps while it runs (pglane worker takes it with
-- pg_advisory_lock; a standby waits in that call). Who holds them (slot_holders, the one place that
-- knows how a slot lock looks in pg_locks), the claim's check that the calling session holds one
-- (claim_slot, the claim's first step: claim.sql), and what the views show of them.

-- slot_holders: every session-level advisory lock on a lane's slot key (lane id, slot number) right
-- now: held or waited for, exclusive or shared, by whatever session. The one place that knows how a
-- slot lock looks in pg_locks; a slot is held by a granted ExclusiveLock (pglane worker takes it so).
CREATE OR REPLACE VIEW pglane.slot_holders AS
SELECT l.id AS lane_id, l.name AS lane, k.objid::integer AS slot, k.pid, k.mode, k.granted
  FROM pg_catalog.pg_locks k
  JOIN pglane.lanes l ON k.classid = l.id::oid AND k.objid::bigint BETWEEN 1 AND l.slots
 WHERE k.locktype = 'advisory' AND k.objsubid = 2
   AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database());

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

-- lane_consumers: how many sessions hold a slot of the lane right now (session advisory locks).
CREATE OR REPLACE FUNCTION pglane.lane_consumers(p_lane_id integer, p_slots integer) RETURNS integer
LANGUAGE sql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT count(DISTINCT h.pid)::integer FROM pglane.slot_holders h
     WHERE h.lane_id = p_lane_id AND h.slot <= p_slots AND h.granted AND h.mode = 'ExclusiveLock';
$$;

-- lanes_consumers: {lane id: sessions holding a slot of it right now} (lane_consumers() for every lane).
-- One of job_status's lane maps, read once per statement (views.sql).
CREATE OR REPLACE FUNCTION pglane.lanes_consumers() RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT jsonb_object_agg(c.lane_id::text, c.consumers)
      FROM (SELECT h.lane_id, count(DISTINCT h.pid) AS consumers FROM pglane.slot_holders h
             WHERE h.granted AND h.mode = 'ExclusiveLock' GROUP BY h.lane_id) c;
$$;

-- slot_sessions: who holds or waits for each slot right now, with the session's role and application;
-- `squatter` marks a granted lock that is not a pglane worker's: a shared lock (it keeps every worker
-- out of the slot), or a session whose role is not a member of pglane_worker.
CREATE OR REPLACE VIEW pglane.slot_sessions AS
SELECT h.lane_id, h.lane, h.slot, h.pid, h.mode, h.granted, s.usename::text AS role, s.application_name,
       h.granted AND (h.mode <> 'ExclusiveLock' OR s.usename IS NULL
                      OR NOT pg_has_role(s.usename, 'pglane_worker', 'USAGE')) AS squatter
  FROM pglane.slot_holders h
  LEFT JOIN pg_catalog.pg_stat_activity s ON s.pid = h.pid;
