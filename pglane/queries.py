"""Every statement pglane's Python sends, by name. The logic lives in sql/; this module only calls it.

No statement is built from user input: lane names, payloads and keys are always parameters.
"""

from typing import LiteralString

ENQUEUE: LiteralString = "SELECT pglane.enqueue(%s, %s::jsonb, %s, %s, %s, %s, %s, %s, make_interval(secs => %s), %s)"
CLAIM: LiteralString = "SELECT * FROM pglane.claim(%s, %s)"
CLAIM_OR_WAIT: LiteralString = "SELECT * FROM pglane.claim_or_wait(%s, %s)"  # the worker's: always a row
# An outcome carries the attempt's token (claim() returned it): any session holding it may write.
COMPLETE: LiteralString = "SELECT pglane.complete(%s, %s::jsonb, %s)"
COMPLETE_AND_CLAIM: LiteralString = "SELECT * FROM pglane.complete_and_claim(%s, %s::jsonb, %s, %s, %s)"
FAIL: LiteralString = "SELECT pglane.fail(%s, %s, %s, %s)"
DEFER: LiteralString = "SELECT pglane.defer(%s, make_interval(secs => %s), %s, %s)"
RECOVER: LiteralString = "SELECT pglane.recover(%s), now() AS at"  # at: the finished_at of what it marked lost
# The attempts a recovery (RECOVER, answering %s as its `at`) has just marked lost, for their spans (pglane.tracing).
LOST_AT: LiteralString = (
    "SELECT coalesce(jsonb_agg(jsonb_build_object('attempt_id', a.id, 'job_id', a.job_id, 'attempt_number',"
    " a.attempt_number, 'seq', a.seq, 'started', extract(epoch FROM a.started_at), 'finished',"
    " extract(epoch FROM a.finished_at), 'error', a.error, 'lane', j.lane, 'group_key', j.group_key,"
    " 'traceparent', j.traceparent)), '[]') AS lost"
    " FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id WHERE a.status = 'lost' AND a.finished_at = %s")
# The stuck attempts (of lane %s, or all), for their spans (pglane.tracing): past their lease, their worker connected.
STUCK_TRACED: LiteralString = (
    "SELECT coalesce(jsonb_agg(jsonb_build_object('attempt_id', s.attempt_id, 'job_id', s.job_id, 'attempt_number',"
    " s.attempt_number, 'seq', a.seq, 'lease_ends', extract(epoch FROM s.lease_expires_at), 'worker', s.worker,"
    " 'lane', s.lane, 'group_key', j.group_key, 'traceparent', j.traceparent)), '[]') AS stuck"
    " FROM pglane.stuck_attempts(%s) s JOIN pglane.jobs j ON j.id = s.job_id"
    " JOIN pglane.attempts a ON a.id = s.attempt_id")
RELEASE_LEASE: LiteralString = "SELECT pglane.release_lease(%s)"
RETRY: LiteralString = "SELECT pglane.retry(%s)"
CANCEL: LiteralString = "SELECT pglane.cancel(%s)"
STUCK: LiteralString = "SELECT * FROM pglane.stuck_attempts(%s) ORDER BY attempt_id"
PRUNE: LiteralString = "SELECT pglane.prune(make_interval(secs => %s), %s, %s, %s)"
PRUNE_BATCH: LiteralString = "SELECT * FROM pglane.prune_batch(make_interval(secs => %s), %s, %s, %s, %s, %s)"
PRUNABLE: LiteralString = (  # how many jobs a prune would delete: one read of the history, for its progress
    "SELECT count(*) AS n FROM pglane.jobs j WHERE j.finished_at < now() - make_interval(secs => %(age)s)"
    " AND (%(lane)s::text IS NULL OR j.lane = %(lane)s)"
    " AND (j.status IN ('done', 'cancelled') OR (%(failed)s AND j.status = 'failed'))"
)
TERMINATE: LiteralString = "SELECT pg_terminate_backend(%s)"
LIVE_SESSIONS: LiteralString = "SELECT count(*) AS n FROM pg_stat_activity WHERE pid = ANY(%s)"  # of these pids

