"""Tenants in a lane (#32): a job's group and priority, a per-group limit, fair service between groups.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06

- jobs.group_key (1 to 255 characters; NULL: the lane's shared group) and jobs.priority (higher first,
  default 0), both settable by a producer's plain INSERT; jobs.fair_rank, the job's round among its
  lane's groups, set by jobs_before_insert (sql/groups.sql), and lane_counters.served_rank, the lane's
  current round, bumped by the claim's take.
- lanes.group_slots: at most this many running jobs of one group (NULL: no limit), counted by the
  claim under the counters row lock (full_groups) and passed over by its pick.
- jobs_queue is keyed in service order: (lane, priority DESC, fair_rank, created_at, id); jobs already
  queued keep their order (rank 0, then created_at and id). jobs_group_queue, (lane, coalesce(group_key,
  ''), fair_rank) WHERE in_queue, finds a group's latest queued round at enqueue (sql/groups.sql says
  why it is keyed so) and counts the waiting groups.
- lane_groups: when each group last had a job started (group_status's served_last).
- The claim's pick and take take the job as a pglane.picked (id, cost, fair_rank, group_key); enqueue()
  gains p_group and p_priority; set_lane accepts group_slots, its parsing moved to lane_with;
  jobs_before_insert's payload checks moved to check_payload (no change in what they refuse);
  job_status and lane_status gain their group columns (at the end).

Applies groups.sql (new) and the files it changes: lanes.sql, jobs.sql, claim.sql, views.sql, roles.sql.
Downgrade restores 0010's text from alembic/frozen/0010/.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

APPLIES = ("groups.sql", "lanes.sql", "jobs.sql", "claim.sql", "views.sql", "roles.sql")
NEW_FILES = ("groups.sql",)

BEFORE = """
    -- A domain, not a table CHECK, as pglane.job_cost (0008): a table CHECK is evaluated again on every
    -- UPDATE of a job (the claim's and the completion's: some 75,000 instructions a job, measured by
    -- bench.lab.claim_revisions), a domain's only where a group is written.
    CREATE DOMAIN pglane.job_group AS text
        CONSTRAINT job_group_1_to_255_characters CHECK (length(VALUE) BETWEEN 1 AND 255);
    ALTER TABLE pglane.jobs ADD COLUMN group_key pglane.job_group, ADD COLUMN priority integer NOT NULL DEFAULT 0,
        ADD COLUMN fair_rank bigint NOT NULL DEFAULT 0;
    COMMENT ON COLUMN pglane.jobs.group_key IS
        'the tenant the job belongs to (1 to 255 characters); NULL: the lane''s shared group';
    COMMENT ON COLUMN pglane.jobs.priority IS 'a higher priority starts first; default 0';
    COMMENT ON COLUMN pglane.jobs.fair_rank IS
        'the job''s round among its lane''s groups, set at enqueue (sql/groups.sql): service order is'
        ' priority DESC, fair_rank, created_at, id';
    ALTER TABLE pglane.lanes ADD COLUMN group_slots integer,
        ADD CONSTRAINT lane_group_slots_range CHECK (group_slots BETWEEN 1 AND 1000);
    COMMENT ON COLUMN pglane.lanes.group_slots IS
        'at most this many running jobs of one group, cluster-wide; NULL: no limit per group';
    ALTER TABLE pglane.lane_counters ADD COLUMN served_rank bigint NOT NULL DEFAULT 0;
    COMMENT ON COLUMN pglane.lane_counters.served_rank IS 'the lane''s current round: the rank of its latest start';
    CREATE TABLE pglane.lane_groups (
        lane_id   integer     NOT NULL REFERENCES pglane.lanes (id) ON DELETE CASCADE,
        group_key text        NOT NULL,
        served_at timestamptz NOT NULL,
        PRIMARY KEY (lane_id, group_key)
    );
    COMMENT ON TABLE pglane.lane_groups IS 'when each group of a lane last had a job started (group_status)';
    CREATE TYPE pglane.picked AS (id bigint, cost integer, fair_rank bigint, group_key text);
    COMMENT ON TYPE pglane.picked IS 'the job the claim''s pick chose, as its take needs it (sql/claim.sql)';
    DROP INDEX pglane.jobs_queue;
    CREATE INDEX jobs_queue ON pglane.jobs (lane, priority DESC, fair_rank, created_at, id) WHERE in_queue;
    CREATE INDEX jobs_group_queue ON pglane.jobs (lane, (coalesce(group_key, '')), fair_rank) WHERE in_queue;
    -- New signatures: the old ones go (enqueue's would make a call with defaults ambiguous).
    DROP FUNCTION pglane.pick(text, integer);
    DROP FUNCTION pglane.take(pglane.lanes, bigint, text, timestamptz, bigint, timestamptz[]);
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer);
"""

UNDO = """
    DROP VIEW pglane.job_status, pglane.lane_status;
    DROP FUNCTION pglane.pick(text, integer, text[], boolean);
    DROP FUNCTION pglane.take(pglane.lanes, pglane.picked, text, timestamptz, bigint, timestamptz[]);
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer);
    DROP FUNCTION pglane.fair_rank(integer, text, text), pglane.group_in_flight(pglane.lanes, text),
        pglane.full_groups(pglane.lanes), pglane.served(integer, text, timestamptz), pglane.groups_waiting(text),
        pglane.group_status(text, integer), pglane.lane_with(pglane.lanes, jsonb),
        pglane.check_payload(jsonb, integer, text);
    DROP TYPE pglane.picked;
    DROP TABLE pglane.lane_groups;
    DROP INDEX pglane.jobs_group_queue;
    DROP INDEX pglane.jobs_queue;
    CREATE INDEX jobs_queue ON pglane.jobs (lane, created_at, id) WHERE in_queue;
    ALTER TABLE pglane.lane_counters DROP COLUMN served_rank;
    ALTER TABLE pglane.lanes DROP COLUMN group_slots;
    ALTER TABLE pglane.jobs DROP COLUMN group_key, DROP COLUMN priority, DROP COLUMN fair_rank;
    DROP DOMAIN pglane.job_group;
"""


def upgrade() -> None:
    op.execute(BEFORE)
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    op.execute(UNDO)
    apply_sql("0010", [name for name in APPLIES if name not in NEW_FILES])
