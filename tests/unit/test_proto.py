"""The schema of record (proto/llmobs.proto): generated code in step with the .proto, field numbers
never reused, and records that survive a round trip exactly."""

from __future__ import annotations

import math
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from llmobs._proto import llmobs_pb2 as pb
from llmobs.shm.reader import STEP_COLUMNS

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "llmobs.proto"

# Every field ever published, with its number. A field may be removed only by reserving both its
# number and its name; it may never be renumbered, and its number never reused.
PUBLISHED_FIELDS: dict[str, dict[str, int]] = {
    "TokenStep": {
        "pid": 1,
        "step_seq": 2,
        "trace_id": 3,
        "step": 4,
        "position": 5,
        "token_id": 6,
        "target_id": 7,
        "loss": 8,
        "entropy": 9,
        "target_prob": 10,
        "target_rank": 11,
        "top1_prob": 12,
        "latency_ns": 13,
        "t_start_ns": 14,
        "t_end_ns": 15,
        "batch_row": 16,
        "tenant": 17,
        "session": 18,
        "model_id": 19,
        "kv_len": 20,
        "tokens_in_pass": 21,
        "request_seq": 22,
        "request_id": 23,
    },
    "TokenStepBatch": {"steps": 1},
    "GpuOp": {
        "pid": 1,
        "tid": 2,
        "cpu": 3,
        "ts_ns": 4,
        "probe": 5,
        "step_seq": 6,
        "trace_id": 7,
        "value": 8,
        "duration_ns": 9,
        "sample_ratio": 10,
        "source": 11,
        "op": 12,
        "correlation_id": 13,
        "device_id": 14,
        "stream_id": 15,
        "name": 16,
    },
    "HostEvent": {
        "pid": 1,
        "tid": 2,
        "cpu": 3,
        "ts_ns": 4,
        "probe": 5,
        "step_seq": 6,
        "trace_id": 7,
        "value": 8,
        "duration_ns": 9,
        "sample_ratio": 10,
        "kind": 11,
    },
    "MemEvent": {
        "pid": 1,
        "tid": 2,
        "cpu": 3,
        "ts_ns": 4,
        "probe": 5,
        "step_seq": 6,
        "trace_id": 7,
        "size_bytes": 8,
        "duration_ns": 9,
        "sample_ratio": 10,
        "address": 11,
    },
    "ProbeAggregate": {"pid": 1, "step_seq": 2, "probe": 3, "count": 4, "sum_value": 5, "sum_duration_ns": 6},
    "LLMTraceLog": {
        "trace_id": 1,
        "timestamp_unix_ns": 2,
        "monotonic_to_unix_ns": 3,
        "pid": 4,
        "request": 5,
        "response": 6,
        "tokens": 7,
        "aggregates": 8,
        "sample_ratio": 9,
    },
    "LLMTraceLog.Request": {"prompt_hash": 1, "max_tokens": 2, "tenant": 3, "session": 4, "prompt_tokens": 5},
    "LLMTraceLog.Response": {"output_tokens": 1, "model_id": 2},
}

# The decoded token-step columns (the map reader's output); TokenStep must carry each of them.
TOKEN_STEP_COLUMNS = STEP_COLUMNS


def message_descriptor(dotted: str):
    desc = pb.DESCRIPTOR.message_types_by_name[dotted.split(".")[0]]
    for nested in dotted.split(".")[1:]:
        desc = desc.nested_types_by_name[nested]
    return desc


def test_one_schema_file_in_package_llmobs_v1() -> None:
    # beside it only upstream's OTEP 4719 message, which opentelemetry-proto does not ship yet
    # (tests/unit/test_otel_context.py holds it to upstream's numbers)
    protos = sorted(p.name for p in (ROOT / "proto").glob("*.proto"))
    assert protos == ["llmobs.proto", "otel_process_context.proto"]
    assert pb.DESCRIPTOR.package == "llmobs.v1"


