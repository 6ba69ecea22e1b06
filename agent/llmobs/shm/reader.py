"""The agent side of the map: open a pid's map read-only, validate everything, decode batches.

The reader never maps the file: it reads with pread. A workload owns its file and could truncate
it at any moment; an mmap reader would then die of SIGBUS, a pread only comes back short. Every
size, offset and capacity in the header is checked against the layout before it is used, and every
record is read twice and kept only when both copies agree and carry the sequence word of the
position asked for (2*pos+2), so torn and overwritten records are counted, never returned.
"""

from __future__ import annotations

import errno
import functools
import itertools
import operator
import os
import re
import stat
import struct
from dataclasses import dataclass, field

import numpy as np

from llmobs.errors import AccessDenied, MalformedMap, NoSuchProcess, NotTracked
from llmobs.shm import intent_format, layout
from llmobs.shm.control import write_reader_tail
from llmobs.shm.hashing import trace_hex
from llmobs.shm.identity import ProcessIdentity, process_start_ticks
from llmobs.shm.writer import map_path

_HEADS = slice(layout.HEADER.offsets["names_head"], layout.HEADER.offsets["cupti_head"] + 8)
_LAYERS_HEAD = slice(layout.HEADER.offsets["layers_head"], layout.HEADER.offsets["layers_head"] + 8)
_REQUESTS_HEAD = slice(layout.HEADER.offsets["requests_head"], layout.HEADER.offsets["requests_head"] + 8)
_TICKS_AT = layout.HEADER.offsets["writer_start_ticks"]
_HEADER_NAMES = layout.HEADER.dtype.names
# The step record's checked words, as columns of the record seen as u64 / i32 words (one fancy index and
# one comparison per kind instead of a structured-field access and a comparison per field)
_STEP_FIELDS = layout.STEP_RECORD.dtype.fields
_U64 = {name: _STEP_FIELDS[name][1] // 8 for name in ("step_seq", "t_start_ns", "t_end_ns")}
_I32_FLOORED = ("batch_row", "kv_len", "target_rank", "token_id", "target_id")
_I32_COLUMNS = np.array([_STEP_FIELDS[name][1] // 4 for name in _I32_FLOORED])
_I32_FLOORS = np.array([0, -1, -1, -1, -1], np.int32)  # batch_row >= 0, the others >= -1
_FLAGS_COLUMN = _STEP_FIELDS["flags"][1] // 4
MAX_HEAD = 1 << 62  # a head beyond this cannot come from a real writer (and 2*pos+2 would overflow)
_KNOWN_FLAGS = (
    layout.FLAG_HAS_TARGET | layout.FLAG_GENERATE | layout.FLAG_TEACHER_FORCED | layout.FLAG_DEVICE_CUDA
    | layout.FLAG_PREFILL | layout.FLAG_SHADOW
)  # fmt: skip
_UNKNOWN_FLAGS = ~_KNOWN_FLAGS & 0xFFFFFFFF
_TOP = 1 << 63  # step_seq and CLOCK_MONOTONIC ns stay below it (they fit an int64)
_RING_HEADS = ("names_head", "steps_head", "cupti_head", "layers_head", "requests_head")
_ring_heads = operator.itemgetter(*_RING_HEADS)
# The header words a live writer moves: ring heads, drop counters, heartbeat, state, default model. The
# rest is fixed when the map is created, so once validated it is only compared (MapView._validated).
_MOVING_HEADER_WORDS = _RING_HEADS + (
    "state", "heartbeat_ns", "names_dropped", "steps_dropped", "cupti_dropped", "model_hash",
    "layers_dropped", "requests_dropped",
)  # fmt: skip
_WORD_CODES = {"u64": "Q", "u32": "I", "i32": "i", "f32": "I"}  # a float as its bits: a NaN keeps its payload
STEP_COLUMNS = [
    "pid", "step_seq", "trace_id", "step", "position", "token_id", "target_id", "loss", "entropy",
    "target_prob", "target_rank", "top1_prob", "latency_ns", "t_start_ns", "t_end_ns", "batch_row",
    "tenant", "session", "model_id", "kv_len", "tokens_in_pass", "request_seq", "request_id",
]  # fmt: skip
# v3 request-events ring, decoded (kind 'end' | 'chunk'; the derived queue/ttft/tpot are NULL-free ints,
# -1 where the request never reached that point)
REQUEST_EVENT_COLUMNS = [
    "pid", "kind", "request_seq", "request_id", "step_seq", "trace_id", "tenant", "session", "model_id",
    "t_start_ns", "t_scheduled_ns", "t_first_token_ns", "t_last_token_ns", "t_end_ns", "queue_ns", "ttft_ns",
    "tpot_ns", "prompt_tokens", "prefill_tokens", "decoded_tokens", "kv_blocks", "prefix_hit_tokens",
    "finish_reason", "position", "trace_from_caller", "parent_span_id", "trace_flags", "prompt_hash",
]  # fmt: skip
_REQUEST_KINDS = {layout.REQUEST_END: "end", layout.REQUEST_CHUNK: "chunk"}
LAYER_COLUMNS = ["pid", "step_seq", "trace_id", "batch_row", "layer", "head", "kind", "value"]
MAX_LAYER = 1 << 16  # no model has more layers or heads; a larger index is a corrupt record
MAX_REQUEST_IDS = 1 << 16  # request ids the reader keeps (a request's steps come long before 65k others)
MAX_LABELS = 8  # labels a request keeps (the workload's own cap, llmobs.publisher.labels)
MAX_MODEL_FACTORS = 4096  # (model, key) pairs the reader keeps
_LABEL = re.compile(r"([a-z][a-z0-9_.-]{0,31})=(.+)", re.DOTALL)  # a label or factor record's text
# the request-keyed tables a request's end brings out of the reader (rows at the end, once per request)
REQUEST_LABEL_COLUMNS = ["pid", "request_seq", "trace_id", "key", "value", "ts_ns"]
REQUEST_INTENT_COLUMNS = ["pid", "request_seq", "trace_id", "template_id", "simhash", "minhash", "action",
                          "output_format", "constraints", "ts_ns"]  # fmt: skip
MODEL_FACTOR_COLUMNS = ["pid", "model_id", "key", "value", "ts_ns"]


def _words_struct(s: layout.Struct) -> struct.Struct:
    """`s` as the struct module unpacks it: one Python int per field, in field order (a float: its bits)."""
    fmt, pos = "<", 0
    for f in s.fields:
        if f.count != 1:
            raise ValueError(f"{s.c_name}.{f.name} is an array: it has no one word to unpack")
        at = s.offsets[f.name]
        fmt += (f"{at - pos}x" if at > pos else "") + _WORD_CODES[f.type]
        pos = at + f.size
    return struct.Struct(fmt + (f"{s.size - pos}x" if s.size > pos else ""))


def _fixed_words_mask(s: layout.Struct, moving: tuple[str, ...]) -> int:
    """Ones over every byte of `s` (read as one little-endian int) but those of the `moving` fields."""
    mask = (1 << 8 * s.size) - 1
    for f in s.fields:
        if f.name in moving:
            mask &= ~(((1 << 8 * f.size) - 1) << 8 * s.offsets[f.name])
    return mask


_FIXED_HEADER_MASK = _fixed_words_mask(layout.HEADER, _MOVING_HEADER_WORDS)
# the moving words in header order, unpacked by one struct call (the fixed ones skipped as padding)
_MOVING_NAMES = tuple(f.name for f in layout.HEADER.fields if f.name in _MOVING_HEADER_WORDS)
_MOVING_WORDS = struct.Struct("<" + "".join(
    _WORD_CODES[f.type] if f.name in _MOVING_HEADER_WORDS else f"{f.size}x" for f in layout.HEADER.fields
))  # fmt: skip
# The small-read path (a poll of a few token steps: the common case at a slowly stepping target, where
# a read's fixed numpy set-up cost far more than its records). A record is unpacked by the struct module
# into Python ints; _AT: a field's index in that tuple.
_STEP_WORDS = _words_struct(layout.STEP_RECORD)
_AT = {f.name: i for i, f in enumerate(layout.STEP_RECORD.fields)}
_SEQ, _STEP_SEQ, _T_START, _T_END, _FLAGS = (
    _AT[k] for k in ("seq", "step_seq", "t_start_ns", "t_end_ns", "flags")
)
_BATCH_ROW, _KV_LEN, _TARGET_RANK, _TOKEN_ID, _TARGET_ID = (_AT[k] for k in _I32_FLOORED)
_TRACE_HI, _TRACE_LO, _TENANT, _SESSION, _MODEL, _REQUEST_SEQ = (
    _AT[k] for k in ("trace_id_hi", "trace_id_lo", "tenant_hash", "session_hash", "model_hash", "request_seq")
)
# Its numeric columns are packed one after another into one buffer (one struct call) and handed out as
# the rows of one array per dtype: int32 columns, float32 columns, int64 columns (the record's, then
# pid and latency_ns), shadow. An int32 or float32 column is packed as the record's own bits ("I" from a
# u32 or a float, "i" from an i32): what _decode_steps' astype gives (a u32 wraps into int32 alike, a
# float copy keeps its bits); an int64 column fits "q" once its record is sane.
_FEW_INT32 = ("target_rank", "batch_row", "kv_len", "tokens_in_pass")
_FEW_FLOAT32 = ("loss", "entropy", "target_prob", "top1_prob")
_FEW_INT64 = ("step_seq", "step", "position", "token_id", "target_id", "t_start_ns", "t_end_ns",
              "request_seq")  # fmt: skip
_FEW_COMPUTED = ("pid", "latency_ns")  # int64 columns too, after the record's
_FEW_FIELDS = operator.itemgetter(
    *(_AT[k] for k in _FEW_INT32 + _FEW_FLOAT32 + _FEW_INT64)
)  # in packing order
_STEP_TYPES = {f.name: f.type for f in layout.STEP_RECORD.fields}
_FEW_CODES = (
    "".join(_WORD_CODES[_STEP_TYPES[k]] for k in _FEW_INT32 + _FEW_FLOAT32)
    + "q" * (len(_FEW_INT64) + len(_FEW_COMPUTED)) + "?"
)  # fmt: skip


@functools.lru_cache(maxsize=128)
def _few_columns_struct(n: int) -> struct.Struct:
    """The packing of n rows' numeric columns: _FEW_INT32, _FEW_FLOAT32, _FEW_INT64, _FEW_COMPUTED, shadow."""
    return struct.Struct("<" + "".join(f"{n}{code}" for code in _FEW_CODES))


class BufferSource:
    """Reads from an in-memory copy of a map (tests, the fuzzer, a recorded blob)."""

    def __init__(self, data: bytes | bytearray | memoryview):
        self.data = memoryview(data).cast("B")
        self.size = len(self.data)

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise MalformedMap(
                f"read of {length} bytes at offset {offset} is outside the {self.size}-byte map"
            )
        return bytes(self.data[offset : offset + length])


class FileSource:
    """Reads a map file with pread: a file truncated under us gives a short read, never a SIGBUS."""

    def __init__(self, fd: int, size: int, path: str):
        self.fd, self.size, self.path = fd, size, path

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise MalformedMap(
                f"read of {length} bytes at offset {offset} is outside the {self.size}-byte map"
            )
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise MalformedMap(f"{self.path} shrank while being read (got {len(data)} of {length} bytes)")
        return data

    def close(self) -> None:
        os.close(self.fd)


# A file that is not a map at all (no magic, no room for a header) is not an ABI mismatch: say so.
NOT_A_MAP_HINT = (
    'the file does not start with an llmobs header ("LLMOBSMP"): some other program wrote it, or it was '
    "cut short; remove it (an instrumented process creates its own map)"
)


def validate_header(raw: bytes, file_size: int) -> dict:
    """Check a header against the layout and the file size; return its fields as ints."""
    if file_size < layout.HEADER.size or len(raw) < layout.HEADER.size:
        raise MalformedMap(
            f"map is {file_size} bytes, smaller than its {layout.HEADER.size}-byte header",
            hint=NOT_A_MAP_HINT,
        )
    # tolist() gives Python ints already: one dict() call (a dict comprehension of int()s was a tenth
    # of a small read)
    h = dict(zip(_HEADER_NAMES, np.frombuffer(raw, layout.HEADER.dtype, 1)[0].tolist(), strict=True))
    h.pop("reserved", None)
    if h["magic"] != layout.MAGIC:
        raise MalformedMap(f"bad magic 0x{h['magic']:016x}: not an llmobs map", hint=NOT_A_MAP_HINT)
    version = h["abi_version"]
    if version not in layout.READ_VERSIONS:
        readable = " and ".join(str(v) for v in layout.READ_VERSIONS)
        raise MalformedMap(f"map has ABI version {version}, this agent reads versions {readable}")
    if h["layout_hash"] != layout.LAYOUT_HASHES[version] or h["header_size"] != layout.HEADER.size:
        raise MalformedMap("map layout differs from this agent's layout although the ABI version matches")
    v3 = version >= 3  # v2: the request-events words are reserved (zero): no such ring
    sizes = [
        ("name_record_size", layout.NAME_RECORD.size),
        ("step_record_size", layout.STEP_RECORD.size),
        ("cupti_record_size", layout.CUPTI_RECORD.size),
        ("layer_record_size", layout.LAYER_RECORD.size),
        ("request_record_size", layout.REQUEST_RECORD.size if v3 else 0),
    ]
    for name, expected in sizes:
        if h[name] != expected:
            raise MalformedMap(f"header {name} is {h[name]}, expected {expected}")
    capacities = ["names_capacity", "steps_capacity", "cupti_capacity", "layers_capacity"]
    if v3:
        capacities.append("requests_capacity")
    elif h["requests_capacity"] or h["requests_offset"] or h["requests_head"] or h["requests_dropped"]:
        raise MalformedMap("a version 2 map has non-zero reserved header words")
    for name in capacities:
        if not layout.is_valid_capacity(h[name]):
            raise MalformedMap(f"header {name} {h[name]} is not a power of two in 1..{layout.MAX_CAPACITY}")
    regions = layout.regions(
        h["names_capacity"], h["steps_capacity"], h["cupti_capacity"], h["layers_capacity"],
        h["requests_capacity"],
    )  # fmt: skip
    expected_offsets = {
        "ctx_offset": layout.CTX_OFFSET,
        "control_offset": layout.CONTROL_OFFSET,
        "names_offset": regions.names_offset,
        "steps_offset": regions.steps_offset,
        "cupti_offset": regions.cupti_offset,
        "layers_offset": regions.layers_offset,
        "requests_offset": regions.requests_offset,
        "layout_size": regions.layout_size,
    }
    for name, expected in expected_offsets.items():
        if h[name] != expected:
            raise MalformedMap(f"header {name} is {h[name]}, the layout puts it at {expected}")
    if h["layout_size"] != file_size:
        raise MalformedMap(f"header says the map is {h['layout_size']} bytes but the file is {file_size}")
    if h["clock_id"] != layout.CLOCK_MONOTONIC:
        raise MalformedMap(f"unknown clock id {h['clock_id']} (expected 1 = CLOCK_MONOTONIC)")
    if h["state"] not in (layout.STATE_LIVE, layout.STATE_CLOSED):
        raise MalformedMap(f"unknown map state {h['state']}")
    for name in _RING_HEADS:
        if h[name] >= MAX_HEAD:
            raise MalformedMap(f"header {name} {h[name]} is impossibly large")
    return h


def _moving_words_valid(h: dict) -> bool:
    """validate_header's checks of the words a live writer moves (_MOVING_HEADER_WORDS), the fixed words
    being valid: a v2 map's reserved request words stay zero, the state is known, no head is too large."""
    if h["abi_version"] < 3 and (h["requests_head"] or h["requests_dropped"]):
        return False
    return h["state"] in (layout.STATE_LIVE, layout.STATE_CLOSED) and max(_ring_heads(h)) < MAX_HEAD


@dataclass
class RingRead:
    """What one read of a ring returned: valid records, and what could not be returned, counted."""

    records: np.ndarray
    positions: np.ndarray
    next_cursor: int
    lost: int = 0  # positions overwritten before we read them (the writer lapped us)
    corrupt: int = 0  # committed-looking records that failed validation


@dataclass
class StepBatch:
    """Decoded token steps as columns (the names agreed in notes/records.md), plus loss accounting."""

    columns: dict[str, list | np.ndarray]
    lost: int
    corrupt: int
    next_cursor: int
    raw: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, layout.STEP_RECORD.dtype))

    def __len__(self) -> int:
        return len(self.columns["step_seq"])

    def rows(self) -> list[dict]:
        names = list(self.columns)
        cols = [self.columns[n] for n in names]
        return [
            {
                n: (c[i].item() if isinstance(c, np.ndarray) else c[i])
                for n, c in zip(names, cols, strict=True)
            }
            for i in range(len(self))
        ]


@dataclass
class LayerBatch:
    """Decoded layer-stream records (LAYER_COLUMNS), plus loss accounting."""

    columns: dict[str, list | np.ndarray]
    lost: int
    corrupt: int
    next_cursor: int

    def __len__(self) -> int:
        return len(self.columns["step_seq"])


@dataclass
class RequestBatch:
    """Decoded request events (REQUEST_EVENT_COLUMNS, v3), plus loss accounting."""

    columns: dict[str, list | np.ndarray]
    lost: int
    corrupt: int
    next_cursor: int
    # request_labels / request_intents rows of the requests that ended in this batch (table -> columns)
    facts: dict[str, dict] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["kind"])


