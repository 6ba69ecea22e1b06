"""Retention: drop rows older than an age, and keep the DuckDB file under a size.

Age is measured on CLOCK_MONOTONIC (every stored timestamp's clock) against `now_ns`, by default the
host's monotonic clock now. Size: DuckDB reuses freed blocks but does not shrink its file, so after
deleting the oldest rows we CHECKPOINT and, when the live data fits but the file does not, rewrite the
file compactly (COPY FROM DATABASE into a new file, then an atomic rename).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from llmobs import clock
from llmobs.store import schema
from llmobs.store.sink import DuckDBStore

# How long a compaction waits for the store's lent cursors (the exporter's, the correlate loop's) to go
# idle before it gives up for this round (StoreBusy, logged by the daemon; the next round tries again).
COMPACT_WAIT_S = 10.0
# Tables whose time decides which rows are "oldest" when trimming by size.
_TIMELINE_TABLES = ("token_steps", *schema.EVENT_TABLES, "probe_aggregates")


@dataclass
class RetentionReport:
    deleted: dict[str, int] = field(default_factory=dict)
    size_before: int = 0
    size_after: int = 0
    compacted: bool = False
    cutoff_ns: int | None = None


def store_file_size(path: Path) -> int:
    """Bytes on disk: the database file plus its write-ahead log."""
    total = 0
    for candidate in (path, Path(f"{path}.wal")):
        with contextlib.suppress(FileNotFoundError):
            total += candidate.stat().st_size
    return total


def delete_before(store: DuckDBStore, cutoff_ns: int) -> dict[str, int]:
    """Delete every row whose time column is before `cutoff_ns`, all tables in one transaction."""
    conn = store.connection
    deleted = {}
    with store._lock:
        conn.execute("BEGIN TRANSACTION")
        try:
            for table, column in schema.TIME_COLUMN.items():
                deleted[table] = conn.execute(
                    f"DELETE FROM {table} WHERE {column} < ?", [cutoff_ns]
                ).fetchall()[0][0]
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise
    return deleted


def retain_age(store: DuckDBStore, max_age_ns: int, now_ns: int | None = None) -> RetentionReport:
    """Drop rows older than `max_age_ns` before `now_ns` (default: CLOCK_MONOTONIC now)."""
    now = clock.monotonic_ns() if now_ns is None else now_ns
    report = RetentionReport(size_before=store_file_size(store.path), cutoff_ns=now - max_age_ns)
    report.deleted = delete_before(store, report.cutoff_ns)
    store.checkpoint()
    report.size_after = store_file_size(store.path)
    return report


def _used_bytes(store: DuckDBStore) -> int:
    with store._lock:
        row = store.connection.execute(
            "SELECT block_size * used_blocks FROM pragma_database_size()"
        ).fetchall()[0]
    return int(row[0])


def _time_quantile(store: DuckDBStore, fraction: float) -> int | None:
    times = " UNION ALL ".join(
        f"SELECT {schema.TIME_COLUMN[table]} AS t FROM {table}" for table in _TIMELINE_TABLES
    )
    with store._lock:
        row = store.connection.execute(f"SELECT quantile_disc(t, ?) FROM ({times})", [fraction]).fetchall()[0]
    return row[0]


def compact(store: DuckDBStore) -> None:
    """Rewrite the store into a new file holding only live blocks, then swap it in atomically."""
    path = store.path
    tmp = path.with_name(path.name + ".compact")
    for leftover in (tmp, Path(f"{tmp}.wal")):
        leftover.unlink(missing_ok=True)
    # exclusive: no cursor of the old database may outlive the swap (it would keep reading the old file)
    with store.exclusive(COMPACT_WAIT_S) as conn:
        conn.execute("CHECKPOINT")
        conn.execute(f"ATTACH '{tmp}' AS llmobs_compact")
        try:
            conn.execute(f"COPY FROM DATABASE {_catalog_name(conn)} TO llmobs_compact")
        finally:
            conn.execute("DETACH llmobs_compact")
        conn.close()
        os.replace(tmp, path)  # atomic: a crash leaves either the old file or the new one
        Path(f"{path}.wal").unlink(missing_ok=True)


def _catalog_name(conn) -> str:
    return conn.execute("SELECT current_database()").fetchall()[0][0]


def _timeline_rows(store: DuckDBStore) -> int:
    counts = " + ".join(f"(SELECT count(*) FROM {table})" for table in _TIMELINE_TABLES)
    with store._lock:
        return int(store.connection.execute(f"SELECT {counts}").fetchall()[0][0])


def retain_size(store: DuckDBStore, max_bytes: int, max_rounds: int = 8) -> RetentionReport:
    """Delete the oldest rows until the store's file (and WAL) is at most `max_bytes`.

    Deleted rows free DuckDB blocks only when whole row groups go, so each round estimates bytes per
    row, deletes the oldest share that should leave ~85% of the limit, and compacts the file.
    """
    report = RetentionReport(size_before=store_file_size(store.path))
    store.checkpoint()
    for _ in range(max_rounds):
        if store_file_size(store.path) <= max_bytes:
            break
        used = _used_bytes(store)
        rows = _timeline_rows(store)
        if used > 0.9 * max_bytes and rows > 0:
            keep_rows = 0.85 * max_bytes / (used / rows)
            fraction = min(0.95, max(0.05, 1.0 - keep_rows / rows))
            cutoff = _time_quantile(store, fraction)
            if cutoff is not None:
                deleted = delete_before(store, cutoff + 1)
                for table, count in deleted.items():
                    report.deleted[table] = report.deleted.get(table, 0) + count
                report.cutoff_ns = cutoff + 1
        compact(store)  # DuckDB does not give freed blocks back to the file system by itself
        report.compacted = True
    report.size_after = store_file_size(store.path)
    return report
