-- Groups: the tenants of a lane. A job may carry a group (jobs.group_key, 1 to 255 characters; NULL:
-- the lane's one shared group) and a priority (jobs.priority, higher first, default 0); a lane may limit
-- how many jobs of one group run at once (lanes.group_slots). docs/design.md#groups-priorities-and-fair-service.
--
-- Service order, said once, in the claim's pick (claim.sql): priority DESC, fair_rank, created_at, id.
-- fair_rank is the round in which a job is served among its lane's groups (start-time fair queuing):
-- a job joining a group with nothing queued gets the lane's current round (lane_counters.served_rank:
-- the rank of the latest job started), so it goes before every queued job of a later round; the next
-- jobs of its group get the rounds after its group's last queued job. A group that enqueues 2,000 jobs
-- takes 2,000 rounds; a group that enqueues 10 behind it shares the next 10 of them, one job each, and
-- so on: the group served least recently goes next. Jobs of one group keep their order. No table of
-- groups and no lock at enqueue: the round is read, not written (two producers of one group at once
-- may give two jobs the same round; created_at, then id, orders them).
--
-- The limit (group_slots) is exact: counted under the lane's counters row lock, which every claim of
-- the lane takes before it commits, so two slots never both take a group's last room; a job whose
-- group is full is passed over by the pick for the next job of another group (no slot idles while
-- another group waits). A running attempt counts until it ends; on a strict lane (takeover
-- after_lease) a lost attempt counts until its lease ends or a person releases it (strict.sql), as
-- it does for the lane's slots.

