"""The statements only the operator's page sends, by name. Everything the CLI also reads (lane_status,
one job's status, its attempts) comes from ``pglane.queries``; nothing is built from user input.
"""

from typing import LiteralString

# The lanes page, one page at a time: keyset by name (after the last one shown), optionally only the
# names starting with a prefix. The page's names are picked from pglane.lanes first (its name index),
# then lane_status is asked for those only: the view computes a lane where its row of pglane.lanes is
# read (sql/views.sql), so a page costs its fifty lanes whatever the number of lanes (#30); asked with
# ORDER BY ... LIMIT on the view itself, the planner may compute every lane and sort them after.
LANE_PAGE: LiteralString = (
    "SELECT * FROM pglane.lane_status WHERE lane = ANY(ARRAY("
    "SELECT l.name FROM pglane.lanes l WHERE l.name > %(after)s AND starts_with(l.name, %(prefix)s)"
    " ORDER BY l.name LIMIT %(limit)s)) ORDER BY lane"
)

# One lane's page: its row of lane_status, computed for that lane only (the view computes a lane where
# its row of pglane.lanes is read, as for LANE_PAGE).
LANE_ONE: LiteralString = "SELECT * FROM pglane.lane_status WHERE lane = %s"
# Whether a lane has grouped jobs (its busiest groups are shown then): a queued job with a group (the
# greatest group key of the lane's queue is not '', the shared group's key in jobs_group_queue: read
# backward, one index entry), or a running one (the running attempts, bounded by the workers). Asked
# only when lane_status's groups_waiting does not say so already (more than one group waiting).
LANE_GROUPED: LiteralString = (
    "SELECT coalesce((SELECT max(coalesce(j.group_key, '')) FROM pglane.jobs j"
    "                  WHERE j.lane = %(lane)s AND j.in_queue) > '', false)"
    " OR EXISTS (SELECT 1 FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id"
    "            WHERE a.status = 'running' AND j.lane = %(lane)s AND j.group_key IS NOT NULL) AS grouped"
)

