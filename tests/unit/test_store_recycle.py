"""DuckDBStore.recycle: the agent's store reopens its database every `recycle_rows` appended rows (DuckDB
holds every appended row group's metadata while a database is open), waiting for the cursors it lent
(StoreCursor) to be given back, never losing a row, and never stalling on a reader that stays busy
(real DuckDB, real files, real threads)."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from llmobs.otlp import resolve, start_exporter
from llmobs.stagecpu import STAGES
from llmobs.store import retention, sink, synthetic
from llmobs.store.sink import DuckDBStore, StoreBusy


def _processes(first: int, count: int) -> dict:
    return {"processes": pa.table({"pid": [1] * count, "start_ns": list(range(first, first + count))})}


def _count(store: DuckDBStore) -> int:
    return store.count("processes")


def _scratch_survives(conn) -> bool:
    """Whether the database instance that ATTACHed `scratch` is still the one `conn` talks to: an
    attachment lives in the instance, so a real reopen has none (a cursor left out would keep it)."""
    names = {row[0] for row in conn.execute("SELECT database_name FROM duckdb_databases()").fetchall()}
    return "scratch" in names


def test_a_store_reopens_its_database_every_recycle_rows_and_keeps_every_row(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1, recycle_rows=10)
    try:
        store.connection.execute("ATTACH ':memory:' AS scratch")
        before = STAGES.snapshot()["counts"].get("store_recycles", 0)
        store.append(_processes(0, 6))
        assert store.recycles == 0 and _scratch_survives(store.connection)  # 6 of 10 rows: not due
        store.append(_processes(6, 6))
        assert store.recycles == 1
        assert not _scratch_survives(store.connection)  # a new database instance, not the cached one
        assert STAGES.snapshot()["counts"]["store_recycles"] == before + 1
        assert _count(store) == 12
        store.append(_processes(12, 9))  # the count starts again from the reopen: 9 of 10
        assert store.recycles == 1 and _count(store) == 21
        # the settings of the store hold in the reopened database too
        assert store.connection.execute("SELECT current_setting('threads')").fetchall()[0][0] == 1
    finally:
        store.close()


def test_a_store_without_recycle_rows_never_reopens(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1)
    try:
        store.connection.execute("ATTACH ':memory:' AS scratch")
        store.append(_processes(0, 50))
        assert store.recycles == 0 and _scratch_survives(store.connection)
    finally:
        store.close()


def test_a_cursor_in_use_defers_the_reopen_and_an_idle_one_follows_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sink, "RECYCLE_WAIT_S", 0.05)
    monkeypatch.setattr(sink, "RECYCLE_RETRY_ROWS", 4)
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1, recycle_rows=10)
    reader = store.cursor()
    try:
        store.connection.execute("ATTACH ':memory:' AS scratch")
        assert reader.execute("SELECT 1").fetchall() == [(1,)]  # borrowed: in use until idle()
        deferred = STAGES.snapshot()["counts"].get("store_recycles_deferred", 0)
        store.append(_processes(0, 12))  # due: the reader is busy, so the writer goes on
        assert store.recycles == 0 and _count(store) == 12
        assert STAGES.snapshot()["counts"]["store_recycles_deferred"] == deferred + 1
        assert _scratch_survives(reader)  # the reader kept its database and its cursor
        reader.idle()
        store.append(_processes(12, 3))  # 3 of the 4 retry rows: not due yet
        assert store.recycles == 0
        store.append(_processes(15, 1))
        assert store.recycles == 1
        # the same StoreCursor borrows from the reopened database at its next use
        assert not _scratch_survives(reader)
        assert reader.execute("SELECT count(*) FROM processes").fetchall() == [(16,)]
    finally:
        reader.idle()
        store.close()


def test_a_borrower_waits_out_a_reopen_and_reads_the_new_database(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1)
    reader = store.cursor()
    inside, rows = threading.Event(), []
    try:
        store.connection.execute("ATTACH ':memory:' AS scratch")

        def read() -> None:
            inside.wait()
            count = reader.execute("SELECT count(*) FROM processes").fetchall()
            rows.append((_scratch_survives(reader), count))
            reader.idle()

        thread = threading.Thread(target=read)
        thread.start()
        with store.exclusive(wait_s=5) as conn:
            inside.set()  # the reader asks for a cursor now, and must wait for the end of the reopen
            thread.join(0.2)
            assert thread.is_alive() and not rows
            conn.execute("INSERT INTO processes (pid, start_ns) VALUES (1, 1)")
        thread.join(5)
        assert rows == [(False, [(1,)])]
    finally:
        store.close()


def test_compaction_waits_for_cursors_and_gives_up_on_a_busy_one(tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "COMPACT_WAIT_S", 0.05)
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1)
    reader = store.cursor()
    try:
        store.append(_processes(0, 5))
        reader.execute("SELECT 1").fetchall()
        with pytest.raises(StoreBusy):
            retention.compact(store)
        assert _count(store) == 5  # the store goes on, unchanged
        reader.idle()
        retention.compact(store)
        assert reader.execute("SELECT count(*) FROM processes").fetchall() == [(5,)]
    finally:
        reader.idle()
        store.close()


def test_the_following_exporter_gives_its_cursor_back_between_rounds(tmp_path, monkeypatch):
    monkeypatch.setattr(sink, "RECYCLE_WAIT_S", 10.0)  # bounded by one poll of the exporter
    store = DuckDBStore(tmp_path / "s.duckdb", threads=1, recycle_rows=10**9)
    store.append({"token_steps": synthetic.token_steps(4242, 2, 4, seed=3)})
    # nothing listens on port 9: each round fails and backs off, the cursor given back either way
    values = {"endpoint": "http://127.0.0.1:9", "protocol": "http/protobuf", "settle_s": 0.0,
              "poll_interval_s": 0.05, "backoff_initial_s": 0.05, "backoff_max_s": 0.1}  # fmt: skip
    config = resolve(values, env={})
    exporter = start_exporter(store, config)
    try:
        assert store.recycle()  # False if the exporter kept its cursor between its rounds
        assert store.recycles == 1
    finally:
        exporter.shutdown(timeout=5)
        store.close()
