"""`llmobs-agent explain` on a real DuckDB file: the report, and each error with its exit code."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from llmobs.cli import main
from llmobs.diagnostics.evidence import refresh_evidence
from llmobs.diagnostics.incidents import IncidentBuilder
from llmobs.store.sink import DuckDBStore

TRACE_A = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACE_B = "4bf92f35aaaaaaaaaaaaaaaaaaaaaaaa"  # shares an 8-char prefix with A
TRACE_C = "00f067aa0ba902b700f067aa0ba902b7"  # two requests (a repeated prompt)
TOKENS, SPIKE = 30, 22


def _request(trace: str, first: int, spike: int | None = None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    loss = rng.normal(2.0, 0.1, TOKENS).astype(np.float32)
    latency = np.full(TOKENS, 2_000_000, np.int64)
    if spike is not None:
        loss[spike], latency[spike] = 6.5, 9_000_000
    step = np.arange(TOKENS)
    return {
        "pid": np.full(TOKENS, 42), "step_seq": first + step, "trace_id": [trace] * TOKENS, "step": step,
        "position": 5 + step, "token_id": 100 + step, "target_id": 100 + step, "loss": loss,
        "entropy": np.full(TOKENS, 1.5, np.float32), "target_prob": np.exp(-loss),
        "target_rank": np.zeros(TOKENS), "top1_prob": np.full(TOKENS, 0.5, np.float32), "latency_ns": latency,
        "t_start_ns": (first + step) * 10_000_000, "t_end_ns": (first + step) * 10_000_000 + latency,
        "batch_row": np.zeros(TOKENS, np.int32), "tenant": ["acme"] * TOKENS, "session": ["s1"] * TOKENS,
        "model_id": ["tiny"] * TOKENS,
    }  # fmt: skip


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    path = tmp_path_factory.mktemp("explain") / "store.duckdb"
    with DuckDBStore(path) as store:
        for trace, first, spike in ((TRACE_A, 1000, SPIKE), (TRACE_B, 2000, None), (TRACE_C, 3000, None),
                                    (TRACE_C, 4000, None)):  # fmt: skip
            store.append({"token_steps": _request(trace, first, spike)})
        seqs = np.arange(1000, 1000 + TOKENS)
        faults = np.where(seqs == 1000 + SPIKE, 9000, 4)
        ones, zeros = np.ones(TOKENS), np.zeros(TOKENS)
        store.append({"step_rollups": {
            "pid": 42 * ones, "step_seq": seqs, "tokens": ones, "t_start_ns": seqs * 10**7,
            "t_end_ns": seqs * 10**7 + 1, "decode_latency_ns": 2_000_000 * ones, "launches": zeros,
            "allocations": 10 * ones, "alloc_bytes": 4096 * ones, "frees": 10 * ones, "memcpy_bytes": zeros,
            "off_cpu_ns": zeros, "page_faults": faults, "compute_calls": 211 * ones, "tagged_events": ones,
            "windowed_events": zeros, "counts_exact": np.ones(TOKENS, bool),
        }})  # fmt: skip
        anomalies = {
            "ts_ns": [1, 1], "pid": [42, 42], "step_seq": [1000 + SPIKE] * 2, "trace_id": [TRACE_A] * 2,
            "kind": ["loss_ttest", "loss_mad"], "score": [40.0, 30.0], "detail": ['{"n": 22}'] * 2,
            "first_step_seq": [1000] * 2, "step": [SPIKE] * 2, "batch_row": [0, 0],
            "detector": ["ttest", "mad"], "artifact": [None, "/var/lib/llmobs/artifacts/dlde.png"],
        }  # fmt: skip
        incidents = IncidentBuilder()  # as the agent's anomaly lane builds them
        anomalies["incident_id"] = incidents.add(anomalies, 1)
        incidents.close_all(2)
        new, _updated = incidents.take_changed()
        store.append({"anomalies": anomalies, "incidents": pa.Table.from_pylist(new)})
        store.append({"layer_streams": {
            "pid": [42, 42], "step_seq": [1000 + SPIKE] * 2, "trace_id": [TRACE_A] * 2, "batch_row": [0, 0],
            "layer": [0, 1], "head": [-1, -1], "kind": [1, 1], "value": [2.25, 0.5], "ts_ns": [1, 1],
        }})  # fmt: skip
        refresh_evidence(store.connection, 42, 0)
    return path


def _explain(db, *args, capsys) -> tuple[int, str, str]:
    code = main(["explain", "--db", str(db), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_prints_the_step_verdicts_evidence_layers(db, capsys):
    code, out, err = _explain(db, "--trace", TRACE_A[:12], "--step", str(SPIKE), capsys=capsys)
    assert code == 0, err
    assert f"trace {TRACE_A}  pid 42  request first_step_seq 1000" in out
    incident = (f"incident 42-{1000 + SPIKE}-0 (request, closed): steps {SPIKE}..{SPIKE}, 1 token(s) flagged "
                f"(2 anomaly rows), peak 40.00 (loss_ttest) at step {SPIKE}, detectors mad,ttest\n"
                "  evidence at the peak: page faults: 9,000 vs median 4")  # fmt: skip
    assert incident in out and out.index(incident) < out.index(f"step {SPIKE} (step_seq")  # incident first
    assert f"step {SPIKE} (step_seq {1000 + SPIKE}, position {5 + SPIKE}): token {100 + SPIKE}" in out
    assert "loss 6.500 nats" in out and "latency 9.00 ms (4.50x the request's median 2.00 ms)" in out
    assert "t-test ANOMALY" in out and "mad    ANOMALY" in out and f"n {SPIKE}" in out
    assert "stored anomaly rows: loss_mad (score 30.00), loss_ttest (score 40.00)" in out
    assert "artifact: /var/lib/llmobs/artifacts/dlde.png" in out
    assert "UNUSUAL page faults: 9,000 vs median 4" in out
    assert "attention entropy: L0 2.25  L1 0.5" in out


def test_explain_a_clean_step_recomputes_the_verdicts(db, capsys):
    code, out, err = _explain(db, "--trace", TRACE_A, "--step", "15", capsys=capsys)
    assert code == 0, err
    assert "t-test ok" in out and "mad    ok" in out and "stored anomaly rows: none" in out
    assert "incident: none" in out
    assert "nothing unusual in GPU/host work" in out  # evidence computed on the spot
    code, out, _ = _explain(db, "--trace", TRACE_A, "--step", "3", capsys=capsys)
    assert "not tested: fewer than 8 tokens before" in out
    assert "GPU/host evidence" in out


def test_explain_json(db, capsys):
    code, out, _ = _explain(db, "--trace", TRACE_A, "--step", str(SPIKE), "--json", capsys=capsys)
    report = json.loads(out)
    assert code == 0
    assert report["detectors"]["ttest"]["flagged"] and report["detectors"]["mad"]["flagged"]
    assert report["step"]["step_seq"] == 1000 + SPIKE
    assert report["evidence"]["unusual"][0]["measure"] == "page_faults"
    assert [a["kind"] for a in report["anomalies"]] == ["loss_mad", "loss_ttest"]
    assert {a["incident_id"] for a in report["anomalies"]} == {report["incident"]["incident_id"]}
    assert (report["incident"]["tokens"], report["incident"]["detectors"]) == (1, "mad,ttest")


def test_explain_picks_one_of_several_requests_of_a_trace(db, capsys):
    code, _, err = _explain(db, "--trace", TRACE_C, "--step", "1", capsys=capsys)
    assert (
        code == 2 and "names 2 requests" in err and "first_step_seq 3000" in err and "--first-step-seq" in err
    )
    code, out, _ = _explain(db, "--trace", TRACE_C, "--step", "1", "--first-step-seq", "4000", capsys=capsys)
    assert code == 0 and "step 1 (step_seq 4001" in out


@pytest.mark.parametrize(
    "args, code, message",
    [
        (("--trace", "4bf92f35", "--step", "1"), 2, "ambiguous: 2 traces match"),
        (("--trace", "ffff", "--step", "1"), 7, "no token steps of a trace ffff"),
        (("--trace", TRACE_A, "--step", "30"), 2, "has token steps 0..29; there is no step 30"),
        (("--trace", TRACE_A, "--step", "-1"), 2, "there is no step -1"),
        (("--trace", "not-hex", "--step", "1"), 2, "is not a hex trace id"),
        (("--trace", TRACE_A, "--step", "1", "--pid", "7"), 7, "for pid 7"),
    ],
)
def test_explain_errors_are_one_line_with_a_distinct_code(db, capsys, args, code, message):
    got, out, err = _explain(db, *args, capsys=capsys)
    assert got == code and out == ""
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert "hint: " in err


def test_explain_without_a_store(tmp_path, capsys):
    got, _, err = _explain(tmp_path / "none.duckdb", "--trace", TRACE_A, "--step", "1", capsys=capsys)
    assert got == 11 and "no store at" in err
