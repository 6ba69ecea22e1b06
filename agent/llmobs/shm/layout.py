"""The one definition of the shared-memory map layout (ABI v3): structs, offsets and constants.

Everything else is generated from this module: the numpy dtypes the writer and reader use, and the C
header bpf/c/llmobs_abi.h (llmobs.shm.cheader). Change a field here, bump ABI_VERSION, regenerate.

A field added in version N says so (`since=N`); it took the place of reserved words, so the layout of
every older version still supported is derived from this one definition (`layout_for(version)`): the
reader accepts READ_VERSIONS and decodes an older map's new fields as their defaults (zero).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

ABI_VERSION = 3  # v3: mixed-batch rows (tokens_in_pass, request_seq), the request-events ring
READ_VERSIONS = (2, 3)  # versions a reader accepts (v2: the layer-stream ring, per-layer metrics)
MAGIC = int.from_bytes(b"LLMOBSMP", "little")  # the first 8 bytes of every map file read "LLMOBSMP"
CLOCK_MONOTONIC = 1  # clock id of every *_ns field (Linux CLOCK_MONOTONIC == bpf_ktime_get_ns())
FILE_PREFIX = "llmobs."  # the map of pid N is /dev/shm/llmobs.N
SHM_DIR = "/dev/shm"
FILE_MODE = 0o600
MAX_CAPACITY = 1 << 24  # upper bound a reader accepts for any ring (keeps a hostile map's sizes sane)
NAME_TEXT_BYTES = 104  # utf-8 bytes a name record holds; longer names are truncated at a char boundary

# header.state
STATE_LIVE = 1
STATE_CLOSED = 2  # the writer unmapped cleanly (normally the file is unlinked right after)

# name record kinds
NAME_TENANT = 1
NAME_SESSION = 2
NAME_MODEL = 3
NAME_OTHER = 4
NAME_REQUEST = 5  # v3: the engine's request id; the record's `hash` word is the request_seq, not a hash
# v3: request `hash` (a request_seq) carries its caller's trace id: text "<traceparent> <prompt hash>", the
# W3C version-00 traceparent it arrived with (its parent span id and flags) and the 32-hex prompt-hash
# trace id it would have had (kept as an attribute so identical prompts still group)
NAME_TRACE_CONTEXT = 6
# request `hash` (a request_seq) has the label text "key=value" (key 'variant' = its variant); one record
# per label, published before the request's first step (docs/shm-abi.md, "Request labels")
NAME_REQUEST_LABEL = 7
# request `hash` (a request_seq) has the prompt's intent fingerprint (docs/shm-abi.md, "Intent")
NAME_REQUEST_INTENT = 8
# model `hash` (the model id's name hash) has the automatic factor "key=value" (dtype, quant, ...)
NAME_MODEL_FACTOR = 9
NAME_KIND_MAX = NAME_MODEL_FACTOR

# step record flags
FLAG_HAS_TARGET = 1 << 0  # target_id, loss, target_prob and target_rank are meaningful
FLAG_GENERATE = 1 << 1  # decoded by generate(): the target is the token that was chosen
FLAG_TEACHER_FORCED = 1 << 2  # a forward pass with labels: the target is the label
FLAG_DEVICE_CUDA = 1 << 3  # the metrics were computed on a CUDA device and copied asynchronously
FLAG_PREFILL = 1 << 4  # v3: this pass also processed the prompt (the request's first token, or a chunk)
FLAG_SHADOW = 1 << 5  # a shadow model's teacher-forced score of a primary request's token (llmobs.shadow)

# context-cell flags (v3, ctx.flags)
CTX_MIXED = 1 << 0  # the pass carries rows of more than one request: trace id 0, see its token steps
CTX_TENANTS_MIXED = 1 << 1  # ... of more than one tenant (tenant_hash 0) or session (session_hash 0)

# request-event record kinds (v3 request-events ring)
REQUEST_END = 1  # a request finished, failed or was cancelled: its per-request figures
REQUEST_CHUNK = 2  # a prefill chunk that produced no token: a row of its pass that is no token step

# request-end finish reasons
FINISH_UNKNOWN = 0
FINISH_STOP = 1  # an end-of-sequence token
FINISH_LENGTH = 2  # max_new_tokens reached
FINISH_CANCELLED = 3
FINISH_ERROR = 4
FINISH_REASONS = {FINISH_UNKNOWN: "", FINISH_STOP: "stop", FINISH_LENGTH: "length",
                  FINISH_CANCELLED: "cancelled", FINISH_ERROR: "error"}  # fmt: skip

# layer-stream record kinds (the metric a record carries); values below LAYER_KIND_MAX are accepted
LAYER_ATTENTION_ENTROPY = 1  # Shannon entropy (nats) of the newest query's attention probabilities
LAYER_MLP_VARIANCE = 2  # population variance over the hidden dim of the MLP output at the newest position
LAYER_KIND_MAX = 16  # room for later kinds without an ABI bump
HEAD_MEAN = -1  # layer record head: the value is the mean over the layer's heads

# control block commands (agent -> workload) and acknowledgement statuses (workload -> agent)
CMD_NONE = 0
CMD_PING = 1  # acknowledge only: proves the workload polls its control block
CMD_COLLECT_CUPTI = 2  # collect CUPTI activity records for cmd_arg token steps
CMD_DUMP_GRADIENTS = 3  # training: dump dL/dE up to step_seq cmd_arg to <map>.dLdE.<ack_step_seq>.npz
CMD_REPLAY = 4  # flight recorder: replay a token step's window (cmd_arg: replay_arg) to <map>.replay.<n>.npz
ACK_OK = 0
ACK_UNSUPPORTED = 1  # the command is known but nothing in this process can carry it out
ACK_UNKNOWN_COMMAND = 2
ACK_NO_GPU = 3
ACK_BUSY = 4
ACK_UNKNOWN_REQUEST = 5  # CMD_REPLAY: no request the recorder keeps holds that token step

# CMD_REPLAY's cmd_arg: the token step (its step_seq and batch row) and the window of steps either side
REPLAY_SEQ_BITS = 40
REPLAY_ROW_BITS = 12
REPLAY_WINDOW_BITS = 12
REPLAY_DEFAULT_WINDOW = 8  # a window field of 0 means this many steps either side


def replay_arg(step_seq: int, batch_row: int = 0, window: int = 0) -> int:
    """Pack CMD_REPLAY's cmd_arg: step_seq in bits 0-39, batch_row in 40-51, window in 52-63."""
    if not (0 <= step_seq < 1 << REPLAY_SEQ_BITS and 0 <= batch_row < 1 << REPLAY_ROW_BITS
            and 0 <= window < 1 << REPLAY_WINDOW_BITS):  # fmt: skip
        raise ValueError(f"replay_arg({step_seq}, {batch_row}, {window}): a field is out of range")
    return step_seq | batch_row << REPLAY_SEQ_BITS | window << (REPLAY_SEQ_BITS + REPLAY_ROW_BITS)


