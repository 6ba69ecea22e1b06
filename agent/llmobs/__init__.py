"""llmobs: token-level observability of PyTorch LLM workloads.

Inside the workload: `import llmobs; llmobs.instrument(model)` or `with llmobs.request(...)`.
The agent side (eBPF, store, export) lives in submodules and is never imported from here, so the
workload pays only for what it uses.
"""

__version__ = "0.1.0"

_LAZY = {
    "instrument": ("llmobs.publisher.hf", "instrument"),
    # llmobs.shadow(primary, shadow, variant=...): another model scores the primary's tokens (docs/compare.md)
    "shadow": ("llmobs.publisher.shadow", "shadow"),
    "request": ("llmobs.publisher.request", "request"),
    "context": ("llmobs.publisher.request", "context"),
    "AttentionEntropy": ("llmobs.publisher.attention", "AttentionEntropy"),
    "MlpVariance": ("llmobs.publisher.layers", "MlpVariance"),
    "LayerStreams": ("llmobs.publisher.layers", "LayerStreams"),
    "TrainingOptions": ("llmobs.publisher.training", "TrainingOptions"),
    "Recorder": ("llmobs.publisher.recorder", "Recorder"),
}


_LAZY_MODULES = {
    # llmobs.serving.instrument_manager(manager): continuous-batching engines (docs/serving.md)
    "serving": "llmobs.publisher.hf_serving",
}


def __getattr__(name: str):
    # Lazy: `import llmobs` costs nothing until the workload actually uses the publisher.
    if name in _LAZY_MODULES:
        import importlib

        value = importlib.import_module(_LAZY_MODULES[name])
        globals()[name] = value
        return value
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'llmobs' has no attribute {name!r}")
