"""A batch consumer of a BPF ring buffer, reading the kernel's mmap'ed pages directly.

bcc's ring_buffer_poll calls a Python callback per event (~1 us each before any decoding). Here the
agent maps the ring itself (the consumer page read-write, the producer page and the
data pages read-only, once), and every drain turns all committed records into one numpy array with a
single frombuffer + copy: no Python call per event. The programs only ever submit one record size,
so the records between the consumer and producer positions form a strided array; the first record
still BUSY (reserved, not yet committed) ends the batch.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

from llmobs.bpf.records import RING_BUSY_BIT, RING_DISCARD_BIT, RING_RECORD_DTYPE

_PAGE = mmap.PAGESIZE
# A ring that fills slowly is drained about once a second, not at every wake of the agent's loop: each
# drain with the hand-off of its few events was ~0.45 ms of CPU on this VM, ~4.5 ms a second at a 20
# steps/s target whose map the loop reads ten times a second. A wake drains only a ring that holds
# DEFER_SHARE of its space or was last drained DEFER_MAX_S ago; the loop wakes at least every
# (1 - DEFER_SHARE) x the time the fastest probes take to fill the ring (runtime.agent.sparse_period),
# so a burst that starts just after a wake that left the ring undrained still cannot overflow it.
DEFER_SHARE = 1 / 32
DEFER_MAX_S = 1.0


class RingConsumer:
    """Drains one BPF_MAP_TYPE_RINGBUF map, given its fd and data size (a power of two)."""

    def __init__(self, map_fd: int, data_bytes: int):
        if data_bytes & (data_bytes - 1):
            raise ValueError("ring size must be a power of two")
        self.data_bytes = data_bytes
        self._mask = data_bytes - 1
        self._consumer = mmap.mmap(map_fd, _PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # the producer page and the data pages once, not the kernel's second copy of them: the
        # mapping is resident from the start (16 MiB more RSS for the default ring); the one drain
        # in a lap whose records wrap past the end copies its two pieces together instead
        self._producer = mmap.mmap(map_fd, _PAGE + data_bytes, mmap.MAP_SHARED, mmap.PROT_READ, offset=_PAGE)
        self._record = RING_RECORD_DTYPE.itemsize
        self.records = 0
        self.discarded = 0

    def pending_bytes(self) -> int:
        return struct.unpack_from("<Q", self._producer, 0)[0] - struct.unpack_from("<Q", self._consumer, 0)[0]

    def drain(self, max_records: int | None = None) -> np.ndarray:
        """All committed records as an array of EVENT_DTYPE (a copy), and the ring space released."""
        cons = struct.unpack_from("<Q", self._consumer, 0)[0]
        prod = struct.unpack_from("<Q", self._producer, 0)[0]
        count = (prod - cons) // self._record
        if max_records is not None:
            count = min(count, max_records)
        if count <= 0:
            return np.empty(0, dtype=RING_RECORD_DTYPE["event"])
        start = cons & self._mask
        if start + count * self._record <= self.data_bytes:
            view = np.frombuffer(self._producer, dtype=RING_RECORD_DTYPE, count=count, offset=_PAGE + start)
        else:  # wraps: the tail of the data area, then its head
            head = start + count * self._record - self.data_bytes
            joined = (
                self._producer[_PAGE + start : _PAGE + self.data_bytes] + self._producer[_PAGE : _PAGE + head]
            )
            view = np.frombuffer(joined, dtype=RING_RECORD_DTYPE, count=count)
        busy = np.flatnonzero(view["len"] & RING_BUSY_BIT)
        if len(busy):
            count = int(busy[0])
            view = view[:count]
        keep = (view["len"] & RING_DISCARD_BIT) == 0
        if keep.all():
            events = view["event"].copy()
        else:
            events = view["event"][keep].copy()
            self.discarded += int(count - keep.sum())
        # release the space only after the copy: the kernel may overwrite it from here on
        struct.pack_into("<Q", self._consumer, 0, cons + count * self._record)
        self.records += len(events)
        return events

    def close(self) -> None:
        self._consumer.close()
        self._producer.close()


class DrainPacer:
    """When a ring is drained: at a wake where it holds DEFER_SHARE of its space, DEFER_MAX_S after its
    last drain, or always while `eager` (attach's first events: the first-event latency)."""

    def __init__(self):
        self._drained_at = float("-inf")

    def due(self, ring: RingConsumer, now: float, eager: bool = False) -> bool:
        filling = ring.pending_bytes() >= ring.data_bytes * DEFER_SHARE
        if eager or now - self._drained_at >= DEFER_MAX_S or filling:
            self._drained_at = now
            return True
        return False
