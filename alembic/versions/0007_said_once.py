"""SQL said once: who holds a slot, where a job goes when it may run again, the opening of a person's
decision, and the claimed row each have one definition.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03

- pglane.slot_holders (view): every advisory lock on a lane's slot key, with its mode and session.
  session_alive() and lane_consumers() read it instead of each spelling out pg_locks.
- pglane.requeue_or_fail(): used by fail() and recover(); it replaces lane_full_note(). A job
  re-queued eligible at once (retry_backoff 0, or recovered) now wakes the lane.
- pglane.decided_job(): the shared opening of retry() and cancel() (lock, PGL09, PGL08 with a hint).
- pglane.claimed (type): the row claim(), claim_impl() and complete_and_claim() return; its last
  column `completed` is set by complete_and_claim() only. The three functions change their return
  type, so they are dropped and re-created, and their grants given again.

Downgrade restores 0006's functions from alembic/frozen/0006/ and drops what this revision added.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "claim.sql", "recover.sql", "views.sql")

RETURNING_CLAIMED = """
DROP FUNCTION pglane.complete_and_claim(bigint, jsonb, text, text);
DROP FUNCTION pglane.claim(text, text);
DROP FUNCTION pglane.claim_impl(text, text);
"""

GRANTS = """
GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.complete_and_claim(bigint, jsonb, text, text)
    TO pglane_worker;
"""


def upgrade() -> None:
    op.execute(RETURNING_CLAIMED)
    op.execute("DROP FUNCTION pglane.lane_full_note(text, bigint)")
    op.execute(
        """
        CREATE TYPE pglane.claimed AS (
            job_id bigint, attempt_id bigint, attempt_number integer, seq bigint, lane text, payload jsonb,
            idempotency_key text, lease_expires_at timestamptz, completed boolean);
        """
    )
    apply_sql(revision, APPLIES)
    op.execute(GRANTS)
    op.execute("GRANT SELECT ON pglane.slot_holders TO pglane_producer, pglane_worker, pglane_operator")


def downgrade() -> None:
    op.execute(RETURNING_CLAIMED)
    op.execute(
        """
        DROP FUNCTION pglane.requeue_or_fail(bigint, text, integer, text, text, text, interval);
        DROP FUNCTION pglane.decided_job(bigint, text[], text);
        DROP TYPE pglane.claimed;
        """
    )
    apply_sql("0006", APPLIES)
    op.execute("DROP VIEW pglane.slot_holders")  # after 0006's session_alive and lane_consumers
    op.execute(GRANTS)
