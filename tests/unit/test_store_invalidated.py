"""DuckDB invalidates a database when an automatic checkpoint inside a commit runs out of the memory cap
("FATAL Error: Failed to create checkpoint because of error: could not allocate block"): every later
statement on it fails until it is opened again. Seen once at 20k steps/s: 768,853 of 852,572 rows failed
in one attach. The store reopens it and runs the failed append once more (its commit stored nothing).
Real DuckDB, a real file: a temp table on another cursor holds most of a 32 MB cap (no temp directory to
offload it to) and the checkpoint threshold is small, so a commit's checkpoint cannot get a block."""

from __future__ import annotations

import contextlib
import threading
import time

import duckdb
import pytest
from llmobs.stagecpu import STAGES
from llmobs.store import synthetic
from llmobs.store.sink import DuckDBStore, StoreCursor


def _hog(store: DuckDBStore) -> StoreCursor:
    """~25 MB of the 32 MB cap held by a temp table of a cursor of the store; checkpoints after ~1 MB."""
    hog = store.cursor()
    hog.execute("SET temp_directory = ''")  # the database's: nothing of the temp table can be offloaded
    hog.execute("SET checkpoint_threshold = '1MB'")
    hog.execute("CREATE TEMP TABLE hog AS SELECT i, md5(i::VARCHAR) s FROM range(400000) r(i)")
    return hog


def _steps(pid: int):
    return synthetic.token_steps(pid, requests=15, tokens_per_request=1000)  # 15,000 rows


def test_a_commit_that_invalidates_the_database_is_run_again_after_a_reopen(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="32MB", threads=1)
    hog_ready, done = threading.Event(), threading.Event()

    def hold_until_invalidated() -> None:
        # the hog gives its cursor back once the database is invalid, as the agent's lanes do between
        # rounds, so that the store can reopen it; the premise (below) is that it was invalidated
        hog = _hog(store)
        hog_ready.set()
        deadline = time.monotonic() + 60
        while not store._invalid and not done.is_set() and time.monotonic() < deadline:
            time.sleep(0.001)
        hog.idle()

    holder = threading.Thread(target=hold_until_invalidated)
    holder.start()
    try:
        assert hog_ready.wait(60)
        before = STAGES.snapshot()["counts"].get("store_reopened_invalidated", 0)
        appended = 0
        for pid in range(1, 21):  # each append's 15,000 rows add to the WAL until a commit checkpoints
            assert store.append({"token_steps": _steps(pid)}) == {"token_steps": 15_000}
            appended += 15_000
            if store.reopens:
                break
        assert store.reopens == 1, "no commit invalidated the database: the premise did not hold"
        assert STAGES.snapshot()["counts"]["store_reopened_invalidated"] == before + 1
        assert store.count("token_steps") == appended  # every append stored once: none lost, none twice
        assert store.append({"token_steps": _steps(99)}) == {"token_steps": 15_000}  # and it goes on
        assert store.count("token_steps") == appended + 15_000
    finally:
        done.set()
        holder.join()
        store.close()


def test_a_cursor_lent_after_an_invalidation_reads_the_reopened_database(tmp_path):
    """The correlate loop and the anomaly lane reach the store through lent cursors: a statement of theirs
    that invalidates the database fails (counted by them, their window retried); the next cursor lent
    reopens it first, so they do not fail on forever while no append comes (an idle target)."""
    store = DuckDBStore(tmp_path / "s.duckdb", memory_limit="32MB", threads=1)
    try:
        hog = _hog(store)
        writer = store.cursor()
        committed = 0
        with pytest.raises(duckdb.FatalException, match="checkpoint"):
            for pid in range(1, 21):
                store.with_headroom(lambda pid=pid: _commit(writer, _steps(pid)))
                committed += 15_000
        assert store._invalid and store.reopens == 0
        hog.idle()
        writer.idle()
        with store.cursor() as reader:
            assert reader.execute("SELECT count(*) FROM token_steps").fetchall() == [(committed,)]
        assert store.reopens == 1 and not store._invalid
    finally:
        store.close()


def _commit(cursor: StoreCursor, steps) -> None:
    cursor.register("batch", steps)
    cursor.execute("BEGIN TRANSACTION")
    try:
        cursor.execute("INSERT INTO token_steps BY NAME SELECT * FROM batch")
        cursor.execute("COMMIT")
    except duckdb.Error:
        with contextlib.suppress(duckdb.Error):  # a failed commit has ended its transaction already
            cursor.execute("ROLLBACK")
        raise
    finally:
        with contextlib.suppress(duckdb.Error):
            cursor.unregister("batch")
