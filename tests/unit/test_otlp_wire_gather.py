"""The OTLP encoder's C gather (llmobs/otlp/c/wire_gather.c): the bytes of numpy's gather for every kind
of segment the encoder makes, and a ValueError, never a read outside a buffer, for segments that do not
fit. tests/unit/test_otlp_wire.py runs the encoder itself with each gather."""

from __future__ import annotations

import numpy as np
import pytest
from llmobs.otlp import wire

if wire.gather_backend() != "c":  # scripts/setup.sh builds it, and fails where it cannot
    pytest.skip("the C gather is not built here (no compiler at install)", allow_module_level=True)


def random_pieces(rng: np.random.Generator, n: int) -> wire.Pieces:
    """Segments of every kind gather meets: constants, matrices (a broadcast one: row stride 0), short
    and wide strings at arbitrary starts, rows left out (length 0), and a nested message."""
    pieces = wire.Pieces(n)
    pieces.const(b"\x0a\x10", present=rng.random(n) < 0.7)
    pieces.matrix(rng.integers(0, 256, (n, 9), dtype=np.uint8), rng.integers(0, 10, n))
    pieces.matrix(np.broadcast_to(np.frombuffer(b"abc", np.uint8), (n, 3)))
    pieces.varint(rng.integers(-(2**40), 2**40, n))
    for width in (20, 300):  # padded into the numpy gather's matrix, and kept apart
        data = rng.integers(0, 256, (n + 1) * width, dtype=np.uint8)
        length = rng.integers(0, width + 1, n)
        start = rng.integers(0, n * width + 1, n)
        pieces.add(data, start, length)
    inner = wire.Pieces(n).varint(rng.integers(0, 2**20, n)).const(b"zz")
    return pieces.message(5, inner, present=rng.random(n) < 0.5)


def test_the_c_gather_writes_the_bytes_of_numpys():
    rng = np.random.default_rng(7)
    for n in (0, 1, 2, 257):
        pieces = random_pieces(rng, n)
        data, offsets = pieces.gather()
        want, want_offsets = pieces.gather_numpy()
        assert data.tobytes() == want.tobytes() and offsets.tolist() == want_offsets.tolist()
        assert offsets[-1] == pieces.length.sum()


@pytest.mark.parametrize(
    "segment, why",
    [
        ((np.zeros((4, 3), np.uint8), None, np.array([1, 4, 0, 0])), "a row longer than the matrix"),
        ((np.zeros(10, np.uint8), np.array([0, 8, 0, 0]), np.array([1, 3, 0, 0])), "past the buffer"),
        ((np.zeros(10, np.uint8), np.array([0, -1, 0, 0]), np.array([1, 1, 0, 0])), "a negative start"),
        ((np.zeros(10, np.uint8), np.array([0, 0, 0, 0]), np.array([1, -1, 0, 0])), "a negative length"),
        ((np.zeros(10, np.int32), np.array([0, 0, 0, 0]), np.array([1, 1, 0, 0])), "not bytes"),
        ((np.zeros((2, 3), np.uint8), None, np.array([1, 1, 1, 1])), "fewer rows than asked for"),
        ((np.zeros(10, np.uint8), np.array([0, 0]), np.array([1, 1])), "short start and length"),
    ],
)
def test_the_c_gather_refuses_a_read_outside_its_buffers(segment, why):
    data, start, length = segment
    total = int(np.clip(length, 0, None).sum())
    with pytest.raises(ValueError):
        wire._c_gather(4, total, [(data, start if start is not None else np.arange(4), length)])


def test_the_c_gather_refuses_lengths_that_do_not_add_up():
    segment = (np.arange(6, dtype=np.uint8).reshape(2, 3), np.arange(2), np.array([3, 2]))
    assert wire._c_gather(2, 5, [segment]) == bytes([0, 1, 2, 3, 4])
    for total in (4, 6):
        with pytest.raises(ValueError):
            wire._c_gather(2, total, [segment])


def python_span_ids(monkeypatch, *args) -> bytes:
    monkeypatch.setattr(wire, "_c_step_span_ids", None)
    return wire.step_span_ids(*args)


def test_the_c_span_ids_are_hashlibs_and_the_encoders(monkeypatch):
    """The C hash of a batch's step span ids: the bytes of the hashlib path, for every prefix length the
    one-block and multi-block cases meet (a 300-byte trace text spans three 128-byte blocks), negative
    and 19-digit numbers, and the span id SpanIds.step_span_id gives one step."""
    from llmobs.otlp.encoder import SpanIds

    rng = np.random.default_rng(11)
    prefixes = [
        f"step\x1f{pid}\x1f{'ab' * width}\x1f".encode() for pid, width in ((1, 16), (42, 0), (7, 150))
    ]
    n = 500
    prefix_of = rng.integers(0, len(prefixes), n)
    seq = rng.integers(-(2**62), 2**62, n)
    row = rng.integers(0, 64, n)
    seq[:3] = (0, -1, 2**63 - 1)
    ids = wire.step_span_ids(prefixes, prefix_of, seq, row)
    assert len(ids) == 8 * n
    assert ids == python_span_ids(monkeypatch, prefixes, prefix_of, seq, row)
    one = SpanIds.step_span_id(42, "", int(seq[5]), int(row[5]))
    assert wire.step_span_ids(prefixes, np.array([1]), seq[5:6], row[5:6]) == one


def test_the_c_span_ids_refuse_a_prefix_outside_their_buffer():
    with pytest.raises(ValueError, match="prefix"):
        wire._c_step_span_ids(b"abc", np.array([2]), np.array([5]), np.array([1]), np.array([0]))
    with pytest.raises(ValueError):  # fewer numbers than prefixes
        wire._c_step_span_ids(b"abc", np.array([0, 1]), np.array([1, 1]), np.array([1]), np.array([0, 0]))
