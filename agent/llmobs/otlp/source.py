"""The export cursor: which store rows are not yet exported, read in bounded batches, committed on ack.

The store is the source of truth and the export buffer: nothing is queued in memory beyond the one batch
in flight, so a collector that is down for hours costs disk (the rows are in the store anyway), not RAM.

Tables this module owns (created with CREATE TABLE IF NOT EXISTS; documented in docs/otlp.md):

- otlp_cursor: per pid, the key (t_start_ns, step_seq, batch_row) of the last token step whose span the
  collector acknowledged. Within one pid, token steps reach the store in that key order (the shm ring is
  FIFO and step_seq is bumped per forward pass), so "key > cursor" is exactly the unexported rows.
  t_start_ns leads the key so that a reused pid (a new process restarting step_seq at 1) is still ahead
  of the cursor: CLOCK_MONOTONIC only grows.
- otlp_requests: per (pid, trace_id), the request aggregates accumulated from exported steps, and
  whether its request span went out. A request span is sent once the request is closed (no new step
  for `request_idle_s`, or on a one-shot export's final flush).
- otlp_state: key/value; holds the salt of the per-request random trace ids (so a retried or resumed
  export gives the same ids).

A batch's cursor advance and request updates are one transaction, run only after the collector
acknowledged the batch: at-least-once, with duplicates limited to a batch whose ack was lost.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa

from llmobs import clock
from llmobs.shm.reader import STEP_COLUMNS

DDL = (
    """CREATE TABLE IF NOT EXISTS otlp_cursor (
        pid INTEGER NOT NULL PRIMARY KEY,
        t_start_ns BIGINT NOT NULL,
        step_seq BIGINT NOT NULL,
        batch_row INTEGER NOT NULL,
        exported_steps BIGINT NOT NULL DEFAULT 0,
        updated_ns BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS otlp_requests (
        pid INTEGER NOT NULL,
        trace_id VARCHAR NOT NULL,
        tenant VARCHAR,
        session VARCHAR,
        model_id VARCHAR,
        t_start_ns BIGINT NOT NULL,
        t_end_ns BIGINT NOT NULL,
        tokens BIGINT NOT NULL,
        loss_sum DOUBLE NOT NULL DEFAULT 0,
        loss_count BIGINT NOT NULL DEFAULT 0,
        exported BOOLEAN NOT NULL DEFAULT false,
        PRIMARY KEY (pid, trace_id))""",
    "CREATE TABLE IF NOT EXISTS otlp_state (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
)

_STEP_NAMES = STEP_COLUMNS  # the decoded token-step columns, as the map reader defines them
STEP_COLUMNS = ", ".join(
    "coalesce(t.batch_row, 0) AS batch_row" if name == "batch_row" else f"t.{name}" for name in _STEP_NAMES
)

_PENDING_STEPS = f"""
SELECT {STEP_COLUMNS} FROM token_steps t LEFT JOIN otlp_cursor c USING (pid)
WHERE (c.pid IS NULL OR t.t_start_ns > c.t_start_ns
       OR (t.t_start_ns = c.t_start_ns AND (t.step_seq > c.step_seq
           OR (t.step_seq = c.step_seq AND coalesce(t.batch_row, 0) > c.batch_row))))
  AND ($cutoff IS NULL OR t.t_start_ns <= $cutoff)
ORDER BY t.t_start_ns, t.pid, t.step_seq, coalesce(t.batch_row, 0)
LIMIT $limit
"""

# Sampled events of the batch's forward passes, the first `max` per pass by time, with each pass's total.
# The ts_ns range lets DuckDB skip row groups (events are appended roughly in time order).
_EVENT_SELECT = """
    SELECT '{kind}' AS kind, pid, tid, cpu, ts_ns, probe, step_seq, trace_hi, trace_lo, value, duration_ns,
           sample_ratio, {extra} FROM {table} WHERE step_seq <> 0 AND ts_ns BETWEEN $lo AND $hi
"""
_NO_GPU = "NULL::VARCHAR AS name, NULL::BIGINT AS gpu_ns"
_GPU = "name, gpu_end_ns - gpu_start_ns AS gpu_ns"
_BATCH_EVENTS = f"""
WITH ev AS (
    {_EVENT_SELECT.format(kind="mem", table="mem_events", extra=_NO_GPU)}
    UNION ALL {_EVENT_SELECT.format(kind="host", table="host_events", extra=_NO_GPU)}
    UNION ALL {_EVENT_SELECT.format(kind="gpu", table="gpu_ops", extra=_GPU)}
)
SELECT ev.*, trace_hex(trace_hi, trace_lo) AS trace_id,
       count(*) OVER (PARTITION BY pid, step_seq) AS pass_total
FROM ev SEMI JOIN _otlp_passes p USING (pid, step_seq)
QUALIFY row_number() OVER (PARTITION BY pid, step_seq ORDER BY ts_ns, probe) <= $max
ORDER BY pid, step_seq, ts_ns
"""

_BATCH_ROLLUPS = """
SELECT r.* FROM step_rollups r SEMI JOIN _otlp_passes p USING (pid, step_seq)
WHERE r.t_start_ns BETWEEN $lo AND $hi
"""

# Device time by kernel name for the batch's passes (CUPTI records, joined by the external id the
# collector sets to the step_seq); the kernel names become classes in metrics.py.
_BATCH_GPU_TIME = """
SELECT g.pid, coalesce(g.external_id, g.step_seq) AS step_seq, coalesce(g.name, '') AS name,
       sum(g.gpu_end_ns - g.gpu_start_ns)::BIGINT AS gpu_ns, count(*) AS ops
FROM gpu_ops g SEMI JOIN _otlp_passes p ON g.pid = p.pid AND coalesce(g.external_id, g.step_seq) = p.step_seq
WHERE g.source = 'cupti' AND g.gpu_start_ns IS NOT NULL AND g.gpu_end_ns IS NOT NULL
  AND g.ts_ns BETWEEN $lo AND $hi
GROUP BY ALL
"""

_ADVANCE_CURSOR = """
INSERT INTO otlp_cursor VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (pid) DO UPDATE SET
    t_start_ns = excluded.t_start_ns, step_seq = excluded.step_seq, batch_row = excluded.batch_row,
    exported_steps = exported_steps + excluded.exported_steps, updated_ns = excluded.updated_ns
"""
_FOLD_REQUESTS = """
INSERT INTO otlp_requests
SELECT pid, trace_id, tenant, session, model_id, t_start_ns, t_end_ns, tokens, loss_sum, loss_count, false
FROM _otlp_fold
ON CONFLICT (pid, trace_id) DO UPDATE SET
    t_start_ns = least(t_start_ns, excluded.t_start_ns), t_end_ns = greatest(t_end_ns, excluded.t_end_ns),
    tokens = tokens + excluded.tokens, loss_sum = loss_sum + excluded.loss_sum,
    loss_count = loss_count + excluded.loss_count
"""

# Loss anomalies of the batch's passes (llmobs.diagnostics): span events named llmobs.anomaly. Detected
# within ~0.1 s of the step and committed at once, they are in the store before the step's own row;
# their evidence lands after correlate (2-5 s), so a step exported sooner carries the anomaly without it.
_BATCH_ANOMALIES = """
SELECT a.pid, a.step_seq, a.trace_id, coalesce(a.batch_row, 0) AS batch_row, a.kind, a.score, a.detector,
       a.detail, a.evidence, a.artifact
FROM anomalies a SEMI JOIN _otlp_passes p USING (pid, step_seq)
WHERE a.ts_ns >= $lo  -- detected after its step, however late (an agent catching up on a backlog)
ORDER BY a.pid, a.step_seq, a.kind
"""

# NVML samples of the batch's processes over its step window (llmobs.gpu.nvml_source): the OTLP gauges
# of GPU utilisation and memory, newest value per series (metrics.py).
_BATCH_GPU_SAMPLES = """
SELECT g.pid, g.gpu_index, coalesce(g.gpu_uuid, '') AS gpu_uuid, g.ts_ns, g.sm_util, g.mem_used
FROM gpu_samples g WHERE g.pid IN (SELECT unnest($pids)) AND g.ts_ns BETWEEN $lo AND $hi
ORDER BY g.ts_ns
"""

# How far around a batch's step window to look for its events (CUPTI records and late-tagged work).
EVENT_SLACK_NS = 2_000_000_000


@dataclass
class StepBatch:
    """One bounded unit of export: token steps plus what the spans and metrics need about them."""

    steps: list[dict]
    events: list[dict]
    rollups: dict[tuple[int, int], dict]
    gpu_time: list[dict]
    requests: list[dict]  # closed requests whose span goes out with this batch
    processes: dict[int, dict]
    anomalies: list[dict] = field(default_factory=list)  # anomaly rows of the batch's passes
    gpu_samples: list[dict] = field(default_factory=list)  # NVML samples of its processes, in time order

    @property
    def span_count(self) -> int:
        return len(self.steps) + len(self.requests)

    def only(self, keep) -> StepBatch:
        """The part of this batch whose trace `keep(trace_id_hex)` accepts (for 1/N trace sampling)."""
        return StepBatch(
            [s for s in self.steps if keep(s["trace_id"])],
            [e for e in self.events if keep(e["trace_id"])],
            self.rollups,
            self.gpu_time,
            [r for r in self.requests if keep(r["trace_id"])],
            self.processes,
            [a for a in self.anomalies if keep(a["trace_id"] or "")],
            self.gpu_samples,  # gauges of the processes, not of traces: never sampled away
        )


class ExportCursor:
    """Reads unexported rows from a store connection and commits progress after an ack."""

    def __init__(self, conn: duckdb.DuckDBPyConnection):
        self.conn = conn
        for statement in DDL:
            conn.execute(statement)
        self._has_trace_hex = bool(
            conn.execute(
                "SELECT count(*) FROM duckdb_functions() WHERE function_name = 'trace_hex'"
            ).fetchall()[0][0]
        )
        if not self._has_trace_hex:  # a store made before the macro existed: define it for this connection
            conn.execute(
                "CREATE TEMP MACRO trace_hex(hi, lo) AS"
                " CASE WHEN hi = 0 AND lo = 0 THEN '' ELSE printf('%016x%016x', hi, lo) END"
            )
        self._process_cache: dict[int, dict] = {}
        self._has_gpu_samples = bool(  # a store older than schema 6 has no NVML samples
            conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = 'gpu_samples'"
            ).fetchall()[0][0]
        )

    # -- state ---------------------------------------------------------------------------------------

    def salt(self) -> bytes:
        """The per-store secret behind random trace ids (made once, kept in otlp_state)."""
        row = self.conn.execute("SELECT value FROM otlp_state WHERE key = 'trace_salt'").fetchall()
        if row:
            return bytes.fromhex(row[0][0])
        value = secrets.token_hex(16)
        self.conn.execute("INSERT OR IGNORE INTO otlp_state VALUES ('trace_salt', ?)", [value])
        return bytes.fromhex(
            self.conn.execute("SELECT value FROM otlp_state WHERE key = 'trace_salt'").fetchall()[0][0]
        )

    def wall_offset_ns(self) -> int:
        """realtime - monotonic: the store's latest recorded fit (the writer's boot), else measured now."""
        try:
            row = self.conn.execute(
                "SELECT offset_ns FROM clock_fits WHERE clock = 'realtime' ORDER BY ts_ns DESC LIMIT 1"
            ).fetchall()
        except duckdb.Error:
            row = []
        return int(row[0][0]) if row else clock.WallClock.measure().offset_ns

    def newest_step_ns(self) -> int | None:
        return self.conn.execute("SELECT max(t_start_ns) FROM token_steps").fetchall()[0][0]

    def pending_steps(self) -> int:
        """How many token steps are not exported yet (for status lines and tests)."""
        sql = _PENDING_STEPS.replace("LIMIT $limit", "").replace(f"SELECT {STEP_COLUMNS}", "SELECT count(*)")
        sql = sql.replace("ORDER BY t.t_start_ns, t.pid, t.step_seq, coalesce(t.batch_row, 0)", "")
        return self.conn.execute(sql, {"cutoff": None}).fetchall()[0][0]

    def counts(self) -> dict[str, int]:
        exported = self.conn.execute("SELECT coalesce(sum(exported_steps), 0) FROM otlp_cursor").fetchall()[
            0
        ][0]
        requests = self.conn.execute("SELECT count(*) FROM otlp_requests WHERE exported").fetchall()[0][0]
        return {"steps_exported": int(exported), "requests_exported": int(requests)}

    # -- reading -------------------------------------------------------------------------------------

    def next_batch(
        self,
        limit: int,
        max_events_per_span: int,
        cutoff_ns: int | None = None,
        request_idle_ns: int | None = None,
        now_ns: int | None = None,
        flush: bool = False,
    ) -> StepBatch:
        """The next `limit` unexported token steps (only those started at or before `cutoff_ns` if set),
        their sampled events, rollups and GPU time, plus the requests that are closed by now."""
        conn = self.conn
        table = conn.sql(_PENDING_STEPS, params={"cutoff": cutoff_ns, "limit": limit}).to_arrow_table()
        steps = table.to_pylist()
        events: list[dict] = []
        rollups: dict[tuple[int, int], dict] = {}
        gpu_time: list[dict] = []
        anomalies: list[dict] = []
        gpu_samples: list[dict] = []
        if steps:
            passes = table.group_by(["pid", "step_seq"]).aggregate([])
            conn.register("_otlp_passes", passes)
            try:
                lo = min(s["t_start_ns"] for s in steps) - EVENT_SLACK_NS
                hi = max(s["t_end_ns"] for s in steps) + EVENT_SLACK_NS
                params = {"lo": lo, "hi": hi}
                events = (
                    conn.sql(_BATCH_EVENTS, params={**params, "max": max_events_per_span})
                    .to_arrow_table()
                    .to_pylist()
                )
                for row in conn.sql(_BATCH_ROLLUPS, params=params).to_arrow_table().to_pylist():
                    rollups[(row["pid"], row["step_seq"])] = row
                gpu_time = conn.sql(_BATCH_GPU_TIME, params=params).to_arrow_table().to_pylist()
                anomalies = conn.sql(_BATCH_ANOMALIES, params={"lo": lo}).to_arrow_table().to_pylist()
                if self._has_gpu_samples:
                    step_pids = sorted({s["pid"] for s in steps})
                    gpu_samples = (
                        conn.sql(_BATCH_GPU_SAMPLES, params={**params, "pids": step_pids})
                        .to_arrow_table()
                        .to_pylist()
                    )
            finally:
                conn.unregister("_otlp_passes")
        # A final flush closes every request only once no step is left behind this batch.
        drained = len(steps) < limit
        # The agent's clock may close a request only once the backlog is drained: behind a backlog every
        # request looks idle although its later steps are still waiting in the store.
        now_ns = now_ns if drained else None
        requests = self._closed_requests(steps, limit, request_idle_ns, now_ns, flush and drained)
        pids = {s["pid"] for s in steps} | {r["pid"] for r in requests}
        return StepBatch(
            steps, events, rollups, gpu_time, requests, self.processes(pids), anomalies, gpu_samples
        )

    def _closed_requests(
        self, steps: list[dict], limit: int, idle_ns: int | None, now_ns: int | None, flush: bool
    ) -> list[dict]:
        """Requests whose span can go out: closed before this batch, or by this batch's steps.

        The batch's own steps are folded in memory (not yet committed) so that the aggregates sent equal
        what commit() will store."""
        pending = self._fold(steps)
        stored = {
            (r["pid"], r["trace_id"]): r
            for r in self.conn.sql("SELECT * FROM otlp_requests WHERE NOT exported")
            .to_arrow_table()
            .to_pylist()
        }
        for key, agg in pending.items():
            stored[key] = _merge(stored.get(key), agg)
        newest_by_pid: dict[int, int] = {}
        for (pid, _), r in stored.items():
            newest_by_pid[pid] = max(newest_by_pid.get(pid, 0), r["t_end_ns"])
        closed = []
        for (pid, _), r in sorted(stored.items(), key=lambda kv: kv[1]["t_end_ns"]):
            if flush:
                is_closed = True
            elif idle_ns is None:
                is_closed = False
            else:  # idle by the agent's clock, or the same process has moved on past it
                is_closed = (now_ns is not None and r["t_end_ns"] + idle_ns <= now_ns) or (
                    r["t_end_ns"] + idle_ns <= newest_by_pid[pid]
                )
            if is_closed:
                closed.append(r)
            if len(closed) >= limit:
                break
        return closed

    @staticmethod
    def _fold(steps: list[dict]) -> dict[tuple[int, str], dict]:
        out: dict[tuple[int, str], dict] = {}
        for s in steps:
            loss = s["loss"]
            has_loss = loss is not None and loss == loss  # NaN: no target
            agg = {
                "pid": s["pid"],
                "trace_id": s["trace_id"],
                "tenant": s["tenant"],
                "session": s["session"],
                "model_id": s["model_id"],
                "t_start_ns": s["t_start_ns"],
                "t_end_ns": s["t_end_ns"],
                "tokens": 1,
                "loss_sum": float(loss) if has_loss else 0.0,
                "loss_count": 1 if has_loss else 0,
                "exported": False,
            }
            key = (s["pid"], s["trace_id"])
            out[key] = _merge(out.get(key), agg)
        return out

    def processes(self, pids: set[int]) -> dict[int, dict]:
        """The latest `processes` row of each pid (exe, cmdline), cached: resource attributes."""
        missing = [p for p in pids if p not in self._process_cache]
        if missing:
            rows = self.conn.execute(
                "SELECT pid, arg_max(exe, start_ns) AS exe, arg_max(cmdline, start_ns) AS cmdline"
                " FROM processes WHERE pid IN (SELECT unnest($pids)) GROUP BY pid",
                {"pids": missing},
            ).fetchall()
            for pid in missing:
                self._process_cache[pid] = {"exe": None, "cmdline": None}
            for pid, exe, cmdline in rows:
                self._process_cache[pid] = {"exe": exe, "cmdline": cmdline}
        return {p: self._process_cache[p] for p in pids}

    # -- committing ----------------------------------------------------------------------------------

    def commit(self, batch: StepBatch) -> None:
        """After the collector acknowledged `batch`: advance each pid's cursor past its steps, fold them
        into otlp_requests and mark the sent request spans, in one transaction."""
        conn = self.conn
        now = clock.monotonic_ns()
        last: dict[int, tuple[int, int, int, int]] = {}
        for s in batch.steps:
            key = (s["t_start_ns"], s["step_seq"], s["batch_row"])
            prev = last.get(s["pid"])
            count = (prev[3] if prev else 0) + 1
            if prev is None or key > prev[:3]:
                last[s["pid"]] = (*key, count)
            else:
                last[s["pid"]] = (*prev[:3], count)
        folded = self._fold(batch.steps)
        conn.execute("BEGIN TRANSACTION")
        try:
            for pid, (t_start, step_seq, batch_row, count) in last.items():
                conn.execute(_ADVANCE_CURSOR, [pid, t_start, step_seq, batch_row, count, now])
            if folded:
                rows = pa.Table.from_pylist(list(folded.values()))
                conn.register("_otlp_fold", rows)
                try:
                    conn.execute(_FOLD_REQUESTS)
                finally:
                    conn.unregister("_otlp_fold")
            for r in batch.requests:
                conn.execute(
                    "UPDATE otlp_requests SET exported = true WHERE pid = ? AND trace_id = ?",
                    [r["pid"], r["trace_id"]],
                )
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise

    def prune(self) -> int:
        """Forget exported requests older than anything left in token_steps (retention removed them)."""
        return self.conn.execute(
            "DELETE FROM otlp_requests WHERE exported"
            " AND t_end_ns < (SELECT coalesce(min(t_start_ns), 0) FROM token_steps)"
        ).fetchall()[0][0]


def _merge(old: dict | None, new: dict) -> dict:
    if old is None:
        return dict(new)
    merged = dict(old)
    merged["t_start_ns"] = min(old["t_start_ns"], new["t_start_ns"])
    merged["t_end_ns"] = max(old["t_end_ns"], new["t_end_ns"])
    merged["tokens"] = old["tokens"] + new["tokens"]
    merged["loss_sum"] = old["loss_sum"] + new["loss_sum"]
    merged["loss_count"] = old["loss_count"] + new["loss_count"]
    for key in ("tenant", "session", "model_id"):
        merged[key] = old.get(key) or new.get(key)
    return merged
