"""DuckDBStore on real DuckDB files: migrations, appends of every input shape, atomic batches, errors."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest
from llmobs.clock import WallClock, fit_clock, sample_brackets
from llmobs.errors import StoreError
from llmobs.store import DuckDBStore, schema, synthetic


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "llmobs.duckdb"


def test_new_store_has_every_table_at_the_latest_version(db_path):
    with DuckDBStore(db_path) as store:
        tables = {
            r[0]
            for r in store.connection.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
        assert set(schema.TIME_COLUMN) | {"schema_migrations"} <= tables
        assert schema.current_version(store.connection) == schema.LATEST_VERSION


def test_a_version_1_store_is_upgraded_in_order_and_keeps_its_rows(db_path):
    conn = duckdb.connect(str(db_path))
    assert schema.migrate(conn, target=1) == [1]
    steps = synthetic.token_steps(pid=11, requests=2, tokens_per_request=5)
    conn.register("s", steps)
    conn.execute("INSERT INTO token_steps SELECT * FROM s")
    conn.close()
    with DuckDBStore(db_path) as store:
        versions = store.connection.execute(
            "SELECT version FROM schema_migrations ORDER BY version"
        ).fetchall()
        assert [v[0] for v in versions] == [m.version for m in schema.MIGRATIONS]
        assert store.count("token_steps") == 10
        assert store.count("clock_fits") == 0  # the table migration 2 adds exists


def test_a_store_newer_than_the_agent_is_refused(db_path):
    with DuckDBStore(db_path) as store:
        store.connection.execute(
            "INSERT INTO schema_migrations (version, description) VALUES (999, 'future')"
        )
    with pytest.raises(StoreError, match="newer than this agent"):
        DuckDBStore(db_path)


def test_token_steps_round_trip_from_arrow_numpy_and_dict(db_path):
    steps = synthetic.token_steps(pid=7, requests=3, tokens_per_request=4, seed=1)
    structured = np.zeros(
        2,
        dtype=[
            ("pid", "<i4"),
            ("step_seq", "<i8"),
            ("trace_id", "S32"),
            ("t_start_ns", "<i8"),
            ("t_end_ns", "<i8"),
            ("loss", "<f4"),
        ],
    )
    structured["pid"] = 8
    structured["step_seq"] = [1, 2]
    structured["trace_id"] = [b"ab" * 16, b"cd" * 16]
    structured["t_start_ns"] = [10, 20]
    structured["t_end_ns"] = [15, 25]
    structured["loss"] = [0.5, float("nan")]
    as_dict = {"pid": [9], "step_seq": [1], "trace_id": ["ef" * 16], "t_start_ns": [1], "t_end_ns": [2]}
    with DuckDBStore(db_path) as store:
        for part in (steps, structured, as_dict):
            assert store.export({"token_steps": part}).ok
        assert store.counters.rows_written == 12 + 2 + 1
        back = store.query("SELECT * FROM token_steps WHERE pid = 7 ORDER BY step_seq, batch_row, trace_id")
        original = steps.sort_by(
            [("step_seq", "ascending"), ("batch_row", "ascending"), ("trace_id", "ascending")]
        )
        for column in steps.column_names:
            assert back[column].to_pylist() == original[column].to_pylist(), column
        rows = store.query("SELECT trace_id, loss, token_id FROM token_steps WHERE pid = 8 ORDER BY step_seq")
        assert rows["trace_id"].to_pylist() == ["ab" * 16, "cd" * 16]
        assert np.isnan(rows["loss"].to_pylist()[1])
        assert rows["token_id"].to_pylist() == [None, None]  # columns a source does not send stay NULL


def test_events_are_routed_by_kind_and_keep_their_trace_id(db_path):
    steps = synthetic.token_steps(pid=5, requests=2, tokens_per_request=3)
    events = synthetic.events_for_steps(steps)
    kinds = events["kind"].to_pylist()
    with DuckDBStore(db_path) as store:
        result = store.export({"events": events})
        assert result.ok and result.rows == events.num_rows
        assert store.count("mem_events") == kinds.count("mem")
        assert store.count("gpu_ops") == kinds.count("gpu") == 0
        assert store.count("host_events") == kinds.count("host") + kinds.count("compute")
        stored = store.query(
            "SELECT ts_ns, probe, trace_hex(trace_hi, trace_lo) AS trace_id FROM mem_events UNION ALL"
            " SELECT ts_ns, probe, trace_hex(trace_hi, trace_lo) FROM host_events ORDER BY ts_ns, probe"
        )
        original = events.sort_by([("ts_ns", "ascending"), ("probe", "ascending")])
        assert stored["trace_id"].to_pylist() == original["trace_id"].to_pylist()
        kinds_stored = store.query("SELECT kind, count(*) AS n FROM host_events GROUP BY kind ORDER BY kind")
        assert kinds_stored["kind"].to_pylist() == ["compute", "host"]


def test_events_may_carry_trace_words_instead_of_hex(db_path):
    words = pa.table(
        {
            "pid": pa.array([1, 1], pa.int32()),
            "ts_ns": [5, 6],
            "probe": ["cuLaunchKernel"] * 2,
            "kind": ["gpu", "gpu"],
            "step_seq": [3, 0],
            "trace_hi": pa.array([2**64 - 1, 0], pa.uint64()),
            "trace_lo": pa.array([1, 0], pa.uint64()),
        }
    )
    with DuckDBStore(db_path) as store:
        assert store.export({"events": words}).ok
        ids = store.query("SELECT trace_hex(trace_hi, trace_lo) AS t FROM gpu_ops ORDER BY ts_ns")[
            "t"
        ].to_pylist()
        assert ids == ["ffffffffffffffff0000000000000001", ""]


def test_a_failing_part_rolls_back_the_whole_batch_and_is_counted(db_path):
    steps = synthetic.token_steps(pid=3, requests=1, tokens_per_request=4)
    bad = pa.table({"pid": [1], "no_such_column": [2]})
    with DuckDBStore(db_path) as store:
        result = store.export({"token_steps": steps, "mem_events": bad})
        assert not result.ok and "no_such_column" in result.error
        assert store.count("token_steps") == 0  # the good part went back too
        assert store.counters.batches_failed == 1 and store.counters.batches_ok == 0
        assert not store.export({"nonsense": steps}).ok
        assert not store.export({"events": steps}).ok  # no kind column
        assert not store.export({"token_steps": [1, 2, 3]}).ok
        assert store.counters.batches_failed == 4
        assert store.export({"token_steps": steps}).ok  # the store is still usable afterwards
        assert store.count("token_steps") == 4


def test_clock_fits_and_processes_are_recorded(db_path):
    with DuckDBStore(db_path) as store:
        store.record_clock_fit("realtime", WallClock.measure(16))
        store.record_clock_fit("synthetic", fit_clock(sample_brackets(lambda: 5, 8)))
        store.upsert_process(42, 100, exe="/usr/bin/python3", first_seen_ns=1, last_seen_ns=1)
        store.upsert_process(42, 100, last_seen_ns=9)
        fits = store.query("SELECT clock, samples, error_ns FROM clock_fits ORDER BY clock")
        assert fits["clock"].to_pylist() == ["realtime", "synthetic"]
        assert fits["samples"].to_pylist() == [16, 4]
        procs = store.query("SELECT exe, first_seen_ns, last_seen_ns FROM processes")
        assert procs.to_pylist() == [{"exe": "/usr/bin/python3", "first_seen_ns": 1, "last_seen_ns": 9}]


def test_shutdown_checkpoints_and_the_data_reopens(db_path):
    store = DuckDBStore(db_path)
    store.export({"token_steps": synthetic.token_steps(pid=2, requests=2, tokens_per_request=8)})
    assert store.shutdown(timeout=5).ok
    assert not (db_path.parent / (db_path.name + ".wal")).exists()
    with DuckDBStore(db_path, read_only=True) as reopened:
        assert reopened.count("token_steps") == 16


def test_open_errors_are_one_clear_store_error(tmp_path):
    with pytest.raises(StoreError, match="no store at"):
        DuckDBStore(tmp_path / "absent.duckdb", read_only=True)
    junk = tmp_path / "junk.duckdb"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open"):
        DuckDBStore(junk)
    plain = tmp_path / "plain.duckdb"
    duckdb.connect(str(plain)).execute("CREATE TABLE x (a INT)").close()
    with pytest.raises(StoreError, match="not an llmobs store"):
        DuckDBStore(plain, read_only=True)


def test_default_path_is_under_var_lib_and_env_overrides(monkeypatch, tmp_path):
    from llmobs.store import DEFAULT_DB_PATH, default_db_path

    monkeypatch.delenv("LLMOBS_DB", raising=False)
    assert default_db_path() == DEFAULT_DB_PATH
    assert str(DEFAULT_DB_PATH).startswith("/var/lib/llmobs/")
    monkeypatch.setenv("LLMOBS_DB", str(tmp_path / "x.duckdb"))
    assert default_db_path() == tmp_path / "x.duckdb"
