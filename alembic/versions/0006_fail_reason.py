"""pglane.fail() records that no reason was given, rather than no reason at all.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03

Up to 0005, fail(attempt, NULL) or fail(attempt, '') from a consumer in any language stored no
error: a failed attempt, and perhaps a failed job, that nothing explained. The function now records
that the consumer gave no reason. Downgrade leaves the function as it is: sql/ holds only today's
text, and the new one refuses nothing that the old one accepted.
"""

from alembic import op
from pglane.schema import sql_text

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sql_text("claim.sql"))


def downgrade() -> None:
    pass  # see the module docstring
