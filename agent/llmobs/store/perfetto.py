"""PerfettoWriter: a time window of the store as Chrome trace-event JSON, which the Perfetto UI opens.

Tracks, per process (pid):
- one track per request (pid, trace id, views.REQUEST_KEY: a served request's steps interleave with
  others' across passes): each token step is a slice, with loss, entropy and the work its
  forward pass did in the slice's args;
- one track per probe: sampled probe events, as slices when they have a duration, else instants;
- off-CPU intervals (sched_switch) as slices on the thread's own track (tid);
- counter tracks from step_rollups: allocations and off-CPU time per forward pass.

Timestamps are CLOCK_MONOTONIC microseconds (the format's unit); `otherData` records the clock and, when
the store has one, the wall-clock offset measured by the agent. The file is written as a stream, so an
export of millions of events never holds them all in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from llmobs.store import schema
from llmobs.store.views import LEGACY_REQUEST_KEY, REQUEST_KEY, REQUEST_SEQ_VERSION

# Synthetic track ids live above Linux's largest pid (2^22) so they never collide with a real tid.
REQUEST_TRACK_BASE = 1 << 22
PROBE_TRACK_BASE = 2 << 22
FETCH_ROWS = 50_000

Progress = Callable[[str, int], None]


@dataclass
class PerfettoStats:
    token_steps: int = 0
    probe_events: int = 0
    off_cpu_intervals: int = 0
    counters: int = 0
    tracks: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.token_steps + self.probe_events + self.off_cpu_intervals + self.counters


def _us(ns: int) -> float:
    return ns / 1000.0


class _Stream:
    """Writes `{"traceEvents": [ e, e, ... ], ...}` one event at a time."""

    def __init__(self, handle):
        self._handle = handle
        self._first = True
        handle.write('{"traceEvents":[\n')

    def event(self, event: dict) -> None:
        if not self._first:
            self._handle.write(",\n")
        self._first = False
        self._handle.write(json.dumps(event, separators=(",", ":"), allow_nan=False))

    def close(self, other: dict) -> None:
        self._handle.write('\n],"displayTimeUnit":"ns","otherData":')
        self._handle.write(json.dumps(other, separators=(",", ":")))
        self._handle.write("}\n")


def _rows(conn: duckdb.DuckDBPyConnection, sql: str, params: list):
    """Yield dict rows in chunks, so a large window streams instead of loading at once."""
    cursor = conn.execute(sql, params)
    names = [d[0] for d in cursor.description]
    while chunk := cursor.fetchmany(FETCH_ROWS):
        for row in chunk:
            yield dict(zip(names, row, strict=True))


def _finite(value):
    """JSON has no NaN: a NaN loss (no target) becomes null."""
    return None if isinstance(value, float) and value != value else value


def _request_key(conn: duckdb.DuckDBPyConnection) -> str:
    """The request key of a token step (views.REQUEST_KEY); a store older than request_seq (opened
    read-only, so not migrated) holds generate() requests only and gets their key."""
    return REQUEST_KEY if schema.current_version(conn) >= REQUEST_SEQ_VERSION else LEGACY_REQUEST_KEY


def write_perfetto(
    conn: duckdb.DuckDBPyConnection,
    path: Path | str,
    since_ns: int | None = None,
    until_ns: int | None = None,
    progress: Progress | None = None,
) -> PerfettoStats:
    lo = since_ns if since_ns is not None else -(1 << 63)
    hi = until_ns if until_ns is not None else (1 << 63) - 1
    stats = PerfettoStats()
    report = progress or (lambda _what, _n: None)
    with open(path, "w", encoding="utf-8") as handle:
        out = _Stream(handle)
        named_pids: set[int] = set()

        def name_process(pid: int, exe: str | None = None) -> None:
            if pid in named_pids:
                return
            named_pids.add(pid)
            out.event(
                {
                    "ph": "M",
                    "name": "process_name",
                    "pid": pid,
                    "tid": 0,
                    "args": {"name": exe or f"pid {pid}"},
                }
            )

        for row in _rows(conn, "SELECT pid, any_value(exe) AS exe FROM processes GROUP BY pid", []):
            name_process(row["pid"], f"{row['exe']} (pid {row['pid']})" if row["exe"] else None)

        # Request tracks and token-step slices, ordered by request so each track is written in one run.
        request_tracks: dict[tuple[int, str, int], int] = {}
        steps_sql = f"""
            SELECT t.*, r.launches, r.allocations, r.alloc_bytes, r.frees, r.off_cpu_ns, r.page_faults,
                   r.compute_calls, r.gpu_ns
            FROM (SELECT *, {_request_key(conn)} AS request_key FROM token_steps
                  WHERE t_end_ns >= ? AND t_start_ns <= ?) t
            LEFT JOIN step_rollups r USING (pid, step_seq)
            ORDER BY t.pid, t.trace_id, t.request_key, t.step
        """
        for row in _rows(conn, steps_sql, [lo, hi]):
            # A request is (pid, trace id, request key): the trace id repeats with the prompt, and a served
            # request's steps interleave with other requests' across passes (views.REQUEST_KEY).
            key = (row["pid"], row["trace_id"], row["request_key"])
            tid = request_tracks.get(key)
            if tid is None:
                name_process(row["pid"])
                tid = request_tracks[key] = REQUEST_TRACK_BASE + len(request_tracks)
                label = f"request {row['trace_id'][:12]} {row['tenant'] or ''}/{row['session'] or ''}".rstrip(
                    "/"
                )
                out.event(
                    {"ph": "M", "name": "thread_name", "pid": row["pid"], "tid": tid, "args": {"name": label}}
                )
                out.event(
                    {
                        "ph": "M",
                        "name": "thread_sort_index",
                        "pid": row["pid"],
                        "tid": tid,
                        "args": {"sort_index": len(request_tracks)},
                    }
                )
            args = {
                k: _finite(row[k])
                for k in (
                    "step_seq",
                    "step",
                    "position",
                    "token_id",
                    "target_id",
                    "loss",
                    "entropy",
                    "target_prob",
                    "target_rank",
                    "latency_ns",
                    "allocations",
                    "alloc_bytes",
                    "frees",
                    "launches",
                    "off_cpu_ns",
                    "page_faults",
                    "compute_calls",
                    "gpu_ns",
                )
            }
            out.event(
                {
                    "ph": "X",
                    "cat": "token",
                    "name": f"token {row['step']}",
                    "pid": row["pid"],
                    "tid": tid,
                    "ts": _us(row["t_start_ns"]),
                    "dur": _us(row["t_end_ns"] - row["t_start_ns"]),
                    "args": args,
                }
            )
            stats.token_steps += 1
            if stats.token_steps % FETCH_ROWS == 0:
                report("token steps", stats.token_steps)
        report("token steps", stats.token_steps)
        stats.tracks["requests"] = len(request_tracks)

        # Sampled probe events; sched_switch intervals go on their thread's track as off-CPU slices.
        probe_tracks: dict[tuple[int, str], int] = {}
        events_sql = """
            SELECT pid, tid, cpu, ts_ns, probe, step_seq, value, duration_ns, sample_ratio, 'mem' AS kind
                FROM mem_events WHERE ts_ns BETWEEN ? AND ?
            UNION ALL SELECT pid, tid, cpu, ts_ns, probe, step_seq, value, duration_ns, sample_ratio, kind
                FROM host_events WHERE ts_ns BETWEEN ? AND ?
            UNION ALL SELECT pid, tid, cpu, ts_ns, probe, step_seq, value, duration_ns, sample_ratio, 'gpu'
                FROM gpu_ops WHERE source = 'ebpf' AND ts_ns BETWEEN ? AND ?
            ORDER BY pid, probe, ts_ns
        """
        named_threads: set[tuple[int, int]] = set()
        for row in _rows(conn, events_sql, [lo, hi] * 3):
            pid = row["pid"]
            name_process(pid)
            args = {
                "step_seq": row["step_seq"],
                "value": row["value"],
                "cpu": row["cpu"],
                "sample_ratio": row["sample_ratio"],
            }
            if row["probe"] == "sched_switch" and row["duration_ns"] > 0:
                tid = row["tid"] or 0
                if (pid, tid) not in named_threads:
                    named_threads.add((pid, tid))
                    out.event(
                        {
                            "ph": "M",
                            "name": "thread_name",
                            "pid": pid,
                            "tid": tid,
                            "args": {"name": f"thread {tid}"},
                        }
                    )
                out.event(
                    {
                        "ph": "X",
                        "cat": "off-cpu",
                        "name": "off-CPU",
                        "pid": pid,
                        "tid": tid,
                        "ts": _us(row["ts_ns"]),
                        "dur": _us(row["duration_ns"]),
                        "args": args,
                    }
                )
                stats.off_cpu_intervals += 1
            else:
                key = (pid, row["probe"])
                tid = probe_tracks.get(key)
                if tid is None:
                    tid = probe_tracks[key] = PROBE_TRACK_BASE + len(probe_tracks)
                    out.event(
                        {
                            "ph": "M",
                            "name": "thread_name",
                            "pid": pid,
                            "tid": tid,
                            "args": {"name": f"probe {row['probe']} ({row['kind']})"},
                        }
                    )
                event = {
                    "cat": row["kind"],
                    "name": row["probe"],
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(row["ts_ns"]),
                    "args": args,
                }
                if row["duration_ns"] > 0:
                    event.update(ph="X", dur=_us(row["duration_ns"]))
                else:
                    event.update(ph="i", s="t")
                out.event(event)
                stats.probe_events += 1
            done = stats.probe_events + stats.off_cpu_intervals
            if done % FETCH_ROWS == 0:
                report("probe events", done)
        report("probe events", stats.probe_events + stats.off_cpu_intervals)
        stats.tracks["probes"] = len(probe_tracks)
        stats.tracks["threads"] = len(named_threads)

        # Per-forward-pass counters: what each step cost, as a line under the slices.
        rollups_sql = """
            SELECT pid, t_start_ns, allocations, off_cpu_ns, launches FROM step_rollups
            WHERE t_end_ns >= ? AND t_start_ns <= ? ORDER BY pid, t_start_ns
        """
        for row in _rows(conn, rollups_sql, [lo, hi]):
            name_process(row["pid"])
            out.event(
                {
                    "ph": "C",
                    "name": "work per step",
                    "pid": row["pid"],
                    "ts": _us(row["t_start_ns"]),
                    "args": {"allocations": row["allocations"], "launches": row["launches"]},
                }
            )
            out.event(
                {
                    "ph": "C",
                    "name": "off-CPU ms per step",
                    "pid": row["pid"],
                    "ts": _us(row["t_start_ns"]),
                    "args": {"off_cpu_ms": row["off_cpu_ns"] / 1e6},
                }
            )
            stats.counters += 2
        report("counters", stats.counters)

        wall = conn.execute(
            "SELECT offset_ns, error_ns FROM clock_fits WHERE clock = 'realtime' ORDER BY ts_ns DESC LIMIT 1"
        ).fetchall()
        other = {
            "clock": "CLOCK_MONOTONIC",
            "exporter": "llmobs-agent",
            "since_ns": since_ns,
            "until_ns": until_ns,
        }
        if wall:
            other["realtime_offset_ns"], other["realtime_error_ns"] = wall[0][0], wall[0][1]
        out.close(other)
    return stats
