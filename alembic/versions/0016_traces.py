"""Traces from the producer to the handler (#36): jobs.traceparent.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08

- jobs.traceparent: the producer's W3C trace context (version 00), set by pglane.enqueue's Python
  twins from the current OpenTelemetry span, or by any producer's plain INSERT; NULL: none. The insert
  trigger refuses a malformed one with a clear message (PGL10, pglane.check_traceparent), nothing written;
  nothing updates it.
- enqueue() gains p_traceparent; producers may INSERT traceparent.
- the claim hands the worker the job's traceparent and its enqueue time (pglane.claimed.traceparent,
  queued_at), from which the worker's spans continue the producer's trace.

Applies jobs.sql, claim.sql and roles.sql; downgrade applies 0013's text (alembic/frozen/0013/).
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

APPLIES = ("jobs.sql", "claim.sql", "roles.sql")

BEFORE = """
    ALTER TABLE pglane.jobs ADD COLUMN traceparent text;
    COMMENT ON COLUMN pglane.jobs.traceparent IS
        'the producer''s W3C trace context (00-trace id-span id-flags), continued by the worker''s spans';
    ALTER TYPE pglane.claimed ADD ATTRIBUTE traceparent text, ADD ATTRIBUTE queued_at timestamptz;
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer, interval);
"""

UNDO = """
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer, text, integer, interval, text);
    DROP FUNCTION pglane.check_traceparent(text);
    ALTER TYPE pglane.claimed DROP ATTRIBUTE traceparent, DROP ATTRIBUTE queued_at;
    ALTER TABLE pglane.jobs DROP COLUMN traceparent;
"""


def upgrade() -> None:
    op.execute(BEFORE)
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    op.execute(UNDO)
    apply_sql("0013", APPLIES)
