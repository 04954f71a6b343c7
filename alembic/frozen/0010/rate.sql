-- Rate limits. A lane with rate_limit N and rate_period P starts at most N units of cost (jobs.cost,
-- 1 by default) in any window of length P, cluster-wide: the claim counts, on the database clock,
-- under the lane's counters row lock (rate_start). Each start is a row of lane_starts, but for the
-- latest starts of rate_start's fast path, kept in the counters row (lane_counters.pending_starts, cost
-- 1 each, at most 31) until the next slow start moves them; each slow start also deletes the rows that
-- left the window, so the table holds the window and little more. lane_counters.window_cost is the sum
-- of both (rate_start and take keep it so; lane_window_starts reads both places).
--
-- A lane's rate is set with set_lane (lanes.sql: refused below the cost of a job it holds queued); an
-- enqueue of a job that costs more than its lane's rate is refused (jobs_before_insert, jobs.sql), and
-- the claim passes such a job over (pick, claim.sql).

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

-- lanes_next_start: {lane: rate_next_start(lane)} for the rate-limited lanes (null: it may start now).
-- One of job_status's lane maps, read once per statement (views.sql).
CREATE OR REPLACE FUNCTION pglane.lanes_next_start() RETURNS jsonb
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT jsonb_object_agg(l.name, pglane.rate_next_start(l.name)) FROM pglane.lanes l WHERE l.rate_limit IS NOT NULL;
$$;
