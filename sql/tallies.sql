-- Tallies: how many jobs each lane holds, and how many of them are failed and cancelled, kept as the
-- jobs are written.
--
-- lane_status's counts, independent of the history (#19, #31 point 7), and not a write nor a trigger
-- more on the claim/complete path: done is what is left of a lane's jobs once its queued and running
-- ones (read through the queue and running-attempt indexes: the backlog) and its failed and cancelled
-- ones are taken off. How many jobs a lane holds, and how many of them are failed and cancelled, is
-- kept in pglane.lane_tallies (jobs, failed, cancelled): an INSERT or DELETE statement adds its
-- counts per lane (statement triggers; a TRUNCATE empties the tallies), so every writer is counted,
-- pglane's functions and plain SQL alike. A job is counted failed (cancelled) while its column
-- failed_or_cancelled is true and its status is failed (cancelled). That column is a plain one,
-- written by the four functions that move a job into or out of failed and cancelled (jobs.sql:
-- requeue_or_fail, cancel, retry, a late result in complete_impl), not a generated one: PostgreSQL reads a generated
-- column's expression again from its stored text for every UPDATE statement, about 20,000
-- instructions each, two per job (bench.callgrind). The row trigger jobs_tally_update counts those
-- moves: it is declared AFTER UPDATE OF failed_or_cancelled, so PostgreSQL fires it only for an UPDATE
-- whose SET list names that column; claim and complete do not (they leave it false: a completion
-- stays a HOT update), and for their UPDATEs the trigger costs a check of the statement's updated
-- columns, the foreign key's row trigger (attempts.job_id) already fetching the old row for every
-- UPDATE of jobs (bench.scale --only instructions: within noise). Not a statement trigger with a
-- transition table: PostgreSQL refuses a column list there, and without one it would keep every row
-- of every UPDATE of jobs, claim's and complete's included. A status changed by hand must set
-- failed_or_cancelled in the same UPDATE (to its value, even unchanged: the SET list is what counts);
-- rows written with triggers off (session_replication_role = replica), or a status changed without
-- it, are not counted: pglane.recount_tallies() sets the column again from status everywhere and
-- counts again. A job made running by hand without a running attempt would read as done.

