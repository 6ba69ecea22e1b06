"""A served request the engine had not finished when the export's final flush ran (detach, one-shot
`llmobs-agent otlp`): it still gets its request span, marked unfinished, so its token-step spans have a
parent; a later run over the same store, once more steps and the end row arrived, loses no step and
sends the complete span with the same id. And otlp_served_sent is pruned like the export cursor.

Real parts: ServingPublisher -> map -> ShmReader -> DuckDB store -> the exporter's delivery loop, whose
acknowledged requests (the encoded protobufs) are checked; the e2e tier sends the same to rotel."""

from __future__ import annotations

import pytest
from llmobs.otlp.config import resolve
from llmobs.otlp.delivery import OtlpExporter
from llmobs.otlp.served import served_span_id
from llmobs.otlp.source import ExportCursor
from llmobs.otlp.transport import SendResult, Transport
from llmobs.store import retention
from llmobs.store.sink import DuckDBStore
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.unit.served_runs import ServedRuns

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Recording(Transport):
    """Acknowledges every request and keeps its spans."""

    def __init__(self):
        self.spans: list[Span] = []

    def send_traces(self, request):
        self.spans += [s for rs in request.resource_spans for sc in rs.scope_spans for s in sc.spans]
        return SendResult(ok=True)

    def send_metrics(self, request):
        return SendResult(ok=True)


def export(store: DuckDBStore) -> list[Span]:
    """One one-shot `llmobs-agent otlp` run over the store: the spans it sent."""
    transport = Recording()
    config = resolve({"batch_spans": 4, "settle_s": 0.0}, env={})  # small batches: several per run
    OtlpExporter(store.connection.cursor(), config, transport).run(give_up_after_s=5)
    return transport.spans