class MapView:
    """A validated map, read through a source (a file or a buffer). The same code serves both."""

    # reads of at most this many token steps take the small-read path (_few_steps); 0: never (tests
    # compare both paths on the same map)
    small_read = 32

    def __init__(self, source, expected_pid: int | None = None):
        self.source = source
        # the header's fixed words as last validated, and that header's fields (_validated)
        self._fixed_header: int | None = None
        self._fixed_fields: dict = {}
        self.header = self._validated(source.read(0, layout.HEADER.size))
        if expected_pid is not None and self.header["writer_pid"] != expected_pid:
            raise MalformedMap(f"map names writer pid {self.header['writer_pid']}, expected {expected_pid}")
        self.names: dict[int, str] = {}
        self.name_kinds: dict[int, int] = {}
        self.request_ids: dict[int, str] = {}  # v3: request_seq -> the engine's request id
        # v3: request_seq -> (parent span id hex, trace flags, prompt-hash trace id hex) of a request that
        # joined its caller's trace (NAME_TRACE_CONTEXT)
        self.trace_contexts: dict[int, tuple[str, int, str]] = {}
        # request_seq -> its labels {key: value} (NAME_REQUEST_LABEL) and its intent (NAME_REQUEST_INTENT),
        # bounded like the trace contexts; both leave at the request's end (RequestBatch.facts)
        self.request_labels: dict[int, dict[str, str]] = {}
        self.request_intents: dict[int, intent_format.Intent] = {}
        # (model hash, key) -> value (NAME_MODEL_FACTOR); the pairs not handed out yet (fresh_model_factors)
        self.model_factors: dict[tuple[int, str], str] = {}
        self._fresh_factors: set[tuple[int, str]] = set()
        self._names_cursor = 0
        self._no_steps: dict | None = None  # decode_steps of no records (its arrays are empty: shared)
        self._no_layers: dict | None = None  # the same for the layer streams

    def refresh(self) -> dict:
        """Re-read the live header (heads, counters) and validate it again. The header is read until
        two reads agree (bounded), so a head word caught mid-update is not used."""
        raw = self.source.read(0, layout.HEADER.size)
        for _ in range(8):
            again = self.source.read(0, layout.HEADER.size)
            if again == raw or (again[_HEADS] == raw[_HEADS] and again[_LAYERS_HEAD] == raw[_LAYERS_HEAD]
                                and again[_REQUESTS_HEAD] == raw[_REQUESTS_HEAD]):  # fmt: skip
                break  # (equal reads, the common case, agree on every head: no slices to compare)
            raw = again
        self.header = self._validated(raw)
        return self.header

    def _validated(self, raw: bytes) -> dict:
        """validate_header(raw, file size), without redoing it each read: when the fixed words are those
        validated last, only validate_header's checks of the moving words are made (heads, state, a v2
        map's reserved words). Anything else, failed checks included, goes through validate_header, so
        every map gives what validate_header gives, its errors too."""
        fixed = int.from_bytes(raw, "little") & _FIXED_HEADER_MASK
        if fixed == self._fixed_header and len(raw) == layout.HEADER.size:
            h = self._fixed_fields.copy()  # (a copy keeps validate_header's key order)
            h.update(zip(_MOVING_NAMES, _MOVING_WORDS.unpack(raw), strict=True))
            if _moving_words_valid(h):
                return h
        h = validate_header(raw, self.source.size)
        self._fixed_header, self._fixed_fields = fixed, dict(h)  # our own copy: callers may change theirs
        return h

    def context(self, tries: int = 100) -> dict | None:
        """The current-context cell, read under its seqlock (None if it never held still)."""
        size = layout.CTX_CELL.size
        for _ in range(tries):
            a = self.source.read(layout.CTX_OFFSET, size)
            b = self.source.read(layout.CTX_OFFSET, size)
            cell = np.frombuffer(a, layout.CTX_CELL.dtype, 1)[0]
            if a == b and int(cell["seq"]) % 2 == 0:
                return {
                    "seq": int(cell["seq"]),
                    "trace_id": trace_hex(int(cell["trace_id_hi"]), int(cell["trace_id_lo"])),
                    "step_seq": int(cell["step_seq"]),
                    "tenant_hash": int(cell["tenant_hash"]),
                    "session_hash": int(cell["session_hash"]),
                    "rows": int(cell["rows"]),  # v3 (zero in a v2 map)
                    "flags": int(cell["flags"]),
                    "tokens": int(cell["tokens"]),
                }
        return None

    def control(self) -> dict:
        raw = self.source.read(layout.CONTROL_OFFSET, layout.CONTROL.size)
        rec = np.frombuffer(raw, layout.CONTROL.dtype, 1)[0]
        return {k: int(rec[k]) for k in layout.CONTROL.dtype.names if k != "reserved"}

    # --- rings ------------------------------------------------------------------------------------
    def _read_ring(self, struct: layout.Struct, offset: int, cap: int, head: int, cursor: int,
                   limit: int | None) -> RingRead:  # fmt: skip
        start, lost, end = _ring_span(cap, head, cursor, limit)
        if end == start:
            return RingRead(np.zeros(0, struct.dtype), np.zeros(0, np.uint64), start, lost)
        a, b = self._read_twice(struct.size, offset, cap, start, end)
        return _sort_records(struct, a, b, start, end, lost)

    def _read_twice(self, rec: int, offset: int, cap: int, start: int, end: int) -> tuple[bytes, bytes]:
        """Positions start..end of a ring, read twice: a record that differs between the reads was torn."""
        n = end - start
        slot = start & (cap - 1)
        first = min(n, cap - slot)

        def once() -> bytes:
            data = self.source.read(offset + slot * rec, first * rec)
            if first < n:
                data += self.source.read(offset, (n - first) * rec)
            return data

        return once(), once()

    def read_names(self) -> int:
        """Fold new names-ring records into self.names; returns how many were corrupt."""
        h = self.header
        if h["names_head"] == self._names_cursor:  # no new name (most polls): nothing to read or set up
            return 0
        got = self._read_ring(layout.NAME_RECORD, h["names_offset"], h["names_capacity"], h["names_head"],
                              self._names_cursor, None)  # fmt: skip
        corrupt = got.corrupt
        for r in got.records:
            length, kind = int(r["length"]), int(r["kind"])
            if length > layout.NAME_TEXT_BYTES or not layout.NAME_TENANT <= kind <= layout.NAME_KIND_MAX:
                corrupt += 1
                continue
            if kind == layout.NAME_REQUEST_INTENT:  # binary: ids and hashes (shm/intent_format.py)
                corrupt += not self._keep_intent(int(r["hash"]), bytes(r["text"][:length]))
                continue
            text = bytes(r["text"][:length]).decode("utf-8", "replace")
            if kind in (layout.NAME_REQUEST_LABEL, layout.NAME_MODEL_FACTOR):  # hash: a request_seq, a model
                corrupt += not self._keep_label(kind, int(r["hash"]), text)
                continue
            if kind == layout.NAME_TRACE_CONTEXT:  # keyed by request_seq, like NAME_REQUEST
                context = _trace_context(text)
                if context is None:
                    corrupt += 1
                    continue
                if len(self.trace_contexts) >= MAX_REQUEST_IDS:
                    self.trace_contexts.pop(next(iter(self.trace_contexts)))
                self.trace_contexts[int(r["hash"])] = context
                continue
            if kind == layout.NAME_REQUEST:  # its hash word is the request_seq: a namespace of its own
                if len(self.request_ids) >= MAX_REQUEST_IDS:
                    self.request_ids.pop(next(iter(self.request_ids)))  # bounded: the oldest goes
                self.request_ids[int(r["hash"])] = text
                continue
            self.names[int(r["hash"])] = text
            self.name_kinds[int(r["hash"])] = kind
        self._names_cursor = got.next_cursor
        return corrupt

    def _keep_intent(self, request_seq: int, data: bytes) -> bool:
        intent = intent_format.unpack(data)
        if intent is None or not request_seq:
            return False
        if request_seq not in self.request_intents and len(self.request_intents) >= MAX_REQUEST_IDS:
            self.request_intents.pop(next(iter(self.request_intents)))
        self.request_intents[request_seq] = intent
        return True

    def _keep_label(self, kind: int, h: int, text: str) -> bool:
        match = _LABEL.fullmatch(text)
        if match is None or not h:
            return False
        key, value = match.groups()
        if kind == layout.NAME_MODEL_FACTOR:
            if self.model_factors.get((h, key)) != value:
                if (h, key) not in self.model_factors and len(self.model_factors) >= MAX_MODEL_FACTORS:
                    return True  # bounded: a factor past the cap is not kept (not corrupt either)
                self.model_factors[(h, key)] = value
                self._fresh_factors.add((h, key))
            return True
        labels = self.request_labels.get(h)
        if labels is None:
            if len(self.request_labels) >= MAX_REQUEST_IDS:
                self.request_labels.pop(next(iter(self.request_labels)))
            labels = self.request_labels[h] = {}
        if key in labels or len(labels) < MAX_LABELS:  # a republished label replaces itself
            labels[key] = value
        return True

    def fresh_model_factors(self, ts_ns: int) -> dict | None:
        """model_factors rows (MODEL_FACTOR_COLUMNS) of the (model, key) pairs new or changed since the
        last call, for models whose id the names ring has told us (the others wait for it)."""
        rows = [(self.names[h], key, self.model_factors[(h, key)]) for h, key in sorted(self._fresh_factors,
                key=lambda x: (x[0], x[1])) if h in self.names]  # fmt: skip
        if not rows:
            return None
        self._fresh_factors = {(h, k) for h, k in self._fresh_factors if h not in self.names}
        return {
            "pid": np.full(len(rows), self.header["writer_pid"], np.int32),
            "model_id": [r[0] for r in rows],
            "key": [r[1] for r in rows],
            "value": [r[2] for r in rows],
            "ts_ns": np.full(len(rows), ts_ns, np.int64),
        }

    def request_facts(self, seqs: list[int], traces: list[str], ts_ns: list[int]) -> dict[str, dict]:
        """request_labels / request_intents rows of the requests that just ended (`seqs`, their trace ids
        and end times); each request's labels and intent leave the reader with them (once)."""
        pid = self.header["writer_pid"]
        labels = {c: [] for c in REQUEST_LABEL_COLUMNS}
        intents = {c: [] for c in REQUEST_INTENT_COLUMNS}
        for seq, trace, ts in zip(seqs, traces, ts_ns, strict=True):
            for key, value in self.request_labels.pop(seq, {}).items():
                for column, v in zip(REQUEST_LABEL_COLUMNS, (pid, seq, trace, key, value, ts), strict=True):
                    labels[column].append(v)
            intent = self.request_intents.pop(seq, None)
            if intent is not None:
                row = (pid, seq, trace, f"{intent.template_id:016x}", intent.simhash,
                       intent_format.minhash_hex(intent.minhash), intent.action, intent.output_format,
                       intent.constraints_text(), ts)  # fmt: skip
                for column, v in zip(REQUEST_INTENT_COLUMNS, row, strict=True):
                    intents[column].append(v)
        facts = {}
        if labels["pid"]:
            facts["request_labels"] = labels
        if intents["pid"]:
            intents["simhash"] = np.array(intents["simhash"], np.uint64)  # UBIGINT: above int64's range
            facts["request_intents"] = intents
        return facts

    def name(self, h: int) -> str:
        return self.names.get(h, "") if h else ""

    def read_steps(self, cursor: int = 0, limit: int | None = None, refresh: bool = True) -> StepBatch:
        """Token steps from position `cursor` on, decoded into the agreed columns."""
        if refresh:
            self.refresh()
        h = self.header
        corrupt = self.read_names()
        cap, head = h["steps_capacity"], h["steps_head"]
        start, lost, end = _ring_span(cap, head, cursor, limit)
        if 0 < end - start <= self.small_read:
            a, b = self._read_twice(layout.STEP_RECORD.size, h["steps_offset"], cap, start, end)
            few = self._few_steps(a, b, start, end)
            if few is not None:
                columns, recs, bad = few
                return StepBatch(columns, lost, corrupt + bad, end, recs)
            got = _sort_records(layout.STEP_RECORD, a, b, start, end, lost)  # not all committed: sort them
        else:
            got = self._read_ring(layout.STEP_RECORD, h["steps_offset"], cap, head, cursor, limit)
        recs = got.records
        if len(recs):
            ok = _sane_steps(recs)
            bad = len(recs) - int(np.count_nonzero(ok))
            if bad:
                recs = recs[ok]
            corrupt += bad
        corrupt += got.corrupt
        return StepBatch(self.decode_steps(recs), got.lost, corrupt, got.next_cursor, recs)

    def _few_steps(self, a: bytes, b: bytes, start: int, end: int) -> tuple[dict, np.ndarray, int] | None:
        """The small-read path: positions start..end read twice (a, b), checked and decoded as the
        general path does (_sort_records, _sane_steps, _decode_steps) when both reads agree and every
        record is committed, the common case; then (columns, the kept records, corrupt). None otherwise:
        a torn, overwritten or unfinished record is the general path's to sort out."""
        if a != b:
            return None
        records = list(_STEP_WORDS.iter_unpack(a))
        if [r[_SEQ] for r in records] != list(range(2 * start + 2, 2 * end + 2, 2)):
            return None
        sane = [_is_sane_step(r) for r in records]
        if not all(sane):
            size = layout.STEP_RECORD.size
            a = b"".join(a[size * i : size * i + size] for i, ok in enumerate(sane) if ok)
            records = [r for r, ok in zip(records, sane, strict=True) if ok]
            if not records:
                recs = np.zeros(0, layout.STEP_RECORD.dtype)
                return self.decode_steps(recs), recs, len(sane)
        # a bytearray: the records handed out are writable, like the general path's copies
        recs = np.frombuffer(bytearray(a), layout.STEP_RECORD.dtype, len(records))
        return self._decode_few_steps(records), recs, len(sane) - len(records)

    def _decode_few_steps(self, records: list[tuple]) -> dict[str, list | np.ndarray]:
        """_decode_steps of a few records unpacked by _STEP_WORDS: the same columns (keys, order, dtypes,
        values) from one struct call and one array per dtype, not a numpy set-up per column."""
        n = len(records)
        fields = list(zip(*records, strict=True))  # a field's index in the record -> its n values
        latency = [e - s for s, e in zip(fields[_T_START], fields[_T_END], strict=True)]
        shadow = [bool(f & layout.FLAG_SHADOW) for f in fields[_FLAGS]]
        packing = _few_columns_struct(n)
        buf = bytearray(packing.size)
        packing.pack_into(buf, 0, *itertools.chain.from_iterable(_FEW_FIELDS(fields)),
                          *(self.header["writer_pid"],) * n, *latency, *shadow)  # fmt: skip
        i32 = np.ndarray((len(_FEW_INT32), n), np.int32, buf)
        at = 4 * len(_FEW_INT32) * n
        f32 = np.ndarray((len(_FEW_FLOAT32), n), np.float32, buf, at)
        at += 4 * len(_FEW_FLOAT32) * n
        i64 = np.ndarray((len(_FEW_INT64) + len(_FEW_COMPUTED), n), np.int64, buf, at)
        at += 8 * (len(_FEW_INT64) + len(_FEW_COMPUTED)) * n
        c = dict(zip(_FEW_INT32, i32, strict=True))
        c.update(zip(_FEW_FLOAT32, f32, strict=True))
        c.update(zip(_FEW_INT64 + _FEW_COMPUTED, i64, strict=True))
        name = self.name
        return {
            "pid": c["pid"],
            "step_seq": c["step_seq"],
            "trace_id": [
                f"{hi:016x}{lo:016x}" for hi, lo in zip(fields[_TRACE_HI], fields[_TRACE_LO], strict=True)
            ],
            "step": c["step"],
            "position": c["position"],
            "token_id": c["token_id"],
            "target_id": c["target_id"],
            "loss": c["loss"],
            "entropy": c["entropy"],
            "target_prob": c["target_prob"],
            "target_rank": c["target_rank"],
            "top1_prob": c["top1_prob"],
            "latency_ns": c["latency_ns"],
            "t_start_ns": c["t_start_ns"],
            "t_end_ns": c["t_end_ns"],
            "batch_row": c["batch_row"],
            "tenant": [name(x) for x in fields[_TENANT]],
            "session": [name(x) for x in fields[_SESSION]],
            "model_id": [name(x) for x in fields[_MODEL]],
            "kv_len": c["kv_len"],
            "tokens_in_pass": c["tokens_in_pass"],
            "request_seq": c["request_seq"],
            "request_id": [self.request_ids.get(x, "") if x else "" for x in fields[_REQUEST_SEQ]],
            "shadow": np.ndarray((n,), np.bool_, buf, at),
        }

    def decode_steps(self, recs: np.ndarray) -> dict[str, list | np.ndarray]:
        if len(recs):
            return self._decode_steps(recs)
        if self._no_steps is None:  # an idle poll: the empty columns, built once (fresh lists each time)
            self._no_steps = self._decode_steps(recs)
        return {k: [] if isinstance(v, list) else v for k, v in self._no_steps.items()}

    def _decode_steps(self, recs: np.ndarray) -> dict[str, list | np.ndarray]:
        pid = self.header["writer_pid"]
        n = len(recs)
        words = np.empty((n, 2), ">u8")  # big-endian words: their bytes are the trace id
        words[:, 0], words[:, 1] = recs["trace_id_hi"], recs["trace_id_lo"]
        hexes = words.tobytes().hex()
        t_start = recs["t_start_ns"].astype(np.int64)
        t_end = recs["t_end_ns"].astype(np.int64)
        names = {}
        for key, col in (("tenant", "tenant_hash"), ("session", "session_hash"), ("model_id", "model_hash")):
            names[key] = [self.name(x) for x in recs[col].tolist()]
        return {
            "pid": np.full(n, pid, np.int64),
            "step_seq": recs["step_seq"].astype(np.int64),
            "trace_id": [hexes[32 * i : 32 * i + 32] for i in range(n)],
            "step": recs["step"].astype(np.int64),
            "position": recs["position"].astype(np.int64),
            "token_id": recs["token_id"].astype(np.int64),
            "target_id": recs["target_id"].astype(np.int64),
            "loss": recs["loss"].astype(np.float32),
            "entropy": recs["entropy"].astype(np.float32),
            "target_prob": recs["target_prob"].astype(np.float32),
            "target_rank": recs["target_rank"].astype(np.int32),
            "top1_prob": recs["top1_prob"].astype(np.float32),
            "latency_ns": t_end - t_start,
            "t_start_ns": t_start,
            "t_end_ns": t_end,
            "batch_row": recs["batch_row"].astype(np.int32),
            "tenant": names["tenant"],
            "session": names["session"],
            "model_id": names["model_id"],
            "kv_len": recs["kv_len"].astype(np.int32),
            "tokens_in_pass": recs["tokens_in_pass"].astype(np.int32),  # v3; a v2 record: 0 (unknown)
            "request_seq": recs["request_seq"].astype(np.int64),  # v3; 0 = none
            "request_id": [self.request_ids.get(x, "") if x else "" for x in recs["request_seq"].tolist()],
            # a shadow model's score of a primary's token (store-only: not one of STEP_COLUMNS)
            "shadow": (recs["flags"] & np.uint32(layout.FLAG_SHADOW)) != 0,
        }

    def read_layers(self, cursor: int = 0, limit: int | None = None, refresh: bool = True) -> LayerBatch:
        """Layer-stream records (v2) from position `cursor` on, validated like the token steps."""
        if refresh:
            self.refresh()
        h = self.header
        # the head did not move since the last read (no layer streams, the common case): nothing is read
        # (the empty ring's read and its columns' set-up were ~0.18 ms a poll at a slowly stepping
        # target); a cursor ahead of the head (a restarted writer) is _read_ring's to say
        if h["layers_head"] == cursor:
            if self._no_layers is None:  # the empty columns, decoded once (fresh lists each time)
                self._no_layers = self._decode_layers(np.zeros(0, layout.LAYER_RECORD.dtype))
            empty = {k: [] if isinstance(v, list) else v for k, v in self._no_layers.items()}
            return LayerBatch(empty, 0, 0, cursor)
        got = self._read_ring(layout.LAYER_RECORD, h["layers_offset"], h["layers_capacity"], h["layers_head"],
                              cursor, limit)  # fmt: skip
        recs = got.records
        ok = (
            (recs["step_seq"] >= 1)
            & (recs["step_seq"] < np.uint64(1 << 63))
            & (recs["batch_row"] >= 0)
            & (recs["layer"] >= 0)
            & (recs["layer"] < MAX_LAYER)
            & (recs["head"] >= layout.HEAD_MEAN)
            & (recs["head"] < MAX_LAYER)
            & (recs["kind"] >= 1)
            & (recs["kind"] < layout.LAYER_KIND_MAX)
            & ((recs["flags"] & ~np.uint32(layout.FLAG_DEVICE_CUDA)) == 0)
        )
        corrupt = got.corrupt + int((~ok).sum())
        return LayerBatch(self._decode_layers(recs[ok]), got.lost, corrupt, got.next_cursor)

    def _decode_layers(self, recs: np.ndarray) -> dict[str, list | np.ndarray]:
        n = len(recs)
        words = np.empty((n, 2), ">u8")
        words[:, 0], words[:, 1] = recs["trace_id_hi"], recs["trace_id_lo"]
        hexes = words.tobytes().hex()
        return {
            "pid": np.full(n, self.header["writer_pid"], np.int64),
            "step_seq": recs["step_seq"].astype(np.int64),
            "trace_id": [hexes[32 * i : 32 * i + 32] for i in range(n)],
            "batch_row": recs["batch_row"].astype(np.int32),
            "layer": recs["layer"].astype(np.int32),
            "head": recs["head"].astype(np.int32),
            "kind": recs["kind"].astype(np.int32),
            "value": recs["value"].astype(np.float32),
        }

    def read_request_events(self, cursor: int = 0, limit: int | None = None,
                            refresh: bool = True) -> RequestBatch:  # fmt: skip
        """v3 request-events records (REQUEST_EVENT_COLUMNS) from `cursor` on; a v2 map has none."""
        if refresh:
            self.refresh()
        h = self.header
        # no ring (a v2 map), or its head did not move since the last read (a target that serves no
        # requests: the common case): the header said so, nothing else is read (a full read of the
        # empty ring, the names ring and the decoding setup cost ~0.7 ms). The cursor-ahead-of-head
        # check (a restarted writer) is _read_ring's, reached as soon as the head moves.
        if not h["requests_capacity"] or h["requests_head"] == cursor:
            return RequestBatch({c: [] for c in REQUEST_EVENT_COLUMNS}, 0, 0, cursor)
        corrupt = self.read_names()  # request ids come through the names ring just before their events
        got = self._read_ring(layout.REQUEST_RECORD, h["requests_offset"], h["requests_capacity"],
                              h["requests_head"], cursor, limit)  # fmt: skip
        recs = got.records
        times = ("t_start_ns", "t_scheduled_ns", "t_first_token_ns", "t_last_token_ns", "t_end_ns")
        ok = np.isin(recs["kind"], list(_REQUEST_KINDS)) & (recs["request_seq"] >= 1)
        for name in times:
            ok &= recs[name] < np.uint64(1 << 63)
        end = recs["kind"] == layout.REQUEST_END
        ok &= ~end | (recs["finish_reason"] <= max(layout.FINISH_REASONS))
        recs = recs[ok]
        end = recs["kind"] == layout.REQUEST_END
        n = len(recs)
        words = np.empty((n, 2), ">u8")
        words[:, 0], words[:, 1] = recs["trace_id_hi"], recs["trace_id_lo"]
        hexes = words.tobytes().hex()
        t = {name: recs[name].astype(np.int64) for name in times}

        def since(later: np.ndarray, earlier: np.ndarray) -> np.ndarray:  # -1 where either is unknown
            return np.where((later > 0) & (earlier > 0), later - earlier, -1)

        decoded = recs["decoded_tokens"].astype(np.int64)
        tpot = np.where(
            end & (decoded > 1) & (t["t_first_token_ns"] > 0),
            (t["t_last_token_ns"] - t["t_first_token_ns"]) // np.maximum(decoded - 1, 1),
            -1,
        )
        seqs = recs["request_seq"].tolist()
        traces = [hexes[32 * i : 32 * i + 32] for i in range(n)]
        columns = {
            "pid": np.full(n, h["writer_pid"], np.int64),
            "kind": [_REQUEST_KINDS[k] for k in recs["kind"].tolist()],
            "request_seq": recs["request_seq"].astype(np.int64),
            "request_id": [self.request_ids.get(x, "") for x in seqs],
            "step_seq": recs["step_seq"].astype(np.int64),
            "trace_id": traces,
            "tenant": [self.name(x) for x in recs["tenant_hash"].tolist()],
            "session": [self.name(x) for x in recs["session_hash"].tolist()],
            "model_id": [self.name(x) for x in recs["model_hash"].tolist()],
            **t,
            "queue_ns": np.where(end, since(t["t_scheduled_ns"], t["t_start_ns"]), -1),
            "ttft_ns": np.where(end, since(t["t_first_token_ns"], t["t_start_ns"]), -1),
            "tpot_ns": tpot,
            "prompt_tokens": recs["prompt_tokens"].astype(np.int32),
            "prefill_tokens": recs["prefill_tokens"].astype(np.int32),
            "decoded_tokens": recs["decoded_tokens"].astype(np.int32),
            "kv_blocks": recs["kv_blocks"].astype(np.int32),
            "prefix_hit_tokens": recs["prefix_hit_tokens"].astype(np.int32),
            # the record's last word: END's finish reason, CHUNK's first position
            "finish_reason": [
                layout.FINISH_REASONS[r] if e else ""
                for r, e in zip(recs["finish_reason"].tolist(), end.tolist(), strict=True)
            ],  # fmt: skip
            "position": np.where(end, -1, recs["finish_reason"].astype(np.int64)).astype(np.int32),
            **self._trace_columns(seqs, traces),
        }
        ends = end.tolist()
        facts = self.request_facts([x for x, e in zip(seqs, ends, strict=True) if e],
                                   [x for x, e in zip(traces, ends, strict=True) if e],
                                   t["t_end_ns"][end].tolist())  # fmt: skip
        return RequestBatch(columns, got.lost, corrupt + got.corrupt + int((~ok).sum()), got.next_cursor,
                            facts)  # fmt: skip

    def _trace_columns(self, seqs: list[int], traces: list[str]) -> dict[str, list]:
        """Whether each request's trace id came from its caller (a traceparent), the caller's span id
        and flags, and its prompt-hash trace id (its own trace id when it kept the default)."""
        contexts = [self.trace_contexts.get(x) for x in seqs]
        return {
            "trace_from_caller": [c is not None for c in contexts],
            "parent_span_id": [c[0] if c else "" for c in contexts],
            "trace_flags": [c[1] if c else 0 for c in contexts],
            "prompt_hash": [c[2] if c else t for c, t in zip(contexts, traces, strict=True)],
        }

    def read_cupti(self, cursor: int = 0) -> RingRead:
        h = self.header
        return self._read_ring(layout.CUPTI_RECORD, h["cupti_offset"], h["cupti_capacity"], h["cupti_head"],
                               cursor, None)  # fmt: skip