# The jobs list, one page at a time, in three sections: the queued jobs that may run now, lane by lane
# in each lane's service order (priority DESC, fair_rank, created_at, id: the claim's pick, sql/claim.sql,
# and the queue index jobs_queue's own order); then the scheduled ones (run_after in the future) by
# run_after, then service order; then every other job, newest first (by id). Each section continues
# after a cursor, the page's last job. Within a lane, the jobs a page shows of its queue are consecutive
# in its service order (its eligible jobs come all before its scheduled ones), so one position per lane
# and page is counted (JOB_POSITIONS) and the others follow from it. Filters: lane and status (each
# optional); an idempotency key has its own statement (JOBS_KEYED).
#
# "After the cursor" in service order mixes directions (priority falls, the rest rises), which no row
# comparison says. It is three ranges of jobs_queue, each read in index order and cut at a page: the
# cursor's lane and priority past its (fair_rank, created_at, id); the cursor's lane at a lower
# priority; the lanes after the cursor's. The three are put in order by `part` (at most three pages
# of rows sorted), so a page reads at most three pages of index entries (plus the scheduled jobs it
# passes over), wherever in a long queue it starts. The first page's cursor is lane '' (before every
# lane name): only the third range has rows.
_ELIGIBLE_RANGE: LiteralString = (
    "SELECT j.id, j.lane, j.priority, j.fair_rank, j.created_at, {part} AS part FROM pglane.jobs j"
    " WHERE j.in_queue AND j.run_after <= now() AND (%(lane)s::text IS NULL OR j.lane = %(lane)s) AND {where}"
    " ORDER BY {order} LIMIT %(limit)s"
)
JOBS_ELIGIBLE: LiteralString = (
    "SELECT p.id, p.lane FROM ("
    "(" + _ELIGIBLE_RANGE.format(
        part="1", where="j.lane = %(c_lane)s::text AND j.priority = %(c_priority)s::integer"
        " AND (j.fair_rank, j.created_at, j.id) > (%(c_rank)s::bigint, %(c_created)s::timestamptz, %(c_id)s::bigint)",
        order="j.fair_rank, j.created_at, j.id") + ")"
    " UNION ALL (" + _ELIGIBLE_RANGE.format(
        part="2", where="j.lane = %(c_lane)s::text AND j.priority < %(c_priority)s::integer",
        order="j.priority DESC, j.fair_rank, j.created_at, j.id") + ")"
    " UNION ALL (" + _ELIGIBLE_RANGE.format(
        part="3", where="j.lane > %(c_lane)s::text",
        order="j.lane, j.priority DESC, j.fair_rank, j.created_at, j.id") + ")"
    ") p ORDER BY p.part, p.lane, p.priority DESC, p.fair_rank, p.created_at, p.id LIMIT %(limit)s"
)
# The scheduled jobs: no index orders them (the queue index is read for the lane, or whole, and the
# scheduled ones sorted, as before #32), so the cursor is one condition, written out.
JOBS_SCHEDULED: LiteralString = (
    "SELECT j.id, j.lane FROM pglane.jobs j"
    " WHERE j.in_queue AND j.run_after > now() AND (%(lane)s::text IS NULL OR j.lane = %(lane)s)"
    " AND j.run_after >= %(c_run_after)s::timestamptz"
    " AND (j.run_after > %(c_run_after)s::timestamptz OR j.priority < %(c_priority)s::integer"
    "      OR (j.priority = %(c_priority)s::integer AND (j.fair_rank, j.created_at, j.id)"
    "          > (%(c_rank)s::bigint, %(c_created)s::timestamptz, %(c_id)s::bigint)))"
    " ORDER BY j.run_after, j.priority DESC, j.fair_rank, j.created_at, j.id LIMIT %(limit)s"
)
# The rest, newest first. Failed and cancelled jobs are read through their partial index
# (failed_or_cancelled), running ones through the running attempts, not by a walk down the history.
JOBS_SETTLED: LiteralString = (
    "SELECT j.id, j.lane FROM pglane.jobs j"
    " WHERE NOT j.in_queue AND j.id < %(before)s AND (%(lane)s::text IS NULL OR j.lane = %(lane)s)"
    " AND (%(status)s::text IS NULL OR j.status::text = %(status)s)"
    " AND (%(settled)s IS NOT TRUE OR j.failed_or_cancelled)"
    " AND (%(running)s IS NOT TRUE OR j.id IN (SELECT a.job_id FROM pglane.attempts a WHERE a.status = 'running'))"
    " ORDER BY j.id DESC LIMIT %(limit)s"
)
# A key's jobs (at most one per lane: lanes and keys are unique together), newest first, each read
# through the (lane, idempotency_key) index rather than by a walk down the history.
JOBS_KEYED: LiteralString = (
    "SELECT j.id, j.lane, j.in_queue FROM pglane.lanes l"
    " CROSS JOIN LATERAL (SELECT k.id, k.lane, k.status, k.in_queue FROM pglane.jobs k"
    "                      WHERE k.lane = l.name AND k.idempotency_key = %(key)s) j"
    " WHERE (%(lane)s::text IS NULL OR l.name = %(lane)s) AND (%(status)s::text IS NULL OR j.status::text = %(status)s)"
    " AND j.id < %(before)s ORDER BY j.id DESC LIMIT %(limit)s"
)
# Where a cursor job stands: its section and sort key.
JOB_CURSOR: LiteralString = (
    "SELECT j.lane, j.priority, j.fair_rank, j.created_at, j.run_after, j.in_queue, j.run_after > now() AS scheduled"
    " FROM pglane.jobs j WHERE j.id = %s"
)
# The shown jobs' rows: job_status's columns but queue_position (a count per row, O(position) each).
JOB_ROWS: LiteralString = (
    "SELECT job_id, lane, status, created_at, run_after, waiting_for_worker, attempts, idempotency_key,"
    " next_safe_action, group_key, priority FROM pglane.job_status WHERE job_id = ANY(%s)"
)
# A queued job's place in its lane's queue, for one job per lane and page: job_status's queue_position
# (sql/views.sql), the same number (tests/test_web.py holds them equal), counted as ranges of the queue
# index: the lane's eligible jobs of a higher priority, then those of its priority up to it in
# (fair_rank, created_at, id). So an eligible job's place costs its place (index entries and their
# rows, for run_after), not its lane's queue; job_status's one condition over the mixed-direction order
# is no index range, and reads the lane's every job. A scheduled job's place counts the lane's eligible
# jobs and the scheduled ones before it (no index orders run_after): its lane's queue, as before.
JOB_POSITIONS: LiteralString = (
    "SELECT j.id AS job_id, CASE WHEN j.run_after <= now() THEN"
    "  (SELECT count(*) FROM pglane.jobs q WHERE q.lane = j.lane AND q.in_queue AND q.priority > j.priority"
    "    AND q.run_after <= now())"
    "  + (SELECT count(*) FROM pglane.jobs q WHERE q.lane = j.lane AND q.in_queue AND q.priority = j.priority"
    "    AND (q.fair_rank, q.created_at, q.id) <= (j.fair_rank, j.created_at, j.id) AND q.run_after <= now())"
    " ELSE (SELECT count(*) FROM pglane.jobs q WHERE q.lane = j.lane AND q.in_queue"
    "   AND (q.run_after <= now() OR q.run_after < j.run_after OR (q.run_after = j.run_after"
    "        AND (q.priority > j.priority OR (q.priority = j.priority"
    "             AND (q.fair_rank, q.created_at, q.id) <= (j.fair_rank, j.created_at, j.id))))))"
    " END AS queue_position"
    " FROM pglane.jobs j WHERE j.id = ANY(%s) AND j.status = 'queued'"
)

# The payload is not in job_status (producers read that view too); operators may read pglane.jobs.
JOB_PAYLOAD: LiteralString = "SELECT payload FROM pglane.jobs WHERE id = %s"

