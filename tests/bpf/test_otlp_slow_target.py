"""`attach --otlp` following a slowly stepping target: the spans that leave while it is attached carry
their forward pass's rollup (llmobs.step.*).

At 20 token steps/s a correlate run costs more than its share of a core, so correlation runs up to
every 15 s there (pipeline/core.py CORRELATE_MAX_S), while the exporter sends a step once it is
`settle_s` (2 s) old. The exporter waits for the pass's rollup (`rollup_wait_s`); before it did, most
step spans of such a target went out without one. The target is the synthetic publisher (the real map
writer), the agent the real `attach` with its probes, the collector a real rotel on loopback; the spans
are read from rotel while the agent is still attached (not the final flush at detach, which follows
the final correlate).
"""

from __future__ import annotations

import signal

from test_attach import Agent

from bench.rotel_harness import Rotel, wait_until
from bench.synthetic_publisher import SyntheticPublisher

RATE = 20.0  # token steps/s: a slowly stepping target
LIVE_SPANS = 100  # ~5 s of its steps, exported while attached


def test_spans_sent_while_attached_to_a_slow_target_carry_their_rollups(tmp_path):
    with Rotel(tmp_path / "rotel") as collector, SyntheticPublisher(RATE, batch=1) as publisher:
        agent = Agent("--pid", str(publisher.pid), "--db", str(tmp_path / "store.duckdb"),
                      "--otlp", collector.grpc_endpoint)  # fmt: skip
        agent.wait_for("attached in")
        publisher.go()

        def step_spans():
            return [s for s in collector.spans() if s.name == "gen_ai.token_step"]

        wait_until(lambda: len(step_spans()) >= LIVE_SPANS, 90, 0.5, f"{LIVE_SPANS} live step spans")
        live = step_spans()
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        publisher.stop()
    assert code == 0, text
    without = [s.attributes["llmobs.step_seq"] for s in live if "llmobs.step.tokens" not in s.attributes]
    assert without == [], f"{len(without)} of {len(live)} step spans sent without their pass's rollup"
    assert {s.attributes["llmobs.step.tokens"] for s in live} == {1}  # batch 1: one token per pass
