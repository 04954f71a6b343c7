"""Lanes served by pattern (#34 point 1): a lane's creation and deletion NOTIFY pglane_lanes.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07

`pglane worker --lanes-like PATTERN` serves every lane whose name matches, including lanes created
later, and lets go of a lane that is deleted. lanes_after_insert and lanes_after_delete now send an
empty NOTIFY on pglane_lanes (one channel for the schema, through pglane.notify), on which such a
worker reads the lane list again; a worker trusts nothing a notification says.

Applies lanes.sql; downgrade applies 0013's text (alembic/frozen/0013/).
"""

from pglane.schema import apply_sql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql",)


def upgrade() -> None:
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    apply_sql("0013", APPLIES)
