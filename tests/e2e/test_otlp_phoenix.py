"""OTLP export into a backend a user opens: a real Arize Phoenix, over gRPC and over HTTP/protobuf.

The store is filled as in test_otlp_rotel.py (DuckDBStore.append + correlate on the records.md columns)
and exported by the real CLI (`llmobs-agent otlp`) inside Phoenix's network namespace
(bench/phoenix_harness.py). Phoenix's REST API then has to give back the exact request -> token-step
tree, the attributes, and each step's `llmobs.token.loss` equal to the store's own value.

One Phoenix serves the module (it takes 25-50 s to start on two busy cores); each protocol writes its own
Phoenix project (the `openinference.project.name` resource attribute) from its own pid, so the two
exports cannot satisfy each other's checks. Marked `phoenix`: `-m "not phoenix"` leaves it out locally;
CI runs it.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from llmobs import clock
from llmobs.store.sink import DuckDBStore
from test_otlp_rotel import KERNELS, expected_ids, fill

from bench.phoenix_harness import Phoenix
from bench.rotel_harness import wait_until

pytestmark = pytest.mark.phoenix

ENDPOINTS = {"grpc": Phoenix.grpc_endpoint, "http/protobuf": Phoenix.http_endpoint}
PIDS = {"grpc": 5151, "http/protobuf": 5252}


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    server = Phoenix(tmp_path_factory.mktemp("phoenix"))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:  # no unshare/nsenter, or namespaces refused
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            raise
        pytest.skip(f"cannot start Phoenix in a network namespace of its own: {exc}")
    yield server
    server.stop()


def export(phoenix: Phoenix, db, protocol: str, project: str) -> dict:
    """`llmobs-agent otlp` one-shot into Phoenix; its --json counters."""
    command = [
        sys.executable, "-m", "llmobs.cli", "otlp", "--db", str(db),
        "--endpoint", ENDPOINTS[protocol], "--protocol", protocol,
        "--resource-attr", f"openinference.project.name={project}",
        "--give-up-after", "20", "--json", "--quiet",
    ]  # fmt: skip
    result = phoenix.run_inside(command, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_phoenix_shows_the_request_tree_with_the_stores_losses(tmp_path, phoenix, protocol):
    pid, project = PIDS[protocol], f"llmobs-{protocol.split('/')[0]}"
    db = tmp_path / "s.duckdb"
    with DuckDBStore(db) as store:
        steps = fill(store, pid, requests=4, tokens=6, start_ns=clock.monotonic_ns() - 30_000_000_000)
        stored = {
            (r["step_seq"], r["batch_row"]): r
            for r in store.query(
                "SELECT step_seq, batch_row, loss, position, tenant, model_id FROM token_steps"
            ).to_pylist()
        }
        allocations = {
            r["step_seq"]: r["allocations"]
            for r in store.query("SELECT step_seq, allocations FROM step_rollups").to_pylist()
        }
    ids, parent, rows = expected_ids(steps)

    status = export(phoenix, db, protocol, project)
    assert status["spans_sent"] == len(ids) == 4 * 6 + 4
    assert status["attempts_failed"] == 0 and status["spans_dropped"] == 0 and status["pending_steps"] == 0
    # Phoenix takes traces only: the one metrics request is refused, counted, and not retried.
    assert status["metrics_sent"] == 0 and status["metrics_failed"] == 1

    # Phoenix inserts what it accepted in the background: poll until the whole set is queryable.
    def arrived() -> dict[str, dict] | None:
        spans = (
            {s["context"]["span_id"]: s for s in phoenix.spans(project)}
            if project in phoenix.projects()
            else {}
        )
        return spans if len(spans) >= len(ids) else None

    spans = wait_until(arrived, 30, interval=0.25, what=f"{len(ids)} spans in Phoenix project {project}")
    assert set(spans) == ids
    for span_id, request_id in parent.items():
        span, request, row = spans[span_id], spans[request_id], rows[span_id]
        assert span["parent_id"] == request_id and request["parent_id"] is None
        assert span["context"]["trace_id"] == request["context"]["trace_id"] == row["trace_id"]
        assert span["name"] == "gen_ai.token_step"
        assert request["name"] == "text_completion smollm2-135m"
        attributes = span["attributes"]
        truth = stored[(row["step_seq"], row["batch_row"])]
        # Exactly the store's float32 loss, widened to the double OTLP carries: no rounding on the way.
        assert attributes["llmobs.token.loss"] == truth["loss"]
        assert attributes["llmobs.token.position"] == truth["position"]
        assert attributes["llmobs.tenant"] == truth["tenant"] == request["attributes"]["llmobs.tenant"]
        assert attributes["gen_ai.request.model"] == truth["model_id"]
        assert attributes["llmobs.step_seq"] == row["step_seq"]
        assert attributes["llmobs.step.allocations"] == allocations[row["step_seq"]] == 6
        assert request["attributes"]["gen_ai.usage.output_tokens"] == 6
    # Each forward pass's sampled probe events sit on one of its step spans, as span events.
    with_events = [s for s in spans.values() if s["events"]]
    assert len(with_events) == steps.group_by(["pid", "step_seq"]).aggregate([]).num_rows
    names = {e["name"] for s in with_events for e in s["events"]}
    assert {"alloc_cpu", "free_cpu", "sgemm_", "sched_switch", "page_fault_user"} <= names
    assert not any(k in names for k in KERNELS)  # kernels are GPU time on the step, not span events


def test_phoenix_namespace_has_loopback_only(phoenix):
    """Phoenix's gRPC server binds every interface of its namespace: that namespace must have only lo."""
    result = phoenix.run_inside(["ip", "-o", "addr", "show"], timeout=10)
    assert result.returncode == 0, result.stderr
    interfaces = {line.split()[1] for line in result.stdout.splitlines()}
    addresses = {line.split()[3] for line in result.stdout.splitlines()}
    assert interfaces == {"lo"} and addresses <= {"127.0.0.1/8", "::1/128"}
