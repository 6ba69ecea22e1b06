"""Protobuf (proto/llmobs.proto) vs JSON for llmobs records: encoded size and encode/decode time of
token-step records and of per-request trace logs, measured side by side in one run.

The two codecs are timed in interleaved repetitions (JSON, protobuf, protobuf, JSON, ...) by
bench/harness.py, so a noisy machine slows both alike; min / median / max and the ratio JSON/protobuf
with its interval are printed. Both encode the same
decoded token-step columns (docs/proto.md); JSON is compact (no spaces), the stronger baseline.
Every run checks that both codecs give back exactly what went in, so the timings are of real work.

    .venv/bin/python -m bench.proto [--records 100000] [--reps 5] [--tokens 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
from collections.abc import Callable

import google.protobuf as protobuf
from google.protobuf.internal import api_implementation
from llmobs._proto import llmobs_pb2 as pb

from bench.harness import Arm, Report, Stopwatch, add_json_option

# The published design this schema is compared with: JSON -> protobuf, per trace log.
REFERENCE_BYTES = (12.7 * 1000, 3.2 * 1000)
REFERENCE_US = (89.0, 14.0)

# Token-step fields that an LLMTraceLog carries once, not per token.
PER_LOG_FIELDS = ("pid", "trace_id", "tenant", "session", "model_id")
FLOAT_FIELDS = ("loss", "entropy", "target_prob", "top1_prob")


def f32(x: float) -> float:
    """x rounded to float32, as the shared-memory map stores it (so protobuf's float is exact)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def make_token_steps(count: int, tokens_per_request: int, rng: random.Random) -> list[dict]:
    """Decoded token-step columns as the shm reader produces them, with plausible values."""
    steps = []
    t = 1_234_567_890_123_456  # CLOCK_MONOTONIC ns, a machine up ~14 days
    trace_id = ""
    prompt_len = 0
    for i in range(count):
        step = i % tokens_per_request
        if step == 0:
            trace_id = rng.randbytes(16).hex()
            prompt_len = rng.randrange(16, 512)
        latency = rng.randrange(20_000_000, 40_000_000)
        target = rng.randrange(49_152)
        steps.append(
            {
                "pid": 48_213,
                "step_seq": i + 1,
                "trace_id": trace_id,
                "step": step,
                "position": prompt_len + step,
                "token_id": rng.randrange(49_152),
                "target_id": target if rng.random() < 0.9 else -1,
                "loss": f32(rng.uniform(0.0, 9.0)),
                "entropy": f32(rng.uniform(0.0, 6.0)),
                "target_prob": f32(rng.random()),
                "target_rank": rng.randrange(0, 50),
                "top1_prob": f32(rng.random()),
                "latency_ns": latency,
                "t_start_ns": t,
                "t_end_ns": t + latency,
                "batch_row": 0,
                "tenant": "team-search",
                "session": "sess-7f3a91c2",
                "model_id": "SmolLM2-135M-Instruct",
                "kv_len": prompt_len + step,
            }
        )
        t += latency + rng.randrange(10_000, 200_000)
    return steps


def token_step_to_dict(msg: pb.TokenStep, names: tuple[str, ...]) -> dict:
    row = {name: getattr(msg, name) for name in names}
    if "trace_id" in row:
        row["trace_id"] = row["trace_id"].hex()
    return row


# --- 100k token-step records: one JSON array vs one TokenStepBatch ---


def json_encode_steps(rows: list[dict]) -> bytes:
    return json.dumps(rows, separators=(",", ":")).encode()


def json_decode_steps(blob: bytes) -> list[dict]:
    return json.loads(blob)


def proto_encode_steps(rows: list[dict]) -> bytes:
    batch = pb.TokenStepBatch()
    add = batch.steps.add  # add(**fields) sets them in C, much faster than setattr one by one
    for row in rows:
        add(**{**row, "trace_id": bytes.fromhex(row["trace_id"])})
    return batch.SerializeToString()


def proto_parse_steps(blob: bytes) -> pb.TokenStepBatch:
    return pb.TokenStepBatch.FromString(blob)


def proto_decode_steps_to_dicts(blob: bytes, names: tuple[str, ...]) -> list[dict]:
    return [token_step_to_dict(step, names) for step in pb.TokenStepBatch.FromString(blob).steps]


# --- per-request trace logs ---


def make_trace_logs(rows: list[dict], tokens: int, rng: random.Random) -> list[dict]:
    """JSON-ready trace logs of `tokens` token steps each, the per-log fields lifted out."""
    logs = []
    for start in range(0, len(rows) - tokens + 1, tokens):
        chunk = rows[start : start + tokens]
        first = chunk[0]
        logs.append(
            {
                "trace_id": first["trace_id"],
                "timestamp_unix_ns": 1_796_000_000_000_000_000 + start,
                "monotonic_to_unix_ns": 1_794_765_432_109_876_544,
                "pid": first["pid"],
                "request": {
                    "prompt_hash": rng.getrandbits(64),
                    "max_tokens": tokens,
                    "tenant": first["tenant"],
                    "session": first["session"],
                    "prompt_tokens": first["position"],
                },
                "response": {"output_tokens": tokens, "model_id": first["model_id"]},
                "tokens": [{k: v for k, v in r.items() if k not in PER_LOG_FIELDS} for r in chunk],
                "sample_ratio": 1,
            }
        )
    return logs


def json_roundtrip_log(log: dict) -> tuple[bytes, dict]:
    blob = json.dumps(log, separators=(",", ":")).encode()
    return blob, json.loads(blob)


def proto_encode_log(log: dict) -> bytes:
    msg = pb.LLMTraceLog(
        trace_id=bytes.fromhex(log["trace_id"]),
        timestamp_unix_ns=log["timestamp_unix_ns"],
        monotonic_to_unix_ns=log["monotonic_to_unix_ns"],
        pid=log["pid"],
        request=pb.LLMTraceLog.Request(**log["request"]),
        response=pb.LLMTraceLog.Response(**log["response"]),
        sample_ratio=log["sample_ratio"],
    )
    add = msg.tokens.add
    for row in log["tokens"]:  # the per-log fields are already lifted out of these rows
        add(**row)
    return msg.SerializeToString()


def proto_roundtrip_log(log: dict) -> tuple[bytes, pb.LLMTraceLog]:
    blob = proto_encode_log(log)
    return blob, pb.LLMTraceLog.FromString(blob)


def proto_log_to_dict(msg: pb.LLMTraceLog, token_names: tuple[str, ...]) -> dict:
    return {
        "trace_id": msg.trace_id.hex(),
        "timestamp_unix_ns": msg.timestamp_unix_ns,
        "monotonic_to_unix_ns": msg.monotonic_to_unix_ns,
        "pid": msg.pid,
        "request": {
            f: getattr(msg.request, f)
            for f in ("prompt_hash", "max_tokens", "tenant", "session", "prompt_tokens")
        },
        "response": {"output_tokens": msg.response.output_tokens, "model_id": msg.response.model_id},
        "tokens": [token_step_to_dict(t, token_names) for t in msg.tokens],
        "sample_ratio": msg.sample_ratio,
    }


# --- output ---


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}x" if b else "  n/a"


