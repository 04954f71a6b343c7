"""Strict lanes: on a lane whose takeover is after_lease, the calls possibly in flight never exceed its
slots, whatever happened to the network.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03

- lanes.takeover ('immediate', the default and today's behaviour, or 'after_lease'; named CHECK
  lane_takeover_valid).
- attempts.lease_released_at / lease_released_by: a person ended the wait for a lost attempt's lease
  (pglane.release_lease, `pglane release-lease ATTEMPT`), recorded on the attempt.
- attempts_lost_lease: the lost attempts whose lease may still run, for the strict claim's count.
- claimed.wait_seconds: a claim that takes no job because of such a lease says how long until it ends;
  pglane.claim_or_wait(), the worker's claim, always returns its row (claim() returns none then).
- lane_status gains takeover, in_flight and waits_until; job_status and lane_status explain the wait.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

APPLIES = ("claim.sql", "recover.sql", "views.sql")


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE pglane.lanes ADD COLUMN takeover text NOT NULL DEFAULT 'immediate',
            ADD CONSTRAINT lane_takeover_valid CHECK (takeover IN ('immediate', 'after_lease'));
        ALTER TABLE pglane.attempts ADD COLUMN lease_released_at timestamptz, ADD COLUMN lease_released_by text;
        CREATE INDEX attempts_lost_lease ON pglane.attempts (lease_expires_at)
            WHERE status = 'lost' AND lease_released_at IS NULL;
        ALTER TYPE pglane.claimed ADD ATTRIBUTE wait_seconds double precision;
        """
    )
    apply_sql(revision, APPLIES)
    op.execute(
        """
        GRANT EXECUTE ON FUNCTION pglane.in_flight(text), pglane.lease_wait_note(text, bigint, timestamptz)
            TO pglane_producer, pglane_worker, pglane_operator;
        GRANT EXECUTE ON FUNCTION pglane.release_lease(bigint) TO pglane_operator;
        GRANT EXECUTE ON FUNCTION pglane.claim_or_wait(text, text) TO pglane_worker;
        GRANT SELECT (lease_released_at, lease_released_by) ON pglane.attempts TO pglane_worker;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP VIEW pglane.lane_status;
        DROP VIEW pglane.job_status;
        DROP FUNCTION pglane.in_flight(text), pglane.release_lease(bigint), pglane.claim_or_wait(text, text),
                      pglane.lease_wait_note(text, bigint, timestamptz);
        ALTER TYPE pglane.claimed DROP ATTRIBUTE wait_seconds;
        DROP INDEX pglane.attempts_lost_lease;
        ALTER TABLE pglane.attempts DROP COLUMN lease_released_at, DROP COLUMN lease_released_by;
        ALTER TABLE pglane.lanes DROP COLUMN takeover;
        """
    )
    apply_sql("0008", APPLIES)
    op.execute(
        """
        GRANT SELECT ON pglane.lane_status, pglane.job_status TO pglane_operator;
        GRANT SELECT ON pglane.job_status TO pglane_producer;
        """
    )
