"""DuckDBStore.with_headroom: a statement that runs out of the store's memory cap runs once more with the
cap raised, and the cap is back afterwards (real DuckDB, a real file)."""

from __future__ import annotations

import threading
import time

import duckdb
import pytest
from llmobs.stagecpu import STAGES
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore

# ~15 MB of text in one aggregate state, its buffer doubling as it grows: more than a 16MB cap holds, less
# than the headroom
BIG = "SELECT length(string_agg(i::VARCHAR, ',')) FROM range(2000000) t(i)"


def _limit(conn) -> str:
    return conn.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]


def test_out_of_memory_is_run_again_with_headroom_and_the_cap_restored(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="16MB", threads=1)
    try:
        conn = store.connection.cursor()
        capped = _limit(conn)
        with pytest.raises(duckdb.OutOfMemoryException):  # the premise: the cap alone is not enough
            conn.execute(BIG).fetchall()
        before = STAGES.snapshot()["counts"].get("store_headroom_retries", 0)
        assert store.with_headroom(lambda: conn.execute(BIG).fetchall()) == [(14_888_889,)]
        assert store.headroom_retries == 1
        assert STAGES.snapshot()["counts"]["store_headroom_retries"] == before + 1
        assert _limit(conn) == capped  # back to the cap for everything after
        # a statement that fits is run once, with no retry counted
        assert store.with_headroom(lambda: conn.execute("SELECT 42").fetchall()) == [(42,)]
        assert store.headroom_retries == 1
    finally:
        store.close()


def test_without_a_cap_of_ours_the_error_stands(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1)
    try:
        conn = store.connection.cursor()
        conn.execute("SET memory_limit = '16MB'")  # someone else's cap: not ours to raise
        with pytest.raises(duckdb.OutOfMemoryException):
            store.with_headroom(lambda: conn.execute(BIG).fetchall())
        assert store.headroom_retries == 0
    finally:
        store.close()


def test_a_retry_while_the_writer_uses_the_connection_fails_neither(tmp_path):
    """The cap is raised and put back through a cursor of its own: the store's connection may be in the
    middle of an append (another thread, under the store's lock), and DuckDB refuses a second call on a
    busy connection instead of waiting. Before, one of the two failed: the retry, or the append and its
    rows. Here a long query holds the store's connection while a retry runs."""
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="16MB", threads=1)
    outcome: dict[str, object] = {}

    def hold_the_connection() -> None:
        try:
            outcome["long"] = store.query("SELECT sum(range * range) FROM range(400000000)").num_rows
        except Exception as exc:  # what failed is the test's answer
            outcome["long"] = exc

    holder = threading.Thread(target=hold_the_connection)
    try:
        conn = store.connection.cursor()
        holder.start()
        while not store._lock.locked() and holder.is_alive():  # the query holds the lock while it runs
            time.sleep(0.001)
        assert holder.is_alive(), outcome
        assert store.with_headroom(lambda: conn.execute(BIG).fetchall()) == [(14_888_889,)]
        holder.join()
        assert outcome["long"] == 1
        assert _limit(conn) == _limit(store.connection.cursor())
    finally:
        holder.join()
        store.close()


def test_an_append_over_the_cap_is_committed_with_headroom_not_lost(tmp_path):
    """An append whose transaction runs out of the store's memory cap (here its inserts, under an 8 MB
    cap; in an agent at 20k steps/s it was the commit, while correlate held memory) is run once more with
    the cap raised: every row is stored. Before, the append failed and its rows were counted lost."""
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="8MB", threads=1)
    try:
        steps = synthetic.token_steps(1, 2000, 100, batch_rows=4)
        events = synthetic.events_for_steps(steps)
        written = store.append({"token_steps": steps, "events": events})
        assert written["token_steps"] == steps.num_rows == 200_000
        assert store.headroom_retries == 1
        assert store.count("token_steps") == steps.num_rows
        assert store.count("mem_events") + store.count("host_events") == events.num_rows
        assert _limit(store.connection.cursor()) == _limit(store.connection)  # the cap is back
    finally:
        store.close()


def test_a_commit_that_cannot_allocate_a_block_is_run_again_with_headroom(tmp_path):
    """A commit that needs a block while another lane holds the cap fails with DuckDB's TransactionException
    "Failed to commit: could not allocate block ..." (seen at 20k steps/s: ~22,000 rows of a commit lost).
    Real DuckDB: an in-memory temp table on another cursor holds ~25 MB of the 32 MB cap (no temp
    directory to offload it to), so a 15,000-row append's inserts fit and its commit cannot get a block
    (the premise, checked first on a cursor of its own); through the store it commits every row."""
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="32MB", threads=1)
    try:
        hog = store.connection.cursor()
        hog.execute("SET temp_directory = ''")  # the database's: nothing of the temp table can be offloaded
        hog.execute("CREATE TEMP TABLE hog AS SELECT i, md5(i::VARCHAR) s FROM range(530000) r(i)")
        steps = synthetic.token_steps(4242, requests=15, tokens_per_request=1000)
        premise = store.connection.cursor()
        premise.execute("BEGIN TRANSACTION")
        premise.execute("INSERT INTO token_steps BY NAME SELECT * FROM steps")
        with pytest.raises(duckdb.TransactionException, match="Failed to commit: could not allocate block"):
            premise.execute("COMMIT")
        premise.close()
        assert store.count("token_steps") == 0
        assert store.append({"token_steps": steps}) == {"token_steps": 15_000}
        assert store.headroom_retries == 1 and store.count("token_steps") == 15_000
        assert _limit(hog) == "30.5 MiB"  # the cap is back
    finally:
        store.close()


def test_a_cap_that_cannot_be_put_back_yet_stays_raised_and_the_statement_stands(tmp_path):
    """After a retry, DuckDB refuses to lower the cap while more than it is in use ("Failed to change
    memory limit ... could not free up enough memory"). Before, that refusal failed the statement that
    had just succeeded (an append's committed rows counted failed). Now the statement stands, the cap
    stays raised (counted), and the next statement through the store puts it back once memory is free.
    Real DuckDB: temp tables with no temp directory hold the memory."""
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="32MB", threads=1)
    try:
        hog = store.connection.cursor()
        hog.execute("SET temp_directory = ''")
        hog.execute("CREATE TEMP TABLE hog AS SELECT i, md5(i::VARCHAR) s FROM range(530000) r(i)")
        more = "CREATE TEMP TABLE more AS SELECT i, md5(i::VARCHAR) s FROM range(300000) r(i)"
        with pytest.raises(duckdb.OutOfMemoryException):  # the premise: over the cap
            hog.execute(more)
        deferred = STAGES.snapshot()["counts"].get("store_cap_restores_deferred", 0)
        assert store.with_headroom(lambda: hog.execute(more).fetchall()) is not None
        assert store.headroom_retries == 1
        assert STAGES.snapshot()["counts"]["store_cap_restores_deferred"] == deferred + 1
        assert _limit(hog) != "30.5 MiB"  # still raised: ~38 MB of temp tables are in use
        assert store.with_headroom(lambda: hog.execute("SELECT 42").fetchall()) == [(42,)]
        assert _limit(hog) != "30.5 MiB"  # still in use: still raised, nothing failed
        hog.execute("DROP TABLE more")
        hog.execute("DROP TABLE hog")
        assert store.with_headroom(lambda: hog.execute("SELECT 43").fetchall()) == [(43,)]
        assert _limit(hog) == "30.5 MiB" and store.headroom_retries == 1
    finally:
        store.close()
