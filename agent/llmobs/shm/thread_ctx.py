"""OTEP 4947 thread context (opentelemetry-specification oteps/profiles/4947-thread-ctx.md, merged
2026-07-17): each thread that runs a token step points the TLS symbol `otel_thread_ctx_v1` at a record
with the step's span id, the request's trace id and two attributes, so a profiler that stops the thread
(a perf event, a uprobe) reads what it is working on.

The TLS symbol lives in a small C library (c/otel_thread_ctx.c, built by setup.py at install); Python has
no ELF TLS of its own. Without the library nothing is published: `attach` and `detach` do nothing and
the process context carries no threadlocal.* keys, so readers do not look for the symbol.

The record's ids are the ones the agent exports: the trace id is the row's W3C trace id (the export's
"prompt" trace-id mode, its default; "random" mode re-keys trace ids with a salt only the store knows)
and the span id is llmobs.otlp.encoder.SpanIds.step_span_id of the pass's first row (batch row 0), the
row the context cell carries too. Attributes, through the key map published in OTEL_CTX:
key 0 `llmobs.tenant` (the tenant name, when the step has one), key 1 `llmobs.step_seq` (decimal, the
process's step sequence number, which the agent's eBPF events are joined on).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path

from llmobs import environment

LIBRARY = Path(__file__).resolve().parent / "c" / "libllmobs_otel_thread_ctx.so"
SYMBOL = "otel_thread_ctx_v1"
SCHEMA_VERSION = "tlsdesc_v1_dev"  # what the merged OTEP and the eBPF profiler's reader use
ATTRIBUTE_KEYS = ("llmobs.tenant", "llmobs.step_seq")  # threadlocal.attribute_key_map, index = key
KEY_TENANT, KEY_STEP_SEQ = 0, 1
RECORD_BYTES = 640
HEAD_BYTES = 28
TRACE_FLAGS_SAMPLED = 0x01
_ABI = 3
_MAX_VALUE = 253  # an entry (key, length, value) fits the one-byte length of the C call's blob

_lib = None
_step = None  # the per-step call: the extension module's step(blob, seq), else a ctypes wrapper
_load_lock = threading.Lock()
_loaded = False
_tenants: dict[int, bytes] = {}  # tenant hash -> its encoded attribute entry (bounded below)
_MAX_TENANTS = 4096
_blobs: dict[tuple[int, int, int, int], bytes] = {}  # (trace_lo, trace_hi, tenant, pid) -> its blob
_MAX_TRACES = 4096
_last: tuple = (None, None, None, None, b"")  # the last key and blob: most steps follow one like it


def library():
    """The loaded C library, or None when it is not built (or not loadable). Loaded once."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _load_lock:
        if not _loaded:
            _lib = _load()
            _loaded = True
    return _lib


def _load():
    global _step
    path = os.environ.get(environment.LLMOBS_THREAD_CTX_LIB) or str(LIBRARY)
    try:
        lib = ctypes.CDLL(path)
        lib.llmobs_thread_ctx_abi.restype = ctypes.c_uint32
        if lib.llmobs_thread_ctx_abi() != _ABI:
            return None
        lib.llmobs_thread_ctx_attach.argtypes = (ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p,
                                                 ctypes.c_uint32)  # fmt: skip
        lib.llmobs_thread_ctx_attach.restype = None
        # no argtypes on the per-step call: ctypes' own conversion of bytes and small ints is the cheap one
        lib.llmobs_thread_ctx_step.restype = None
        lib.llmobs_blake2b_64.argtypes = (ctypes.c_char_p, ctypes.c_uint32, ctypes.c_char_p)
        lib.llmobs_blake2b_64.restype = None
        lib.llmobs_thread_ctx_detach.argtypes = ()
        lib.llmobs_thread_ctx_detach.restype = None
        lib.llmobs_otel_fence.argtypes = ()
        lib.llmobs_otel_fence.restype = None
        for name in ("llmobs_thread_ctx_record_address", "llmobs_thread_ctx_pointer"):
            getattr(lib, name).restype = ctypes.c_size_t
        ctypes.c_void_p.in_dll(lib, SYMBOL)  # the TLS symbol itself resolves (dlsym), or no library
        _step = _extension_step(path) or _ctypes_step(lib.llmobs_thread_ctx_step)
        return lib
    except (OSError, AttributeError, ValueError):
        return None


