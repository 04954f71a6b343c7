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

-- notify: a wake-up that never costs the writer its transaction. PostgreSQL queues a notification
-- at commit and fails the whole commit when its NOTIFY queue is full, which any login can bring
-- about (LISTEN, stay idle in a transaction, flood): an enqueue or a completion must not fail for
-- a hint. Past half the queue the notification is skipped, counted (notifications_skipped()) and
-- logged; the workers' poll finds the job, a waiter's backup poll the outcome.
CREATE OR REPLACE FUNCTION pglane.notify(p_channel text, p_payload text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    IF pg_notification_queue_usage() < 0.5 THEN
        PERFORM pg_notify(p_channel, p_payload);
    ELSE
        PERFORM nextval('pglane.notifications_skipped');
        RAISE LOG 'pglane: the NOTIFY queue is % %% full: the wake-up on % was skipped; pollers find the work '
                  '(a session that LISTENs and stays in a transaction holds the queue: see pg_stat_activity)',
                  round(pg_notification_queue_usage() * 100), p_channel;
    END IF;
END $$;

-- notifications_skipped: how many wake-ups notify() skipped since the schema was made.
CREATE OR REPLACE FUNCTION pglane.notifications_skipped() RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT CASE WHEN s.is_called THEN s.last_value ELSE 0 END FROM pglane.notifications_skipped s;
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
-- bounded lanes) is recounted under both rows' locks. When the rate limit is removed, its window goes.
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
    IF NEW.rate_limit IS NULL AND OLD.rate_limit IS NOT NULL THEN  -- unlimited: no window to keep
        DELETE FROM pglane.lane_starts s WHERE s.lane_id = NEW.id;
        UPDATE pglane.lane_counters c SET window_cost = 0, pending_starts = '{}' WHERE c.lane_id = NEW.id;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS lanes_before_update ON pglane.lanes;
CREATE TRIGGER lanes_before_update BEFORE UPDATE ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_before_update();

-- lanes_after_delete: a deleted lane's recorded starts go with it (lane_starts has no foreign key: its
-- check would lock the lane's row at every start of a rate-limited lane).
CREATE OR REPLACE FUNCTION pglane.lanes_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    DELETE FROM pglane.lane_starts s WHERE s.lane_id = OLD.id;
    DELETE FROM pglane.pruned_keys k WHERE k.lane = OLD.name;  -- a lane made again starts with no keys
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS lanes_after_delete ON pglane.lanes;
CREATE TRIGGER lanes_after_delete AFTER DELETE ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_after_delete();

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
    UPDATE pglane.jobs j SET status = 'failed', failed_or_cancelled = true, finished_at = now(),
           last_error = p_error || p_final_note
     WHERE j.id = p_job_id;
    RETURN false;
END $$;

-- notify_lane: wake the lane's listening workers. The channel is derived from the lane's id, never
-- from its name; the payload is empty (no job data). Identical notifications in one transaction fold
-- into one, so a transaction wakes each lane at most once.
CREATE OR REPLACE FUNCTION pglane.notify_lane(p_lane_id integer) RETURNS void
LANGUAGE sql AS $$
    SELECT pglane.notify('pglane_' || p_lane_id, '');
$$;

-- Rate limits. A lane with rate_limit N and rate_period P starts at most N units of cost (jobs.cost,
-- 1 by default) in any window of length P, cluster-wide: the claim counts, on the database clock,
-- under the lane's counters row lock (rate_start). Each start is a row of lane_starts, but for the
-- latest starts of rate_start's fast path, kept in the counters row (lane_counters.pending_starts, cost
-- 1 each, at most 31) until the next slow start moves them; each slow start also deletes the rows that
-- left the window, so the table holds the window and little more. lane_counters.window_cost is the sum
-- of both (rate_start and take keep it so; lane_window_starts reads both places).

