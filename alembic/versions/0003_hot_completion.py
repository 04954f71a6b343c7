"""Completion as a HOT update: the queue index keyed on a column that completion does not change.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

A row update is HOT (no new index entries, no new index pages dirtied) only when no column that any
index uses, in its key or its predicate, changes. Up to 0002 both partial indexes of pglane.jobs had
`status` in their predicate, so every completion (running -> done) inserted new entries into all
four indexes of the job, the text (lane, idempotency_key) one included: the largest single cost of
the fused complete-and-claim (see bench/profile.py and research/performance.md).

- jobs.in_queue is generated from status (`status = 'queued'`): no writer can make it disagree with
  status, and a plain INSERT from any language needs no change. It changes only when a job enters or
  leaves the queue (enqueue, claim, cancel, retry, requeue, a late result), never on completion.
- jobs_queue is rebuilt on `WHERE in_queue`; the claim and the bounded-lane recount say `in_queue`
  so that the planner matches the predicate.
- jobs_running goes; recovery and the views find running attempts through attempts_running, keyed by
  job_id. Its predicate is the attempt's status, so finishing an attempt is no longer HOT, but its
  entries are small integers, not text.

Adding a stored generated column rewrites pglane.jobs under an ACCESS EXCLUSIVE lock: stop workers
and producers for the length of the migration on a large history (or prune first).

Downgrade restores the 0002 indexes and drops the column, then re-applies the functions that named
it with the 0002 predicate spelled out (the one textual difference between the two revisions).
"""

from alembic import op
from pglane.schema import sql_text

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# The sql/ files whose functions name jobs.in_queue: re-applied here (CREATE OR REPLACE keeps grants).
# views.sql names it too, since 0005, which re-applies it.
USES_IN_QUEUE = ("lanes.sql", "claim.sql")


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE pglane.jobs ADD COLUMN in_queue boolean GENERATED ALWAYS AS (status = 'queued') STORED;
        DROP INDEX pglane.jobs_queue;
        DROP INDEX pglane.jobs_running;
        CREATE INDEX jobs_queue ON pglane.jobs (lane, created_at, id) WHERE in_queue;
        CREATE INDEX attempts_running ON pglane.attempts (job_id) WHERE status = 'running';
        COMMENT ON COLUMN pglane.jobs.in_queue IS
            'status = ''queued'', kept apart so that the queue index does not depend on status';
        """
    )
    for name in USES_IN_QUEUE:
        op.execute(sql_text(name))


def downgrade() -> None:
    op.execute(
        """
        DROP INDEX pglane.attempts_running;
        DROP INDEX pglane.jobs_queue;
        ALTER TABLE pglane.jobs DROP COLUMN in_queue;
        CREATE INDEX jobs_queue ON pglane.jobs (lane, created_at, id) WHERE status = 'queued';
        CREATE INDEX jobs_running ON pglane.jobs (lane) WHERE status = 'running';
        """
    )
    for name in USES_IN_QUEUE:
        op.execute(sql_text(name, before_in_queue=True))
