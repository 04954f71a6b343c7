-- Views for operators: the state of every lane and job, and the next safe action, from one query.
-- Everything is computed from the database clock (now()), never a worker's.
-- Each capability gives the views its own facts (slots.sql, strict.sql, rate.sql, tallies.sql); they
-- are put together here. CREATE OR REPLACE keeps a view's grants (roles.sql) when a later revision
-- re-applies this file; a change to a view's columns other than adding one at the end needs its own
-- DROP in that revision.

-- first_id_since: the first id of pglane.attempts (p_attempts) or pglane.jobs whose row began at or
-- after p_at (an attempt's started_at, a job's created_at), found by bisecting the primary key: about
-- 2 log2(rows) index probes, whatever the history. Ids are handed out in the order rows are inserted,
-- and a row's time is its transaction's start, so the times follow the ids but for transactions that
-- overlap; callers search from a little earlier than they need and filter on the time itself. NULL for
-- an empty table.
CREATE OR REPLACE FUNCTION pglane.first_id_since(p_attempts boolean, p_at timestamptz) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lo  bigint;   -- every row below v_lo began before p_at
    v_hi  bigint;   -- the row at or after v_hi (the first existing one) begins at or after p_at, or none is left
    v_mid bigint;
    v_id  bigint;
    v_at  timestamptz;
BEGIN
    IF p_attempts THEN
        SELECT min(a.id), max(a.id) + 1 INTO v_lo, v_hi FROM pglane.attempts a;
    ELSE
        SELECT min(j.id), max(j.id) + 1 INTO v_lo, v_hi FROM pglane.jobs j;
    END IF;
    WHILE v_lo < v_hi LOOP
        v_mid := v_lo + (v_hi - v_lo) / 2;
        IF p_attempts THEN
            SELECT a.id, a.started_at INTO v_id, v_at FROM pglane.attempts a WHERE a.id >= v_mid ORDER BY a.id LIMIT 1;
        ELSE
            SELECT j.id, j.created_at INTO v_id, v_at FROM pglane.jobs j WHERE j.id >= v_mid ORDER BY j.id LIMIT 1;
        END IF;
        IF NOT FOUND OR v_at >= p_at THEN
            v_hi := v_mid;
        ELSE
            v_lo := v_id + 1;
        END IF;
    END LOOP;
    RETURN v_lo;
END $$;

