"""The small-read path (MapView._few_steps, the header's fixed words validated once) against the general
path on the same map contents: the same columns (keys, order, types, dtypes, values to the bit), the same
loss accounting and cursors, the same errors, over many seeded random small publishes."""

from __future__ import annotations

import os
import random
import struct

import numpy as np
import pytest
import torch
from llmobs.errors import MalformedMap
from llmobs.shm import layout
from llmobs.shm.reader import MAX_HEAD, BufferSource, MapView, ShmReader, StepBatch, validate_header
from llmobs.shm.writer import ShmWriter
from test_shm_versions import _as_v2

CAP = 16  # steps ring: a burst of more than this between two reads laps the reader
_F = layout.STEP_RECORD.offsets
_H = layout.HEADER.offsets
# a record field -> (struct code, values a corrupt or unusual record may hold there)
RECORD_EDGES = {
    "step_seq": ("Q", [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]),
    "t_start_ns": ("Q", [0, 1 << 62, (1 << 63) - 1, 1 << 63]),
    "t_end_ns": ("Q", [0, 5, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]),
    "trace_id_hi": ("Q", [0, (1 << 64) - 1, 1 << 63]),
    "batch_row": ("i", [-(1 << 31), -1, 0, (1 << 31) - 1]),
    "kv_len": ("i", [-2, -1, 0, (1 << 31) - 1]),
    "target_rank": ("i", [-2, -1, 3]),
    "token_id": ("i", [-(1 << 31), -2, -1, (1 << 31) - 1]),
    "target_id": ("i", [-2, -1, 7]),
    "flags": ("I", [0, layout.FLAG_SHADOW, layout.FLAG_PREFILL | layout.FLAG_SHADOW, 1 << 6, 1 << 31]),
    "tokens_in_pass": ("I", [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1]),
    "request_seq": ("I", [0, 1, 3, (1 << 32) - 1]),
    "step": ("I", [0, (1 << 32) - 1]),
    "position": ("I", [0, (1 << 31), (1 << 32) - 1]),
    # float bits: a signalling NaN, a NaN with a payload, -0.0, inf, a denormal
    "loss": ("I", [0x7FA00001, 0xFFC12345, 0x80000000, 0x7F800000, 0x00000001]),
    "top1_prob": ("I", [0x7FA00001, 0x3F800000]),
}


def _general(source) -> MapView:
    view = MapView(source)
    view.small_read = 0  # never the small path
    return view


def _accounting(batch: StepBatch) -> tuple[int, int, int]:
    return batch.lost, batch.corrupt, batch.next_cursor


def assert_same_batch(small: StepBatch, general: StepBatch) -> None:
    """What the small path handed out is what the general path handed out, to the bit."""
    assert _accounting(small) == _accounting(general)
    assert list(small.columns) == list(general.columns)  # the same keys, in the same order
    for key, want in general.columns.items():
        got = small.columns[key]
        assert type(got) is type(want), key
        if isinstance(want, np.ndarray):
            assert (got.dtype, got.shape) == (want.dtype, want.shape), key
            assert got.tobytes() == want.tobytes(), key  # bitwise: a NaN's payload too
            assert got.flags.c_contiguous and got.flags.aligned and got.flags.writeable, key
        else:
            assert got == want and [type(x) for x in got] == [type(x) for x in want], key
    assert small.raw.dtype == general.raw.dtype and small.raw.tobytes() == general.raw.tobytes()
    assert small.raw.flags.writeable


class Mirror:
    """A writer's map copied into a buffer before each read, poked first where a round says so: both
    paths read the very same bytes, through their own MapView (the small one counts its fast reads)."""

    def __init__(self, w: ShmWriter):
        self.w = w
        self.data = bytearray(bytes(w.mm))
        source = BufferSource(self.data)
        self.small, self.general = MapView(source), _general(source)
        self.cursors = [0, 0]
        self.fast = 0  # reads the small path decoded itself (not handed to the general path)
        few = self.small._few_steps

        def counted(*args):
            got = few(*args)
            self.fast += got is not None
            return got

        self.small._few_steps = counted

    def sync(self) -> None:
        self.data[:] = bytes(self.w.mm)

    def poke(self, pos: int, name: str, value: int) -> None:
        code = RECORD_EDGES[name][0] if name in RECORD_EDGES else "Q"
        off = self.w.steps_offset + (pos & (CAP - 1)) * layout.STEP_RECORD.size + _F[name]
        struct.pack_into("<" + code, self.data, off, value)

    def read(self, limit: int | None = None) -> tuple[StepBatch, StepBatch]:
        small = self.small.read_steps(self.cursors[0], limit)
        general = self.general.read_steps(self.cursors[1], limit)
        assert_same_batch(small, general)
        assert self.small.header == self.general.header
        self.cursors = [small.next_cursor, general.next_cursor]
        return small, general


