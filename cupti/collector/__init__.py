"""llmobs.cupti: the in-process CUPTI collector (cupti-python), switched on by the agent on demand.

This folder is installed as `llmobs.cupti` (see pyproject.toml), never as a top-level `cupti`,
which would shadow NVIDIA's cupti-python module.

`install()` is called by `llmobs.instrument`: where torch sees a CUDA device it registers the
collector as the handler of the control block's CMD_COLLECT_CUPTI; nothing else happens (and
cupti-python is not even imported) until the agent sends that command (`llmobs-agent trace`).
Without CUDA nothing is registered and the writer answers the command with ACK_NO_GPU.
"""

from __future__ import annotations

_collector = None


def install(force: bool = False):
    """Register the collector for CMD_COLLECT_CUPTI if this process can use CUDA; returns it or None.

    Never raises: instrumenting a model must not fail because of the GPU side."""
    global _collector
    if _collector is not None:
        return _collector
    try:
        if not force:
            import torch

            if not torch.cuda.is_available():
                return None
        from llmobs.cupti.collector import CuptiCollector
        from llmobs.shm import layout
        from llmobs.shm.writer import register_command_handler

        collector = CuptiCollector()
        register_command_handler(layout.CMD_COLLECT_CUPTI, collector.handle)
        _collector = collector
        return collector
    except Exception:
        return None


def installed():
    return _collector
