"""The one definition of the shared-memory map layout (ABI v2): structs, offsets and constants.

Everything else is generated from this module: the numpy dtypes the writer and reader use, and the C
header bpf/c/llmobs_abi.h (llmobs.shm.cheader). Change a field here, bump ABI_VERSION, regenerate.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

ABI_VERSION = 2  # v2: the layer-stream ring (per-layer metrics such as attention entropy)
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

# step record flags
FLAG_HAS_TARGET = 1 << 0  # target_id, loss, target_prob and target_rank are meaningful
FLAG_GENERATE = 1 << 1  # decoded by generate(): the target is the token that was chosen
FLAG_TEACHER_FORCED = 1 << 2  # a forward pass with labels: the target is the label
FLAG_DEVICE_CUDA = 1 << 3  # the metrics were computed on a CUDA device and copied asynchronously

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
ACK_OK = 0
ACK_UNSUPPORTED = 1  # the command is known but nothing in this process can carry it out
ACK_UNKNOWN_COMMAND = 2
ACK_NO_GPU = 3
ACK_BUSY = 4

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
        Field("reserved", "u64", "zero", count=4),
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
        Field("reserved", "u64", "zero", count=2),
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
        Field("reserved", "u64", "zero"),
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

STRUCTS = [HEADER, CTX_CELL, CONTROL, NAME_RECORD, STEP_RECORD, CUPTI_RECORD, LAYER_RECORD]

CTX_OFFSET = 256
CONTROL_OFFSET = CTX_OFFSET + CTX_CELL.size
NAMES_OFFSET = 512  # rings start here; each ring is a power-of-two array of fixed records
DEVICE_BLOCK_OFFSET = STEP_RECORD.offsets["loss"]  # the 7 words copied from the device in one copy
DEVICE_BLOCK_WORDS = 7

DEFAULT_NAMES_CAPACITY = 1024
DEFAULT_STEPS_CAPACITY = 32768
DEFAULT_CUPTI_CAPACITY = 4096
DEFAULT_LAYERS_CAPACITY = 4096


@dataclass(frozen=True)
class Regions:
    """Where each ring lies for a set of capacities; the writer lays out, the reader checks equality."""

    names_offset: int
    steps_offset: int
    cupti_offset: int
    layers_offset: int
    layout_size: int


def regions(names_capacity: int, steps_capacity: int, cupti_capacity: int, layers_capacity: int) -> Regions:
    names_offset = NAMES_OFFSET
    steps_offset = names_offset + names_capacity * NAME_RECORD.size
    cupti_offset = steps_offset + steps_capacity * STEP_RECORD.size
    layers_offset = cupti_offset + cupti_capacity * CUPTI_RECORD.size
    end = layers_offset + layers_capacity * LAYER_RECORD.size
    page = 4096
    return Regions(names_offset, steps_offset, cupti_offset, layers_offset, (end + page - 1) // page * page)


def is_valid_capacity(n: int) -> bool:
    return 1 <= n <= MAX_CAPACITY and n & (n - 1) == 0


def _layout_hash() -> int:
    text = ";".join(
        f"{s.c_name}:{s.size}:"
        + ",".join(f"{f.name}/{f.type}/{f.count}@{s.offsets[f.name]}" for f in s.fields)
        for s in STRUCTS
    )
    text += f";ctx@{CTX_OFFSET};control@{CONTROL_OFFSET};names@{NAMES_OFFSET}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


LAYOUT_HASH = _layout_hash()

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
    ("LLMOBS_FLAG_HAS_TARGET", FLAG_HAS_TARGET, "step record flag"),
    ("LLMOBS_FLAG_GENERATE", FLAG_GENERATE, "step record flag"),
    ("LLMOBS_FLAG_TEACHER_FORCED", FLAG_TEACHER_FORCED, "step record flag"),
    ("LLMOBS_FLAG_DEVICE_CUDA", FLAG_DEVICE_CUDA, "step record flag"),
    ("LLMOBS_LAYER_ATTENTION_ENTROPY", LAYER_ATTENTION_ENTROPY, "layer record kind"),
    ("LLMOBS_LAYER_MLP_VARIANCE", LAYER_MLP_VARIANCE, "layer record kind"),
    ("LLMOBS_LAYER_KIND_MAX", LAYER_KIND_MAX, "layer record kinds are below this"),
    ("LLMOBS_HEAD_MEAN", HEAD_MEAN, "layer record head: mean over heads"),
    ("LLMOBS_CMD_NONE", CMD_NONE, "control command"),
    ("LLMOBS_CMD_PING", CMD_PING, "control command: acknowledge only"),
    ("LLMOBS_CMD_COLLECT_CUPTI", CMD_COLLECT_CUPTI, "control command: CUPTI for cmd_arg steps"),
    ("LLMOBS_CMD_DUMP_GRADIENTS", CMD_DUMP_GRADIENTS, "control command: dump dL/dE up to step cmd_arg"),
    ("LLMOBS_ACK_OK", ACK_OK, "acknowledgement status"),
    ("LLMOBS_ACK_UNSUPPORTED", ACK_UNSUPPORTED, "acknowledgement status"),
    ("LLMOBS_ACK_UNKNOWN_COMMAND", ACK_UNKNOWN_COMMAND, "acknowledgement status"),
    ("LLMOBS_ACK_NO_GPU", ACK_NO_GPU, "acknowledgement status"),
    ("LLMOBS_ACK_BUSY", ACK_BUSY, "acknowledgement status"),
    ("LLMOBS_NAME_TEXT_BYTES", NAME_TEXT_BYTES, "bytes of text in a name record"),
]