def _block(rng: random.Random, n: int) -> torch.Tensor:
    """The device block of n rows: four floats, then rank, token and target as int32 bits."""
    floats = np.array([[rng.uniform(-5, 5) for _ in range(4)] for _ in range(n)], np.float32)
    ints = np.array([[rng.choice([-1, 0, 9, 50_000]) for _ in range(3)] for _ in range(n)], np.int32)
    return torch.from_numpy(np.concatenate([floats, ints.view(np.float32)], axis=1))


def _publish(w: ShmWriter, rng: random.Random, names: list[int]) -> None:
    """One random forward pass of 1..6 rows, with the per-row fields as ints or as sequences."""
    n = rng.randint(1, 6)
    seq = w.begin_step(rng.getrandbits(64), rng.getrandbits(64), rng.choice(names), 0)
    t_start = rng.randrange(1 << 40)

    def per_row(values):
        return rng.choice(values) if rng.random() < 0.5 else [rng.choice(values) for _ in range(n)]

    w.publish_steps(
        _block(rng, n), step_seq=seq, t_start=t_start, t_end=t_start + rng.randrange(10**6),
        trace_hi=[rng.getrandbits(64) for _ in range(n)], trace_lo=[rng.getrandbits(64) for _ in range(n)],
        tenant_hash=per_row(names), session_hash=per_row([0, names[-1], 12345]), model_hash=per_row(names),
        step=per_row([0, 1, 70]), position=[rng.randrange(1 << 20) for _ in range(n)],
        batch_row=list(range(n)), kv_len=per_row([-1, 0, 4096]),
        flags=per_row([layout.FLAG_HAS_TARGET, layout.FLAG_GENERATE | layout.FLAG_PREFILL,
                       layout.FLAG_SHADOW]),
        tokens_in_pass=per_row([0, 1, 12]), request_seq=per_row([0, 1, 2, 3, 99]),
    )  # fmt: skip


@pytest.fixture
def writer(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), names_capacity=8, steps_capacity=CAP, cupti_capacity=4,
                  layers_capacity=4, requests_capacity=4, model_id="small-model")  # fmt: skip
    yield w
    w.close()


@pytest.mark.parametrize("seed", range(6))
def test_random_small_publishes_read_the_same_through_both_paths(writer, seed):
    rng = random.Random(seed)
    names = [writer.name(layout.NAME_TENANT, f"tenant-{i}") for i in range(3)]
    for request_seq, request_id in ((1, "req-1"), (3, "chatcmpl-3")):
        writer.name_request(request_seq, request_id)
    mirror = Mirror(writer)
    reads = 0
    for _ in range(150):
        burst = rng.random() < 0.1  # more than the ring holds: the reader is lapped
        for _ in range(rng.randint(5, 9) if burst else rng.randint(0, 2)):
            _publish(writer, rng, names)
        if rng.random() < 0.1:  # a new name between two reads (the names ring moves)
            names.append(writer.name(layout.NAME_SESSION, f"session-{rng.randrange(1000)}"))
        mirror.sync()
        unread = range(max(mirror.cursors[0], writer.steps_head - CAP), writer.steps_head)
        for _ in range(rng.choice([0, 0, 1, 2]) if unread else 0):  # unread records made corrupt or odd
            name = rng.choice(list(RECORD_EDGES))
            mirror.poke(rng.choice(unread), name, rng.choice(RECORD_EDGES[name][1]))
        if unread and rng.random() < 0.05:  # a record caught being written, overwritten, or never written
            pos = rng.choice(unread)
            mirror.poke(pos, "seq", rng.choice([2 * pos + 1, 2 * (pos + CAP) + 2, 0]))
        small, _ = mirror.read(limit=rng.choice([None, None, None, 1, 3, CAP]))
        reads += len(small) > 0
    # the comparison is only worth something if the small path did decode most reads itself
    assert mirror.fast > reads * 0.7, (mirror.fast, reads)


def test_a_lapped_ring_counts_the_same_losses(writer):
    rng = random.Random(11)
    names = [writer.name(layout.NAME_TENANT, "t")]
    mirror = Mirror(writer)
    _publish(writer, rng, names)
    mirror.sync()
    mirror.read()
    while writer.steps_head < mirror.cursors[0] + CAP + 5:
        _publish(writer, rng, names)
    mirror.sync()
    small, _ = mirror.read()
    assert small.lost > 0 and len(small) == CAP and mirror.fast == 2


