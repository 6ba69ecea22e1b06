"""The agent's GPU side (the workload side is llmobs.cupti, the in-process collector).

- records.py: CUPTI records read from a map's ring: the capture, the per-step summary, gpu_ops rows
- tracer.py: one `trace`: ask the collector through the control block, read the ring until MARK_END
- cupti_source.py: a finished trace as a Source of the pipeline (gpu_ops + the token steps it joined)
- nvml.py: NvmlSampler, device and per-process utilisation and memory read from NVML
- nvml_source.py: NvmlSource, the sampler as a live Source of gpu_samples rows for tracked pids
"""
