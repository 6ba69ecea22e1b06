"""Retention on real DuckDB files: by age (exact cutoffs, every table) and by size (file under the limit)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore, schema, synthetic
from llmobs.store.retention import retain_age, retain_size, store_file_size


def _fill(store, requests=20, tokens=10, seed=0):
    steps = synthetic.token_steps(pid=9, requests=requests, tokens_per_request=tokens, seed=seed)
    assert store.export({"token_steps": steps, "events": synthetic.events_for_steps(steps, seed=seed)}).ok
    assert store.export(
        {"probe_aggregates": synthetic.aggregates_for_steps(steps, synthetic.DEFAULT_PROBES)}
    ).ok
    correlate(store.connection)
    return steps


def test_retain_age_drops_exactly_the_rows_older_than_the_cutoff(tmp_path):
    with DuckDBStore(tmp_path / "a.duckdb") as store:
        steps = _fill(store)
        starts = np.sort(steps["t_start_ns"].to_numpy())
        now = int(starts[-1]) + 1
        cutoff = int(starts[len(starts) // 2])
        expected = {
            table: store.connection.execute(
                f"SELECT count(*) FROM {table} WHERE {col} < ?", [cutoff]
            ).fetchall()[0][0]
            for table, col in schema.TIME_COLUMN.items()
        }
        before = {table: store.count(table) for table in schema.TIME_COLUMN}
        report = retain_age(store, max_age_ns=now - cutoff, now_ns=now)
        assert report.cutoff_ns == cutoff
        assert report.deleted == expected
        assert expected["token_steps"] > 0 and expected["mem_events"] > 0 and expected["step_rollups"] > 0
        for table, col in schema.TIME_COLUMN.items():
            assert store.count(table) == before[table] - expected[table]
            oldest = store.connection.execute(f"SELECT min({col}) FROM {table}").fetchall()[0][0]
            assert oldest is None or oldest >= cutoff


def test_retain_size_brings_the_file_under_the_limit_keeping_the_newest_rows(tmp_path):
    path = tmp_path / "s.duckdb"
    with DuckDBStore(path) as store:
        # ~1.2 M events over 4,000 forward passes: a file of a few tens of MB.
        rng = np.random.default_rng(1)
        n = 1_200_000
        ts = np.sort(rng.integers(1_000_000_000_000, 1_100_000_000_000, size=n))
        events = pa.table(
            {
                "pid": np.full(n, 3, np.int32),
                "tid": rng.integers(3, 9, size=n).astype(np.int32),
                "ts_ns": ts,
                "probe": pa.array(np.array(["alloc_cpu", "free_cpu"])[rng.integers(0, 2, size=n)]),
                "kind": ["mem"] * n,
                "step_seq": ts // 25_000_000,
                "value": rng.integers(0, 1 << 30, size=n),
            }
        )
        assert store.export({"events": events}).ok
        store.checkpoint()
        size = store_file_size(path)
        newest = store.connection.execute("SELECT max(ts_ns) FROM mem_events").fetchall()[0][0]
        limit = size // 3
        report = retain_size(store, limit)
        assert report.size_before == size
        assert report.size_after <= limit and store_file_size(path) <= limit
        assert report.compacted  # DuckDB never shrinks a file by itself: the rewrite did it
        assert 0 < report.deleted["mem_events"] < n
        remaining = store.count("mem_events")
        assert remaining == n - report.deleted["mem_events"]
        oldest_kept, newest_kept = store.connection.execute(
            "SELECT min(ts_ns), max(ts_ns) FROM mem_events"
        ).fetchall()[0]
        assert newest_kept == newest
        # Only the oldest went: every deleted timestamp is older than every kept one.
        assert int(np.sum(ts < oldest_kept)) == report.deleted["mem_events"]
        assert store.export({"events": events.slice(0, 10)}).ok  # still writable after compaction
    with DuckDBStore(path, read_only=True) as reopened:
        assert reopened.count("mem_events") == remaining + 10


def test_retain_size_on_a_store_already_small_does_nothing(tmp_path):
    with DuckDBStore(tmp_path / "small.duckdb") as store:
        _fill(store, requests=2, tokens=3)
        before = store.count("token_steps")
        report = retain_size(store, 1 << 40)
        assert report.deleted == {} and not report.compacted and store.count("token_steps") == before
