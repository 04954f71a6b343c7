"""The statements only the operator's page sends, by name. Everything the CLI also reads (lane_status,
one job's status, its attempts) comes from ``pglane.queries``; nothing is built from user input.
"""

from typing import LiteralString

LANE_NAMES: LiteralString = "SELECT name FROM pglane.lanes ORDER BY name"

# The jobs list: filtered by lane, status and idempotency key (each optional); queued jobs first in
# the order they will be served (as pglane.queries.JOBS and queue_position count), the rest newest first.
JOBS: LiteralString = (
    "SELECT * FROM pglane.job_status"
    " WHERE (%(lane)s::text IS NULL OR lane = %(lane)s) AND (%(status)s::text IS NULL OR status = %(status)s)"
    " AND (%(key)s::text IS NULL OR idempotency_key = %(key)s)"
    " ORDER BY status <> 'queued', (status = 'queued' AND run_after > now()),"
    " CASE WHEN status = 'queued' AND run_after > now() THEN run_after END,"
    " CASE WHEN status = 'queued' THEN created_at END, CASE WHEN status = 'queued' THEN job_id END,"
    " job_id DESC LIMIT %(limit)s"
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
# within the hour can have a point in the hour; reading them scans pglane.jobs once.
LAST_HOUR: LiteralString = """
WITH span AS (
    SELECT date_trunc('minute', now()) - interval '59 minutes' AS since
), recent AS (
    SELECT j.id, j.lane, j.status, j.created_at, j.finished_at, j.attempts
      FROM pglane.jobs j, span
     WHERE j.in_queue OR j.status = 'running' OR j.finished_at >= span.since
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
      FROM pglane.lanes l, span, generate_series(span.since, date_trunc('minute', now()), interval '1 minute') AS m
), moves AS (  -- +1 where a wait began (at the first minute for one begun before the hour), -1 where it ended
    SELECT w.lane, greatest(date_trunc('minute', w.entered), s.since) AS minute, 1 AS delta
      FROM waits w, span s WHERE w.entered <= now() AND w.left_at > s.since
    UNION ALL
    SELECT w.lane, date_trunc('minute', w.left_at), -1
      FROM waits w, span s WHERE w.left_at > s.since AND w.left_at <= now()
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
