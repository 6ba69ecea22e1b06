"""The agent's one-way data path (DESIGN.md): sources -> correlate -> sinks.

- sources.py: ShmSource (token steps from a process's map), BpfSource (ring events + exact aggregates)
- core.py: Pipeline (fan-out to queued sinks, periodic incremental correlate, flush-everything close)
- live.py: LiveStats (the numbers `top` shows) and the snapshot file a running `attach` publishes
"""

from llmobs.pipeline.core import Pipeline, PipelineSummary
from llmobs.pipeline.live import LiveStats, read_snapshots, snapshot_path
from llmobs.pipeline.sources import BpfSource, ShmSource

__all__ = [
    "BpfSource",
    "LiveStats",
    "Pipeline",
    "PipelineSummary",
    "ShmSource",
    "read_snapshots",
    "snapshot_path",
]
