"""A lane's consumers count its slots held, not the sessions holding them (#34 point 2).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08

`pglane worker ... --sessions K` holds the slots of many lanes on K shared sessions; a lane with more
slots in one process than it has sessions has two slots on one session. lane_consumers and
lanes_consumers (lane_status.consumers, job_status's waits) counted distinct sessions, which would show
such a lane with one consumer for two slots served: they now count the slot locks held.

Applies slots.sql; downgrade applies 0010's text (alembic/frozen/0010/).
"""

from pglane.schema import apply_sql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

APPLIES = ("slots.sql",)


def upgrade() -> None:
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    apply_sql("0010", APPLIES)