def test_generated_code_matches_the_proto_file(tmp_path: Path) -> None:
    """The generated module was built from the .proto as it is now (setup.sh regenerates it)."""
    args = ["protoc", f"--proto_path={PROTO.parent}", f"--python_out={tmp_path}", str(PROTO)]
    assert protoc.main(args) == 0
    fresh = (tmp_path / "llmobs_pb2.py").read_text()
    assert Path(pb.__file__).read_text() == fresh, "agent/llmobs/_proto is stale: run `bash scripts/setup.sh`"


def test_published_field_numbers_are_never_reused() -> None:
    for message, fields in PUBLISHED_FIELDS.items():
        desc = message_descriptor(message)
        proto = descriptor_pb2.DescriptorProto()
        desc.CopyToProto(proto)
        reserved_numbers = {n for r in proto.reserved_range for n in range(r.start, r.end)}
        for name, number in fields.items():
            field = desc.fields_by_name.get(name)
            if field is None:
                # Removed: only allowed with its number and name reserved.
                assert number in reserved_numbers and name in proto.reserved_name, f"{message}.{name}"
            else:
                assert field.number == number, f"{message}.{name} renumbered {number} -> {field.number}"
        # A new field must not take the number of a removed one.
        for field in desc.fields:
            if field.name not in fields:
                assert field.number not in fields.values(), f"{message}.{field.name} reuses {field.number}"
    assert set(PUBLISHED_FIELDS) >= {m for m in pb.DESCRIPTOR.message_types_by_name}


def test_token_step_carries_every_decoded_column() -> None:
    assert set(TOKEN_STEP_COLUMNS) <= set(pb.TokenStep.DESCRIPTOR.fields_by_name)


def test_unknown_minus_one_costs_one_byte() -> None:
    # sint32 zigzag: -1 is a single byte after the tag; a plain int32 -1 would take ten.
    assert len(pb.TokenStep(target_id=-1).SerializeToString()) == 2
    assert len(pb.TokenStep(kv_len=-1).SerializeToString()) == 3  # field 20: a two-byte tag


def test_trace_log_round_trip() -> None:
    trace_id = bytes(range(16))
    log = pb.LLMTraceLog(
        trace_id=trace_id,
        timestamp_unix_ns=1_796_000_000_123_456_789,
        monotonic_to_unix_ns=-5,
        pid=4242,
        request=pb.LLMTraceLog.Request(
            prompt_hash=0xFEDCBA9876543210, max_tokens=64, tenant="team-a", session="s-1", prompt_tokens=12
        ),
        response=pb.LLMTraceLog.Response(output_tokens=2, model_id="SmolLM2-135M-Instruct"),
        sample_ratio=8,
    )
    log.tokens.add(step_seq=7, step=0, position=12, token_id=99, target_id=-1, loss=float("nan"), kv_len=-1)
    log.tokens.add(step_seq=8, step=1, position=13, token_id=5, target_id=5, loss=0.25, target_rank=0)
    log.aggregates.add(pid=4242, step_seq=7, probe="alloc_cpu", count=2900, sum_value=1 << 33)
    back = pb.LLMTraceLog.FromString(log.SerializeToString())
    assert back.trace_id == trace_id
    assert back.timestamp_unix_ns == 1_796_000_000_123_456_789
    assert back.monotonic_to_unix_ns == -5
    assert back.request.prompt_hash == 0xFEDCBA9876543210
    assert back.request.tenant == "team-a" and back.response.model_id == "SmolLM2-135M-Instruct"
    assert [t.step_seq for t in back.tokens] == [7, 8]
    assert back.tokens[0].target_id == -1 and back.tokens[0].kv_len == -1
    assert math.isnan(back.tokens[0].loss)
    assert back.tokens[1].loss == 0.25
    assert back.aggregates[0].sum_value == 1 << 33
    assert back.tokens[0].tenant == ""  # per-log fields are not repeated per token
