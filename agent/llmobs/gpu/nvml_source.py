"""NvmlSource: NVML as a live Source of the pipeline, gpu_samples rows for the processes it tracks.

The runtime polls it about once a second with its other agent-level sources, and hands each target its
own rows (`split_by_pid`, then `Pipeline.add_gpu_samples`). One row per (sample time, pid, GPU): the
process's SM and memory utilisation and device memory, beside the whole device's (store/schema.py,
migration 6). Reads are synchronous (a handful of NVML calls per GPU, well under a millisecond each):
no thread of its own.

NVML is opened on the first poll. Where it cannot be (no driver, no GPU, nvidia-ml-py missing) the
source says so in one status line and every later poll returns None at once: the agent runs on without
GPU samples. A GPU whose reads fail mid-run is a status line too (once per distinct failure), never an
exception; after MAX_FAILED_POLLS polls in a row in which every read failed the source turns itself
off, saying so, instead of asking a lost GPU again every second forever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from llmobs.gpu.nvml import DeviceSample, NvmlSampler, ProcessSample, load_nvml
from llmobs.gpu.records import select_rows

MAX_FAILED_POLLS = 10
MAX_SAID = 32  # distinct failure lines said; past that a GPU failing in new ways is only counted

# The gpu_samples columns a poll returns, in the table's order.
COLUMNS = (
    "ts_ns", "pid", "gpu_index", "gpu_uuid", "gpu_name", "sm_util", "mem_util", "mem_used", "gpu_util",
    "gpu_mem_util", "device_mem_used", "device_mem_total",
)  # fmt: skip


class NvmlSource:
    """`track(pid)` / `untrack(pid)`, `poll() -> {"gpu_samples": columns} | None`, `stats()`, `status`
    (the last status line, None until there is one), `close()`.

    Each status line goes once to `say` (default: nowhere, the runtime prints `status` itself): the
    source never writes to the terminal on its own."""

    def __init__(self, *, load=load_nvml, say: Callable[[str], None] | None = None):
        self._say = say or (lambda line: None)
        # 1 Hz: what the runtime polls at; NVML's own counters update at ~1-6 Hz
        self.sampler = NvmlSampler(hz=1.0, load=load, status=self._report)
        self.status: str | None = None
        self.pids: set[int] = set()
        self._state = "unopened"  # -> "on" | "off"; "off" is for good
        self._failed_polls = 0
        self._said: set[str] = set()
        self.counters = {"polls": 0, "rows": 0, "read_errors": 0}

    # --- what the runtime calls ---------------------------------------------------------------------
    def track(self, pid: int) -> None:
        self.pids.add(int(pid))

    def untrack(self, pid: int) -> None:
        self.pids.discard(int(pid))

    @property
    def available(self) -> bool:
        return self._state == "on"

    def poll(self) -> dict | None:
        """One NVML read of every GPU: the rows of the tracked pids seen on them (None: none, or off)."""
        if self._state == "off" or (self._state == "unopened" and not self._open()):
            return None
        if not self.pids:
            return None
        self.counters["polls"] += 1
        errors = self.sampler.errors
        try:
            devices, processes = self.sampler.sample()
        except Exception as exc:  # NVML failing where the sampler does not expect it
            self._off(f"reading the GPUs failed ({exc})")
            return None
        self.sampler.drain()  # the sampler also keeps what it read for drain(); nothing else reads it
        if self.sampler.errors > errors:
            self._read_failed(self.sampler.errors - errors, all_failed=not devices)
            if self._state == "off":
                return None
        else:
            self._failed_polls = 0
        columns = rows(devices, processes, self.sampler.identities, self.pids)
        if not len(columns["ts_ns"]):
            return None
        self.counters["rows"] += len(columns["ts_ns"])
        return {"gpu_samples": columns}

    def stats(self) -> dict[str, int]:
        return {**self.counters, "gpus": len(self.sampler.handles), "available": int(self.available)}

    def close(self) -> None:
        self.sampler.stop()  # shuts NVML down (no thread was started)
        if self._state == "on":
            self._state = "off"

    # --- status -------------------------------------------------------------------------------------
    def _open(self) -> bool:
        self._state = "on" if self.sampler.open() else "off"  # open() said its one line either way
        return self._state == "on"

    def _report(self, line: str) -> None:
        self.status = line
        self._say(line)

    def _off(self, reason: str) -> None:
        self._state = "off"
        self._report(f"nvml: off: {reason}; the agent runs on without GPU samples")
        self.sampler.stop()

    def _read_failed(self, count: int, all_failed: bool) -> None:
        self.counters["read_errors"] += count
        self._failed_polls = self._failed_polls + 1 if all_failed else 0
        if self._failed_polls >= MAX_FAILED_POLLS:
            self._off(f"every GPU read failed {MAX_FAILED_POLLS} times in a row ({self.sampler.last_error})")
            return
        line = f"nvml: read failed, that GPU's samples are skipped: {self.sampler.last_error}"
        if line not in self._said and len(self._said) < MAX_SAID:
            self._said.add(line)
            self._report(line)


def rows(
    devices: list[DeviceSample],
    processes: list[ProcessSample],
    identities: list[tuple[str, str]],
    pids: Iterable[int],
) -> dict:
    """gpu_samples columns: one row per process sample of a pid in `pids`, beside its device's sample
    of the same read. NVML's -1 ("no sample yet", "not known") becomes NULL."""
    wanted = set(pids)
    by_device = {d.device: d for d in devices}
    mine = [p for p in processes if p.pid in wanted and p.device in by_device]
    dev = [by_device[p.device] for p in mine]
    ident = [identities[p.device] if p.device < len(identities) else ("", "") for p in mine]
    return {
        "ts_ns": np.array([p.ts_ns for p in mine], np.int64),
        "pid": np.array([p.pid for p in mine], np.int32),
        "gpu_index": np.array([p.device for p in mine], np.int32),
        "gpu_uuid": [i[0] or None for i in ident],
        "gpu_name": [i[1] or None for i in ident],
        "sm_util": [_known(p.sm_util) for p in mine],
        "mem_util": [_known(p.mem_util) for p in mine],
        "mem_used": [_known(p.mem_used) for p in mine],
        "gpu_util": np.array([d.gpu_util for d in dev], np.int16),
        "gpu_mem_util": np.array([d.mem_util for d in dev], np.int16),
        "device_mem_used": np.array([d.mem_used for d in dev], np.int64),
        "device_mem_total": np.array([d.mem_total for d in dev], np.int64),
    }


def split_by_pid(batch: dict) -> dict[int, dict]:
    """gpu_samples columns cut into one set per pid, for each target's `Pipeline.add_gpu_samples`;
    takes what `poll()` returns ({"gpu_samples": columns}) or the columns themselves."""
    columns = batch.get("gpu_samples", batch)
    pids = np.asarray(columns["pid"])
    return {int(pid): select_rows(columns, pids == pid) for pid in np.unique(pids).tolist()}


def _known(value: int) -> int | None:
    return None if value < 0 else value