def test_a_restarted_writer_raises_the_same_error_on_both_paths(writer, tmp_path):
    rng = random.Random(5)
    names = [writer.name(layout.NAME_TENANT, "t")]
    mirror = Mirror(writer)
    for _ in range(4):
        _publish(writer, rng, names)
    mirror.sync()
    mirror.read()
    cursor = mirror.cursors[0]
    # the workload restarted: a new map of the same size, fewer steps than our cursor (and a new header:
    # created_ns moved, a fixed word, so the header is validated again in full)
    (tmp_path / "again").mkdir()
    again = ShmWriter(shm_dir=str(tmp_path / "again"), names_capacity=8, steps_capacity=CAP, cupti_capacity=4,
                      layers_capacity=4, requests_capacity=4, model_id="small-model")  # fmt: skip
    try:
        _publish(again, rng, [again.name(layout.NAME_TENANT, "t")])
        assert 0 < again.steps_head < cursor
        mirror.data[:] = bytes(again.mm)
    finally:
        again.close()
    errors = []
    for view, at in ((mirror.small, mirror.cursors[0]), (mirror.general, mirror.cursors[1])):
        with pytest.raises(MalformedMap, match="behind the reader's cursor") as exc:
            view.read_steps(at)
        errors.append(str(exc.value))
        assert view.header == validate_header(bytes(mirror.data[: layout.HEADER.size]), len(mirror.data))
    assert errors[0] == errors[1]


def test_torn_reads_are_left_to_the_general_path(writer):
    """A record that differs between the two reads: both paths see the same reads and agree."""
    rng = random.Random(3)
    names = [writer.name(layout.NAME_TENANT, "t")]
    for _ in range(3):
        _publish(writer, rng, names)
    data = bytes(writer.mm)
    steps_at = writer.steps_offset

    class TornSource(BufferSource):
        def __init__(self):
            super().__init__(data)
            self.ring_reads = 0

        def read(self, offset: int, length: int) -> bytes:
            got = super().read(offset, length)
            if offset >= steps_at:
                self.ring_reads += 1
                if self.ring_reads % 2 == 0:  # the second read of each pair: the first record changed
                    got = got[:40] + bytes([got[40] ^ 1]) + got[41:]
            return got

    small, general = MapView(TornSource()).read_steps(0), _general(TornSource()).read_steps(0)
    assert_same_batch(small, general)
    assert len(small) == 0 and small.next_cursor == 0  # the torn record is retried at the next read


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("state", 7, "unknown map state 7"),
        ("steps_head", MAX_HEAD, "steps_head .* is impossibly large"),
        ("requests_head", MAX_HEAD + 1, "requests_head .* is impossibly large"),
        ("names_head", (1 << 64) - 1, "names_head .* is impossibly large"),
        ("created_ns", 1, None),  # a fixed word that changed validly: validated again, accepted
        ("writer_uid", 4242, None),
        ("steps_capacity", 8, "the layout puts it at"),  # a fixed word that changed badly
    ],
)
def test_a_header_change_between_reads_gives_what_validate_header_gives(writer, field, value, error):
    mirror = Mirror(writer)
    mirror.read()
    f = next(f for f in layout.HEADER.fields if f.name == field)
    struct.pack_into("<" + {"u64": "Q", "u32": "I"}[f.type], mirror.data, _H[field], value)
    raw = bytes(mirror.data[: layout.HEADER.size])
    for view in (mirror.small, mirror.general):
        if error is None:
            assert view.refresh() == validate_header(raw, len(mirror.data))
            assert view.header[field] == value
        else:
            with pytest.raises(MalformedMap, match=error):
                view.refresh()
            with pytest.raises(MalformedMap, match=error):
                validate_header(raw, len(mirror.data))


def test_a_v2_maps_reserved_request_words_are_checked_on_every_read(writer):
    """A v2 map has no request-events ring: its requests_head and requests_dropped (moving words) must
    stay zero, on the fast header path too."""
    data = _as_v2(writer)
    view = MapView(BufferSource(data))
    view.refresh()
    struct.pack_into("<Q", data, _H["requests_dropped"], 1)
    with pytest.raises(MalformedMap, match="non-zero reserved header words"):
        view.refresh()
    struct.pack_into("<Q", data, _H["requests_dropped"], 0)
    assert view.refresh() == validate_header(bytes(data[: layout.HEADER.size]), len(data))


def test_a_live_file_reads_the_same_through_both_paths(writer, tmp_path):
    """Two readers of the very file (pread), one per path, a live writer publishing between reads."""
    rng = random.Random(17)
    names = [writer.name(layout.NAME_TENANT, "tenant-a")]
    with (
        ShmReader(os.getpid(), shm_dir=str(tmp_path)) as small,
        ShmReader(os.getpid(), shm_dir=str(tmp_path)) as general,
    ):
        general.small_read = 0
        cursors = [0, 0]
        for _ in range(40):
            for _ in range(rng.choice([0, 1, 1, 2, 6])):
                _publish(writer, rng, names)
            a, b = small.read_steps(cursors[0]), general.read_steps(cursors[1])
            assert_same_batch(a, b)
            cursors = [a.next_cursor, b.next_cursor]
