"""The export cursor: which store rows are not yet exported, read in bounded batches, committed on ack.

The store is the source of truth and the export buffer: nothing is queued in memory beyond the one batch
in flight, so a collector that is down for hours costs disk (the rows are in the store anyway), not RAM.

Tables this module owns (created with CREATE TABLE IF NOT EXISTS; documented in docs/otlp.md):

- otlp_cursor: per pid, the last token step whose span the collector acknowledged: its ingest_seq
  (token_steps' per-store sequence, assigned at append: store migration 7) and its key (t_start_ns,
  step_seq, batch_row), plus the steps exported. The export position is the largest ingest_seq in the
  table: rows with a larger one are exactly the unexported rows, whatever their pid or timestamps, and
  reading them is a scan of the newest row groups (DuckDB skips the others by their min/max), not a
  sort of the whole table by time. A table written before ingest_seq existed (its rows' ingest_seq is
  NULL) is read once by its time keys to find where to resume.
- otlp_requests: per (pid, trace_id), the request aggregates accumulated from exported steps, and
  whether its request span went out. A request span is sent once the request is closed (no new step
  for `request_idle_s`, or on a one-shot export's final flush).
- otlp_served_sent: the served requests' spans sent (llmobs.otlp.served_rows), finished or not.
- otlp_state: key/value; holds the salt of the per-request random trace ids (so a retried or resumed
  export gives the same ids).

A batch's cursor advance and request updates are one transaction, run only after the collector
acknowledged the batch: at-least-once, with duplicates limited to a batch whose ack was lost.
"""

from __future__ import annotations

import secrets
import warnings
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from llmobs import clock
from llmobs.otlp.columns import sorted_keys
from llmobs.otlp.served_rows import ServedRequests
from llmobs.shm.hashing import stored_trace_hex
from llmobs.shm.reader import STEP_COLUMNS

