"""Three functions on the claim's path planned once per session or inlined (#35); workers may list stuck attempts (#36).

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06

in_flight (a strict lane's admission, strict.sql) and served (a grouped job's start, groups.sql) were
SQL-language functions that PostgreSQL never inlines (SECURITY DEFINER with SET; an INSERT), whose
query PostgreSQL before 18 plans anew at every call: a strict lane's claim on PostgreSQL 15 cost 1.93x a
plain one (bench/README.md "The cost of each feature"). Both are now plpgsql, which keeps the plan for
the session. mark_time (the claim's record of the session's identity, sessions.sql) was declared
IMMUTABLE over a STABLE body (timestamptz + interval), which PostgreSQL never inlines: planned at every
claim before 18. It is now STABLE, and inlined. What they read, write and return is unchanged; so are
their signatures.

pglane_worker may now execute stuck_attempts(): a traced worker's recovery writes a span for each stuck
attempt (pglane.tracing). It shows nothing a worker cannot read already (attempts, jobs).

Applies strict.sql, groups.sql, sessions.sql and roles.sql; downgrade applies the text 0010, 0012 and 0016
installed (alembic/frozen/0010/, 0012/, 0016/; roles.sql revokes every grant before it grants).
"""

from pglane.schema import apply_sql

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

APPLIES = ("strict.sql", "groups.sql", "sessions.sql", "roles.sql")


def upgrade() -> None:
    apply_sql(revision, APPLIES)


def downgrade() -> None:
    apply_sql("0010", ("strict.sql", "sessions.sql"))
    apply_sql("0012", ("groups.sql",))
    apply_sql("0016", ("roles.sql",))