def parse_replay_arg(arg: int) -> tuple[int, int, int]:
    """(step_seq, batch_row, window) of a CMD_REPLAY cmd_arg; window 0 becomes REPLAY_DEFAULT_WINDOW."""
    step_seq = arg & ((1 << REPLAY_SEQ_BITS) - 1)
    batch_row = (arg >> REPLAY_SEQ_BITS) & ((1 << REPLAY_ROW_BITS) - 1)
    window = arg >> (REPLAY_SEQ_BITS + REPLAY_ROW_BITS)
    return step_seq, batch_row, window or REPLAY_DEFAULT_WINDOW


_TYPES: dict[str, tuple[int, str, str]] = {  # name -> (size, numpy code, C type)
    "u8": (1, "u1", "__u8"),
    "u32": (4, "<u4", "__u32"),
    "i32": (4, "<i4", "__s32"),
    "u64": (8, "<u8", "__u64"),
    "f32": (4, "<f4", "float"),
}


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    doc: str
    count: int = 1  # > 1 makes an array
    since: int = 1  # the ABI version that added it (in older versions: reserved words)

    @property
    def size(self) -> int:
        return _TYPES[self.type][0] * self.count


@dataclass
class Struct:
    """A C struct with natural alignment, padded to `size` bytes."""

    c_name: str
    doc: str
    fields: list[Field]
    size: int
    offsets: dict[str, int] = field(default_factory=dict)
    since: int = 1  # the ABI version that added the struct

    def __post_init__(self) -> None:
        pos = 0
        for f in self.fields:
            align = _TYPES[f.type][0]
            if pos % align:
                raise ValueError(f"{self.c_name}.{f.name} at {pos} is not {align}-aligned; reorder fields")
            self.offsets[f.name] = pos
            pos += f.size
        if pos > self.size:
            raise ValueError(f"{self.c_name} needs {pos} bytes, declared {self.size}")

    @functools.cached_property
    def dtype(self) -> np.dtype:
        names, formats, offsets = [], [], []
        for f in self.fields:
            names.append(f.name)
            code = _TYPES[f.type][1]
            formats.append(code if f.count == 1 else (code, (f.count,)))
            offsets.append(self.offsets[f.name])
        return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": self.size})