DDL = (
    """CREATE TABLE IF NOT EXISTS otlp_cursor (
        pid INTEGER NOT NULL PRIMARY KEY,
        t_start_ns BIGINT NOT NULL,
        step_seq BIGINT NOT NULL,
        batch_row INTEGER NOT NULL,
        exported_steps BIGINT NOT NULL DEFAULT 0,
        updated_ns BIGINT NOT NULL,
        ingest_seq BIGINT)""",
    "ALTER TABLE otlp_cursor ADD COLUMN IF NOT EXISTS ingest_seq BIGINT",  # a cursor from before it
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


def _step_select(stored: set[str]) -> str:
    """The step columns to read: the reader's, as far as this store has them (a store migrated before
    a newer column existed still exports)."""
    return ", ".join(
        "coalesce(t.batch_row, 0) AS batch_row" if name == "batch_row" else f"t.{name}"
        for name in _STEP_NAMES
        if name in stored
    )


# A constant lower bound on ingest_seq lets DuckDB skip every row group below it (zonemaps).
_PENDING_STEPS = """
SELECT {columns}, t.ingest_seq FROM token_steps t
WHERE t.ingest_seq > $after
ORDER BY t.ingest_seq
LIMIT $limit
"""
_STILL_PENDING = """
SELECT DISTINCT pid, trace_id FROM token_steps
WHERE ingest_seq > $after AND trace_id IN (SELECT unnest($traces))
"""
_PENDING_COUNT = "SELECT count(*) FROM token_steps WHERE ingest_seq > $after"
# How far correlation has rolled up each pid's passes: the start of its newest pass with a rollup. The
# lower bound lets DuckDB skip all but the newest row groups (rollups are written in time order).
_ROLLED_THROUGH = """
SELECT pid, max(t_start_ns) FROM step_rollups
WHERE t_start_ns >= $since AND pid IN (SELECT unnest($pids))
GROUP BY pid
"""
_POSITION = "SELECT max(ingest_seq), count(*), count(ingest_seq) FROM otlp_cursor"
# A cursor written before ingest_seq: resume at the first row its time keys call unexported (rows
# between that and the old position are sent again: duplicates with the same ids, never a gap).
_LEGACY_POSITION = """
SELECT coalesce(min(t.ingest_seq) - 1, (SELECT max(ingest_seq) FROM token_steps), 0)
FROM token_steps t LEFT JOIN otlp_cursor c USING (pid)
WHERE c.pid IS NULL OR t.t_start_ns > c.t_start_ns
   OR (t.t_start_ns = c.t_start_ns AND (t.step_seq > c.step_seq
       OR (t.step_seq = c.step_seq AND coalesce(t.batch_row, 0) > c.batch_row)))
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
SELECT ev.* FROM ev SEMI JOIN _otlp_event_passes p USING (pid, step_seq)
"""
# The rows are then sorted by (pid, step_seq, ts_ns, probe) in Arrow (_EVENT_ORDER), and the first `max`
# per pass and each pass's total found in numpy on them (_first_per_pass). Measured on this project's
# VM for a batch's ~10k events: DuckDB's ORDER BY cost 2.2 ms of the query's 6.2, Arrow's sort 0.9; two
# window functions (a count and a row_number, each its own partitioned sort) about a fifth more than
# the one sort. The events keep their trace id as its two stored words: the hex form (trace_hex) of
# each took a third of the query (10.0 -> 6.5 ms), for a match the encoder makes against the batch's few
# distinct step traces (encoder._Owners).
_EVENT_ORDER = [(name, "ascending") for name in ("pid", "step_seq", "ts_ns", "probe")]

# In key order: the batch's rollups table keeps this order and metrics.py gives each llmobs.step.* bucket
# the exemplar of its last pass in it, so without the ORDER BY the exemplar would follow storage order.
_BATCH_ROLLUPS = """
SELECT r.* FROM step_rollups r SEMI JOIN _otlp_passes p USING (pid, step_seq)
WHERE r.t_start_ns BETWEEN $lo AND $hi
ORDER BY r.pid, r.step_seq
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
INSERT INTO otlp_cursor (pid, t_start_ns, step_seq, batch_row, exported_steps, updated_ns, ingest_seq)
VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (pid) DO UPDATE SET
    t_start_ns = excluded.t_start_ns, step_seq = excluded.step_seq, batch_row = excluded.batch_row,
    exported_steps = exported_steps + excluded.exported_steps, updated_ns = excluded.updated_ns,
    ingest_seq = greatest(coalesce(ingest_seq, 0), excluded.ingest_seq)
"""
# _ADVANCE_CURSOR for a row known to exist (the UPDATE says how many rows it changed: 0, the upsert runs).
_MOVE_CURSOR = """
UPDATE otlp_cursor SET t_start_ns = ?, step_seq = ?, batch_row = ?, exported_steps = exported_steps + ?,
    updated_ns = ?, ingest_seq = greatest(coalesce(ingest_seq, 0), ?)
WHERE pid = ?
"""
# One upsert folds the batch's steps into their requests and marks the request spans sent: a sent
# request the batch has no step of comes as a row of zero counts and its stored times (least/greatest
# leave them as they are) with `exported` true. One statement instead of an upsert and an UPDATE ... FROM.
# Not an UPDATE ... FROM and an anti-joined INSERT either: cheaper while otlp_requests is small (4.7 vs
# 5.1 ms a batch on this project's VM), but both join the whole table, where the upsert finds its keys
# by the primary key's index: with 200,000 requests kept, 11.1 ms against 5.2-5.7.
_FOLD_REQUESTS = """
INSERT INTO otlp_requests
SELECT pid, trace_id, tenant, session, model_id, t_start_ns, t_end_ns, tokens, loss_sum, loss_count, exported
FROM _otlp_fold
ON CONFLICT (pid, trace_id) DO UPDATE SET
    t_start_ns = least(t_start_ns, excluded.t_start_ns), t_end_ns = greatest(t_end_ns, excluded.t_end_ns),
    tokens = tokens + excluded.tokens, loss_sum = loss_sum + excluded.loss_sum,
    loss_count = loss_count + excluded.loss_count, exported = exported OR excluded.exported
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

# Replays of the batch's token steps (llmobs.pipeline.replay_ingest): span events named llmobs.replay on the
# replayed step's span. A replay stored after its step went out is not sent (a span is sent once).
_BATCH_REPLAYS = """
SELECT r.pid, r.target_step_seq AS step_seq, r.trace_id, r.target_batch_row AS batch_row, r.replay_id,
       r.verdict, r.first_diverging_layer, r.cause, printf('%016x', r.op_graph_hash) AS op_graph_hash,
       r.loss_diff::DOUBLE AS loss_diff, r.trigger
FROM replays r SEMI JOIN _otlp_passes p ON r.pid = p.pid AND r.target_step_seq = p.step_seq
ORDER BY r.pid, r.target_step_seq, r.ts_ns
"""

_BATCH_HAS = """
EXISTS (SELECT 1 FROM gpu_ops WHERE source = 'cupti' AND ts_ns BETWEEN $lo AND $hi),
EXISTS (SELECT 1 FROM anomalies WHERE ts_ns >= $lo), {samples}
"""  # a select list: ExportCursor._look_for_rare runs it
_BATCH_HAS_GPU_SAMPLES = _BATCH_HAS.format(
    samples="EXISTS (SELECT 1 FROM gpu_samples WHERE ts_ns BETWEEN $lo AND $hi)"
)
_BATCH_HAS = _BATCH_HAS.format(samples="false")

# Sources most stores never have a row in, each behind its own batch query: name -> (table, a look for a
# row). Served request ends come from a serving engine's publisher, replays from `replay`, incidents from
# the anomaly lane's flags (ExportCursor._look_for_rare).
_RARE_SOURCES = {
    "replays": ("replays", "SELECT 1 FROM replays"),
    "incidents": ("incidents", "SELECT 1 FROM incidents"),
    "served": ("request_events", "SELECT 1 FROM request_events WHERE kind = 'end'"),
}

# How far around a batch's step window to look for its events (CUPTI records and late-tagged work).
EVENT_SLACK_NS = 2_000_000_000


@dataclass
class StepBatch:
    """One bounded unit of export: token steps plus what the spans and metrics need about them.

    Steps and events stay Arrow tables (the encoder and the metrics read them column by column);
    `steps` gives the rows as dicts for tools and tests."""

    step_table: pa.Table
    events: pa.Table | None
    rollups: pa.Table | None  # step_rollups rows of the batch's passes, in (pid, step_seq) order
    gpu_time: list[dict]
    requests: list[dict]  # closed requests whose span goes out with this batch
    processes: dict[int, dict]
    anomalies: list[dict] = field(default_factory=list)  # anomaly rows of the batch's passes
    gpu_samples: list[dict] = field(default_factory=list)  # NVML samples of its processes, in time order
    folded: dict[tuple[int, str], dict] = field(default_factory=dict)  # the steps' request aggregates
    advance: dict[int, tuple[int, int, int, int, int]] = field(default_factory=dict)  # pid -> cursor row
    served: list[dict] = field(default_factory=list)  # request_events 'end' rows: their spans (otlp.served)
    unfinished: list[dict] = field(default_factory=list)  # served requests without an end row (final flush)
    replays: list[dict] = field(default_factory=list)  # replays of the batch's token steps (llmobs.replay)
    _rows: list[dict] | None = field(default=None, repr=False)

    @property
    def steps(self) -> list[dict]:
        if self._rows is None:
            self._rows = self.step_table.to_pylist()
        return self._rows

    @property
    def span_count(self) -> int:
        return self.step_table.num_rows + len(self.requests) + len(self.served) + len(self.unfinished)

    def only(self, keep) -> StepBatch:
        """The part of this batch whose trace `keep(trace_id_hex)` accepts (for 1/N trace sampling)."""
        decided: dict[str, bool] = {}

        def kept(trace: str) -> bool:
            answer = decided.get(trace)
            if answer is None:
                answer = decided[trace] = bool(keep(trace))
            return answer

        def rows_of(table: pa.Table | None) -> pa.Table | None:
            if table is None or table.num_rows == 0:
                return table
            mask = [kept(t) for t in table.column("trace_id").to_pylist()]
            return table.filter(pa.array(mask, pa.bool_()))

        def events_of(table: pa.Table | None) -> pa.Table | None:  # trace ids as words: per distinct pair
            if table is None or table.num_rows == 0:
                return table
            hi, lo = table.column("trace_hi").to_numpy(), table.column("trace_lo").to_numpy()
            pair_of, firsts = sorted_keys((hi, lo))
            kept_pairs = [kept(stored_trace_hex(int(hi[i]), int(lo[i]))) for i in firsts.tolist()]
            return table.filter(pa.array(np.array(kept_pairs, dtype=bool)[pair_of]))

        return StepBatch(
            rows_of(self.step_table),
            events_of(self.events),
            self.rollups,
            self.gpu_time,
            [r for r in self.requests if kept(r["trace_id"])],
            self.processes,
            [a for a in self.anomalies if kept(a["trace_id"] or "")],
            self.gpu_samples,  # gauges of the processes, not of traces: never sampled away
            self.folded,
            self.advance,
            [r for r in self.served if kept(r["trace_id"] or "")],
            [r for r in self.unfinished if kept(r["trace_id"] or "")],
            [r for r in self.replays if kept(r["trace_id"] or "")],
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
        stored = {
            row[0]
            for row in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'token_steps'"
            ).fetchall()
        }
        self._pending_steps = _PENDING_STEPS.format(columns=_step_select(stored))
        self._position: int | None = None
        self._process_cache: dict[int, dict] = {}
        self._rolled_through: dict[int, int] = {}  # pid -> _ROLLED_THROUGH, as last read (it only grows)
        self.served = ServedRequests(conn)
        self._has_gpu_samples = bool(  # a store older than schema 6 has no NVML samples
            conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = 'gpu_samples'"
            ).fetchall()[0][0]
        )
        tables = {
            row[0] for row in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
        # The rare sources this store can hold (an older store has no replays: schema 12), and which of
        # them have had a row: see _look_for_rare.
        self._rare = {name: look for name, (table, look) in _RARE_SOURCES.items() if table in tables}
        self._rare_seen: set[str] = set()
        self._cursor_pids: set[int] = set()  # pids whose otlp_cursor row this exporter has written
        # After next_batch: how long until its first step held for its rollup goes without one (0: none
        # held). The follow loop sleeps that long where the store wakes it at each correlate commit.
        self.held_for_ns = 0

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

    def position(self) -> int:
        """The ingest_seq of the last acknowledged step (0: nothing exported yet). Read from the store
        once, then kept by commit(): one exporter owns a store's cursor."""
        if self._position is None:
            newest, rows, with_seq = self.conn.execute(_POSITION).fetchall()[0]
            if rows and not with_seq:  # a cursor written before ingest_seq existed
                newest = self.conn.execute(_LEGACY_POSITION).fetchall()[0][0]
            self._position = int(newest or 0)
        return self._position

    def pending_steps(self) -> int:
        """How many token steps are not exported yet (for status lines and tests)."""
        return self.conn.execute(_PENDING_COUNT, {"after": self.position()}).fetchall()[0][0]

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
        rollup_cutoff_ns: int | None = None,
    ) -> StepBatch:
        """The next `limit` unexported token steps in ingest order (stopping before the first one that
        started after `cutoff_ns`, if set: it and what came after it wait to settle; and, if
        `rollup_cutoff_ns` is set, before the first one that started after it whose pass has no rollup
        yet: it waits for correlation), their sampled events, rollups and GPU time, plus the requests
        that are closed by now."""
        conn = self.conn
        table = _arrow(conn, self._pending_steps, {"after": self.position(), "limit": limit})
        if cutoff_ns is not None and table.num_rows:
            late = np.flatnonzero(table.column("t_start_ns").to_numpy() > cutoff_ns)
            if len(late):
                table = table.slice(0, int(late[0]))
        self.held_for_ns = 0
        if rollup_cutoff_ns is not None and table.num_rows:
            ready = self._rolled_up_rows(table, rollup_cutoff_ns)
            if ready < table.num_rows:  # the first waiting step goes at the latest once past the cutoff
                self.held_for_ns = max(int(table.column("t_start_ns")[ready].as_py()) - rollup_cutoff_ns, 0)
            table = table.slice(0, ready)
        events = None
        rollups: pa.Table | None = None
        gpu_time: list[dict] = []
        anomalies: list[dict] = []
        replays: list[dict] = []
        gpu_samples: list[dict] = []
        folded, advance = _fold(table)
        if table.num_rows:
            pid, seq = table.column("pid").to_numpy(), table.column("step_seq").to_numpy()
            passes = _distinct_passes(pid, seq)
            # A pass's events go out once, with the batch holding its first row (batch_row 0), as its
            # per-pass metrics do: batches follow ingest order, in which a pass's rows may straddle two.
            first = table.column("batch_row").to_numpy() == 0
            by_pass = {"_otlp_passes": passes, "_otlp_event_passes": _distinct_passes(pid[first], seq[first])}
            lo = pc.min(table.column("t_start_ns")).as_py() - EVENT_SLACK_NS
            hi = pc.max(table.column("t_end_ns")).as_py() + EVENT_SLACK_NS
            params = {"lo": lo, "hi": hi}
            events = _first_per_pass(_arrow(conn, _BATCH_EVENTS, params, by_pass), max_events_per_span)
            # Arrow, not dicts: ~500 rows x 15 columns a batch, read column by column by the encoder
            rollups = _arrow(conn, _BATCH_ROLLUPS, params, by_pass)
            # One cheap look for which of the rarer sources have rows here (usually none: no CUPTI,
            # no anomaly) instead of a query each, with the look for the rare sources.
            has_gpu_time, has_anomalies, has_samples = self._look_for_rare(
                _BATCH_HAS_GPU_SAMPLES if self._has_gpu_samples else _BATCH_HAS, params
            )
            if has_gpu_time:
                gpu_time = _dicts(conn, _BATCH_GPU_TIME, params, by_pass)
            if has_anomalies:
                anomalies = _dicts(conn, _BATCH_ANOMALIES, {"lo": lo}, by_pass)
            if "replays" in self._rare_seen:
                replays = _dicts(conn, _BATCH_REPLAYS, None, by_pass)
            if has_samples:
                step_pids = sorted(advance)
                gpu_samples = _dicts(conn, _BATCH_GPU_SAMPLES, {**params, "pids": step_pids})
        else:
            self._look_for_rare()
        # A final flush closes every request only once no step is left behind this batch.
        drained = table.num_rows < limit
        # The agent's clock may close a request only once the backlog is drained: behind a backlog every
        # request looks idle although its later steps are still waiting in the store.
        now_ns = now_ns if drained else None
        last_seq = max((row[4] for row in advance.values()), default=self.position())
        requests = self._closed_requests(folded, limit, request_idle_ns, now_ns, flush and drained, last_seq)
        _attach_incidents(conn, requests, stored="incidents" in self._rare_seen)
        served = self.served.pending(limit, cutoff_ns) if "served" in self._rare_seen else []
        # The final flush also gives the served requests the engine has not finished their span, so that
        # their step spans do not point at one that never comes (served_rows._UNFINISHED).
        unfinished = self.served.unfinished(limit, last_seq) if flush and drained else []
        pids = set(advance) | {r["pid"] for r in requests} | {r["pid"] for r in served}
        pids |= {r["pid"] for r in unfinished}
        return StepBatch(
            table,
            events,
            rollups,
            gpu_time,
            requests,
            self.processes(pids),
            anomalies,
            gpu_samples,
            folded,
            advance,
            served,
            unfinished,
            replays,
        )

    def _look_for_rare(self, also: str = "", params: dict | None = None) -> tuple:
        """Adds to `_rare_seen` the rare sources (_RARE_SOURCES) that have a row by now, in the same
        statement as `also` (a select list, with its `params`), whose values it returns; none is run
        when there is neither. The batch queries of a source are skipped until it is seen: each costs a
        few ms of DuckDB's fixed per-statement cost however empty its table (replays ~3 ms, served ends
        ~5 ms on this project's VM), most of an idle round's and a small batch's CPU. Once seen, a source
        is queried every batch, whatever retention deletes later. A row that lands between this look and
        where its query would have run is seen by the next batch, as it would be had it landed just
        after that query."""
        unseen = [name for name in self._rare if name not in self._rare_seen]
        columns = [also] if also else []
        columns += [f"EXISTS ({self._rare[name]})" for name in unseen]
        if not columns:
            return ()
        row = self.conn.execute(f"SELECT {', '.join(columns)}", params).fetchall()[0]
        found = row[len(row) - len(unseen) :]
        self._rare_seen.update(name for name, there in zip(unseen, found, strict=True) if there)
        return row[: len(row) - len(unseen)]

    def _rolled_up_rows(self, table: pa.Table, young_after_ns: int) -> int:
        """How many of the batch's leading rows may go now: up to the first step that started after
        `young_after_ns` in a pass correlation has not rolled up yet (its span would lack the pass's
        llmobs.step.* attributes). A step without a pass (step_seq 0) never gets a rollup and never
        waits; one older than `young_after_ns` waits no longer (correlation is failing or behind)."""
        starts = table.column("t_start_ns").to_numpy()
        pids = table.column("pid").to_numpy()
        young = (table.column("step_seq").to_numpy() != 0) & (starts > young_after_ns)
        if not young.any():
            return table.num_rows
        through = self._rolled_through
        young_pids, young_starts = pids[young], starts[young]
        behind = [pid for pid in np.unique(young_pids).tolist()
                  if young_starts[young_pids == pid].max() > through.get(pid, -1)]  # fmt: skip
        if behind:  # read again only for the pids whose young steps are past what was read before
            params = {"since": min(through.get(pid, young_after_ns) for pid in behind), "pids": behind}
            for pid, newest in self.conn.execute(_ROLLED_THROUGH, params).fetchall():
                through[pid] = max(through.get(pid, -1), newest)
        unique, row_pid = np.unique(pids, return_inverse=True)
        known = np.array([through.get(pid, -1) for pid in unique.tolist()], dtype=np.int64)[row_pid]
        waiting = np.flatnonzero(young & (starts > known))
        return int(waiting[0]) if len(waiting) else table.num_rows

    def _closed_requests(
        self,
        pending: dict[tuple[int, str], dict],
        limit: int,
        idle_ns: int | None,
        now_ns: int | None,
        flush: bool,
        last_seq: int,
    ) -> list[dict]:
        """Requests whose span can go out: closed before this batch, or by this batch's steps.

        The batch's own steps are folded in memory (not yet committed) so that the aggregates sent equal
        what commit() will store."""
        stored = {
            (r["pid"], r["trace_id"]): r
            for r in _dicts(self.conn, "SELECT * FROM otlp_requests WHERE NOT exported", None)
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
        if closed and not flush:
            # Batches follow ingest order, not time: a request whose later steps are still behind this
            # batch in the store is not closed, however idle its exported part looks.
            waiting = {
                (pid, trace)
                for pid, trace in self.conn.execute(
                    _STILL_PENDING,
                    {"after": last_seq, "traces": sorted({r["trace_id"] for r in closed})},
                ).fetchall()
            }
            closed = [r for r in closed if (r["pid"], r["trace_id"]) not in waiting]
        return closed[:limit]

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
        conn.execute("BEGIN TRANSACTION")
        try:
            for pid, (t_start, step_seq, batch_row, count, ingest_seq) in batch.advance.items():
                values = [t_start, step_seq, batch_row, count, now, ingest_seq, pid]
                # An UPDATE of the row this exporter wrote costs a third of the upsert (~1 vs ~3-5 ms):
                # the upsert only where the row may be missing (first batch of a pid, a deleted cursor).
                if pid not in self._cursor_pids or not conn.execute(_MOVE_CURSOR, values).fetchall()[0][0]:
                    conn.execute(_ADVANCE_CURSOR, [pid, *values[:-1]])
                self._cursor_pids.add(pid)
            rows = _request_rows(batch.folded, batch.requests)
            if rows:
                _otlp_fold = pa.Table.from_pylist(rows)  # noqa: F841 (read by name: _execute says how)
                conn.execute(_FOLD_REQUESTS)
            self.served.mark_sent(batch.served, now)
            self.served.mark_unfinished(batch.unfinished, now)
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            self._position = None  # read it again from the store
            self._cursor_pids.clear()
            raise
        if batch.advance and self._position is not None:
            self._position = max(self._position, *(row[4] for row in batch.advance.values()))

    def prune(self) -> int:
        """Forget exported requests older than anything left in token_steps (retention removed them), and
        the sent marks of served requests whose rows are gone (served_rows._PRUNE); the rows deleted."""
        requests = self.conn.execute(
            "DELETE FROM otlp_requests WHERE exported"
            " AND t_end_ns < (SELECT coalesce(min(t_start_ns), 0) FROM token_steps)"
        ).fetchall()[0][0]
        return int(requests) + self.served.prune()


def _request_rows(folded: dict[tuple[int, str], dict], sent: list[dict]) -> list[dict]:
    """The rows of _FOLD_REQUESTS: each folded aggregate, `exported` where its span went out with the
    batch, and each other sent request as a no-op aggregate (zero counts, its own times) marked sent."""
    rows = {key: dict(agg, exported=False) for key, agg in folded.items()}
    for request in sent:
        key = (request["pid"], request["trace_id"])
        row = rows.get(key)
        if row is None:
            row = rows[key] = {
                "pid": request["pid"],
                "trace_id": request["trace_id"],
                "tenant": request.get("tenant"),
                "session": request.get("session"),
                "model_id": request.get("model_id"),
                "t_start_ns": request["t_start_ns"],
                "t_end_ns": request["t_end_ns"],
                "tokens": 0,
                "loss_sum": 0.0,
                "loss_count": 0,
            }
        row["exported"] = True
    return list(rows.values())


def _distinct_passes(pid: np.ndarray, seq: np.ndarray) -> pa.Table:
    """The distinct (pid, step_seq) pairs, as a table DuckDB joins against. In numpy: an Arrow group-by
    costs ~0.5 ms a call in fixed set-up for a batch's few thousand rows."""
    firsts = sorted_keys((pid, seq))[1]
    return pa.table({"pid": pid[firsts], "step_seq": seq[firsts]})


def _first_per_pass(events: pa.Table, limit: int) -> pa.Table:
    """The events sorted by (pid, step_seq, ts_ns, probe), the first `limit` of each pass (pid, step_seq)
    kept, with `pass_total`, how many the pass has in all (the span says how many it left out)."""
    rows = events.num_rows
    if not rows:
        return events.append_column("pass_total", pa.array([], pa.int64()))
    events = events.take(pc.sort_indices(events, _EVENT_ORDER))
    pid = events.column("pid").to_numpy()
    seq = events.column("step_seq").to_numpy()
    first = np.ones(rows, dtype=bool)
    first[1:] = (pid[1:] != pid[:-1]) | (seq[1:] != seq[:-1])
    starts = np.flatnonzero(first)
    run = np.cumsum(first) - 1  # the pass of each row
    totals = np.diff(np.append(starts, rows))[run].astype(np.int64)
    keep = np.arange(rows) - starts[run] < limit
    events = events.append_column("pass_total", pa.array(totals))
    return events if keep.all() else events.filter(pa.array(keep))


# The incidents of the requests whose span goes out (llmobs.diagnostics.incidents): one span event each
# on the request span (llmobs.anomaly.incident). A request span is sent once the request is closed, by
# when its incidents are too (an incident closes a few passes after its last flagged token); the event
# says its state all the same. With the evidence summary of its peak row.
_REQUEST_INCIDENTS = """
SELECT i.pid, i.trace_id, i.incident_id, i.scope, i.state, i.first_step, i.last_step, i.first_seq,
    i.last_seq, i.tokens, i.rows, i.peak_score, i.peak_kind, i.peak_step, i.detectors, i.artifact,
    coalesce(i.t_first_ns, i.ts_ns) AS t_ns,
    (SELECT any_value(a.evidence) FROM anomalies a WHERE a.incident_id = i.incident_id
        AND a.step_seq = i.peak_seq AND a.kind = i.peak_kind) AS evidence
FROM incidents i SEMI JOIN _otlp_request_keys k ON i.pid = k.pid AND i.trace_id = k.trace_id
ORDER BY i.pid, i.trace_id, i.first_seq
"""


def _attach_incidents(conn: duckdb.DuckDBPyConnection, requests: list[dict], stored: bool = True) -> None:
    """Each request dict gets `incidents`: its incidents' rows (none: an empty list; all empty, unread,
    where the store has no incident: not `stored`)."""
    for req in requests:
        req["incidents"] = []
    if not requests or not stored:
        return
    keys = pa.table({"pid": [r["pid"] for r in requests], "trace_id": [r["trace_id"] for r in requests]})
    try:
        found = _dicts(conn, _REQUEST_INCIDENTS, None, {"_otlp_request_keys": keys})
    except duckdb.CatalogException:  # a store from before incidents (migration 11); any other failure
        return  # fails the batch, which is read again, rather than sending its requests without them
    by_key = {(r["pid"], r["trace_id"]): r for r in requests}
    for row in found:
        by_key[(row["pid"], row["trace_id"])]["incidents"].append(row)


def _execute(conn: duckdb.DuckDBPyConnection, sql: str, params, tables: dict[str, pa.Table] | None = None):
    """conn.execute(sql, params), with the batch's Arrow `tables` readable by their names (_otlp_passes,
    _otlp_event_passes, _otlp_request_keys). DuckDB's replacement scan finds a name its catalog lacks
    among the locals of the frame that calls execute, so each is bound to a local of that name here.
    Registering them as views instead (register + unregister) cost ~0.45 ms a table a batch on this
    project's VM, for a read or two. So `conn` must hand execute over as DuckDB's own method (a
    connection, or StoreCursor, whose __getattr__ does): a Python wrapper's frame would hide them."""
    tables = tables or {}
    _otlp_passes = tables.get("_otlp_passes")  # noqa: F841 (read by the replacement scan)
    _otlp_event_passes = tables.get("_otlp_event_passes")  # noqa: F841
    _otlp_request_keys = tables.get("_otlp_request_keys")  # noqa: F841
    return conn.execute(sql, params) if params else conn.execute(sql)


def _arrow(conn: duckdb.DuckDBPyConnection, sql: str, params: dict, tables=None) -> pa.Table:
    """A result as an Arrow table from DB-API's execute. DuckDB advises the relation API (conn.sql)
    instead, as it saves a copy of the rows; but it binds the statement once more first to learn its
    schema, and for a batch's few thousand rows that costs more than the copy: the events query 11.3
    -> 8.3 ms, the steps' 3.9 -> 3.2 ms on this project's VM. Its warning is silenced for this module."""
    return _execute(conn, sql, params, tables).to_arrow_table()


warnings.filterwarnings(
    "ignore", "Arrow output on a DB-API result makes an extra copy", UserWarning, __name__
)


def _dicts(conn: duckdb.DuckDBPyConnection, sql: str, params, tables=None) -> list[dict]:
    """A small result as one dict per row. execute + fetchall: for a few hundred rows a third of the CPU
    of a relation turned into Arrow (measured: ~0.7 vs ~2.3 ms a statement on this project's VM)."""
    rows = _execute(conn, sql, params, tables).fetchall()
    names = [d[0] for d in conn.description]
    return [dict(zip(names, row, strict=True)) for row in rows]


_CURSOR_COLUMNS = ("pid", "t_start_ns", "step_seq", "batch_row", "ingest_seq")


_TEXTS = ("tenant", "session", "model_id")  # a request's: the first non-empty of its steps'
_WITH_NULLS = pc.ScalarAggregateOptions(skip_nulls=False)


def _fold(
    table: pa.Table,
) -> tuple[dict[tuple[int, str], dict], dict[int, tuple[int, int, int, int, int]]]:
    """The batch's steps folded per request (pid, trace_id), in order of first appearance; and per pid
    the cursor row to commit: the largest (t_start_ns, step_seq, batch_row) key, the steps counted, the
    last ingest_seq.

    Column-wise (one Arrow group-by, a lexsort): a Python pass over the rows cost ~8 us a step, the
    exporter's largest per-span cost after the encoding. A tenant, session or model is the first
    non-empty one of the request's rows; a loss counts where it is a number (NaN: no target)."""
    folded: dict[tuple[int, str], dict] = {}
    advance: dict[int, tuple[int, int, int, int, int]] = {}
    n = table.num_rows
    if not n:
        return folded, advance
    keep = None  # a step of a request with a request_seq: its request span comes from request_events
    if "request_seq" in table.column_names:
        keep = pc.fill_null(pc.equal(table.column("request_seq"), 0), True)
    loss = table.column("loss")
    has_loss = pc.fill_null(pc.invert(pc.is_nan(loss)), False)

    def text(name: str):  # a column of NULLs only has the null type, which group-by cannot aggregate
        column = table.column(name)
        return column.cast(pa.string()) if pa.types.is_null(column.type) else column

    def non_empty(name: str):  # "" as NULL, so that "first" skips it
        column = text(name)
        return pc.if_else(pc.equal(column, ""), pa.scalar(None, column.type), column)

    rows = pa.table(
        {
            "pid": table.column("pid"),
            "trace_id": table.column("trace_id"),
            "order": pa.array(np.arange(n)),
            **{name: non_empty(name) for name in _TEXTS},
            **{f"{name}_raw": text(name) for name in _TEXTS},
            "t_start_ns": table.column("t_start_ns"),
            "t_end_ns": table.column("t_end_ns"),
            "loss": pc.if_else(has_loss, pc.cast(loss, pa.float64()), 0.0),
            "has_loss": pc.cast(has_loss, pa.int64()),
        }
    )
    if keep is not None:
        rows = rows.filter(keep)
    if rows.num_rows:
        grouped = (
            rows.group_by(["pid", "trace_id"], use_threads=False)
            .aggregate(
                [
                    ("order", "min"),
                    *((name, "first") for name in _TEXTS),
                    *((f"{name}_raw", "last", _WITH_NULLS) for name in _TEXTS),
                    ("t_start_ns", "min"),
                    ("t_end_ns", "max"),
                    ("order", "count"),
                    ("loss", "sum"),
                    ("has_loss", "sum"),
                ]
            )
            .sort_by("order_min")
        )
        # the first non-empty value, else the last row's (NULL or ""), as `agg or value` row by row gave
        texts = [
            pc.coalesce(grouped.column(f"{name}_first"), grouped.column(f"{name}_raw_last")).to_pylist()
            for name in _TEXTS
        ]
        times = [grouped.column(c).to_pylist() for c in ("t_start_ns_min", "t_end_ns_max")]
        columns = [grouped.column("pid").to_pylist(), grouped.column("trace_id").to_pylist(), *texts, *times]
        counts = [grouped.column(c).to_pylist() for c in ("order_count", "loss_sum", "has_loss_sum")]
        for pid, trace, tenant, session, model, t_start, t_end, tokens, loss_sum, loss_count in zip(
            *columns, *counts, strict=True
        ):
            folded[(pid, trace)] = {
                "pid": pid,
                "trace_id": trace,
                "tenant": tenant,
                "session": session,
                "model_id": model,
                "t_start_ns": t_start,
                "t_end_ns": t_end,
                "tokens": tokens,
                "loss_sum": float(loss_sum or 0.0),
                "loss_count": int(loss_count or 0),
                "exported": False,
            }
    pid, t_start, step_seq, batch_row, ingest_seq = (
        table.column(name).to_numpy().astype(np.int64) for name in _CURSOR_COLUMNS
    )
    order = np.lexsort((batch_row, step_seq, t_start, pid))  # by pid, then the cursor key
    pid_sorted = pid[order]
    last = np.flatnonzero(np.r_[pid_sorted[1:] != pid_sorted[:-1], True])
    first = np.r_[0, last[:-1] + 1]
    newest = np.maximum.reduceat(ingest_seq[order], first)
    top = order[last]
    for p, t, s, b, count, seq in zip(
        pid[top].tolist(),
        t_start[top].tolist(),
        step_seq[top].tolist(),
        batch_row[top].tolist(),
        (last - first + 1).tolist(),
        newest.tolist(),
        strict=True,
    ):
        advance[p] = (t, s, b, count, seq)
    return folded, advance


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
