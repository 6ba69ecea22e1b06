"""The exact per-(pid, step, probe) totals kept by the kernel in a per-CPU hash, read in batches.

The kernel counts every event (sampled or not) in llmobs_aggs, one slot per CPU. The agent reads the
map with BPF_MAP_LOOKUP_BATCH into numpy buffers, sums the CPUs, and from time to time moves the
totals of finished steps (older than the newest step of that pid by a margin, so no thread still
tags with them) into user space and deletes them, keeping the bounded map from filling.
"""

from __future__ import annotations

import ctypes as ct
import errno

import numpy as np

from llmobs.bpf.records import AGG_KEY_DTYPE, AGG_VAL_DTYPE

# a step is final once the process is this many steps further: no thread still tags events with it
FINISHED_STEP_MARGIN = 2


def possible_cpus() -> int:
    from bcc.utils import get_possible_cpus

    return len(get_possible_cpus())


def read_percpu_hash(lib, map_fd: int, capacity: int, ncpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values summed over CPUs) of a per-CPU hash with AGG_KEY/AGG_VAL records."""
    keys = np.zeros(capacity, dtype=AGG_KEY_DTYPE)
    values = np.zeros((capacity, ncpus), dtype=AGG_VAL_DTYPE)
    in_batch, out_batch, count = ct.c_uint32(0), ct.c_uint32(0), ct.c_uint32(0)
    total = 0
    first = True
    while total < capacity:
        count.value = capacity - total
        res = lib.bpf_lookup_batch(
            map_fd,
            None if first else ct.byref(in_batch),
            ct.byref(out_batch),
            keys.ctypes.data + total * AGG_KEY_DTYPE.itemsize,
            values.ctypes.data + total * ncpus * AGG_VAL_DTYPE.itemsize,
            ct.byref(count),
        )
        err = ct.get_errno()
        total += count.value
        if res != 0:
            if err in (errno.ENOENT, 0):
                break
            raise OSError(err, f"BPF_MAP_LOOKUP_BATCH on the aggregates map: {errno.errorcode.get(err, err)}")
        first = False
        in_batch.value = out_batch.value
    summed = np.zeros(total, dtype=AGG_VAL_DTYPE)
    for field in AGG_VAL_DTYPE.names:
        summed[field] = values[:total][field].sum(axis=1)
    return keys[:total].copy(), summed


def delete_keys(lib, map_fd: int, keys: np.ndarray) -> None:
    if len(keys):
        buf = np.ascontiguousarray(keys)
        count = ct.c_uint32(len(buf))
        lib.bpf_delete_batch(map_fd, buf.ctypes.data, ct.byref(count))


class Totals:
    """Totals moved out of the kernel map, plus the live map, merged on read."""

    def __init__(self):
        self._harvested: dict[tuple[int, int, int], list[int]] = {}

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        for key, value in zip(keys.tolist(), values.tolist(), strict=True):
            slot = self._harvested.setdefault(key, [0, 0, 0])
            slot[0] += value[0]
            slot[1] += value[1]
            slot[2] += value[2]

    def merged(self, live_keys: np.ndarray, live_values: np.ndarray) -> dict[tuple[int, int, int], list[int]]:
        """(pid, probe, step_seq) -> [count, sum_value, sum_duration_ns] over harvested + live."""
        result = {key: list(value) for key, value in self._harvested.items()}
        for key, value in zip(live_keys.tolist(), live_values.tolist(), strict=True):
            slot = result.setdefault(key, [0, 0, 0])
            for i in range(3):
                slot[i] += value[i]
        return result


def finished(keys: np.ndarray) -> np.ndarray:
    """A mask of the keys whose step is FINISHED_STEP_MARGIN behind their pid's newest step."""
    mask = np.zeros(len(keys), dtype=bool)
    for pid in np.unique(keys["pid"]):
        mine = keys["pid"] == pid
        newest = keys["step_seq"][mine].max()
        mask |= mine & (keys["step_seq"] != 0) & (keys["step_seq"] + FINISHED_STEP_MARGIN < newest)
    return mask
