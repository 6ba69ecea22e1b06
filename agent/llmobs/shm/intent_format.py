"""The intent fingerprint's record (NAME_REQUEST_INTENT) and its vocabulary, shared by both sides.

The workload derives it (llmobs.publisher.intent.fingerprint); the reader decodes it into request_intents
rows; diagnostics.intent_cluster compares them. The record holds ids and hashes only, never text:

    offset size  field
    0      1     version (1)
    1      1     action id (ACTIONS)
    2      1     output format id (FORMATS)
    3      1     constraints used (0..MAX_CONSTRAINTS)
    4      8     template id (u64 LE): hash of the instruction with its variable parts masked
    12     8     SimHash (u64 LE) of the masked instruction's word 3-gram shingles
    20     12    MAX_CONSTRAINTS x (kind id, value id) u8 pairs (CONSTRAINT_KINDS, their value tables)
    32     72    MINHASH_K x u16 LE: the low 16 bits of each MinHash minimum (b-bit MinHash, b = 16)

104 bytes: exactly a names-ring record's text (docs/shm-abi.md, "Intent").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VERSION = 1
MINHASH_K = 36
MAX_CONSTRAINTS = 6
_HEAD = struct.Struct("<BBBBQQ")
RECORD_SIZE = _HEAD.size + 2 * MAX_CONSTRAINTS + 2 * MINHASH_K  # 104
EMPTY_MIN = 0xFFFF  # a slot no shingle reached (a prompt with no words)

# id -> name; 0 is the fallback of each table
ACTIONS = (
    "other",
    "summarize",
    "translate",
    "explain",
    "write",
    "rewrite",
    "classify",
    "extract",
    "answer",
    "code",
    "compare",
    "list",
)
FORMATS = ("none", "json", "yaml", "csv", "table", "list", "code", "markdown")
# length buckets (also step counts): 'any' = the constraint was asked for without a number
BUCKETS = ("any", "1", "2", "3", "4-5", "6-10", "11-20", "21-50", "51-100", "101-200", "201-500", "501+")
_BUCKET_TOPS = (1, 2, 3, 5, 10, 20, 50, 100, 200, 500)
LANGUAGES = (
    "other",
    "en",
    "fr",
    "de",
    "es",
    "it",
    "pt",
    "nl",
    "ru",
    "zh",
    "ja",
    "ko",
    "ar",
    "hi",
    "tr",
    "pl",
    "sv",
)
CODE_LANGUAGES = (
    "other",
    "python",
    "javascript",
    "typescript",
    "java",
    "c",
    "cpp",
    "csharp",
    "go",
    "rust",
    "sql",
    "bash",
    "ruby",
    "php",
)
TONES = ("other", "formal", "casual", "friendly", "professional", "simple", "concise", "detailed", "humorous")
# kind id -> (name, its value table); 0 is unused (an empty pair)
CONSTRAINT_KINDS = (
    ("", ()),
    ("words", BUCKETS),
    ("sentences", BUCKETS),
    ("tokens", BUCKETS),
    ("characters", BUCKETS),
    ("items", BUCKETS),
    ("paragraphs", BUCKETS),
    ("lines", BUCKETS),
    ("language", LANGUAGES),
    ("steps", BUCKETS),
    ("tone", TONES),
    ("code_language", CODE_LANGUAGES),
)
KIND_IDS = {name: i for i, (name, _) in enumerate(CONSTRAINT_KINDS) if name}


def bucket(n: int) -> str:
    """The length bucket of a requested count (1, 2, 3, 4-5, ... 501+)."""
    for top, name in zip(_BUCKET_TOPS, BUCKETS[1:], strict=False):
        if n <= top:
            return name
    return BUCKETS[-1]


@dataclass(frozen=True)
class Intent:
    """A prompt's fingerprint: ids and hashes only (the text is never kept)."""

    template_id: int
    simhash: int
    minhash: tuple[int, ...]  # MINHASH_K values, u16
    action: str = "other"
    output_format: str = "none"
    constraints: tuple[tuple[str, str], ...] = ()  # (kind, value) pairs, sorted by kind id, unique kinds

    def constraints_text(self) -> str:
        """`kind=value,kind=value` (the store's request_intents.constraints; '' for none)."""
        return ",".join(f"{k}={v}" for k, v in self.constraints)

    def pack(self) -> bytes:
        pairs = []
        for kind, value in self.constraints[:MAX_CONSTRAINTS]:
            kid = KIND_IDS[kind]
            pairs += [kid, CONSTRAINT_KINDS[kid][1].index(value)]
        pairs += [0] * (2 * MAX_CONSTRAINTS - len(pairs))
        head = _HEAD.pack(
            VERSION,
            ACTIONS.index(self.action),
            FORMATS.index(self.output_format),
            min(len(self.constraints), MAX_CONSTRAINTS),
            self.template_id,
            self.simhash,
        )
        return head + bytes(pairs) + struct.pack(f"<{MINHASH_K}H", *self.minhash)


def unpack(data: bytes) -> Intent | None:
    """A record back into an Intent; None when it is not a valid version-1 record (counted corrupt)."""
    if len(data) != RECORD_SIZE:
        return None
    version, action, fmt, used, template_id, simhash = _HEAD.unpack_from(data)
    if version != VERSION or action >= len(ACTIONS) or fmt >= len(FORMATS) or used > MAX_CONSTRAINTS:
        return None
    constraints = []
    for i in range(used):
        kid, vid = data[_HEAD.size + 2 * i], data[_HEAD.size + 2 * i + 1]
        if not 0 < kid < len(CONSTRAINT_KINDS) or vid >= len(CONSTRAINT_KINDS[kid][1]):
            return None
        constraints.append((CONSTRAINT_KINDS[kid][0], CONSTRAINT_KINDS[kid][1][vid]))
    minhash = struct.unpack_from(f"<{MINHASH_K}H", data, _HEAD.size + 2 * MAX_CONSTRAINTS)
    return Intent(template_id, simhash, minhash, ACTIONS[action], FORMATS[fmt], tuple(constraints))


def minhash_hex(minhash: tuple[int, ...]) -> str:
    """The store's request_intents.minhash: MINHASH_K big-endian u16s as 4 hex digits each."""
    return "".join(f"{v:04x}" for v in minhash)


def parse_minhash_hex(text: str) -> tuple[int, ...]:
    return tuple(int(text[i : i + 4], 16) for i in range(0, len(text), 4))
