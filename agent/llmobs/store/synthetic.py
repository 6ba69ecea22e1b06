"""Synthetic but realistically shaped batches, with the column names of notes/records.md.

Used by the tests, the ingest benchmark and anything that needs a store with known contents. Every
generator is deterministic for a seed, vectorised (10 M token steps in seconds), and returns plain
pyarrow Tables exactly as the shm reader and the eBPF decoder hand them over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class ProbeSpec:
    """Events of one probe per token step: `count` tagged events, each of `value` bytes (0 if none)."""

    probe: str
    kind: str
    count: int
    value: int = 0
    duration_ns: int = 0


# A CPU-profile forward pass in miniature: allocations and frees by libc10, one GEMM entry per linear
# layer, a couple of off-CPU intervals and a page fault.
DEFAULT_PROBES = (
    ProbeSpec("alloc_cpu", "mem", 6, value=4096),
    ProbeSpec("free_cpu", "mem", 5),
    ProbeSpec("sgemm_", "compute", 4),
    ProbeSpec("sched_switch", "host", 2, duration_ns=30_000),
    ProbeSpec("page_fault_user", "host", 1),
)


def trace_id_hex(words_hi: np.ndarray, words_lo: np.ndarray) -> list[str]:
    return [f"{hi:016x}{lo:016x}" for hi, lo in zip(words_hi.tolist(), words_lo.tolist(), strict=True)]


def token_steps(
    pid: int,
    requests: int,
    tokens_per_request: int,
    *,
    batch_rows: int = 1,
    start_ns: int = 1_000_000_000_000,
    step_ns: int = 20_000_000,
    gap_ns: int = 1_000_000,
    tenants: tuple[str, ...] = ("acme", "globex"),
    sessions_per_tenant: int = 2,
    model_id: str = "smollm2-135m",
    step_seq_start: int = 1,
    seed: int = 0,
) -> pa.Table:
    """Token steps of `requests` requests decoded `batch_rows` at a time by one process.

    Each forward pass has one step_seq shared by the `batch_rows` requests decoded in it (that is how the
    workload tags work: one bump per forward pass). Passes follow each other `gap_ns` apart.
    """
    rng = np.random.default_rng(seed)
    groups = -(-requests // batch_rows)
    n = requests * tokens_per_request
    request = np.repeat(np.arange(requests), tokens_per_request)
    step = np.tile(np.arange(tokens_per_request), requests)
    group = request // batch_rows
    batch_row = request % batch_rows
    pass_index = group * tokens_per_request + step  # forward passes run group after group
    latency = (step_ns * rng.uniform(0.6, 1.4, size=groups * tokens_per_request)).astype(np.int64)
    pass_start = start_ns + np.concatenate(([0], np.cumsum(latency[:-1] + gap_ns))).astype(np.int64)
    t_start = pass_start[pass_index]
    t_end = t_start + latency[pass_index]
    hi = (rng.integers(1, 2**63, size=requests, dtype=np.int64).astype(np.uint64)) | np.uint64(pid << 16)
    lo = rng.integers(0, 2**63, size=requests, dtype=np.int64).astype(np.uint64)
    trace_ids = np.array(trace_id_hex(hi, lo), dtype=object)
    tenant_index = np.arange(requests) % len(tenants)
    session_index = (np.arange(requests) // len(tenants)) % sessions_per_tenant
    tenant_names = np.array(tenants, dtype=object)
    session_names = np.array(
        [f"{tenants[t]}-s{s}" for t, s in zip(tenant_index, session_index, strict=True)], dtype=object
    )
    prompt_len = 16
    loss = rng.gamma(2.0, 1.0, size=n).astype(np.float32)
    return pa.table(
        {
            "pid": np.full(n, pid, dtype=np.int32),
            "step_seq": (step_seq_start + pass_index).astype(np.int64),
            "trace_id": pa.array(trace_ids[request], type=pa.string()),
            "step": step.astype(np.int32),
            "position": (prompt_len + step).astype(np.int32),
            "token_id": rng.integers(0, 49_152, size=n, dtype=np.int32),
            "target_id": rng.integers(0, 49_152, size=n, dtype=np.int32),
            "loss": loss,
            "entropy": rng.uniform(0.1, 6.0, size=n).astype(np.float32),
            "target_prob": np.exp(-loss).astype(np.float32),
            "target_rank": rng.integers(0, 50, size=n, dtype=np.int32),
            "top1_prob": rng.uniform(0.2, 1.0, size=n).astype(np.float32),
            "latency_ns": (t_end - t_start).astype(np.int64),
            "t_start_ns": t_start.astype(np.int64),
            "t_end_ns": t_end.astype(np.int64),
            "batch_row": batch_row.astype(np.int32),
            "tenant": pa.array(tenant_names[tenant_index[request]], type=pa.string()),
            "session": pa.array(session_names[request], type=pa.string()),
            "model_id": pa.array(np.full(n, model_id, dtype=object), type=pa.string()),
            "kv_len": (prompt_len + step + 1).astype(np.int32),
        }
    )


def forward_passes(steps: pa.Table) -> pa.Table:
    """One row per (pid, step_seq): the window [t_start_ns, t_end_ns) and trace id of its first row."""
    import duckdb

    conn = duckdb.connect()
    conn.register("steps", steps)
    return conn.sql(
        "SELECT pid, step_seq, min(t_start_ns) AS t_start_ns, max(t_end_ns) AS t_end_ns,"
        " arg_min(trace_id, batch_row) AS trace_id FROM steps GROUP BY ALL ORDER BY pid, step_seq"
    ).to_arrow_table()


def events_for_steps(
    steps: pa.Table,
    probes: tuple[ProbeSpec, ...] = DEFAULT_PROBES,
    *,
    untagged: tuple[ProbeSpec, ...] = (),
    sample_ratio: int = 1,
    seed: int = 0,
) -> pa.Table:
    """eBPF events for every forward pass in `steps`: per pass, each probe's `count` events tagged with the
    pass's step_seq, plus each `untagged` probe's events with step_seq 0 (emitted before a tag existed,
    or by a probe that cannot read the cell), all timed strictly inside the pass's window."""
    passes = forward_passes(steps)
    rng = np.random.default_rng(seed)
    parts = []
    for specs, tagged in ((probes, True), (untagged, False)):
        for spec in specs:
            if spec.count == 0:
                continue
            m = passes.num_rows * spec.count
            pid = np.repeat(passes["pid"].to_numpy(), spec.count)
            seq = np.repeat(passes["step_seq"].to_numpy(), spec.count)
            t0 = np.repeat(passes["t_start_ns"].to_numpy(), spec.count)
            t1 = np.repeat(passes["t_end_ns"].to_numpy(), spec.count)
            ts = t0 + (rng.uniform(0.01, 0.99, size=m) * (t1 - t0)).astype(np.int64)
            trace = np.repeat(np.array(passes["trace_id"].to_pylist(), dtype=object), spec.count)
            parts.append(
                pa.table(
                    {
                        "pid": pid.astype(np.int32),
                        "tid": (pid + rng.integers(0, 2, size=m)).astype(np.int32),
                        "cpu": rng.integers(0, 2, size=m).astype(np.int16),
                        "ts_ns": ts.astype(np.int64),
                        "probe": pa.array([spec.probe] * m, type=pa.string()),
                        "kind": pa.array([spec.kind] * m, type=pa.string()),
                        "step_seq": seq.astype(np.int64) if tagged else np.zeros(m, dtype=np.int64),
                        "trace_id": pa.array(trace if tagged else [""] * m, type=pa.string()),
                        "value": np.full(m, spec.value, dtype=np.int64),
                        "duration_ns": np.full(m, spec.duration_ns, dtype=np.int64),
                        "sample_ratio": np.full(m, sample_ratio, dtype=np.int32),
                    }
                )
            )
    if not parts:
        raise ValueError("no events requested")
    return pa.concat_tables(parts).sort_by("ts_ns")


