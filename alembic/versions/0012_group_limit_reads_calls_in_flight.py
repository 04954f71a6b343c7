"""The group limit reads the calls in flight, not the history (#32 point 7): full_groups rewritten.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

0011's full_groups counted the running attempts with a bitmap scan, which never marks the entries of
finished attempts dead: every claim of a lane with group_slots read every attempt finished since
attempts was last vacuumed, and its plan was rebuilt at each claim. It now reads attempts_running by
a plain index scan, probes the jobs by key, skips the count when fewer calls are in flight than
group_slots, and keeps one generic plan (sql/groups.sql says why each). What it counts is unchanged.

Applies groups.sql; downgrade applies 0011's text (alembic/frozen/0011/).
"""

from pglane.schema import apply_sql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

APPLIES = ("groups.sql",)


def upgrade() -> None:
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    apply_sql("0011", APPLIES)
