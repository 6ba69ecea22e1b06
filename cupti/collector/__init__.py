"""llmobs.cupti: the in-process CUPTI collector (cupti-python), switched on by the agent on demand.

This folder is installed as `llmobs.cupti` (see pyproject.toml), never as a top-level `cupti`,
which would shadow NVIDIA's cupti-python module.
"""