def aggregates_for_steps(steps: pa.Table, probes: tuple[ProbeSpec, ...], scale: int = 1) -> pa.Table:
    """Exact per-(pid, step_seq, probe) aggregates as the per-CPU maps give them: `scale` x the spec."""
    passes = forward_passes(steps)
    rows = {k: [] for k in ("pid", "step_seq", "probe", "count", "sum_value", "sum_duration_ns")}
    for pid, seq in zip(passes["pid"].to_pylist(), passes["step_seq"].to_pylist(), strict=True):
        for spec in probes:
            rows["pid"].append(pid)
            rows["step_seq"].append(seq)
            rows["probe"].append(spec.probe)
            rows["count"].append(spec.count * scale)
            rows["sum_value"].append(spec.count * scale * spec.value)
            rows["sum_duration_ns"].append(spec.count * scale * spec.duration_ns)
    return pa.table(rows)


def cupti_kernels(steps: pa.Table, kernels: tuple[str, ...], durations_ns: tuple[int, ...]) -> pa.Table:
    """CUPTI kernel records (gpu_ops rows) for every forward pass in `steps`: each of `kernels` once per
    pass, with its duration from `durations_ns`, untagged (step_seq 0) but carrying the pass's step_seq
    as the external id, as the in-process collector sets it, so correlate joins them by it."""
    if len(kernels) != len(durations_ns):
        raise ValueError("one duration per kernel")
    passes = forward_passes(steps)
    k, count = len(kernels), passes.num_rows
    n = count * k
    t0 = np.repeat(passes["t_start_ns"].to_numpy(), k)
    return pa.table(
        {
            "pid": np.repeat(passes["pid"].to_numpy().astype(np.int32), k),
            "ts_ns": t0 + 1000,
            "probe": pa.array(["cupti_kernel"] * n),
            "step_seq": np.zeros(n, dtype=np.int64),
            "source": pa.array(["cupti"] * n),
            "name": pa.array(list(kernels) * count),
            "external_id": np.repeat(passes["step_seq"].to_numpy(), k),
            "gpu_start_ns": t0 + 2000,
            "gpu_end_ns": t0 + 2000 + np.tile(np.asarray(durations_ns, dtype=np.int64), count),
        }
    )
