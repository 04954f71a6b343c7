-- Strict lanes (takeover after_lease): the calls a lane may have in flight never exceed its slots,
-- counting the call of a lost attempt as in flight until its lease ends on the database clock, or a
-- person who knows its worker is stopped releases it (release_lease). The claim asks lease_admission
-- (its second step, claim.sql); the views say why a strict lane waits and what ends the wait.

-- in_flight: the calls of lane p_lane that may be in flight right now: running attempts, and lost ones
-- whose lease has not passed on the database clock and that nobody released (release_lease): the
-- worker of such an attempt may still be calling. `lease_ends` and `lost_attempt` name the lost
-- attempt whose lease ends first. A strict lane's claim (takeover after_lease) counts this; the views
-- explain a wait with it. Read-only; runs as its owner so that a producer's job_status may call it.
CREATE OR REPLACE FUNCTION pglane.in_flight(p_lane text,
    OUT in_flight bigint, OUT lost_attempt bigint, OUT lease_ends timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT count(*),
           (array_agg(a.id ORDER BY a.lease_expires_at) FILTER (WHERE a.status = 'lost'))[1],
           min(a.lease_expires_at) FILTER (WHERE a.status = 'lost')
      FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id
     WHERE j.lane = p_lane
       AND (a.status = 'running'
            OR (a.status = 'lost' AND a.lease_released_at IS NULL AND a.lease_expires_at > now()));
$$;

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

-- release_lease: a person who knows the worker of lost attempt p_attempt_id is stopped ends the wait
-- for its lease on a strict lane: recorded on the attempt (who, when), and the lane is woken. Refused
-- (PGL08) for an attempt that is not lost with its lease still running.
CREATE OR REPLACE FUNCTION pglane.release_lease(p_attempt_id bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane text;
BEGIN
    UPDATE pglane.attempts a SET lease_released_at = now(), lease_released_by = pglane.caller()
     WHERE a.id = p_attempt_id AND a.status = 'lost' AND a.lease_released_at IS NULL
       AND a.lease_expires_at > now()
    RETURNING (SELECT j.lane FROM pglane.jobs j WHERE j.id = a.job_id) INTO v_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL08',
            MESSAGE = format('attempt %s is not a lost attempt whose lease still runs: there is no wait to end',
                             p_attempt_id),
            HINT = 'pglane status shows which attempt a strict lane waits for';
    END IF;
    PERFORM pglane.notify_lane((SELECT l.id FROM pglane.lanes l WHERE l.name = v_lane));
    RETURN true;
END $$;

-- lease_wait_note: why a strict lane takes no job, and the way out.
CREATE OR REPLACE FUNCTION pglane.lease_wait_note(p_lane text, p_attempt bigint, p_until timestamptz) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format('wait: the worker of lost attempt %s may still be calling; lane %s takes its next job when '
                  'that lease ends at %s. If you know that worker is stopped: pglane release-lease %s',
                  p_attempt, p_lane, p_until, p_attempt);
$$;

-- lanes_in_flight: {lane: in_flight(lane)} for the strict lanes (takeover after_lease).
-- One of job_status's lane maps, read once per statement (views.sql).
CREATE OR REPLACE FUNCTION pglane.lanes_in_flight() RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT jsonb_object_agg(l.name, to_jsonb(f)) FROM pglane.lanes l CROSS JOIN LATERAL pglane.in_flight(l.name) f
     WHERE l.takeover = 'after_lease';
$$;