def _extension_step(path: str):
    """The library's CPython-extension face (built in when setup.py found Python's headers): its step
    is a METH_FASTCALL call, several times cheaper than going through ctypes. None without it."""
    import importlib.machinery
    import importlib.util

    try:
        loader = importlib.machinery.ExtensionFileLoader("_llmobs_otel_thread_ctx", path)
        spec = importlib.util.spec_from_loader("_llmobs_otel_thread_ctx", loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module.step
    except (ImportError, AttributeError, OSError):
        return None


def _ctypes_step(call):
    def step(blob: bytes, step_seq: int) -> None:
        call(blob, step_seq & 0xFFFFFFFF, step_seq >> 32)

    return step


def uses_extension() -> bool:
    """True when the per-step call goes through the extension module (bench, doctor)."""
    return library() is not None and getattr(_step, "__module__", None) != __name__


def available() -> bool:
    return library() is not None


def reference_attributes() -> dict[str, object]:
    """OTEP 4947's Thread-Local Reference Data, for ProcessContext.attributes (empty without the
    library: no threadlocal.* keys means readers never look for the TLS symbol)."""
    if not available():
        return {}
    return {
        "threadlocal.schema_version": SCHEMA_VERSION,
        "threadlocal.attribute_key_map": list(ATTRIBUTE_KEYS),
    }


def entry(key: int, value: bytes) -> bytes:
    """One attrs-data entry: key index, length, value (cut to 253 bytes on a UTF-8 boundary)."""
    if len(value) > _MAX_VALUE:
        value = value[:_MAX_VALUE].decode("utf-8", "ignore").encode("utf-8")
    return bytes((key, len(value))) + value


def step_span_id(pid: int, trace_hex: str, step_seq: int, batch_row: int = 0) -> bytes:
    """The span id the OTLP export gives token step (pid, trace, step_seq, batch_row): the same as
    llmobs.otlp.encoder.SpanIds.step_span_id (a unit test holds the two together)."""
    text = f"step\x1f{pid}\x1f{trace_hex}\x1f{step_seq}\x1f{batch_row}".encode()
    digest = hashlib.blake2b(text, digest_size=8).digest()
    return digest if any(digest) else b"\x01" + digest[1:]


def remember_tenant(tenant_hash: int, name: str) -> None:
    """The writer tells us each tenant name it hashes, so a step carries the name, not the hash."""
    if tenant_hash and tenant_hash not in _tenants and len(_tenants) < _MAX_TENANTS:
        _tenants[tenant_hash] = entry(KEY_TENANT, name.encode("utf-8"))


def _blob(pid: int, trace_hi: int, trace_lo: int, tenant_hash: int) -> bytes:
    """What llmobs_thread_ctx_step needs of a (pid, trace, tenant), prepared once (c/otel_thread_ctx.c):
    prefix length, tenant entry length, trace id, the span-id text's prefix, the tenant entry."""
    tenant = _tenants.get(tenant_hash, b"")
    if not (trace_hi or trace_lo):  # a pass of several requests: no one trace (their steps' spans say)
        return bytes((0, len(tenant))) + bytes(16) + tenant
    trace_hex = f"{trace_hi:016x}{trace_lo:016x}"
    prefix = f"step\x1f{pid}\x1f{trace_hex}\x1f".encode()
    return bytes((len(prefix), len(tenant))) + bytes.fromhex(trace_hex) + prefix + tenant


def attach(pid: int, trace_hi: int, trace_lo: int, step_seq: int, tenant_hash: int) -> None:
    """This thread now runs token step `step_seq` of trace (trace_hi, trace_lo): one C call, which
    computes the span id and writes the record. Never raises."""
    global _last
    lib = _lib if _loaded else library()
    if lib is None:
        return
    try:
        last = _last  # one tuple, read once: another thread may replace it at any time
        if last[0] != trace_lo or last[1] != trace_hi or last[2] != tenant_hash or last[3] != pid:
            key = (trace_lo, trace_hi, tenant_hash, pid)
            blob = _blobs.get(key)
            if blob is None:
                if len(_blobs) >= _MAX_TRACES:
                    _blobs.clear()
                blob = _blobs[key] = _blob(pid, trace_hi, trace_lo, tenant_hash)
            _last = last = (*key, blob)
        _step(last[4], step_seq)
    except Exception:  # the workload must never see our failure
        pass


def detach() -> None:
    """This thread runs no token step now (its record reads invalid). Never raises."""
    lib = _lib if _loaded else library()
    if lib is not None:
        lib.llmobs_thread_ctx_detach()


def fence() -> bool:
    """A full memory barrier (OTEP 4719's protocol steps) when the library is there; False if not."""
    lib = library()
    if lib is None:
        return False
    lib.llmobs_otel_fence()
    return True


def _forget_in_child() -> None:
    global _last
    _blobs.clear()  # keyed by pid too; dropped only to stay small
    _last = (None, None, None, None, b"")


os.register_at_fork(after_in_child=_forget_in_child)
