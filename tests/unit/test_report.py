"""The demo report and plot from a real store with known contents: per-token tables, the slowest steps
and the probe that explains each, the probes per step, and a PNG that decodes to the expected size."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from llmobs.diagnostics.incidents import IncidentBuilder
from llmobs.pipeline.correlate import correlate
from llmobs.report import plot
from llmobs.report import text as report
from llmobs.store.sink import DuckDBStore

from tests.unit.interleaved_steps import PASSES, SLOW_PASS, interleaved_steps, pass_start_ns
from tests.unit.interleaved_steps import REQUESTS as INTERLEAVED

PID = 321
MS = 1_000_000


def _store(tmp_path):
    """Two requests of 6 tokens. Step 4 of request 1 is slow because the main thread was off-CPU for
    40 ms; step 2 of request 2 is slow because it allocated 50x more; step 0s are prefills."""
    rows = {k: [] for k in ("pid", "step_seq", "trace_id", "step", "position", "token_id", "loss", "entropy",
                            "target_prob", "latency_ns", "t_start_ns", "t_end_ns", "batch_row", "tenant",
                            "session", "model_id")}  # fmt: skip
    aggregates = {
        k: [] for k in ("pid", "step_seq", "probe", "count", "sum_value", "sum_duration_ns", "ts_ns")
    }
    events = {k: [] for k in ("pid", "tid", "ts_ns", "probe", "kind", "step_seq", "duration_ns", "value")}
    t = 10**12
    seq = 0
    for r, (tenant, trace) in enumerate((("acme", "aa" * 16), ("globex", "bb" * 16))):
        for step in range(6):
            seq += 1
            latency = 10 * MS
            allocs, main_off = 100, 1 * MS
            if (r, step) == (0, 4):
                latency, main_off = 50 * MS, 41 * MS
            if (r, step) == (1, 2):
                latency, allocs = 30 * MS, 5000
            for k, v in (("pid", PID), ("step_seq", seq), ("trace_id", trace), ("step", step),
                         ("position", 7 + step), ("token_id", 65 + step), ("loss", 0.5 * (step + 1)),
                         ("entropy", 1.0), ("target_prob", 0.5), ("latency_ns", latency), ("t_start_ns", t),
                         ("t_end_ns", t + latency), ("batch_row", 0), ("tenant", tenant),
                         ("session", f"s{r}"), ("model_id", "m")):  # fmt: skip
                rows[k].append(v)
            for probe, count, value, ns in (("alloc_cpu", allocs, allocs * 64, 0), ("sgemm", 30, 10**6, 0),
                                            ("sched_switch", 20, 20, 180 * MS)):  # fmt: skip
                for k, v in (("pid", PID), ("step_seq", seq), ("probe", probe), ("count", count),
                             ("sum_value", value), ("sum_duration_ns", ns), ("ts_ns", t)):  # fmt: skip
                    aggregates[k].append(v)
            for tid, ns in ((PID, main_off), (PID + 1, 9 * MS)):  # main thread, and an idle pool thread
                event = (("pid", PID), ("tid", tid), ("ts_ns", t + 1), ("probe", "sched_switch"),
                         ("kind", "host"), ("step_seq", seq), ("duration_ns", ns), ("value", 1))  # fmt: skip
                for k, v in event:
                    events[k].append(v)
            t += latency + MS
    store = DuckDBStore(tmp_path / "r.duckdb")
    store.append({"token_steps": rows, "probe_aggregates": aggregates, "events": events})
    correlate(store.connection)
    return store


def test_report_tables_slowest_steps_and_probes(tmp_path):
    with _store(tmp_path) as store:
        requests = report.load_requests(store.connection, decode=chr)
        text = report.build_report(store.connection, decode=chr, header=["HEADER"], requests=requests)
    assert [len(r.tokens) for r in requests] == [6, 6]
    assert [(r.tenant, r.session) for r in requests] == [("acme", "s0"), ("globex", "s1")]
    assert requests[0].mean_loss == pytest.approx(np.mean([0.5, 1.0, 1.5, 2.0, 2.5, 3.0]))
    assert text.startswith("HEADER\n") and "generated: 'ABCDEF'" in text
    # the per-token table: one line per token, with the main thread's off-CPU (not all threads')
    table = [line for line in text.splitlines() if line.startswith("     4  'E'")]
    assert len(table) == 2
    assert table[0].split()[5:9] == ["50.0", "100", "30", "41.0"]
    slow = text.split("Slowest steps")[1].split("Probes per step")[0]
    first, second = slow.split("  request ")[1:3]
    assert first.startswith("1 step 4 'E': 50.0 ms = 5.0x the median")
    assert "sched_switch (main thread) 41.0 ms vs 1.0 ms median" in first and "alloc" not in first
    assert second.startswith("2 step 2 'C': 30.0 ms") and "alloc_cpu 5,000 calls vs 100 median" in second
    # the all-threads sched_switch total is the same every step: it must never be given as a reason
    assert "- sched_switch 180" not in slow
    probes = text.split("Probes per step")[1].splitlines()
    sgemm = next(line for line in probes if line.strip().startswith("sgemm "))
    assert sgemm.split()[1:5] == ["compute", "30.0", "30", "30"] and "1.0 MFLOP" in sgemm
    alloc = next(line for line in probes if line.strip().startswith("alloc_cpu "))
    assert alloc.split()[2:5] == [f"{(100 * 11 + 5000) / 12:,.1f}", "100", "5,000"]


def test_report_without_tokenizer_shows_ids(tmp_path):
    with _store(tmp_path) as store:
        text = report.build_report(store.connection)
    assert "'#69'" in text and "no tokenizer" in text


def test_plot_writes_a_png(tmp_path):
    import matplotlib.image as mpimg

    with _store(tmp_path) as store:
        requests = report.load_requests(store.connection)
    path = plot.write_png(requests, tmp_path / "p.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = mpimg.imread(path).shape[:2]
    assert (width, height) == (11 * 110, int(6.5 * 110))


def test_report_lists_the_tokens_the_loss_detectors_flagged(tmp_path):
    """Anomaly rows (as the live detectors write them) become the 'Surprising tokens' section: the
    flagged token, its loss against its request's median, its detectors, the evidence summary, and the
    explain command that shows the rest; a store without any says so."""
    with _store(tmp_path) as store:
        clean = report.build_report(store.connection, decode=chr, db="/x/r.duckdb")
        trace = "bb" * 16
        for detector, score in (("ttest", 9.5), ("mad", 7.25)):
            store.connection.execute(
                "INSERT INTO anomalies (ts_ns, pid, step_seq, trace_id, kind, score, detail, first_step_seq,"
                " step, batch_row, detector, evidence) VALUES (1, ?, 12, ?, ?, ?, '{}', 7, 5, 0, ?, ?)",
                [PID, trace, f"loss_{detector}", score, detector, '{"summary": "UNUSUAL page faults"}'],
            )
        text = report.build_report(store.connection, decode=chr, db="/x/r.duckdb")
    assert "Surprising tokens (0 flagged" in clean and "none: no token's loss stood out" in clean
    section = text.split("Surprising tokens")[1].split("Probes per step")[0]
    assert section.startswith(" (1 flagged live")  # two detectors, one token
    assert "request 2 step 5 'F': loss 3.000 vs the request's median 2.000" in section
    assert "flagged by mad, ttest (score 9.5)" in section and "GPU/host: UNUSUAL page faults" in section
    assert f"llmobs-agent explain --db /x/r.duckdb --trace {trace[:16]} --step 5" in section


def test_report_shows_incidents_before_the_flagged_tokens(tmp_path):
    """Three flagged tokens of one request, two of them within the gap: two incidents (as the agent's
    anomaly lane builds them), listed before the tokens, each with its span, counts, peak and explain."""
    trace = "bb" * 16
    rows = {
        "ts_ns": [1] * 4, "pid": [PID] * 4, "step_seq": [10, 12, 12, 40], "trace_id": [trace] * 4,
        "kind": ["loss_ttest", "loss_ttest", "loss_mad", "loss_ttest"], "score": [4.0, 9.5, 7.25, 5.0],
        "detail": ["{}"] * 4, "first_step_seq": [7] * 4, "step": [3, 5, 5, 33], "batch_row": [0] * 4,
        "detector": ["ttest", "ttest", "mad", "ttest"],
    }  # fmt: skip
    builder = IncidentBuilder()
    rows["incident_id"] = builder.add(rows, 1)
    builder.close_all(2)
    new, _updated = builder.take_changed()
    with _store(tmp_path) as store:
        store.append({"anomalies": rows, "incidents": pa.Table.from_pylist(new)})
        text = report.build_report(store.connection, decode=chr, db="/x/r.duckdb")
    assert text.index("Incidents (2:") < text.index("Surprising tokens")
    section = text.split("Incidents (2:")[1].split("Surprising tokens")[0]
    assert (
        "request 2 steps 3..5 (closed): 2 token(s) in 3 row(s), peak 9.5 (loss_ttest), detectors mad, ttest"
        in section
    )
    assert (
        "request 2 steps 33..33 (closed): 1 token(s) in 1 row(s), peak 5.0 (loss_ttest), detectors ttest"
        in section
    )
    assert f"llmobs-agent explain --db /x/r.duckdb --trace {trace[:16]} --step 5" in section


def test_report_keeps_each_interleaved_served_request_whole(tmp_path):
    """Served requests whose steps interleave across passes (one joining late) are one request each, with
    every step in its order and whichever row of the pass it was; per-step sections count a pass once."""
    rows = interleaved_steps(PID)
    aggregates = {
        k: [] for k in ("pid", "step_seq", "probe", "count", "sum_value", "sum_duration_ns", "ts_ns")
    }
    for seq in range(1, PASSES + 1):  # 40 allocations per pass, 400 in the slow one
        for k, v in (("pid", PID), ("step_seq", seq), ("probe", "alloc_cpu"),
                     ("count", 400 if seq == SLOW_PASS else 40), ("sum_value", 64), ("sum_duration_ns", 0),
                     ("ts_ns", pass_start_ns(seq))):  # fmt: skip
            aggregates[k].append(v)
    with DuckDBStore(tmp_path / "i.duckdb") as store:
        store.append({"token_steps": rows, "probe_aggregates": aggregates})
        correlate(store.connection)
        requests = report.load_requests(store.connection, decode=chr)
        text = report.build_report(store.connection, decode=chr, requests=requests)
    # in the order of their first pass (a and b: 1, c: 3), each with all its steps
    expected = [(trace, tenant, list(passes)) for _, trace, tenant, passes in INTERLEAVED.values()]
    got = [(r.trace_id, r.tenant, [t.step_seq for t in r.tokens]) for r in requests]
    assert got == expected
    assert all([t.step for t in r.tokens] == list(range(len(r.tokens))) for r in requests)
    assert "Request 3/3" in text and "Request 4/" not in text
    assert [line for line in text.splitlines() if "generated:" in line] == [
        "  generated: 'ABCD'",
        "  generated: 'ABCD'",
        "  generated: 'ABC'",
    ]
    # pass 5 (rows of b and c) is the slowest step once, not once per row, and the probes average passes
    slow = text.split("Slowest steps")[1].split("Probes per step")[0]
    assert slow.count("30.0 ms =") == 1 and "request 2 step 3 'D': 30.0 ms" in slow
    assert f"over {PASSES} token steps" in text
    alloc = next(line for line in text.split("Probes per step")[1].splitlines() if "alloc_cpu" in line)
    assert alloc.split()[2:5] == [f"{(40 * 5 + 400) / PASSES:,.1f}", "40", "400"]


def test_report_lists_an_anomaly_on_a_served_pass_row_other_than_0(tmp_path):
    """In a continuously batched pass each row is its own request's token: an anomaly the detectors wrote
    for row 1 of pass 5 (request c, whose step 1 it is; row 0 is request b) is listed under request c, and
    one on b's row of the same pass is listed under b, each with its own token."""
    rows = interleaved_steps(PID)
    with DuckDBStore(tmp_path / "a.duckdb") as store:
        store.append({"token_steps": rows})
        correlate(store.connection)
        for trace, first, step, row, score in (("cc" * 16, 3, 1, 1, 8.5), ("bb" * 16, 1, 3, 0, 4.25)):
            store.connection.execute(
                "INSERT INTO anomalies (ts_ns, pid, step_seq, trace_id, kind, score, detail, first_step_seq,"
                " step, batch_row, detector, evidence) VALUES (1, ?, ?, ?, 'loss_mad', ?, '{}', ?, ?, ?,"
                " 'mad', NULL)",
                [PID, SLOW_PASS, trace, score, first, step, row],
            )
        text = report.build_report(store.connection, decode=chr)
    section = text.split("Surprising tokens")[1].split("Probes per step")[0]
    assert section.startswith(" (2 flagged live")
    flagged = [line for line in section.splitlines() if line.startswith("  request ")]
    # c's losses are 3.25, 3.5, 3.75 (step 1: 3.5); b's 2.25 .. 3.0 (step 3: 3.0), highest score first
    assert flagged == [
        "  request 3 step 1 'B': loss 3.500 vs the request's median 3.500, p(token) 0.500; flagged by mad "
        "(score 8.5)",
        "  request 2 step 3 'D': loss 3.000 vs the request's median 2.750, p(token) 0.500; flagged by mad "
        "(score 4.2)",
    ]
    assert f"explain --trace {'cc' * 8} --step 1" in section
