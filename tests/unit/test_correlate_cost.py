"""correlate's cost when there is nothing to roll up: counted in rows the event-table scans produce
(DuckDB's own profile of every statement correlate runs), never in seconds.

Why: the soak (docs/reliability.md) attached the agent to a process without an llmobs map for 30 minutes;
every incremental correlate scanned the window's events to produce nothing, and the final one at
detach took 114 s over 90 M untagged events.
"""

from __future__ import annotations

import json

import pytest
from llmobs.pipeline.correlate import correlate
from llmobs.store import DuckDBStore

PID = 4242
EVENTS = 400_000  # untagged alloc/free events, 10 us apart: 4 s, longer than correlate's 1 s tag slack
GAP_NS = 10_000
T0 = 10_000_000_000
EVENT_TABLES = ("mem_events", "host_events", "gpu_ops")


class _ProfiledConnection:
    """Runs each statement on a real DuckDB cursor and adds up the rows its event-table scans read."""

    def __init__(self, conn):
        self.conn = conn
        self.event_rows_scanned = 0
        self.statements = 0
        conn.execute("SET enable_profiling = 'no_output'")

    def execute(self, sql, params=None):
        rows = self.conn.execute(sql, params).fetchall() if params else self.conn.execute(sql).fetchall()
        self.statements += 1
        profile = json.loads(self.conn.get_profiling_information(format="json"))
        self.event_rows_scanned += _scanned(profile.get("operator", []))
        return _Result(rows)

    def __getattr__(self, name):  # sql (the shares' fetch: no event table), register, unregister
        return getattr(self.conn, name)


class _Result:
    def __init__(self, rows):
        self.rows = rows

    def fetchall(self):
        return self.rows


def _scanned(operators, tables=EVENT_TABLES) -> int:
    """Rows the plan's scans of `tables` read."""
    total = 0
    for op in operators:
        table = str(op.get("extra_info", {}).get("Table", "")).rsplit(".", 1)[-1]  # catalog.schema.table
        if op.get("type") == "TABLE_SCAN" and table in tables:
            total += int(op.get("rows_scanned", op.get("intermediate_rows", 0)))
        total += _scanned(op.get("children", []), tables)
    return total


@pytest.fixture
def store(tmp_path):
    with DuckDBStore(tmp_path / "cost.duckdb") as s:
        s.connection.execute(
            "INSERT INTO mem_events (pid, ts_ns, probe, step_seq, value, duration_ns) "
            f"SELECT {PID}, {T0} + i * {GAP_NS}, "
            "CASE WHEN i % 2 = 0 THEN 'alloc_cpu' ELSE 'free_cpu' END, 0, 4096, 500 "
            f"FROM range({EVENTS}) r(i)"
        )
        yield s


def _add_pass(store, step_seq: int, t_start: int, t_end: int) -> None:
    store.connection.execute(
        "INSERT INTO token_steps (pid, step_seq, trace_id, step, t_start_ns, t_end_ns, latency_ns) "
        "VALUES (?, ?, 'ab', 0, ?, ?, ?)",
        [PID, step_seq, t_start, t_end, t_end - t_start],
    )


def test_no_token_step_in_the_window_scans_no_event(store):
    conn = _ProfiledConnection(store.connection.cursor())
    stats = correlate(conn, since_ns=T0, pid=PID)  # the whole table is in the window: the final-at-close case
    assert (stats.passes, stats.windowed_events, stats.orphan_events, stats.requests) == (0, 0, 0, 0)
    assert conn.statements >= 3 and conn.event_rows_scanned == 0


def test_the_measure_sees_a_scan_when_there_is_a_pass_to_roll_up(store):
    # The control: one forward pass in the middle of the events; the same call now has work to do, and
    # the profile must show the event scan (else the test above could pass with a blind measure).
    middle = T0 + EVENTS // 2 * GAP_NS
    _add_pass(store, step_seq=7, t_start=middle, t_end=middle + 100 * GAP_NS)  # 100 events fall inside it
    conn = _ProfiledConnection(store.connection.cursor())
    stats = correlate(conn, since_ns=T0, pid=PID)
    assert stats.passes == 1 and stats.windowed_events == 100
    assert conn.event_rows_scanned >= 100


