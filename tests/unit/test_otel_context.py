"""OpenTelemetry contexts of an instrumented process: OTEP 4719 (process context, as merged
2026-04-07) and OTEP 4947 (thread context, merged 2026-07-17).

The OTEL_CTX mapping is read here by a reader written from the OTEP's text alone (its header table
and reading protocol: offsets, names, checks), not by llmobs's reader, and the payload decoded with
the generated ProcessContext class. The thread records are read through the exported TLS symbol
itself (dlsym of otel_thread_ctx_v1) and decoded by the OTEP's record table; their span ids are
checked against the OTLP encoder's, computed from the same process's token-step rows.
No reference test vectors exist: the spec repository and open-telemetry/sig-profiling
(process-context/c-and-cpp) ship a writer, a reader and a dump script, but no fixtures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from llmobs.shm import layout, otel_ctx, otel_ctx_reader, thread_ctx

ROOT = Path(__file__).resolve().parents[2]
AGENT = [sys.executable, "-m", "llmobs.cli"]

# --- the OTEP's text, transcribed ------------------------------------------------------------------
# Reading protocol step 1: mapping names to look for (prefix match).
SPEC_NAMES = ("[anon_shmem:OTEL_CTX]", "[anon:OTEL_CTX]", "/memfd:OTEL_CTX")
# Header Structure table: signature char[8], version u32, payload_size u32,
# monotonic_published_at_ns u64, payload u64 (pointer), in that order, native byte order.
SIG, VER, SIZE, STAMP, PAYLOAD = (0, 8), (8, 12), (12, 16), (16, 24), (24, 32)


def _u(raw: bytes, span: tuple[int, int]) -> int:
    return int.from_bytes(raw[span[0] : span[1]], sys.byteorder)


def spec_read(pid: int, attempts: int = 1000):
    """OTEP 4719's reading protocol: (mapping name, version, stamp, payload), or None while the stamp
    stays 0 or moves (an update in progress) for `attempts` tries."""
    with open(f"/proc/{pid}/maps") as maps:
        found = [line.split(None, 5) for line in maps]
    found = [(int(f[0].split("-")[0], 16), f[5].strip()) for f in found if len(f) == 6]
    found = [(start, name) for start, name in found if name.startswith(SPEC_NAMES)]
    assert len(found) == 1, found  # "MUST NOT be more than one process context"
    start, name = found[0]
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:

        def read(address: int, n: int) -> bytes:
            mem.seek(address)
            return mem.read(n)

        for _ in range(attempts):
            head = read(start, 32)
            assert head[SIG[0] : SIG[1]] == b"OTEL_CTX"  # exactly 8 bytes, no NUL
            version = _u(head, VER)
            assert version == 2
            stamp = _u(head, STAMP)
            if stamp == 0:
                continue  # being mutated: restart at 2
            payload = read(_u(head, PAYLOAD), _u(head, SIZE))
            if _u(read(start, 32), STAMP) == stamp:  # re-verify: unchanged, so consistent
                return name, version, stamp, payload
    return None


def decode(payload: bytes):
    from llmobs._proto.otel_process_context_pb2 import ProcessContext

    def value(v):
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    message = ProcessContext.FromString(payload)
    return (
        {kv.key: value(kv.value) for kv in message.resource.attributes},
        {kv.key: value(kv.value) for kv in message.attributes},
    )


# OTEP 4947's record table: trace-id u8[16], span-id u8[8], valid u8, trace-flags u8,
# attrs-data-size u16 (native), attrs-data: entries of key u8, length u8, value.
def spec_record(raw: bytes, key_map: list[str]) -> dict:
    size = int.from_bytes(raw[26:28], sys.byteorder)
    attrs, data, i = {}, raw[28 : 28 + size], 0
    while i + 2 <= len(data) and i + 2 + data[i + 1] <= len(data):
        key, length = data[i], data[i + 1]
        if key < len(key_map):  # "ignore entries whose key index is outside" the map
            attrs[key_map[key]] = data[i + 2 : i + 2 + length].decode()  # last occurrence wins
        i += 2 + length
    return {"trace": raw[0:16], "span": raw[16:24], "valid": raw[24], "flags": raw[25], "attrs": attrs}


# --- an instrumented process: two threads stepping requests at once ------------------------------
CHILD = r"""
import ctypes, json, os, sys, threading, time
t_before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
import llmobs, torch
from llmobs.shm import otel_ctx, thread_ctx
from llmobs.shm.writer import get_writer

