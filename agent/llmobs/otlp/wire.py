"""Protobuf wire format in bulk: one column of values -> one encoded field per row, all rows at once.

Why: building OTLP spans through the generated message classes costs a Python call per attribute (~60
per token-step span, ~1 µs each), which made the exporter's CPU per span its largest cost. Here each
attribute is a few numpy operations over the whole batch, and the bytes of every span are put together
by one gather at the end.

A `Pieces` is, per row, a sequence of byte segments (data array, start, length), nothing copied until
`gather`. Length prefixes are computed from segment lengths, so nesting (a KeyValue inside an AnyValue
inside a Span) never materialises the inner message. Fields are written in field-number order, as the
generated classes write them, so the bytes equal theirs.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa

try:  # the C gather (c/wire_gather.c), built at install; without a compiler, numpy's (same bytes)
    from llmobs.otlp._wire_gather import gather as _c_gather
except ImportError:
    _c_gather = None
try:  # its span-id hash, apart: a module built before it was added still gathers in C
    from llmobs.otlp._wire_gather import step_span_ids as _c_step_span_ids
except ImportError:
    _c_step_span_ids = None

_U64 = np.uint64


def gather_backend() -> str:
    """Which gather Pieces.gather uses: 'c' or 'numpy' (llmobs-agent doctor shows it)."""
    return "c" if _c_gather is not None else "numpy"


def span_ids_backend() -> str:
    """Which hash step_span_ids uses: 'c' or 'hashlib' (llmobs-agent doctor shows it)."""
    return "c" if _c_step_span_ids is not None else "hashlib"


def step_span_ids(prefixes: list[bytes], prefix_of: np.ndarray, seq: np.ndarray, row: np.ndarray) -> bytes:
    """8 bytes a row, back to back: BLAKE2b-64 of row i's prefix (prefixes[prefix_of[i]]) followed by
    "<seq[i]>\x1f<row[i]>", an all-zero digest made 01 00.. (an all-zero id is invalid in OTLP). In C
    where the module has it (c/wire_gather.c), else hashlib: the same bytes."""
    seq = np.ascontiguousarray(seq, dtype=np.int64)
    row = np.ascontiguousarray(row, dtype=np.int64)
    if _c_step_span_ids is not None:
        lengths = np.array([len(p) for p in prefixes], dtype=np.int64)
        starts = np.zeros(len(prefixes), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        return _c_step_span_ids(b"".join(prefixes), starts[prefix_of], lengths[prefix_of], seq, row)
    blake2b = hashlib.blake2b
    ids = bytearray(
        b"".join(
            [
                blake2b(prefixes[p] + f"{s}\x1f{r}".encode(), digest_size=8).digest()
                for p, s, r in zip(prefix_of.tolist(), seq.tolist(), row.tolist(), strict=True)
            ]
        )
    )
    for zero in np.flatnonzero(np.frombuffer(ids, np.uint64) == 0).tolist():
        ids[8 * zero] = 1
    return bytes(ids)


def varint_bytes(value: int) -> bytes:
    """One varint (a tag, a length) as bytes; negative int64 values take 10 bytes, as in protobuf."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint_bytes(field << 3 | wire_type)


