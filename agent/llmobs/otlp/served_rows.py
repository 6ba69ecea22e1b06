"""The store side of served requests' spans (llmobs.otlp.served): request-end rows not yet acknowledged,
and on a final flush the requests still unfinished.

Table this module owns: otlp_served_sent (pid, request_seq, t_start_ns, sent_ns, t_end_ns, unfinished):
the request spans the collector acknowledged, recorded in the same transaction as the export cursor
(ExportCursor.commit). A finished request's row has its end row's t_start_ns (arrival) and t_end_ns; the
unsent 'end' rows are those without one. An unfinished request's span (sent by a final flush: detach or
a one-shot export, while the request has token steps but no end row) is marked `unfinished`, keyed by its
first step's start and covering up to its last step's end: a later final flush sends it again only if
more of its steps arrived, and its end row, once it comes, is sent as usual and drops the mark. Bounded:
at most `limit` rows a batch. Pruned with the export cursor (ExportCursor.prune).
"""

from __future__ import annotations

import duckdb

DDL = (
    """CREATE TABLE IF NOT EXISTS otlp_served_sent (
        pid INTEGER NOT NULL,
        request_seq BIGINT NOT NULL,
        t_start_ns BIGINT NOT NULL,
        sent_ns BIGINT NOT NULL,
        t_end_ns BIGINT,
        unfinished BOOLEAN DEFAULT false,
        PRIMARY KEY (pid, request_seq, t_start_ns))""",
    # a table from before unfinished spans: its rows are finished requests' (t_end_ns NULL: unknown)
    "ALTER TABLE otlp_served_sent ADD COLUMN IF NOT EXISTS t_end_ns BIGINT",
    "ALTER TABLE otlp_served_sent ADD COLUMN IF NOT EXISTS unfinished BOOLEAN DEFAULT false",
)
_COLUMNS = (
    "pid, request_seq, request_id, trace_id, tenant, session, model_id, t_start_ns, t_scheduled_ns,"
    " t_first_token_ns, t_last_token_ns, t_end_ns, queue_ns, ttft_ns, tpot_ns, prompt_tokens,"
    " prefill_tokens, decoded_tokens, kv_blocks, prefix_hit_tokens, finish_reason"
)
_CONTEXT = (
    "coalesce(trace_from_caller, false) AS trace_from_caller,"
    " coalesce(parent_span_id, '') AS parent_span_id, coalesce(prompt_hash, '') AS prompt_hash"
)
_NO_CONTEXT = "false AS trace_from_caller, '' AS parent_span_id, '' AS prompt_hash"
_PENDING = """
SELECT {columns}, {context} FROM request_events e
WHERE e.kind = 'end' AND e.t_end_ns <= $before
  AND NOT EXISTS (SELECT 1 FROM otlp_served_sent s
                  WHERE s.pid = e.pid AND s.request_seq = e.request_seq AND s.t_start_ns = e.t_start_ns
                    AND NOT coalesce(s.unfinished, false))
ORDER BY e.t_end_ns, e.pid, e.request_seq
LIMIT $limit
"""
# Served requests with token steps (up to ingest_seq $upto: the steps exported with this batch or before)
# and no end row: the engine had not finished them when the agent detached or the one-shot export ran.
# Their step spans point at served_span_id(pid, trace_id, request_seq); this row gives it its span, built
# from the steps: first step's start to last step's end, the tokens generated so far. What only the end
# row holds stays out (arrival, prompt tokens, queue/TTFT/TPOT, finish reason, and the caller's parent
# span id, which reaches the store on request_events rows only). An end row ending after the request's
# first step is its end (request_seq is per process: a pid reused by a process whose request numbers
# start again ended its requests before this one's steps began).
_UNFINISHED = """
WITH open AS (
    SELECT pid, request_seq, trace_id, min(t_start_ns) AS t_start_ns, max(t_end_ns) AS t_end_ns,
           count(*)::INTEGER AS decoded_tokens, max(coalesce(request_id, '')) AS request_id,
           max(tenant) AS tenant, max(session) AS session, max(model_id) AS model_id
    FROM token_steps WHERE coalesce(request_seq, 0) <> 0 AND coalesce(ingest_seq, 0) <= $upto
    GROUP BY pid, request_seq, trace_id
)
SELECT o.*, true AS unfinished FROM open o
WHERE NOT EXISTS (SELECT 1 FROM request_events e
                  WHERE e.kind = 'end' AND e.pid = o.pid AND e.request_seq = o.request_seq
                    AND e.t_end_ns >= o.t_start_ns)
  AND NOT EXISTS (SELECT 1 FROM otlp_served_sent s
                  WHERE s.unfinished AND s.pid = o.pid AND s.request_seq = o.request_seq
                    AND s.t_start_ns = o.t_start_ns AND s.t_end_ns >= o.t_end_ns)
ORDER BY o.t_end_ns, o.pid, o.request_seq
LIMIT $limit
"""
_MARK = (
    "INSERT OR IGNORE INTO otlp_served_sent (pid, request_seq, t_start_ns, sent_ns, t_end_ns, unfinished)"
    " VALUES (?, ?, ?, ?, ?, false)"
)
# The end row's span supersedes an unfinished one of the same request (first step after its arrival).
_DROP_UNFINISHED = """
DELETE FROM otlp_served_sent WHERE unfinished AND pid = ? AND request_seq = ? AND t_start_ns BETWEEN ? AND ?
"""
_MARK_UNFINISHED = (
    "INSERT OR REPLACE INTO otlp_served_sent (pid, request_seq, t_start_ns, sent_ns, t_end_ns, unfinished)"
    " VALUES (?, ?, ?, ?, ?, true)"
)
# Marks whose rows retention removed, by ExportCursor.prune's rule (older than anything left): a finished
# mark once its arrival is before every end row left (its own end row is gone, so it is never pending
# again); an unfinished one once its last step ended before every token step left (its steps are gone).
# An empty table deletes nothing (coalesce 0), as there.
_PRUNE = """
DELETE FROM otlp_served_sent WHERE
    (NOT coalesce(unfinished, false)
     AND t_start_ns < (SELECT coalesce(min(t_start_ns), 0) FROM request_events WHERE kind = 'end'))
    OR (unfinished AND t_end_ns < (SELECT coalesce(min(t_start_ns), 0) FROM token_steps))
"""


