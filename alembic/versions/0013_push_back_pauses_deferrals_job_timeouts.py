"""When the capability pushes back (#33): "not paid, try later", pausing a lane, a breaker, a job's own
timeout.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-06

- attempts may end `deferred` (pglane.defer, a handler's RetryLater): the job is queued again for
  later and the attempt does not count toward max_attempts; jobs.deferrals_in_row counts a run of
  them, which lanes.max_deferrals (default 20) bounds; lanes.on_retry_later ('lane', the default, or
  'job') says whether a deferral pauses the whole lane until the same moment.
- A lane may be paused: lane_counters.paused_until, which the claim's take obeys under the counters
  row lock (sql/pause.sql), and lane_pauses, the record (since when, what, by whom, why, which
  attempts; who resumed it; its end is the counters row's alone). pause_lane and resume_lane for the operator.
- The breaker: lanes.pause_after_failures (NULL: none); lane_counters.failures_in_row and
  failed_attempts, counted by fail() and ended by a success or a resume.
- jobs.job_timeout: a job's own call timeout, at most its lane's (checked at insert); the claim
  hands the call's timeout to the worker (pglane.claimed.job_timeout, seconds).
- enqueue() gains p_job_timeout; producers may INSERT job_timeout.

Applies pause.sql (new) and the files it changes: lanes.sql, rate.sql, jobs.sql, claim.sql,
views.sql, roles.sql. Downgrade restores their previous text (alembic/frozen/0011/, and 0010/ for
rate.sql, which 0011 and 0012 left alone); a deferred attempt becomes failed, its reason kept.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "rate.sql", "pause.sql", "jobs.sql", "claim.sql", "views.sql", "roles.sql")
NEW_FILES = ("pause.sql",)

BEFORE = """
    ALTER DOMAIN pglane.attempt_state DROP CONSTRAINT attempt_status_valid;
    ALTER DOMAIN pglane.attempt_state ADD CONSTRAINT attempt_status_valid
        CHECK (VALUE IN ('running', 'done', 'failed', 'lost', 'timed_out', 'deferred'));
    ALTER TABLE pglane.lanes
        ADD COLUMN max_deferrals integer NOT NULL DEFAULT 20,
        ADD CONSTRAINT lane_max_deferrals_range CHECK (max_deferrals BETWEEN 0 AND 10000),
        ADD COLUMN on_retry_later text NOT NULL DEFAULT 'lane',
        ADD CONSTRAINT lane_on_retry_later_valid CHECK (on_retry_later IN ('job', 'lane')),
        ADD COLUMN pause_after_failures integer,
        ADD CONSTRAINT lane_pause_after_failures_range CHECK (pause_after_failures BETWEEN 1 AND 10000);
    COMMENT ON COLUMN pglane.lanes.max_deferrals IS
        'a job deferred (RetryLater) this many times in a row fails with the reason';
    COMMENT ON COLUMN pglane.lanes.on_retry_later IS
        'lane: a deferral pauses the whole lane until the job''s new run_after; job: only the job waits';
    COMMENT ON COLUMN pglane.lanes.pause_after_failures IS
        'the breaker: after this many failed attempts in a row the lane pauses until resumed; NULL: none';
    ALTER TABLE pglane.lane_counters ADD COLUMN paused_until timestamptz,
        ADD COLUMN failures_in_row integer NOT NULL DEFAULT 0, ADD COLUMN failed_attempts bigint[];
    COMMENT ON COLUMN pglane.lane_counters.paused_until IS
        'no job of the lane starts before this (infinity: until resumed); the claim''s take checks it (pause.sql)';
    ALTER TABLE pglane.jobs ADD COLUMN job_timeout interval, ADD COLUMN deferrals_in_row integer NOT NULL DEFAULT 0;
    COMMENT ON COLUMN pglane.jobs.job_timeout IS 'the job''s own call timeout, at most its lane''s; NULL: the lane''s';
    COMMENT ON COLUMN pglane.jobs.deferrals_in_row IS 'the job''s latest attempts deferred in a row (max_deferrals)';
    CREATE TABLE pglane.lane_pauses (
        lane_id      integer     PRIMARY KEY REFERENCES pglane.lanes (id) ON DELETE CASCADE,
        paused_at    timestamptz NOT NULL,
        kind         text        NOT NULL CONSTRAINT lane_pause_kind_valid
                                 CHECK (kind IN ('person', 'retry_later', 'breaker')),
        paused_by    text,
        reason       text        NOT NULL,
        attempts     bigint[],
        resumed_at   timestamptz,
        resumed_by   text
    );
    COMMENT ON TABLE pglane.lane_pauses IS 'each lane''s latest pause: what, by whom, why (sql/pause.sql)';
    ALTER TYPE pglane.claimed ADD ATTRIBUTE job_timeout double precision;
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer);
"""

UNDO = """
    DROP VIEW pglane.job_status, pglane.lane_status;
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer, interval);
    DROP FUNCTION pglane.defer(bigint, interval, text, uuid), pglane.deferrals(bigint),
        pglane.outcome_job(bigint, uuid),
        pglane.pause_for(integer, timestamptz, interval, text, text, text, bigint[]),
        pglane.pause_lane(text, timestamptz, text), pglane.resume_lane(text), pglane.pause_wait(integer),
        pglane.pause_note(text, timestamptz, text, text, text, bigint[]),
        pglane.breaker_failure(text, bigint, text), pglane.breaker_success(text);
    ALTER TYPE pglane.claimed DROP ATTRIBUTE job_timeout;
    DROP TABLE pglane.lane_pauses;
    ALTER TABLE pglane.jobs DROP COLUMN job_timeout, DROP COLUMN deferrals_in_row;
    ALTER TABLE pglane.lane_counters DROP COLUMN paused_until, DROP COLUMN failures_in_row,
        DROP COLUMN failed_attempts;
    ALTER TABLE pglane.lanes DROP COLUMN max_deferrals, DROP COLUMN on_retry_later, DROP COLUMN pause_after_failures;
    ALTER DOMAIN pglane.attempt_state DROP CONSTRAINT attempt_status_valid;
    UPDATE pglane.attempts SET status = 'failed' WHERE status = 'deferred';
    ALTER DOMAIN pglane.attempt_state ADD CONSTRAINT attempt_status_valid
        CHECK (VALUE IN ('running', 'done', 'failed', 'lost', 'timed_out'));
"""


def upgrade() -> None:
    op.execute(BEFORE)
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    op.execute(UNDO)
    apply_sql("0010", ["rate.sql"])
    apply_sql("0011", ["lanes.sql", "jobs.sql", "claim.sql", "views.sql", "roles.sql"])
