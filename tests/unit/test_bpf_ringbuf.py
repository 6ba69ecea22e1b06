"""The ring consumer on a file laid out like the kernel's ring mapping (consumer page, producer page,
data pages twice): batch decode, a BUSY record ending the batch, discarded records, wrap-around."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
from llmobs.bpf.records import EVENT_DTYPE, RING_BUSY_BIT, RING_DISCARD_BIT, RING_RECORD_DTYPE
from llmobs.bpf.ringbuf import RingConsumer

PAGE = mmap.PAGESIZE
DATA = 4 * PAGE
REC = RING_RECORD_DTYPE.itemsize


class FakeRing:
    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, 2 * PAGE + 2 * DATA)
        self.map = mmap.mmap(self.fd, 2 * PAGE + 2 * DATA)
        self.prod = 0

    def put(self, step: int, flags: int = 0) -> None:
        record = np.zeros(1, dtype=RING_RECORD_DTYPE)
        record["len"] = EVENT_DTYPE.itemsize | flags
        record["event"]["step_seq"] = step
        record["event"]["pid"] = 7
        raw = record.tobytes()
        where = self.prod % DATA
        for copy in (0, DATA):  # the kernel maps the data pages twice; a file needs both copies
            end = min(len(raw), 2 * DATA - (where + copy))
            self.map[2 * PAGE + where + copy : 2 * PAGE + where + copy + end] = raw[:end]
            if end < len(raw):
                self.map[2 * PAGE : 2 * PAGE + len(raw) - end] = raw[end:]
        self.prod += REC
        struct.pack_into("<Q", self.map, PAGE, self.prod)

    def consumer_pos(self) -> int:
        return struct.unpack_from("<Q", self.map, 0)[0]


def test_batch_busy_and_discard(tmp_path):
    ring = FakeRing(tmp_path / "ring")
    consumer = RingConsumer(ring.fd, DATA)
    for step in range(1, 6):
        ring.put(step)
    ring.put(6, RING_DISCARD_BIT)
    ring.put(7)
    ring.put(8, RING_BUSY_BIT)  # reserved, not committed: the batch stops before it
    ring.put(9)
    events = consumer.drain()
    assert list(events["step_seq"]) == [1, 2, 3, 4, 5, 7]
    assert consumer.discarded == 1
    assert ring.consumer_pos() == 7 * REC  # released up to the busy record, not past it
    assert len(consumer.drain()) == 0  # still busy


def test_wraps_around_the_data_area(tmp_path):
    ring = FakeRing(tmp_path / "ring")
    consumer = RingConsumer(ring.fd, DATA)
    seen = []
    step = 0
    for _ in range(5):  # 5 x 200 records of 72 bytes through a 16 KiB area: wraps several times
        for _ in range(200):
            step += 1
            ring.put(step)
            if (ring.prod - ring.consumer_pos()) > DATA - REC:
                seen.extend(consumer.drain()["step_seq"].tolist())
        seen.extend(consumer.drain()["step_seq"].tolist())
    assert seen == list(range(1, step + 1))
    assert consumer.records == step


def test_empty_and_max_records(tmp_path):
    ring = FakeRing(tmp_path / "ring")
    consumer = RingConsumer(ring.fd, DATA)
    assert len(consumer.drain()) == 0
    for step in range(10):
        ring.put(step)
    assert len(consumer.drain(max_records=4)) == 4
    assert list(consumer.drain()["step_seq"]) == list(range(4, 10))