class Pieces:
    """Per row, an ordered list of byte segments; `length` is each row's total."""

    __slots__ = ("n", "segments", "length", "_rows")

    def __init__(self, n: int):
        self.n = n
        self.segments: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (data, start[n], len[n])
        self.length = np.zeros(n, dtype=np.int64)
        self._rows = np.arange(n, dtype=np.int64)

    def add(self, data: np.ndarray, start: np.ndarray, length: np.ndarray) -> Pieces:
        self.segments.append((data, start, length))
        self.length += length
        return self

    def const(self, blob: bytes, present: np.ndarray | None = None) -> Pieces:
        """The same bytes in every row (or only where `present`)."""
        data = np.frombuffer(blob, dtype=np.uint8)
        length = np.full(self.n, len(blob), dtype=np.int64)
        if present is not None:
            length = np.where(present, length, 0)
        return self.add(data, np.zeros(self.n, dtype=np.int64), length)

    def matrix(self, matrix: np.ndarray, length: np.ndarray | None = None) -> Pieces:
        """Row i gets the first length[i] bytes of matrix[i] (an (n, w) uint8 array; all w if None)."""
        if length is None:
            length = np.full(self.n, matrix.shape[1], dtype=np.int64)
        return self.add(matrix, self._rows, length)  # 2-D data: row i of the matrix for row i

    def fixed(self, matrix: np.ndarray, present: np.ndarray | None = None) -> Pieces:
        """Row i gets the bytes of matrix[i] (an (n, w) uint8 array), or none where not `present`."""
        length = None
        if present is not None:
            length = np.where(present, matrix.shape[1], 0).astype(np.int64)
        return self.matrix(matrix, length)

    def varint(self, values: np.ndarray, present: np.ndarray | None = None) -> Pieces:
        matrix, length = varint_matrix(values)
        if present is not None:
            length = np.where(present, length, 0)
        return self.matrix(matrix, length)

    def extend(self, other: Pieces, present: np.ndarray | None = None) -> Pieces:
        for data, start, length in other.segments:
            self.add(data, start, length if present is None else np.where(present, length, 0))
        return self

    def message(self, field: int, inner: Pieces, present: np.ndarray | None = None) -> Pieces:
        """A length-delimited field holding `inner` (left out where not `present`)."""
        self.const(tag(field, 2), present)
        self.varint(inner.length, present)
        return self.extend(inner, present)

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """(bytes of every row, back to back; each row's start offset, n + 1 of them)."""
        if _c_gather is None:
            return self.gather_numpy()
        offsets = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(self.length, out=offsets[1:])
        joined = _c_gather(self.n, int(offsets[-1]), self.segments)
        return np.frombuffer(joined, np.uint8), offsets

    def gather_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """gather without the C extension, to the same bytes.

        Segments of a bounded width (constants, matrices, short strings) are laid side by side in one
        (rows x width) matrix and compressed by a mask of the bytes in use: one pass over bytes, no
        per-byte index arithmetic. Wide segments (a span's events) stay apart and are joined row by row."""
        n = self.n
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per row: (data, start, length)
        run: list[tuple[np.ndarray, np.ndarray]] = []  # (matrix (n, w) or (1, w), length) side by side

        def close_run() -> None:
            if not run:
                return
            width = sum(m.shape[1] for m, _ in run)
            matrix = np.empty((n, width), np.uint8)
            mask = np.empty((n, width), bool)
            column = 0
            for m, length in run:
                w = m.shape[1]
                matrix[:, column : column + w] = m
                if int(length.min()) == w:  # every row uses the whole width (ids, times, constants)
                    mask[:, column : column + w] = True
                else:
                    np.less(_ARANGE[:w][None, :], length[:, None], out=mask[:, column : column + w])
                column += w
            lengths = sum(length for _, length in run)
            offsets = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            parts.append((matrix[mask], offsets[:-1], lengths))
            run.clear()

        for data, start, length in self.segments:
            width = int(length.max()) if n else 0
            if width == 0:
                continue
            if data.ndim == 2:  # a matrix, row i at row i
                run.append((data, length))
            elif not start.any() and width <= len(data):  # a constant
                run.append((data[None, :width], length))
            elif width <= _NARROW:  # a short string: padded into the matrix
                index = np.minimum(start[:, None] + _ARANGE[:width][None, :], len(data) - 1)
                run.append((data[index], length))
            else:
                close_run()
                parts.append((data, start, length))
        close_run()
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.length, out=offsets[1:])
        if not parts:  # no rows, or every row empty
            return np.zeros(0, np.uint8), offsets
        if len(parts) == 1:
            return parts[0][0], offsets
        # Several parts, interleaved row by row: every part's bytes in one buffer, then one join of the
        # (row, part) slices in row-major order (one comprehension: no per-row loop over the parts).
        base = np.cumsum([0, *(len(d) for d, _, _ in parts[:-1])])
        whole = memoryview(np.concatenate([d for d, _, _ in parts]))
        starts = np.stack([s + b for (_, s, _), b in zip(parts, base, strict=True)], axis=1).ravel()
        ends = starts + np.stack([length for _, _, length in parts], axis=1).ravel()
        joined = b"".join([whole[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)])
        return np.frombuffer(joined, np.uint8), offsets


_NARROW = 128  # strings up to this many bytes are padded into the gather matrix
_ARANGE = np.arange(4096, dtype=np.int64)


def varint_matrix(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Varint bytes of each value (int64 two's complement, as protobuf writes int64): an (n, w) matrix,
    w the widest value's length, and each row's length."""
    v = np.asarray(values).astype(np.int64, copy=False).view(_U64)
    n = len(v)
    top = int(v.max()) if n else 0
    width = max(1, (top.bit_length() + 6) // 7)
    shifted = v[:, None] >> (np.arange(width, dtype=_U64) * _U64(7))[None, :]
    # bytes needed: how many of v >> 0, v >> 7, ... are non-zero (at least one byte, for 0)
    length = np.maximum(np.count_nonzero(shifted, axis=1), 1).astype(np.int64)
    matrix = (shifted & _U64(0x7F)).astype(np.uint8)
    if width > 1:
        more = np.arange(width - 1)[None, :] < (length[:, None] - 1)
        matrix[:, :-1] |= more.astype(np.uint8) << 7
    return matrix, length


def string_segments(
    array: pa.Array | pa.ChunkedArray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(utf-8 data, start, length, valid) of a string column, from its Arrow buffers (no copy per row)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks() if array.num_chunks != 1 else array.chunk(0)
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if not pa.types.is_large_string(array.type):
        array = array.cast(pa.large_string()) if not pa.types.is_string(array.type) else array
    n = len(array)
    valid = np.ones(n, dtype=bool) if array.null_count == 0 else ~np.asarray(array.is_null())
    buffers = array.buffers()
    offset_type = np.int64 if pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(buffers[1], dtype=offset_type)[array.offset : array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    length = np.where(valid, offsets[1:] - offsets[:-1], 0)
    return data, offsets[:-1], length, valid


def fixed64_matrix(values: np.ndarray) -> np.ndarray:
    """(n, 8) little-endian bytes of int64 / uint64 / float64 values (fixed64, sfixed64, double)."""
    return np.ascontiguousarray(values).view(np.uint8).reshape(-1, 8)
