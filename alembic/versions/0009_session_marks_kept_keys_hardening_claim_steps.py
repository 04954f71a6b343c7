"""Session marks for managed PostgreSQL (#29), idempotency keys kept after prune, hardening (#30), the
claim in four steps and lane_status's failures from the tallies (#31).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06

- attempts.session_mark: the claiming session's mark (sql/sessions.sql), a session advisory lock key
  that pg_locks shows to every role. The claim no longer reads pg_stat_activity, which hides another
  role's backend_start from an owner that is neither superuser nor in pg_read_all_stats (managed
  PostgreSQL): there, every claim failed on attempts.backend_start NOT NULL. backend_start now says
  when the claiming session took its mark. Attempts claimed before this revision keep NULL and are
  judged by pg_stat_activity as before (running ones may be mid-call during the upgrade).
- lanes.key_retention and pruned_keys: a pruned job's idempotency key is remembered for its lane's
  retention (30 days by default): the same key then gets JobPruned (PGL14), never a second paid call.
  prune() and prune_batch() gain p_forget_keys.
- Hardening (#30): a job that costs more than its lane's rate is passed over by the claim (it wedged
  the lane); set_lane locks a lane FOR NO KEY UPDATE (no wait behind a producer's open transaction)
  but FOR UPDATE when it lowers the rate, atomic with enqueues (jobs_before_insert reads the lane FOR
  KEY SHARE); retry() refuses such a job; every NOTIFY goes through pglane.notify(), which skips and
  counts (notifications_skipped) a wake-up past half the NOTIFY queue instead of failing the commit;
  a producer's plain INSERT may set cost, as the docs say.
- The claim as four steps (#31): claim_slot, admission (lease_admission, rate_admission), pick,
  take. A rate-limited lane's start is recorded by rate_start, whose fast path keeps the latest in
  lane_counters.pending_starts as 0008's claim did (take writes them with its seq bump; its
  signature gains them). rate_refusal goes (rate_turn, rate_start).
- lane_status's failed and cancelled counts from the tallies (#31 point 7): lane_tallies gains
  failed and cancelled (counted here once, writers held off), kept by the statement triggers and the
  row trigger jobs_tally_update (AFTER UPDATE OF failed_or_cancelled: claim and complete never fire
  it); tally() gains the two counts. jobs_failed_or_cancelled is keyed (lane, id), so that lane_flow
  reads a lane's latest cancels first, a bounded number.

Downgrade restores 0008's text from alembic/frozen/0008/.
"""

from alembic import op
from pglane.schema import apply_sql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

APPLIES = ("lanes.sql", "sessions.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql",
           "wait.sql")
NEW_FILES = ("sessions.sql",)  # sql/ files 0008 did not have: a downgrade does not apply them

ROLES = "pglane_producer, pglane_worker, pglane_operator"

BEFORE = """
    ALTER TABLE pglane.attempts ADD COLUMN session_mark bigint;
    COMMENT ON COLUMN pglane.attempts.session_mark IS
        'the claiming session''s mark: a session advisory lock key (bigint form) it holds while it lives;'
        ' NULL for attempts claimed before revision 0009 (judged by pg_stat_activity''s backend_start)';
    COMMENT ON COLUMN pglane.attempts.backend_start IS
        'when the claiming session took its mark (its pglane identity, with backend_pid and session_mark);'
        ' before revision 0009, the backend''s start from pg_stat_activity';
    ALTER TABLE pglane.lanes ADD COLUMN key_retention interval NOT NULL DEFAULT '30 days',
        ADD CONSTRAINT lane_key_retention_valid CHECK (key_retention BETWEEN '0' AND '10 years');
    COMMENT ON COLUMN pglane.lanes.key_retention IS
        'how long after a job finished its idempotency key is remembered once the job is pruned';
    CREATE TABLE pglane.pruned_keys (
        lane            text        NOT NULL,  -- no foreign key: lanes_after_delete forgets a lane's keys
        idempotency_key text        NOT NULL,
        job_id          bigint      NOT NULL,
        status          text        NOT NULL,
        enqueued_by     text,
        finished_at     timestamptz NOT NULL,
        forget_after    timestamptz NOT NULL,
        PRIMARY KEY (lane, idempotency_key)
    );
    COMMENT ON TABLE pglane.pruned_keys IS
        'the idempotency keys of pruned jobs, each remembered until forget_after: a repeated request is refused'
        ' with the pruned job''s id (PGL14) rather than paid for again';
    CREATE SEQUENCE pglane.notifications_skipped;
    COMMENT ON SEQUENCE pglane.notifications_skipped IS
        'wake-ups pglane.notify() skipped because the NOTIFY queue was over half full';
    -- New signatures: dropped here, re-created by sql/, granted again below.
    DROP FUNCTION pglane.prune(interval, text, boolean);
    DROP FUNCTION pglane.prune_batch(interval, text, boolean, bigint, integer);
    -- lane_status's failed and cancelled counts (#31 point 7): counted once here, writers held off.
    LOCK TABLE pglane.jobs IN SHARE MODE;
    ALTER TABLE pglane.lane_tallies ADD COLUMN failed bigint NOT NULL DEFAULT 0,
        ADD COLUMN cancelled bigint NOT NULL DEFAULT 0;
    COMMENT ON TABLE pglane.lane_tallies IS
        'per lane, summed over its rows: how many jobs pglane.jobs holds, and how many of them are failed and'
        ' cancelled (failed_or_cancelled true, and that status)';
    INSERT INTO pglane.lane_tallies (lane_id, shard, jobs, failed, cancelled)
    SELECT l.id, nextval('pglane.lane_tally_shards'), 0, count(*) FILTER (WHERE j.status = 'failed'),
           count(*) FILTER (WHERE j.status = 'cancelled')
      FROM pglane.jobs j JOIN pglane.lanes l ON l.name = j.lane WHERE j.failed_or_cancelled GROUP BY l.id;
    DROP FUNCTION pglane.tally(text, bigint);
    DROP INDEX pglane.jobs_failed_or_cancelled;
    CREATE INDEX jobs_failed_or_cancelled ON pglane.jobs (lane, id) WHERE failed_or_cancelled;
"""
AFTER = f"""
    DROP FUNCTION pglane.jobs_tally_insert(), pglane.jobs_tally_delete();  -- one function now: jobs_tally_rows()
    DROP FUNCTION pglane.session_alive(integer, timestamptz, integer, integer);
    DROP FUNCTION pglane.may_write(uuid, uuid, integer, timestamptz);
    DROP FUNCTION pglane.rate_refusal(pglane.claimed, pglane.lanes, bigint, integer, integer, bigint, timestamptz);
    GRANT EXECUTE ON FUNCTION pglane.session_alive(integer, timestamptz, bigint, integer, integer),
                              pglane.holds_mark(integer, bigint) TO {ROLES};
    GRANT EXECUTE ON FUNCTION pglane.prune(interval, text, boolean, boolean),
                              pglane.prune_batch(interval, text, boolean, bigint, integer, boolean)
        TO pglane_operator;
    GRANT SELECT (session_mark) ON pglane.attempts TO pglane_worker;
    GRANT SELECT ON pglane.pruned_keys TO pglane_operator;
    GRANT EXECUTE ON FUNCTION pglane.notifications_skipped() TO {ROLES};
    GRANT INSERT (cost) ON pglane.jobs TO pglane_producer;
    GRANT EXECUTE ON FUNCTION pglane.lane_queue(text) TO pglane_operator;
"""

