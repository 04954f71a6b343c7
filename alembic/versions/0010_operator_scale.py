"""The operator's surface at scale: a full lane refuses cheaply, a prune runs in batches.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03

- pglane.enqueue() gains p_if_full ('error', the default, as before; or 'skip': NULL when the bounded
  lane is full, nothing written and no ERROR in the server log). The four-argument function is
  replaced, so its grant is given again.
- pglane.prune_batch(): one bounded, resumable step of a prune in a transaction of its own.
- complete() and fail() test a matching token before calling may_write(), which cannot be inlined:
  a worker's completion no longer pays for a function call (about 20 us).
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

APPLIES = ("enqueue.sql", "history.sql", "claim.sql")


def upgrade() -> None:
    op.execute("DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz)")
    apply_sql(revision, APPLIES)
    op.execute(
        """
        GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text) TO pglane_producer;
        GRANT EXECUTE ON FUNCTION pglane.prune_batch(interval, text, boolean, bigint, integer) TO pglane_operator;
        """
    )


def downgrade() -> None:
    op.execute(
        """
        DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text), pglane.lane_is_full(text),
                      pglane.prune_batch(interval, text, boolean, bigint, integer);
        """
    )
    apply_sql("0008", ("enqueue.sql",))
    apply_sql("0006", ("history.sql",))
    apply_sql("0009", ("claim.sql",))
    op.execute("GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz) TO pglane_producer")
