"""What `top` shows for one process, computed from the token steps and exact totals as they stream in,
and the snapshot file through which a running `attach` shares it.

Why a snapshot file: DuckDB admits one writer process and a read-only open of a file that process holds
fails, so `top` cannot read the store while `attach` writes it; and the exact probe totals live in the
attaching agent's BPF maps. `attach` therefore rewrites a small JSON file once a second (atomically,
rename over) under $LLMOBS_RUN_DIR (default /run/llmobs); `top` reads those, and reads a process's map
itself for the token columns when no agent is attached to it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from llmobs import clock, environment
from llmobs.diagnostics.detectors import live_traffic
from llmobs.pipeline.tenant_compute import TenantCompute, run_starts
from llmobs.store.schema import probe_class

DEFAULT_RUN_DIR = Path("/run/llmobs")
WINDOW_S = 10.0  # tokens/s and latency percentiles are over the last WINDOW_S seconds
RECENT_STEPS = 64  # an idle process still shows the latency of its last steps
WORK_STEPS = 256  # per-step work is averaged over the last WORK_STEPS finished steps
MAX_PASSES = 20_000  # forward passes kept for the per-tenant rates (a 10 s window at 2,000 passes/s)
# Token steps kept for the window's figures: the whole WINDOW_S up to ~26k steps/s (a GPU server's rate);
# above it the figures are over the last STEP_RING steps, rated over the span they cover. 28 bytes a step.
STEP_RING = 1 << 18
# Latency percentiles over at most this many of the window's steps, drawn at random (with replacement):
# selecting in 200,000 steps (20k steps/s) cost ~3.5 ms a second; 32,768 put p99 within ~0.1 points of
# rank, and a random draw cannot alias with a batch's period as every k-th step could.
PERCENTILE_STEPS = 1 << 15
STALE_AFTER_S = 5.0  # a snapshot not rewritten for this long belongs to a stuck or killed agent
WORK_CLASSES = ("launch", "alloc", "free", "compute", "offcpu", "fault", "memcpy")


def run_dir() -> Path:
    return Path(os.environ.get(environment.LLMOBS_RUN_DIR) or DEFAULT_RUN_DIR)


def snapshot_path(pid: int, directory: Path | None = None) -> Path:
    return (directory or run_dir()) / f"attach.{pid}.json"


class StepRing:
    """The newest token steps' end, latency, loss and tenant (an interned code) in fixed numpy arrays.

    Why not a deque of tuples: `top`'s figures are recomputed every second over the last WINDOW_S, and
    a Python pass over the window's steps cost the snapshot ~30 ms at 225 steps/s and ~290 ms at 20k
    (where the deque's 100k bound also capped tokens/s at 10k). Here an add is a few slice copies and a
    window is one vectorised mask."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.end = np.zeros(capacity, np.int64)
        self.latency = np.zeros(capacity, np.int64)
        self.loss = np.zeros(capacity, np.float64)
        self.tenant = np.zeros(capacity, np.int32)
        self.added = 0  # steps ever added; the newest is at (added - 1) % capacity

    def __len__(self) -> int:
        return min(self.added, self.capacity)

    def add(self, end, latency, loss, tenant) -> None:
        """Arrays of one length (`tenant` may be one code for all)."""
        n = len(end)
        skip = max(n - self.capacity, 0)  # a batch larger than the ring: its newest steps
        start = (self.added + skip) % self.capacity
        first = min(n - skip, self.capacity - start)
        wraps = n - skip > first
        columns = ((self.end, end), (self.latency, latency), (self.loss, loss), (self.tenant, tenant))
        for ring, values in columns:
            one = isinstance(values, int)  # one value for every step (a batch's one tenant)
            ring[start : start + first] = (
                values if one or not (skip or wraps) else values[skip : skip + first]
            )
            if wraps:
                ring[: n - skip - first] = values if one else values[skip + first :]
        self.added += n

    def oldest_end(self) -> int | None:
        """The end of the oldest step still held, once the ring has overwritten some (else None)."""
        if self.added <= self.capacity:
            return None
        return int(self.end[self.added % self.capacity])

    def newest(self, k: int) -> np.ndarray:
        """Slots of the newest k steps held."""
        k = min(k, len(self))
        return (np.arange(self.added - k, self.added) % self.capacity) if k else np.zeros(0, np.int64)

    def since(self, since_ns: int) -> np.ndarray:
        """Slots of the held steps that ended at or after since_ns."""
        return np.flatnonzero(self.end[: len(self)] >= since_ns)


class LiveStats:
    """Rolling numbers for one pid: tokens/s, per-token latency p50/p99, mean loss, work per step."""

    def __init__(self, pid: int, attached_ns: int | None = None):
        self.pid = pid
        # Probes attach one after another while the process runs: a step that started before the last
        # one attached was only partly seen, so per-step work counts only steps started after this.
        self.attached_ns = attached_ns
        self.tokens = 0
        self.model_id = ""
        self.tenants: set[str] = set()
        self.first_start_ns: int | None = None
        self._steps = StepRing(STEP_RING)
        self._tenant_names: list[str] = []  # a StepRing's tenant code -> tenant ("" untagged)
        self._tenant_codes: dict[str, int] = {}
        self._work: dict[int, dict[str, float]] = {}  # step_seq -> class -> count (offcpu: ns)
        self._starts: dict[int, int] = {}  # step_seq -> t_start_ns of recent steps (for attached_ns)
        # the attaching agent's own state (SelfTelemetry sample + governor state for this pid), set by
        # the agent each second; `top` shows it as a header line
        self.agent: dict | None = None
        # gpu_index -> (ts_ns, SM utilisation %, device memory bytes) of this pid's newest NVML sample
        self._gpu: dict[int, tuple[int, int | None, int | None]] = {}
        # per-tenant compute: recent forward passes' durations shared out by tokens with the store's rule
        self._tenant_compute = TenantCompute(MAX_PASSES)
        self._draw = np.random.default_rng(pid)  # the steps the percentiles are read from (above)

    def add_steps(self, columns: dict) -> None:
        columns = live_traffic(columns)  # a shadow model's scores of tokens already counted are no traffic
        n = len(columns["step_seq"])
        if not n:
            return
        self.tokens += n
        seqs = np.asarray(columns["step_seq"], np.int64)
        starts = np.asarray(columns["t_start_ns"], np.int64)
        if self.first_start_ns is None:
            self.first_start_ns = int(starts.min())
        if self.attached_ns is not None:  # a pass's rows (mostly adjacent) share its start: one entry each
            first = run_starts(seqs)
            self._starts.update(zip(seqs[first].tolist(), starts[first].tolist(), strict=True))
            if len(self._starts) > 4 * WORK_STEPS:
                for step in sorted(self._starts)[: len(self._starts) - 2 * WORK_STEPS]:
                    del self._starts[step]
        if columns["model_id"]:
            self.model_id = columns["model_id"][-1] or self.model_id
        tenants = [t or "" for t in columns["tenant"]]
        distinct = set(tenants)
        codes = self._tenant_column(tenants, distinct)
        self.tenants.update(distinct - {""})
        ends = np.asarray(columns["t_end_ns"], np.int64)
        tokens = columns.get("tokens_in_pass")
        tokens = np.zeros(n, np.int64) if tokens is None else tokens
        loss = np.asarray(columns["loss"], dtype=np.float64)
        self._steps.add(ends, np.asarray(columns["latency_ns"], np.int64), loss, codes)
        self._tenant_compute.add_rows(seqs, starts, ends, codes, tokens)

    @property
    def _passes(self) -> set[int]:
        """The forward passes held for the per-tenant compute (step_seq)."""
        return self._tenant_compute.held

    def _tenant_column(self, tenants: list[str], distinct: set[str]) -> np.ndarray | int:
        for tenant in distinct - self._tenant_codes.keys():
            self._tenant_code(tenant)
        codes = self._tenant_codes
        if len(distinct) == 1:  # one tenant a batch (most): its code, broadcast
            return codes[tenants[0]]
        return np.fromiter((codes[t] for t in tenants), np.int32, len(tenants))

    def _tenant_code(self, tenant: str) -> int:
        code = self._tenant_codes.get(tenant)
        if code is None:
            code = self._tenant_codes[tenant] = len(self._tenant_names)
            self._tenant_names.append(tenant)
        return code

    def add_request_events(self, columns: dict) -> None:
        """request_events columns (llmobs.shm.reader.REQUEST_EVENT_COLUMNS): a prefill chunk is a row of
        its pass with no token step, and takes its share of the pass."""
        for kind, pid, seq, start, end, tenant, k in zip(
            columns["kind"], np.asarray(columns["pid"]).tolist(), np.asarray(columns["step_seq"]).tolist(),
            np.asarray(columns["t_start_ns"]).tolist(), np.asarray(columns["t_end_ns"]).tolist(),
            columns["tenant"], np.asarray(columns["prefill_tokens"]).tolist(), strict=True,
        ):  # fmt: skip
            if kind == "chunk" and pid == self.pid and seq:
                self._tenant_compute.add_row(seq, start, end, self._tenant_code(tenant or ""), int(k))

    def _tenant_rates(self, recent: np.ndarray, since_ns: int, span_s: float) -> list[dict]:
        """Per tenant over the window: tokens/s (the `recent` slots' token steps) and compute-s/s (each
        pass's duration shared by its rows' tokens; a row of unknown tokens weighs the pass's mean known
        row). Passes that ended before the window are dropped: no later window holds them."""
        counts = np.bincount(self._steps.tenant[recent], minlength=len(self._tenant_names)).tolist()
        tokens = {self._tenant_names[code]: k for code, k in enumerate(counts) if k}
        names = self._tenant_names
        compute = {names[code]: ns for code, ns in self._tenant_compute.since(since_ns).items()}
        all_compute = sum(compute.values())
        rates = [
            {
                "tenant": tenant,
                "tokens_per_s": tokens.get(tenant, 0) / span_s,
                "compute_s_per_s": compute.get(tenant, 0.0) / 1e9 / span_s,
                "compute_share": compute.get(tenant, 0.0) / all_compute if all_compute else None,
            }
            for tenant in set(tokens) | set(compute)
        ]
        return sorted(rates, key=lambda r: (-r["compute_s_per_s"], -r["tokens_per_s"], r["tenant"]))

    def add_gpu_samples(self, columns: dict) -> None:
        """gpu_samples columns (llmobs.gpu.nvml_source) of this pid: the newest sample per GPU is kept."""
        for ts, pid, gpu, sm, mem in zip(
            np.asarray(columns["ts_ns"]).tolist(), np.asarray(columns["pid"]).tolist(),
            np.asarray(columns["gpu_index"]).tolist(), list(columns["sm_util"]), list(columns["mem_used"]),
            strict=True,
        ):  # fmt: skip
            if pid == self.pid and ts >= self._gpu.get(gpu, (0,))[0]:
                self._gpu[gpu] = (ts, sm, mem)

    def _gpu_row(self, since_ns: int) -> dict:
        """The process's GPU utilisation (mean over its GPUs) and device memory (summed), from samples
        of the last WINDOW_S; None where NVML said nothing (no GPU, or no kernel ran since its last look)."""
        fresh = [v for v in self._gpu.values() if v[0] >= since_ns]
        util = [v[1] for v in fresh if v[1] is not None]
        memory = [v[2] for v in fresh if v[2] is not None]
        return {
            "gpu_util_pct": sum(util) / len(util) if util else None,
            "gpu_mem_bytes": sum(memory) if memory else None,
        }

    def add_aggregates(self, table: pa.Table) -> None:
        """probe_aggregates deltas (pid, step_seq, probe, count, sum_value, sum_duration_ns)."""
        for row in table.to_pylist():
            if row["pid"] != self.pid or not row["step_seq"]:
                continue
            cls = probe_class(row["probe"])
            slot = self._work.setdefault(row["step_seq"], {})
            if cls == "offcpu":
                slot[cls] = slot.get(cls, 0) + row["sum_duration_ns"]
            else:
                slot[cls] = slot.get(cls, 0) + row["count"]
        if len(self._work) > 2 * WORK_STEPS:
            for step in sorted(self._work)[: len(self._work) - WORK_STEPS]:
                del self._work[step]

    def _fully_seen(self, step_seq: int) -> bool:
        if self.attached_ns is None:
            return True
        start = self._starts.get(step_seq)
        return start is not None and start >= self.attached_ns

    def row(self, now_ns: int | None = None) -> dict:
        """The numbers of one `top` line (None where unknown)."""
        now_ns = clock.monotonic_ns() if now_ns is None else now_ns
        since = now_ns - int(WINDOW_S * 1e9)
        span_s = WINDOW_S
        if self.first_start_ns is not None:
            span_s = min(WINDOW_S, max((now_ns - self.first_start_ns) / 1e9, 1e-3))
        oldest = self._steps.oldest_end()
        if oldest is not None and oldest > since:  # faster than the ring holds a window of: its span
            since, span_s = oldest, min(span_s, max((now_ns - oldest) / 1e9, 1e-3))
        recent = self._steps.since(since)
        shown = recent if len(recent) else self._steps.newest(RECENT_STEPS)
        drawn = (
            shown[self._draw.integers(0, len(shown), PERCENTILE_STEPS)]
            if len(shown) > PERCENTILE_STEPS
            else shown
        )
        latencies = self._steps.latency[drawn]
        # both quantiles in one call: np.percentile's set-up is most of its cost on a window this small
        p50, p99 = np.percentile(latencies, (50, 99)).tolist() if len(latencies) else (None, None)
        losses = self._steps.loss[shown]
        losses = losses[~np.isnan(losses)]
        steps = sorted(s for s in self._work if self._fully_seen(s))[-WORK_STEPS:]
        per_step = {}
        if steps:
            for cls in WORK_CLASSES:  # only classes some probe counted: no `mem` profile -> "-", not 0
                if any(cls in self._work[s] for s in steps):
                    per_step[cls] = sum(self._work[s].get(cls, 0) for s in steps) / len(steps)
        return {
            "pid": self.pid,
            "model_id": self.model_id,
            "tenants": sorted(self.tenants),
            "tokens": self.tokens,
            "tokens_per_s": len(recent) / span_s if len(self._steps) else None,
            "p50_ms": p50 / 1e6 if p50 is not None else None,
            "p99_ms": p99 / 1e6 if p99 is not None else None,
            "mean_loss": float(losses.mean()) if len(losses) else None,
            "per_step": per_step,
            "work_steps": len(steps),
            "by_tenant": self._tenant_rates(recent, since, span_s),
            **self._gpu_row(since),
            **({"agent": self.agent} if self.agent is not None else {}),
        }


def write_snapshot(path: Path, data: dict) -> None:
    """Atomically replace `path` with `data` as JSON (readers never see half a file). The directory is
    made when missing (first write, or removed since). Plain os calls: pathlib's text file cost ~0.2 ms
    more at each once-a-second write, and a mkdir each time ~0.14 ms (measured cold, this VM)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    text = json.dumps(data, sort_keys=True).encode()
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except FileNotFoundError:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_snapshots(directory: Path | None = None, now_ns: int | None = None) -> list[dict]:
    """The snapshots of running agents (stale ones, of killed agents, are skipped)."""
    directory = directory or run_dir()
    now_ns = clock.monotonic_ns() if now_ns is None else now_ns
    found = []
    for path in sorted(directory.glob("attach.*.json")) if directory.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            fresh = now_ns - int(data.get("updated_ns", 0)) < STALE_AFTER_S * 1e9
            if fresh and _alive(int(data.get("agent_pid", 0))):
                found.append(data)
    return found


def remove_snapshot(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def wall_time() -> str:
    return time.strftime("%H:%M:%S")
