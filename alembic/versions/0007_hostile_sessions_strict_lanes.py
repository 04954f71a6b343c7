"""Hostile sessions and strict lanes on top of the baseline, with SQL said once and the operator's
surface at scale. One revision: none of its parts was ever released on its own.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

SQL said once
- pglane.slot_holders (view): every advisory lock on a lane's slot key; session_alive() and
  lane_consumers() read it. pglane.requeue_or_fail() serves fail() and recover() (lane_full_note()
  goes); pglane.decided_job() opens retry() and cancel(); pglane.claimed is the one claim row type.

Hostile sessions
- attempts.token: the secret claim() returns to its session; complete(), fail() and
  complete_and_claim() take it as p_token and refuse (PGL12) a caller with neither it nor the
  claiming session. pglane_worker reads every column of attempts but the token.
- jobs.enqueued_by (pglane.caller()); row-level security lets a producer read only its own rows of
  pglane.jobs; job_status shows a producer only its jobs (security_barrier) and carries `result` and
  `enqueued_by`. Jobs enqueued before this revision have no enqueued_by: producers do not see them.
- A bounded lane's depth is lane_admissions.admitted - lane_counters.left_queue (was
  lane_counters.queued): producers lock the first row, claims the second.
- lanes.max_result_bytes (16 MiB); lane_status shows slot holders and squatters (slot_sessions).

Strict lanes
- lanes.takeover ('immediate' or 'after_lease', CHECK lane_takeover_valid); attempts
  lease_released_at / lease_released_by (pglane.release_lease); attempts_lost_lease; the claim row's
  wait_seconds, returned by pglane.claim_or_wait(), the worker's claim.

Scale
- enqueue(..., p_if_full): 'skip' returns NULL on a full bounded lane, nothing written, no error;
  pglane.prune_batch(): one bounded, resumable step of a prune.

Functions whose signature or return type changes are dropped and re-created, and their grants given
again. Downgrade restores the baseline's text from alembic/frozen/0006/.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql")

ROLES = "pglane_producer, pglane_worker, pglane_operator"
ATTEMPT_COLUMNS = ("id, job_id, attempt_number, status, worker, backend_pid, backend_start, started_at, finished_at,"
                   " lease_expires_at, error, seq, lease_released_at, lease_released_by")
POLICIES = """
ALTER TABLE pglane.jobs ENABLE ROW LEVEL SECURITY;
CREATE POLICY jobs_producer_reads_own ON pglane.jobs FOR SELECT TO pglane_producer
    USING (enqueued_by = pglane.caller());