HEADER = Struct(
    "llmobs_header",
    "The map header at offset 0. `magic` is written last at creation, so a reader never sees a half header.",
    [
        Field("magic", "u64", 'LLMOBS_MAGIC: the bytes "LLMOBSMP"'),
        Field("abi_version", "u32", "LLMOBS_ABI_VERSION"),
        Field("header_size", "u32", "sizeof(struct llmobs_header)"),
        Field("layout_size", "u64", "total bytes of the map == the file size"),
        Field("layout_hash", "u64", "LLMOBS_LAYOUT_HASH: catches a layout change without a version bump"),
        Field("writer_pid", "u32", "the pid that created and writes the map"),
        Field("writer_uid", "u32", "its real uid (the file's owner)"),
        Field("writer_start_ticks", "u64", "its start time, /proc/PID/stat field 22: tells a reused pid"),
        Field("clock_id", "u32", "clock of every *_ns field: 1 = CLOCK_MONOTONIC"),
        Field("state", "u32", "1 = live, 2 = closed by the writer"),
        Field("created_ns", "u64", "when the map was created"),
        Field("heartbeat_ns", "u64", "when the writer last started a token step"),
        Field("ctx_offset", "u64", "offset of struct llmobs_ctx_cell (== LLMOBS_CTX_OFFSET)"),
        Field("control_offset", "u64", "offset of struct llmobs_control (== LLMOBS_CONTROL_OFFSET)"),
        Field("names_offset", "u64", "offset of the names ring"),
        Field("names_capacity", "u32", "records in the names ring (a power of two)"),
        Field("name_record_size", "u32", "sizeof(struct llmobs_name_record)"),
        Field("steps_offset", "u64", "offset of the token-step ring"),
        Field("steps_capacity", "u32", "records in the token-step ring (a power of two)"),
        Field("step_record_size", "u32", "sizeof(struct llmobs_step_record)"),
        Field("cupti_offset", "u64", "offset of the CUPTI record ring"),
        Field("cupti_capacity", "u32", "records in the CUPTI ring (a power of two)"),
        Field("cupti_record_size", "u32", "sizeof(struct llmobs_cupti_record)"),
        Field("names_head", "u64", "positions ever claimed in the names ring"),
        Field("steps_head", "u64", "positions ever claimed in the token-step ring"),
        Field("cupti_head", "u64", "positions ever claimed in the CUPTI ring"),
        Field("names_dropped", "u64", "names the writer could not publish"),
        Field("steps_dropped", "u64", "token-step records the writer could not publish (never claimed)"),
        Field("cupti_dropped", "u64", "CUPTI records the writer could not publish"),
        Field("model_hash", "u64", "name hash of the process's default model id (0 = none)"),
        Field("layers_offset", "u64", "v2: offset of the layer-stream ring"),
        Field("layers_capacity", "u32", "v2: records in the layer-stream ring (a power of two)"),
        Field("layer_record_size", "u32", "v2: sizeof(struct llmobs_layer_record)"),
        Field("layers_head", "u64", "v2: positions ever claimed in the layer-stream ring"),
        Field("layers_dropped", "u64", "v2: layer records the writer could not publish"),
        Field("requests_offset", "u64", "v3: offset of the request-events ring", since=3),
        Field("requests_capacity", "u32", "v3: records in the request-events ring (a power of two)", since=3),
        Field("request_record_size", "u32", "v3: sizeof(struct llmobs_request_record)", since=3),
        Field("requests_head", "u64", "v3: positions ever claimed in the request-events ring", since=3),
        Field("requests_dropped", "u64", "v3: request events the writer could not publish", since=3),
    ],
    256,
)