_TRACE_CONTEXT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2}) ([0-9a-f]{32})")


def _trace_context(text: str) -> tuple[str, int, str] | None:
    """A NAME_TRACE_CONTEXT record's text -> (parent span id, flags, prompt hash); None if corrupt."""
    match = _TRACE_CONTEXT.fullmatch(text)
    if match is None:
        return None
    _, span, flags, prompt_hash = match.groups()
    return span, int(flags, 16), prompt_hash


def _is_sane_step(r: tuple) -> bool:
    """_sane_steps of one record unpacked by _STEP_WORDS: the same bounds, on Python ints."""
    return (
        0 < r[_STEP_SEQ] < _TOP
        and r[_T_START] <= r[_T_END] < _TOP
        and r[_BATCH_ROW] >= 0
        and r[_KV_LEN] >= -1
        and r[_TARGET_RANK] >= -1
        and r[_TOKEN_ID] >= -1
        and r[_TARGET_ID] >= -1
        and not r[_FLAGS] & _UNKNOWN_FLAGS
    )


def _sane_steps(recs: np.ndarray) -> np.ndarray:
    """Which records hold values a real writer writes: 1 <= step_seq < 2^63, t_start <= t_end < 2^63
    (CLOCK_MONOTONIC ns fit an int64), batch_row >= 0, kv_len / target_rank / token_id / target_id
    >= -1, and no unknown flag bit. `recs` is contiguous (a RingRead's records are copies)."""
    n = len(recs)
    recs = np.ascontiguousarray(recs)
    words = recs.view(np.uint64).reshape(n, -1)
    ints = recs.view(np.int32).reshape(n, -1)
    seq, t_start, t_end = words[:, _U64["step_seq"]], words[:, _U64["t_start_ns"]], words[:, _U64["t_end_ns"]]
    top = np.uint64(1 << 63)
    return (
        ((seq - np.uint64(1)) < top - np.uint64(1))  # seq 0 wraps to 2^64 - 1
        & (t_end >= t_start)
        & (t_end < top)
        & (ints[:, _I32_COLUMNS] >= _I32_FLOORS).all(1)
        & ((ints[:, _FLAGS_COLUMN].view(np.uint32) & np.uint32(~_KNOWN_FLAGS & 0xFFFFFFFF)) == 0)
    )


