"""The two small interfaces every part of the data path is written against: a Source and a Sink.

They sit at the bottom of the layers (docs/architecture.md): bpf, store and gpu sinks and sources
implement them, the pipeline and the runtime use them.

The data flows one way (docs/architecture.md):

    sources (ring, map, CUPTI, NVML) -> Pipeline -> sinks (StoreWriter: the journal, Parquet, ...)
                                                     store -> {correlate, OTLP follower, top}

A Source is polled by the runtime's one loop and never blocks: `poll()` returns one typed Batch or
None. A Sink takes batches and never raises into the pipeline: `submit()` returns at once (a full
queue drops and counts, as the kernel counts ring drops) and `close(timeout)` says what became of
everything it was given. The fan-out to several sinks is itself a Sink (CompositeSink), in the manner
of dynolog's CompositeLogger: the pipeline never knows how many sinks there are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

# A batch is what the store appends: ring records (an EVENT_DTYPE array, decoded by the writer) or a
# mapping {table name: columns} (token_steps, probe_aggregates, layer_streams, gpu_ops, gpu_samples...).
Batch = np.ndarray | Mapping[str, object]


@runtime_checkable
class Source(Protocol):
    """Something the runtime polls: a ring, a map, a CUPTI capture, an NVML sampler."""

    def poll(self) -> Batch | None:
        """What arrived since the last poll, as one batch (None: nothing). Never blocks."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters by name (rows read, and every way rows were lost), for `top` and the summary."""
        ...


@dataclass
class SinkResult:
    """What a sink did with everything it was given, returned by `close`."""

    name: str
    accepted: int = 0  # rows that were taken
    dropped: dict[str, int] = field(default_factory=dict)  # rows lost, by why ("queue_full", ...)
    error: str | None = None  # the last failure, if any
    finished: bool = True  # False: the sink's thread was still working when the timeout ran out

    @property
    def ok(self) -> bool:
        return self.finished and self.error is None and not any(self.dropped.values())

    def __bool__(self) -> bool:
        """Truthy when the sink finished within its timeout (what a caller waiting on close asks)."""
        return self.finished


@runtime_checkable
class Sink(Protocol):
    """Something batches go to. `submit` never blocks and never raises into the pipeline."""

    name: str

    def submit(self, batch: Batch) -> None: ...

    def close(self, timeout: float) -> SinkResult: ...


def _rows(batch: Batch) -> int:
    if isinstance(batch, np.ndarray):
        return len(batch)
    total = 0
    for columns in batch.values():
        if isinstance(columns, np.ndarray):
            total += len(columns)
        elif hasattr(columns, "num_rows"):
            total += columns.num_rows
        elif isinstance(columns, Mapping) and columns:
            total += len(next(iter(columns.values())))
    return total


class CompositeSink:
    """Fans every batch out to its sinks; a failing sink is counted by its name and never stops the
    others (dynolog's CompositeLogger: the fan-out is itself a sink)."""

    name = "composite"

    def __init__(self, sinks: Iterable[Sink] = ()):
        self.sinks: list[Sink] = list(sinks)
        self.failures: dict[str, int] = {}  # sink name -> rows of the batches whose submit raised
        self.last_error: str | None = None

    def add(self, sink: Sink) -> None:
        self.sinks.append(sink)

    def submit(self, batch: Batch) -> None:
        for sink in self.sinks:
            try:
                sink.submit(batch)
            except Exception as exc:  # a sink never raises into the pipeline
                name = getattr(sink, "name", type(sink).__name__)
                self.failures[name] = self.failures.get(name, 0) + _rows(batch)
                self.last_error = f"{name}: {exc}"

    def close(self, timeout: float) -> SinkResult:
        """Closes every sink (each with the whole timeout: they drain in parallel threads of their
        own); the result sums what they accepted and names every drop and failure by sink."""
        result = SinkResult(self.name)
        for sink in self.sinks:
            name = getattr(sink, "name", type(sink).__name__)
            try:
                part = sink.close(timeout)
            except Exception as exc:
                part = SinkResult(name, error=str(exc))
            if isinstance(part, SinkResult):
                result.finished = result.finished and part.finished
                result.accepted += part.accepted
                for why, n in part.dropped.items():
                    result.dropped[f"{name}.{why}"] = n
                result.error = part.error or result.error
        for name, n in self.failures.items():
            result.dropped[f"{name}.submit_failed"] = n
        result.error = result.error or self.last_error
        return result


__all__ = ["Batch", "CompositeSink", "Sink", "SinkResult", "Source"]
