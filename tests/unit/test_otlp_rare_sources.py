"""A following exporter skips the queries of sources its store has no row in yet (served request ends,
replays, incidents: ExportCursor._look_for_rare) and updates its own cursor row instead of upserting it;
neither may lose a row that arrives later, nor a cursor row that is gone.

Real parts: ServingPublisher -> map -> ShmReader -> DuckDB store -> one long-lived exporter, as `attach
--otlp` runs it, whose acknowledged requests (the encoded protobufs) are checked."""

from __future__ import annotations

import duckdb
import pytest
from llmobs.otlp import source
from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.unit import test_otlp_unfinished
from tests.unit.test_otlp_unfinished import Recording, attrs, requests_of

# The same real map and store as test_otlp_unfinished's tests (its fixtures, reused by name).
served = test_otlp_unfinished.served
store = test_otlp_unfinished.store


def following(store: DuckDBStore) -> tuple[OtlpExporter, Recording]:
    """One exporter kept across rounds, as the agent's follow loop keeps it (no settle wait, no rollup
    wait: nothing correlates this store)."""
    transport = Recording()
    config = resolve({"batch_spans": 4, "settle_s": 0.0, "rollup_wait_s": 0.0}, env={})
    return OtlpExporter(store.connection.cursor(), config, transport), transport


def round_of(exporter: OtlpExporter, transport: Recording) -> list[Span]:
    sent = len(transport.spans)
    exporter.export_pending(follow=True)
    return transport.spans[sent:]


def test_a_request_end_that_lands_after_rounds_without_any_is_still_sent(served, store):
    served.arrive("a", [5, 6, 7], "acme")
    served.step(["a"])
    served.ingest(store)
    exporter, transport = following(store)
    first = round_of(exporter, transport)
    assert [s.kind for s in first] == [Span.SPAN_KIND_INTERNAL]  # the step; no end row in the store yet
    assert round_of(exporter, transport) == []  # an idle round, still none

    served.step(["a"])
    served.finish("a", "stop")
    served.ingest(store)
    later = round_of(exporter, transport)
    server = requests_of(later)
    assert len(server) == 1 and attrs(server[0])["gen_ai.response.finish_reasons"] == ["stop"]
    assert len(later) == 2  # the second step and the request's span
    assert round_of(exporter, transport) == []  # sent once


def test_the_cursor_row_comes_back_when_it_is_gone_between_batches(served, store):
    served.arrive("a", [5, 6, 7], "acme")
    for _ in range(3):
        served.step(["a"])
    served.ingest(store)
    exporter, transport = following(store)
    assert len(round_of(exporter, transport)) == 3
    conn = store.connection
    assert conn.execute("SELECT exported_steps FROM otlp_cursor").fetchall() == [(3,)]  # one upsert
    served.step(["a"])
    served.ingest(store)
    assert len(round_of(exporter, transport)) == 1
    assert conn.execute("SELECT exported_steps FROM otlp_cursor").fetchall() == [(4,)]  # updated

    conn.execute("DELETE FROM otlp_cursor")  # e.g. a user resetting the export by hand
    served.step(["a"])
    served.ingest(store)
    assert len(round_of(exporter, transport)) == 1
    newest = conn.execute("SELECT max(ingest_seq) FROM token_steps").fetchall()[0][0]
    assert conn.execute("SELECT exported_steps, ingest_seq FROM otlp_cursor").fetchall() == [(1, newest)]


def test_incidents_are_skipped_only_where_the_store_has_no_incidents_table(tmp_path, monkeypatch):
    """A store from before incidents (no table) sends its requests without them; any other failure of
    the incidents read fails the batch (it is read and sent again), instead of sending the requests
    without their incident events, silently, as a catch-all did."""
    requests = [{"pid": 1, "trace_id": "ab" * 16}]
    old = duckdb.connect(str(tmp_path / "old.duckdb"))  # no incidents table
    source._attach_incidents(old, requests)
    assert requests[0]["incidents"] == []
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:

        def failing(conn, sql, params, tables=None):
            raise duckdb.IOException("IO Error: the disk went away")

        monkeypatch.setattr(source, "_dicts", failing)
        with pytest.raises(duckdb.IOException):
            source._attach_incidents(store.connection, requests)
    finally:
        store.close()
        old.close()
