"""Rate limits and `lane set` (#21), waiting for a job's result (#20), the operator's listings at
scale (#19). One revision; each feature keeps its DDL in its own section below, so that the parts
can land independently inside it.

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

APPLIES = ("lanes.sql", "enqueue.sql", "claim.sql", "recover.sql", "history.sql", "views.sql", "wait.sql")
NEW_FILES = ("wait.sql",)  # sql/ files 0007 did not have: a downgrade does not apply them

ROLES = "pglane_producer, pglane_worker, pglane_operator"

# --- rate limits and lane set (#21) ------------------------------------------------------------------
# lanes.rate_limit / rate_period: at most rate_limit units of cost started in any window of
# rate_period (both set or neither); jobs.cost (>= 1); lane_starts: the limited lanes' starts still
# inside their window, summed in lane_counters.window_cost; the claim row's wait_reason.
RATE_BEFORE = """
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text);
    ALTER TABLE pglane.lanes ADD COLUMN rate_limit integer, ADD COLUMN rate_period interval,
        ADD CONSTRAINT lane_rate_valid CHECK ((rate_limit IS NULL) = (rate_period IS NULL)
            AND (rate_limit IS NULL OR rate_limit BETWEEN 1 AND 1000000)
            AND (rate_period IS NULL OR rate_period BETWEEN '1 second' AND '1 day'));
    -- A domain, not a table CHECK: a table CHECK is read again from its stored text and evaluated on
    -- every UPDATE of a job (claim and complete included, about 10,000 instructions each); a domain's
    -- is checked only where a cost is written.
    CREATE DOMAIN pglane.job_cost AS integer CONSTRAINT job_cost_positive CHECK (VALUE >= 1);
    ALTER TABLE pglane.jobs ADD COLUMN cost pglane.job_cost NOT NULL DEFAULT 1;
    ALTER TABLE pglane.lane_counters ADD COLUMN window_cost bigint NOT NULL DEFAULT 0,
        ADD COLUMN pending_starts timestamptz[] NOT NULL DEFAULT '{}';
    COMMENT ON COLUMN pglane.lane_counters.pending_starts IS
        'the latest starts of cost 1 taken by the claim''s fast path, not yet rows of lane_starts (at most 31;'
        ' the last one''s seq is last_seq, the ones before it consecutive): moved there by the next claim that'
        ' takes the slow path, which every 32nd start does';
    ALTER TABLE pglane.lanes ADD COLUMN weighted boolean NOT NULL DEFAULT false;
    COMMENT ON COLUMN pglane.lanes.weighted IS
        'a job of this lane has cost more than 1 (set by the first such enqueue, never unset): its rate-limited'
        ' claims read the head job''s cost first';
    CREATE TABLE pglane.lane_starts (
        lane_id    integer     NOT NULL,  -- no foreign key: its check would lock the lane's row at every
                                          -- start; lanes_after_delete (lanes.sql) deletes a lane's starts
        seq        bigint      NOT NULL,
        started_at timestamptz NOT NULL,
        cost       integer     NOT NULL,
        PRIMARY KEY (lane_id, started_at, seq)
    );
    COMMENT ON TABLE pglane.lane_starts IS
        'the starts of rate-limited lanes still inside their window (the latest may still be in'
        ' lane_counters.pending_starts); lane_counters.window_cost is the sum of both';
    ALTER TYPE pglane.claimed ADD ATTRIBUTE wait_reason text;
"""
RATE_AFTER = f"""
    GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer) TO pglane_producer;
    GRANT EXECUTE ON FUNCTION pglane.set_lane(text, jsonb) TO pglane_operator;
    GRANT EXECUTE ON FUNCTION pglane.parse_rate(text), pglane.rate_text(integer, interval),
                              pglane.rate_window_use(text), pglane.rate_next_start(text) TO {ROLES};
    GRANT SELECT ON pglane.lane_starts TO pglane_operator;
"""
RATE_UNDO_BEFORE = """
    DROP VIEW pglane.lane_status, pglane.job_status;
    DROP FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text, integer), pglane.set_lane(text, jsonb),
                  pglane.parse_rate(text), pglane.rate_text(integer, interval), pglane.rate_wait(integer, integer,
                  interval, bigint, integer, integer, timestamptz), pglane.rate_next_start(text),
                  pglane.rate_window_use(text), pglane.lane_window_starts(integer, timestamptz),
                  pglane.rate_refusal(pglane.claimed, pglane.lanes, bigint, integer,
                  integer, bigint, timestamptz),
                  pglane.full_lane_retry_after(text, bigint);  -- LaneFull's retry delay (#19)
    ALTER TYPE pglane.claimed DROP ATTRIBUTE wait_reason;
    DROP TABLE pglane.lane_starts;
    ALTER TABLE pglane.lane_counters DROP COLUMN window_cost, DROP COLUMN pending_starts;
    ALTER TABLE pglane.jobs DROP COLUMN cost;
    DROP DOMAIN pglane.job_cost;
    DROP TRIGGER lanes_after_delete ON pglane.lanes;
    DROP FUNCTION pglane.lanes_after_delete();
    ALTER TABLE pglane.lanes DROP COLUMN rate_limit, DROP COLUMN rate_period, DROP COLUMN weighted;
"""
RATE_UNDO_AFTER = """
    GRANT EXECUTE ON FUNCTION pglane.enqueue(text, jsonb, text, timestamptz, text) TO pglane_producer;
    GRANT SELECT ON pglane.lane_status, pglane.job_status TO pglane_operator;
    GRANT SELECT ON pglane.job_status TO pglane_producer;