def test_final_report_covers_the_session_while_only_the_tail_is_rerolled(store):
    # Two passes: one early (rolled up by an earlier run), one in the tail the final run re-rolls.
    early, late = T0 + 500_000_000, T0 + 3_800_000_000
    _add_pass(store, step_seq=1, t_start=early, t_end=early + 10 * GAP_NS)
    _add_pass(store, step_seq=2, t_start=late, t_end=late + 10 * GAP_NS)
    correlate(store.connection, since_ns=T0, pid=PID)
    conn = _ProfiledConnection(store.connection.cursor())
    tail = correlate(conn, since_ns=late - 1_000_000, pid=PID, report_since_ns=T0)
    assert tail.passes == 2 and tail.windowed_events == 20 and tail.requests == 2
    # only the tail's events were read (those from 1 s, the tag slack, before `since` on: ~1.2 of the
    # 4 s, rounded up to DuckDB's row groups of 122,880 rows), not the session's
    assert 0 < conn.event_rows_scanned <= EVENTS // 2


ROW_GROUP = 122_880  # DuckDB's rows per row group: a zone map prunes whole groups


def test_the_requests_refresh_reads_token_steps_from_where_the_windows_requests_begin(tmp_path):
    """A long-attached server's store: 600,000 token steps of 64-step requests, 16 rows a pass. The
    steps before the window were rolled up by an earlier run; an incremental run over the last 2,000
    refreshes their requests from the steps where those requests begin (their rows say where), not from
    the whole table, and leaves the requests a refresh over every step would."""
    steps, rows, span = 600_000, 16, 64
    window = steps - 2_000
    insert = (
        "INSERT INTO token_steps (pid, step_seq, batch_row, trace_id, step, t_start_ns, t_end_ns,"
        " latency_ns, loss) SELECT $pid, 1 + p, i % $rows, md5((p // $span * $rows + i % $rows)::VARCHAR),"
        " p % $span, $t0 + p * 1000, $t0 + p * 1000 + 900, 900, 1.0"
        " FROM (SELECT i, i // $rows AS p FROM range($lo, $hi) r(i))"
    )  # row i is pass i // 16 of request (pass // 64, row), step pass % 64; trace ids random (no zone map)
    params = {"pid": PID, "rows": rows, "span": span, "t0": T0}
    with DuckDBStore(tmp_path / "big.duckdb") as store:
        conn = store.connection
        conn.execute(insert, {**params, "lo": 0, "hi": window})
        correlate(conn, since_ns=0, pid=PID)  # the earlier run: the steps so far
        conn.execute(insert, {**params, "lo": window, "hi": steps})
        since = T0 + window // rows * 1000
        first = conn.execute(
            "SELECT min(t_start_ns) FROM token_steps WHERE trace_id IN"
            " (SELECT trace_id FROM token_steps WHERE t_start_ns >= ?)",
            [since],
        ).fetchall()[0][0]
        assert first < since  # the premise: the window's requests began before it

        profiled = _ProfiledConnection(conn.cursor())
        profiled.token_rows = 0
        execute = profiled.execute

        def counting(sql, params=None):
            result = execute(sql, params)
            if sql.lstrip().startswith("INSERT OR REPLACE INTO requests"):
                profile = json.loads(profiled.conn.get_profiling_information(format="json"))
                profiled.token_rows += _scanned(profile.get("operator", []), ("token_steps",))
            return result

        profiled.execute = counting
        stats = correlate(profiled, since_ns=since, pid=PID)
        incremental = conn.execute("SELECT * FROM requests ORDER BY ALL").fetchall()
        correlate(conn, since_ns=0, pid=PID)  # every step again: the requests it writes
        assert incremental == conn.execute("SELECT * FROM requests ORDER BY ALL").fetchall()
        assert stats.requests == 3 * rows  # the window's 125 passes reach into three requests a row
        tokens = dict(conn.execute("SELECT trace_id, tokens FROM requests").fetchall())
        assert set(tokens.values()) == {span, steps // rows % span}  # whole, and the last one so far
        from_first = conn.execute(
            "SELECT count(*) FROM token_steps WHERE t_start_ns >= ?", [first]
        ).fetchall()
        assert 0 < profiled.token_rows <= from_first[0][0] + 2 * ROW_GROUP < steps  # not the whole table