-- parse_rate: '5/s', '60/min', '1000/h', '2/d', '100/10min' (a count before the unit multiplies it);
-- NULL for 'none'. Raises PGL10 saying what is accepted.
CREATE OR REPLACE FUNCTION pglane.parse_rate(p_rate text, OUT rate_limit integer, OUT rate_period interval)
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    m text[];
BEGIN
    IF lower(btrim(p_rate)) = 'none' THEN
        RETURN;
    END IF;
    m := regexp_match(lower(coalesce(p_rate, '')),
                      '^\s*([0-9]{1,7})\s*/\s*([0-9]{0,5})\s*(s|sec|second|m|min|minute|h|hour|d|day)s?\s*$');
    IF m IS NULL OR m[1]::integer < 1 OR coalesce(nullif(m[2], ''), '1')::integer < 1 THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('rate %L is not N/PERIOD', p_rate),
            HINT = 'give starts per period, e.g. 5/s, 60/min, 1000/h or 100/10min; none removes the limit';
    END IF;
    rate_limit := m[1]::integer;
    rate_period := coalesce(nullif(m[2], ''), '1')::integer * CASE left(m[3], 1)
        WHEN 's' THEN interval '1 second' WHEN 'm' THEN interval '1 minute'
        WHEN 'h' THEN interval '1 hour' ELSE interval '1 day' END;
END $$;

-- rate_text: how a rate reads: '10/s', '60/min', '1000/h', '5/30s'.
CREATE OR REPLACE FUNCTION pglane.rate_text(p_limit integer, p_period interval) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p_limit IS NULL THEN NULL
        WHEN p_period = interval '1 second' THEN p_limit || '/s'
        WHEN p_period = interval '1 minute' THEN p_limit || '/min'
        WHEN p_period = interval '1 hour' THEN p_limit || '/h'
        WHEN p_period = interval '1 day' THEN p_limit || '/d'
        ELSE p_limit || '/' || extract(epoch FROM p_period)::bigint || 's'
    END;
$$;

-- lane_window_starts: lane p_lane_id's starts after p_since, wherever they are kept (lane_starts, or
-- the counters row's pending_starts: cost 1, consecutive seqs ending at last_seq).
CREATE OR REPLACE FUNCTION pglane.lane_window_starts(p_lane_id integer, p_since timestamptz,
                                                     OUT started_at timestamptz, OUT seq bigint, OUT cost integer)
RETURNS SETOF record
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT s.started_at, s.seq, s.cost FROM pglane.lane_starts s
     WHERE s.lane_id = p_lane_id AND s.started_at > p_since
    UNION ALL
    SELECT p.at, c.last_seq - cardinality(c.pending_starts) + p.i, 1
      FROM pglane.lane_counters c, unnest(c.pending_starts) WITH ORDINALITY p(at, i)
     WHERE c.lane_id = p_lane_id AND p.at > p_since;
$$;