CREATE POLICY jobs_producer_inserts ON pglane.jobs FOR INSERT TO pglane_producer WITH CHECK (true);
CREATE POLICY jobs_workers_and_operators ON pglane.jobs TO pglane_worker, pglane_operator USING (true);
"""


def upgrade() -> None:
    op.execute(
        """
        DROP FUNCTION pglane.complete_and_claim(bigint, jsonb, text, text), pglane.claim(text, text),
                      pglane.claim_impl(text, text), pglane.complete(bigint, jsonb),
                      pglane.fail(bigint, text, boolean), pglane.complete_impl(bigint, jsonb),
                      pglane.queue_delta(text, integer), pglane.lane_full_note(text, bigint),
                      pglane.enqueue(text, jsonb, text, timestamptz);

        ALTER TABLE pglane.lanes ADD COLUMN max_result_bytes integer NOT NULL DEFAULT 16777216,
            ADD CONSTRAINT lane_max_result_range CHECK (max_result_bytes BETWEEN 1 AND 268435455),
            ADD COLUMN takeover text NOT NULL DEFAULT 'immediate',
            ADD CONSTRAINT lane_takeover_valid CHECK (takeover IN ('immediate', 'after_lease'));
        ALTER TABLE pglane.jobs ADD COLUMN enqueued_by text;
        ALTER TABLE pglane.attempts ADD COLUMN token uuid, ADD COLUMN lease_released_at timestamptz,
            ADD COLUMN lease_released_by text;
        COMMENT ON COLUMN pglane.attempts.token IS
            'the secret claim() handed the claiming session: complete() and fail() from elsewhere need it';
        CREATE INDEX attempts_lost_lease ON pglane.attempts (lease_expires_at)
            WHERE status = 'lost' AND lease_released_at IS NULL;

        CREATE TABLE pglane.lane_admissions (
            lane_id  integer PRIMARY KEY REFERENCES pglane.lanes (id) ON DELETE CASCADE,
            admitted bigint NOT NULL DEFAULT 0
        );
        INSERT INTO pglane.lane_admissions (lane_id, admitted) SELECT c.lane_id, c.queued FROM pglane.lane_counters c;
        ALTER TABLE pglane.lane_counters RENAME COLUMN queued TO left_queue;
        UPDATE pglane.lane_counters SET left_queue = 0;

        CREATE TYPE pglane.claimed AS (
            job_id bigint, attempt_id bigint, attempt_number integer, seq bigint, lane text, payload jsonb,
            idempotency_key text, lease_expires_at timestamptz, completed boolean, token uuid,
            wait_seconds double precision);
        """
    )
    apply_sql(revision, APPLIES)
    op.execute(
        f"""
        GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.claim_or_wait(text, text),
                                  pglane.complete(bigint, jsonb, uuid), pglane.fail(bigint, text, boolean, uuid),
                                  pglane.complete_and_claim(bigint, jsonb, text, text, uuid)
            TO pglane_worker;
        GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text) TO pglane_producer;
        GRANT EXECUTE ON FUNCTION pglane.sees_every_job(name), pglane.caller(), pglane.in_flight(text),
                                  pglane.lease_wait_note(text, bigint, timestamptz)
            TO {ROLES};
        GRANT EXECUTE ON FUNCTION pglane.release_lease(bigint),
                                  pglane.prune_batch(interval, text, boolean, bigint, integer)
            TO pglane_operator;
        GRANT SELECT ON pglane.slot_holders TO {ROLES};
        GRANT SELECT ON pglane.slot_sessions TO pglane_operator;
        REVOKE SELECT ON pglane.attempts FROM pglane_worker;
        GRANT SELECT ({ATTEMPT_COLUMNS}) ON pglane.attempts TO pglane_worker;
        {POLICIES}
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

        DROP VIEW pglane.lane_status, pglane.slot_sessions, pglane.job_status;
        DROP FUNCTION pglane.claim(text, text), pglane.claim_or_wait(text, text), pglane.claim_impl(text, text),
                      pglane.complete(bigint, jsonb, uuid), pglane.fail(bigint, text, boolean, uuid),
                      pglane.complete_and_claim(bigint, jsonb, text, text, uuid),
                      pglane.complete_impl(bigint, jsonb, uuid), pglane.queue_left(text),
                      pglane.may_write(uuid, uuid, integer, timestamptz), pglane.not_the_claimer(bigint),
                      pglane.bounded_error(text), pglane.sees_every_job(name), pglane.caller(),
                      pglane.requeue_or_fail(bigint, text, integer, text, text, text, interval),
                      pglane.decided_job(bigint, text[], text), pglane.in_flight(text),
                      pglane.release_lease(bigint), pglane.lease_wait_note(text, bigint, timestamptz),
                      pglane.lane_is_full(text), pglane.prune_batch(interval, text, boolean, bigint, integer),
                      pglane.enqueue(text, jsonb, text, timestamptz, text);
        DROP TYPE pglane.claimed;

        ALTER TABLE pglane.lane_counters RENAME COLUMN left_queue TO queued;
        UPDATE pglane.lane_counters c SET queued = a.admitted - c.queued
          FROM pglane.lane_admissions a WHERE a.lane_id = c.lane_id;
        DROP TABLE pglane.lane_admissions;
        DROP INDEX pglane.attempts_lost_lease;
        ALTER TABLE pglane.attempts DROP COLUMN token, DROP COLUMN lease_released_at,
            DROP COLUMN lease_released_by;
        ALTER TABLE pglane.jobs DROP COLUMN enqueued_by;
        ALTER TABLE pglane.lanes DROP COLUMN max_result_bytes, DROP COLUMN takeover;
        """
    )
    apply_sql("0006", APPLIES)
    op.execute(
        """
        DROP VIEW pglane.slot_holders;
        GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.complete(bigint, jsonb),
                                  pglane.fail(bigint, text, boolean),
                                  pglane.complete_and_claim(bigint, jsonb, text, text)
            TO pglane_worker;
        GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz) TO pglane_producer;
        GRANT SELECT ON pglane.lane_status, pglane.job_status TO pglane_operator;
        GRANT SELECT ON pglane.job_status TO pglane_producer;
        """
    )
