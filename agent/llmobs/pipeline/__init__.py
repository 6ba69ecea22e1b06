"""The agent's one-way data path (docs/architecture.md): sources -> Pipeline -> sinks (the store, the
journal) -> {correlate, the OTLP follower}.

- sources.py: ShmSource (token steps from a process's map), AggregateSource (exact kernel totals)
- core.py: Pipeline (fan-out to queued sinks, periodic incremental correlate, flush-everything close)
- correlate.py: the per-step rollup of events and totals onto token steps
- leftovers.py: maps of exited processes, ingested once, then removed
- live.py: LiveStats (the numbers `top` shows) and the snapshot file a running `attach` publishes
- replay_ingest.py, auto_replay.py: a flight-recorder replay's file into the store with its verdict, and
  the automatic replays of flagged tokens (docs/replay.md)
"""

from llmobs.pipeline.core import Pipeline, PipelineSummary
from llmobs.pipeline.live import LiveStats, read_snapshots, snapshot_path
from llmobs.pipeline.sources import AggregateSource, ShmSource

__all__ = [
    "AggregateSource",
    "LiveStats",
    "Pipeline",
    "PipelineSummary",
    "ShmSource",
    "read_snapshots",
    "snapshot_path",
]
