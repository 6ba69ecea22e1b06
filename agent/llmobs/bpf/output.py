"""Writes decoded eBPF events and the exact aggregates to Parquet files (until [store] takes them).

Batches go through a bounded queue to a writer thread, so a slow disk never delays the ring drain:
when the queue is full the batch is dropped and counted (the user-side drops the status line shows).

Files for `--out PATH` (PATH ends in .parquet):
  PATH                        the sampled events (columns of records.md: pid, tid, cpu, ts_ns, probe,
                              kind, step_seq, trace_id, value, duration_ns, sample_ratio)
  PATH - .parquet + .aggregates.parquet   exact totals: pid, step_seq, probe, count, sum_value,
                                          sum_duration_ns
  PATH - .parquet + .summary.json         counters, drops, attached and skipped probes, latencies
"""

from __future__ import annotations

import json
import queue
import threading
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmobs.bpf.profiles import PROBES
from llmobs.bpf.records import KINDS, sample_ratios, thinned_ids, trace_runs
from llmobs.dataflow import SinkResult

if TYPE_CHECKING:
    import pyarrow as pa

# pyarrow (~25 MB resident, +18 MB with compute and parquet) is imported when a table is built, not
# with this module: `attach` without --out / --db imports it for companion_paths and write_summary.


@lru_cache(maxsize=1)
def _arrow():
    """(pyarrow, pyarrow.compute, the events' schema, the probe names, the kind names), built once."""
    import pyarrow as pa
    import pyarrow.compute as pc

    schema = pa.schema(
        [
            ("pid", pa.uint32()),
            ("tid", pa.uint32()),
            ("cpu", pa.uint32()),
            ("ts_ns", pa.uint64()),
            ("probe", pa.string()),
            ("kind", pa.string()),
            ("step_seq", pa.uint64()),
            ("trace_id", pa.string()),
            ("value", pa.uint64()),
            ("duration_ns", pa.uint64()),
            ("sample_ratio", pa.uint32()),
        ]
    )
    # each with "unknown" last: a code past the table (a newer BPF program, a damaged record) takes it
    # instead of failing `take`, and with it the whole batch
    probes = pa.array([*(probe.name for probe in PROBES), "unknown"], pa.string())
    return pa, pc, schema, probes, pa.array([*KINDS, "unknown"], pa.string())


@lru_cache(maxsize=1)
def _thinned() -> np.ndarray:
    return thinned_ids(probe.name for probe in PROBES)


def __getattr__(name: str):
    if name == "EVENT_SCHEMA":  # the old module constant, built on first use
        return _arrow()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def companion_paths(out: str | Path) -> tuple[Path, Path, Path]:
    """(events, aggregates, summary) paths for --out."""
    events = Path(out)
    stem = events.with_suffix("") if events.suffix == ".parquet" else events
    return events, Path(f"{stem}.aggregates.parquet"), Path(f"{stem}.summary.json")


def events_table(events: np.ndarray, sample_ratio: int, thin: int = 1) -> pa.Table:
    """Decoded columns of a batch, all built by numpy / Arrow kernels: names via `take` on the probe
    and kind codes, trace ids formatted once per run of equal ids."""
    pa, pc, schema, probe_names, kind_names = _arrow()
    texts, runs = trace_runs(events["trace_id_hi"], events["trace_id_lo"])
    ratios = sample_ratios(events["probe"], events["step_seq"], sample_ratio, thin, _thinned(), "u4")
    return pa.table(
        [
            pa.array(events["pid"]),
            pa.array(events["tid"]),
            pa.array(events["cpu"]),
            pa.array(events["ts_ns"]),
            pc.take(probe_names, pa.array(np.minimum(events["probe"], len(probe_names) - 1))),
            pc.take(kind_names, pa.array(np.minimum(events["kind"], len(kind_names) - 1))),
            pa.array(events["step_seq"]),
            pc.take(pa.array(texts, pa.string()), pa.array(runs)),
            pa.array(events["value"]),
            pa.array(events["duration_ns"]),
            pa.array(ratios),
        ],
        schema=schema,
    )


def aggregates_table(totals: dict[tuple[int, int, int], list[int]]) -> pa.Table:
    import pyarrow as pa

    rows = sorted(totals.items(), key=lambda item: (item[0][0], item[0][2], item[0][1]))
    names = [probe.name for probe in PROBES]
    return pa.table(
        {
            "pid": pa.array([key[0] for key, _ in rows], pa.uint32()),
            "step_seq": pa.array([key[2] for key, _ in rows], pa.uint64()),
            "probe": pa.array([names[key[1]] for key, _ in rows], pa.string()),
            "count": pa.array([value[0] for _, value in rows], pa.uint64()),
            "sum_value": pa.array([value[1] for _, value in rows], pa.uint64()),
            "sum_duration_ns": pa.array([value[2] for _, value in rows], pa.uint64()),
        }
    )


class ParquetEventWriter:
    """A bounded queue and a thread appending event batches to one Parquet file (`attach --out`)."""

    name = "parquet"

    def __init__(self, path: str | Path, sample_ratio: int, max_batches: int = 256, thin: int = 1):
        self.path = Path(path)
        self.sample_ratio = sample_ratio
        self.thin = thin  # probes.thin of the program whose events these are
        self.dropped = 0
        self.written = 0
        self.error: str | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_batches)
        import pyarrow.parquet as pq

        self._writer = pq.ParquetWriter(self.path, _arrow()[2])
        self._thread = threading.Thread(target=self._run, name="llmobs-parquet", daemon=True)
        self._thread.start()

    def submit(self, events: np.ndarray) -> None:
        """Never blocks: a full queue drops the batch and counts it."""
        if not len(events):
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += len(events)

    def _run(self) -> None:
        pending: list[np.ndarray] = []
        rows = 0
        while True:
            try:
                batch = self._queue.get(timeout=0.5)
            except queue.Empty:
                batch = ...  # idle: flush what we have
            if isinstance(batch, np.ndarray):
                pending.append(batch)
                rows += len(batch)
            # row groups of >= 64k rows, or whatever is there after 0.5 s idle / at the end
            if pending and (batch is None or batch is ... or rows >= 65536):
                self._flush(pending, rows)
                pending, rows = [], 0
            if batch is None:
                return

    def _flush(self, pending: list[np.ndarray], rows: int) -> None:
        try:
            self._writer.write_table(events_table(np.concatenate(pending), self.sample_ratio, self.thin))
            self.written += rows
        except Exception as exc:  # a sink never raises into the pipeline; counted instead
            self.error = str(exc)
            self.dropped += rows

    def close(self, timeout: float | None = None) -> SinkResult:
        self._queue.put(None)
        self._thread.join(timeout)
        finished = not self._thread.is_alive()
        if finished:
            self._writer.close()
        return SinkResult(
            self.name, accepted=self.written, dropped={"queue_full_or_failed": self.dropped},
            error=self.error, finished=finished,
        )  # fmt: skip


def write_summary(path: Path, summary: dict) -> None:
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
