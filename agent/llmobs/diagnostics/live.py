"""Live token-loss anomalies: the pipeline's token steps through the detectors, rows committed at once
(while rows keep coming faster than COMMIT_GAP_NS apart, at most one commit each COMMIT_GAP_NS).

The anomaly lane. The pipeline's StoreWriter coalesces for a second or more (cheap appends); an anomaly
is worth a commit of its own, so its rows take this lane instead: a bounded queue and one thread that
commits each batch as soon as it arrives, on its own DuckDB cursor, so a commit never waits behind the
StoreWriter's (which hold the store's lock for a whole coalesced batch of events) or the correlate
thread's SQL (its cursor too). The drain loop never waits on the disk; a full queue drops and counts.

The lane also builds the incidents (llmobs.diagnostics.incidents) from the rows it commits, and writes
each row with its incident_id and the changed incidents in the same transaction. The step-level
training rows (llmobs.diagnostics.training) come here too (`submit`), so a bad batch is an incident.

For each committed token row it keeps the latency from the step's end in the workload (t_end_ns,
CLOCK_MONOTONIC, the clock of time.monotonic_ns here) to the commit, and how much of it was spent before
the detectors saw the step (the map read cadence) - what the agent reports and bench/anomaly_latency.py
measures. A row committed more than LATE_NS after its step's end is counted (`anomaly_rows_late`, shown
at detach, by `top` and as llmobs.agent.anomaly.late over OTLP): the agent says when it falls behind.
Evidence is added later, once correlate has rolled the step up (`refresh_evidence`, called from the
pipeline's correlate thread).
"""

from __future__ import annotations

import functools
import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from llmobs import clock
from llmobs.diagnostics.detectors import ANOMALY_COLUMNS, DetectorConfig, StreamingDetector, live_traffic
from llmobs.diagnostics.evidence import refresh_evidence
from llmobs.diagnostics.incidents import INCIDENT_COLUMNS, IncidentBuilder
from llmobs.stagecpu import STAGES

QUEUE_ITEMS = 256
LATENCY_KEPT = 4096  # the most recent spike-to-commit latencies kept for percentiles
LATE_NS = 200_000_000  # the spike-to-row target (docs/diagnostics.md): later rows are counted
# With incidents open the lane wakes this often to close those no row can join any more (the
# detectors scored past their gap); with none open it sleeps until a row comes.
CLOSE_CHECK_S = 0.25
INCIDENT_HOLD_NS = 500_000_000  # the longest the incidents' write waits for a moment without rows
# ... and the incidents are written at most this often (a lone spike's at once): at a 20k steps/s server
# they were written after most commits of rows, ~6 a second at ~9 ms (an INSERT and an UPDATE ... FROM in
# a transaction), ~2.7 us of agent CPU per token step. A held write goes at the lane's next wake (it
# wakes every CLOSE_CHECK_S while incidents are unwritten), so an incident row is at most ~0.75 s later.
INCIDENT_GAP_NS = 500_000_000
# An open incident is written once it has been open this long (then at most this often while it grows),
# a closed one at once: most incidents close within GAP_PASSES passes and are written once, where a
# write per growth was two statements per commit (bench.step_cost: the slow target's anomaly lane
# 104 -> 415 us of CPU per token step).
OPEN_WRITE_NS = 2_000_000_000
# Once two commits of rows have come within this long of each other, rows that come within this long
# of the last one wait out the rest of it and share the next commit: at a 20k steps/s server the
# detectors flag rows on most of the loop's 50 polls a second, and a commit each (an INSERT and its
# transaction, ~1.5 ms of CPU here) was ~4 us of agent CPU per token step. A spike's rows, and the next
# poll's that follow it, are committed at once, as before (the < 200 ms spike-to-row target).
COMMIT_GAP_NS = 50_000_000
ROW_COLUMNS = (*ANOMALY_COLUMNS, "artifact", "incident_id")
_UPDATE_INCIDENTS = (
    "UPDATE incidents SET "
    + ", ".join(f"{c} = u.{c}" for c in INCIDENT_COLUMNS if c != "incident_id")
    + " FROM _llmobs_updates u WHERE incidents.incident_id = u.incident_id"
)


@dataclass
class AnomalyCounters:
    rows: int = 0  # anomaly rows produced by the detectors
    committed: int = 0
    dropped: int = 0  # queue full
    failed: int = 0  # the commit failed (see last_error)
    late: int = 0  # token rows committed more than LATE_NS after their step's end
    evidence_updates: int = 0  # anomaly rows given (or refreshed with) evidence
    evidence_errors: int = 0
    last_error: str | None = None


