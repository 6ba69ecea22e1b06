"""The store side of served requests' spans (llmobs.otlp.served): request-end rows not yet acknowledged.

Table this module owns: otlp_served_sent (pid, request_seq, t_start_ns, sent_ns): the request spans the
collector acknowledged, recorded in the same transaction as the export cursor (ExportCursor.commit); the
unsent 'end' rows are those without a row here. Bounded: at most `limit` rows a batch.
"""

from __future__ import annotations

import duckdb

DDL = (
    """CREATE TABLE IF NOT EXISTS otlp_served_sent (
        pid INTEGER NOT NULL,
        request_seq BIGINT NOT NULL,
        t_start_ns BIGINT NOT NULL,
        sent_ns BIGINT NOT NULL,
        PRIMARY KEY (pid, request_seq, t_start_ns))""",
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
                  WHERE s.pid = e.pid AND s.request_seq = e.request_seq AND s.t_start_ns = e.t_start_ns)
ORDER BY e.t_end_ns, e.pid, e.request_seq
LIMIT $limit
"""
_MARK = "INSERT OR IGNORE INTO otlp_served_sent VALUES (?, ?, ?, ?)"


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

    def mark_sent(self, rows: list[dict], now_ns: int) -> None:
        """Inside the caller's transaction (ExportCursor.commit)."""
        if rows:
            self.conn.executemany(
                _MARK, [[r["pid"], r["request_seq"], r["t_start_ns"], now_ns] for r in rows]
            )
