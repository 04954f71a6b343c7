"""pglane core: lanes, jobs, attempts, the lane counters, and the functions, triggers and views of sql/.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Invariants kept here, next to the state they protect:
- a status is text in a DOMAIN that carries the named CHECK (job_status_valid, attempt_status_valid):
  cheaper per statement than a table CHECK on the hot tables (see research/performance.md), still
  text and still a named CHECK that alembic owns;
- lane_lease_exceeds_job_timeout: a lane can never hand a running job to a second worker because its
  lease ran out before its job timeout;
- lanes.id is an identity that is never reused: it is the slot lock key and the NOTIFY channel;
- attempt_finished_when_not_running: only a running attempt lacks finished_at;
- (job_id, attempt_number) is unique, and the job's latest attempt is the one whose number equals
  jobs.attempts: the guard of complete() and fail().

Function bodies live in sql/ and are applied from there (pglane.schema.sql_text). A later revision
that changes a function re-applies sql/; one that changes a table does it in its own file. This
revision applies today's sql/, with the column jobs.in_queue (added by 0003) spelled as the status
test it is generated from, so that a fresh database can stop at any revision.
"""

from alembic import op
from pglane.schema import SQL_FILES, sql_text

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TABLES = r"""
CREATE DOMAIN pglane.job_state AS text
    CONSTRAINT job_status_valid CHECK (VALUE IN ('queued', 'running', 'done', 'failed', 'cancelled'));
CREATE DOMAIN pglane.attempt_state AS text
    CONSTRAINT attempt_status_valid CHECK (VALUE IN ('running', 'done', 'failed', 'lost', 'timed_out'));

CREATE TABLE pglane.lanes (
    id                integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name              text        NOT NULL CONSTRAINT lanes_name_key UNIQUE,
    slots             integer     NOT NULL DEFAULT 1,
    job_timeout       interval    NOT NULL DEFAULT '600 seconds',
    lease_timeout     interval    NOT NULL DEFAULT '660 seconds',
    max_attempts      integer     NOT NULL DEFAULT 1,
    max_queued        integer,
    waiting_grace     interval    NOT NULL DEFAULT '5 seconds',
    max_payload_bytes integer     NOT NULL DEFAULT 1048576,
    retry_backoff     interval    NOT NULL DEFAULT '2 seconds',
    created_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT lane_name_valid CHECK (name ~ '^[a-z][a-z0-9_-]{0,47}$'),
    CONSTRAINT lane_slots_range CHECK (slots BETWEEN 1 AND 1000),
    CONSTRAINT lane_job_timeout_range CHECK (job_timeout BETWEEN '1 second' AND '7 days'),
    CONSTRAINT lane_lease_exceeds_job_timeout CHECK (lease_timeout > job_timeout),
    CONSTRAINT lane_lease_timeout_range CHECK (lease_timeout <= '8 days'),
    CONSTRAINT lane_max_attempts_range CHECK (max_attempts BETWEEN 1 AND 100),
    CONSTRAINT lane_max_queued_range CHECK (max_queued IS NULL OR max_queued >= 1),
    CONSTRAINT lane_waiting_grace_range CHECK (waiting_grace BETWEEN '0' AND '1 hour'),
    CONSTRAINT lane_max_payload_range CHECK (max_payload_bytes BETWEEN 1 AND 67108864),
    CONSTRAINT lane_retry_backoff_range CHECK (retry_backoff BETWEEN '0' AND '1 hour')
);
COMMENT ON TABLE pglane.lanes IS
    'A scarce capability: slots consumer places, held by session advisory locks keyed (id, slot).';

-- Hot counters kept off pglane.lanes so that a claim does not evaluate the lanes CHECKs.
-- last_seq: the lane's gapless claim sequence; bumped under this row's lock by every claim, so a
--           rolled-back claim rolls its number back and numbers follow commit order.
-- queued:   the lane's queued jobs, maintained only while lanes.max_queued is set (bounded lanes);
--           producers of a bounded lane serialise on this row, which is what makes the bound hold.
CREATE TABLE pglane.lane_counters (
    lane_id  integer PRIMARY KEY REFERENCES pglane.lanes (id) ON DELETE CASCADE,
    last_seq bigint NOT NULL DEFAULT 0,
    queued   bigint NOT NULL DEFAULT 0
);

CREATE TABLE pglane.jobs (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lane            text               NOT NULL REFERENCES pglane.lanes (name),
    payload         jsonb              NOT NULL DEFAULT '{}',
    idempotency_key text,
    status          pglane.job_state   NOT NULL DEFAULT 'queued',
    run_after       timestamptz        NOT NULL DEFAULT now(),
    created_at      timestamptz        NOT NULL DEFAULT now(),
    started_at      timestamptz,
    finished_at     timestamptz,
    attempts        integer            NOT NULL DEFAULT 0,
    result          jsonb,
    last_error      text,
    seq             bigint,
    -- A full (not partial) unique constraint, so that a plain
    -- INSERT ... ON CONFLICT (lane, idempotency_key) DO NOTHING can infer it. NULL keys never clash.
    CONSTRAINT jobs_lane_idempotency_key_key UNIQUE (lane, idempotency_key)
);
-- The claim reads this index in service order; it holds only queued rows, so its size follows the
-- backlog, not the history.
CREATE INDEX jobs_queue ON pglane.jobs (lane, created_at, id) WHERE status = 'queued';
-- Recovery and the views find running jobs here (at most `slots` per lane).
CREATE INDEX jobs_running ON pglane.jobs (lane) WHERE status = 'running';
-- Dead queue-index entries slow every claim: vacuum the hot table early.
ALTER TABLE pglane.jobs SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000,
                             autovacuum_vacuum_insert_scale_factor = 0.05, fillfactor = 90);

CREATE TABLE pglane.attempts (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id           bigint                NOT NULL REFERENCES pglane.jobs (id) ON DELETE CASCADE,
    attempt_number   integer               NOT NULL,
    status           pglane.attempt_state  NOT NULL DEFAULT 'running',
    worker           text                  NOT NULL,
    backend_pid      integer               NOT NULL,
    backend_start    timestamptz           NOT NULL,
    started_at       timestamptz           NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    lease_expires_at timestamptz           NOT NULL,
    error            text,
    seq              bigint                NOT NULL,
    CONSTRAINT attempt_number_unique UNIQUE (job_id, attempt_number),
    CONSTRAINT attempt_finished_when_not_running CHECK ((status = 'running') = (finished_at IS NULL))
);
ALTER TABLE pglane.attempts SET (fillfactor = 90);
"""


def upgrade() -> None:
    op.execute(TABLES)
    for name in SQL_FILES:  # today's sql/, with jobs.in_queue (0003) spelled as what it is generated from
        op.execute(sql_text(name, before_in_queue=True))


def downgrade() -> None:
    # Everything of pglane but alembic's own version table, which alembic empties afterwards;
    # pglane.schema.downgrade() then drops the empty schema.
    op.execute(
        """
        DROP VIEW IF EXISTS pglane.job_status, pglane.lane_status CASCADE;
        DROP TABLE IF EXISTS pglane.attempts, pglane.jobs, pglane.lane_counters, pglane.lanes CASCADE;
        DROP DOMAIN IF EXISTS pglane.job_state, pglane.attempt_state CASCADE;
        DO $$
        DECLARE f regprocedure;
        BEGIN
            FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
                     WHERE p.pronamespace = 'pglane'::regnamespace
            LOOP
                EXECUTE format('DROP FUNCTION %s CASCADE', f);
            END LOOP;
        END $$;
        """
    )