class LiveAnomalies:
    """Detector + immediate-commit writer (the anomaly lane) + incidents, for one pipeline (one pid)."""

    def __init__(
        self,
        store,
        config: DetectorConfig | None = None,
        incidents: IncidentBuilder | None = None,
        wait: Callable[[float], object] = time.sleep,
    ):
        self.store = store
        self._wait = wait  # the lane's sleep out of COMMIT_GAP_NS
        self.detector = StreamingDetector(config or DetectorConfig())
        self.incidents = incidents or IncidentBuilder()
        self.counters = AnomalyCounters()
        # (step_seq, step, kind, ns from the step's end to its row committed, ns of that before the
        # detectors scored it) of recent token rows
        self.latencies: deque[tuple[int, int, str, int, int]] = deque(maxlen=LATENCY_KEPT)
        self.lag_ns = 0  # the last committed token row's step-end-to-commit latency
        # Passes scored so far, for closing incidents: the token detectors' (set by add) and the
        # step-level detector's (a callable the pipeline sets: TrainingMonitor.scored_through).
        self._scored_seq: int | None = None
        self.pass_progress: Callable[[], int | None] = lambda: None
        # Called on the lane's thread with each batch of rows once committed ({column: list}); must not
        # block (the automatic replays: llmobs.pipeline.auto_replay.AutoReplayer.on_rows).
        self.on_committed: Callable[[dict], object] | None = None
        # the lane's own cursor, borrowed on its thread at the first write, given back after each commit
        self._conn = self.store.cursor()
        self._changed_since: int | None = None  # when incidents first changed since the last write
        self._rows_committed_ns = (0, 0)  # when the two last commits of rows began (COMMIT_GAP_NS)
        self._incidents_written_ns = -INCIDENT_GAP_NS  # when incidents were last written (INCIDENT_GAP_NS)
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_ITEMS)
        self._thread = threading.Thread(target=self._run, name="llmobs-anomalies", daemon=True)
        self._thread.start()

    def add(self, steps: dict, before_rows: Callable[[], object] | None = None) -> int:
        """Score a batch of token steps (the map reader's columns); queue the anomalies; return how many.
        `before_rows` runs first when there are rows (the pipeline hands the steps it holds to the writer:
        a row's step is submitted before the row)."""
        try:
            newest = int(np.max(steps["step_seq"])) if len(steps["step_seq"]) else None
            steps = live_traffic(steps)  # shadow scores are not traffic (detectors.live_traffic)
            rows = self.detector.add(steps, clock.monotonic_ns()) if len(steps["step_seq"]) else None
        except Exception as exc:  # a detector bug must not stop the data path
            self.counters.last_error = f"detector: {exc}"
            return 0
        if rows is not None:
            count = len(rows["ts_ns"])
            self.counters.rows += count
            rows["pass_token"] = _pass_tokens(rows, steps)
            if before_rows is not None:
                before_rows()
            self._put(rows, count)
        if newest is not None and (self._scored_seq is None or newest > self._scored_seq):
            self._scored_seq = newest  # after the rows are queued: the lane reads it before draining
        return 0 if rows is None else len(rows["ts_ns"])

    def submit(self, batch: dict) -> bool:
        """Anomaly rows of another detector ({"anomalies": columns}, the step-level training rows):
        committed on this lane, with their incidents. Never blocks; False when the queue is full."""
        columns = batch["anomalies"]
        rows = {c: _as_list(v) for c, v in columns.items()}
        return self._put(rows, len(rows["kind"]))

    def _put(self, rows: dict, count: int) -> bool:
        try:
            self._queue.put_nowait(rows)
        except queue.Full:
            self.counters.dropped += count
            STAGES.count("anomaly_rows_dropped", count)
            return False
        return True

    def _run(self) -> None:
        # The first pa.table() of a process costs ~0.6 s (pyarrow's lazy set-up): paid here, at attach,
        # not by the first anomaly's commit.
        pa.table({"warm": [0]})
        stop = False
        while not stop:
            timeout = CLOSE_CHECK_S if self.incidents.open_count or self.incidents.changed else None
            try:
                first = self._queue.get(timeout=timeout)
            except queue.Empty:
                first = ()
            if first is None:
                stop = True
            elif first:
                self._wait_out_commit_gap()
            # read before the queued rows: every row of a pass up to these was queued before they were set
            token_seq, pass_seq = self._scored_seq, self._pass_progress()
            parts, more_stop = self._drain([first] if first else [])
            stop = stop or more_stop
            self._commit(parts, token_seq, pass_seq, final=stop)
            self._conn.idle()  # between commits the store may reopen its database (DuckDBStore.recycle)

    def _wait_out_commit_gap(self) -> None:
        """While commits of rows come less than COMMIT_GAP_NS apart, sleeps until COMMIT_GAP_NS after the
        last one began (at most that long)."""
        before, last = self._rows_committed_ns
        if last - before >= COMMIT_GAP_NS:
            return
        rest = last + COMMIT_GAP_NS - clock.monotonic_ns()
        if rest > 0:
            self._wait(rest / 1e9)

    def _pass_progress(self) -> int | None:
        try:
            return self.pass_progress()
        except Exception:  # bookkeeping: no closing of pass incidents this time
            return None

    def _drain(self, parts: list) -> tuple[list, bool]:
        """The batch and every other one already queued, as one commit: under a high flag rate a
        commit per drain would cost more than the detectors (no batch waits for another)."""
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return parts, False
            if more is None:
                return parts, True
            parts.append(more)

    def _commit(self, parts: list[dict], token_seq, pass_seq, final: bool = False) -> None:
        now = clock.monotonic_ns()
        rows = _merged(parts) if parts else None
        if rows is not None:
            self._rows_committed_ns = (self._rows_committed_ns[1], now)
            rows["incident_id"] = self.incidents.add(rows, now)
        self.incidents.close_through("request", token_seq, now)
        self.incidents.close_through("pass", pass_seq, now)
        if final:
            self.incidents.close_all(now)
        if rows is not None:
            try:  # the store's memory cap is shared with the writer, correlate and the exporter
                self.store.with_headroom(functools.partial(self._write_rows, rows))
            except Exception as exc:  # counted
                self.counters.failed += len(rows["kind"])
                self._failed(exc)
            else:
                self._committed(rows)
        # The incidents in a transaction of their own, after their rows' (a statement costs as much as
        # the rows' commit: 10-50 ms on a busy 2-core host), and while rows wait only once they are
        # INCIDENT_HOLD_NS old: the next rows are not committed behind them.
        every = None if final else OPEN_WRITE_NS
        if not self.incidents.ready(now, every):
            return
        if self._changed_since is None:
            self._changed_since = now
        if not (final or self._queue.empty() or now - self._changed_since > INCIDENT_HOLD_NS):
            return
        if not final and now - self._incidents_written_ns < INCIDENT_GAP_NS:
            return
        new, updated = self.incidents.take_changed(now, every)
        try:
            self.store.with_headroom(functools.partial(self._write_incidents, new, updated))
        except Exception as exc:  # written with the next commit
            self.incidents.restore(new, updated)
            self._failed(exc)
            return
        self._changed_since, self._incidents_written_ns = None, now
        counts = self.store.counters.rows_by_table
        counts["incidents"] = counts.get("incidents", 0) + len(new)

    def _failed(self, exc: Exception) -> None:
        self.counters.last_error = f"commit: {str(exc).splitlines()[0]}"
        self._conn.idle()  # a fresh cursor next time

    def _committed(self, rows: dict) -> None:
        done_ns = clock.monotonic_ns()
        count = len(rows["kind"])
        counts = self.store.counters.rows_by_table
        counts["anomalies"] = counts.get("anomalies", 0) + count
        self.counters.committed += count
        late = 0
        keys = zip(rows["step_seq"], rows["step"], rows["kind"], rows["detail"], rows["ts_ns"], strict=True)
        for seq, step, kind, detail, ts_ns in keys:
            t_end = _t_end(detail)
            if t_end is None:  # a step-level row: no token step end to measure from
                continue
            self.lag_ns = done_ns - t_end
            late += self.lag_ns > LATE_NS
            self.latencies.append((seq, step, kind, self.lag_ns, ts_ns - t_end))
        if late:
            self.counters.late += late
            STAGES.count("anomaly_rows_late", late)
        if self.on_committed is not None:
            try:
                self.on_committed(rows)
            except Exception as exc:  # a follower's bug must not stop the lane
                self.counters.last_error = f"on_committed: {exc}"

    def _write_rows(self, rows: dict) -> None:
        """The rows, with their incident_id, in one INSERT (autocommitted: one transaction)."""
        stored = {c: v for c, v in rows.items() if c != "pass_token"}  # pass_token: the builder's only
        _llmobs_rows = pa.table(stored)  # noqa: F841 (read by DuckDB's replacement scan)
        self._conn.execute("INSERT INTO anomalies BY NAME SELECT * FROM _llmobs_rows")

    def _write_incidents(self, new: list[dict], updated: list[dict]) -> None:
        """One transaction: the incidents opened (INSERT) and those grown or closed (UPDATE ... FROM, by
        incident_id). Two plain statements cost less than one INSERT ... ON CONFLICT DO UPDATE here."""
        conn = self._conn
        _llmobs_new = pa.Table.from_pylist(new) if new else None  # noqa: F841 (replacement scan)
        _llmobs_updates = pa.Table.from_pylist(updated) if updated else None  # noqa: F841
        conn.execute("BEGIN TRANSACTION")
        try:
            if new:
                conn.execute("INSERT INTO incidents BY NAME SELECT * FROM _llmobs_new")
            if updated:
                conn.execute(_UPDATE_INCIDENTS)
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise

    def refresh_evidence(self, conn, pid: int, since_ns: int, pages: int | None = 1) -> None:
        """Give the anomalies of rolled-up steps their evidence (on the correlate thread's cursor; `pages`
        as evidence.refresh_evidence's: one a correlate run, None at close)."""
        try:
            self.counters.evidence_updates += refresh_evidence(conn, pid, since_ns, pages)
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

    def lag_summary(self) -> str:
        """Where the step-end-to-row time went (p99 of the rows kept): before the detectors scored the
        step (the map read) and after (queue and commit), and how many rows were late."""
        if not self.latencies:
            return "anomaly lag: no token rows committed"
        total = np.asarray([r[3] for r in self.latencies], np.float64) / 1e6
        seen = np.asarray([r[4] for r in self.latencies], np.float64) / 1e6
        return (f"anomaly lag p99: {np.percentile(total, 99):.0f} ms from step end to row committed, "
                f"{np.percentile(seen, 99):.0f} ms of it before the detectors scored the step, "
                f"{np.percentile(total - seen, 99):.0f} ms from scored to committed; "
                f"{self.counters.late:,} row(s) later than {LATE_NS // 1_000_000} ms")  # fmt: skip

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
        if c.late:
            line += f" ({c.late:,} later than {LATE_NS // 1_000_000} ms: the agent fell behind)"
        i = self.incidents.counters
        line += f"; {i.opened:,} incident(s)"
        if d.evicted:
            line += f"; {d.evicted:,} open requests evicted"
        if c.last_error:
            line += f"; last error: {c.last_error}"
        return line


