"""The bulk protobuf writer (llmobs.otlp.wire) and the bulk span encoder against the generated classes:
the same bytes for the same values, and the export cursor by ingest_seq (store migration 7)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from llmobs.otlp import wire
from llmobs.otlp.encoder import SpanIds, TraceEncoder, _add_attribute, set_attribute
from llmobs.otlp.source import ExportCursor
from llmobs.pipeline import correlate
from llmobs.store import schema, synthetic
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@pytest.fixture(params=["c", "numpy"], autouse=True)
def gather_backend(request, monkeypatch):
    """Every test here runs with each gather: the C extension (built by scripts/setup.sh) and numpy's."""
    if request.param == "numpy":
        monkeypatch.setattr(wire, "_c_gather", None)
    assert wire.gather_backend() == request.param
    return request.param


def rows_of(pieces: wire.Pieces) -> list[bytes]:
    data, offsets = pieces.gather()
    raw = data.tobytes()
    return [raw[offsets[i] : offsets[i + 1]] for i in range(pieces.n)]


@pytest.mark.parametrize(
    "column",
    [
        pa.array([0, 1, 127, 128, 300, -1, 2**62, None, -(2**63)], pa.int64()),
        pa.array([0.0, 1.5, float("nan"), None, -2.25, 1e300, 0.1, 3.0, -0.0], pa.float64()),
        pa.array(["", "a", None, "ü" * 40, "x" * 200, "mem", "host", "b", "c"], pa.string()),
        pa.array([True, False, None, True, False, True, False, None, True], pa.bool_()),
    ],
    ids=["int", "double", "string", "bool"],
)
@pytest.mark.parametrize("key", ["llmobs.k", "k" * 150])  # one-byte lengths, and the general form
def test_an_attribute_column_gives_the_bytes_of_set_attribute(column, key):
    pieces = wire.Pieces(len(column))
    _add_attribute(pieces, wire.tag(9, 2), key, column)
    for got, value in zip(rows_of(pieces), column.to_pylist(), strict=True):
        span = Span()
        set_attribute(span.attributes, key, value)
        assert got == span.SerializeToString()


def test_varints_match_protobuf():
    values = np.array([0, 1, 127, 128, 16383, 16384, 2**35, -1, -(2**40), 2**63 - 1], dtype=np.int64)
    pieces = wire.Pieces(len(values)).varint(values)
    for got, value in zip(rows_of(pieces), values.tolist(), strict=True):
        span = Span()
        set_attribute(span.attributes, "k", value)  # int_value: an int64 varint after 0x18
        assert span.SerializeToString().endswith(b"\x18" + got)


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    steps = synthetic.token_steps(51, 6, 5, batch_rows=3, seed=9)
    other = synthetic.token_steps(52, 2, 4, batch_rows=1, seed=4, start_ns=2_000_000_000_000)
    store.append({"token_steps": steps, "events": synthetic.events_for_steps(steps)})
    store.append({"token_steps": other, "events": synthetic.events_for_steps(other)})
    correlate.correlate(store.connection)
    yield store
    store.close()


def test_bulk_spans_are_canonical_protobuf_of_two_processes(store):
    batch = ExportCursor(store.connection.cursor()).next_batch(limit=100, max_events_per_span=5, flush=True)
    encoded = TraceEncoder(SpanIds(), 10**18, host_name="h").encode(batch)
    message = ExportTraceServiceRequest.FromString(encoded.SerializeToString())
    # written in field order, as the generated classes write: re-serialising gives the same bytes
    assert message.SerializeToString() == encoded.SerializeToString()
    assert [rs.resource.attributes[2].value.int_value for rs in message.resource_spans] == [51, 52]
    spans = [s for rs in message.resource_spans for sc in rs.scope_spans for s in sc.spans]
    assert len(spans) == encoded.spans == 30 + 8 + 8
    assert sum(len(s.events) for s in spans) > 0


def test_ingest_seq_is_assigned_at_append_and_an_old_store_is_numbered_in_order(tmp_path):
    import duckdb

    conn = duckdb.connect(str(tmp_path / "v6.duckdb"))
    schema.migrate(conn, target=6)  # a store of the release before: no ingest_seq
    steps = synthetic.token_steps(7, 2, 3)
    conn.register("s", steps)
    conn.execute(f"INSERT INTO token_steps ({', '.join(steps.column_names)}) SELECT * FROM s")
    assert 7 in schema.migrate(conn)
    assert conn.execute("SELECT ingest_seq FROM token_steps").fetchall() == [(i,) for i in range(1, 7)]
    conn.execute(f"INSERT INTO token_steps ({', '.join(steps.column_names)}) SELECT * FROM s")
    assert conn.execute("SELECT max(ingest_seq), count(DISTINCT ingest_seq) FROM token_steps").fetchall() == [
        (12, 12)
    ]
    conn.close()


def test_a_cursor_from_before_ingest_seq_resumes_where_its_time_keys_say(store):
    conn = store.connection
    ExportCursor(conn)  # the cursor tables
    # An older agent exported pid 51 in time order up to its 10th step and had not reached pid 52.
    keys = sorted(
        conn.execute("SELECT t_start_ns, step_seq, batch_row FROM token_steps WHERE pid = 51").fetchall()
    )
    conn.execute("INSERT INTO otlp_cursor VALUES (51, ?, ?, ?, 10, 0, NULL)", list(keys[9]))
    cursor = ExportCursor(conn)
    position = cursor.position()
    # never a gap: every step the old cursor called unexported is after the position (steps in between
    # that it had sent go again, with the same ids)
    unsent = conn.execute(
        "SELECT min(ingest_seq), count(*) FROM token_steps"
        " WHERE pid = 52 OR (t_start_ns, step_seq, batch_row) > (?, ?, ?)",
        list(keys[9]),
    ).fetchall()[0]
    assert unsent[1] == store.count("token_steps") - 10 and unsent[0] == position + 1
    assert cursor.pending_steps() >= unsent[1]