CTX_CELL = Struct(
    "llmobs_ctx_cell",
    "The current-context cell: the words the eBPF probes read with bpf_probe_read_user.\n"
    "seq is a seqlock counter: odd while the writer is updating the cell.",
    [
        Field("seq", "u64", "seqlock: odd while the writer updates the cell"),
        Field("trace_id_hi", "u64", "trace id bytes 0..7, big-endian as in the W3C hex form"),
        Field("trace_id_lo", "u64", "trace id bytes 8..15"),
        Field("step_seq", "u64", "process-global token-step sequence number, 0 = no step yet"),
        Field("tenant_hash", "u64", "name hash of the tenant, 0 = none"),
        Field("session_hash", "u64", "name hash of the session, 0 = none"),
        Field("rows", "u32", "v3: rows (requests' sequences) in this pass, 0 = not told", since=3),
        Field("flags", "u32", "v3: LLMOBS_CTX_*", since=3),
        Field("tokens", "u32", "v3: tokens this pass processes (sum over its rows), 0 = not told", since=3),
        Field("reserved", "u32", "zero"),
    ],
    64,
)

CONTROL = Struct(
    "llmobs_control",
    "The control block: the agent writes a command, the workload acknowledges it at its next step.\n"
    "Agent: write cmd, cmd_arg, then cmd_seq last. Workload: write ack_*, then ack_seq = cmd_seq last.",
    [
        Field("cmd_seq", "u64", "agent: bumped after cmd and cmd_arg are written"),
        Field("cmd", "u32", "agent: LLMOBS_CMD_*"),
        Field("cmd_flags", "u32", "agent: zero"),
        Field("cmd_arg", "u64", "agent: argument (COLLECT_CUPTI: number of token steps)"),
        Field("ack_seq", "u64", "workload: the cmd_seq it has handled (written last)"),
        Field("ack_status", "u32", "workload: LLMOBS_ACK_*"),
        Field("ack_pid", "u32", "workload: the pid that acknowledged"),
        Field("ack_step_seq", "u64", "workload: step_seq when the command took effect"),
        Field("done_step_seq", "u64", "workload: step_seq when a multi-step command finished, 0 = running"),
        Field("reader_pid", "u64", "agent: pid of the reader advertising its cursor"),
        Field("reader_tail", "u64", "agent: next token-step position it will read (for lag and drops)"),
        Field("reader_heartbeat_ns", "u64", "agent: when it last advanced reader_tail"),
        Field("reserved", "u64", "zero", count=5),
    ],
    128,
)

NAME_RECORD = Struct(
    "llmobs_name_record",
    "A names-ring record: the string behind a 64-bit name hash (tenant, session, model id).",
    [
        Field("seq", "u64", "2*pos+1 while written, 2*pos+2 once committed"),
        Field("hash", "u64", "llmobs name hash of the full string"),
        Field("kind", "u32", "LLMOBS_NAME_*"),
        Field("length", "u32", "bytes used in text"),
        Field("text", "u8", "utf-8, not NUL-terminated", count=NAME_TEXT_BYTES),
    ],
    128,
)

