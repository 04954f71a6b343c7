"""The next round: rate limits and `lane set` (#21), waiting for a job's result (#20), the operator's
listings at scale (#19). One revision; each feature keeps its DDL in its own section below, so that
the parts can land independently inside it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04

Functions whose signature or return type changes are dropped (in a section's *_BEFORE) and
re-created by the sql/ files, and their grants given again (*_AFTER). Downgrade restores 0007's text
from alembic/frozen/0007/.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql")

ROLES = "pglane_producer, pglane_worker, pglane_operator"

# --- rate limits and lane set (#21) ------------------------------------------------------------------
RATE_BEFORE = ""
RATE_AFTER = ""
RATE_UNDO_BEFORE = ""
RATE_UNDO_AFTER = ""

# --- waiting for a job's result (#20) ----------------------------------------------------------------
WAIT_BEFORE = ""
WAIT_AFTER = ""
WAIT_UNDO_BEFORE = ""
WAIT_UNDO_AFTER = ""

# --- listings at scale (#19) -------------------------------------------------------------------------
SCALE_BEFORE = ""
SCALE_AFTER = ""
SCALE_UNDO_BEFORE = ""
SCALE_UNDO_AFTER = ""

SECTIONS = ((RATE_BEFORE, RATE_AFTER, RATE_UNDO_BEFORE, RATE_UNDO_AFTER),
            (WAIT_BEFORE, WAIT_AFTER, WAIT_UNDO_BEFORE, WAIT_UNDO_AFTER),
            (SCALE_BEFORE, SCALE_AFTER, SCALE_UNDO_BEFORE, SCALE_UNDO_AFTER))


def _run(statements: str) -> None:
    if statements.strip():
        op.execute(statements)


def upgrade() -> None:
    for before, _, _, _ in SECTIONS:
        _run(before)
    apply_sql(revision, APPLIES)
    for _, after, _, _ in SECTIONS:
        _run(after)


def downgrade() -> None:
    """UNDO_BEFORE drops what 0008 added (run before 0007's text is restored); UNDO_AFTER gives back
    grants on what 0007's text re-created."""
    for _, _, undo_before, _ in reversed(SECTIONS):
        _run(undo_before)
    apply_sql("0007", APPLIES)
    for _, _, _, undo_after in reversed(SECTIONS):
        _run(undo_after)
