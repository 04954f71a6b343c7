"""Least privilege: the group roles pglane_producer, pglane_worker and pglane_operator, and their grants.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Roles are cluster-wide while pglane's schema is per database: the roles are created only when
missing (and a concurrent migration of another database that creates them first is not an error),
and a downgrade revokes the grants but keeps the roles, which other databases may still use.
Creating them needs CREATEROLE; without it an administrator creates the three NOLOGIN roles first.

Invariants: nobody but the owner may UPDATE or DELETE jobs and attempts; EXECUTE on pglane's
functions is revoked from PUBLIC; every function a role may call that writes is SECURITY DEFINER
with a fixed search_path (see sql/).
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ROLES = ("pglane_producer", "pglane_worker", "pglane_operator")

CREATE_ROLES = r"""
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['pglane_producer', 'pglane_worker', 'pglane_operator'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN NULL;  -- created meanwhile elsewhere
                WHEN insufficient_privilege THEN
                    RAISE EXCEPTION USING ERRCODE = 'PGL10',
                        MESSAGE = format('cannot create role %I: the migrating role lacks CREATEROLE', r),
                        HINT = 'run pglane migrate as a role with CREATEROLE, or have an administrator run: '
                               'CREATE ROLE pglane_producer NOLOGIN; CREATE ROLE pglane_worker NOLOGIN; '
                               'CREATE ROLE pglane_operator NOLOGIN;';
            END;
        END IF;
    END LOOP;
END $$;
"""

GRANTS = r"""
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pglane FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pglane FROM PUBLIC;
ALTER DEFAULT PRIVILEGES IN SCHEMA pglane REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

GRANT USAGE ON SCHEMA pglane TO pglane_producer, pglane_worker, pglane_operator;
GRANT SELECT ON pglane.alembic_version TO pglane_producer, pglane_worker, pglane_operator;
-- The views call these read-only helpers, and a view's functions are checked as the querying user.
GRANT EXECUTE ON FUNCTION pglane.session_alive(integer, timestamptz, integer, integer),
                          pglane.lane_consumers(integer, integer)
    TO pglane_producer, pglane_worker, pglane_operator;

-- Producers: enqueue (the function or a plain INSERT of the four input columns) and read job status.
GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz) TO pglane_producer;
GRANT INSERT (lane, payload, idempotency_key, run_after) ON pglane.jobs TO pglane_producer;
-- INSERT ... ON CONFLICT (lane, idempotency_key) DO NOTHING reads the conflict target's columns.
GRANT SELECT (lane, idempotency_key) ON pglane.jobs TO pglane_producer;
GRANT SELECT ON pglane.job_status TO pglane_producer;

-- Workers: claim, complete, fail, recover; read their lane and its jobs.
GRANT EXECUTE ON FUNCTION pglane.claim(text, text), pglane.complete(bigint, jsonb),
                          pglane.fail(bigint, text, boolean), pglane.complete_and_claim(bigint, jsonb, text, text),
                          pglane.recover(text)
    TO pglane_worker;
GRANT SELECT ON pglane.lanes, pglane.jobs TO pglane_worker;

-- Operators: read every view and the history; decide (retry, cancel), recover and prune.
GRANT SELECT ON pglane.lanes, pglane.jobs, pglane.attempts, pglane.lane_status, pglane.job_status,
                pglane.running_attempts
    TO pglane_operator;
GRANT EXECUTE ON FUNCTION pglane.retry(bigint), pglane.cancel(bigint), pglane.recover(text),
                          pglane.stuck_attempts(text), pglane.prune(interval, text, boolean)
    TO pglane_operator;
"""


def upgrade() -> None:
    op.execute(CREATE_ROLES)
    op.execute(GRANTS)


def downgrade() -> None:
    roles = ", ".join(ROLES)
    op.execute(
        f"""
        REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pglane FROM {roles};
        REVOKE ALL ON ALL TABLES IN SCHEMA pglane FROM {roles};
        REVOKE ALL ON SCHEMA pglane FROM {roles};
        ALTER DEFAULT PRIVILEGES IN SCHEMA pglane GRANT EXECUTE ON FUNCTIONS TO PUBLIC;
        """
    )
