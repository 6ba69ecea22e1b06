"""StoreWriter: the bounded, never-blocking path from sources to DuckDBStore.

Sources (the ring drain, the shm reader) must never wait on the disk: they `submit()` and return. A
writer thread decodes ring records, coalesces batches and commits when `max_rows` are pending or
`max_delay_s` has passed since the first pending item (`max_hold_s` for a small commit, below). Why
coalesce: DuckDB's append cost per row falls steeply with commit size (measured on this VM, one core:
~1.2 M rows/s at 125 k rows per commit, ~2.6 M rows/s at 1 M), and a commit is still atomic, so a
crash loses at most the pending (uncommitted) items, never part of a commit. When the queue is full
the item is dropped and counted, like the kernel counts ring drops: a slow disk costs data, not the
workload's or the drain's time.

Items are held as submitted and converted once per table per commit (ring records decoded together in
one call, EventDecoder.decode_parts, with no concatenation copy; dicts of numpy columns concatenated
column by column): at a slowly stepping target the pipeline hands ~25 tiny items a second, and
converting each on arrival (~0.4-0.5 ms of numpy and Arrow setup apiece) cost more than the rows. Held
raw rows are converted as soon as they reach CONVERT_ROWS, so a fast source never holds more than that
unconverted (a bounded copy).

Why the thread is not woken by every submit (_Inbox): waking a sleeping thread costs ~40 us of CPU on
each side on this project's VMs (an IPI to an idle vCPU, then a GIL hand-over), and the drain loop
submits 2-3 items on each of its ~10 wake-ups a second at a slowly stepping target: ~25 thread
wake-ups a second that did nothing but move an item from one list to another. The thread now sleeps
until it has a reason to run (its commit is due, or enough rows or items arrived to convert, to commit
or to keep the queue from filling), and a submit wakes it only then, or when it sleeps with nothing
pending (so that it arms its timer).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from llmobs import environment
from llmobs.dataflow import SinkResult
from llmobs.store.batches import TableLike, to_arrow
from llmobs.store.ingest import EventDecoder
from llmobs.store.sink import DuckDBStore

# Raw (unconverted) rows held before they are converted in one go: large enough that a slow target's
# second of items is one conversion, small enough that the concatenation copy stays ~4 MB.
CONVERT_ROWS = 65_536
# A commit costs a fixed ~4-15 ms of DuckDB statement planning and WAL write however few its rows
# (measured on this VM: 20 token steps ~5 ms of CPU, 360 events ~10 ms): at a target stepping 20 times
# a second, one commit a second was the agent's largest single cost (~1.2% of a core). A commit of
# fewer than SMALL_COMMIT_ROWS rows waits up to MAX_HOLD_S for more; a busy target's commits still go
# out every max_delay_s. The price: the store lags a slowly stepping target by up to MAX_HOLD_S, and a
# crash loses up to that much of its ring events (its token steps are re-read from the map on restart).
SMALL_COMMIT_ROWS = 4_096
MAX_HOLD_S = 4.0  # the default; $LLMOBS_STORE_MAX_HOLD_S sets another (default_max_hold_s)


def default_max_hold_s() -> float:
    """$LLMOBS_STORE_MAX_HOLD_S when it is a number from 0 to MAX_HOLD_S, else MAX_HOLD_S (it can only
    shorten the hold: the pipeline's correlate re-rolls late steps over a window sized by MAX_HOLD_S)."""
    try:
        value = float(os.environ.get(environment.LLMOBS_STORE_MAX_HOLD_S, MAX_HOLD_S))
    except ValueError:
        return MAX_HOLD_S
    return value if 0 <= value <= MAX_HOLD_S else MAX_HOLD_S


_STOP = object()  # commit what is pending, then end the thread
_FLUSH = object()  # commit what is pending now


@dataclass
class WriterCounters:
    submitted_rows: int = 0
    dropped_rows: int = 0  # queue full: never reached the store
    failed_rows: int = 0  # reached the store but the commit failed (see store.counters.last_error)
    committed_rows: int = 0
    commits: int = 0


class StoreWriter:
    """A bounded queue and one thread in front of a DuckDBStore: the pipeline's journal sink."""

    name = "store"

    def __init__(
        self,
        store: DuckDBStore,
        decoder: EventDecoder | None = None,
        max_rows: int = 1_000_000,
        max_delay_s: float = 1.0,
        queue_items: int = 100,
        max_hold_s: float | None = None,
    ):
        self.store = store
        self.decoder = decoder
        self.max_rows = max_rows
        self.max_delay_s = max_delay_s
        self.max_hold_s = max(default_max_hold_s() if max_hold_s is None else max_hold_s, max_delay_s)
        self.counters = WriterCounters()
        self._queue = _Inbox(queue_items)
        self._idle = threading.Condition()
        self._outstanding = 0  # items accepted by submit() and not yet committed or failed
        self._thread = threading.Thread(target=self._run, name="llmobs-store-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def _rows(item) -> int:
        if isinstance(item, np.ndarray):
            return len(item)
        return sum(_table_rows(t) for t in item.values())

    def submit(self, item: np.ndarray | Mapping[str, TableLike]) -> bool:
        """Queue ring records (an EVENT_DTYPE array; needs a decoder) or a batch {table: data}. Never
        blocks; returns False (and counts the rows) when the queue is full."""
        rows = self._rows(item)
        self.counters.submitted_rows += rows
        if isinstance(item, np.ndarray) and self.decoder is None:
            raise TypeError("StoreWriter got ring records but has no EventDecoder")
        with self._idle:
            if not self._queue.put(item, rows):
                self.counters.dropped_rows += rows
                return False
            self._outstanding += 1
        return True

    def _run(self) -> None:
        pending = _Pending(self)
        first_at = 0.0  # when the first item of `pending` was submitted
        while True:
            deadline = first_at + self._delay(pending) if pending.items else None
            for item, rows, submitted_at in self._queue.take(deadline, self._wake_rows(pending)):
                control = item is _STOP or item is _FLUSH
                if not control:
                    if not pending.items:
                        first_at = submitted_at
                    pending.add(item, rows)
                if pending.items and (control or pending.rows >= self.max_rows):
                    self._commit(pending)
                    pending = _Pending(self)
                if item is _STOP:
                    return
            if pending.items and time.monotonic() - first_at >= self._delay(pending):
                self._commit(pending)
                pending = _Pending(self)

    def _delay(self, pending: _Pending) -> float:
        """How long the first pending item may wait: max_delay_s, or max_hold_s for a small commit."""
        return self.max_delay_s if pending.rows >= SMALL_COMMIT_ROWS else self.max_hold_s

    def _wake_rows(self, pending: _Pending) -> int:
        """Rows queued that make the thread run before its deadline: enough to convert (CONVERT_ROWS held
        raw), to commit (max_rows), or to end a small commit's longer hold (SMALL_COMMIT_ROWS)."""
        limits = [CONVERT_ROWS - pending.raw_rows, self.max_rows - pending.rows]
        if pending.rows < SMALL_COMMIT_ROWS:
            limits.append(SMALL_COMMIT_ROWS - pending.rows)
        return max(1, min(limits))

    def _commit(self, pending: _Pending) -> None:
        merged, rows = pending.tables()
        if merged:
            try:
                result = self.store.export(merged)
            except Exception as exc:  # a sink's export never raises; counted if one does
                self._failed([], rows, exc)
            else:
                if result.ok:
                    self.counters.committed_rows += rows
                    self.counters.commits += 1
                else:
                    self.counters.failed_rows += rows
        self._done(pending.items)

    def _failed(self, pending: list, rows: int, exc: Exception) -> None:
        self.counters.failed_rows += rows
        self.store.counters.last_error = f"writer: {exc}"

    def _done(self, items: int) -> None:
        with self._idle:
            self._outstanding -= items
            self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything submitted so far now; False if that did not finish within `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._queue.put(_FLUSH, 0, control=True)
        with self._idle:
            return self._idle.wait_for(
                lambda: self._outstanding == 0,
                None if deadline is None else max(0.0, deadline - time.monotonic()),
            )

    def close(self, timeout: float | None = 10.0) -> SinkResult:
        """Commit what is pending and stop the thread; falsy if it did not finish in time."""
        self._queue.put(_STOP, 0, control=True)
        self._thread.join(timeout)
        c = self.counters
        return SinkResult(
            self.name,
            accepted=c.committed_rows,
            dropped={"queue_full": c.dropped_rows, "commit_failed": c.failed_rows},
            error=self.store.counters.last_error,
            finished=not self._thread.is_alive(),
        )


class _Inbox:
    """The writer thread's queue: bounded (a full one refuses, the caller counts the drop), put never
    blocks, and the thread is woken only when it has a reason to run (the module's docstring says why):

      - it sleeps with nothing pending (no deadline): the first item arms its timer;
      - the queue holds `wake_rows` rows (the thread's figure: enough to convert or commit), or half of
        its `maxsize` items (so that a fast source does not fill it before the deadline);
      - a control item (flush, stop), which is never refused.

    Otherwise the items wait for the thread's own deadline (its commit's max_delay_s / max_hold_s)."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._wake_items = max(1, maxsize // 2)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._items: deque = deque()  # (item, rows, submitted at)
        self._rows = 0
        self._controls = 0
        self._wake_rows = 1
        self._timed = False  # the thread sleeps until a deadline (False: until woken)
        self._waiting = False  # the thread is inside wait()
        self.wakeups = 0  # puts that woke the waiting thread (what the inbox exists to keep rare)

    def qsize(self) -> int:
        return len(self._items)

    def put(self, item, rows: int, control: bool = False) -> bool:
        with self._lock:
            if not control and len(self._items) >= self.maxsize:
                return False
            self._items.append((item, rows, time.monotonic()))
            self._rows += rows
            self._controls += control
            if self._waiting and self._due():
                self.wakeups += 1
                self._ready.notify()
        return True

    def take(self, deadline: float | None, wake_rows: int) -> list[tuple]:
        """Everything queued, once the thread has a reason to run or `deadline` (monotonic) has passed;
        waits for that (with deadline None, until an item arrives)."""
        with self._lock:
            self._wake_rows, self._timed = wake_rows, deadline is not None
            while not self._due():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._waiting = True
                self._ready.wait(left)
                self._waiting = False
            items, self._items = list(self._items), deque()
            self._rows = self._controls = 0
            self._timed = False  # running: the next take() says how it sleeps
            return items

    def _due(self) -> bool:
        if not self._items:
            return False
        return (
            not self._timed
            or self._controls > 0
            or self._rows >= self._wake_rows
            or len(self._items) >= self._wake_items
        )


def _table_rows(table) -> int:
    """Rows of one table of a batch, without converting it (submit runs on the drain loop): a dict of
    columns has its first column's length."""
    if isinstance(table, np.ndarray):
        return len(table)
    if isinstance(table, Mapping):
        return len(next(iter(table.values()))) if table else 0
    return to_arrow(table).num_rows


class _Pending:
    """The items of the next commit: held raw, converted to one Arrow table per table in chunks of at
    least CONVERT_ROWS rows (or at commit). An item that cannot be converted is counted as failed (its
    rows) and the rest of its chunk is kept."""

    def __init__(self, writer: StoreWriter):
        self.writer = writer
        self.items = 0  # items accepted into this commit (each is _done once committed or failed)
        self.rows = 0  # rows of the items, converted or not
        self.good_rows = 0  # rows converted so far
        self._raw: list = []
        self.raw_rows = 0  # rows held raw (not converted yet)
        self._parts: dict[str, list[pa.Table]] = {}

    def add(self, item, rows: int) -> None:
        self.items += 1
        self.rows += rows
        self._raw.append((item, rows))
        self.raw_rows += rows
        if self.raw_rows >= CONVERT_ROWS:
            self._convert()

    def tables(self) -> tuple[dict[str, pa.Table], int]:
        """{table: one Arrow table} of every convertible item, and their rows."""
        self._convert()
        try:
            merged = {
                t: parts[0] if len(parts) == 1 else pa.concat_tables(parts, promote_options="default")
                for t, parts in sorted(self._parts.items())
            }
        except Exception as exc:  # parts whose schemas cannot be merged
            self.writer._failed([], self.good_rows, exc)
            return {}, 0
        return merged, self.good_rows

    def _convert(self) -> None:
        raw, self._raw, self.raw_rows = self._raw, [], 0
        if not raw:
            return
        try:
            converted = self._convert_all([item for item, _rows in raw])
        except Exception:  # find the bad item(s): each converted alone, the rest kept
            for item, rows in raw:
                try:
                    self._keep(self._convert_all([item]), rows)
                except Exception as exc:
                    self.writer._failed([], rows, exc)
            return
        self._keep(converted, sum(rows for _item, rows in raw))

    def _keep(self, converted: dict[str, pa.Table], rows: int) -> None:
        for table, data in converted.items():
            self._parts.setdefault(table, []).append(data)
        self.good_rows += rows

    def _convert_all(self, items: list) -> dict[str, pa.Table]:
        records = [item for item in items if isinstance(item, np.ndarray)]
        by_table: dict[str, list] = {}
        if records:
            decoded = self.writer.decoder.decode_parts(records)  # no concatenation copy
            for table, data in decoded.items():
                by_table.setdefault(table, []).append(data)
        for item in items:
            if not isinstance(item, np.ndarray):
                for table, data in item.items():
                    by_table.setdefault(table, []).append(data)
        return {table: _one_table(parts) for table, parts in by_table.items()}


def _one_table(parts: list) -> pa.Table:
    """Parts of one table as one Arrow table: dicts of plain columns (numpy arrays, or lists: the map's
    strings) with the same columns, each column of one kind, are concatenated column by column and
    converted once; anything else is converted part by part."""
    first = parts[0]
    if len(parts) > 1 and all(_same_plain_columns(p, first) for p in parts):
        return to_arrow({name: _concatenate([p[name] for p in parts]) for name in first})
    tables = [to_arrow(p) for p in parts]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


def _same_plain_columns(part, first) -> bool:
    if not isinstance(part, Mapping) or list(part) != list(first):
        return False
    return all(type(part[name]) is type(first[name]) and isinstance(first[name], np.ndarray | list)
               for name in first)  # fmt: skip


def _concatenate(columns: list):
    if isinstance(columns[0], list):
        return [value for column in columns for value in column]
    return np.concatenate(columns)
