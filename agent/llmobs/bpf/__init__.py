"""The eBPF probe layer: probe profiles, library and symbol resolution, the BPF program, the ring
buffer consumer, the exact per-step aggregates, and the attach session that ties them together."""
