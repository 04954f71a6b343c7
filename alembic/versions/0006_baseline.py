"""pglane's baseline: lanes, jobs, attempts, the lane counters, the three group roles and their grants,
and the functions, triggers and views of sql/. A squash of revisions 0001-0006 (the releases before
it), under the id of the last of them, so that a database already at 0006 is at this baseline.

Revision ID: 0006
Revises:
Create Date: 2026-12-03

How revisions own their text (pglane.schema.sql_text): each revision lists in APPLIES the sql/ files
it applies, only those it changes. The newest revision to apply a file reads it from sql/; a revision
that changes a file again first copies the older revision's text to alembic/frozen/<revision>/, so
that what a revision installs never changes once written (tests/test_schema.py checks the rule, and
that every upgrade and downgrade path ends in the same schema as a fresh install at that revision).

Invariants kept here, next to the state they protect:
- a status is text in a DOMAIN that carries the named CHECK (job_status_valid, attempt_status_valid):
  cheaper per statement than a table CHECK on the hot tables (see research/performance.md), still
  text and still a named CHECK that alembic owns;
- lane_lease_exceeds_job_timeout: a lane can never hand a running job to a second worker because its
  lease ran out before its job timeout;
- lanes.id is an identity that is never reused: it is the slot lock key and the NOTIFY channel;
- attempt_finished_when_not_running: only a running attempt lacks finished_at;
- (job_id, attempt_number) is unique, and the job's latest attempt is the one whose number equals
  jobs.attempts: the guard of complete() and fail();
- jobs.in_queue is generated from status: no writer can make it disagree, and the queue index keyed
  on it lets a completion (running -> done) be a HOT update;
- nobody but the owner may UPDATE or DELETE jobs and attempts; EXECUTE on pglane's functions is
  revoked from PUBLIC (by apply_sql, after every revision's functions); every function a role may
  call that writes is SECURITY DEFINER with a fixed search_path (see sql/).

Roles are cluster-wide while pglane's schema is per database: they are created only when missing (a
concurrent migration of another database that creates them first is not an error), and a downgrade
keeps them, since other databases may still use them. Creating them needs CREATEROLE; without it
(PGL11) an administrator creates the three NOLOGIN roles first.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0006"
down_revision = None
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql")

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
    in_queue        boolean GENERATED ALWAYS AS (status = 'queued') STORED,
    -- A full (not partial) unique constraint, so that a plain
    -- INSERT ... ON CONFLICT (lane, idempotency_key) DO NOTHING can infer it. NULL keys never clash.
    CONSTRAINT jobs_lane_idempotency_key_key UNIQUE (lane, idempotency_key)
);
COMMENT ON COLUMN pglane.jobs.in_queue IS
    'status = ''queued'', kept apart so that the queue index does not depend on status';
-- The claim reads this index in service order; it holds only queued rows, so its size follows the
-- backlog, not the history. Keyed on in_queue, not status: a completion changes no indexed column.
CREATE INDEX jobs_queue ON pglane.jobs (lane, created_at, id) WHERE in_queue;
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
-- Recovery and the views find running attempts here (at most `slots` per lane).
CREATE INDEX attempts_running ON pglane.attempts (job_id) WHERE status = 'running';
"""

CREATE_ROLES = r"""
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['pglane_producer', 'pglane_worker', 'pglane_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN NULL;  -- created meanwhile elsewhere
                WHEN insufficient_privilege THEN
                    RAISE EXCEPTION USING ERRCODE = 'PGL11',
                        MESSAGE = format('cannot create role %I: the migrating role lacks CREATEROLE', r),
                        HINT = 'run pglane migrate as a role with CREATEROLE, or have an administrator run: '
                               'CREATE ROLE pglane_producer NOLOGIN; CREATE ROLE pglane_worker NOLOGIN; '
                               'CREATE ROLE pglane_operator NOLOGIN;';
            END;
        END IF;
    END LOOP;
END $$;
"""

GRANTS = r"""
REVOKE ALL ON ALL TABLES IN SCHEMA pglane FROM PUBLIC;

GRANT USAGE ON SCHEMA pglane TO pglane_producer, pglane_worker, pglane_operator;
GRANT SELECT ON pglane.alembic_version TO pglane_producer, pglane_worker, pglane_operator;
-- The views call these read-only helpers, and a view's functions are checked as the querying user.
GRANT EXECUTE ON FUNCTION pglane.session_alive(integer, timestamptz, integer, integer),
                          pglane.lane_consumers(integer, integer)
    TO pglane_producer, pglane_worker, pglane_operator;

-- Producers: enqueue (the function or a plain INSERT of the four input columns) and read job status.
GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz) TO pglane_producer;
GRANT INSERT (lane, payload, idempotency_key, run_after) ON pglane.jobs TO pglane_producer;
-- INSERT ... ON CONFLICT (lane, idempotency_key) DO NOTHING reads the conflict target's columns.
GRANT SELECT (lane, idempotency_key) ON pglane.jobs TO pglane_producer;
GRANT SELECT ON pglane.job_status TO pglane_producer;

-- Workers: claim, complete, fail, recover; read their lane, its jobs and their attempts (the
-- worker's queue gauges count running attempts).
GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.complete(bigint, jsonb),
                          pglane.fail(bigint, text, boolean), pglane.complete_and_claim(bigint, jsonb, text, text),
                          pglane.recover(text)
    TO pglane_worker;
GRANT SELECT ON pglane.lanes, pglane.jobs, pglane.attempts TO pglane_worker;

-- Operators: read every view and the history; decide (retry, cancel), recover and prune.
GRANT SELECT ON pglane.lanes, pglane.jobs, pglane.attempts, pglane.lane_status, pglane.job_status,
                pglane.running_attempts
    TO pglane_operator;
GRANT EXECUTE ON FUNCTION pglane.retry(bigint), pglane.cancel(bigint), pglane.recover(text),
                          pglane.stuck_attempts(text), pglane.prune(interval, text, boolean)
    TO pglane_operator;
"""


def upgrade() -> None:
    op.execute(TABLES)
    apply_sql(revision, APPLIES)
    op.execute(CREATE_ROLES)
    op.execute(GRANTS)


def downgrade() -> None:
    # Everything of pglane but alembic's own version table, which alembic empties afterwards;
    # pglane.schema.downgrade() then drops the empty schema. The roles stay (see above).
    op.execute(
        """
        REVOKE ALL ON SCHEMA pglane FROM pglane_producer, pglane_worker, pglane_operator;
        REVOKE ALL ON pglane.alembic_version FROM pglane_producer, pglane_worker, pglane_operator;
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