class ServedRequests:
    """Reads the unsent request-end rows of a store and records the acknowledged ones."""

    def __init__(self, conn: duckdb.DuckDBPyConnection):
        self.conn = conn
        tables = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        self.enabled = "request_events" in tables  # a store older than migration 8 has none
        if not self.enabled:
            return
        for statement in DDL:
            conn.execute(statement)
        stored = {
            r[0]
            for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = 'request_events'"
            ).fetchall()
        }
        context = _CONTEXT if "trace_from_caller" in stored else _NO_CONTEXT  # before migration 10
        self._pending = _PENDING.format(columns=_COLUMNS, context=context)

    def pending(self, limit: int, before_ns: int | None = None) -> list[dict]:
        """Up to `limit` request-end rows whose span is not acknowledged yet, oldest end first."""
        if not self.enabled or limit <= 0:
            return []
        params = {"limit": limit, "before": before_ns if before_ns is not None else (1 << 62)}
        rows = self.conn.execute(self._pending, params).fetchall()
        names = [d[0] for d in self.conn.description]
        return [dict(zip(names, row, strict=True)) for row in rows]

    def unfinished(self, limit: int, upto_seq: int) -> list[dict]:
        """Up to `limit` requests with token steps (ingest_seq <= `upto_seq`) and no end row whose
        unfinished span has not gone out yet, or went out before more of their steps arrived."""
        if not self.enabled or limit <= 0:
            return []
        rows = self.conn.execute(_UNFINISHED, {"limit": limit, "upto": upto_seq}).fetchall()
        names = [d[0] for d in self.conn.description]
        return [dict(zip(names, row, strict=True)) for row in rows]

    def mark_sent(self, rows: list[dict], now_ns: int) -> None:
        """Inside the caller's transaction (ExportCursor.commit)."""
        if rows:
            self.conn.executemany(
                _MARK, [[r["pid"], r["request_seq"], r["t_start_ns"], now_ns, r["t_end_ns"]] for r in rows]
            )
            self.conn.executemany(
                _DROP_UNFINISHED, [[r["pid"], r["request_seq"], r["t_start_ns"], r["t_end_ns"]] for r in rows]
            )

    def mark_unfinished(self, rows: list[dict], now_ns: int) -> None:
        """Inside the caller's transaction: the unfinished spans sent, each up to its last step's end."""
        if rows:
            self.conn.executemany(
                _MARK_UNFINISHED,
                [[r["pid"], r["request_seq"], r["t_start_ns"], now_ns, r["t_end_ns"]] for r in rows],
            )

    def prune(self) -> int:
        """Forget sent marks whose rows retention removed (see _PRUNE); the rows deleted."""
        if not self.enabled:
            return 0
        return self.conn.execute(_PRUNE).fetchall()[0][0]
