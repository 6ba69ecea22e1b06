"""The exact per-(pid, step, probe) totals kept by the kernel in a hash, read in batches.

The kernel counts every event (sampled or not) in llmobs_aggs (a plain hash, added to atomically; see
bpf/c/llmobs_events.h for why not per CPU). The agent reads the map with BPF_MAP_LOOKUP_BATCH into
numpy buffers (summing the CPUs where a map is per-CPU), and from time to time moves the totals of
finished steps (older than the newest step of that pid by a margin, so no thread still tags with them)
into user space and deletes them, keeping the bounded map from filling.
"""

from __future__ import annotations

import errno

import numpy as np

from llmobs.bpf import syscall
from llmobs.bpf.records import AGG_KEY_DTYPE, AGG_VAL_DTYPE

# a step is final once the process is this many steps further: no thread still tags events with it
FINISHED_STEP_MARGIN = 2


# Entries asked of one BPF_MAP_LOOKUP_BATCH. The kernel allocates its bounce buffers for the count asked
# (kvmalloc), so asking for the map's capacity (65,536) cost a 2.5 MB vmalloc and free, and this side
# 2.5 MB of zeroed numpy buffers, at every read: 1.13 ms of a cold once-a-second read of a 60-entry map
# here, 0.57 ms in chunks of this size. A full map takes 16 calls (each resumes where the last ended).
READ_CHUNK = 4096


def read_totals(
    map_fd: int, capacity: int, ncpus: int = 1, chunk: int = READ_CHUNK
) -> tuple[np.ndarray, np.ndarray]:
    """(keys, values) of a hash with AGG_KEY/AGG_VAL records, read with BPF_MAP_LOOKUP_BATCH in chunks of
    `chunk` entries (grown when one hash bucket holds more: the kernel's ENOSPC); `ncpus` > 1 for a
    per-CPU hash, whose values are summed over the CPUs. At most `capacity` entries."""
    chunk = max(1, min(chunk, capacity))
    key_parts, value_parts = [], []
    batch = np.zeros(1, dtype=np.uint64)  # the kernel's opaque position token (a u32 bucket for hashes)
    total = 0
    first = True
    while total < capacity:
        # A whole chunk even where the cap leaves less room: the kernel copies whole buckets (ENOSPC where
        # one does not fit), and entries past the cap are dropped below. Before, a capped read whose room
        # left was smaller than the next bucket failed (ENOSPC) instead.
        keys = np.empty(chunk, dtype=AGG_KEY_DTYPE)
        values = np.empty((chunk, ncpus), dtype=AGG_VAL_DTYPE)
        try:
            count, end = syscall.map_lookup_batch(
                map_fd, None if first else batch, batch, keys.ctypes.data, values.ctypes.data, chunk
            )
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            chunk *= 2  # the next bucket holds more entries than one chunk: ask again for more
            continue
        count = min(count, capacity - total)
        if count:
            key_parts.append(keys[:count])
            value_parts.append(values[:count])
            total += count
        if end or not count:  # the map's end (a call that copied nothing has nowhere further to go)
            break
        first = False
    keys = np.concatenate(key_parts) if key_parts else np.empty(0, dtype=AGG_KEY_DTYPE)
    values = np.concatenate(value_parts) if value_parts else np.empty((0, ncpus), dtype=AGG_VAL_DTYPE)
    if ncpus == 1:
        return keys, values[:, 0].copy()
    summed = np.zeros(total, dtype=AGG_VAL_DTYPE)
    for field in AGG_VAL_DTYPE.names:
        summed[field] = values[field].sum(axis=1)
    return keys, summed


def delete_keys(lib, map_fd: int, keys: np.ndarray) -> None:
    """Deletes these keys in one BPF_MAP_DELETE_BATCH. `lib` is unused (it was bcc's libbcc)."""
    if len(keys):
        buf = np.ascontiguousarray(keys)
        syscall.map_delete_batch(map_fd, buf, len(buf))


class Totals:
    """Totals moved out of the kernel map, plus the live map, merged on read.

    Beside the per-step totals (what the detach summary and `merged` give) it keeps, as harvests
    arrive, what each of them moved (`take_new`: probe_aggregates deltas for the store, without
    comparing the whole history again) and running counts per (pid, probe) and of steps (`counts`,
    `overview`): what the once-a-second readers need, in O(probes + live keys), never O(all steps)."""

    def __init__(self):
        self._harvested: dict[tuple[int, int, int], list[int]] = {}
        self._new: dict[tuple[int, int, int], list[int]] = {}  # harvested since the last take_new()
        self.track_new = False  # set by the one consumer of take_new() (the pipeline's AggregateSource)
        self._by_probe: dict[tuple[int, int], int] = {}  # (pid, probe) -> events harvested
        self._steps: set[tuple[int, int]] = set()  # (pid, step) of the non-zero steps harvested
        self._newest = 0  # the newest step harvested

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        harvested, new, by_probe = self._harvested, self._new if self.track_new else None, self._by_probe
        for key, value in zip(keys.tolist(), values.tolist(), strict=True):
            slot = harvested.get(key)
            if slot is None:
                slot = harvested[key] = [0, 0, 0]
                if key[2]:
                    self._steps.add((key[0], key[2]))
                    self._newest = max(self._newest, key[2])
            slot[0] += value[0]
            slot[1] += value[1]
            slot[2] += value[2]
            probe_key = key[:2]
            by_probe[probe_key] = by_probe.get(probe_key, 0) + value[0]
            if new is not None:
                delta = new.setdefault(key, [0, 0, 0])
                delta[0] += value[0]
                delta[1] += value[1]
                delta[2] += value[2]

    def take_new(self) -> dict[tuple[int, int, int], list[int]]:
        """What the harvests since the last call moved: (pid, probe, step_seq) -> deltas."""
        new, self._new = self._new, {}
        return new

    def harvested(self, key: tuple[int, int, int]) -> list[int] | None:
        return self._harvested.get(key)

    def counts(self, live_keys: np.ndarray, live_values: np.ndarray) -> dict[tuple[int, int], int]:
        """(pid, probe) -> events counted (harvested + live)."""
        result = dict(self._by_probe)
        if len(live_keys):
            counts = live_values["count"].tolist()
            for (pid, probe, _step), count in zip(live_keys.tolist(), counts, strict=True):
                result[(pid, probe)] = result.get((pid, probe), 0) + count
        return result

    def overview(self, live_keys: np.ndarray, live_values: np.ndarray) -> tuple[int, int, int]:
        """(events, distinct non-zero steps, newest step) over harvested + live, every pid."""
        events = sum(self._by_probe.values())
        live: set[tuple[int, int]] = set()
        if len(live_keys):
            events += int(live_values["count"].sum())
            live = {(pid, step) for pid, _probe, step in live_keys.tolist() if step}
        steps = len(self._steps) + len(live - self._steps)
        last = max((step for _pid, step in live), default=0)
        if self._steps:
            last = max(last, self._newest)
        return events, steps, last

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
    if not len(keys):
        return np.zeros(0, dtype=bool)
    pids = keys["pid"]
    if pids.min() == pids.max():  # one pid (an attach session): no per-pid masks
        steps = keys["step_seq"]
        return (steps != 0) & (steps + FINISHED_STEP_MARGIN < steps.max())
    mask = np.zeros(len(keys), dtype=bool)
    for pid in np.unique(keys["pid"]):
        mine = keys["pid"] == pid
        newest = keys["step_seq"][mine].max()
        mask |= mine & (keys["step_seq"] != 0) & (keys["step_seq"] + FINISHED_STEP_MARGIN < newest)
    return mask
