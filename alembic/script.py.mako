"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from alembic import op
from pglane.schema import apply_sql


revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}

# The sql/ files this revision (re-)applies, in order. Before changing one that an older revision
# applies, copy that older text to alembic/frozen/<older revision>/ (see pglane.schema).
APPLIES: tuple[str, ...] = ()


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
