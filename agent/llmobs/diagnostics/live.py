"""Live token-loss anomalies: the pipeline's token steps through the detectors, rows committed at once.

The pipeline's StoreWriter coalesces for up to a second (cheap appends); an anomaly is worth a commit
of its own, so its rows take this small writer instead: a bounded queue and one thread that commits
each batch as soon as it arrives (the drain loop never waits on the disk; a full queue drops and
counts). For each committed row it keeps the latency from the step's end in the workload (t_end_ns,
CLOCK_MONOTONIC, the clock of time.monotonic_ns here) to the commit, which the agent reports and
bench/anomaly_latency.py measures. Evidence is added later, once correlate has rolled the
step up (`refresh_evidence`, called from the pipeline's correlate thread).
"""

from __future__ import annotations

import json
import queue
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from llmobs import clock
from llmobs.diagnostics.detectors import DetectorConfig, StreamingDetector
from llmobs.diagnostics.evidence import refresh_evidence

QUEUE_ITEMS = 256
LATENCY_KEPT = 4096  # the most recent spike-to-commit latencies kept for percentiles


@dataclass
class AnomalyCounters:
    rows: int = 0  # anomaly rows produced by the detectors
    committed: int = 0
    dropped: int = 0  # queue full
    failed: int = 0  # the commit failed (see last_error)
    evidence_updates: int = 0  # anomaly rows given (or refreshed with) evidence
    evidence_errors: int = 0
    last_error: str | None = None


class LiveAnomalies:
    """Detector + immediate-commit writer for one pipeline (one pid)."""

    def __init__(self, store, config: DetectorConfig | None = None):
        self.store = store
        self.detector = StreamingDetector(config or DetectorConfig())
        self.counters = AnomalyCounters()
        # (step_seq, step, kind, ns from the step's end to its row committed) of recent rows
        self.latencies: deque[tuple[int, int, str, int]] = deque(maxlen=LATENCY_KEPT)
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_ITEMS)
        self._thread = threading.Thread(target=self._run, name="llmobs-anomalies", daemon=True)
        self._thread.start()

    def add(self, steps: dict) -> int:
        """Score a batch of token steps (the map reader's columns); queue the anomalies; return how many."""
        try:
            rows = self.detector.add(steps, clock.monotonic_ns())
        except Exception as exc:  # a detector bug must not stop the data path
            self.counters.last_error = f"detector: {exc}"
            return 0
        if rows is None:
            return 0
        count = len(rows["ts_ns"])
        self.counters.rows += count
        try:
            self._queue.put_nowait(rows)
        except queue.Full:
            self.counters.dropped += count
        return count

    def _run(self) -> None:
        while True:
            rows = self._queue.get()
            if rows is None:
                return
            rows, stop = self._coalesce(rows)
            self._commit(rows)
            if stop:
                return

    def _coalesce(self, rows: dict) -> tuple[dict, bool]:
        """The batch and every other one already queued, as one commit: under a high flag rate a
        commit per drain would cost more than the detectors (no batch waits for another)."""
        parts, stop = [rows], False
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                stop = True
                break
            parts.append(more)
        if len(parts) == 1:
            return rows, stop
        return {c: [v for p in parts for v in p[c]] for c in rows}, stop

    def _commit(self, rows: dict) -> None:
        result = self.store.export({"anomalies": rows})
        done_ns = clock.monotonic_ns()
        if not result.ok:
            self.counters.failed += len(rows["ts_ns"])
            self.counters.last_error = result.error
            return
        self.counters.committed += len(rows["ts_ns"])
        keys = zip(rows["step_seq"], rows["step"], rows["kind"], rows["detail"], strict=True)
        for seq, step, kind, detail in keys:
            self.latencies.append((seq, step, kind, done_ns - json.loads(detail)["t_end_ns"]))

    def refresh_evidence(self, conn, pid: int, since_ns: int) -> None:
        """Give the anomalies of rolled-up steps their evidence (on the correlate thread's cursor)."""
        try:
            self.counters.evidence_updates += refresh_evidence(conn, pid, since_ns)
        except Exception as exc:  # counted; the final pass at close covers the whole session
            self.counters.evidence_errors += 1
            self.counters.last_error = f"evidence: {str(exc).splitlines()[0]}"

    def latency_ms(self) -> dict[str, float] | None:
        """p50/p99/max of spike (step end) to committed row, in ms, over the rows kept."""
        if not self.latencies:
            return None
        values = np.asarray([row[3] for row in self.latencies], np.float64) / 1e6
        return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
                "max": float(values.max()), "n": int(len(values))}  # fmt: skip

    def close(self, timeout: float = 10.0) -> bool:
        """Commit what is queued and stop the thread; False if it did not finish in time."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def summary(self) -> str:
        c, d = self.counters, self.detector.counters
        line = (
            f"anomalies ({self.detector.config.detector}, window {self.detector.config.window}): "
            f"{d.tested:,} of {d.steps:,} token steps tested, {c.rows:,} flagged, {c.committed:,} committed, "
            f"{c.dropped:,} dropped, {c.failed:,} failed, {c.evidence_updates:,} evidence updates"
        )
        latency = self.latency_ms()
        if latency:
            line += f"; step end to row committed p50 {latency['p50']:.0f} ms, p99 {latency['p99']:.0f} ms"
        if d.evicted:
            line += f"; {d.evicted:,} open requests evicted"
        if c.last_error:
            line += f"; last error: {c.last_error}"
        return line
