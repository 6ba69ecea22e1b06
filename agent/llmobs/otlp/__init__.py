"""OTLP export of the store: traces (request -> token steps -> sampled probe events) and metrics.

Modules, one job each: config (flags > env > file > default), source (the export cursor over the store),
encoder (rows -> OTLP trace protobuf), metrics (cumulative histograms/sums with exemplars), transport
(gRPC or HTTP/protobuf, one try per call), backoff (jittered, interruptible), delivery (the loop that
ties them: bounded, at-least-once, counted). docs/otlp.md documents the mapping and the cursor tables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmobs.otlp.config import OtlpConfig, resolve

if TYPE_CHECKING:
    from llmobs.otlp.delivery import ExportCounters, ExportFailed, OtlpExporter

__all__ = ["ExportCounters", "ExportFailed", "OtlpConfig", "OtlpExporter", "resolve", "start_exporter"]


def __getattr__(name: str):
    """delivery (gRPC, requests, protobuf: ~15 MB resident, ~0.5 s) is imported when an exporter is
    made, not with the package: the daemon reads its [otlp] settings through llmobs.otlp.config on
    every start, exporting or not."""
    if name in ("ExportCounters", "ExportFailed", "OtlpExporter"):
        from llmobs.otlp import delivery

        return getattr(delivery, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_exporter(store, config: OtlpConfig) -> OtlpExporter:
    """Follow a live DuckDBStore from a background thread on its own cursor of the store, given back
    between rounds (for `attach --otlp` and the daemon); call `.shutdown()` on the result before
    closing the store."""
    from llmobs.otlp.delivery import OtlpExporter

    exporter = OtlpExporter(store.cursor(), config, headroom=store.with_headroom)
    exporter.follow_rollups(store)  # the pipeline correlating this store wakes it
    exporter.start()
    return exporter