LANES: LiteralString = (  # every lane, or the one named %(name)s
    "SELECT id, name, slots, extract(epoch FROM job_timeout)::float8 AS job_timeout,"
    " extract(epoch FROM lease_timeout)::float8 AS lease_timeout, max_attempts, max_queued, max_result_bytes,"
    " takeover"
    " FROM pglane.lanes WHERE %(name)s::text IS NULL OR name = %(name)s ORDER BY name"
)
LANES_LIKE: LiteralString = (  # every lane whose name matches the LIKE pattern %(pattern)s: one read for all
    "SELECT id, name, slots, extract(epoch FROM job_timeout)::float8 AS job_timeout,"
    " extract(epoch FROM lease_timeout)::float8 AS lease_timeout, max_attempts, max_queued, max_result_bytes,"
    " takeover"
    " FROM pglane.lanes WHERE name LIKE %(pattern)s ORDER BY name"
)
LANES_CHANNEL: LiteralString = "LISTEN pglane_lanes"  # a lane created or deleted (sql/lanes.sql); payload empty
# Change a running lane: settings as a JSON object (a key given null removes max_queued or rate).
SET_LANE: LiteralString = "SELECT pglane.set_lane(%s, %s::jsonb) AS note"
CREATE_LANE: LiteralString = (
    "INSERT INTO pglane.lanes (name, slots, job_timeout, lease_timeout, max_attempts, max_queued,"
    " waiting_grace, max_payload_bytes, retry_backoff, max_result_bytes, takeover, rate_limit, rate_period,"
    " key_retention, group_slots, max_deferrals, on_retry_later, pause_after_failures)"
    " SELECT %s, %s, make_interval(secs => %s), make_interval(secs => %s), %s, %s,"
    " make_interval(secs => %s), %s, make_interval(secs => %s), %s, %s, r.rate_limit, r.rate_period,"
    " make_interval(secs => %s), %s, %s, %s, %s"
    " FROM pglane.parse_rate(coalesce(%s, 'none')) r RETURNING id"
)

TRY_SLOT: LiteralString = "SELECT pg_try_advisory_lock(%s, %s)"
WAIT_SLOT: LiteralString = "SELECT pg_advisory_lock(%s, %s)"
RELEASE_SLOT: LiteralString = "SELECT pg_advisory_unlock(%s, %s)"
# A shared session's standbys (pglane.shared): for each lane of %(lanes)s (with %(slots)s slots), the first of its
# slots this session does not hold already (%(held)s: lane id << 32 | slot) that a try-lock takes, or NULL; at
# most one per lane. CASE orders the test before the lock (SQL does not promise to evaluate AND left to right).
STANDBY_TRY: LiteralString = (
    "SELECT array_agg((SELECT s.slot FROM generate_series(1, w.slots) AS s(slot)"
    " WHERE CASE WHEN (w.lane_id::bigint << 32 | s.slot) = ANY (%(held)s::bigint[]) THEN false"
    " ELSE pg_try_advisory_lock(w.lane_id, s.slot) END LIMIT 1) ORDER BY w.n) AS taken"
    " FROM unnest(%(lanes)s::integer[], %(slots)s::integer[]) WITH ORDINALITY AS w(lane_id, slots, n)")
# A shared session's poll (pglane.shared): which of the lanes %s have a queued job whose run_after has come.
DUE_LANES: LiteralString = (
    "SELECT coalesce(array_agg(l.id), '{}') AS due FROM pglane.lanes l WHERE l.id = ANY (%s::integer[])"
    " AND EXISTS (SELECT 1 FROM pglane.jobs j WHERE j.lane = l.name AND j.in_queue AND j.run_after <= now())")
# Which slot this session holds, for the claim to check first (an order, never a permission).
SLOT_HINT: LiteralString = "SELECT set_config('pglane.slot', %s, false)"

LANE_STATUS: LiteralString = "SELECT * FROM pglane.lane_status ORDER BY lane"
JOB_STATUS: LiteralString = "SELECT * FROM pglane.job_status WHERE job_id = %s"
# job_status's columns, in its order, but queue_position: a listing takes it from queue_positions().
JOB_COLUMNS: LiteralString = (
    "s.job_id, s.lane, s.status, s.created_at, s.run_after, s.started_at, s.finished_at, s.waiting_for_worker,"
    " p.queue_position, s.attempts, s.seq, s.idempotency_key, s.last_error, s.attempt_id, s.attempt_status,"
    " s.next_safe_action, s.result, s.enqueued_by, s.group_key, s.priority, s.job_timeout"
)
JOBS: LiteralString = (  # queued jobs first, in the order they will be served (eligible ones in service
    # order, then scheduled ones by run_after); the rest newest first. The positions come from one ordered
    # pass over the queue (pglane.queue_positions), not one count per listed row, so listing N queued jobs
    # costs O(N); job_status's own queue_position is not named, so it is never computed. Not read at all
    # when the listing asks for jobs that are not queued.
    "SELECT " + JOB_COLUMNS + " FROM pglane.job_status s"
    " LEFT JOIN (SELECT * FROM pglane.queue_positions(%(lane)s)"
    "             WHERE coalesce(%(status)s::text, 'queued') = 'queued') p ON p.job_id = s.job_id"
    " WHERE (%(lane)s::text IS NULL OR s.lane = %(lane)s) AND (%(status)s::text IS NULL OR s.status = %(status)s)"
    " AND (%(group)s::text IS NULL OR s.group_key = %(group)s)"
    " ORDER BY s.status <> 'queued', CASE WHEN s.status = 'queued' THEN p.queue_position END,"
    " s.job_id DESC LIMIT %(limit)s"
)
ATTEMPTS: LiteralString = (
    "SELECT id, attempt_number, status, worker, backend_pid, backend_start, started_at, finished_at,"
    " lease_expires_at, seq, error FROM pglane.attempts WHERE job_id = %s ORDER BY attempt_number"
)
JOB_RESULT: LiteralString = "SELECT result FROM pglane.job_status WHERE job_id = %s"  # a producer's own jobs

