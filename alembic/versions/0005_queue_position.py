"""job_status.queue_position counts through the queue index, so it costs the backlog, not the history.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

Up to 0004 the position of a queued job counted the lane's rows WHERE status = 'queued', which no
index matches (the queue index's predicate is in_queue since 0003): `pglane status JOB` of a queued
job read every job the lane ever had. It now says q.in_queue, as the claim does.

views.sql replaces its views in place (CREATE OR REPLACE) from this revision on, so re-applying it
keeps the grants of 0002; before, it dropped and re-created them. Downgrade re-applies views.sql
with in_queue spelled as the status test it is generated from, as 0004 had it (so that 0003's
downgrade can drop the column).
"""

from alembic import op
from pglane.schema import sql_text

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(sql_text("views.sql"))


def downgrade() -> None:
    op.execute(sql_text("views.sql", before_in_queue=True))
