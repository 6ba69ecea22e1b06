"""DuckDBStore: the local store and the pipeline's sink for it.

A batch is a mapping {destination: table-like}; destinations are table names, plus "events" for eBPF
events, which are routed to mem_events / gpu_ops / host_events by their `kind` column. One batch is one
transaction: after a crash (even SIGKILL) a batch is either wholly in the store or not at all.

As a sink (DESIGN.md) `export(batch)` returns a SinkResult and never raises into the pipeline; failures
are counted and the last error kept. `append()` is the raising form, for tools and tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import duckdb
import pyarrow as pa

from llmobs import clock, environment
from llmobs.errors import StoreError
from llmobs.stagecpu import STAGES
from llmobs.store import schema
from llmobs.store.batches import TableLike, to_arrow

log = logging.getLogger(__name__)

DEFAULT_DB_PATH = Path("/var/lib/llmobs/llmobs.duckdb")
DB_PATH_ENV = environment.LLMOBS_DB  # overrides the default path; `--db` overrides both
# DuckDB's buffer pool for an agent that writes the store: by default (80% of the host's RAM) DuckDB keeps
# every block it wrote cached, so a store ingesting 50k events/s grew the agent's RSS by ~2 MB per
# million rows for as long as it ran; capped, old blocks are evicted (they are on disk) and large queries
# spill to disk instead. 32MB (issue 14): `bench.soak --minutes 3 --rate 50000`, agent RSS first/max: 206/251
# MB at 256MB, 182/221 at 64MB, 179/188 at 32MB (flat), every event stored and the same CPU in each.
AGENT_MEMORY_LIMIT = "32MB"
# The cap is for the steady state. Rarely one statement needs more than what is left of it while the
# writer, correlate and the exporter share it (seen once in ~15 serving acceptance runs: the final
# correlate failed with "Out of Memory Error (30.5 MiB/30.5 MiB used)" and 247 of 384 passes were not
# rolled up). Such a statement is run once more with the cap raised to this for its duration, counted
# (DuckDBStore.headroom_retries), rather than failing. 96MB, not more: what the agent runs through it is
# bounded (an append is at most a second of rows, correlate a slice of SLICE_STEPS steps), and DuckDB
# keeps what a retry allocated resident (at 20k steps/s with 256MB: RSS peaks of 264-415 MB; with
# 96MB: 258-266, every retry through).
HEADROOM_MEMORY_LIMIT = "96MB"
# DuckDB keeps metadata of every row group appended to a database in memory for as long as that database
# stays open (~0.18 MB per million event rows here; a CHECKPOINT does not free it and `memory_limit` does
# not count it; duckdb/duckdb#13172). Opened again, it loads that metadata lazily, when a query needs it.
# At 50k events/s that was most of the 30-minute soak's +0.5-0.7 MB of RSS a minute (glibc's heap rising
# 17 -> 22 MB in 10 minutes, Python's objects and DuckDB's own accounting flat). So a store the agent
# writes reopens its database once it has appended RECYCLE_ROWS rows since it opened (DuckDBStore.recycle):
# at most ~1 MB of such metadata, one reopen every ~100 s at 50k events/s.
RECYCLE_ROWS = 5_000_000
# A reopen needs every other cursor of the database closed (each keeps the old one alive): it waits this
# long for them to go idle (StoreCursor.idle), then lets them go on and tries again RECYCLE_RETRY_ROWS
# rows later, counted (store_recycles_deferred), so a busy reader delays it and never stalls the writer.
RECYCLE_WAIT_S = 0.5
RECYCLE_RETRY_ROWS = 500_000
T = TypeVar("T")
# DuckDB's worker threads for an agent that writes the store: by default one per core, and every
# statement (a commit a second, a correlate) wakes them: at a slowly stepping target they were ~10 ms of
# CPU a second (bench/step_cost, native_threads) for appends of a few hundred rows. The agent's SQL is
# small and incremental; one thread runs it on the calling thread, with no wake-ups.
AGENT_THREADS = 1


# Keyed tables a reader may hand the same row again (a re-attached agent reads a live map's names ring
# from its start): the stored row stays (a request's labels and intent never change) or, for a model's
# factor, the newer value wins. A plain INSERT would fail the whole commit on the duplicate key.
_ON_CONFLICT = {
    "request_labels": "INSERT OR IGNORE",
    "request_intents": "INSERT OR IGNORE",
    "model_factors": "INSERT OR REPLACE",
}


# What DuckDB's buffer manager says when a commit needs a block the cap has no room for; the commit's
# TransactionException wraps it ("Failed to commit: could not allocate block of size 256.0 KiB (30.7
# MiB/30.5 MiB used)"). Only "failed to pin" was known here: the other one failed whole commits at 20k
# steps/s (~22,000 rows in 2 of 5 attaches, bench/step_cost's "store failed").
_COMMIT_OUT_OF_MEMORY = ("failed to pin block", "could not allocate block")


def _out_of_memory(exc: duckdb.Error) -> bool:
    """DuckDB ran out of its memory cap: its own error, or a commit that failed for it (a
    TransactionException naming a block it could not pin or allocate)."""
    if isinstance(exc, duckdb.OutOfMemoryException):
        return True
    text = str(exc)
    return isinstance(exc, duckdb.TransactionException) and any(s in text for s in _COMMIT_OUT_OF_MEMORY)


def _invalidated(exc: BaseException) -> bool:
    """DuckDB invalidated the database: every later statement on it fails until it is opened again. Seen
    when an automatic checkpoint inside a commit ran out of the memory cap ("FATAL Error: Failed to create
    checkpoint because of error: could not allocate block"); the commit that triggered it stored nothing,
    what was committed before is in the file and its WAL."""
    return isinstance(exc, duckdb.FatalException)


def agent_memory_limit() -> str:
    """The DuckDB memory limit of a store the agent writes: $LLMOBS_DUCKDB_MEMORY_LIMIT, else 32MB."""
    return os.environ.get(environment.LLMOBS_DUCKDB_MEMORY_LIMIT) or AGENT_MEMORY_LIMIT


def agent_store(path: Path | str | None = None) -> DuckDBStore:
    """The store as a running agent writes it (attach, run): DuckDB's cache capped (agent_memory_limit),
    its SQL on one thread (AGENT_THREADS), its database reopened every RECYCLE_ROWS appended rows."""
    limit = agent_memory_limit()
    return DuckDBStore(path, memory_limit=limit, threads=AGENT_THREADS, recycle_rows=RECYCLE_ROWS)


def default_db_path() -> Path:
    return Path(os.environ.get(DB_PATH_ENV) or DEFAULT_DB_PATH)


@dataclass
class SinkResult:
    """What a sink reports for one export or shutdown; `ok` False carries the reason in `error`."""

    ok: bool
    rows: int = 0
    error: str | None = None


@dataclass
class SinkCounters:
    batches_ok: int = 0
    batches_failed: int = 0
    rows_written: int = 0
    rows_by_table: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None


class StoreBusy(StoreError):
    """The store's cursors stayed in use past the wait of DuckDBStore.exclusive()."""


class StoreCursor:
    """A DuckDB cursor of a DuckDBStore for a thread beside the writer (the correlate loop, the OTLP
    exporter, the anomaly lane). It stands for the cursor itself (`execute`, `fetchall`, `description`,
    ...): the first use borrows one from the store, `idle()` gives it back. Its holder calls `idle()`
    between its rounds of work, where it keeps no result and no transaction open; only then can the store
    reopen its database (DuckDBStore.recycle), which waits for every lent cursor. As a context manager it
    is idle at the end."""

    def __init__(self, store: DuckDBStore):
        self._store = store
        self._cursor: duckdb.DuckDBPyConnection | None = None

    def __getattr__(self, name: str):
        if self._cursor is None:
            self._store.reopen_if_invalid()
            self._cursor = self._store._lend()
        return getattr(self._cursor, name)

    def idle(self) -> None:
        cursor, self._cursor = self._cursor, None
        if cursor is not None:
            self._store._give_back(cursor)

    close = idle  # the cursor's own close(): the same, and the StoreCursor can be used again

    def __enter__(self) -> StoreCursor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.idle()


def open_connection(path: Path | str, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    """Open a DuckDB file with errors turned into one clear StoreError line."""
    path = Path(path)
    if read_only and not path.exists():
        raise StoreError(f"no store at {path}", hint="give the agent's store with --db PATH")
    if not read_only:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {path.parent}: {exc.strerror}") from None
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"cannot open {path}: {first_line}") from None


class DuckDBStore:
    """The llmobs DuckDB file: schema migrated at open, batched transactional appends, counted failures."""

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        read_only: bool = False,
        threads: int | None = None,
        memory_limit: str | None = None,
        recycle_rows: int | None = None,
    ):
        self.path = Path(path) if path is not None else default_db_path()
        self.read_only = read_only
        self.counters = SinkCounters()
        self._lock = threading.Lock()
        self._threads = threads
        self._memory_limit = memory_limit  # e.g. AGENT_MEMORY_LIMIT; None: DuckDB's default
        self._headroom_lock = threading.Lock()
        self.headroom_retries = 0
        self._cap_raised = False  # a headroom retry raised the cap and it could not be put back yet
        # Cursors lent out (StoreCursor), and whether a reopen is waiting for them to come back.
        self._leases = threading.Condition()
        self._lent = 0
        self._reopening = False
        self.recycle_rows = recycle_rows  # None: never reopened for memory (tools, tests, readers)
        self._recycle_due = recycle_rows
        self.recycles = 0
        self._invalid = False  # DuckDB invalidated the database (_invalidated): reopen before the next use
        self.reopens = 0  # ... done
        self._rollup_followers: list[Callable[[], None]] = []
        self._open()

    def follow_rollups(self, wake: Callable[[], None]) -> None:
        """Call `wake()` after each correlate commit on this store (rollups_committed): a follower that
        waits for rollups (the OTLP exporter, whose young steps wait for theirs) sleeps until then
        instead of polling for them."""
        self._rollup_followers.append(wake)

    @property
    def rollups_followed(self) -> bool:
        """Someone waits for this store's rollups as they are committed (an OTLP exporter follows)."""
        return bool(self._rollup_followers)

    def rollups_committed(self) -> None:
        """Called by the pipeline after a correlate run committed (from its thread); never raises."""
        for wake in list(self._rollup_followers):
            try:
                wake()
            except Exception:  # a follower's wake-up must not fail the correlate that called it
                log.exception("a rollup follower's wake-up failed")

    def with_headroom(self, run: Callable[[], T]) -> T:
        """`run()`; if DuckDB runs out of the store's memory cap, run it once more with the cap raised
        to HEADROOM_MEMORY_LIMIT (one such retry at a time; the cap is the database's, all connections
        see it) and put the cap back. Without a cap of ours, or if the retry fails too, the error stands."""
        if self._cap_raised:
            self._restore_cap()
        try:
            return run()
        except duckdb.Error as exc:
            if _invalidated(exc):
                self._invalid = True  # opened again by the next append or cursor (reopen_if_invalid)
            if not self._memory_limit or not _out_of_memory(exc):
                raise
        with self._headroom_lock:
            self.headroom_retries += 1
            STAGES.count("store_headroom_retries")  # said at detach with the other degrades
            # Set through a cursor of its own, never the store's connection, which the writer may be
            # using this moment: DuckDB refuses a second call on a busy connection instead of waiting,
            # which failed the retry or the writer's append, and with it the append's rows (seen at 20k
            # steps/s with the default 32 MB cap: 23,274 rows and a correlate run lost in one attach).
            settings = self._conn.cursor()
            try:
                settings.execute("SET memory_limit = $limit", {"limit": HEADROOM_MEMORY_LIMIT})
                self._cap_raised = True
                try:
                    return run()
                finally:
                    self._lower_cap()
            finally:
                settings.close()

    def _lower_cap(self) -> None:
        """The cap back (the caller holds _headroom_lock), through a cursor of its own. DuckDB refuses to
        lower it while more than it is in use (another lane's statement, or what the retried one still
        holds): then it stays raised, counted, and the next statement through with_headroom tries again.
        Before, the refusal failed the statement that had just succeeded (at 20k steps/s: an append's
        ~22,000 committed rows counted as failed)."""
        settings = self._conn.cursor()
        try:
            settings.execute("SET memory_limit = $limit", {"limit": self._memory_limit})
        except duckdb.Error:
            STAGES.count("store_cap_restores_deferred")
            return
        finally:
            settings.close()
        self._cap_raised = False

    def _restore_cap(self) -> None:
        with self._headroom_lock:
            if self._cap_raised:
                self._lower_cap()

    def _open(self) -> None:
        read_only, threads = self.read_only, self._threads
        self._conn = open_connection(self.path, read_only=read_only)
        try:
            if threads:
                self._conn.execute(f"SET threads = {int(threads)}")
            if self._memory_limit:
                self._conn.execute("SET memory_limit = $limit", {"limit": self._memory_limit})
            self._cap_raised = False  # a reopened database has the cap again
            if read_only:
                version = schema.current_version(self._conn)
                if version == 0:
                    raise StoreError(f"{self.path} is a DuckDB file but not an llmobs store (no schema)")
                if version > schema.LATEST_VERSION:
                    raise StoreError(
                        f"the store is at schema version {version}, newer than this agent's "
                        f"{schema.LATEST_VERSION}",
                        hint="upgrade llmobs-agent",
                    )
            else:
                schema.migrate(self._conn)
            self._columns = schema.tables_columns(
                self._conn, [table for table in schema.TIME_COLUMN if table]
            )
        except duckdb.Error as exc:
            self._conn.close()
            raise StoreError(f"cannot use {self.path}: {str(exc).splitlines()[0]}") from None
        except StoreError:
            self._conn.close()
            raise

    @property
    def connection(self) -> duckdb.DuckDBPyConnection:
        """The store's own connection: for a command's queries. A thread of the agent that reads or
        writes beside the writer takes a `cursor()` instead, which a reopen can wait for."""
        return self._conn

    def cursor(self) -> StoreCursor:
        """A cursor of this store for one thread, lent while in use (see StoreCursor)."""
        return StoreCursor(self)

    def _lend(self) -> duckdb.DuckDBPyConnection:
        with self._leases:
            self._leases.wait_for(lambda: not self._reopening)
            cursor = self._conn.cursor()
            self._lent += 1
            return cursor

    def _give_back(self, cursor: duckdb.DuckDBPyConnection) -> None:
        try:
            cursor.close()
        finally:
            with self._leases:
                self._lent -= 1
                self._leases.notify_all()

    @contextlib.contextmanager
    def exclusive(self, wait_s: float | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
        """The store's connection with no append running and no cursor lent; the database is opened
        again at the end (so whatever was done to the file underneath, e.g. retention's compaction, is
        what the store reads next). Raises StoreBusy when lent cursors are still in use after `wait_s`
        (None: wait as long as they take)."""
        with self._lock:
            with self._leases:
                self._reopening = True
                if not self._leases.wait_for(lambda: self._lent == 0, wait_s):
                    self._reopening = False
                    self._leases.notify_all()
                    raise StoreBusy(f"{self._lent} cursor(s) of the store still in use after {wait_s} s")
            try:
                with self._headroom_lock:  # nobody is between a statement and its cap's reset now
                    try:
                        yield self._conn
                    finally:
                        with contextlib.suppress(duckdb.Error):  # closed by the caller: nothing to flush
                            self._conn.execute("CHECKPOINT")
                        self._conn.close()
                        self._open()
                        self._recycle_due = self.recycle_rows
            finally:
                with self._leases:
                    self._reopening = False
                    self._leases.notify_all()

    def recycle(self) -> bool:
        """Reopen the database, which hands back the row groups' metadata DuckDB holds while it is open
        (RECYCLE_ROWS). False, counted, if lent cursors stayed in use past RECYCLE_WAIT_S."""
        try:
            with self.exclusive(RECYCLE_WAIT_S):
                pass
        except StoreBusy:
            self._recycle_due = RECYCLE_RETRY_ROWS
            STAGES.count("store_recycles_deferred")
            return False
        self.recycles += 1
        STAGES.count("store_recycles")
        return True

    def reopen_if_invalid(self) -> None:
        """Open the database again if DuckDB invalidated it (_invalidated), once the lent cursors are back
        (each holder gives its cursor back between rounds; they fail fast on an invalid database). Raises
        StoreError if they stayed in use past RECYCLE_WAIT_S or the file cannot be opened: the next use
        tries again."""
        if not self._invalid:
            return
        try:
            with self.exclusive(RECYCLE_WAIT_S):
                pass
        except StoreBusy as exc:
            raise StoreError(f"the database was invalidated and is not reopened yet: {exc}") from None
        self._invalid = False
        self.reopens += 1
        STAGES.count("store_reopened_invalidated")  # said at detach with the other degrades

    def __enter__(self) -> DuckDBStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- appending -------------------------------------------------------------------------------

    def append(self, batch: Mapping[str, TableLike]) -> dict[str, int]:
        """Append every part of `batch` in one transaction; return rows per table. Raises StoreError.
        A transaction that runs out of the store's memory cap (the inserts, or the commit while another
        lane holds memory) is run once more with headroom (with_headroom): before, its rows were lost
        (at 20k steps/s with the default 32 MB cap, ~23k rows in one attach in 2 runs of 5). One whose
        commit invalidated the database (_invalidated) is run once more after the database is reopened:
        before, it and every later append failed (768,853 of 852,572 rows in one attach at 20k steps/s)."""
        tables = {dest: to_arrow(data) for dest, data in batch.items()}
        try:
            try:
                written = self._append_reopened(tables)
            except duckdb.Error as exc:
                if not _invalidated(exc):
                    raise
                written = self._append_reopened(tables)  # its commit stored nothing: once more, reopened
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(f"append failed: {str(exc).splitlines()[0]}") from exc
        if self._recycle_due is not None and self._recycle_due <= 0:
            self.recycle()  # after the commit, outside its lock: what was appended is stored already
        return written

    def _append_reopened(self, tables: Mapping[str, pa.Table]) -> dict[str, int]:
        """One try of an append: the database reopened first if DuckDB invalidated it, then the transaction
        under the store's lock, with headroom."""
        self.reopen_if_invalid()
        with self._lock:
            written = self.with_headroom(lambda: self._append_in_transaction(tables))
            if self._recycle_due is not None:
                self._recycle_due -= sum(written.values())
        return written

    def _append_in_transaction(self, tables: Mapping[str, pa.Table]) -> dict[str, int]:
        conn = self._conn
        conn.execute("BEGIN TRANSACTION")
        try:
            written: dict[str, int] = {}
            for dest, table in tables.items():
                if table.num_rows == 0:
                    continue
                for target, rows in self._insert(dest, table):
                    written[target] = written.get(target, 0) + rows
            conn.execute("COMMIT")
        except Exception:
            # A commit that failed has ended its transaction already: the rollback's own error ("no
            # transaction is active") must not hide why it failed.
            with contextlib.suppress(duckdb.Error):
                conn.execute("ROLLBACK")
            raise
        return written

    def _insert(self, dest: str, table: pa.Table) -> list[tuple[str, int]]:
        names = table.schema.names
        if dest == "events":
            if "kind" not in names:
                raise StoreError("an events batch needs a `kind` column (mem | gpu | host | compute)")
            # A route with no rows costs a statement (~0.3 ms) for nothing: only the kinds present.
            kinds = set(table.column("kind").unique().to_pylist())  # not pyarrow.compute: +9 MB resident
            routes = [
                ("mem_events", "kind = 'mem'", "mem" in kinds),
                ("gpu_ops", "kind = 'gpu'", "gpu" in kinds),
                (
                    "host_events",
                    "kind IS DISTINCT FROM 'mem' AND kind IS DISTINCT FROM 'gpu'",
                    bool(kinds - {"mem", "gpu"}),
                ),
            ]
            return [
                (target, self._insert_select(target, table, names, where) if present else 0)
                for target, where, present in routes
            ]
        if dest not in self._columns or dest == "schema_migrations":
            raise StoreError(f"unknown destination {dest!r}")
        return [(dest, self._insert_select(dest, table, names, None))]

    def _insert_select(self, table: str, batch: pa.Table, names: list[str], where: str | None) -> int:
        target_columns = self._columns[table]
        ignorable = {"kind", "trace_id"} if table in schema.EVENT_TABLES else set()
        unknown = [n for n in names if n not in target_columns and n not in ignorable]
        if unknown:
            raise StoreError(f"{table} has no column(s) {', '.join(unknown)}")
        into, select = [], []
        for column in target_columns:
            if column in names:
                into.append(column)
                select.append(f'"{column}"')
            elif column in ("trace_hi", "trace_lo") and "trace_id" in names:
                # The agreed decoded form is 32 hex chars ('' untracked); we keep its two 64-bit words.
                start = 1 if column == "trace_hi" else 17
                into.append(column)
                select.append(
                    f"CASE WHEN coalesce(trace_id, '') = '' THEN 0::UBIGINT"
                    f" ELSE ('0x' || substr(trace_id, {start}, 16))::UBIGINT END"
                )
        if table == "probe_aggregates" and "ts_ns" not in names:
            into.append("ts_ns")  # when it was read, so retention can age it out
            select.append(str(clock.monotonic_ns()))
        # The batch is read by DuckDB's replacement scan: a name the catalog does not know is looked up
        # among the locals of the frame that calls execute, here `_llmobs_batch`. Registering it as a
        # view instead (register + unregister) cost ~1.8 ms a table a commit, two catalog changes for
        # one read. Column lists by name, as before: a column the batch lacks takes its default.
        _llmobs_batch = batch  # noqa: F841 (read by the replacement scan)
        verb = _ON_CONFLICT.get(table, "INSERT")
        sql = f"{verb} INTO {table} ({', '.join(into)}) SELECT {', '.join(select)} FROM _llmobs_batch"
        if where:
            sql += f" WHERE {where}"
        return self._conn.execute(sql).fetchall()[0][0]

    def export(self, batch: Mapping[str, TableLike]) -> SinkResult:
        """The sink interface: append `batch`, never raise; failures are counted in `counters`."""
        try:
            written = self.append(batch)
        except Exception as exc:  # a sink must not take the pipeline down
            self.counters.batches_failed += 1
            self.counters.last_error = str(exc)
            return SinkResult(ok=False, error=str(exc))
        rows = sum(written.values())
        self.counters.batches_ok += 1
        self.counters.rows_written += rows
        for table, count in written.items():
            self.counters.rows_by_table[table] = self.counters.rows_by_table.get(table, 0) + count
        return SinkResult(ok=True, rows=rows)

    def record_clock_fit(self, clock_name: str, fit: clock.ClockFit | clock.WallClock, pid: int = 0) -> None:
        """Store the clock conversion in use, with its measured error (the issue asks it be kept)."""
        if isinstance(fit, clock.WallClock):
            values = (fit.measured_at_mono_ns, fit.offset_ns, 0.0, fit.error_ns, fit.residual_ns, fit.samples)
        else:
            # A fit has no single bracket bound; its worst residual is the honest error bound.
            values = (
                fit.ref_mono_ns,
                fit.offset_ns,
                fit.drift_ppm,
                fit.max_residual_ns,
                fit.residual_ns,
                fit.samples,
            )
        with self._lock:
            self._conn.execute(
                "INSERT INTO clock_fits (ts_ns, pid, clock, ref_mono_ns, offset_ns, drift_ppm, error_ns,"
                " residual_ns, samples) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [clock.monotonic_ns(), pid, clock_name, *values],
            )

    def upsert_process(self, pid: int, start_ns: int = 0, **columns: object) -> None:
        """Insert or update one row of `processes` (key: pid, start_ns, which tells reused pids apart)."""
        allowed = set(self._columns["processes"]) - {"pid", "start_ns"}
        bad = set(columns) - allowed
        if bad:
            raise StoreError(f"processes has no column(s) {', '.join(sorted(bad))}")
        names = ["pid", "start_ns", *columns]
        updates = ", ".join(f"{n} = excluded.{n}" for n in columns)
        on_conflict = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
        with self._lock:
            self._conn.execute(
                f"INSERT INTO processes ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})"
                f" ON CONFLICT (pid, start_ns) {on_conflict}",
                [pid, start_ns, *columns.values()],
            )

    # -- reading and lifecycle -------------------------------------------------------------------

    def query(self, sql: str, params: list | None = None) -> pa.Table:
        with self._lock:
            return self._conn.sql(sql, params=params).to_arrow_table()

    def count(self, table: str) -> int:
        if table not in self._columns:
            raise StoreError(f"unknown table {table!r}")
        with self._lock:
            return self._conn.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]

    def checkpoint(self) -> None:
        with self._lock:
            self._conn.execute("CHECKPOINT")

    def shutdown(self, timeout: float | None = None) -> SinkResult:
        """Flush (CHECKPOINT) and close; never raise. An export running past `timeout` is interrupted."""
        acquired = self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0))
        try:
            if not acquired:
                self._conn.interrupt()
                acquired = self._lock.acquire(timeout=5)
            if not self.read_only:
                self._conn.execute("CHECKPOINT")
            self._conn.close()
            return SinkResult(ok=True)
        except Exception as exc:
            self.counters.last_error = str(exc)
            return SinkResult(ok=False, error=str(exc))
        finally:
            if acquired:
                self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