def _ring_span(cap: int, head: int, cursor: int, limit: int | None) -> tuple[int, int, int]:
    """(start, lost, end): the positions to read from `cursor` on (at most `limit`), after those the
    writer lapped (`lost`, overwritten before we read them)."""
    if cursor < 0 or cursor > head:
        raise MalformedMap(f"ring head {head} is behind the reader's cursor {cursor}: the writer restarted")
    start = max(cursor, head - cap)
    end = head if limit is None else min(head, start + limit)
    return start, start - cursor, end


def _sort_records(record: layout.Struct, a: bytes, b: bytes, start: int, end: int, lost: int) -> RingRead:
    """The records of positions start..end read twice (a, b): the committed ones, the others counted
    (lost: overwritten; corrupt), stopping at the first one still being written."""
    n = end - start
    rec = record.size
    recs = np.frombuffer(a, record.dtype, n)
    positions = np.arange(start, end, dtype=np.uint64)
    expected = 2 * positions + 2
    seq = recs["seq"]
    if a == b:  # the common case: nothing changed between the two reads
        committed = seq == expected
        if committed.all():
            return RingRead(recs.copy(), positions, end, lost, 0)
        overwritten = ~committed & (seq > expected)
        in_progress = ~committed & ~overwritten & (seq == expected - 1)
    else:
        rows_a = np.frombuffer(a, np.uint8).reshape(n, rec)
        same = (rows_a == np.frombuffer(b, np.uint8).reshape(n, rec)).all(1)
        seq_b = np.frombuffer(b, record.dtype, n)["seq"]
        committed = same & (seq == expected)
        overwritten = ~committed & ((seq > expected) | (seq_b > expected))
        torn_now = (seq == expected - 1) | (seq_b == expected - 1) | (~same & (seq == expected))
        in_progress = ~committed & ~overwritten & torn_now
    unwritten = ~committed & ~overwritten & ~in_progress & (seq < expected - 1)
    if unwritten[-1]:  # a trailing run of never-written records: the head was read ahead of them
        trailing = n if unwritten.all() else int(np.argmin(unwritten[::-1]))
        in_progress = in_progress.copy()
        in_progress[n - trailing :] = True
    next_cursor = end
    if in_progress.any():  # stop at the first record still being written; retry it next time
        stop = int(np.argmax(in_progress))
        next_cursor = start + stop
        committed, overwritten, positions, recs = (
            committed[:stop],
            overwritten[:stop],
            positions[:stop],
            recs[:stop],
        )
    corrupt = ~committed & ~overwritten
    return RingRead(
        recs[committed].copy(), positions[committed], next_cursor,
        lost + int(overwritten.sum()), int(corrupt.sum()),
    )  # fmt: skip


