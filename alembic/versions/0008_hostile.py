"""Hostile input and hostile sessions: only the claimer writes an outcome, producers see their own
jobs, squatters on a slot are shown, claims never wait for a producer, payloads every consumer can
decode, errors and results of bounded size.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03

- attempts.token: a secret claim() returns to the claiming session; complete(), fail() and
  complete_and_claim() take it as p_token and refuse (PGL12) a caller that has neither it nor the
  claiming session. pglane_worker reads every column of attempts but the token.
- jobs.enqueued_by: the role that enqueued (pglane.caller(): its SET ROLE, else its login; set by
  the insert trigger, whatever the INSERT says).
  Row-level security lets a producer read only its own rows of pglane.jobs (ON CONFLICT included);
  job_status shows a producer only its jobs, and now carries `result` and `enqueued_by`. Jobs
  enqueued before this revision have no enqueued_by: only operators and workers see them.
- The queue depth of a bounded lane is now lane_admissions.admitted - lane_counters.left_queue
  (was lane_counters.queued): producers lock the first row, claims the second.
- lanes.max_result_bytes (16 MiB by default): the Python worker fails a larger result's attempt
  before sending it.
- lane_status shows every slot holder (`holders`) and counts `squatters`; slot_sessions is the view
  behind them.
- session_alive() and lane_consumers() run with a fixed search_path.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "views.sql")

ROLES = "pglane_producer, pglane_worker, pglane_operator"
ATTEMPT_COLUMNS = ("id, job_id, attempt_number, status, worker, backend_pid, backend_start, started_at, finished_at,"
                   " lease_expires_at, error, seq")


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE pglane.lanes ADD COLUMN max_result_bytes integer NOT NULL DEFAULT 16777216,
            ADD CONSTRAINT lane_max_result_range CHECK (max_result_bytes BETWEEN 1 AND 268435455);
        ALTER TABLE pglane.jobs ADD COLUMN enqueued_by text;
        ALTER TABLE pglane.attempts ADD COLUMN token uuid;
        COMMENT ON COLUMN pglane.attempts.token IS
            'the secret claim() handed the claiming session: complete() and fail() from elsewhere need it';

        CREATE TABLE pglane.lane_admissions (
            lane_id  integer PRIMARY KEY REFERENCES pglane.lanes (id) ON DELETE CASCADE,
            admitted bigint NOT NULL DEFAULT 0
        );
        INSERT INTO pglane.lane_admissions (lane_id, admitted) SELECT c.lane_id, c.queued FROM pglane.lane_counters c;
        ALTER TABLE pglane.lane_counters RENAME COLUMN queued TO left_queue;
        UPDATE pglane.lane_counters SET left_queue = 0;

        ALTER TYPE pglane.claimed ADD ATTRIBUTE token uuid;
        DROP FUNCTION pglane.complete(bigint, jsonb), pglane.fail(bigint, text, boolean),
                      pglane.complete_and_claim(bigint, jsonb, text, text), pglane.complete_impl(bigint, jsonb),
                      pglane.queue_delta(text, integer);

        """
    )
    apply_sql(revision, APPLIES)
    op.execute(
        f"""
        GRANT EXECUTE ON FUNCTION pglane.complete(bigint, jsonb, uuid), pglane.fail(bigint, text, boolean, uuid),
                                  pglane.complete_and_claim(bigint, jsonb, text, text, uuid)
            TO pglane_worker;
        GRANT EXECUTE ON FUNCTION pglane.sees_every_job(name), pglane.caller() TO {ROLES};
        GRANT SELECT ON pglane.slot_sessions TO pglane_operator;
        REVOKE SELECT ON pglane.attempts FROM pglane_worker;
        GRANT SELECT ({ATTEMPT_COLUMNS}) ON pglane.attempts TO pglane_worker;

        ALTER TABLE pglane.jobs ENABLE ROW LEVEL SECURITY;
        CREATE POLICY jobs_producer_reads_own ON pglane.jobs FOR SELECT TO pglane_producer
            USING (enqueued_by = pglane.caller());
        CREATE POLICY jobs_producer_inserts ON pglane.jobs FOR INSERT TO pglane_producer WITH CHECK (true);
        CREATE POLICY jobs_workers_and_operators ON pglane.jobs TO pglane_worker, pglane_operator USING (true);
        """
    )


def downgrade() -> None:
    op.execute(
        f"""
        DROP POLICY jobs_producer_reads_own ON pglane.jobs;
        DROP POLICY jobs_producer_inserts ON pglane.jobs;
        DROP POLICY jobs_workers_and_operators ON pglane.jobs;
        ALTER TABLE pglane.jobs DISABLE ROW LEVEL SECURITY;
        REVOKE SELECT ({ATTEMPT_COLUMNS}) ON pglane.attempts FROM pglane_worker;
        GRANT SELECT ON pglane.attempts TO pglane_worker;

        DROP VIEW pglane.lane_status, pglane.slot_sessions;
        DROP VIEW pglane.job_status;
        DROP FUNCTION pglane.complete(bigint, jsonb, uuid), pglane.fail(bigint, text, boolean, uuid),
                      pglane.complete_and_claim(bigint, jsonb, text, text, uuid),
                      pglane.complete_impl(bigint, jsonb, uuid), pglane.queue_left(text), pglane.queue_admit(text),
                      pglane.may_write(uuid, uuid, integer, timestamptz), pglane.not_the_claimer(bigint),
                      pglane.bounded_error(text), pglane.sees_every_job(name), pglane.caller();
        ALTER TYPE pglane.claimed DROP ATTRIBUTE token;

        ALTER TABLE pglane.lane_counters RENAME COLUMN left_queue TO queued;
        UPDATE pglane.lane_counters c SET queued = a.admitted - c.queued
          FROM pglane.lane_admissions a WHERE a.lane_id = c.lane_id;
        DROP TABLE pglane.lane_admissions;
        ALTER TABLE pglane.attempts DROP COLUMN token;
        ALTER TABLE pglane.jobs DROP COLUMN enqueued_by;
        ALTER TABLE pglane.lanes DROP COLUMN max_result_bytes;
        """
    )
    apply_sql("0007", ("lanes.sql", "claim.sql", "recover.sql"))
    apply_sql("0006", ("enqueue.sql",))
    apply_sql("0007", ("views.sql",))
    op.execute(
        """
        GRANT EXECUTE ON FUNCTION pglane.complete(bigint, jsonb), pglane.fail(bigint, text, boolean),
                                  pglane.complete_and_claim(bigint, jsonb, text, text)
            TO pglane_worker;
        GRANT SELECT ON pglane.lane_status, pglane.job_status TO pglane_operator;
        GRANT SELECT ON pglane.job_status TO pglane_producer;
        """
    )
