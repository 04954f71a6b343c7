"""The claim reads the session's mark before it bumps the lane's seq (#35).

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06

Every other slot of a lane waits for the lane's counters row from a claim's bump until that claim's
commit is flushed. take (sql/claim.sql) checked the claiming session's mark (sessions.sql: a plpgsql
call and three advisory lock calls, more on a session's first claim) inside that hold, though the mark
does not depend on the seq. It is now read first: inside the hold are only the job's UPDATE and the
attempt's INSERT, which carry the seq. What a claim reads, writes and returns is unchanged; so is every
signature.

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