def _as_list(column) -> list:
    return column.tolist() if isinstance(column, np.ndarray) else list(column)


def _pass_tokens(rows: dict, steps: dict) -> list[bool]:
    """Which flagged rows are tokens of a teacher-forced pass (a forward with labels: first_step_seq =
    step_seq). Beyond step 0 always; step 0 is also a generated request's first token, told apart by its
    pass having more of that row's tokens in this batch (a poll that split the pass right after its step
    0 leaves it a request's token: the one case this misses)."""
    out = []
    seqs = rows_of = None
    keys = zip(rows["step_seq"], rows["first_step_seq"], rows["step"], rows["batch_row"], strict=True)
    for seq, first, step, row in keys:
        if first != seq:
            out.append(False)
        elif step > 0:
            out.append(True)
        else:
            if seqs is None:
                seqs, rows_of = np.asarray(steps["step_seq"]), np.asarray(steps["batch_row"])
            out.append(int(np.count_nonzero((seqs == seq) & (rows_of == row))) > 1)
    return out


def _merged(parts: list[dict]) -> dict[str, list]:
    """Row batches of either source as one {column: list} over ROW_COLUMNS (None where a source has no
    such column: the training rows have no token index)."""
    out: dict[str, list] = {c: [] for c in (*ROW_COLUMNS, "pass_token") if c != "incident_id"}
    for part in parts:
        n = len(part["kind"])
        for column, values in out.items():
            values.extend(part[column] if column in part else [None] * n)
    return out


def _t_end(detail) -> int | None:
    try:
        value = json.loads(detail).get("t_end_ns") if detail else None
    except (TypeError, ValueError, AttributeError):
        return None
    return int(value) if value is not None else None