-- A tally change is a row of its own (a delta), inserted, never an update of a shared row: so
-- producers never wait on each other for it (a producer's open transaction locks nothing another
-- needs). lane_status adds a lane's rows up; every 64th delta folds the lane's rows into one (rows
-- another fold holds are skipped; at most one fold per transaction), so a lane keeps a few dozen rows,
-- whatever its history.
CREATE OR REPLACE FUNCTION pglane.tally(p_lane text, p_jobs bigint, p_failed bigint, p_cancelled bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lane  integer;
    v_shard bigint := nextval('pglane.lane_tally_shards');
BEGIN
    SELECT l.id INTO v_lane FROM pglane.lanes l WHERE l.name = p_lane;
    INSERT INTO pglane.lane_tallies (lane_id, shard, jobs, failed, cancelled)
    VALUES (v_lane, v_shard, p_jobs, p_failed, p_cancelled);
    -- At most once per transaction: rows this transaction deleted stay in the way of its later reads.
    IF v_shard % 64 = 0 AND current_setting('pglane.tallies_folded', true) IS DISTINCT FROM txid_current()::text THEN
        PERFORM pglane.fold_tallies(v_lane);
        PERFORM set_config('pglane.tallies_folded', txid_current()::text, true);
    END IF;
END $$;

-- fold_tallies: replace lane p_lane_id's tally rows that no other transaction holds by their sum.
CREATE OR REPLACE FUNCTION pglane.fold_tallies(p_lane_id integer) RETURNS void
LANGUAGE sql
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    WITH held AS MATERIALIZED (
        SELECT s.shard FROM pglane.lane_tallies s WHERE s.lane_id = p_lane_id FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM pglane.lane_tallies t USING held h
         WHERE t.lane_id = p_lane_id AND t.shard = h.shard
        RETURNING t.jobs, t.failed, t.cancelled
    )
    INSERT INTO pglane.lane_tallies (lane_id, shard, jobs, failed, cancelled)
    SELECT p_lane_id, nextval('pglane.lane_tally_shards'), sum(g.jobs), sum(g.failed), sum(g.cancelled)
      FROM gone g HAVING count(*) > 0;
$$;

-- jobs_tally_rows (triggers jobs_tally_insert and jobs_tally_delete): once per statement, per lane touched. jobs_tally_update: once
-- per row of an UPDATE that names failed_or_cancelled, for a row whose count changes.
CREATE OR REPLACE FUNCTION pglane.jobs_tally_rows() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_sign integer := CASE TG_OP WHEN 'INSERT' THEN 1 ELSE -1 END;  -- rows inserted count in, deleted out
BEGIN
    PERFORM pglane.tally(c.lane, v_sign * c.jobs, v_sign * c.failed, v_sign * c.cancelled)
       FROM (SELECT j.lane, count(*) AS jobs,
                    count(*) FILTER (WHERE j.failed_or_cancelled AND j.status = 'failed') AS failed,
                    count(*) FILTER (WHERE j.failed_or_cancelled AND j.status = 'cancelled') AS cancelled
               FROM changed_jobs j GROUP BY j.lane) c;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION pglane.jobs_tally_update() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_failed    integer := (NEW.failed_or_cancelled AND NEW.status = 'failed')::integer
                         - (OLD.failed_or_cancelled AND OLD.status = 'failed')::integer;
    v_cancelled integer := (NEW.failed_or_cancelled AND NEW.status = 'cancelled')::integer
                         - (OLD.failed_or_cancelled AND OLD.status = 'cancelled')::integer;
BEGIN
    IF NEW.lane IS DISTINCT FROM OLD.lane THEN  -- by hand only: the job moves its counts too
        PERFORM pglane.tally(OLD.lane, -1, -(OLD.failed_or_cancelled AND OLD.status = 'failed')::integer,
                             -(OLD.failed_or_cancelled AND OLD.status = 'cancelled')::integer);
        PERFORM pglane.tally(NEW.lane, 1, (NEW.failed_or_cancelled AND NEW.status = 'failed')::integer,
                             (NEW.failed_or_cancelled AND NEW.status = 'cancelled')::integer);
    ELSIF v_failed <> 0 OR v_cancelled <> 0 THEN
        PERFORM pglane.tally(NEW.lane, 0, v_failed, v_cancelled);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION pglane.jobs_tally_truncate() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
BEGIN
    DELETE FROM pglane.lane_tallies;
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS jobs_tally_insert ON pglane.jobs;
CREATE TRIGGER jobs_tally_insert AFTER INSERT ON pglane.jobs
    REFERENCING NEW TABLE AS changed_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pglane.jobs_tally_rows();
DROP TRIGGER IF EXISTS jobs_tally_delete ON pglane.jobs;
CREATE TRIGGER jobs_tally_delete AFTER DELETE ON pglane.jobs
    REFERENCING OLD TABLE AS changed_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pglane.jobs_tally_rows();
DROP TRIGGER IF EXISTS jobs_tally_update ON pglane.jobs;
CREATE TRIGGER jobs_tally_update AFTER UPDATE OF failed_or_cancelled ON pglane.jobs
    FOR EACH ROW EXECUTE FUNCTION pglane.jobs_tally_update();
DROP TRIGGER IF EXISTS jobs_tally_truncate ON pglane.jobs;
CREATE TRIGGER jobs_tally_truncate AFTER TRUNCATE ON pglane.jobs
    FOR EACH STATEMENT EXECUTE FUNCTION pglane.jobs_tally_truncate();

-- recount_tallies: set failed_or_cancelled again from status wherever the two disagree, then count
-- every lane's jobs, and its failed and cancelled ones, again from the history (one full read, with
-- writers to pglane.jobs held off meanwhile): after rows were written with triggers off or statuses
-- changed by hand. Returns the lanes counted.
CREATE OR REPLACE FUNCTION pglane.recount_tallies() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pglane, pg_temp
AS $$
DECLARE
    v_lanes integer;
BEGIN
    LOCK TABLE pglane.jobs IN SHARE MODE;
    UPDATE pglane.jobs j SET failed_or_cancelled = j.status IN ('failed', 'cancelled')
     WHERE j.failed_or_cancelled IS DISTINCT FROM (j.status IN ('failed', 'cancelled'));
    DELETE FROM pglane.lane_tallies;
    INSERT INTO pglane.lane_tallies (lane_id, shard, jobs, failed, cancelled)
    SELECT l.id, 0, count(*), count(*) FILTER (WHERE j.failed_or_cancelled AND j.status = 'failed'),
           count(*) FILTER (WHERE j.failed_or_cancelled AND j.status = 'cancelled')
      FROM pglane.jobs j JOIN pglane.lanes l ON l.name = j.lane GROUP BY l.id;
    GET DIAGNOSTICS v_lanes = ROW_COUNT;
    RETURN v_lanes;
END $$;