def attrs(span: Span) -> dict[str, object]:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = (
            [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
        )
    return out


def requests_of(spans: list[Span]) -> list[Span]:
    return [s for s in spans if s.kind == Span.SPAN_KIND_SERVER]


@pytest.fixture
def served(tmp_path):
    runs = ServedRuns(tmp_path)
    yield runs
    runs.close()


@pytest.fixture
def store(tmp_path):
    store = DuckDBStore(tmp_path / "s.duckdb")
    yield store
    store.close()


def test_an_unfinished_request_gets_its_span_and_a_later_run_completes_it(served, store):
    served.arrive("done", [5, 6, 7], "acme")
    served.arrive("open", [8, 9, 10, 11], "globex", traceparent=CALLER)
    for _ in range(3):
        served.step(["done", "open"])
    served.finish("done", "length")
    served.ingest(store)

    first = export(store)  # run 1: "open" has 3 steps and no end row
    assert len(first) == 6 + 2
    by_id = {attrs(s).get("llmobs.request.id"): s for s in requests_of(first)}
    done, open_ = by_id["done"], by_id["open"]
    a = attrs(open_)
    assert a["llmobs.request.unfinished"] is True and "gen_ai.response.finish_reasons" not in a
    assert a["gen_ai.usage.output_tokens"] == 3 and "gen_ai.usage.input_tokens" not in a
    assert open_.status.code == Status.STATUS_CODE_UNSET and not open_.parent_span_id
    assert open_.trace_id.hex() == CALLER[3:35]  # the caller's trace id is on every step of the request
    assert "llmobs.request.unfinished" not in attrs(done)
    assert attrs(done)["gen_ai.response.finish_reasons"] == ["length"]
    steps = [s for s in first if s.kind != Span.SPAN_KIND_SERVER]
    assert sum(s.parent_span_id == open_.span_id for s in steps) == 3
    assert sum(s.parent_span_id == done.span_id for s in steps) == 3
    seq = int(attrs(open_)["llmobs.request_seq"])
    assert open_.span_id == served_span_id(served.pub.writer.pid, CALLER[3:35], seq)
    last_step_end = max(s.end_time_unix_nano for s in steps if s.parent_span_id == open_.span_id)
    assert open_.end_time_unix_nano == last_step_end
    assert export(store) == []  # nothing new: the unfinished span is not sent again

    served.step(["open"])  # run 2: one more step, still unfinished: the span again, up to it
    served.ingest(store)
    second = export(store)
    assert [s.kind for s in second].count(Span.SPAN_KIND_SERVER) == 1 and len(second) == 2
    again = requests_of(second)[0]
    assert again.span_id == open_.span_id and attrs(again)["gen_ai.usage.output_tokens"] == 4
    assert again.end_time_unix_nano > open_.end_time_unix_nano

    served.step(["open"])  # run 3: the last step and the end row: the complete span, same id
    served.finish("open", "stop")
    served.ingest(store)
    third = export(store)
    assert len(third) == 2
    final = requests_of(third)[0]
    fa = attrs(final)
    assert final.span_id == open_.span_id and "llmobs.request.unfinished" not in fa
    assert fa["gen_ai.response.finish_reasons"] == ["stop"] and fa["gen_ai.usage.output_tokens"] == 5
    assert fa["gen_ai.usage.input_tokens"] == 4 and final.parent_span_id.hex() == CALLER[36:52]
    # no step lost across the runs: every step of "open" is under its one span id
    all_steps = [s for s in first + second + third if s.kind != Span.SPAN_KIND_SERVER]
    mine = [s for s in all_steps if s.parent_span_id == open_.span_id]
    assert sorted(attrs(s)["llmobs.token.step"] for s in mine) == list(range(5))
    assert export(store) == []
    marks = store.connection.execute("SELECT count(*), count(*) FILTER (unfinished) FROM otlp_served_sent")
    assert marks.fetchall()[0] == (2, 0)  # the end row's mark replaced the unfinished one


def test_follow_mode_does_not_close_an_unfinished_request(served, store):
    served.arrive("open", [8, 9], "acme")
    served.step(["open"])
    served.ingest(store)
    cursor = ExportCursor(store.connection.cursor())
    batch = cursor.next_batch(100, 8, request_idle_ns=0, now_ns=1 << 62)  # not a final flush
    assert batch.step_table.num_rows == 1 and batch.unfinished == [] and batch.served == []
    flushed = cursor.next_batch(100, 8, flush=True)
    assert [r["request_seq"] for r in flushed.unfinished] == [batch.steps[0]["request_seq"]]


def test_sent_marks_are_pruned_once_retention_removed_their_rows(served, store):
    for rid in ("old", "new"):
        served.arrive(rid, [1, 2, 3], "acme")
        served.step([rid])
        served.finish(rid)
    served.arrive("open", [4, 5], "acme")
    served.step(["open"])
    served.ingest(store)
    assert len(requests_of(export(store))) == 3  # two finished, one unfinished
    conn = store.connection
    cursor = ExportCursor(conn.cursor())
    assert cursor.prune() == 0  # every mark's rows are still in the store
    # retention removes "old" (its end row and its step): its mark goes, the others stay
    new_arrival = conn.execute(
        "SELECT t_start_ns FROM request_events WHERE kind = 'end' AND request_id = 'new'"
    ).fetchall()[0][0]
    retention.delete_before(store, new_arrival)
    seqs = dict(conn.execute("SELECT request_id, request_seq FROM token_steps").fetchall())
    assert set(seqs) == {"new", "open"}
    assert cursor.prune() == 1
    left = conn.execute("SELECT request_seq, unfinished FROM otlp_served_sent ORDER BY request_seq")
    assert left.fetchall() == [(seqs["new"], False), (seqs["open"], True)]
    assert export(store) == []  # pruning never makes a sent span pending again
    # a later request, then retention removes everything before it: the marks of "new" (its end row is
    # gone) and of "open" (its steps are) go, pruned by the next export
    served.arrive("later", [6, 7], "acme")
    served.step(["later"])
    served.finish("later")
    served.ingest(store)
    later = conn.execute("SELECT min(t_start_ns) FROM request_events WHERE request_id = 'later'").fetchall()
    retention.delete_before(store, later[0][0])
    assert len(export(store)) == 2  # "later"'s step and span; the one-shot export prunes at its end
    later_seq = conn.execute("SELECT request_seq FROM token_steps").fetchall()[0][0]
    assert conn.execute("SELECT request_seq, unfinished FROM otlp_served_sent").fetchall() == [
        (later_seq, False)
    ]
    assert cursor.prune() == 0
