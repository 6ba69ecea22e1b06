"""What this host can do: the checks behind `llmobs-agent doctor`, kept apart from its printing.

`run_checks()` runs each check with a time bound and turns every failure into a row, never a crash;
`cpu_profile_ok()` says whether the agent can run at least its CPU probe profile here.
"""

from llmobs.hostcheck.model import Check, Context, Row, Status
from llmobs.hostcheck.runner import CPU_PROFILE_CHECKS, GPU_CHECKS, cpu_profile_ok, default_checks, run_checks

__all__ = [
    "CPU_PROFILE_CHECKS",
    "GPU_CHECKS",
    "Check",
    "Context",
    "Row",
    "Status",
    "cpu_profile_ok",
    "default_checks",
    "run_checks",
]