# The worker's queue gauges (pglane.metrics): the lane's queued jobs, the age of the oldest, and its running
# attempts, read through the queue and running-attempt indexes so the cost does not grow with history.
QUEUE_GAUGES: LiteralString = (
    "SELECT count(*) AS queued, coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest,"
    " (SELECT count(*) FROM pglane.attempts a JOIN pglane.jobs r ON r.id = a.job_id"
    "   WHERE a.status = 'running' AND r.lane = %(lane)s) AS running,"
    " pglane.rate_window_use(%(lane)s) AS rate_window_used,"
    # paused: the fact the claim obeys (sql/pause.sql), which pglane_worker may read
    " EXISTS (SELECT 1 FROM pglane.lane_counters c JOIN pglane.lanes l ON l.id = c.lane_id"
    "   WHERE l.name = %(lane)s AND c.paused_until > now()) AS paused"
    " FROM pglane.jobs WHERE lane = %(lane)s AND in_queue"
)

# A lane's groups (tenants), the deepest queues first: queued, running, oldest wait, served last.
GROUP_STATUS: LiteralString = "SELECT * FROM pglane.group_status(%s, %s)"

# Waiting for a job's result (pglane.waiting): mark the job awaited (its completion then notifies
# DONE_CHANNEL with its id) and read where it is, in one statement; a pruned job's row says so.
AWAIT_JOB: LiteralString = "SELECT * FROM pglane.await_job(%s)"
LISTEN_DONE: LiteralString = "LISTEN pglane_done"
DONE_CHANNEL = "pglane_done"

# Lanes as `pglane lane list/show` print them: every setting under its command-line option's name, the
# timeouts in seconds (the rate as a limit and a period: the CLI writes it as '60/min').
LANE_SETTINGS: LiteralString = (
    "SELECT name, slots, extract(epoch FROM job_timeout)::float8 AS job_timeout,"
    " extract(epoch FROM lease_timeout)::float8 AS lease_timeout, max_attempts, max_queued,"
    " replace(takeover, '_', '-') AS takeover,"
    " rate_limit, extract(epoch FROM rate_period)::float8 AS rate_period,"
    " max_result_bytes, max_payload_bytes, extract(epoch FROM waiting_grace)::float8 AS waiting_grace,"
    " extract(epoch FROM retry_backoff)::float8 AS retry_backoff,"
    " extract(epoch FROM key_retention)::float8 AS key_retention, group_slots, max_deferrals,"
    " replace(on_retry_later, '_', '-') AS on_retry_later, pause_after_failures, created_at"
    " FROM pglane.lanes WHERE %(name)s::text IS NULL OR name = %(name)s ORDER BY name"
)
# `pglane lane delete`: in one transaction, the lane's row locked first (an enqueue's foreign key check
# then waits, and fails once the lane is gone), what it holds counted, then its attempts, its jobs and
# itself deleted (lanes_after_delete deletes its recorded starts; its counters rows cascade).
LOCK_LANE: LiteralString = "SELECT id FROM pglane.lanes WHERE name = %s FOR UPDATE"
LANE_HOLDINGS: LiteralString = (
    "SELECT count(*) FILTER (WHERE status = 'queued') AS queued,"
    " count(*) FILTER (WHERE status = 'running') AS running,"
    " count(*) FILTER (WHERE status NOT IN ('queued', 'running')) AS finished,"
    " (SELECT count(*) FROM pglane.attempts a JOIN pglane.jobs j ON j.id = a.job_id WHERE j.lane = %(name)s)"
    " AS attempts"
    " FROM pglane.jobs WHERE lane = %(name)s"
)
DELETE_LANE_ATTEMPTS: LiteralString = (
    "DELETE FROM pglane.attempts a USING pglane.jobs j WHERE a.job_id = j.id AND j.lane = %s"
)
DELETE_LANE_JOBS: LiteralString = "DELETE FROM pglane.jobs WHERE lane = %s"
DELETE_LANE: LiteralString = "DELETE FROM pglane.lanes WHERE name = %s"
# Whether the connected login is a member of a pglane role (before a hint suggests granting it).
HAS_ROLE: LiteralString = (
    "SELECT CASE WHEN to_regrole(%(role)s) IS NULL THEN false"
    " ELSE pg_has_role(current_user, %(role)s, 'MEMBER') END AS member"
)
# The sessions holding slots of a lane above a number (lane set --slots lowering it): a worker's session
# is named "pglane <worker name>" (application_name); pid is the server session's, not the worker's.
SLOTS_ABOVE: LiteralString = (
    "SELECT slot, pid, application_name FROM pglane.slot_sessions"
    " WHERE lane = %s AND granted AND slot > %s ORDER BY slot"
)

# A pause ends at a given moment, after a length, or (neither given) when a person resumes it.
PAUSE_LANE: LiteralString = (
    "SELECT pglane.pause_lane(%s, coalesce(%s, now() + make_interval(secs => %s), 'infinity'), %s) AS note")
RESUME_LANE: LiteralString = "SELECT pglane.resume_lane(%s) AS note"