def parse_buffer(data: bytes | bytearray | memoryview) -> tuple[MapView, StepBatch]:
    """Validate and decode a whole in-memory map (the fuzzer's entry point; same code as files)."""
    view = MapView(BufferSource(data))
    return view, view.read_steps(0, refresh=False)


class ShmReader(MapView):
    """A live process's map, opened read-only and checked against the process that should own it.

    With `final_read=True` it also opens the map a process left behind when it exited (llmobs.shm.leftover:
    the writer keeps its file while an agent has not read every step; a killed process leaves it too),
    for one last read: then the file must be owned by the uid the process ran as (`writer`, the identity
    the agent saw while it lived; without one, the uid the header records) and, with `writer`, the header
    must name that very process (its start time), so a pid reused by another process lets no foreign map
    in. `writer_exited` says which case it was."""

    def __init__(self, pid: int, *, shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc",
                 final_read: bool = False, writer: ProcessIdentity | None = None):  # fmt: skip
        self.pid = pid
        self.path = map_path(pid, shm_dir)
        self.proc_root = proc_root
        self.writer_exited = False
        self._tail_fd: int | None = None
        if not os.path.isdir(f"{proc_root}/{pid}") and not (final_read and os.path.lexists(self.path)):
            if os.path.lexists(self.path):
                raise NoSuchProcess(
                    f"process {pid} does not exist; {self.path} is a stale map it left behind",
                    hint=f"the process exited without cleaning up; remove {self.path}",
                )
            raise NoSuchProcess(f"no process with pid {pid}")
        fd = self._open_file()
        try:
            st = os.fstat(fd)
            source = FileSource(fd, st.st_size, self.path)
            if not final_read:
                self._check_file(st, proc_root)
                super().__init__(source, expected_pid=pid)
                self._check_not_stale(proc_root)
            else:
                super().__init__(source, expected_pid=pid)  # the header first: it names the writer
                if self._writer_is_live(proc_root):
                    self._check_file(st, proc_root)
                else:
                    self._check_left_behind(st, writer)
                    self.writer_exited = True
        except BaseException:
            os.close(fd)
            raise

    def _open_file(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotTracked(
                f"process {self.pid} publishes no llmobs map ({self.path} does not exist)"
            ) from None
        except PermissionError:
            raise AccessDenied(
                f"cannot read {self.path}: permission denied",
                hint="run as root or as the user that runs the workload",
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise MalformedMap(f"{self.path} is a symbolic link, not a map file") from None
            raise MalformedMap(f"cannot open {self.path}: {exc.strerror}") from None

    def _check_mode(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise MalformedMap(f"{self.path} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode != layout.FILE_MODE:
            raise MalformedMap(
                f"{self.path} has mode {mode:04o}, a map must be 0600",
                hint="another user could have written it; remove the file and restart the workload",
            )

    def _check_owner(self, st: os.stat_result, owner: int, who: str) -> None:
        if st.st_uid != owner:
            raise MalformedMap(
                f"{self.path} is owned by uid {st.st_uid} but process {self.pid} {who} uid {owner}",
                hint="another user could have written it; remove the file and restart the workload",
            )

    def _check_file(self, st: os.stat_result, proc_root: str) -> None:
        self._check_mode(st)
        try:
            owner = os.stat(f"{proc_root}/{self.pid}").st_uid
        except FileNotFoundError:
            raise NoSuchProcess(f"process {self.pid} exited") from None
        self._check_owner(st, owner, "runs as")

    def _writer_is_live(self, proc_root: str) -> bool:
        """Whether the process now at our pid is the one the header names as the map's writer."""
        try:
            return process_start_ticks(self.pid, proc_root) == self.header["writer_start_ticks"]
        except (OSError, ValueError, IndexError):
            return False

    def _check_left_behind(self, st: os.stat_result, writer: ProcessIdentity | None) -> None:
        """The checks of _check_file for a map whose writer has exited: nothing is left in /proc to ask,
        so the file is held to what the agent saw of the process (or to what its own header says)."""
        self._check_mode(st)
        self._check_owner(st, self.header["writer_uid"], "recorded writer")
        if writer is None:
            return
        self._check_owner(st, writer.uid, "ran as")
        if self.header["writer_start_ticks"] != writer.start_ticks:
            raise NotTracked(
                f"{self.path} was written by another process with pid {self.pid}, not the one attached to",
                hint=f"the pid was reused; remove {self.path}",
            )

    def _check_not_stale(self, proc_root: str) -> None:
        try:
            ticks = process_start_ticks(self.pid, proc_root)
        except (FileNotFoundError, ProcessLookupError):
            raise NoSuchProcess(f"process {self.pid} exited") from None
        except (OSError, ValueError, IndexError):
            return  # an unreadable stat cannot prove staleness
        if ticks != self.header["writer_start_ticks"]:
            raise NotTracked(
                f"{self.path} is stale: it was written by an earlier process with pid {self.pid}",
                hint=f"the pid was reused; remove {self.path}",
            )

    def advertise_tail(self, tail: int) -> bool:
        """Publish our cursor in the map's control block (llmobs.shm.control.write_reader_tail), so the
        workload knows at exit whether we have read everything. Written through a second descriptor of
        the very file we validated (/proc/self/fd), never by path; False when we may not write it."""
        try:
            if self._tail_fd is None:
                self._tail_fd = os.open(f"/proc/self/fd/{self.source.fd}", os.O_WRONLY | os.O_CLOEXEC)
            write_reader_tail(self._tail_fd, tail)
            return True
        except OSError:
            self._tail_fd = -1 if self._tail_fd is None else self._tail_fd
            return False

    def remove_file(self) -> bool:
        """Unlink the map's path if it still names the file we have open (a later process with our pid
        may have put its own there); True when removed. Our descriptor stays readable."""
        try:
            ours, there = os.fstat(self.source.fd), os.stat(self.path, follow_symlinks=False)
            if (ours.st_dev, ours.st_ino) != (there.st_dev, there.st_ino):
                return False
            os.unlink(self.path)
            return True
        except OSError:
            return False

    def is_alive(self) -> bool:
        """Whether the map's writer still runs (its pid is not gone, nor reused by a later process)."""
        return self._writer_is_live(self.proc_root)

    def close(self) -> None:
        if self._tail_fd is not None and self._tail_fd >= 0:
            os.close(self._tail_fd)
        self._tail_fd = None
        self.source.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stale_maps(shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc", skip_pids=()) -> list[str]:
    """Map files whose writer is gone: killed (SIGKILL, a crash), or exited before an agent read every
    step (llmobs.shm.leftover). The pid is gone, or it now belongs to a process started later than the
    map's writer. `skip_pids`: maps the caller reads itself (its own targets)."""
    stale = []
    for entry in os.scandir(shm_dir):
        pid_text = entry.name[len(layout.FILE_PREFIX) :]
        if not entry.name.startswith(layout.FILE_PREFIX) or not pid_text.isdigit():
            continue
        if int(pid_text) in skip_pids:
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        if not os.path.isdir(f"{proc_root}/{pid_text}"):
            stale.append(entry.path)
            continue
        try:
            with open(entry.path, "rb") as f:
                raw = f.read(layout.HEADER.size)
            magic, ticks = struct.unpack_from("<Q", raw, 0)[0], struct.unpack_from("<Q", raw, _TICKS_AT)[0]
            if magic == layout.MAGIC and ticks != process_start_ticks(pid_text, proc_root):
                stale.append(entry.path)
        except (OSError, ValueError, IndexError, struct.error):
            continue  # unreadable or still being created: not provably stale
    return stale


def remove_stale_maps(shm_dir: str = layout.SHM_DIR, proc_root: str = "/proc", skip_pids=()) -> list[str]:
    """Remove the files stale_maps() finds (the agent's housekeeping where no store is open: with one,
    llmobs.pipeline.leftovers.ingest_stale_maps stores their steps first); returns what it removed."""
    removed = []
    for path in stale_maps(shm_dir, proc_root, skip_pids):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
