"""The overhead governor (probe costs calibrated at start, hit rates while running, shedding and
restoring uprobes to keep a workload's estimated slowdown under a budget) and the agent's own
telemetry (events, drops, export failures, CPU, RSS). See docs/governor.md."""

from llmobs.governor.governor import DEFAULT_BUDGET, Decision, Governor
from llmobs.governor.telemetry import SelfTelemetry

__all__ = ["DEFAULT_BUDGET", "Decision", "Governor", "SelfTelemetry"]
