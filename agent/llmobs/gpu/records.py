"""The agent side of CUPTI on demand: read the map's CUPTI ring, join its records to token steps,
summarise them per step, and turn them into store rows.

Records in the ring are already on CLOCK_MONOTONIC and carry the token step's step_seq (the CUSTOM2
external correlation the collector pushed), so the join with token steps is an equality on
(pid, step_seq); records with step 0 ran outside any step (or their correlation was never seen).
The collector's marker records (llmobs.cupti.protocol) travel in the same ring: MARK_STATUS says why a
collection was refused, MARK_CLOCK gives the clock fit, MARK_END says everything has been written.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from llmobs.cupti import protocol as p
from llmobs.shm import layout


@dataclass
class CuptiCapture:
    """What a trace read from the ring: activity records, markers, and what it could not read."""

    records: list = field(default_factory=list)  # np.void records of layout.CUPTI_RECORD, in order
    statuses: list[tuple[int, int, int]] = field(default_factory=list)  # (status, step_seq, reason hash)
    clock: p.ClockMark | None = None
    end: p.EndMark | None = None
    lost: int = 0
    corrupt: int = 0

    def add(self, ring_read) -> None:
        """Fold one reader.RingRead of the CUPTI ring in."""
        self.lost += ring_read.lost
        self.corrupt += ring_read.corrupt
        for rec in ring_read.records:
            kind = int(rec["kind"])
            if kind == p.MARK_STATUS:
                self.statuses.append((int(rec["device_id"]), int(rec["step_seq"]), int(rec["name_hash"])))
            elif kind == p.MARK_CLOCK:
                self.clock = p.ClockMark.from_record(rec)
            elif kind == p.MARK_END:
                self.end = p.EndMark.from_record(rec)
            elif self.end is None:  # records after the end belong to a later collection
                self.records.append(rec)

    def array(self) -> np.ndarray:
        if not self.records:
            return np.zeros(0, layout.CUPTI_RECORD.dtype)
        return np.array(self.records, dtype=layout.CUPTI_RECORD.dtype)


@dataclass
class StepGpu:
    step_seq: int
    kernels: int = 0
    gpu_ns: int = 0  # kernels + memcpy + memset device time
    kernel_ns: int = 0
    memcpy: int = 0
    api_calls: int = 0
    launches: int = 0  # runtime/driver launch API calls (what an eBPF uprobe on the launch sees)
    trace_id: str = ""
    tokens: int = 0


@dataclass
class KernelStat:
    name: str
    count: int
    total_ns: int

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0


@dataclass
class TraceSummary:
    steps: list[StepGpu]
    top_kernels: list[KernelStat]
    records: int
    kernels: int
    joined: int  # records whose step is a token step read from the map
    untracked: int  # records with step 0
    unjoined: int  # records with a step that has no token step (yet) in what was read


def is_launch(name: str) -> bool:
    """Kernel-launch API calls (runtime or driver), the ones the cuda eBPF profile counts."""
    return "LaunchKernel" in name or name.startswith(("cudaLaunch", "cuLaunch"))


def summarize(records: np.ndarray, names: dict[int, str], steps: dict, top: int = 10) -> TraceSummary:
    """Per-step kernel counts and GPU time, and the top kernels by total time.

    `steps` holds token-step columns (step_seq, trace_id, ... as ShmReader.read_steps returns)."""
    step_trace: dict[int, str] = {}
    tokens: dict[int, int] = defaultdict(int)
    for seq, trace in zip(np.asarray(steps["step_seq"]).tolist(), steps["trace_id"], strict=True):
        step_trace.setdefault(seq, trace)
        tokens[seq] += 1
    per_step: dict[int, StepGpu] = {}
    kernels: dict[int, list[int]] = {}
    joined = untracked = unjoined = n_kernels = 0
    for rec in records:
        seq, kind = int(rec["step_seq"]), int(rec["kind"])
        dur = max(0, int(rec["end_ns"]) - int(rec["start_ns"]))
        if seq == 0:
            untracked += 1
        elif seq in step_trace:
            joined += 1
        else:
            unjoined += 1
        s = per_step.get(seq)
        if s is None:
            s = per_step[seq] = StepGpu(seq, trace_id=step_trace.get(seq, ""), tokens=tokens.get(seq, 0))
        if kind in p.KERNEL_KINDS:
            s.kernels += 1
            s.kernel_ns += dur
            n_kernels += 1
            k = kernels.setdefault(int(rec["name_hash"]), [0, 0])
            k[0] += 1
            k[1] += dur
        if kind in p.DEVICE_KINDS:
            s.gpu_ns += dur
        if kind == p.KIND_MEMCPY:
            s.memcpy += 1
        if kind in p.API_KINDS:
            s.api_calls += 1
            if is_launch(names.get(int(rec["name_hash"]), "")):
                s.launches += 1
    top_list = sorted(
        (KernelStat(names.get(h, f"<kernel {h:016x}>"), c, t) for h, (c, t) in kernels.items()),
        key=lambda k: (-k.total_ns, k.name),
    )[:top]
    ordered = [per_step[k] for k in sorted(per_step)]
    return TraceSummary(ordered, top_list, len(records), n_kernels, joined, untracked, unjoined)


def gpu_ops_rows(pid: int, records: np.ndarray, names: dict[int, str], steps: dict) -> dict:
    """Columns for the store's gpu_ops table (source 'cupti'), each record tagged with its step's
    trace id. Device records (kernels, copies, memsets) carry gpu_start_ns/gpu_end_ns, which the
    rollups sum into gpu_ns; API records leave them NULL so nothing is counted twice."""
    n = len(records)
    trace_of: dict[int, str] = {}
    for seq, trace in zip(np.asarray(steps["step_seq"]).tolist(), steps["trace_id"], strict=True):
        trace_of.setdefault(seq, trace)
    kind = records["kind"].astype(np.int64)
    start = records["start_ns"].astype(np.int64)
    end = records["end_ns"].astype(np.int64)
    seq = records["step_seq"].astype(np.int64)
    device = np.isin(kind, list(p.DEVICE_KINDS))
    api = np.isin(kind, list(p.API_KINDS))
    dev_id = records["device_id"].astype(np.int64)
    return {
        "pid": np.full(n, pid, np.int32),
        "ts_ns": start,
        "probe": [f"cupti_{p.KIND_NAMES.get(k, str(k))}" for k in kind.tolist()],
        "step_seq": seq,
        "trace_id": [trace_of.get(s, "") for s in seq.tolist()],
        "duration_ns": np.maximum(end - start, 0),
        "source": ["cupti"] * n,
        "name": [names.get(h, "") for h in records["name_hash"].tolist()],
        "correlation_id": records["correlation_id"].astype(np.int64),
        "external_id": [s if s else None for s in seq.tolist()],
        "device_id": [
            None if a or d == p.NO_DEVICE else d for a, d in zip(api.tolist(), dev_id.tolist(), strict=True)
        ],  # fmt: skip
        "stream_id": [
            None if a else s for a, s in zip(api.tolist(), records["stream_id"].tolist(), strict=True)
        ],  # fmt: skip
        "gpu_start_ns": [int(s) if d else None for s, d in zip(start.tolist(), device.tolist(), strict=True)],
        "gpu_end_ns": [int(e) if d else None for e, d in zip(end.tolist(), device.tolist(), strict=True)],
    }


def steps_in(columns: dict, first: int, last: int) -> dict:
    """The token-step columns whose step_seq lies in [first, last]."""
    seq = np.asarray(columns["step_seq"])
    return select_rows(columns, (seq >= first) & (seq <= last))


def select_rows(columns: dict, keep: np.ndarray) -> dict:
    """The rows of `columns` (numpy arrays or lists, as ShmReader.read_steps returns) where `keep`."""
    idx = np.flatnonzero(keep)
    return {k: (v[keep] if isinstance(v, np.ndarray) else [v[i] for i in idx]) for k, v in columns.items()}