-- lane_flow: how many of lane p_lane's jobs arrived in the last 5 minutes, and how many left its
-- queue (started, or cancelled while queued) -- the two sides of a backlog -- without reading older
-- history and without an index kept on the claim/complete path for it: arrivals and starts are read
-- by primary key from the first job and the first attempt of the last 5 minutes (first_id_since, from
-- 30 s earlier), cancels through jobs_failed_or_cancelled (lane, id), latest first. A retried job's
-- new start counts again. Bounded (#31 point 7): it reads at most 5,000 jobs, 5,000 attempts (each
-- with its job) and the lane's 1,000 latest failed or cancelled jobs, whatever the traffic and the
-- history (the last, a read of scattered rows, is the one that follows the history). When more
-- jobs or attempts than that (of all lanes) began in the last 5 minutes, it counts both sides over
-- the shorter latest period that the last 5,000 of each cover (from the later of their first rows'
-- times): fewer than 5 minutes' worth, but the same period for both, so that which side is larger --
-- what the advice reads -- is still told. A cancel is missed when the lane holds 1,000 failed or
-- cancelled jobs of higher id. lane_status asks for it only when it may advise on a growing backlog.
CREATE OR REPLACE FUNCTION pglane.lane_flow(p_lane text, OUT arrived_5m bigint, OUT left_5m bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    c_rows    constant integer := 5000;  -- jobs, and attempts
    c_ended   constant integer := 1000;  -- the lane's failed and cancelled jobs
    v_since   timestamptz := now() - interval '5 minutes';
    v_job     bigint := pglane.first_id_since(false, now() - interval '5 minutes 30 seconds');
    v_attempt bigint := pglane.first_id_since(true, now() - interval '5 minutes 30 seconds');
    v_last    bigint;
    v_at      timestamptz;
BEGIN
    SELECT max(j.id) INTO v_last FROM pglane.jobs j;
    IF v_last - v_job >= c_rows THEN  -- busy: the last c_rows jobs, from the first one's time
        v_job := v_last - c_rows + 1;
        SELECT j.created_at INTO v_at FROM pglane.jobs j WHERE j.id >= v_job ORDER BY j.id LIMIT 1;
        v_since := greatest(v_since, v_at);
    END IF;
    SELECT max(a.id) INTO v_last FROM pglane.attempts a;
    IF v_last - v_attempt >= c_rows THEN
        v_attempt := v_last - c_rows + 1;
        SELECT a.started_at INTO v_at FROM pglane.attempts a WHERE a.id >= v_attempt ORDER BY a.id LIMIT 1;
        v_since := greatest(v_since, v_at);
    END IF;
    -- ORDER BY id LIMIT: read by primary key from the first id, at most c_rows rows, whatever the plan.
    SELECT count(*) INTO arrived_5m
      FROM (SELECT j.lane, j.created_at FROM pglane.jobs j WHERE j.id >= v_job ORDER BY j.id LIMIT c_rows) j
     WHERE j.lane = p_lane AND j.created_at >= v_since;
    SELECT count(*) INTO left_5m
      FROM (SELECT a.job_id FROM pglane.attempts a WHERE a.id >= v_attempt AND a.started_at >= v_since
             ORDER BY a.id LIMIT c_rows) a
      JOIN pglane.jobs j ON j.id = a.job_id
     WHERE j.lane = p_lane;
    left_5m := left_5m + (SELECT count(*)
                            FROM (SELECT j.status, j.finished_at FROM pglane.jobs j
                                   WHERE j.lane = p_lane AND j.failed_or_cancelled ORDER BY j.id DESC LIMIT c_ended) c
                           WHERE c.status = 'cancelled' AND c.finished_at >= v_since);
END $$;

-- lane_queue: lane p_lane's queue, read through the queue index: how many jobs are queued, how many
-- of them may run now (eligible), and the oldest of each. A function of its own so that it is planned
-- for the lane it is given: a lane's few queued jobs are read through the index even where another
-- lane holds most of the queue (a plan made for any lane reads the whole table; #30). Definer: it
-- reads jobs as lane_status does.
CREATE OR REPLACE FUNCTION pglane.lane_queue(p_lane text, OUT queued bigint, OUT eligible bigint,
                                             OUT oldest_queued timestamptz, OUT oldest_eligible timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT count(*), count(*) FILTER (WHERE j.run_after <= now()), min(j.created_at),
           min(greatest(j.created_at, j.run_after)) FILTER (WHERE j.run_after <= now())
      FROM pglane.jobs j WHERE j.lane = p_lane AND j.in_queue;
$$;

-- lane_status: every count of a lane without reading its history: queued and eligible through the
-- queue index, running through the running attempts, done, failed and cancelled from the tallies
-- (tallies.sql), the last 5 minutes' flow (lane_flow, bounded) only for a lane whose eligible jobs wait past
-- the grace. It costs the lanes, the backlog and the running attempts, never the finished jobs.
-- Lane by lane (#30): each lane's counts and functions are LATERAL to its row of pglane.lanes, so a
-- condition on `lane` (WHERE lane = ANY(...), as the operator's page asks for its fifty) selects the
-- lanes first and only theirs are computed: a page costs its lanes, not every lane. The running
-- attempts and the slot locks, bounded by the workers, are grouped once for all lanes. The per-lane
-- function calls sit in OFFSET 0 subqueries so that each runs once per lane, however often the
-- columns they give are read below (next_safe_action reads several twice).
CREATE OR REPLACE VIEW pglane.lane_status AS
WITH running AS (
    SELECT j.lane, count(*) AS running
      FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id
     WHERE a.status = 'running' AND j.status = 'running'
     GROUP BY j.lane
), attempts_now AS (
    SELECT ra.lane, count(*) FILTER (WHERE NOT ra.alive) AS orphaned,
           count(*) FILTER (WHERE ra.alive AND ra.past_lease) AS stuck
      FROM pglane.running_attempts ra
     GROUP BY ra.lane
), holders AS (
    SELECT ss.lane_id,
           jsonb_agg(jsonb_build_object('slot', ss.slot, 'pid', ss.pid, 'role', ss.role,
                                        'application', ss.application_name, 'mode', ss.mode,
                                        'granted', ss.granted, 'squatter', ss.squatter)
                     ORDER BY ss.slot, ss.granted DESC, ss.pid) AS holders,
           (array_agg(format('end session %s (role %s, application %L), which holds slot %s of lane %s with a %s '
                             'but is not a pglane worker: SELECT pg_terminate_backend(%s); then keep it out '
                             '(REVOKE CONNECT, or revoke its role''s membership)',
                             ss.pid, coalesce(ss.role, '?'), coalesce(ss.application_name, ''), ss.slot,
                             ss.lane, ss.mode, ss.pid) COLLATE "default" ORDER BY ss.slot)
                FILTER (WHERE ss.squatter))[1] AS squatter_action,
           count(*) FILTER (WHERE ss.squatter) AS squatters
      FROM pglane.slot_sessions ss
     GROUP BY ss.lane_id
), base AS (
    SELECT l.name AS lane, l.id AS lane_id, l.slots, x.consumers,
           q.queued, q.eligible, coalesce(r.running, 0) AS running,
           t.jobs - q.queued - coalesce(r.running, 0) - t.failed - t.cancelled AS done,
           t.failed, t.cancelled,
           now() - q.oldest_queued AS oldest_queued_age,
           now() - q.oldest_eligible AS oldest_eligible_age,
           CASE WHEN fl.arrived_5m IS NOT NULL THEN ARRAY[fl.arrived_5m, fl.left_5m] END AS flow,
           coalesce(an.orphaned, 0) AS orphaned, coalesce(an.stuck, 0) AS stuck,
           l.max_queued, l.waiting_grace, l.job_timeout, l.lease_timeout, l.max_attempts,
           coalesce(h.holders, '[]') AS holders, coalesce(h.squatters, 0) AS squatters, h.squatter_action,
           l.takeover, x.in_flight, x.lost_attempt, x.lease_ends,
           pglane.rate_text(l.rate_limit, l.rate_period) AS rate, x.rate_window_used, x.rate_next_start_at,
           l.group_slots, x.groups_waiting,
           pz.paused_until AS pause_end, pz.kind AS pause_kind, pz.paused_by, pz.reason AS pause_reason,
           pz.attempts AS pause_attempts
      FROM pglane.lanes l
     CROSS JOIN LATERAL pglane.lane_queue(l.name) q
     CROSS JOIN LATERAL (SELECT coalesce(sum(t.jobs), 0)::bigint AS jobs, coalesce(sum(t.failed), 0)::bigint AS failed,
                                coalesce(sum(t.cancelled), 0)::bigint AS cancelled
                           FROM pglane.lane_tallies t WHERE t.lane_id = l.id) t
     CROSS JOIN LATERAL (SELECT pglane.lane_consumers(l.id, l.slots) AS consumers, f.in_flight, f.lost_attempt,
                                f.lease_ends, pglane.rate_window_use(l.name) AS rate_window_used,
                                pglane.rate_next_start(l.name) AS rate_next_start_at,
                                CASE WHEN q.queued > 0 THEN pglane.groups_waiting(l.name) ELSE 0 END AS groups_waiting
                           FROM pglane.in_flight(l.name) f OFFSET 0) x
      LEFT JOIN LATERAL (SELECT fl.arrived_5m, fl.left_5m FROM pglane.lane_flow(l.name) fl
                          WHERE q.eligible > 0 AND now() - q.oldest_eligible > l.waiting_grace OFFSET 0) fl ON true
      LEFT JOIN LATERAL (SELECT c.paused_until, p.kind, p.paused_by, p.reason, p.attempts  -- pause.sql
                           FROM pglane.lane_counters c LEFT JOIN pglane.lane_pauses p ON p.lane_id = c.lane_id
                          WHERE c.lane_id = l.id AND c.paused_until > now()) pz ON true
      LEFT JOIN running r ON r.lane = l.name
      LEFT JOIN attempts_now an ON an.lane = l.name
      LEFT JOIN holders h ON h.lane_id = l.id
)
SELECT b.lane, b.slots, b.consumers, b.queued, b.running, b.done, b.failed, b.cancelled,
       b.oldest_queued_age, b.orphaned AS lost_workers, b.stuck, b.max_queued, b.max_attempts,
       b.job_timeout, b.lease_timeout,
       CASE
           WHEN b.orphaned > 0 THEN
               format('run: pglane recover %s (%s running attempt(s) lost their worker; a worker taking the slot does this too)',
                      b.lane, b.orphaned)
           WHEN b.stuck > 0 THEN
               format('inspect %s stuck attempt(s) past their lease with the worker still connected '
                      '(pglane jobs --lane %s --status running); end them with: pglane recover %s --terminate-stuck',
                      b.stuck, b.lane, b.lane)
           WHEN b.squatters > 0 THEN b.squatter_action
           WHEN b.pause_end IS NOT NULL THEN
               pglane.pause_note(b.lane, b.pause_end, b.pause_kind, b.paused_by, b.pause_reason, b.pause_attempts)
           WHEN b.takeover = 'after_lease' AND b.in_flight >= b.slots AND b.lost_attempt IS NOT NULL AND b.queued > 0 THEN
               pglane.lease_wait_note(b.lane, b.lost_attempt, b.lease_ends)
           WHEN b.consumers = 0 AND b.queued > 0 THEN
               format('start a worker for lane %s: pglane worker %s --handler MODULE:CALLABLE', b.lane, b.lane)
           WHEN b.rate_next_start_at IS NOT NULL AND b.eligible > 0 THEN
               format('nothing to do: rate limited (%s, %s used in the current window): next start at %s',
                      b.rate, b.rate_window_used, b.rate_next_start_at)
           WHEN b.eligible > 0 AND b.oldest_eligible_age > b.waiting_grace
                AND b.flow[1] > b.flow[2] THEN
               format('backlog of lane %s is growing (%s queued, %s arrived and %s started or cancelled in 5 min): '
                      'add slots and workers, or expect the oldest to wait longer', b.lane, b.queued,
                      b.flow[1], b.flow[2])
           WHEN b.consumers = 0 THEN
               format('nothing queued; start a worker for lane %s before work arrives', b.lane)
           ELSE 'nothing to do'
       END AS next_safe_action,
       b.holders, b.squatters, b.takeover, b.in_flight,
       CASE WHEN b.takeover = 'after_lease' AND b.in_flight >= b.slots THEN b.lease_ends END AS waits_until,
       b.rate, b.rate_window_used, b.rate_next_start_at, b.group_slots, b.groups_waiting,
       b.pause_end IS NOT NULL AS paused, nullif(b.pause_end, 'infinity') AS paused_until,  -- NULL: until resumed
       b.paused_by, b.pause_reason, b.pause_kind  -- person, retry_later or breaker
  FROM base b;

-- queue_positions: the position of every queued job of lane p_lane (of every lane if NULL), from one
-- ordered pass over the queue index: O(queued), where job_status's per-row count is O(position) per
-- row (listing N queued jobs through it costs N²/2 index entries: 26 s for 10,000). The order and
-- the numbers are exactly job_status's queue_position: eligible jobs by created_at and id, then the
-- scheduled ones by run_after, created_at and id, per lane. A listing joins it on job_id (see
-- pglane/queries.py JOBS); one job's position stays job_status's index lookup, which a window over
-- the whole queue would turn into O(queued) for every single-job read. SECURITY DEFINER to count the
-- jobs a producer may not see (as job_status does), but it returns only the caller's own jobs, unless
-- the caller sees every job.
CREATE OR REPLACE FUNCTION pglane.queue_positions(p_lane text DEFAULT NULL)
RETURNS TABLE (job_id bigint, queue_position bigint)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_caller text := pglane.caller();
    v_all    boolean := pglane.sees_every_job(v_caller::name);
BEGIN
    -- Two statements rather than one with (p_lane IS NULL OR lane = p_lane), so that each plans its
    -- scan of the queue index (the lane's part of it, or all of it) and never the history.
    IF p_lane IS NULL THEN
        RETURN QUERY
        SELECT p.id, p.pos FROM (
            SELECT q.id, q.enqueued_by,
                   row_number() OVER (PARTITION BY q.lane ORDER BY q.run_after > now(),
                                      CASE WHEN q.run_after > now() THEN q.run_after END,
                                      q.priority DESC, q.fair_rank, q.created_at, q.id) AS pos
              FROM pglane.jobs q WHERE q.in_queue) p
         WHERE v_all OR p.enqueued_by = v_caller;
    ELSE
        RETURN QUERY
        SELECT p.id, p.pos FROM (
            SELECT q.id, q.enqueued_by,
                   row_number() OVER (ORDER BY q.run_after > now(),
                                      CASE WHEN q.run_after > now() THEN q.run_after END,
                                      q.priority DESC, q.fair_rank, q.created_at, q.id) AS pos
              FROM pglane.jobs q WHERE q.lane = p_lane AND q.in_queue) p
         WHERE v_all OR p.enqueued_by = v_caller;
    END IF;
END $$;

-- Lane facts for job_status, one map per statement (lanes_consumers, slots.sql; lanes_in_flight,
-- strict.sql; lanes_next_start, rate.sql): each is read by an uncorrelated sub-select in the view,
-- which PostgreSQL runs once, at its first use, and then reuses for every row (an InitPlan). A listing
-- of 100,000 queued jobs thus reads the slot locks once, not once per row (at about 0.1 ms a read,
-- that was 12 s); a lookup of one job that needs none of them reads none. SECURITY DEFINER: a
-- producer reads through job_status what these tell, not the tables they read.

-- queue_position counts the lane's queued jobs through the queue index (q.in_queue), so it costs
-- the backlog, not the history: one job's position is one range count of that index. A listing of
-- many queued jobs takes its positions from queue_positions() instead (one pass, not one count per
-- row; a query that does not name queue_position never computes it). The lane facts come from the
-- maps (above), once per statement. A producer sees the jobs it enqueued (caller()), nothing else; operators
-- and workers see every job (sees_every_job, evaluated once per query). security_barrier: a caller's
-- own conditions run only on the rows it may see, so no function of theirs reads another's row.
CREATE OR REPLACE VIEW pglane.job_status WITH (security_barrier) AS
SELECT j.id AS job_id, j.lane, j.status, j.created_at, j.run_after, j.started_at, j.finished_at,
       (j.status = 'queued' AND greatest(j.created_at, j.run_after) < now() - l.waiting_grace
        AND NOT coalesce(c.paused_until > now(), false)  -- it waits for the pause's end (pause.sql)
        AND NOT (l.rate_limit IS NOT NULL AND j.run_after <= now()
                 AND ((SELECT pglane.lanes_next_start()) ->> j.lane) IS NOT NULL)
        AND NOT coalesce(j.cost > l.rate_limit, false)  -- it waits for a person, not a worker
        AND NOT CASE WHEN l.group_slots IS NULL OR j.run_after > now() THEN false  -- waits for its group
                     ELSE pglane.group_in_flight(l, j.group_key) >= l.group_slots END)
           AS waiting_for_worker,
       CASE WHEN j.status <> 'queued' THEN NULL
            WHEN j.run_after <= now() THEN  -- two ranges of jobs_queue: the higher priorities, then its own up to it
               (SELECT count(*) FROM pglane.jobs q WHERE q.lane = j.lane AND q.in_queue AND q.priority > j.priority
                   AND q.run_after <= now())
             + (SELECT count(*) FROM pglane.jobs q WHERE q.lane = j.lane AND q.in_queue AND q.priority = j.priority
                   AND (q.fair_rank, q.created_at, q.id) <= (j.fair_rank, j.created_at, j.id) AND q.run_after <= now())
            ELSE  -- scheduled: after every eligible job, then by run_after and service order
               (SELECT count(*) FROM pglane.jobs q
                 WHERE q.lane = j.lane AND q.in_queue
                   AND (q.run_after <= now() OR q.run_after < j.run_after OR (q.run_after = j.run_after
                        AND (q.priority > j.priority OR (q.priority = j.priority
                             AND (q.fair_rank, q.created_at, q.id) <= (j.fair_rank, j.created_at, j.id))))))
       END AS queue_position,
       j.attempts, j.seq, j.idempotency_key, j.last_error,
       a.id AS attempt_id, a.status AS attempt_status,
       CASE j.status
           WHEN 'queued' THEN CASE
               WHEN j.cost > l.rate_limit THEN  -- passed over by every claim (claim.sql): it could never start
                   format('change it: job %s costs %s, more than lane %s''s whole rate (%s), so it never starts '
                          'and the jobs behind it run; cancel it (pglane cancel %s), or raise the rate '
                          '(pglane lane set %s --rate N/PERIOD) to run it', j.id, j.cost, j.lane,
                          pglane.rate_text(l.rate_limit, l.rate_period), j.id, j.lane)
               WHEN c.paused_until > greatest(now(), j.run_after) THEN
                   'nothing to do until lane ' || j.lane || ' resumes: ' ||
                   (SELECT pglane.pause_note(j.lane, c.paused_until, p.kind, p.paused_by, p.reason, p.attempts)
                      FROM pglane.lane_pauses p WHERE p.lane_id = l.id)
               WHEN j.run_after > now() THEN format('nothing to do: scheduled to run after %s', j.run_after)
               WHEN CASE WHEN l.group_slots IS NULL THEN false
                         ELSE pglane.group_in_flight(l, j.group_key) >= l.group_slots END THEN
                   format('nothing to do: %s is at its limit of %s running job(s) (--group-slots %s of lane %s): '
                          'this job starts when one of them ends, while other groups'' jobs go ahead',
                          coalesce('group ' || j.group_key, 'the shared group (jobs with no group)'),
                          l.group_slots, l.group_slots, j.lane)
               WHEN l.takeover = 'after_lease'
                    AND ((SELECT pglane.lanes_in_flight()) -> j.lane ->> 'in_flight')::bigint >= l.slots
                    AND (SELECT pglane.lanes_in_flight()) -> j.lane ->> 'lost_attempt' IS NOT NULL THEN
                   pglane.lease_wait_note(j.lane, ((SELECT pglane.lanes_in_flight()) -> j.lane ->> 'lost_attempt')::bigint,
                                          ((SELECT pglane.lanes_in_flight()) -> j.lane ->> 'lease_ends')::timestamptz)
               WHEN l.rate_limit IS NOT NULL AND ((SELECT pglane.lanes_next_start()) ->> j.lane) IS NOT NULL THEN
                   format('nothing to do: rate limited: lane %s (%s) makes its next start at %s', j.lane,
                          pglane.rate_text(l.rate_limit, l.rate_period),
                          ((SELECT pglane.lanes_next_start()) ->> j.lane)::timestamptz)
               WHEN greatest(j.created_at, j.run_after) >= now() - l.waiting_grace THEN 'nothing to do: just queued'
               WHEN coalesce(((SELECT pglane.lanes_consumers()) ->> l.id::text)::integer, 0) = 0 THEN
                   format('start a worker for lane %s: pglane worker %s --handler MODULE:CALLABLE', j.lane, j.lane)
               ELSE format('wait: every slot of lane %s is busy; add slots and workers to go faster', j.lane)
           END
           WHEN 'running' THEN CASE
               WHEN NOT pglane.session_alive(a.backend_pid, a.backend_start, a.session_mark, l.id, l.slots) THEN
                   format('run: pglane recover %s (the worker of attempt %s is gone)', j.lane, a.id)
               WHEN now() > a.lease_expires_at THEN
                   format('inspect stuck attempt %s: past its lease, worker %s (pid %s) still connected; '
                          'end it with: pglane recover %s --terminate-stuck', a.id, a.worker, a.backend_pid, j.lane)
               ELSE 'nothing to do: running'
           END
           WHEN 'failed' THEN CASE a.status
               WHEN 'lost' THEN
                   format('inspect attempt %s: worker lost during the call; retry only if you accept paying again: pglane retry %s',
                          a.id, j.id)
               WHEN 'timed_out' THEN
                   format('inspect attempt %s: it ran past its job_timeout (its own, else the lane''s); raise the timeout or fix the handler, then: pglane retry %s',
                          a.id, j.id)
               WHEN 'deferred' THEN
                   format('inspect attempt %s: the provider kept refusing (deferred too many times in a row, nothing '
                          'paid); once it takes calls again: pglane retry %s', a.id, j.id)
               ELSE format('inspect attempt %s: the handler failed; fix the cause, then: pglane retry %s', a.id, j.id)
           END
           WHEN 'cancelled' THEN format('nothing to do: cancelled (pglane retry %s runs it after all)', j.id)
           ELSE 'nothing to do: done, result stored'
       END AS next_safe_action,
       j.result, j.enqueued_by, j.group_key, j.priority, j.job_timeout
  FROM pglane.jobs j
  JOIN pglane.lanes l ON l.name = j.lane
  JOIN pglane.lane_counters c ON c.lane_id = l.id
  LEFT JOIN pglane.attempts a ON a.job_id = j.id AND a.attempt_number = j.attempts
 WHERE j.enqueued_by = (SELECT pglane.caller()) OR (SELECT pglane.sees_every_job(current_user));