-- fair_rank: the round of a new job of group p_group on lane p_lane (jobs_before_insert, jobs.sql).
-- Reads the group's latest queued round through jobs_group_queue: one index probe, no lock, whatever
-- the statistics say. A plan that reads the group's or the lane's whole queue instead (a sequential
-- scan, a bitmap or a sort: what the planner picks when the statistics say the table is empty, as on a
-- lane's first day) costs one pass per job, and a bulk INSERT the square of its rows: so the three are
-- off here (jobs_queue, in service order, would need a sort), and the index is keyed on
-- coalesce(group_key, ''): the shared group is then an equality the probe walks backward.
-- VOLATILE (the default), so that the rows an INSERT ... SELECT wrote before this one are seen: a
-- batch of one group spreads over as many rounds as it has jobs.
CREATE OR REPLACE FUNCTION pglane.fair_rank(p_lane_id integer, p_lane text, p_group text) RETURNS bigint
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_sort = off
AS $$
DECLARE
    v_round bigint;  -- the lane's current round
    v_last  bigint;  -- the group's latest queued round (NULL: nothing queued)
BEGIN
    IF length(p_group) NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('a group of %s characters; a job''s group is 1 to 255 characters', length(p_group)),
            HINT = 'use a short tenant id as the group; no group at all (NULL) is the lane''s shared group';
    END IF;
    SELECT c.served_rank INTO v_round FROM pglane.lane_counters c WHERE c.lane_id = p_lane_id;
    SELECT j.fair_rank INTO v_last FROM pglane.jobs j
     WHERE j.lane = p_lane AND coalesce(j.group_key, '') = coalesce(p_group, '') AND j.in_queue
     ORDER BY j.fair_rank DESC LIMIT 1;
    RETURN greatest(v_round, v_last + 1);  -- greatest() passes over a NULL
END $$;

-- group_in_flight: the running jobs of group p_group on lane p_lane that count toward its limit: its
-- running attempts, and on a strict lane its lost ones whose lease runs on (strict.sql, in_flight).
-- Read-only; runs as its owner so that a producer's job_status may call it.
CREATE OR REPLACE FUNCTION pglane.group_in_flight(p_lane pglane.lanes, p_group text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT count(*) FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id
     WHERE j.lane = p_lane.name AND j.group_key IS NOT DISTINCT FROM p_group
       AND (a.status = 'running'
            OR (p_lane.takeover = 'after_lease' AND a.status = 'lost' AND a.lease_released_at IS NULL
                AND a.lease_expires_at > now()));
$$;

-- full_groups: the claim's group policy (claim_impl), on a lane with group_slots: the groups with no
-- room left, which the pick then passes over (`shared`: the jobs with no group are full). Takes the
-- counters row lock first, so that what it counts stays true until the claim commits; the statement
-- after the lock sees every start committed before it (READ COMMITTED: a new snapshot per statement).
-- What counts is as in strict.sql's in_flight: running attempts, and on a strict lane (takeover
-- after_lease) lost ones whose lease runs on. Read so that the cost follows the calls in flight, not
-- the history (docs/design.md#groups-priorities-and-fair-service, bench/README.md "Groups"):
-- - attempts_running by a plain index(-only) scan, never a bitmap: a bitmap scan does not mark the
--   entries of finished attempts dead, and nothing else on the claim's path scans that index, so each
--   claim would read every attempt finished since the last vacuum; a plain scan marks them as it goes;
-- - the jobs by their key alone, one probe per call in flight (= ANY, and OFFSET 0 so that the lane's
--   test is not pushed into it): a join may be planned as a merge that reads jobs_pkey from the lane's
--   oldest job, and with the lane's test beside it the generic plan may walk the lane's every job by
--   jobs_lane_idempotency_key_key;
-- - with fewer calls in flight than group_slots no group can be full: nothing more is read;
-- - the plan is the generic one: with the array as a parameter the planner would otherwise build a
--   custom plan at every claim (some 700,000 instructions).
CREATE OR REPLACE FUNCTION pglane.full_groups(p_lane pglane.lanes, OUT groups text[], OUT shared boolean)
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_bitmapscan = off SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_jobs bigint[];  -- the jobs whose calls count, in every lane (attempts carry no lane)
BEGIN
    groups := '{}';
    shared := false;
    PERFORM 1 FROM pglane.lane_counters c WHERE c.lane_id = p_lane.id FOR UPDATE;
    v_jobs := ARRAY(SELECT a.job_id FROM pglane.attempts a WHERE a.status = 'running');
    IF p_lane.takeover = 'after_lease' THEN
        v_jobs := v_jobs || ARRAY(SELECT a.job_id FROM pglane.attempts a
                                   WHERE a.status = 'lost' AND a.lease_released_at IS NULL
                                     AND a.lease_expires_at > now());
    END IF;
    IF cardinality(v_jobs) < p_lane.group_slots THEN
        RETURN;
    END IF;
    SELECT coalesce(array_agg(f.group_key) FILTER (WHERE f.group_key IS NOT NULL), '{}'),
           coalesce(bool_or(f.group_key IS NULL), false)
      INTO groups, shared
      FROM (SELECT j.group_key FROM (SELECT j.lane, j.group_key FROM pglane.jobs j WHERE j.id = ANY (v_jobs)
                                      OFFSET 0) j  -- by key alone: the lane is tested after (see above)
             WHERE j.lane = p_lane.name
             GROUP BY j.group_key HAVING count(*) >= p_lane.group_slots) f;
END $$;

-- served: the claim took a job of group p_group (take, claim.sql): when, for group_status. The shared
-- group (no group) is not recorded: a lane that never uses groups pays nothing for them. plpgsql, so
-- that its statement is planned once per session (a SQL function's is planned at every call before
-- PostgreSQL 18).
CREATE OR REPLACE FUNCTION pglane.served(p_lane_id integer, p_group text, p_at timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO pglane.lane_groups AS g (lane_id, group_key, served_at) VALUES (p_lane_id, p_group, p_at)
    ON CONFLICT (lane_id, group_key) DO UPDATE SET served_at = excluded.served_at;
END $$;

-- groups_waiting: how many groups of lane p_lane have a queued job (the shared group counts as one).
-- The lane's greatest queued group, one probe of jobs_group_queue backward, says whether it has any
-- but the shared group ('' there, which sorts first); only a lane that has grouped jobs queued is
-- counted, in one pass over its part of the index, which is ordered by group: it costs the backlog.
CREATE OR REPLACE FUNCTION pglane.groups_waiting(p_lane text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT CASE WHEN t.top IS NULL THEN 0 WHEN t.top = '' THEN 1
                ELSE (SELECT count(*) FROM (SELECT DISTINCT coalesce(j.group_key, '') FROM pglane.jobs j
                                             WHERE j.lane = p_lane AND j.in_queue) g)
           END
      FROM (SELECT (SELECT coalesce(j.group_key, '') FROM pglane.jobs j WHERE j.lane = p_lane AND j.in_queue
                     ORDER BY coalesce(j.group_key, '') DESC LIMIT 1) AS top) t;
$$;

-- group_status: lane p_lane's groups, the deepest queue first (at most p_limit; NULL: all): queued
-- and running jobs, how long the oldest queued job has waited, when the group last had a job
-- started (NULL for the shared group, which is not recorded, and for a group never served). One pass
-- over the lane's queue and its running attempts: it costs the backlog, not the history.
CREATE OR REPLACE FUNCTION pglane.group_status(p_lane text, p_limit integer DEFAULT 20)
RETURNS TABLE (lane text, group_key text, queued bigint, running bigint, oldest_wait interval,
               served_last timestamptz)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane_id integer;
BEGIN
    SELECT l.id INTO v_lane_id FROM pglane.lanes l WHERE l.name = p_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'list the lanes with: pglane lane list';
    END IF;
    RETURN QUERY
    WITH q AS (SELECT coalesce(j.group_key, '') AS k, count(*) AS queued, min(j.created_at) AS oldest
                 FROM pglane.jobs j WHERE j.lane = p_lane AND j.in_queue GROUP BY 1),
         r AS (SELECT coalesce(j.group_key, '') AS k, count(*) AS running
                 FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id
                WHERE a.status = 'running' AND j.lane = p_lane GROUP BY 1)
    SELECT p_lane, nullif(coalesce(q.k, r.k), ''), coalesce(q.queued, 0), coalesce(r.running, 0),
           now() - q.oldest, g.served_at
      FROM q FULL JOIN r ON r.k = q.k
      LEFT JOIN pglane.lane_groups g ON g.lane_id = v_lane_id AND g.group_key = coalesce(q.k, r.k)
     ORDER BY 3 DESC, 4 DESC, 2 NULLS FIRST
     LIMIT p_limit;
END $$;