-- rate_wait: when a start of cost p_cost fits a lane's window (whose use is p_window at p_now) again
-- after p_ahead other starts, each assumed to cost p_cost too. The claim gives each slot its own
-- p_ahead (rate_turn), so that the workers of a limited lane wake at different openings, one
-- claim each, not all at the first. Reads the window's starts only; writes nothing.
CREATE OR REPLACE FUNCTION pglane.rate_wait(p_lane_id integer, p_limit integer, p_period interval,
                                            p_window bigint, p_cost integer, p_ahead integer,
                                            p_now timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH need AS (SELECT p_window + (p_ahead + 1)::bigint * p_cost - p_limit AS units),
         live AS (SELECT s.started_at, sum(s.cost) OVER (ORDER BY s.started_at, s.seq) AS freed
                    FROM pglane.lane_window_starts(p_lane_id, p_now - p_period) s)
    SELECT coalesce((SELECT live.started_at FROM live, need WHERE live.freed >= need.units
                      ORDER BY live.started_at LIMIT 1),
                    (SELECT max(live.started_at) FROM live), p_now) + p_period;
$$;

-- rate_turn: the seconds until slot p_slot's turn to start a job of cost p_cost on limited lane p_lane,
-- whose window's use is p_window at p_at, p_seq the lane's last start. The slot waits for the start
-- numbered like itself (seq counts starts), so that the lane's idle workers wake at successive
-- openings, not all at the first.
CREATE OR REPLACE FUNCTION pglane.rate_turn(p_lane pglane.lanes, p_window bigint, p_cost integer, p_slot integer,
                                            p_seq bigint, p_at timestamptz) RETURNS double precision
LANGUAGE sql AS $$
    SELECT greatest(0, extract(epoch FROM pglane.rate_wait(
               p_lane.id, p_lane.rate_limit, p_lane.rate_period, p_window, p_cost,
               (((p_slot - 1 - p_seq) % p_lane.slots + p_lane.slots) % p_lane.slots)::integer, p_at)
           - clock_timestamp()))::double precision;
$$;

-- rate_admission: the claim's rate policy, before it picks a job: may a start fit the window? Read
-- without a lock and without a write: a refused start writes nothing, not even a row lock. A start
-- costs the head job's cost (a weighted lane's: queue_head, claim.sql; any other's jobs all cost 1).
-- p_window and p_last_seq are the counters row as the claim's first statement saw it, unlocked: its
-- window_cost can only overstate the window's use at p_at by the starts that left it since the last
-- slow start (rows of lane_starts or pending starts: summed here only when the counter alone leaves no
-- room), and understate it by the starts committed since, which only add to it: a refusal made from
-- it is right. A yes is checked again, exactly, under the lock (rate_start). No with nothing eligible
-- is no wait at all: the rate holds nothing back. Else wait_seconds says when this slot's turn comes
-- (rate_turn).
CREATE OR REPLACE FUNCTION pglane.rate_admission(p_lane pglane.lanes, p_window bigint, p_last_seq bigint,
    p_slot integer, OUT admit boolean, OUT wait_seconds double precision, OUT wait_reason text)
LANGUAGE plpgsql AS $$
DECLARE
    v_cost integer := 1;
    v_at   timestamptz := clock_timestamp();
BEGIN
    IF p_lane.weighted THEN
        SELECT h.cost INTO v_cost FROM pglane.queue_head(p_lane.name, p_lane.rate_limit) h;
        IF v_cost IS NULL THEN  -- nothing eligible
            admit := false;
            RETURN;
        END IF;
    END IF;
    admit := p_window + v_cost <= p_lane.rate_limit;
    IF NOT admit THEN  -- the counter and the expired starts read in one statement: one snapshot
        SELECT c.window_cost - coalesce((SELECT sum(s.cost) FROM pglane.lane_starts s
                                          WHERE s.lane_id = c.lane_id AND s.started_at > '-infinity'
                                            AND s.started_at <= (SELECT v_at - p_lane.rate_period)), 0)  -- rate_start
                            - (SELECT count(*) FROM unnest(c.pending_starts) p(at) WHERE p.at <= v_at - p_lane.rate_period),
               c.last_seq
          INTO p_window, p_last_seq FROM pglane.lane_counters c WHERE c.lane_id = p_lane.id;
        admit := p_window + v_cost <= p_lane.rate_limit;
        IF NOT admit AND (p_lane.weighted OR EXISTS (SELECT FROM pglane.queue_head(p_lane.name, p_lane.rate_limit))) THEN
            wait_reason := 'rate';
            wait_seconds := pglane.rate_turn(p_lane, p_window, v_cost, p_slot, p_last_seq, v_at);
        END IF;
    END IF;
END $$;

-- rate_start: a start of cost p_cost on limited lane p_lane, its job picked (and locked), recorded or
-- refused: exact, under the counters row lock, which every claim of the lane takes, on the database
-- clock read after it (`at`: no start can commit before it now). The counters row is written once,
-- by take, with the seq it bumps: window_change and pending_starts (the row's new list) are its.
--
-- The fast path: a start of cost 1 for which the counter leaves room, for it and one more like it
-- (the counter can only overstate the window's use: it still counts the starts that left the window
-- since the last slow start), is appended to the counters row's pending_starts: no row of lane_starts
-- written, none deleted, and no turn to tell (the next start fits too). At most 31 starts are pending:
-- the 32nd, and every start the fast path cannot take, is a slow start.
--
-- A slow start: the pending starts become rows of lane_starts (consecutive seqs ending at the locked
-- last_seq), then the rows that left the window go (deleted, and taken off the counter: by take, or
-- here if the start is refused after all), so the counter is the window's use. A start that fits is a
-- row of lane_starts, with the seq that take gives it (the one after the locked last_seq); if a start
-- like it would not fit after it, wait_seconds already says when this slot's next turn comes, and the
-- worker stores this job's outcome without claiming again too soon. A start refused here leaves its
-- job untouched, unlocked at commit.
CREATE OR REPLACE FUNCTION pglane.rate_start(p_lane pglane.lanes, p_cost integer, p_slot integer,
    OUT admit boolean, OUT at timestamptz, OUT window_change bigint, OUT pending_starts timestamptz[],
    OUT wait_seconds double precision, OUT wait_reason text)
LANGUAGE plpgsql AS $$
DECLARE
    v_seq     bigint;  -- this start's seq
    v_window  bigint;  -- the cost started in the window ending at `at`, this start left out
    v_expired bigint;  -- the cost of the starts that left the window, deleted now
BEGIN
    SELECT c.last_seq + 1, c.window_cost, c.pending_starts INTO v_seq, v_window, pending_starts
      FROM pglane.lane_counters c WHERE c.lane_id = p_lane.id FOR UPDATE;
    at := clock_timestamp();
    IF p_cost = 1 AND v_window + 2 <= p_lane.rate_limit AND cardinality(pending_starts) < 31 THEN  -- fast
        admit := true;
        window_change := 1;
        pending_starts := pending_starts || at;
        RETURN;
    END IF;
    IF pending_starts <> '{}' THEN
        INSERT INTO pglane.lane_starts (lane_id, seq, started_at, cost)
        SELECT p_lane.id, v_seq - 1 - cardinality(pending_starts) + p.i, p.at, 1
          FROM unnest(pending_starts) WITH ORDINALITY p(at, i);
        pending_starts := '{}';
    END IF;
    -- The cut is a subquery's value, which the planner cannot see: the plan is made once, not at every
    -- start (a custom plan would also look up the index's end, past the rows deleted before). Bounded
    -- on both sides, an unseen range is planned as a narrow one: an index scan, whatever the table holds.
    WITH gone AS (DELETE FROM pglane.lane_starts s
                   WHERE s.lane_id = p_lane.id AND s.started_at > '-infinity'
                     AND s.started_at <= (SELECT at - p_lane.rate_period)
                  RETURNING s.cost)
    SELECT coalesce(sum(gone.cost), 0) INTO v_expired FROM gone;
    v_window := v_window - v_expired;
    admit := v_window + p_cost <= p_lane.rate_limit;
    IF NOT admit THEN  -- the row as take would have left it, the start left out (if anything changed)
        UPDATE pglane.lane_counters c SET window_cost = c.window_cost - v_expired, pending_starts = '{}'
         WHERE c.lane_id = p_lane.id AND (v_expired > 0 OR c.pending_starts <> '{}');
        wait_reason := 'rate';
        wait_seconds := pglane.rate_turn(p_lane, v_window, p_cost, p_slot, v_seq - 1, at);
        RETURN;
    END IF;
    INSERT INTO pglane.lane_starts (lane_id, seq, started_at, cost) VALUES (p_lane.id, v_seq, at, p_cost);
    window_change := p_cost - v_expired;
    IF v_window + 2 * p_cost > p_lane.rate_limit THEN
        wait_reason := 'rate';
        wait_seconds := pglane.rate_turn(p_lane, v_window + p_cost, p_cost, p_slot, v_seq, at);
    END IF;
END $$;

-- rate_window_use: the cost lane p_lane started in the window ending now; NULL if it has no rate limit.
-- Definer: workers (their metrics) and producers read it without reading lane_starts.
CREATE OR REPLACE FUNCTION pglane.rate_window_use(p_lane text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT (SELECT coalesce(sum(s.cost), 0) FROM pglane.lane_window_starts(l.id, now() - l.rate_period) s)
      FROM pglane.lanes l WHERE l.name = p_lane AND l.rate_limit IS NOT NULL;
$$;

-- rate_next_start: when lane p_lane may start a job of cost 1 again; NULL if it may now, or is not
-- limited. For the operator's views: the claim decides with the exact cost and under the lock.
CREATE OR REPLACE FUNCTION pglane.rate_next_start(p_lane text) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN u.used + 1 > l.rate_limit
                THEN pglane.rate_wait(l.id, l.rate_limit, l.rate_period, u.used, 1, 0, now())
           END
      FROM pglane.lanes l
      CROSS JOIN LATERAL (SELECT pglane.rate_window_use(l.name) AS used) u
     WHERE l.name = p_lane AND l.rate_limit IS NOT NULL;
$$;

-- set_lane: change lane p_lane's settings while its workers run; effective at each setting's next use
-- (the next claim for slots, rate and takeover; each new attempt for the timeouts: a running attempt
-- keeps the lease it was given). p_settings names what changes: slots, job_timeout, lease_timeout
-- (seconds, or an interval such as '10 minutes'), max_attempts, max_queued (null: unbounded),
-- rate ('10/s', null or 'none': unlimited), takeover, waiting_grace, retry_backoff, max_payload_bytes,
-- max_result_bytes, key_retention (how long a pruned job's key is remembered). Validated as lane create is (the lanes CHECKs, R1 among them); a lowered rate is
-- refused while a queued job costs more than it allows (that job could never start). Returns what
-- changed and what it means for running workers. Nothing changes when anything is refused.
CREATE OR REPLACE FUNCTION pglane.set_lane(p_lane text, p_settings jsonb) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_old    pglane.lanes;
    v_new    pglane.lanes;
    v_key    text;
    v_rate   record;
    v_cost   integer;
    v_note   text := '';
    v_over   text;
BEGIN
    -- FOR NO KEY UPDATE: a producer's insert holds FOR KEY SHARE on its lane's row (the foreign key's
    -- check, and jobs_before_insert) until it commits; a change of settings need not wait for it. A
    -- lowered rate must (below).
    SELECT * INTO v_old FROM pglane.lanes l WHERE l.name = p_lane FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'list the lanes with: pglane status';
    END IF;
    IF p_settings IS NULL OR jsonb_typeof(p_settings) <> 'object' OR p_settings = '{}' THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = 'no settings to change',
            HINT = 'give an object of settings, e.g. {"slots": 3, "rate": "60/min"}';
    END IF;
    FOR v_key IN SELECT jsonb_object_keys(p_settings) LOOP
        IF v_key NOT IN ('slots', 'job_timeout', 'lease_timeout', 'max_attempts', 'max_queued', 'rate', 'takeover',
                         'waiting_grace', 'retry_backoff', 'max_payload_bytes', 'max_result_bytes',
                         'key_retention') THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('unknown lane setting %L', v_key),
                HINT = 'settings: slots, job_timeout, lease_timeout, max_attempts, max_queued, rate, takeover, '
                       'waiting_grace, retry_backoff, max_payload_bytes, max_result_bytes, key_retention';
        END IF;
        IF jsonb_typeof(p_settings -> v_key) = 'null' AND v_key NOT IN ('max_queued', 'rate') THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('lane setting %s cannot be removed', v_key),
                HINT = 'give it a value; only max_queued and rate can be none';
        END IF;
    END LOOP;
    v_new := v_old;
    BEGIN
        v_new.slots := coalesce((p_settings ->> 'slots')::integer, v_old.slots);
        v_new.max_attempts := coalesce((p_settings ->> 'max_attempts')::integer, v_old.max_attempts);
        v_new.max_payload_bytes := coalesce((p_settings ->> 'max_payload_bytes')::integer, v_old.max_payload_bytes);
        v_new.max_result_bytes := coalesce((p_settings ->> 'max_result_bytes')::integer, v_old.max_result_bytes);
        v_new.job_timeout := coalesce((p_settings ->> 'job_timeout')::interval, v_old.job_timeout);
        v_new.lease_timeout := coalesce((p_settings ->> 'lease_timeout')::interval, v_old.lease_timeout);
        v_new.waiting_grace := coalesce((p_settings ->> 'waiting_grace')::interval, v_old.waiting_grace);
        v_new.retry_backoff := coalesce((p_settings ->> 'retry_backoff')::interval, v_old.retry_backoff);
        v_new.key_retention := coalesce((p_settings ->> 'key_retention')::interval, v_old.key_retention);
        IF p_settings ? 'max_queued' THEN
            v_new.max_queued := (p_settings ->> 'max_queued')::integer;
        END IF;
    EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range OR invalid_datetime_format
                   OR datetime_field_overflow OR interval_field_overflow THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('lane settings %s: %s', p_settings, SQLERRM),
            HINT = 'counts are whole numbers; timeouts are seconds or intervals such as ''10 minutes''';
    END;
    v_new.takeover := coalesce(replace(p_settings ->> 'takeover', '-', '_'), v_old.takeover);
    IF p_settings ? 'rate' THEN
        SELECT * INTO v_rate FROM pglane.parse_rate(coalesce(p_settings ->> 'rate', 'none'));
        v_new.rate_limit := v_rate.rate_limit;
        v_new.rate_period := v_rate.rate_period;
        -- Atomic with enqueues: FOR UPDATE waits for the producers whose inserts into this lane are
        -- not committed yet (their FOR KEY SHARE), and holds off later ones until this commits, when
        -- jobs_before_insert reads the new rate (its FOR KEY SHARE waits, then sees this row's new
        -- version). So the look at the queued costs below misses no job that the new rate refuses.
        IF v_new.rate_limit < coalesce(v_old.rate_limit, 2147483647) THEN
            PERFORM 1 FROM pglane.lanes l WHERE l.id = v_old.id FOR UPDATE;
        END IF;
        SELECT max(j.cost) INTO v_cost FROM pglane.jobs j WHERE j.lane = p_lane AND j.in_queue;
        IF v_new.rate_limit < v_cost THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL13',
                MESSAGE = format('rate %s is below the cost %s of a job queued on lane %s: it could never start',
                                 pglane.rate_text(v_new.rate_limit, v_new.rate_period), v_cost, p_lane),
                HINT = 'choose a rate of at least that many per period, or cancel the costly jobs first';
        END IF;
    END IF;
    IF v_new.slots < v_old.slots THEN  -- read before the change: slot_holders shows slots up to the lane's
        SELECT string_agg(format('slot %s (server session pid %s)', h.slot, h.pid), ', ' ORDER BY h.slot) INTO v_over
          FROM pglane.slot_holders h WHERE h.lane_id = v_old.id AND h.slot > v_new.slots AND h.granted;
        IF v_over IS NOT NULL THEN
            v_note := format('; the workers holding %s are above the new %s slot(s): each finishes the job it '
                             'runs, its next claim is refused, and it waits as a standby for a slot up to %s',
                             v_over, v_new.slots, v_new.slots);
        END IF;
    END IF;
    UPDATE pglane.lanes l
       SET slots = v_new.slots, job_timeout = v_new.job_timeout, lease_timeout = v_new.lease_timeout,
           max_attempts = v_new.max_attempts, max_queued = v_new.max_queued, rate_limit = v_new.rate_limit,
           rate_period = v_new.rate_period, takeover = v_new.takeover, waiting_grace = v_new.waiting_grace,
           retry_backoff = v_new.retry_backoff, max_payload_bytes = v_new.max_payload_bytes,
           max_result_bytes = v_new.max_result_bytes, key_retention = v_new.key_retention
     WHERE l.id = v_old.id;
    -- Wake the lane's workers: one sleeping until a rate allows a start may start sooner now.
    PERFORM pglane.notify('pglane_' || v_old.id, 'settings');
    RETURN format('lane %s changed: %s%s', p_lane, coalesce(
                  (SELECT string_agg(format('%s %s -> %s', k.key, k.old, k.new), ', ' ORDER BY k.key)
                     FROM jsonb_each_text(to_jsonb(v_old)) o(key, old)
                     JOIN jsonb_each_text(to_jsonb(v_new)) n(key, new) USING (key)
                     CROSS JOIN LATERAL (SELECT o.key, coalesce(o.old, 'none') AS old,
                                                coalesce(n.new, 'none') AS new) k
                    WHERE o.old IS DISTINCT FROM n.new), 'nothing (each setting already had that value)'),
                  v_note);
END $$;
