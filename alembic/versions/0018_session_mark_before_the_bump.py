"""The claim reads the session's mark before it bumps the lane's seq (#35).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06

Every other slot of a lane waits for the lane's counters row from a claim's bump until that claim's
commit is flushed. take (sql/claim.sql) checked the claiming session's mark (sessions.sql: a plpgsql
call and three advisory lock calls, more on a session's first claim) inside that hold, though the mark
does not depend on the seq. It is now read first: on a plain lane only the job's UPDATE and the
attempt's INSERT, which carry the seq, and a grouped job's round follow the bump. (A strict, grouped,
weighted or rate-limited lane locks the row earlier, in its admission, as before.) The rows a claim
writes and its answers are unchanged; so is every signature. One difference: a claim that picked a
job on a paused lane now checks the session's mark (takes one, on the session's first claim) before
it answers with the pause, where it took none; no row is written either way.

Applies claim.sql; downgrade applies the text 0016 installed (alembic/frozen/0016/).
"""

from pglane.schema import apply_sql

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

APPLIES = ("claim.sql",)


def upgrade() -> None:
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    apply_sql("0016", APPLIES)
