"""Fuzz: 100k malformed maps through the reader's own validation code (in-memory buffers), half through
its small-read path and half through its general one (a different seed each), and 10k more through
both, compared.

Every map must either decode into sane rows or raise MalformedMap: never another exception, never a
read outside the buffer (BufferSource raises MalformedMap on any out-of-bounds read instead).
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch
from llmobs.errors import MalformedMap
from llmobs.shm import layout
from llmobs.shm.reader import BufferSource, MapView, _sane_steps, parse_buffer, validate_header
from llmobs.shm.writer import ShmWriter
from test_shm_small_read import RECORD_EDGES, assert_same_batch

N_MAPS = 50_000  # per read path: 100k in all
N_COMPARED = 10_000  # maps read through both paths and compared (each read twice)
FUZZ_STEPS = 16  # the valid map's steps ring: a read of it all is a small read
_HEADER_FIELDS = [
    (f.name, layout.HEADER.offsets[f.name], layout._TYPES[f.type][0])
    for f in layout.HEADER.fields
    if f.count == 1
]


@pytest.fixture(scope="module")
def valid_map(tmp_path_factory) -> bytes:
    d = tmp_path_factory.mktemp("fuzz")
    # every ring small (the layer and request rings too): each of the 100k mutations copies the map
    # twice, and at the default capacities (a 388 KiB map) the copies cost more than the reader
    w = ShmWriter(shm_dir=str(d), names_capacity=4, steps_capacity=FUZZ_STEPS, cupti_capacity=4,
                  layers_capacity=4, requests_capacity=4, model_id="fuzz-model")  # fmt: skip
    tenant = w.name(layout.NAME_TENANT, "tenant-a")
    for i in range(24):  # wraps the 16-record ring once
        block = torch.tensor([[0.5, 1.0, 0.6, 0.9, 0, 0, 0]], dtype=torch.float32)
        block[0, 4:] = torch.tensor([0, 65 + i, 65 + i], dtype=torch.int32).view(torch.float32)
        seq = w.begin_step(i, i + 1, tenant, 0)
        w.publish_steps(
            block, step_seq=seq, t_start=100 * i, t_end=100 * i + 50, trace_hi=[i], trace_lo=[i + 1],
            tenant_hash=tenant, session_hash=0, model_hash=0, step=i, position=[i], batch_row=[0],
            kv_len=i, flags=layout.FLAG_HAS_TARGET,
        )  # fmt: skip
    data = bytes(w.mm[:])
    w.close()
    return data


def _interesting(size: int, rng: random.Random) -> int:
    choices = [
        0,
        1,
        2,
        3,
        4,
        7,
        8,
        15,
        16,
        17,
        255,
        256,
        4096,
        1 << 24,
        (1 << 24) + 1,
        (1 << 31),
        (1 << 32) - 1,
    ]
    choices += [(1 << 62), (1 << 63), (1 << 64) - 1, rng.getrandbits(size * 8)]
    return rng.choice(choices) & ((1 << (size * 8)) - 1)


def _mutate(base: bytes, rng: random.Random) -> bytes:
    buf = bytearray(base)
    kind = rng.randrange(7)
    if kind == 0:  # one header field set to an interesting value
        _, off, size = rng.choice(_HEADER_FIELDS)
        buf[off : off + size] = _interesting(size, rng).to_bytes(size, "little")
    elif kind == 1:  # random byte flips anywhere
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    elif kind == 2:  # a record's sequence word (torn, overwritten, from the future, garbage)
        h = np.frombuffer(base, layout.HEADER.dtype, 1)[0]
        cap, off0 = int(h["steps_capacity"]), int(h["steps_offset"])
        slot = rng.randrange(cap)
        seq = struct.unpack_from("<Q", buf, off0 + slot * 128)[0]
        new = rng.choice([seq - 1, seq + 1, seq + 2 * cap, seq - 2 * cap, 0, _interesting(8, rng)]) % (
            1 << 64
        )
        struct.pack_into("<Q", buf, off0 + slot * 128, new)
    elif kind == 3:  # a record body overwritten with random bytes
        h = np.frombuffer(base, layout.HEADER.dtype, 1)[0]
        region = rng.choice(["names", "steps", "cupti"])
        off = int(h[f"{region}_offset"])
        rec = {"names": 128, "steps": 128, "cupti": 64}[region]
        start = off + rng.randrange(int(h[f"{region}_capacity"])) * rec + rng.randrange(rec)
        end = min(len(buf), start + rng.randint(1, 64))
        buf[start:end] = rng.randbytes(end - start)
    elif kind == 4:  # truncated or extended
        cut = rng.choice(
            [0, 7, 8, 255, 256, 257, 512, len(buf) // 2, len(buf) - 1, len(buf) + 1, len(buf) + 4096]
        )
        buf = buf[:cut] if cut <= len(buf) else buf + bytes(cut - len(buf))
    elif kind == 5:  # a name record's length/kind
        h = np.frombuffer(base, layout.HEADER.dtype, 1)[0]
        off = int(h["names_offset"]) + rng.randrange(int(h["names_capacity"])) * 128
        struct.pack_into("<II", buf, off + 16, rng.getrandbits(32), _interesting(4, rng))
    else:  # several header fields at once
        for _ in range(rng.randint(2, 5)):
            _, off, size = rng.choice(_HEADER_FIELDS)
            buf[off : off + size] = _interesting(size, rng).to_bytes(size, "little")
    return bytes(buf)


@pytest.fixture(params=["small", "general"])
def read_path(request, monkeypatch) -> str:
    """The path parse_buffer's read takes: the small-read path (MapView._few_steps: a read of the whole
    fuzz ring is a small read) or the general one (numpy, for reads of many records)."""
    monkeypatch.setattr(MapView, "small_read", FUZZ_STEPS if request.param == "small" else 0)
    return request.param


def test_valid_map_decodes(valid_map):
    view, batch = parse_buffer(valid_map)
    assert (len(batch), batch.lost, batch.corrupt) == (16, 8, 0)
    assert batch.columns["tenant"][0] == "tenant-a" and list(batch.columns["step"]) == list(range(8, 24))


def test_100k_malformed_maps_never_crash(valid_map, read_path):
    rng = random.Random(4719 if read_path == "general" else 5827)
    outcomes = {"ok": 0, "malformed": 0}
    failures = []
    for i in range(N_MAPS):
        data = _mutate(valid_map, rng)
        try:
            view, batch = parse_buffer(data)
        except MalformedMap as exc:
            assert str(exc)  # one clear message
            outcomes["malformed"] += 1
            continue
        except Exception as exc:  # anything else is a reader bug
            failures.append((i, repr(exc)))
            if len(failures) > 5:
                break
            continue
        outcomes["ok"] += 1
        cap = view.header["steps_capacity"]
        assert len(batch) <= cap and batch.lost >= 0 and batch.corrupt >= 0
        assert batch.next_cursor <= view.header["steps_head"]
        if len(batch):
            assert (batch.columns["step_seq"] >= 1).all() and (batch.columns["latency_ns"] >= 0).all()
    assert not failures, failures
    assert outcomes["ok"] + outcomes["malformed"] == N_MAPS
    assert outcomes["malformed"] > N_MAPS // 4 and outcomes["ok"] > N_MAPS // 10, outcomes


def _outcome(fn, *args):
    """What fn(*args) gives: its result, or the message of the MalformedMap it raised."""
    try:
        return fn(*args)
    except MalformedMap as exc:
        return str(exc)


def _read_through(data: bytes, small_read: int):
    view = MapView(BufferSource(data))
    view.small_read = small_read
    return view.read_steps(0, refresh=False)


def _edge_record(base: bytes, rng: random.Random) -> bytes:
    """A step record with a field at a value by a bound of what is sane (RECORD_EDGES): one byte flipped
    at random seldom lands exactly on a bound."""
    buf = bytearray(base)
    h = np.frombuffer(base, layout.HEADER.dtype, 1)[0]
    name = rng.choice(list(RECORD_EDGES))
    code, values = RECORD_EDGES[name]
    off = int(h["steps_offset"]) + rng.randrange(FUZZ_STEPS) * 128 + layout.STEP_RECORD.offsets[name]
    struct.pack_into("<" + code, buf, off, rng.choice(values))
    return bytes(buf)


def test_malformed_maps_read_the_same_through_both_paths(valid_map):
    """Each malformed map through the small-read path and the general path: the same error, or the same
    batch to the bit (columns, loss accounting, cursor, the kept records)."""
    rng = random.Random(8802)
    for i in range(N_COMPARED):
        data = _mutate(valid_map, rng) if i % 2 else _edge_record(valid_map, rng)
        small, general = _outcome(_read_through, data, FUZZ_STEPS), _outcome(_read_through, data, 0)
        if isinstance(general, str) or isinstance(small, str):
            assert small == general
        else:
            assert_same_batch(small, general)


def test_a_refresh_after_a_valid_read_gives_what_validate_header_gives(valid_map):
    """The header's fixed words are validated once, then only compared (MapView._validated): a malformed
    header read by a view that validated the valid one gives validate_header's result, or its error."""
    rng = random.Random(2207)
    data = bytearray(valid_map)
    view = MapView(BufferSource(data))
    checked = 0
    for _ in range(N_COMPARED):
        mutated = _mutate(valid_map, rng)
        if len(mutated) != len(valid_map):
            continue  # a source's size is fixed when it is opened
        data[:] = mutated
        want = _outcome(validate_header, mutated[: layout.HEADER.size], len(mutated))
        assert _outcome(view.refresh) == want
        data[:] = valid_map
        view.refresh()  # back to the valid header: its fixed words are the ones compared next
        checked += 1
    assert checked > N_COMPARED * 3 // 4


@pytest.mark.parametrize(
    ("field", "value", "sane"),
    [
        ("step_seq", 0, False), ("step_seq", 1, True), ("step_seq", (1 << 63) - 1, True),
        ("step_seq", 1 << 63, False), ("step_seq", (1 << 64) - 1, False),
        ("t_end_ns", 0, False), ("t_end_ns", 1 << 63, False), ("t_start_ns", 0, True),
        ("batch_row", -1, False), ("batch_row", 0, True), ("kv_len", -1, True), ("kv_len", -2, False),
        ("target_rank", -2, False), ("token_id", -2, False), ("target_id", -1, True),
        ("target_id", -2, False),
        ("flags", layout.FLAG_HAS_TARGET | layout.FLAG_SHADOW, True), ("flags", 1 << 31, False),
    ],
)  # fmt: skip
def test_a_record_is_sane_exactly_at_each_fields_bounds(valid_map, field, value, sane):
    """One record of the valid map with one field at a bound: kept, or counted corrupt and left out."""
    view, batch = parse_buffer(valid_map)
    recs = batch.raw.copy()
    recs[3][field] = value
    assert _sane_steps(recs).tolist() == [i != 3 or sane for i in range(len(recs))]
