"""`attach --otlp`: a real workload, the real agent and a real collector (rotel on 127.0.0.1).

Every token step the workload published leaves as a `gen_ai.token_step` span under its request's span,
with its tenant, and the spans carry the sampled probe events of their forward pass; the export of the
last steps happens at detach, before the store closes.
"""

from __future__ import annotations

import signal
from collections import Counter
from pathlib import Path

from test_attach import Agent, _assert_clean
from test_probes_target import leftovers

from bench.held_workload import HeldWorkload
from bench.rotel_harness import Rotel

WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workload.py"
REQUESTS, TOKENS = 4, 6


def test_attach_otlp_exports_every_published_step_under_its_request(tmp_path):
    before = leftovers()
    args = ("--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS), "--threads", "1",
            "--tenant", "acme,globex")  # fmt: skip
    with Rotel(tmp_path / "rotel") as collector:
        with HeldWorkload(*args) as workload:
            agent = Agent(
                "--pid", str(workload.pid), "--profile", "cpu,host",
                "--db", str(tmp_path / "store.duckdb"), "--otlp", collector.grpc_endpoint,
            )  # fmt: skip
            agent.wait_for("attached in")
            workload.generate()
            agent.proc.send_signal(signal.SIGINT)
            code, text = agent.finish()
            assert code == 0, text
            _assert_clean(agent.pid, workload.pid, before)
        collector.stop()  # SIGTERM: rotel writes out everything it accepted
        spans = {span.span_id: span for span in collector.spans()}

    assert "otlp http://127.0.0.1" in text and "0 dropped" in text, text
    steps = [s for s in spans.values() if s.name == "gen_ai.token_step"]
    requests = {s.span_id: s for s in spans.values() if not s.parent_id}
    assert len(steps) == REQUESTS * TOKENS, (len(steps), text)
    assert len(requests) == REQUESTS
    per_request = Counter(s.parent_id for s in steps)
    assert set(per_request) == set(requests) and set(per_request.values()) == {TOKENS}
    assert Counter(s.attributes["llmobs.tenant"] for s in steps) == {"acme": 12, "globex": 12}
    assert all(s.trace_id == requests[s.parent_id].trace_id for s in steps)
