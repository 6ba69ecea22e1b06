"""The project's own PyTorch workloads: real models instrumented with llmobs, run as the agent's targets.

    python -m llmobs.workloads [--model tiny|smollm2] ...   generate tokens (`llmobs-agent demo` runs it)
    python -m llmobs.workloads.train ...                     a tiny GPT-2 training loop
    python -m llmobs.workloads.serve ...                     an OpenAI-compatible server (transformers serve)
    python -m llmobs.workloads.clients --base-url URL ...    concurrent openai clients of two tenants

Workload side: these modules import torch, transformers and the publisher, so the agent's commands
import them only when they run one (never at module import time). Nothing is imported here.
"""
