"""The agent runtime: one Agent (runtime/agent.py) behind attach, demo and run.

It owns the drain of the BPF ring, the routing of events to each target's pipeline, the overhead
governor's tick, the self-telemetry, the NVML source and the OTLP exporter's lifetime. The interfaces
its parts implement (Source, Sink, CompositeSink) are in llmobs.dataflow.
"""

from llmobs.runtime.agent import DRAIN_PERIOD_S, SLOW_TICK_S, Agent, Detached, Target, Task

__all__ = ["DRAIN_PERIOD_S", "SLOW_TICK_S", "Agent", "Detached", "Target", "Task"]