# The last hour of each lane, one row per lane and minute, derived from jobs and attempts (no table of
# its own). A job is in the queue from its enqueue to its first attempt's start, and again from the end
# of attempt k to the start of attempt k+1 (or until now, or until it was cancelled). The moment of a
# retry by hand is not recorded, so a job retried by hand counts as queued from its previous attempt's
# end: the depth over-counts such a job for the time it sat failed. `depth` is counted at the end of
# each minute (now, for the current one) as a running sum of the waits begun and ended, so its cost
# follows the hour's jobs, not sixty times them; `wait_avg`/`wait_max` are the seconds from entering the queue
# to the start of the attempts that started in that minute. Only jobs queued or running now or finished
# within the hour can have a point in the hour. Only the lanes shown (%(lanes)s) are read. A queued job
# never tried (the bulk of a backlog) has one wait, from its enqueue on, and no attempt: such jobs are
# counted by lane and minute of enqueue in one pass over the queue (`fresh`), not expanded job by job
# and joined to attempts (100,000 queued jobs: 1.9 s before, a few tens of ms now); the per-job path
# reads only the jobs tried, running or finished within the hour.
LAST_HOUR: LiteralString = """
WITH span AS (
    SELECT date_trunc('minute', now()) - interval '59 minutes' AS since
), recent AS (
    SELECT j.id, j.lane, j.status, j.created_at, j.finished_at, j.attempts
      FROM pglane.jobs j, span
     WHERE ((j.in_queue AND j.attempts > 0) OR j.status = 'running' OR j.finished_at >= span.since)
       AND j.lane = ANY(%(lanes)s::text[])
), fresh AS (  -- queued jobs never tried: one wait each, from created_at on, and nothing else to read
    SELECT j.lane, greatest(date_trunc('minute', j.created_at), span.since) AS minute, count(*) AS delta
      FROM pglane.jobs j, span
     WHERE j.in_queue AND j.attempts = 0 AND j.created_at <= now() AND j.lane = ANY(%(lanes)s::text[])
     GROUP BY 1, 2
), att AS MATERIALIZED (
    SELECT r.lane, a.job_id, a.attempt_number, a.status, a.started_at, a.finished_at
      FROM recent r JOIN pglane.attempts a ON a.job_id = r.id
), waits AS (
    SELECT r.lane,
           CASE WHEN k = 1 THEN r.created_at ELSE p.finished_at END AS entered,
           CASE WHEN a.started_at IS NOT NULL THEN a.started_at
                WHEN r.status = 'queued' THEN 'infinity'::timestamptz
                WHEN r.status = 'cancelled' THEN r.finished_at
           END AS left_at,
           a.started_at IS NOT NULL AS served
      FROM recent r
     CROSS JOIN LATERAL generate_series(1, r.attempts + 1) AS k
      LEFT JOIN att a ON a.job_id = r.id AND a.attempt_number = k
      LEFT JOIN att p ON p.job_id = r.id AND p.attempt_number = k - 1
), minutes AS (
    SELECT l.name AS lane, m AS minute
      FROM pglane.lanes l CROSS JOIN span
     CROSS JOIN generate_series(span.since, date_trunc('minute', now()), interval '1 minute') AS m
     WHERE l.name = ANY(%(lanes)s::text[])
), moves AS (  -- +1 where a wait began (at the first minute for one begun before the hour), -1 where it ended
    SELECT w.lane, greatest(date_trunc('minute', w.entered), s.since) AS minute, 1 AS delta
      FROM waits w, span s WHERE w.entered <= now() AND w.left_at > s.since
    UNION ALL
    SELECT w.lane, date_trunc('minute', w.left_at), -1
      FROM waits w, span s WHERE w.left_at > s.since AND w.left_at <= now()
    UNION ALL
    SELECT f.lane, f.minute, f.delta FROM fresh f
), depth AS (  -- a running sum of the moves: the waits begun and not ended by the end of each minute
    SELECT m.lane, m.minute, sum(coalesce(d.delta, 0)) OVER (PARTITION BY m.lane ORDER BY m.minute) AS depth
      FROM minutes m
      LEFT JOIN (SELECT lane, minute, sum(delta) AS delta FROM moves GROUP BY 1, 2) d
        ON d.lane = m.lane AND d.minute = m.minute
), started AS (
    SELECT lane, date_trunc('minute', left_at) AS minute, count(*) AS started,
           extract(epoch FROM avg(left_at - entered)) AS wait_avg,
           extract(epoch FROM max(left_at - entered)) AS wait_max
      FROM waits WHERE served GROUP BY 1, 2
), finished AS (
    SELECT lane, date_trunc('minute', finished_at) AS minute, count(*) FILTER (WHERE status = 'done') AS finished,
           count(*) FILTER (WHERE status <> 'done') AS failed
      FROM att WHERE finished_at IS NOT NULL GROUP BY 1, 2
)
SELECT d.lane, d.minute, coalesce(s.started, 0)::int AS started, coalesce(f.finished, 0)::int AS finished,
       coalesce(f.failed, 0)::int AS failed, d.depth::int AS depth,
       s.wait_avg::float8 AS wait_avg, s.wait_max::float8 AS wait_max
  FROM depth d
  LEFT JOIN started s ON s.lane = d.lane AND s.minute = d.minute
  LEFT JOIN finished f ON f.lane = d.lane AND f.minute = d.minute
 ORDER BY d.lane, d.minute
"""