LABEL = 24  # width of the label column
CELL = 25  # width of a JSON or protobuf column


def row_text(label: str, json_cell: str, proto_cell: str, ratio: str = "") -> str:
    return f"  {label:<{LABEL}} {json_cell:>{CELL}}  {proto_cell:>{CELL}}  {ratio}".rstrip()


def timed_ms(fn: Callable[[], object]) -> float:
    with Stopwatch() as watch:
        fn()
    return watch.wall * 1e3


def bench_records(rows: list[dict], reps: int, report: Report) -> None:
    names = tuple(rows[0])
    json_blob = json_encode_steps(rows)
    proto_blob = proto_encode_steps(rows)
    # Both codecs must give back exactly what went in (floats are float32 values, so exact in both).
    assert json_decode_steps(json_blob) == rows, "JSON round trip changed the records"
    assert proto_decode_steps_to_dicts(proto_blob, names) == rows, "protobuf round trip changed the records"
    n = len(rows)

    def codec(encode, parse, to_dicts) -> Callable:
        def arm(ctx) -> dict[str, float]:
            figures = {"encode ms": timed_ms(encode), "decode (parse) ms": timed_ms(parse),
                       "decode (to dicts) ms": timed_ms(to_dicts)}  # fmt: skip
            figures["encode+parse per record us"] = (
                (figures["encode ms"] + figures["decode (parse) ms"]) * 1e3 / n
            )
            return figures

        return arm

    report.note(f"{n} token-step records, {reps} interleaved repetitions")
    print(row_text("", "JSON (compact)", "protobuf", "JSON/protobuf"))
    print(
        row_text(
            "size",
            f"{len(json_blob) / 1e6:.2f} MB",
            f"{len(proto_blob) / 1e6:.2f} MB",
            fmt_ratio(len(json_blob), len(proto_blob)).strip(),
        )
    )
    print(row_text("size per record", f"{len(json_blob) / n:.1f} B", f"{len(proto_blob) / n:.1f} B"))
    arms = [
        Arm("JSON", codec(lambda: json_encode_steps(rows), lambda: json_decode_steps(json_blob),
                          lambda: json_decode_steps(json_blob))),
        Arm("protobuf", codec(lambda: proto_encode_steps(rows), lambda: proto_parse_steps(proto_blob),
                              lambda: proto_decode_steps_to_dicts(proto_blob, names))),
    ]  # fmt: skip
    report.compare(f"{n} token-step records", arms, reps, baseline="protobuf",
                   metrics=["encode ms", "decode (parse) ms", "decode (to dicts) ms",
                            "encode+parse per record us"])  # fmt: skip