torch.manual_seed(0)
model = torch.nn.Linear(8, 32)
llmobs.instrument(model, model_id="demo-model")  # publishes OTEL_CTX
lib = thread_ctx.library()
lockstep = threading.Barrier(2, timeout=30)
snaps = []

def record():
    ptr = ctypes.c_void_p.in_dll(lib, "otel_thread_ctx_v1").value  # this thread's TLS, via dlsym
    return ctypes.string_at(ptr, 640).hex() if ptr else None

def snap(seq):
    # called by begin_step on the stepping thread, after it wrote its record; the threads wait for
    # each other here, so every step of one overlaps a step of the other
    if seq:
        before = record()
        lockstep.wait()
        lockstep.wait()  # the other thread has written its own record by now
        snaps.append({"thread": threading.current_thread().name, "seq": seq, "before": before,
                      "after": record()})

get_writer().step_hook = snap

def run(tenant, prompt):
    # the publisher's request API, one token step per forward pass of the model, on this thread
    with llmobs.request(torch.tensor([prompt]), tenant=tenant, model_id="demo-model") as req:
        x = torch.randn(1, 8)
        for _ in range(5):
            req.begin_step()
            logits = model(x)
            req.step(logits, token_ids=logits.argmax(-1))
    snaps.append({"thread": threading.current_thread().name, "seq": 0, "after": record()})