STEP_RECORD = Struct(
    "llmobs_step_record",
    "A token-step record: one decoded (or teacher-forced) token of one batch row.\n"
    "loss..target_id are one 28-byte block copied from the model's device in one copy.",
    [
        Field("seq", "u64", "2*pos+1 while written, 2*pos+2 once committed"),
        Field("step_seq", "u64", "the process-global step sequence (join key with eBPF events)"),
        Field("trace_id_hi", "u64", "trace id bytes 0..7 (big-endian)"),
        Field("trace_id_lo", "u64", "trace id bytes 8..15"),
        Field("t_start_ns", "u64", "step start (CLOCK_MONOTONIC)"),
        Field("t_end_ns", "u64", "token known (CLOCK_MONOTONIC)"),
        Field("tenant_hash", "u64", "name hash, 0 = none"),
        Field("session_hash", "u64", "name hash, 0 = none"),
        Field("model_hash", "u64", "name hash, 0 = none"),
        Field("step", "u32", "index of the step within its request, 0-based"),
        Field("position", "u32", "position of the token in its sequence"),
        Field("batch_row", "i32", "row in the batch"),
        Field("kv_len", "i32", "KV-cache length when the step started, -1 = unknown"),
        Field("loss", "f32", "cross-entropy of the target, NaN without target"),
        Field("entropy", "f32", "entropy of softmax(logits), nats"),
        Field("target_prob", "f32", "softmax probability of the target, NaN without target"),
        Field("top1_prob", "f32", "highest softmax probability"),
        Field("target_rank", "i32", "tokens with a higher logit than the target, -1 without target"),
        Field("token_id", "i32", "the token at this position (decoded, label, or arg-max)"),
        Field("target_id", "i32", "the target token, -1 = unknown"),
        Field("flags", "u32", "LLMOBS_FLAG_*"),
        Field(
            "tokens_in_pass",
            "u32",
            "v3: tokens this row processed in the pass (1 decode), 0 = unknown",
            since=3,
        ),
        Field("request_seq", "u32", "v3: the process's number of the row's request, 0 = none", since=3),
    ],
    128,
)

CUPTI_RECORD = Struct(
    "llmobs_cupti_record",
    "A CUPTI activity record, written by the in-process collector while the control block asks.",
    [
        Field("seq", "u64", "2*pos+1 while written, 2*pos+2 once committed"),
        Field("step_seq", "u64", "external correlation id pushed by the collector"),
        Field("start_ns", "u64", "CLOCK_MONOTONIC"),
        Field("end_ns", "u64", "CLOCK_MONOTONIC"),
        Field("correlation_id", "u64", "CUPTI correlation id"),
        Field("name_hash", "u64", "name hash of the kernel or API name"),
        Field("kind", "u32", "CUPTI activity kind"),
        Field("device_id", "u32", "device"),
        Field("stream_id", "u32", "stream"),
        Field("reserved", "u32", "zero"),
    ],
    64,
)

LAYER_RECORD = Struct(
    "llmobs_layer_record",
    "A layer-stream record (v2): one per-layer metric of one token step and batch row, sampled by a\n"
    "policy (attention entropy: off by default). `value` may be copied from the model's device.",
    [
        Field("seq", "u64", "2*pos+1 while written, 2*pos+2 once committed"),
        Field("step_seq", "u64", "the token step (forward pass) the value was measured on"),
        Field("trace_id_hi", "u64", "trace id bytes 0..7 (big-endian) of the batch row's request"),
        Field("trace_id_lo", "u64", "trace id bytes 8..15"),
        Field("batch_row", "i32", "row in the batch"),
        Field("layer", "i32", "layer index, 0-based"),
        Field("head", "i32", "head index, -1 = mean over the layer's heads"),
        Field("kind", "u32", "LLMOBS_LAYER_*: the metric"),
        Field("value", "f32", "the metric (attention entropy: nats)"),
        Field("flags", "u32", "LLMOBS_FLAG_DEVICE_CUDA when value was copied from a CUDA device"),
        Field("reserved", "u64", "zero"),
    ],
    64,
)

