"""Automatic mode of the flight recorder (`replay.on_anomaly`, `--replay-on-anomaly`): the agent replays
flagged tokens itself, rate-limited, and stores each replay with its verdict.

The anomaly lane (llmobs.diagnostics.live) hands every batch of committed rows to `on_rows` (its
thread: this only filters and queues, never waits). A token row (one with a token index) of this
target is asked for once per token step (several detectors may flag the same token); at most
`max_per_minute` are asked for in any 60 s (a sliding window, per target: one AutoReplayer per
pipeline), the rest are counted (`skipped_rate`). One thread posts CMD_REPLAY, waits for the result
file (llmobs.shm.replay_client), has the pipeline's StoreWriter commit what it holds (the replayed
steps' recorded losses must be in the store), ingests it in one transaction
(llmobs.pipeline.replay_ingest, trigger 'anomaly') and deletes the file. A workload without a flight
recorder answers once; the target is then left alone (counted in `failed`, said in the summary).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmobs.shm import layout

QUEUE_ITEMS = 16
WINDOW_S = 60.0
SEEN_KEPT = 4096  # token steps already asked for, remembered to ask once each


@dataclass(frozen=True)
class ReplayOptions:
    """What `replay.*` configures: replays of flagged tokens, at most max_per_minute per target."""

    max_per_minute: int = 2
    window: int = 0  # 0: layout.REPLAY_DEFAULT_WINDOW steps either side
    timeout_s: float = 120.0  # per replay: the ack and the file
    ack_timeout_s: float = 10.0


@dataclass
class ReplayCounters:
    requested: int = 0  # CMD_REPLAY posted
    skipped_rate: int = 0  # over max_per_minute (or the queue full)
    busy: int = 0  # the workload was running another replay
    failed: int = 0  # refused, no answer, no file in time, or the ingest failed
    stored: int = 0  # ingested, with a verdict
    verdicts: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None


class AutoReplayer:
    def __init__(self, store, pid: int, options: ReplayOptions, shm_dir: str = layout.SHM_DIR,
                 flush: Callable[[float], bool] | None = None):  # fmt: skip
        self.store, self.pid, self.options, self.shm_dir = store, pid, options, shm_dir
        self.flush = flush  # the pipeline's StoreWriter.flush: commit the steps before the ingest
        self.counters = ReplayCounters()
        self.disabled: str | None = None  # why this target is not asked any more
        self._asked: deque[float] = deque()  # when each of the last minute's requests was queued
        self._seen: dict[tuple[int, int], None] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_ITEMS)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmobs-replay-agent", daemon=True)
        self._thread.start()

    # ---- the anomaly lane's side (never blocks) -----------------------------------------------------
    def on_rows(self, rows: dict, now: float | None = None) -> int:
        """Queue replays of the committed rows' flagged token steps; returns how many were queued."""
        if self.disabled:
            return 0
        now = time.monotonic() if now is None else now
        queued = 0
        keys = zip(rows["pid"], rows["step_seq"], rows["batch_row"], rows["step"], strict=True)
        for pid, seq, row, step in keys:
            if pid != self.pid or step is None or seq is None:  # a step-level (training) row: no token
                continue
            key = (int(seq), int(row or 0))
            if key in self._seen:
                continue
            self._remember(key)
            while self._asked and now - self._asked[0] >= WINDOW_S:
                self._asked.popleft()
            if len(self._asked) >= self.options.max_per_minute:
                self.counters.skipped_rate += 1
                continue
            try:
                self._queue.put_nowait(key)
            except queue.Full:
                self.counters.skipped_rate += 1
                continue
            self._asked.append(now)
            queued += 1
        return queued

    def _remember(self, key: tuple[int, int]) -> None:
        self._seen[key] = None
        if len(self._seen) > SEEN_KEPT:
            self._seen.pop(next(iter(self._seen)))

    # ---- the replay thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            if self.disabled:
                continue
            try:
                self._replay(*key)
            except Exception as exc:  # counted: a replay must never take the pipeline down
                self.counters.failed += 1
                self.counters.last_error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    def _replay(self, step_seq: int, batch_row: int) -> None:
        from llmobs.errors import NoRecorder, ReplayBusy
        from llmobs.pipeline import replay_ingest
        from llmobs.shm import replay_client
        from llmobs.shm.control import ControlClient

        o = self.options
        try:
            with ControlClient(self.pid, self.shm_dir) as client:
                self.counters.requested += 1
                accepted = replay_client.post(client, step_seq, batch_row, o.window, o.ack_timeout_s)
            path = replay_client.wait_file(accepted, o.timeout_s, self.pid, cancelled=self._closing.is_set)
        except ReplayBusy:
            self.counters.busy += 1
            return
        except NoRecorder as exc:
            self.disabled = str(exc)
            raise
        if self.flush is not None:
            self.flush(o.timeout_s)
        try:
            got = replay_ingest.ingest_file(
                self.store, path, ack_step_seq=accepted.ack_step_seq, trigger="anomaly"
            )
        finally:
            replay_ingest.remove(path)
        self.counters.stored += 1
        verdict = got.verdict.verdict
        self.counters.verdicts[verdict] = self.counters.verdicts.get(verdict, 0) + 1
        rows = self.store.counters.rows_by_table
        for table, count in got.rows.items():
            rows[table] = rows.get(table, 0) + count

    def close(self, timeout: float = 10.0) -> bool:
        """Finish the replay in flight (bounded: past `timeout` its wait is given up), drop the queued
        ones, stop the thread."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._closing.set()
            self._thread.join(1.0)
        return not self._thread.is_alive()

    def summary(self) -> str:
        c = self.counters
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(c.verdicts.items())) or "none"
        line = (
            f"replays on anomaly (at most {self.options.max_per_minute}/min): {c.requested} requested, "
            f"{c.stored} stored ({verdicts}), {c.skipped_rate} skipped by the rate limit, {c.busy} busy, "
            f"{c.failed} failed"
        )
        if self.disabled:
            line += f"; stopped asking: {self.disabled}"
        elif c.last_error:
            line += f"; last error: {c.last_error}"
        return line