"""

# --- waiting for a job's result (#20) ----------------------------------------------------------------
WAIT_BEFORE = """
    ALTER TABLE pglane.jobs ADD COLUMN awaited boolean NOT NULL DEFAULT false;
    COMMENT ON COLUMN pglane.jobs.awaited IS
        'someone waits for this job (pglane.await_job): its completion notifies pglane_done with its id';
    CREATE TABLE pglane.pruned_jobs (
        first_id  bigint      NOT NULL,
        last_id   bigint      NOT NULL,
        jobs      bigint      NOT NULL,
        pruned_at timestamptz NOT NULL DEFAULT now()
    );
    COMMENT ON TABLE pglane.pruned_jobs IS
        'one row per prune or prune batch: the range of job ids it deleted, so a wait says pruned, not unknown';
    CREATE INDEX pruned_jobs_range ON pglane.pruned_jobs (last_id, first_id);
"""
WAIT_AFTER = f"""
    GRANT EXECUTE ON FUNCTION pglane.await_job(bigint) TO {ROLES};
"""
WAIT_UNDO_BEFORE = """
    DROP TRIGGER jobs_awaited_finished ON pglane.jobs;
    DROP FUNCTION pglane.await_job(bigint), pglane.notify_awaited(), pglane.note_pruned(bigint, bigint, bigint);
    DROP TABLE pglane.pruned_jobs;
    ALTER TABLE pglane.jobs DROP COLUMN awaited;
"""
WAIT_UNDO_AFTER = ""

# --- listings at scale (#19) -------------------------------------------------------------------------
# queue_positions(): a listing's positions from one ordered pass of the queue; lanes_consumers(),
# lanes_next_start(), lanes_in_flight(): job_status's lane facts, read once per statement.
# lane_status without the history: lane_tallies (per lane, in delta rows: the jobs the table holds;
# kept by the jobs_tally_* statement triggers, views.sql then, tallies.sql since 0010; counted here
# once), jobs.failed_or_cancelled (a plain column written with status by the functions that fail,
# cancel and retry; set here once)
# and its partial index (the failed and cancelled jobs, claim and complete leave it false); lane_flow()
# reads the last 5 minutes by primary key (first_id_since()), no index of its own. Functions, the table and the
# column go after 0007's text is back (0007's views do not use them; RATE_UNDO_BEFORE drops 0008's
# views); the triggers, before it.
SCALE_FUNCTIONS = ("pglane.queue_positions(text), pglane.lanes_consumers(), pglane.lanes_next_start(),"
                   " pglane.lanes_in_flight()")
SCALE_INTERNAL = ("pglane.tally(text, bigint), pglane.fold_tallies(integer), pglane.jobs_tally_insert(),"
                  " pglane.jobs_tally_delete(), pglane.jobs_tally_truncate(), pglane.recount_tallies(),"
                  " pglane.lane_flow(text), pglane.first_id_since(boolean, timestamptz)")
SCALE_BEFORE = """
    CREATE TABLE pglane.lane_tallies (
        lane_id integer NOT NULL REFERENCES pglane.lanes (id) ON DELETE CASCADE,
        shard   bigint  NOT NULL,
        jobs    bigint  NOT NULL,
        PRIMARY KEY (lane_id, shard)
    );
    COMMENT ON TABLE pglane.lane_tallies IS 'per lane, summed over its rows: how many jobs pglane.jobs holds';
    CREATE SEQUENCE pglane.lane_tally_shards;
    INSERT INTO pglane.lane_tallies (lane_id, shard, jobs)
    SELECT l.id, 0, count(*) FROM pglane.jobs j JOIN pglane.lanes l ON l.name = j.lane GROUP BY l.id;
    ALTER TABLE pglane.jobs ADD COLUMN failed_or_cancelled boolean NOT NULL DEFAULT false;
    UPDATE pglane.jobs SET failed_or_cancelled = true WHERE status IN ('failed', 'cancelled');
    COMMENT ON COLUMN pglane.jobs.failed_or_cancelled IS
        'status is failed or cancelled, kept apart so that its index does not depend on status (as in_queue);'
        ' written with status by pglane''s functions (not generated: see views.sql)';
    CREATE INDEX jobs_failed_or_cancelled ON pglane.jobs (lane) WHERE failed_or_cancelled;
    -- Every attempt is updated once when it ends: vacuumed as often as jobs are (the soak's finding: at the
    -- default 20 %, a long history's dead attempt rows pile up between vacuums).
    ALTER TABLE pglane.attempts SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000);
"""
SCALE_AFTER = f"""
    GRANT EXECUTE ON FUNCTION {SCALE_FUNCTIONS} TO {ROLES};
    GRANT EXECUTE ON FUNCTION pglane.lane_flow(text), pglane.recount_tallies() TO pglane_operator;
    GRANT SELECT ON pglane.lane_tallies TO pglane_operator;
"""
SCALE_UNDO_BEFORE = """
    DROP TRIGGER jobs_tally_insert ON pglane.jobs;
    DROP TRIGGER jobs_tally_delete ON pglane.jobs;
    DROP TRIGGER jobs_tally_truncate ON pglane.jobs;
    ALTER TABLE pglane.attempts RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold);
"""
SCALE_UNDO_AFTER = f"""
    DROP FUNCTION {SCALE_FUNCTIONS}, {SCALE_INTERNAL};
    DROP TABLE pglane.lane_tallies;
    DROP SEQUENCE pglane.lane_tally_shards;
    ALTER TABLE pglane.jobs DROP COLUMN failed_or_cancelled;
"""

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
    apply_sql("0007", [name for name in APPLIES if name not in NEW_FILES])
    for _, _, _, undo_after in reversed(SECTIONS):
        _run(undo_after)
