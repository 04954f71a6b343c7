-- A session's identity: what an attempt records about the session that claimed it, and the evidence
-- recovery reads later to tell whether that session still lives. Readable by any role: managed
-- PostgreSQL gives the schema's owner neither SUPERUSER nor pg_read_all_stats, and pg_stat_activity
-- hides another role's backend_start from such an owner (docs/managed.md).
--
-- The mark. The first claim of a session gives it a mark: a session-level advisory lock (the bigint
-- form, objsubid 1, apart from the slots' two-integer keys) whose key is the microsecond since the
-- epoch at which the session took it, bumped until no other session holds that key. The session
-- keeps it until it ends, and pglane never lets go of it: so "pid P holds mark M" in pg_locks, which
-- every role may read, is the proof that the claiming session still lives. The attempt records
-- backend_pid = P, session_mark = M and backend_start = M as a time (when the session registered).
--
-- Invariants: the mark is chosen and locked by the claim (SECURITY DEFINER), never given by the
-- caller: a session cannot claim under another session's identity, and a mark that another session
-- holds cannot be taken. The setting pglane.session_mark only says which key to check first; the
-- check itself is exact (the same pin, unlock and re-lock as the slot check in slots.sql), so a
-- forged setting costs a new mark, nothing more. A dead session's mark can be taken by a later session
-- only under another pid (two live backends never share one), or under a reused pid by deliberate
-- effort: that stalls its attempts' recovery (shown as a squatter on the slot it must also hold) and
-- never makes a live claimer look gone.

-- mark_time: the time a mark stands for (microseconds since the epoch, exact). No SET clause, so that
-- the claim inlines it (a function with one costs a GUC save and restore per call); it is called
-- with the search_path pinned by the caller's own SET (claim_impl, the views' definer functions).
-- STABLE, as its body is (timestamptz + interval is): PostgreSQL inlines no function declared more
-- immutable than its body, and before 18 plans a SQL function's body at every call it is not inlined
-- in (some 66,000 instructions per claim on 15, bench/README.md "The cost of each feature").
CREATE OR REPLACE FUNCTION pglane.mark_time(p_mark bigint) RETURNS timestamptz
LANGUAGE sql STABLE
AS $$
    SELECT 'epoch'::timestamptz + p_mark * interval '1 microsecond';
$$;

-- session_mark: this session's mark, taken now if it has none. Runs inside the claim, on every claim:
-- no SET clause (see mark_time), every name qualified; no role but the owner may call it.
CREATE OR REPLACE FUNCTION pglane.session_mark() RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    v_said text := pg_catalog.current_setting('pglane.session_mark', true);
    v_mark bigint;  -- the setting, if it is 1 to 18 ASCII digits (see claim_slot: no regular expression)
BEGIN
    IF pg_catalog.length(v_said) BETWEEN 1 AND 18 AND pg_catalog.ltrim(v_said, '0123456789') = '' THEN
        v_mark := v_said::bigint;
    END IF;
    -- Held already? The transaction-level try-lock succeeds only if the key is free or ours; the unlock
    -- then says whether we held it at session level; the re-lock gives it back. (Nested IFs: SQL does
    -- not promise to evaluate AND left to right.)
    IF v_mark IS NOT NULL AND pg_catalog.pg_try_advisory_xact_lock(v_mark) THEN
        IF pg_catalog.pg_advisory_unlock(v_mark) THEN
            PERFORM pg_catalog.pg_advisory_lock(v_mark);
            RETURN v_mark;
        END IF;
    END IF;
    v_mark := (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000000)::bigint;
    WHILE NOT pg_catalog.pg_try_advisory_lock(v_mark) LOOP
        v_mark := v_mark + 1;
    END LOOP;
    -- A session setting: kept when the claim's transaction commits; rolled back with it otherwise,
    -- when the next claim takes another mark (the lock of this one stays with the session, harmless).
    PERFORM pg_catalog.set_config('pglane.session_mark', v_mark::text, false);
    RETURN v_mark;
END $$;

-- holds_mark: whether session p_pid holds mark p_mark in this database right now (pg_locks).
CREATE OR REPLACE FUNCTION pglane.holds_mark(p_pid integer, p_mark bigint) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks k
         WHERE k.locktype = 'advisory' AND k.objsubid = 1 AND k.pid = p_pid AND k.granted
           AND k.mode = 'ExclusiveLock'
           AND (k.classid::bigint << 32 | k.objid::bigint) = p_mark
           AND k.database = (SELECT d.oid FROM pg_catalog.pg_database d
                              WHERE d.datname = pg_catalog.current_database()));
$$;

-- session_alive: whether the session that claimed an attempt still exists and still holds a slot of
-- the attempt's lane. Both are evidence: an exiting backend releases its advisory locks a moment
-- before it leaves pg_stat_activity, and a correct worker never lets go of its slot (nor its mark)
-- during a call. An attempt claimed before revision 0009 has no mark: its session is looked up by pid
-- and backend_start in pg_stat_activity, and when it exists but its start cannot be read (no
-- privilege) it counts as alive: pglane never marks an attempt lost without proof.
CREATE OR REPLACE FUNCTION pglane.session_alive(
    p_pid integer, p_backend_start timestamptz, p_session_mark bigint, p_lane_id integer, p_slots integer
) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT CASE WHEN p_session_mark IS NOT NULL THEN pglane.holds_mark(p_pid, p_session_mark)
                ELSE EXISTS (SELECT 1 FROM pg_stat_get_activity(p_pid) s
                              WHERE s.backend_start IS NULL OR s.backend_start = p_backend_start)
           END
       AND EXISTS (SELECT 1 FROM pglane.slot_holders h
                    WHERE h.pid = p_pid AND h.lane_id = p_lane_id AND h.slot <= p_slots
                      AND h.granted AND h.mode = 'ExclusiveLock');
$$;

-- is_claiming_session: whether the calling session is the one that claimed an attempt with this
-- identity (a consumer that claims and completes on one connection needs no token).
CREATE OR REPLACE FUNCTION pglane.is_claiming_session(p_pid integer, p_backend_start timestamptz,
                                                      p_session_mark bigint) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pglane, pg_temp
AS $$
    SELECT p_pid = pg_backend_pid()
       AND CASE WHEN p_session_mark IS NOT NULL THEN pglane.holds_mark(p_pid, p_session_mark)
                ELSE p_backend_start = (SELECT s.backend_start FROM pg_stat_get_activity(pg_backend_pid()) s)
           END;
$$;