UNDO_BEFORE = """
    DROP FUNCTION pglane.prune(interval, text, boolean, boolean),
                  pglane.prune_batch(interval, text, boolean, bigint, integer, boolean),
                  pglane.keep_keys(pglane.jobs[], boolean, text, timestamptz), pglane.refuse_pruned_key(text, text);
    DROP FUNCTION pglane.claim_slot(pglane.lanes), pglane.lease_admission(pglane.lanes),
                  pglane.queue_head(text, integer), pglane.pick(text, integer),
                  pglane.take(pglane.lanes, bigint, text, timestamptz, bigint, timestamptz[]),
                  pglane.rate_turn(pglane.lanes, bigint, integer, integer, bigint, timestamptz),
                  pglane.rate_admission(pglane.lanes, bigint, bigint, integer),
                  pglane.rate_start(pglane.lanes, integer, integer);
    DROP TRIGGER jobs_tally_update ON pglane.jobs;
    DROP FUNCTION pglane.jobs_tally_update(), pglane.tally(text, bigint, bigint, bigint);
"""
UNDO_AFTER = f"""
    DROP FUNCTION pglane.jobs_tally_rows();
    DROP FUNCTION pglane.session_alive(integer, timestamptz, bigint, integer, integer),
                  pglane.may_write(uuid, uuid, integer, timestamptz, bigint),
                  pglane.is_claiming_session(integer, timestamptz, bigint),
                  pglane.holds_mark(integer, bigint), pglane.session_mark(), pglane.mark_time(bigint);
    GRANT EXECUTE ON FUNCTION pglane.session_alive(integer, timestamptz, integer, integer) TO {ROLES};
    GRANT EXECUTE ON FUNCTION pglane.prune(interval, text, boolean),
                              pglane.prune_batch(interval, text, boolean, bigint, integer) TO pglane_operator;
    DROP TABLE pglane.pruned_keys;
    ALTER TABLE pglane.lanes DROP COLUMN key_retention;
    ALTER TABLE pglane.attempts DROP COLUMN session_mark;
    COMMENT ON COLUMN pglane.attempts.backend_start IS NULL;
    REVOKE INSERT (cost) ON pglane.jobs FROM pglane_producer;
    DROP FUNCTION pglane.notify(text, text), pglane.notifications_skipped();
    DROP SEQUENCE pglane.notifications_skipped;
    DROP FUNCTION pglane.lane_queue(text);
    ALTER TABLE pglane.lane_tallies DROP COLUMN failed, DROP COLUMN cancelled;
    COMMENT ON TABLE pglane.lane_tallies IS 'per lane, summed over its rows: how many jobs pglane.jobs holds';
    DROP INDEX pglane.jobs_failed_or_cancelled;
    CREATE INDEX jobs_failed_or_cancelled ON pglane.jobs (lane) WHERE failed_or_cancelled;
"""


def upgrade() -> None:
    op.execute(BEFORE)
    apply_sql(revision, APPLIES)
    op.execute(AFTER)


def downgrade() -> None:
    """0008's text comes back over this revision's (its session_alive and may_write beside the new
    ones, which go after, as the columns they read do)."""
    op.execute(UNDO_BEFORE)
    apply_sql("0008", [name for name in APPLIES if name not in NEW_FILES])
    op.execute(UNDO_AFTER)
