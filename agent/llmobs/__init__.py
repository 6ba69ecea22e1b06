"""llmobs: token-level observability of PyTorch LLM workloads.

Inside the workload: `import llmobs; llmobs.instrument(model)` or `with llmobs.request(...)`.
The agent side (eBPF, store, export) lives in submodules and is never imported from here, so the
workload pays only for what it uses.
"""

__version__ = "0.1.0"