threads = [threading.Thread(target=run, name=t, args=(t, p)) for t, p in (("acme", [1, 2, 3, 4]),
                                                                          ("globex", [9, 8, 7]))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"instance_id": otel_ctx.instance_id, "t_before": t_before, "snaps": snaps,
                  "library": lib is not None}), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    shm = tmp_path_factory.mktemp("shm")
    env = dict(os.environ, LLMOBS_SHM_DIR=str(shm), OTEL_SERVICE_NAME="otel-ctx-test", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(proc.stderr.read()[-3000:])
    info = json.loads(line)
    info.update(pid=proc.pid, shm=shm)
    yield info
    proc.stdin.close()
    proc.wait(timeout=30)


def test_spec_reader_decodes_the_process_context(child):
    assert thread_ctx.available(), "scripts/setup.sh builds the thread-context library"
    read = spec_read(child["pid"])
    assert read is not None
    name, version, stamp, payload = read
    assert name.startswith("/memfd:OTEL_CTX") or name in ("[anon_shmem:OTEL_CTX]", "[anon:OTEL_CTX]")
    assert child["t_before"] < stamp <= time.clock_gettime_ns(time.CLOCK_BOOTTIME)  # CLOCK_BOOTTIME
    resource, attributes = decode(payload)
    pid = child["pid"]
    assert resource == {
        "service.name": "otel-ctx-test",
        "service.instance.id": child["instance_id"],
        "telemetry.sdk.name": "llmobs",
        "telemetry.sdk.language": "python",
        "process.pid": str(pid),
        "llmobs.model_id": "demo-model",
        "llmobs.shm.path": f"{child['shm']}/llmobs.{pid}",
        "llmobs.shm.abi_version": str(layout.ABI_VERSION),
    }
    assert attributes == {  # OTEP 4947's Thread-Local Reference Data
        "threadlocal.schema_version": "tlsdesc_v1_dev",
        "threadlocal.attribute_key_map": ["llmobs.tenant", "llmobs.step_seq"],
    }
    with open(f"/proc/{pid}/smaps") as smaps:  # MADV_DONTFORK: VmFlags "dc" on the mapping
        text = smaps.read()
    block = text[text.index("OTEL_CTX") :]
    flags = next(line for line in block.splitlines() if line.startswith("VmFlags:"))
    assert " dc" in flags, flags


def test_our_reader_inspect_and_doctor_agree(child):
    pid = child["pid"]
    ours = otel_ctx_reader.read_process_context(pid)
    assert (ours.format, ours.status, ours.version) == ("otep-4719", "ok", 2)
    assert (ours.resource, ours.attributes) == decode(spec_read(pid)[3])
    proc = subprocess.run([*AGENT, "inspect", "--pid", str(pid), "--json", "--shm-dir", str(child["shm"])],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)["otel_process_context"]
    assert shown["format"] == "otep-4719" and shown["resource"]["llmobs.model_id"] == "demo-model"
    from llmobs.commands.inspect import otel_context_line
    from llmobs.hostcheck.otelctx import process_row

    line = otel_context_line(shown)
    assert line.startswith("otel_ctx   OTEP 4719 v2  service.name otel-ctx-test") and "tlsdesc_v1_dev" in line
    row = process_row(pid)
    assert row.status == "OK" and child["instance_id"] in row.detail


def test_each_thread_record_carries_its_own_step_span(child):
    """Two threads stepping requests at once, in lockstep: at every step each thread's record (read through
    the TLS symbol) holds its own trace, the span id the OTLP export derives from that step's row,
    its tenant and step_seq, and the other thread's steps never change it."""
    from llmobs.otlp.encoder import SpanIds
    from llmobs.shm.reader import ShmReader

    pid = child["pid"]
    key_map = decode(spec_read(pid)[3])[1]["threadlocal.attribute_key_map"]
    with ShmReader(pid, shm_dir=str(child["shm"])) as reader:
        rows = reader.read_steps(0).rows()
        tenants = {row["step_seq"]: row["tenant"] for row in rows}
    first_row = {row["step_seq"]: row["trace_id"] for row in rows if row["batch_row"] == 0}
    snaps = [s for s in child["snaps"] if s["seq"]]
    assert sorted(s["thread"] for s in snaps) == ["acme"] * 5 + ["globex"] * 5
    assert sorted(s["seq"] for s in snaps) == sorted(first_row)  # one record per token step
    seqs = np.array([s["seq"] for s in snaps], np.int64)
    traces = pa.array([first_row[s["seq"]] for s in snaps])
    _, export_spans, _ = SpanIds().step_ids(
        np.full(len(snaps), pid), traces, seqs, np.zeros(len(snaps), np.int64)
    )
    for i, snap in enumerate(snaps):
        record = spec_record(bytes.fromhex(snap["before"]), key_map)
        assert snap["after"] == snap["before"]  # the other thread's step did not touch this record
        assert tenants[snap["seq"]] == snap["thread"]
        assert record == {
            "trace": bytes.fromhex(first_row[snap["seq"]]),
            "span": export_spans[8 * i : 8 * i + 8],
            "valid": 1,
            "flags": 1,
            "attrs": {"llmobs.tenant": snap["thread"], "llmobs.step_seq": str(snap["seq"])},
        }
    ends = [s for s in child["snaps"] if not s["seq"]]
    assert len(ends) == 2 and all(bytes.fromhex(s["after"])[24] == 0 for s in ends)  # detached: invalid


# --- the pre-merge draft, as llmobs published it before this change --------------------------------
DRAFT = r"""
import mmap, os, struct, sys, time
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from llmobs.shm.writer import get_writer
get_writer().set_model("draft-model")  # an llmobs map, so `inspect` has something to open
res = Resource()
for k, v in (("service.name", "old-svc"), ("service.instance.id", "old-1")):
    kv = res.attributes.add(); kv.key = k; kv.value.string_value = v
payload = res.SerializeToString()
fd = os.memfd_create("OTEL_CTX", os.MFD_CLOEXEC)
os.ftruncate(fd, 8192)
mm = mmap.mmap(fd, 8192, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)
import ctypes
anchor = ctypes.c_char.from_buffer(mm); address = ctypes.addressof(anchor); del anchor
mm[32:32 + len(payload)] = payload
struct.pack_into("<IIQQ", mm, 8, 2, len(payload), time.time_ns(), address + 32)  # epoch ns
mm[:8] = b"OTEL_CTX"
print("ready", flush=True)
sys.stdin.read()
"""


def test_draft_mapping_is_reported_as_draft(tmp_path):
    env = dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", DRAFT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        inspect = [*AGENT, "inspect", "--pid", str(proc.pid), "--shm-dir", str(tmp_path)]
        out = subprocess.run([*inspect, "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        shown = json.loads(out.stdout)["otel_process_context"]
        assert (shown["format"], shown["status"], shown["version"]) == ("pre-merge-draft", "ok", 2)
        assert shown["resource"] == {"service.name": "old-svc", "service.instance.id": "old-1"}
        text = subprocess.run(inspect, capture_output=True, text=True, timeout=60).stdout
        assert "otel_ctx   pre-merge draft (epoch timestamp, bare Resource payload) v2  " in text
        from llmobs.hostcheck.otelctx import process_row

        row = process_row(proc.pid)
        assert row.status == "DEGRADED" and row.detail.startswith("pre-merge-draft layout")
        assert spec_read(proc.pid)[2] > time.clock_gettime_ns(time.CLOCK_BOOTTIME)  # not a boottime stamp
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


# --- the updating protocol, watched from inside the publisher --------------------------------------
@pytest.fixture
def fresh_context():
    # This test process publishes its own, from scratch: one an earlier test published here is unmapped
    # (not orphaned as in a forked child), so the readers find exactly one OTEL_CTX mapping.
    if otel_ctx._published is not None:
        otel_ctx._published.close()
        otel_ctx._published = None
    yield
    if otel_ctx._published is not None:
        otel_ctx._published.close()
    otel_ctx._published = None


def test_update_protocol_zero_stamp_while_updating(fresh_context, monkeypatch):
    """At each of the protocol's fences the header is captured, and both readers run: during an update
    the stamp is 0 and neither reader returns a context; after it, a later stamp, the new payload at a
    new pointer. A clock that does not move still gives each update a new stamp."""
    import ctypes

    seen = []

    def fence():
        address = otel_ctx.published_address()
        head = ctypes.string_at(address, 32)
        spec = spec_read(os.getpid(), attempts=3)
        seen.append(
            (_u(head, STAMP), _u(head, PAYLOAD), spec, otel_ctx_reader.read_process_context(os.getpid()))
        )
        thread_ctx.fence()

    monkeypatch.setattr(otel_ctx, "_fence", fence)
    assert otel_ctx.publish_process_context(model_id="first"), otel_ctx.last_failure
    (stamp0, _, _, _), *_ = seen
    assert stamp0 == 0  # publication: every field but the stamp, then the fence, then the stamp
    _, _, first_stamp, first_payload = spec_read(os.getpid())
    first_pointer = _u(ctypes.string_at(otel_ctx.published_address(), 32), PAYLOAD)
    seen.clear()
    monkeypatch.setattr(otel_ctx, "_boottime_ns", lambda: first_stamp)  # a clock that did not move
    assert otel_ctx.publish_process_context(model_id="second"), otel_ctx.last_failure
    assert [s[0] for s in seen] == [0, 0]  # both fences of the update: stamp 0
    assert seen[0][1] == first_pointer and seen[1][1] != first_pointer  # pointer moved before the stamp
    assert all(s[2] is None and s[3].status == "updating" for s in seen)  # nobody reads a torn context
    _, _, second_stamp, second_payload = spec_read(os.getpid())
    assert second_stamp == first_stamp + 1
    assert decode(second_payload)[0]["llmobs.model_id"] == "second"
    assert decode(first_payload)[0]["llmobs.model_id"] == "first"


def test_without_the_library_nothing_is_published_and_nothing_raises(tmp_path):
    code = r"""
import json
from llmobs.shm import otel_ctx, thread_ctx
from llmobs.shm.otel_ctx_reader import read_process_context
from llmobs.shm.writer import get_writer
w = get_writer()
seq = w.begin_step(1, 2, w.name(1, "acme"), 0)
w.clear_context()
ok = otel_ctx.publish_process_context(model_id="m")
import os
c = read_process_context(os.getpid())
print(json.dumps([thread_ctx.available(), seq, ok, c.attributes, c.resource["llmobs.model_id"]]))
"""
    env = dict(os.environ, LLMOBS_SHM_DIR=str(tmp_path), LLMOBS_THREAD_CTX_LIB=str(tmp_path / "missing.so"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, 1, True, {}, "m"]


def test_library_exports_the_tls_symbol_and_hashes_like_the_encoder():
    from llmobs.otlp.encoder import SpanIds

    dynsym = subprocess.run(["readelf", "--dyn-syms", "-W", str(thread_ctx.LIBRARY)], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    entry = [line.split() for line in dynsym.splitlines() if line.endswith(" otel_thread_ctx_v1")]
    assert len(entry) == 1 and entry[0][2:6] == ["8", "TLS", "GLOBAL", "DEFAULT"], dynsym
    relocs = subprocess.run(["readelf", "-r", "-W", str(thread_ctx.LIBRARY)], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    assert "R_X86_64_TLSDESC" in relocs or "R_AARCH64_TLSDESC" in relocs  # -mtls-dialect=gnu2
    import ctypes

    lib = thread_ctx.library()
    thread_ctx.remember_tenant(77, "t" * 300)  # longer than an entry holds: cut to 253 bytes
    for pid, hi, lo, seq in (
        (1, 1, 2, 1),
        (4242, 0xFFFFFFFFFFFFFFFF, 3, 2**40 + 7),
        (99999, 5, 0, 123456789),
    ):
        thread_ctx.attach(pid, hi, lo, seq, 77)
        raw = ctypes.string_at(lib.llmobs_thread_ctx_pointer(), 640)
        record = spec_record(raw, list(thread_ctx.ATTRIBUTE_KEYS))
        assert record["span"] == SpanIds.step_span_id(pid, f"{hi:016x}{lo:016x}", seq, 0)
        assert record["trace"] == hi.to_bytes(8, "big") + lo.to_bytes(8, "big")
        assert record["attrs"] == {"llmobs.tenant": "t" * 253, "llmobs.step_seq": str(seq)}
    assert thread_ctx.uses_extension()  # setup.sh builds it with Python's headers (python3-dev)
    ctypes_step = thread_ctx._ctypes_step(lib.llmobs_thread_ctx_step)  # the path without them
    ctypes_step(thread_ctx._blob(4242, 7, 8, 77), 2**33 + 1)
    record = spec_record(
        ctypes.string_at(lib.llmobs_thread_ctx_pointer(), 640), list(thread_ctx.ATTRIBUTE_KEYS)
    )
    assert record["span"] == SpanIds.step_span_id(4242, f"{7:016x}{8:016x}", 2**33 + 1, 0)
    assert record["attrs"]["llmobs.step_seq"] == str(2**33 + 1)
    thread_ctx.attach(5, 0, 0, 9, 0)  # a pass of several requests: no trace, still its step
    record = spec_record(
        ctypes.string_at(lib.llmobs_thread_ctx_pointer(), 640), list(thread_ctx.ATTRIBUTE_KEYS)
    )
    assert record == {
        "trace": bytes(16),
        "span": bytes(8),
        "valid": 1,
        "flags": 0,
        "attrs": {"llmobs.step_seq": "9"},
    }
    thread_ctx.detach()
    assert ctypes.string_at(lib.llmobs_thread_ctx_pointer(), 640)[24] == 0


def test_process_context_message_is_upstreams():
    """opentelemetry-proto v1.11.0's ProcessContext: same package, names, numbers and types."""
    from llmobs.shm.otel_ctx_format import ProcessContext

    desc = ProcessContext.DESCRIPTOR
    assert desc.full_name == "opentelemetry.proto.processcontext.v1development.ProcessContext"
    fields = {f.number: (f.name, f.message_type.full_name, f.is_repeated) for f in desc.fields}
    assert fields == {
        1: ("resource", "opentelemetry.proto.resource.v1.Resource", False),
        2: ("attributes", "opentelemetry.proto.common.v1.KeyValue", True),
    }
