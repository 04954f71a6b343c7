-- Pauses: a lane that accepts jobs and starts none, until a moment or until a person resumes it.
-- docs/design.md#push-back-pauses-deferrals-and-the-breaker.
--
-- Three things pause a lane: a person (pause_lane, resume_lane), a handler's "not paid, try later"
-- on a lane whose on_retry_later is 'lane' (defer, jobs.sql), and the breaker, after
-- pause_after_failures failed attempts in a row (fail, jobs.sql). All three write the same two things:
-- - lane_counters.paused_until, the fact the claim obeys: the claim's take bumps the lane's seq only
--   WHERE the lane is not paused (claim.sql), under the counters row lock that every start of the
--   lane takes. A pause therefore holds from its commit for every slot, cluster-wide, on the database
--   clock: a claim that waited for the lock reads the new row (PostgreSQL re-checks an UPDATE's WHERE
--   on the newest version of a row it waited for), so no start of the lane follows a pause's commit
--   before paused_until. 'infinity': until a person resumes it. A pause ended by time needs no writer.
-- - lane_pauses, the record an operator reads (lane_status): since when, what, by whom, why, and
--   for the breaker which attempts. The latest pause of each lane; resume_lane says who ended it. Its
--   end is paused_until's alone (one fact, one place; lane_status shows 'infinity', which clients
--   cannot read as a date, as NULL: until resumed).
-- A pause never shortens another: the later end wins (a deferral during a person's pause leaves it).
-- Its start (lane_pauses.paused_at) is the moment it held the counters row: no start of the lane is
-- recorded from then until paused_until.
-- Calls in flight when a lane pauses finish normally; their outcomes are stored as usual.

-- pause_for: pause lane p_lane_id until p_until, or for p_for from the moment it holds the lane's
-- counters row (not before a pause already in force ends), recording p_kind ('person',
-- 'retry_later', 'breaker'), p_by, p_reason and p_attempts. The moment is read after the lock:
-- every start committed before it was recorded earlier (its take held the lock), none after it
-- starts before the end. No NOTIFY: a slot learns of the pause at its next claim, which answers with
-- the pause's end. Returns that end. Caller: pause_lane, defer and breaker_failure; called last in
-- their transactions (lock order: a job, then the counters row).
CREATE OR REPLACE FUNCTION pglane.pause_for(p_lane_id integer, p_until timestamptz, p_for interval, p_kind text,
                                            p_by text, p_reason text, p_attempts bigint[]) RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    v_at    timestamptz;
    v_was   timestamptz;
    v_until timestamptz;
BEGIN
    SELECT c.paused_until INTO v_was FROM pglane.lane_counters c WHERE c.lane_id = p_lane_id FOR UPDATE;
    v_at := clock_timestamp();
    v_until := coalesce(p_until, v_at + p_for);
    IF v_was > v_at AND v_was >= v_until THEN  -- a pause in force ends later: it stays, and its record
        RETURN v_was;
    END IF;
    UPDATE pglane.lane_counters c SET paused_until = v_until WHERE c.lane_id = p_lane_id;
    INSERT INTO pglane.lane_pauses AS p (lane_id, paused_at, kind, paused_by, reason, attempts)
    VALUES (p_lane_id, v_at, p_kind, p_by, left(p_reason, 1000), p_attempts)
    ON CONFLICT (lane_id) DO UPDATE
       SET paused_at = excluded.paused_at, kind = excluded.kind,
           paused_by = excluded.paused_by, reason = excluded.reason, attempts = excluded.attempts,
           resumed_at = NULL, resumed_by = NULL;
    RETURN v_until;
END $$;

-- pause_lane: a person pauses lane p_lane until p_until ('infinity', the default: until resumed), for
-- reason p_reason. The lane keeps accepting jobs; calls in flight finish. Returns what it did.
CREATE OR REPLACE FUNCTION pglane.pause_lane(p_lane text, p_until timestamptz DEFAULT 'infinity',
                                             p_reason text DEFAULT NULL) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane_id integer;
    v_until   timestamptz;
BEGIN
    SELECT l.id INTO v_lane_id FROM pglane.lanes l WHERE l.name = p_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'list the lanes with: pglane status';
    END IF;
    IF p_until IS NULL OR p_until <= now() THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL10',
            MESSAGE = format('a pause must end in the future, not at %s (now is %s)', coalesce(p_until::text, 'NULL'), now()),
            HINT = 'give --for DURATION (e.g. 10m), --until a later time, or neither to pause until resumed';
    END IF;
    v_until := pglane.pause_for(v_lane_id, p_until, NULL, 'person', pglane.caller(),
                                coalesce(nullif(btrim(p_reason), ''), 'paused by hand, no reason given'), NULL);
    RETURN format('lane %s paused %s: it accepts jobs and starts none; calls in flight finish; resume it with: '
                  'pglane lane resume %s', p_lane,
                  CASE WHEN v_until = 'infinity' THEN 'until resumed' ELSE 'until ' || v_until END, p_lane);
END $$;

-- resume_lane: end lane p_lane's pause now (whatever paused it; the breaker's count starts again) and
-- wake its workers. Returns what it did; resuming a lane that is not paused changes nothing.
CREATE OR REPLACE FUNCTION pglane.resume_lane(p_lane text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane_id integer;
    v_was     timestamptz;
BEGIN
    SELECT l.id INTO v_lane_id FROM pglane.lanes l WHERE l.name = p_lane;
    IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PGL01', MESSAGE = format('unknown lane %L', p_lane),
            HINT = 'list the lanes with: pglane status';
    END IF;
    SELECT c.paused_until INTO v_was FROM pglane.lane_counters c WHERE c.lane_id = v_lane_id FOR UPDATE;
    IF v_was IS NULL OR v_was <= now() THEN
        RETURN format('lane %s is not paused: nothing changed', p_lane);
    END IF;
    UPDATE pglane.lane_counters c SET paused_until = NULL, failures_in_row = 0, failed_attempts = NULL
     WHERE c.lane_id = v_lane_id;
    UPDATE pglane.lane_pauses p SET resumed_at = now(), resumed_by = pglane.caller() WHERE p.lane_id = v_lane_id;
    PERFORM pglane.notify('pglane_' || v_lane_id, 'settings');  -- news: slots asleep until the pause's end wake
    RETURN format('lane %s resumed: its workers start jobs again', p_lane);
END $$;

-- pause_wait: the claim's answer when take found lane p_lane_id paused: wait_seconds until the pause
-- ends (NULL when it lasts until a person resumes it), wait_reason 'paused'. Read after the refused
-- take, under the counters row lock the claim already holds or waited for.
CREATE OR REPLACE FUNCTION pglane.pause_wait(p_lane_id integer, OUT wait_seconds double precision,
                                             OUT wait_reason text)
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN c.paused_until = 'infinity' THEN NULL
                ELSE greatest(extract(epoch FROM c.paused_until - now()), 0)::double precision END, 'paused'
      FROM pglane.lane_counters c WHERE c.lane_id = p_lane_id;
$$;

-- pause_note: what lane_status and job_status say of a paused lane: until when, what paused it, by
-- whom and why, and how to resume it.
CREATE OR REPLACE FUNCTION pglane.pause_note(p_lane text, p_until timestamptz, p_kind text, p_by text,
                                             p_reason text, p_attempts bigint[]) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT format('paused %s %s: %s%s; it accepts jobs and starts none; resume it now with: pglane lane resume %s',
                  CASE WHEN p_until IS NULL OR p_until = 'infinity' THEN 'until resumed' ELSE 'until ' || p_until END,
                  CASE p_kind WHEN 'breaker' THEN 'by the breaker'
                              WHEN 'retry_later' THEN 'by a handler''s RetryLater (on_retry_later lane)'
                              ELSE 'by ' || coalesce(p_by, 'a person') END,
                  coalesce(p_reason, 'no reason given'),
                  CASE WHEN p_attempts IS NOT NULL THEN format(' (attempts %s)', array_to_string(p_attempts, ', ')) ELSE '' END,
                  p_lane);
$$;

-- The breaker (lanes.pause_after_failures, K): after K failed attempts in a row on a lane (failed or
-- timed out: calls that may have been paid; not deferrals, not cancellations, not lost attempts,
-- which recovery explains), the lane pauses until a person resumes it, saying why and which attempts.
-- The count is lane_counters.failures_in_row and the attempts failed_attempts (the last K); a success
-- (complete), a resume or a change of the lane's breaker sets it back to none. A lane without a
-- breaker never counts, and its completions never look (complete_impl reads the setting in the
-- UPDATE it makes anyway).

-- breaker_failure: attempt p_attempt_id of lane p_lane failed with p_error (fail, jobs.sql).
CREATE OR REPLACE FUNCTION pglane.breaker_failure(p_lane text, p_attempt_id bigint, p_error text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_lane pglane.lanes;
    v_run  record;
BEGIN
    SELECT * INTO v_lane FROM pglane.lanes l WHERE l.name = p_lane;
    IF v_lane.pause_after_failures IS NULL THEN
        RETURN;
    END IF;
    UPDATE pglane.lane_counters c
       SET failures_in_row = c.failures_in_row + 1,
           failed_attempts = (coalesce(c.failed_attempts, '{}') || p_attempt_id)[greatest(1, cardinality(c.failed_attempts) + 2 - v_lane.pause_after_failures):]
     WHERE c.lane_id = v_lane.id
    RETURNING c.failures_in_row, c.failed_attempts, c.paused_until INTO v_run;
    IF v_run.failures_in_row >= v_lane.pause_after_failures AND NOT coalesce(v_run.paused_until = 'infinity', false) THEN
        PERFORM pglane.pause_for(v_lane.id, 'infinity', NULL, 'breaker', pglane.caller(),
                                 format('%s failed attempts in a row (--pause-after-failures %s); the last: %s',
                                        v_run.failures_in_row, v_lane.pause_after_failures, left(p_error, 500)),
                                 v_run.failed_attempts);
    END IF;
END $$;

-- breaker_success: an attempt of lane p_lane succeeded (complete, jobs.sql): a run of failures ends.
-- One probe of the lane's counters row; written only when a run was counted.
CREATE OR REPLACE FUNCTION pglane.breaker_success(p_lane text) RETURNS void
LANGUAGE sql AS $$
    UPDATE pglane.lane_counters c SET failures_in_row = 0, failed_attempts = NULL
      FROM pglane.lanes l
     WHERE l.name = p_lane AND c.lane_id = l.id AND c.failures_in_row > 0;
$$;
