"""NvmlSampler: GPU utilisation and memory from NVML (nvidia-ml-py), per device and per process, 1-4 Hz.

Samples are stamped on CLOCK_MONOTONIC (the agent's one clock) when they are read, and
`assign_steps` places per-process samples in the token steps of that process by time. NVML is
imported and initialised lazily, on `start()`: on a host without an NVIDIA driver the sampler prints
one status line ("nvml: off: ...") and stays off, and the agent runs on without GPU samples.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from dataclasses import dataclass

import numpy as np

from llmobs import clock

MIN_HZ, MAX_HZ = 1.0, 4.0  # faster gives nothing: NVML's own utilisation counters update at ~1-6 Hz
MAX_KEPT = 4096  # samples kept for `drain()`; the oldest go first (counted in `dropped`)


@dataclass(frozen=True)
class DeviceSample:
    ts_ns: int
    device: int
    gpu_util: int  # percent of the last sample period a kernel was running
    mem_util: int  # percent of that period device memory was read or written
    mem_used: int  # bytes
    mem_total: int


@dataclass(frozen=True)
class ProcessSample:
    ts_ns: int
    device: int
    pid: int
    sm_util: int  # percent, -1 when NVML has no utilisation sample for the process yet
    mem_util: int
    mem_used: int  # bytes of device memory the process holds, -1 when NVML does not say


def load_nvml():
    """NVIDIA's pynvml module (from nvidia-ml-py)."""
    import pynvml

    return pynvml


class NvmlSampler:
    """Samples every device at `hz` (clamped to 1-4) in a daemon thread; `sample()` reads once."""

    def __init__(self, hz: float = 2.0, *, load=load_nvml, status=None):
        self.period_s = 1.0 / min(MAX_HZ, max(MIN_HZ, hz))
        self._load = load
        self._status = status or (lambda line: print(line, file=sys.stderr))
        self.nvml = None
        self.handles: list = []
        self.identities: list[tuple[str, str]] = []  # (uuid, name) of each handle; "" where NVML says none
        self.available = False
        self.reason = ""
        self.devices: collections.deque = collections.deque(maxlen=MAX_KEPT)
        self.processes: collections.deque = collections.deque(maxlen=MAX_KEPT)
        self.dropped = 0
        self.errors = 0
        self.last_error = ""  # the newest failed read, "GPU <index>: <NVML's message>"
        self._last_seen_us: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------------
    def open(self) -> bool:
        """Initialise NVML; False (with one status line saying why) when there is no GPU or driver."""
        try:
            nvml = self._load()
        except ImportError as exc:
            return self._off(f"nvidia-ml-py is not installed ({exc})")
        try:
            nvml.nvmlInit()
        except Exception as exc:
            return self._off(_nvml_reason(exc))
        try:
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return self._off(f"NVML could not list devices: {exc}")
        if not handles:
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            return self._off("NVML sees no GPU on this host")
        self.nvml, self.handles, self.available = nvml, handles, True
        self.identities = [_identity(nvml, handle) for handle in handles]
        self._status(f"nvml: sampling {len(handles)} GPU(s) at {1 / self.period_s:g} Hz")
        return True

    def _off(self, reason: str) -> bool:
        self.available, self.reason = False, reason
        self._status(f"nvml: off: {reason}; the agent runs on without GPU samples")
        return False

    def start(self) -> bool:
        if not self.available and not self.open():
            return False
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="llmobs-nvml", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
            self.nvml, self.available = None, False

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    # --- reading ----------------------------------------------------------------------------------
    def sample(self) -> tuple[list[DeviceSample], list[ProcessSample]]:
        """Read every device once; a device that fails a read is skipped and counted in `errors`."""
        devices, processes = [], []
        if not self.available:
            return devices, processes
        nvml = self.nvml
        for index, handle in enumerate(self.handles):
            ts = clock.monotonic_ns()
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                devices.append(DeviceSample(ts, index, int(util.gpu), int(util.memory), int(mem.used),
                                            int(mem.total)))  # fmt: skip
            except Exception as exc:
                self._failed(index, exc)
                continue
            processes.extend(self._processes(nvml, handle, index, ts))
        for queue, rows in ((self.devices, devices), (self.processes, processes)):
            overflow = len(queue) + len(rows) - MAX_KEPT
            if overflow > 0:
                self.dropped += overflow
            queue.extend(rows)
        return devices, processes

    def _processes(self, nvml, handle, index: int, ts: int) -> list[ProcessSample]:
        memory: dict[int, int] = {}
        try:
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                memory[int(proc.pid)] = int(used) if used is not None else -1
        except Exception as exc:
            self._failed(index, exc)
        util: dict[int, tuple[int, int]] = {}
        try:  # samples newer than the last one we saw on this device (NVML keeps a short history)
            rows = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen_us.get(index, 0))
            for row in rows:
                util[int(row.pid)] = (int(row.smUtil), int(row.memUtil))
                self._last_seen_us[index] = max(self._last_seen_us.get(index, 0), int(row.timeStamp))
        except Exception:  # NVML_ERROR_NOT_FOUND: no process ran a kernel since the last call
            pass
        pids = sorted(set(memory) | set(util))
        return [ProcessSample(ts, index, pid, *util.get(pid, (-1, -1)), memory.get(pid, -1)) for pid in pids]

    def _failed(self, index: int, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"GPU {index}: {exc}"

    def drain(self) -> tuple[list[DeviceSample], list[ProcessSample]]:
        """Take the samples collected since the last drain."""
        devices, processes = [], []
        while self.devices:
            devices.append(self.devices.popleft())
        while self.processes:
            processes.append(self.processes.popleft())
        return devices, processes


def _identity(nvml, handle) -> tuple[str, str]:
    """(uuid, name) of a device; "" for what this NVML cannot say (a driver too old, a stand-in)."""
    out = []
    for getter in ("nvmlDeviceGetUUID", "nvmlDeviceGetName"):
        try:
            value = getattr(nvml, getter)(handle)
            out.append(value.decode() if isinstance(value, bytes) else str(value))
        except Exception:
            out.append("")
    return out[0], out[1]


def _nvml_reason(exc: Exception) -> str:
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "no NVIDIA driver on this host (libnvidia-ml.so.1 not found)"
    if "DriverNotLoaded" in name:
        return "the NVIDIA kernel driver is not loaded"
    if "NoPermission" in name:
        return "no permission to query the GPU (NVML)"
    return f"NVML failed to initialise: {exc}"


def assign_steps(samples: list[ProcessSample], steps: dict) -> np.ndarray:
    """The step_seq each per-process sample falls in: the step of the same pid whose
    [t_start_ns, t_end_ns] contains the sample's time, else 0. `steps` holds token-step columns
    (pid, step_seq, t_start_ns, t_end_ns), as ShmReader.read_steps returns them."""
    out = np.zeros(len(samples), np.int64)
    if not samples or len(steps["step_seq"]) == 0:
        return out
    pids = np.asarray(steps["pid"], np.int64)
    seqs = np.asarray(steps["step_seq"], np.int64)
    starts = np.asarray(steps["t_start_ns"], np.int64)
    ends = np.asarray(steps["t_end_ns"], np.int64)
    for pid in np.unique(pids):
        mine = np.flatnonzero(pids == pid)
        order = mine[np.argsort(starts[mine], kind="stable")]
        s, e, q = starts[order], ends[order], seqs[order]
        for i, sample in enumerate(samples):
            if sample.pid != pid:
                continue
            j = int(np.searchsorted(s, sample.ts_ns, side="right")) - 1
            if j >= 0 and sample.ts_ns <= e[j]:
                out[i] = q[j]
    return out
