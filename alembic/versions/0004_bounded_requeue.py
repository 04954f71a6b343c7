"""max_queued holds for jobs that come back to the queue; workers may read attempts; the claim
checks the session's own slot first.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

- Up to 0003, a job that went back to the queue (fail() with attempts left, recover() on an
  at-least-once lane, an operator's retry()) added one to a bounded lane's queued counter without
  looking at max_queued, so a full lane could end up holding more than its bound. queue_admit (in
  lanes.sql) now takes the place under the counters row lock or says no: retry() is refused with
  PGL04 and the job stays as it was; fail() and recover() fail the job instead of re-queueing it, with
  the reason and the retry command in last_error. Nothing is lost.
- The worker's Prometheus queue gauges count running attempts through pglane.attempts (the
  attempts_running index of 0003), which pglane_worker could not read: the gauges stayed at zero.
  pglane_worker now has SELECT on pglane.attempts, as it has on jobs.
- The claim checks first the slot the session names in the setting pglane.slot (pglane worker sets
  it): a worker on slot k > 1 no longer pins the free slots below its own for the length of its claim
  transaction, nor makes the server log a WARNING for each of them on every claim.

Downgrade revokes the grant. The functions keep this revision's bodies: they need nothing that 0004
added to the tables, and they keep the bound on the older schema.
"""

from alembic import op
from pglane.schema import sql_text

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# queue_admit is defined in lanes.sql; fail() and the claim in claim.sql; recover() and retry() in
# recover.sql.
# CREATE OR REPLACE keeps the grants of 0002.
CHANGED = ("lanes.sql", "claim.sql", "recover.sql")


def upgrade() -> None:
    for name in CHANGED:
        op.execute(sql_text(name))
    op.execute("GRANT SELECT ON pglane.attempts TO pglane_worker")


def downgrade() -> None:
    op.execute("REVOKE SELECT ON pglane.attempts FROM pglane_worker")
