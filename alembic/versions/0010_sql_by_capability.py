"""sql/ by capability (#31 point 3): one file per capability, so that a feature lives in one file, and
the three roles' whole privilege set in one file, sql/roles.sql. A move: no function, view, trigger
or privilege changes.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

sql/ was split by verb (claim, enqueue, lanes, views, ...); each function, view and trigger now lives
in the one file of the capability it serves, its text unchanged:
- lanes.sql: a lane's own rows (its triggers), its settings (set_lane), its wake-ups (notify);
- slots.sql: the slot locks, the claim's slot check (claim_slot), who holds a slot;
- sessions.sql: a session's identity, the mark, the evidence that it lives;
- queue_bound.sql: max_queued, at enqueue (jobs_after_insert) and for returning jobs;
- rate.sql: rate limits, from parsing a rate to the claim's admission and the recorded starts;
- strict.sql: strict lanes (takeover after_lease): the calls in flight, the lease's wait, its release;
- jobs.sql: a job's life: who enqueued it, the enqueue, its outcome, a person's retry and cancel;
- claim.sql: the claim as its steps (pick, take) and its entry points;
- recover.sql: recovery and the stuck report; history.sql: prune and the keys kept after it;
- tallies.sql: the lane tallies and the triggers that keep them; views.sql: lane_status, job_status;
- wait.sql: waiting for a job's result (unchanged, so not applied here: 0009's text stays its own);
- roles.sql: every grant to pglane_producer, pglane_worker and pglane_operator, and the policies on
  jobs; idempotent (it takes back what the three roles hold, then grants the set).

APPLIES lists them in dependency order: a file's views and SQL-language functions use only objects
of the files before it (and wait.sql, of 0009). This revision installs no new object and grants
exactly what 0006-0009 granted (tests/test_schema.py compares the schema and every privilege before
and after it). The one stored text that changes is jobs.failed_or_cancelled's comment, which named
the file of the tallies. 0009's text of the files it applied is frozen in alembic/frozen/0009/;
downgrade applies it again and gives the comment back (roles.sql's grants are 0009's: nothing to undo).
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "slots.sql", "sessions.sql", "queue_bound.sql", "rate.sql", "strict.sql", "jobs.sql",
           "claim.sql", "recover.sql", "history.sql", "tallies.sql", "views.sql", "roles.sql")
PREVIOUS = ("lanes.sql", "sessions.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql",
            "wait.sql")  # 0009's APPLIES: its text, as 0009 installs it

FAILED_OR_CANCELLED = """
    COMMENT ON COLUMN pglane.jobs.failed_or_cancelled IS
        'status is failed or cancelled, kept apart so that its index does not depend on status (as in_queue);'
        ' written with status by pglane''s functions (not generated: see {file})';
"""


def upgrade() -> None:
    apply_sql(revision, APPLIES)
    op.execute(FAILED_OR_CANCELLED.format(file="tallies.sql"))


def downgrade() -> None:
    apply_sql("0009", PREVIOUS)
    op.execute(FAILED_OR_CANCELLED.format(file="views.sql"))
