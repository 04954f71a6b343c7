-- Lanes: what every other capability hangs off. A lane's own rows (its counters and admissions rows,
-- made with it; its recorded starts and remembered keys, gone with it), what may change about it (its
-- settings, through set_lane; never its name nor its id: the jobs' foreign key and the lock keys) and
-- how its workers are woken (notify, notify_lane). What a setting turns on lives in its own file:
-- slots.sql (slots), queue_bound.sql (max_queued), rate.sql (rate), strict.sql (takeover after_lease).

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

-- notify_lane: wake the lane's listening workers. The channel is derived from the lane's id, never
-- from its name; the payload is empty (no job data). Identical notifications in one transaction fold
-- into one, so a transaction wakes each lane at most once.
CREATE OR REPLACE FUNCTION pglane.notify_lane(p_lane_id integer) RETURNS void
LANGUAGE sql AS $$
    SELECT pglane.notify('pglane_' || p_lane_id, '');
$$;

-- lanes_after_insert: every lane gets its counters and admissions rows in the same transaction, so
-- claim() and the bound check can rely on them existing. A NOTIFY on pglane_lanes, one channel for the
-- whole schema, tells the workers that serve lanes by pattern (pglane worker --lanes-like) to read the
-- lane list again; its payload is empty, and a worker trusts none (any login may NOTIFY that channel).
CREATE OR REPLACE FUNCTION pglane.lanes_after_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    INSERT INTO pglane.lane_counters (lane_id) VALUES (NEW.id);
    INSERT INTO pglane.lane_admissions (lane_id) VALUES (NEW.id);
    PERFORM pglane.notify('pglane_lanes', '');
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
-- check would lock the lane's row at every start of a rate-limited lane). The pattern workers are told
-- on pglane_lanes, as at insert.
CREATE OR REPLACE FUNCTION pglane.lanes_after_delete() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    DELETE FROM pglane.lane_starts s WHERE s.lane_id = OLD.id;
    DELETE FROM pglane.pruned_keys k WHERE k.lane = OLD.name;  -- a lane made again starts with no keys
    PERFORM pglane.notify('pglane_lanes', '');
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS lanes_after_delete ON pglane.lanes;
CREATE TRIGGER lanes_after_delete AFTER DELETE ON pglane.lanes
    FOR EACH ROW EXECUTE FUNCTION pglane.lanes_after_delete();

-- lane_with: lane p_old with p_settings applied (set_lane's names and forms, below), validated as to
-- its keys and the form of each value; the lanes CHECKs validate the values when the row is written.
CREATE OR REPLACE FUNCTION pglane.lane_with(p_old pglane.lanes, p_settings jsonb) RETURNS pglane.lanes
LANGUAGE plpgsql AS $$
DECLARE
    v_new  pglane.lanes := p_old;
    v_key  text;
    v_rate record;
    v_keys CONSTANT text[] := ARRAY['slots', 'job_timeout', 'lease_timeout', 'max_attempts', 'max_queued', 'rate',
                                    'takeover', 'waiting_grace', 'retry_backoff', 'max_payload_bytes',
                                    'max_result_bytes', 'key_retention', 'group_slots', 'max_deferrals',
                                    'on_retry_later', 'pause_after_failures'];
    v_removable CONSTANT text[] := ARRAY['max_queued', 'rate', 'group_slots', 'pause_after_failures'];
BEGIN
    IF p_settings IS NULL OR jsonb_typeof(p_settings) <> 'object' OR p_settings = '{}' THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = 'no settings to change',
            HINT = 'give an object of settings, e.g. {"slots": 3, "rate": "60/min"}';
    END IF;
    FOR v_key IN SELECT jsonb_object_keys(p_settings) LOOP
        IF v_key <> ALL (v_keys) THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('unknown lane setting %L', v_key),
                HINT = 'settings: ' || array_to_string(v_keys, ', ');
        END IF;
        IF jsonb_typeof(p_settings -> v_key) = 'null' AND v_key <> ALL (v_removable) THEN
            RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('lane setting %s cannot be removed', v_key),
                HINT = 'give it a value; only ' || array_to_string(v_removable, ', ') || ' can be none';
        END IF;
    END LOOP;
    BEGIN
        v_new.slots := coalesce((p_settings ->> 'slots')::integer, p_old.slots);
        v_new.max_attempts := coalesce((p_settings ->> 'max_attempts')::integer, p_old.max_attempts);
        v_new.max_payload_bytes := coalesce((p_settings ->> 'max_payload_bytes')::integer, p_old.max_payload_bytes);
        v_new.max_result_bytes := coalesce((p_settings ->> 'max_result_bytes')::integer, p_old.max_result_bytes);
        v_new.job_timeout := coalesce((p_settings ->> 'job_timeout')::interval, p_old.job_timeout);
        v_new.lease_timeout := coalesce((p_settings ->> 'lease_timeout')::interval, p_old.lease_timeout);
        v_new.waiting_grace := coalesce((p_settings ->> 'waiting_grace')::interval, p_old.waiting_grace);
        v_new.retry_backoff := coalesce((p_settings ->> 'retry_backoff')::interval, p_old.retry_backoff);
        v_new.key_retention := coalesce((p_settings ->> 'key_retention')::interval, p_old.key_retention);
        IF p_settings ? 'max_queued' THEN
            v_new.max_queued := (p_settings ->> 'max_queued')::integer;
        END IF;
        IF p_settings ? 'group_slots' THEN
            v_new.group_slots := (p_settings ->> 'group_slots')::integer;
        END IF;
        v_new.max_deferrals := coalesce((p_settings ->> 'max_deferrals')::integer, p_old.max_deferrals);
        IF p_settings ? 'pause_after_failures' THEN
            v_new.pause_after_failures := (p_settings ->> 'pause_after_failures')::integer;
        END IF;
    EXCEPTION WHEN invalid_text_representation OR numeric_value_out_of_range OR invalid_datetime_format
                   OR datetime_field_overflow OR interval_field_overflow THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10', MESSAGE = format('lane settings %s: %s', p_settings, SQLERRM),
            HINT = 'counts are whole numbers; timeouts are seconds or intervals such as ''10 minutes''';
    END;
    v_new.takeover := coalesce(replace(p_settings ->> 'takeover', '-', '_'), p_old.takeover);
    v_new.on_retry_later := coalesce(p_settings ->> 'on_retry_later', p_old.on_retry_later);
    IF p_settings ? 'rate' THEN
        SELECT * INTO v_rate FROM pglane.parse_rate(coalesce(p_settings ->> 'rate', 'none'));
        v_new.rate_limit := v_rate.rate_limit;
        v_new.rate_period := v_rate.rate_period;
    END IF;
    RETURN v_new;
END $$;

-- set_lane: change lane p_lane's settings while its workers run; effective at each setting's next use
-- (the next claim for slots, rate, takeover and group_slots; each new attempt for the timeouts: a
-- running attempt keeps the lease it was given). p_settings names what changes: slots, job_timeout,
-- lease_timeout (seconds, or an interval such as '10 minutes'), max_attempts, max_queued (null:
-- unbounded), rate ('10/s', null or 'none': unlimited), takeover, waiting_grace, retry_backoff,
-- max_payload_bytes, max_result_bytes, key_retention (how long a pruned job's key is remembered),
-- group_slots (null: no limit per group), max_deferrals, on_retry_later ('job' or 'lane'),
-- pause_after_failures (null: no breaker; pause.sql). Validated as lane create is (the lanes CHECKs, R1 among
-- them); a lowered rate is refused while a queued job costs more than it allows (that job could never
-- start). Returns what changed and what it means for running workers. Nothing changes when anything
-- is refused.
CREATE OR REPLACE FUNCTION pglane.set_lane(p_lane text, p_settings jsonb) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_old    pglane.lanes;
    v_new    pglane.lanes;
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
    v_new := pglane.lane_with(v_old, p_settings);
    IF p_settings ? 'rate' THEN
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
           max_result_bytes = v_new.max_result_bytes, key_retention = v_new.key_retention,
           group_slots = v_new.group_slots, max_deferrals = v_new.max_deferrals,
           on_retry_later = v_new.on_retry_later, pause_after_failures = v_new.pause_after_failures
     WHERE l.id = v_old.id;
    IF v_new.pause_after_failures IS DISTINCT FROM v_old.pause_after_failures THEN  -- a new breaker counts anew
        UPDATE pglane.lane_counters c SET failures_in_row = 0, failed_attempts = NULL WHERE c.lane_id = v_old.id;
    END IF;
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