REQUEST_RECORD = Struct(
    "llmobs_request_record",
    "A request-events record (v3): the end of a served request with its figures (kind END), or a\n"
    "prefill chunk that produced no token (kind CHUNK: a row of pass step_seq that is no token step).",
    [
        Field("seq", "u64", "2*pos+1 while written, 2*pos+2 once committed"),
        Field("step_seq", "u64", "END: the pass of its last token (0 = none); CHUNK: its pass"),
        Field("trace_id_hi", "u64", "trace id bytes 0..7 (big-endian) of the request"),
        Field("trace_id_lo", "u64", "trace id bytes 8..15"),
        Field("tenant_hash", "u64", "name hash, 0 = none"),
        Field("session_hash", "u64", "name hash, 0 = none"),
        Field("model_hash", "u64", "name hash, 0 = none"),
        Field("t_start_ns", "u64", "END: arrival (added by the client); CHUNK: pass start"),
        Field("t_scheduled_ns", "u64", "END: first scheduled into a pass, 0 = never; CHUNK: pass start"),
        Field("t_first_token_ns", "u64", "END: first token known, 0 = none"),
        Field("t_last_token_ns", "u64", "END: last token known, 0 = none"),
        Field("t_end_ns", "u64", "END: finished, failed or cancelled; CHUNK: pass end"),
        Field("request_seq", "u32", "the process's number of the request (names ring: its engine id)"),
        Field("kind", "u32", "LLMOBS_REQUEST_*"),
        Field("prompt_tokens", "u32", "tokens of the prompt"),
        Field("prefill_tokens", "u32", "END: prompt tokens computed (not reused); CHUNK: this chunk's"),
        Field("decoded_tokens", "u32", "END: tokens generated (token steps); CHUNK: 0"),
        Field("kv_blocks", "u32", "END: KV-cache blocks the request held at its end; CHUNK: 0"),
        Field("prefix_hit_tokens", "u32", "END: prompt tokens whose KV came from shared (prefix) blocks"),
        Field("finish_reason", "u32", "END: LLMOBS_FINISH_*; CHUNK: first position the chunk processed"),
    ],
    128,
    since=3,
)

STRUCTS = [HEADER, CTX_CELL, CONTROL, NAME_RECORD, STEP_RECORD, CUPTI_RECORD, LAYER_RECORD, REQUEST_RECORD]

CTX_OFFSET = 256
CONTROL_OFFSET = CTX_OFFSET + CTX_CELL.size
NAMES_OFFSET = 512  # rings start here; each ring is a power-of-two array of fixed records
DEVICE_BLOCK_OFFSET = STEP_RECORD.offsets["loss"]  # the 7 words copied from the device in one copy
DEVICE_BLOCK_WORDS = 7

DEFAULT_NAMES_CAPACITY = 1024
DEFAULT_STEPS_CAPACITY = 32768
DEFAULT_CUPTI_CAPACITY = 4096
DEFAULT_LAYERS_CAPACITY = 4096
DEFAULT_REQUESTS_CAPACITY = 1024


@dataclass(frozen=True)
class Regions:
    """Where each ring lies for a set of capacities; the writer lays out, the reader checks equality."""

    names_offset: int
    steps_offset: int
    cupti_offset: int
    layers_offset: int
    layout_size: int
    requests_offset: int = 0  # v3


def regions(names_capacity: int, steps_capacity: int, cupti_capacity: int, layers_capacity: int,
            requests_capacity: int = 0) -> Regions:  # fmt: skip
    """Ring offsets for a set of capacities. requests_capacity 0: a v2 map (no request-events ring)."""
    names_offset = NAMES_OFFSET
    steps_offset = names_offset + names_capacity * NAME_RECORD.size
    cupti_offset = steps_offset + steps_capacity * STEP_RECORD.size
    layers_offset = cupti_offset + cupti_capacity * CUPTI_RECORD.size
    requests_offset = layers_offset + layers_capacity * LAYER_RECORD.size
    end = requests_offset + requests_capacity * REQUEST_RECORD.size
    page = 4096
    return Regions(names_offset, steps_offset, cupti_offset, layers_offset, (end + page - 1) // page * page,
                   requests_offset if requests_capacity else 0)  # fmt: skip


