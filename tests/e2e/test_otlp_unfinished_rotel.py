"""A served request still running when the agent detaches, end to end into a real collector (rotel-agent
on 127.0.0.1, its debug log parsed).

Run 1 is `attach --otlp`'s exporter: it follows the store in its thread and, at detach, `finish()` does
the final flush. The request the engine has not finished must arrive as a request span marked
llmobs.request.unfinished with no finish reason, parenting its token-step spans (follow mode never sends
it: only the final flush does). Run 2 is a later one-shot `llmobs-agent otlp` over the same store after
the request's last steps and its end row arrived: no step is lost, every step of the request is under the
one span id, and the complete span arrives with that id.

Real parts: ServingPublisher -> map -> ShmReader -> DuckDB store -> OtlpExporter over OTLP/gRPC -> rotel.
"""

from __future__ import annotations

import pytest
from llmobs.otlp import config as otlp_config
from llmobs.otlp.delivery import OtlpExporter
from llmobs.store.sink import DuckDBStore

from bench.rotel_harness import Rotel, wait_until
from tests.unit.served_runs import ServedRuns

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"
FINISH_REASONS = "gen_ai.response.finish_reasons"  # an array attribute: the parser skips it, the log has it


@pytest.fixture
def collector(tmp_path):
    with Rotel(tmp_path / "rotel") as rotel:
        yield rotel


def _config(collector):
    # rollup_wait_s 0: nothing correlates these stores, so a followed step has no rollup to wait for
    return otlp_config.resolve(
        {"endpoint": collector.grpc_endpoint, "protocol": "grpc", "timeout_s": 2.0, "settle_s": 0.0,
         "rollup_wait_s": 0.0, "poll_interval_s": 0.05, "metrics_interval_s": 0.3},
        env={},
    )  # fmt: skip


def _spans(collector, count: int):
    """Every span in rotel's log once it holds `count` (the cheap count first: see wait_for_spans)."""
    wait_until(
        lambda: collector.span_count() >= count, 20, interval=0.1, what=f"{count} spans in rotel's log"
    )
    return collector.spans()


def test_a_request_running_at_detach_gets_an_unfinished_span_a_later_run_completes(tmp_path, collector):
    served = ServedRuns(tmp_path / "shm")
    store = DuckDBStore(tmp_path / "s.duckdb")
    try:
        served.arrive("done", [5, 6, 7], "acme")
        served.arrive("open", [8, 9, 10, 11], "globex", traceparent=CALLER)
        for _ in range(3):
            served.step(["done", "open"])
        served.finish("done", "stop")
        served.ingest(store)

        # run 1: attach --otlp's exporter, following; then the detach's final flush
        exporter = OtlpExporter(store.connection.cursor(), _config(collector))
        exporter.start()
        wait_until(lambda: exporter.counters.spans_sent >= 7, 20, what="the followed steps and 'done' acked")
        wait_until(lambda: collector.span_count() >= 7, 20, what="7 spans in rotel's log")
        assert exporter.counters.spans_sent == 7 and "llmobs.request.unfinished" not in collector.text()
        counters = exporter.finish(timeout=10)
        assert counters.spans_sent == 8 and counters.spans_dropped == 0
        spans = _spans(collector, 8)
        assert len(spans) == 8
        requests = {
            s.attributes["llmobs.request.id"]: s for s in spans if "llmobs.request.id" in s.attributes
        }
        open_, done = requests["open"], requests["done"]
        assert open_.attributes["llmobs.request.unfinished"] is True
        assert "llmobs.request.unfinished" not in done.attributes
        assert collector.text().count(FINISH_REASONS) == 1  # "done"'s; the unfinished span has none
        assert open_.attributes["gen_ai.usage.output_tokens"] == 3
        # the caller's trace id is on its steps; its span id reaches the store with the end row only
        assert open_.trace_id == CALLER_TRACE and open_.parent_id == ""
        steps = [s for s in spans if s.name == "gen_ai.token_step"]
        assert sorted(s.parent_id for s in steps) == sorted([open_.span_id] * 3 + [done.span_id] * 3)

        # run 2, later: the request's last two steps and its end row, then a one-shot export
        served.step(["open"])
        served.step(["open"])
        served.finish("open", "length")
        assert served.ingest(store) == 2
        store.close()
        store = DuckDBStore(tmp_path / "s.duckdb")
        exporter = OtlpExporter(store.connection.cursor(), _config(collector))
        try:
            counters = exporter.run(follow=False, give_up_after_s=20)
        finally:
            exporter.shutdown()
        assert counters.spans_sent == 3  # two steps and the complete request span
        spans = _spans(collector, 11)
        assert len(spans) == 11
        versions = [s for s in spans if s.span_id == open_.span_id]
        assert len(versions) == 2  # the unfinished span, then the complete one with the same id
        final = versions[1]
        assert "llmobs.request.unfinished" not in final.attributes
        assert final.attributes["gen_ai.usage.output_tokens"] == 5
        assert final.attributes["gen_ai.usage.input_tokens"] == 4
        assert final.trace_id == CALLER_TRACE and final.parent_id == CALLER[36:52]
        assert collector.text().count(FINISH_REASONS) == 2
        mine = [s for s in spans if s.name == "gen_ai.token_step" and s.parent_id == open_.span_id]
        assert sorted(s.attributes["llmobs.token.step"] for s in mine) == list(range(5))
        assert all(s.trace_id == CALLER_TRACE for s in mine)
    finally:
        store.close()
        served.close()