def bench_trace_logs(logs: list[dict], tokens: int, reps: int, report: Report) -> None:
    token_names = tuple(logs[0]["tokens"][0])
    json_sizes = [len(json_roundtrip_log(log)[0]) for log in logs]
    proto_sizes = []
    for log in logs:
        blob, msg = proto_roundtrip_log(log)
        assert proto_log_to_dict(msg, token_names) == log, "protobuf trace log round trip changed it"
        assert json_roundtrip_log(log)[1] == log
        proto_sizes.append(len(blob))

    def all_logs(roundtrip) -> Callable:
        def arm(ctx) -> dict[str, float]:
            with ctx.timed() as watch:
                for log in logs:
                    roundtrip(log)
            return {"encode+decode us per log": watch.wall / len(logs) * 1e6}

        return arm

    print()
    made = report.compare(
        f"per trace log (LLMTraceLog of {tokens} tokens; {len(logs)} logs)",
        [Arm("JSON", all_logs(json_roundtrip_log)), Arm("protobuf", all_logs(proto_roundtrip_log))],
        reps, baseline="protobuf", metrics=["encode+decode us per log"],
    )  # fmt: skip
    figure = "encode+decode us per log"
    json_bytes = statistics.median(json_sizes)
    proto_bytes = statistics.median(proto_sizes)
    json_us, proto_us = made.median("JSON", figure), made.median("protobuf", figure)
    ref_json_b, ref_proto_b = REFERENCE_BYTES
    ref_json_us, ref_proto_us = REFERENCE_US
    print(
        row_text("", "JSON (compact)", "protobuf", "JSON/protobuf   | published reference, JSON -> protobuf")
    )
    size_ratio = fmt_ratio(json_bytes, proto_bytes).strip()
    ref_ratio = fmt_ratio(ref_json_b, ref_proto_b).strip()
    ref_size = f"{ref_json_b / 1000:.1f} KB -> {ref_proto_b / 1000:.1f} KB ({ref_ratio})"
    print(
        row_text(
            "size, median",
            f"{json_bytes / 1000:.1f} KB",
            f"{proto_bytes / 1000:.1f} KB",
            f"{size_ratio:<15} | {ref_size}",
        )
    )
    time_ratio = fmt_ratio(json_us, proto_us).strip()
    ref_time = (
        f"{ref_json_us:.0f} us -> {ref_proto_us:.0f} us ({fmt_ratio(ref_json_us, ref_proto_us).strip()})"
    )
    print(
        row_text(
            "encode+decode, median",
            f"{json_us:.1f} us",
            f"{proto_us:.1f} us",
            f"{time_ratio:<15} | {ref_time}",
        )
    )
    print(row_text("bytes per token", f"{json_bytes / tokens:.1f} B", f"{proto_bytes / tokens:.1f} B"))
    print("  (a trace log carries pid, trace id, tenant, session and model id once, not per token)")
    print(
        f"  ours / reference: JSON size {json_bytes / ref_json_b:.2f}x, "
        f"protobuf size {proto_bytes / ref_proto_b:.2f}x, protobuf time {proto_us / ref_proto_us:.2f}x "
        "(Python upb here; the reference's runtime is not stated)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=100_000, help="token-step records (default 100000)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (default 5)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per trace log (default 64)")
    parser.add_argument("--logs", type=int, default=200, help="trace logs timed per repetition (default 200)")
    parser.add_argument("--seed", type=int, default=1)
    add_json_option(parser)
    args = parser.parse_args(argv)
    if args.records < args.tokens or args.reps < 1 or args.tokens < 1 or args.logs < 1:
        parser.error("need --records >= --tokens >= 1, --reps >= 1, --logs >= 1")
    rng = random.Random(args.seed)
    print(
        f"bench_proto: python {sys.version.split()[0]}, protobuf {protobuf.__version__} "
        f"({api_implementation.Type()} runtime), schema llmobs.v1"
    )
    rows = make_token_steps(args.records, args.tokens, rng)
    report = Report("proto", args)
    bench_records(rows, args.reps, report)
    log_rows = rows[: args.tokens * args.logs] if args.records >= args.tokens * args.logs else rows
    logs = make_trace_logs(log_rows, args.tokens, rng)
    bench_trace_logs(logs, args.tokens, args.reps, report)
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
