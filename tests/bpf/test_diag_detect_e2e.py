"""Issue 9's loss anomalies end to end: the real `llmobs-agent attach --db` on a real tiny GPT-2 that
generates with a known fault (scripts/workload.py --spike-steps: at token 20 of every request the least
likely token is chosen, and that step also allocates and touches 64 MiB), then `llmobs-agent explain`.

- each request's token 20 gets an anomaly row from both detectors, with the right step_seq, trace id,
  request key and a detail that says why (p-value / modified z, window numbers, the loss);
- the anomaly's evidence (filled after correlate rolled the step up) names the allocation burst of
  that forward pass with the numbers;
- `explain` on that step prints the verdicts and the evidence, and its --json form parses.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import duckdb
from test_attach import Agent, _assert_clean
from test_probes_target import leftovers

from bench.held_workload import HeldWorkload

REQUESTS, TOKENS, SPIKE = 3, 40, 20
SPIKE_BYTES = 64 << 20


def _run(tmp_path) -> tuple:
    db = tmp_path / "store.duckdb"
    before = leftovers()
    args = ("--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens", str(TOKENS), "--threads", "1",
            "--spike-steps", str(SPIKE), "--spike-alloc-bytes", str(SPIKE_BYTES))  # fmt: skip
    with HeldWorkload(*args) as workload:
        # the windowed detectors (the default), named: verdicts from token 8 on (calibrated warms up)
        agent = Agent(
            "--pid", str(workload.pid), "--profile", "cpu,mem,host", "--db", str(db), "--detector", "both"
        )
        agent.wait_for("attached in")
        workload.generate()
        agent.proc.send_signal(signal.SIGINT)
        code, text = agent.finish()
        assert code == 0, text
        _assert_clean(agent.pid, workload.pid, before)
    return db, text


def _explain(db, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "llmobs.cli", "explain", "--db", str(db), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_injected_spike_becomes_an_anomaly_row_with_evidence_and_explain_shows_it(tmp_path):
    db, agent_output = _run(tmp_path)
    assert "anomalies (both, window 32)" in agent_output, agent_output
    conn = duckdb.connect(str(db), read_only=True)
    spikes = conn.execute(
        "SELECT trace_id, step_seq, step_seq - step, loss FROM token_steps WHERE step = ? ORDER BY step_seq",
        [SPIKE],
    ).fetchall()
    assert len(spikes) == REQUESTS, agent_output
    rows = conn.execute(
        "SELECT trace_id, step_seq, first_step_seq, step, kind, detector, score, detail, evidence"
        " FROM anomalies"
    ).fetchall()
    flagged = {(r[0], r[1], r[2], r[3], r[4]) for r in rows}
    for trace, step_seq, first, _loss in spikes:
        for kind in ("loss_ttest", "loss_mad"):
            assert (trace, step_seq, first, SPIKE, kind) in flagged, (kind, trace, rows)
    # the clean tokens of this model barely move: what else was flagged is rare
    others = [r for r in rows if r[3] != SPIKE]
    assert len(others) <= REQUESTS, others
    for trace, step_seq, _first, step, kind, detector, score, detail, evidence in rows:
        if step != SPIKE:
            continue
        detail = json.loads(detail)
        assert detail["step"] == SPIKE and detail["n"] == SPIKE  # the 20 tokens before it, all in the window
        if kind == "loss_ttest":
            assert detector == "ttest" and detail["p_value"] < 0.01 and score > 0
        else:
            assert detector == "mad" and score > 3.5
        assert evidence is not None, (trace, step_seq, agent_output)
        evidence = json.loads(evidence)
        burst = [u for u in evidence["unusual"] if u["measure"] == "alloc_bytes"]
        assert burst and burst[0]["value"] >= SPIKE_BYTES, evidence
        assert "allocation burst (bytes)" in evidence["summary"]

    trace = spikes[1][0]
    print(_explain(db, "--trace", trace[:10], "--step", str(SPIKE)).stdout)  # shown with pytest -s
    shown = _explain(db, "--trace", trace[:10], "--step", str(SPIKE))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert f"trace {trace}" in text and f"step {SPIKE} (step_seq {spikes[1][1]}" in text
    assert "t-test ANOMALY" in text and "mad    ANOMALY" in text
    assert "stored anomaly rows: loss_mad" in text
    assert "UNUSUAL allocation burst (bytes)" in text, text
    as_json = json.loads(_explain(db, "--trace", trace, "--step", str(SPIKE), "--json").stdout)
    assert as_json["detectors"]["ttest"]["flagged"] and as_json["step"]["step_seq"] == spikes[1][1]

    # a clean step of the same request: tested, not flagged, no stored rows
    clean = _explain(db, "--trace", trace, "--step", "12")
    assert (
        clean.returncode == 0 and "t-test ok" in clean.stdout and "stored anomaly rows: none" in clean.stdout
    )
