"""The pipeline without eBPF (no privileges): a real tiny-GPT-2 workload's map -> ShmSource -> StoreWriter
-> DuckDB -> correlate. Every token step the workload published arrives once, with the token and loss
the workload computed itself; the live snapshot `top` reads exists while it runs and is gone after."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from llmobs.pipeline import Pipeline, read_snapshots
from llmobs.store.sink import DuckDBStore

from bench.ready_pipe import read_json_line

WORKLOAD = Path(__file__).resolve().parents[2] / "scripts" / "workload.py"
REQUESTS, TOKENS = 5, 6
READY_TIMEOUT_S = 90.0  # loading the tiny model on a busy 2-core VM: an upper bound, not a pace


def test_map_to_store_without_bpf(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOBS_RUN_DIR", str(tmp_path / "run"))
    record = tmp_path / "record.jsonl"
    ready_r, ready_w = os.pipe()
    workload = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--model", "tiny", "--requests", str(REQUESTS), "--max-new-tokens",
         str(TOKENS), "--threads", "1", "--tenant", "a,b", "--record", str(record), "--wait-stdin", "--hold",
         "--ready-fd", str(ready_w)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(ready_w,),
    )  # fmt: skip
    os.close(ready_w)
    try:
        assert read_json_line(ready_r, READY_TIMEOUT_S)["phase"] == "ready"
        pipeline = Pipeline(DuckDBStore(tmp_path / "s.duckdb"), workload.pid, owns_store=True)
        workload.stdin.write(b"go\n")
        workload.stdin.flush()
        assert read_json_line(ready_r, READY_TIMEOUT_S)["phase"] == "done"
        deadline = time.monotonic() + 30
        while pipeline.live.tokens < REQUESTS * TOKENS and time.monotonic() < deadline:
            pipeline.poll()
            select.select([], [], [], 0.02)  # the drain period, as in attach
        snapshots = read_snapshots()
    finally:
        workload.stdin.write(b"bye\n")
        workload.stdin.flush()
        workload.wait(timeout=30)
        os.close(ready_r)
    summary = pipeline.close()
    assert [s["pid"] for s in snapshots] == [workload.pid] and snapshots[0]["stats"]["tokens"] == 30
    assert not list((tmp_path / "run").glob("attach.*.json"))  # removed at close
    assert summary.steps_read == REQUESTS * TOKENS and summary.steps_lost == 0
    assert summary.rows_by_table["token_steps"] == REQUESTS * TOKENS and summary.dropped_rows == 0
    assert (
        summary.final_correlate.passes == REQUESTS * TOKENS and summary.final_correlate.requests == REQUESTS
    )

    records = [json.loads(line) for line in record.read_text().splitlines()]
    with DuckDBStore(tmp_path / "s.duckdb", read_only=True) as store:
        steps = store.connection.execute(
            "SELECT step, token_id, loss, tenant FROM token_steps ORDER BY step_seq"
        ).fetchall()
        process = store.connection.execute("SELECT pid, cmdline, map_path FROM processes").fetchall()
        fits = store.count("clock_fits")
    expected = [
        (i, rec["tokens"][0][i], rec["losses"][0][i], rec["tenant"]) for rec in records for i in range(TOKENS)
    ]
    assert [(s[0], s[1], s[3]) for s in steps] == [(e[0], e[1], e[3]) for e in expected]
    assert np.allclose([s[2] for s in steps], [e[2] for e in expected], rtol=1e-4, atol=1e-5)
    assert process[0][0] == workload.pid and "workload.py" in process[0][1]
    assert process[0][2] == f"/dev/shm/llmobs.{workload.pid}" and fits == 1


def test_close_before_any_poll_still_stores_the_maps_steps(tmp_path):
    """A detach that comes before the first poll (Ctrl-C right after attaching, seen in the bpf e2e
    test on a loaded machine) must still store every step the map holds."""
    ready_r, ready_w = os.pipe()
    workload = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--model", "tiny", "--requests", "3", "--max-new-tokens", "4",
         "--threads", "1", "--hold", "--ready-fd", str(ready_w)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(ready_w,),
    )  # fmt: skip
    os.close(ready_w)
    try:
        assert read_json_line(ready_r, READY_TIMEOUT_S)["phase"] == "ready"
        assert read_json_line(ready_r, READY_TIMEOUT_S)["phase"] == "done"
        pipeline = Pipeline(DuckDBStore(tmp_path / "s.duckdb"), workload.pid, owns_store=True, snapshot=False)
        summary = pipeline.close()
    finally:
        workload.stdin.write(b"bye\n")
        workload.stdin.flush()
        workload.wait(timeout=30)
        os.close(ready_r)
    # and the model's automatic factors (dtype, quant, tokenizer, vocab, adapters: llmobs.publisher.factors)
    assert summary.steps_read == 12 and summary.rows_by_table == {"token_steps": 12, "model_factors": 5}
