"""The shared-memory tensor map: the ABI between an instrumented workload and the agent.

`layout` is the single definition of every byte (it generates the numpy views and bpf/c/llmobs_abi.h),
`writer` is the workload side, `reader` the agent side. See docs/shm-abi.md for the spec.
"""
