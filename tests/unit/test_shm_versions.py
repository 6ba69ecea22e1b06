"""ABI v3 beside v2: a map written by a v2 writer is still read (its v3 fields decode as their defaults),
and the v3 parts (mixed-pass rows, the request-events ring, request ids) round-trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llmobs.errors import MalformedMap
from llmobs.shm import layout
from llmobs.shm.reader import BufferSource, MapView, parse_buffer
from llmobs.shm.writer import ShmWriter

_H = layout.HEADER.offsets


@pytest.fixture
def writer(tmp_path):
    w = ShmWriter(shm_dir=str(tmp_path), names_capacity=8, steps_capacity=8, cupti_capacity=4,
                  layers_capacity=4, requests_capacity=4, model_id="m1")  # fmt: skip
    yield w
    w.close()


def _block(n: int) -> torch.Tensor:
    block = torch.zeros((n, 7), dtype=torch.float32)
    block[:, 0] = 2.5
    block[:, 4:] = torch.tensor([[0, 7, 7]] * n, dtype=torch.int32).view(torch.float32)
    return block


def _as_v2(w: ShmWriter) -> bytearray:
    """The bytes a v2 writer would have left for the same records: no request-events ring, the v3 words
    reserved (zero), its version and layout hash."""
    v2 = layout.regions(w.names_capacity, w.steps_capacity, w.cupti_capacity, w.layers_capacity)
    data = bytearray(bytes(w.mm[: v2.layout_size]))
    hdr = np.frombuffer(data, layout.HEADER.dtype, 1)
    hdr["abi_version"] = 2
    hdr["layout_hash"] = layout.LAYOUT_HASHES[2]
    hdr["layout_size"] = v2.layout_size
    for name in ("requests_offset", "requests_capacity", "request_record_size", "requests_head",
                 "requests_dropped"):  # fmt: skip
        hdr[name] = 0
    steps = np.frombuffer(data, layout.STEP_RECORD.dtype, w.steps_capacity, w.steps_offset)
    steps["tokens_in_pass"] = 0
    steps["request_seq"] = 0
    cell = np.frombuffer(data, layout.CTX_CELL.dtype, 1, layout.CTX_OFFSET)
    cell["rows"], cell["flags"], cell["tokens"] = 0, 0, 0
    return data


def _publish(w: ShmWriter, n: int = 2) -> int:
    seq = w.begin_step(1, 2, 0, 0)
    w.publish_steps(_block(n), step_seq=seq, t_start=10, t_end=20, trace_hi=[0xAB] * n, trace_lo=[0xCD] * n,
                    tenant_hash=0, session_hash=0, model_hash=0, step=0, position=np.arange(n),
                    batch_row=np.arange(n), kv_len=-1, flags=layout.FLAG_HAS_TARGET)  # fmt: skip
    return seq


def test_a_v2_map_is_read_with_the_new_fields_as_defaults(writer):
    _publish(writer, 3)
    view, batch = parse_buffer(_as_v2(writer))
    assert view.header["abi_version"] == 2 and len(batch) == 3 and batch.corrupt == 0
    assert batch.columns["tokens_in_pass"].tolist() == [0, 0, 0]
    assert batch.columns["request_seq"].tolist() == [0, 0, 0] and batch.columns["request_id"] == ["", "", ""]
    assert batch.columns["loss"].tolist() == [2.5, 2.5, 2.5]
    assert len(view.read_request_events(0, refresh=False)) == 0
    assert view.context()["rows"] == 0


def test_a_v2_map_with_v3_words_set_is_malformed(writer):
    data = _as_v2(writer)
    np.frombuffer(data, layout.HEADER.dtype, 1)["requests_capacity"] = 4
    with pytest.raises(MalformedMap, match="reserved"):
        MapView(BufferSource(data))


def test_other_versions_are_refused(writer):
    data = bytearray(bytes(writer.mm))
    np.frombuffer(data, layout.HEADER.dtype, 1)["abi_version"] = 4
    with pytest.raises(MalformedMap, match="reads versions 2 and 3"):
        MapView(BufferSource(data))


def test_mixed_pass_rows_request_ids_and_request_events_round_trip(writer):
    writer.name_request(7, "req_7")
    writer.name_request(9, "chatcmpl-9")
    seq = writer.begin_step(0, 0, 0, 0, rows=2, flags=layout.CTX_MIXED, tokens=13)
    writer.publish_steps(
        _block(2), step_seq=seq, t_start=10, t_end=20, trace_hi=[1, 3], trace_lo=[2, 4],
        tenant_hash=np.array([11, 12], np.uint64), session_hash=0, model_hash=0, step=np.array([0, 5]),
        position=np.array([12, 40]), batch_row=np.array([0, 1]), kv_len=np.array([0, 39]),
        flags=np.array([layout.FLAG_PREFILL, 0], np.uint32), tokens_in_pass=np.array([12, 1]),
        request_seq=np.array([7, 9]),
    )  # fmt: skip
    writer.publish_request_event(kind=layout.REQUEST_END, request_seq=9, step_seq=seq, t_start=100,
                                 t_scheduled=150, t_first_token=300, t_last_token=700, t_end=710,
                                 prompt_tokens=30, prefill_tokens=14, decoded_tokens=5, kv_blocks=3,
                                 prefix_hit_tokens=16, finish_reason=layout.FINISH_STOP)  # fmt: skip
    writer.publish_request_event(kind=layout.REQUEST_CHUNK, request_seq=7, step_seq=seq, t_start=10, t_end=20,
                                 prefill_tokens=8, finish_reason=4)  # fmt: skip
    view = MapView(BufferSource(bytes(writer.mm)))
    assert view.context() | {"seq": 0} == {"seq": 0, "trace_id": "0" * 32, "step_seq": seq, "tenant_hash": 0,
                                           "session_hash": 0, "rows": 2, "flags": layout.CTX_MIXED,
                                           "tokens": 13}  # fmt: skip
    batch = view.read_steps(0)
    assert batch.columns["tokens_in_pass"].tolist() == [12, 1]
    assert batch.columns["request_id"] == ["req_7", "chatcmpl-9"] and batch.columns["step"].tolist() == [0, 5]
    events = view.read_request_events(0)
    c = events.columns
    assert c["kind"] == ["end", "chunk"] and c["request_id"] == ["chatcmpl-9", "req_7"]
    assert c["queue_ns"].tolist() == [50, -1] and c["ttft_ns"].tolist() == [200, -1]
    assert c["tpot_ns"].tolist() == [100, -1]  # (700 - 300) / (5 - 1)
    assert c["finish_reason"] == ["stop", ""] and c["position"].tolist() == [-1, 4]
    assert c["prefix_hit_tokens"].tolist() == [16, 0] and c["prefill_tokens"].tolist() == [14, 8]


def test_the_request_events_ring_wraps_and_counts_what_it_lost(writer):
    for i in range(10):
        writer.publish_request_event(kind=layout.REQUEST_END, request_seq=i + 1, t_end=5)
    events = MapView(BufferSource(bytes(writer.mm))).read_request_events(0)
    assert events.lost == 6 and events.columns["request_seq"].tolist() == [7, 8, 9, 10]