def is_valid_capacity(n: int) -> bool:
    return 1 <= n <= MAX_CAPACITY and n & (n - 1) == 0


def _as_of(s: Struct, version: int) -> Struct:
    """`s` as it was in `version`: each run of fields added later (with the reserved word after it)
    is the reserved u64 words it took the place of."""
    fields: list[Field] = []
    run = 0  # bytes of a run of later fields not yet turned back into reserved words
    for f in s.fields:
        if f.since > version or (run and f.name == "reserved"):
            run += f.size
            continue
        if run:
            fields.append(Field("reserved", "u64", "zero", count=run // 8))
            run = 0
        fields.append(f)
    if run:
        fields.append(Field("reserved", "u64", "zero", count=run // 8))
    return Struct(s.c_name, s.doc, fields, s.size, since=s.since)


def layout_for(version: int) -> list[Struct]:
    """The structs of an ABI version this code reads (a struct added later is absent)."""
    return [_as_of(s, version) for s in STRUCTS if s.since <= version]


def _layout_hash(structs: list[Struct]) -> int:
    text = ";".join(
        f"{s.c_name}:{s.size}:"
        + ",".join(f"{f.name}/{f.type}/{f.count}@{s.offsets[f.name]}" for f in s.fields)
        for s in structs
    )
    text += f";ctx@{CTX_OFFSET};control@{CONTROL_OFFSET};names@{NAMES_OFFSET}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


LAYOUT_HASH = _layout_hash(STRUCTS)
LAYOUT_HASHES = {v: _layout_hash(layout_for(v)) for v in READ_VERSIONS}  # version -> its layout hash

# C constants exported with the header (name -> (value, comment)).
C_CONSTANTS: list[tuple[str, int, str]] = [
    ("LLMOBS_ABI_VERSION", ABI_VERSION, "bumped on any incompatible layout change"),
    ("LLMOBS_MAGIC", MAGIC, 'the bytes "LLMOBSMP" read as a little-endian u64'),
    ("LLMOBS_LAYOUT_HASH", LAYOUT_HASH, "sha256 of the layout definition, first 8 bytes LE"),
    ("LLMOBS_CLOCK_MONOTONIC", CLOCK_MONOTONIC, "header.clock_id"),
    ("LLMOBS_CTX_OFFSET", CTX_OFFSET, "byte offset of the current-context cell from the mapping start"),
    ("LLMOBS_CONTROL_OFFSET", CONTROL_OFFSET, "byte offset of the control block"),
    ("LLMOBS_NAMES_OFFSET", NAMES_OFFSET, "byte offset of the first ring (names)"),
    ("LLMOBS_STATE_LIVE", STATE_LIVE, "header.state"),
    ("LLMOBS_STATE_CLOSED", STATE_CLOSED, "header.state"),
    ("LLMOBS_NAME_TENANT", NAME_TENANT, "name record kind"),
    ("LLMOBS_NAME_SESSION", NAME_SESSION, "name record kind"),
    ("LLMOBS_NAME_MODEL", NAME_MODEL, "name record kind"),
    ("LLMOBS_NAME_OTHER", NAME_OTHER, "name record kind"),
    ("LLMOBS_NAME_REQUEST", NAME_REQUEST, "name record kind: hash is the request_seq"),
    ("LLMOBS_NAME_TRACE_CONTEXT", NAME_TRACE_CONTEXT, "name record kind: request_seq's caller trace"),
    ("LLMOBS_NAME_REQUEST_LABEL", NAME_REQUEST_LABEL, "name record kind: a label of request_seq"),
    ("LLMOBS_NAME_REQUEST_INTENT", NAME_REQUEST_INTENT, "name record kind: request_seq's intent"),
    ("LLMOBS_NAME_MODEL_FACTOR", NAME_MODEL_FACTOR, "name record kind: a factor of model hash"),
    ("LLMOBS_FLAG_HAS_TARGET", FLAG_HAS_TARGET, "step record flag"),
    ("LLMOBS_FLAG_GENERATE", FLAG_GENERATE, "step record flag"),
    ("LLMOBS_FLAG_TEACHER_FORCED", FLAG_TEACHER_FORCED, "step record flag"),
    ("LLMOBS_FLAG_DEVICE_CUDA", FLAG_DEVICE_CUDA, "step record flag"),
    ("LLMOBS_FLAG_PREFILL", FLAG_PREFILL, "step record flag: the pass also processed prompt tokens"),
    ("LLMOBS_FLAG_SHADOW", FLAG_SHADOW, "step record flag: a shadow model's score of a primary token"),
    ("LLMOBS_CTX_MIXED", CTX_MIXED, "ctx flag: rows of several requests (trace id 0)"),
    ("LLMOBS_CTX_TENANTS_MIXED", CTX_TENANTS_MIXED, "ctx flag: rows of several tenants or sessions"),
    ("LLMOBS_REQUEST_END", REQUEST_END, "request-event kind"),
    ("LLMOBS_REQUEST_CHUNK", REQUEST_CHUNK, "request-event kind"),
    ("LLMOBS_FINISH_STOP", FINISH_STOP, "request-end finish reason"),
    ("LLMOBS_FINISH_LENGTH", FINISH_LENGTH, "request-end finish reason"),
    ("LLMOBS_FINISH_CANCELLED", FINISH_CANCELLED, "request-end finish reason"),
    ("LLMOBS_FINISH_ERROR", FINISH_ERROR, "request-end finish reason"),
    ("LLMOBS_LAYER_ATTENTION_ENTROPY", LAYER_ATTENTION_ENTROPY, "layer record kind"),
    ("LLMOBS_LAYER_MLP_VARIANCE", LAYER_MLP_VARIANCE, "layer record kind"),
    ("LLMOBS_LAYER_KIND_MAX", LAYER_KIND_MAX, "layer record kinds are below this"),
    ("LLMOBS_HEAD_MEAN", HEAD_MEAN, "layer record head: mean over heads"),
    ("LLMOBS_CMD_NONE", CMD_NONE, "control command"),
    ("LLMOBS_CMD_PING", CMD_PING, "control command: acknowledge only"),
    ("LLMOBS_CMD_COLLECT_CUPTI", CMD_COLLECT_CUPTI, "control command: CUPTI for cmd_arg steps"),
    ("LLMOBS_CMD_DUMP_GRADIENTS", CMD_DUMP_GRADIENTS, "control command: dump dL/dE up to step cmd_arg"),
    ("LLMOBS_CMD_REPLAY", CMD_REPLAY, "control command: replay a token step's window (flight recorder)"),
    ("LLMOBS_ACK_OK", ACK_OK, "acknowledgement status"),
    ("LLMOBS_ACK_UNSUPPORTED", ACK_UNSUPPORTED, "acknowledgement status"),
    ("LLMOBS_ACK_UNKNOWN_COMMAND", ACK_UNKNOWN_COMMAND, "acknowledgement status"),
    ("LLMOBS_ACK_NO_GPU", ACK_NO_GPU, "acknowledgement status"),
    ("LLMOBS_ACK_BUSY", ACK_BUSY, "acknowledgement status"),
    ("LLMOBS_ACK_UNKNOWN_REQUEST", ACK_UNKNOWN_REQUEST, "acknowledgement status: no such request"),
    ("LLMOBS_REPLAY_SEQ_BITS", REPLAY_SEQ_BITS, "CMD_REPLAY cmd_arg: bits of step_seq (from bit 0)"),
    ("LLMOBS_REPLAY_ROW_BITS", REPLAY_ROW_BITS, "CMD_REPLAY cmd_arg: bits of batch_row (next)"),
    ("LLMOBS_REPLAY_WINDOW_BITS", REPLAY_WINDOW_BITS, "CMD_REPLAY cmd_arg: bits of the window (top)"),
    ("LLMOBS_NAME_TEXT_BYTES", NAME_TEXT_BYTES, "bytes of text in a name record"),
]
