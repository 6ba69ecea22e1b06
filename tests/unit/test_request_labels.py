"""Request labels, model factors and intent fingerprints, from the workload through the real map, the
reader and the pipeline into a real DuckDB store (request_labels, model_factors, request_intents,
token_steps.shadow), and `llmobs-agent query --by-intent` over that store."""

from __future__ import annotations

import json
import os
import warnings

import llmobs
import pytest
import torch
from llmobs.cli import main
from llmobs.pipeline.core import Pipeline
from llmobs.pipeline.sources import ShmSource
from llmobs.publisher import labels
from llmobs.publisher.serving import Row, ServingPublisher
from llmobs.shm import layout
from llmobs.shm import writer as writer_module
from llmobs.shm.reader import ShmReader
from llmobs.store.sink import DuckDBStore
from llmobs.workloads.models import ByteTokenizer

from tests.unit.publisher_fixtures import isolated_writer, tiny_gpt2


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


@pytest.fixture
def fresh_counter(monkeypatch):
    monkeypatch.setattr(labels, "dropped", 0)
    monkeypatch.setattr(labels, "_warned", False)


def test_bad_labels_are_dropped_counted_and_warned_about_once(fresh_counter):
    nine = {f"k{i}": "v" for i in range(9)}  # with the variant: 10, two past the cap of 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = labels.merge((), "qlora-r8", nine)
        assert got[0] == ("variant", "qlora-r8") and len(got) == 8 and labels.dropped == 2
        bad = {"Upper": "x", "9lead": "x", "k" * 33: "x", "ok": "é" * 33, "empty": "", "obj": object()}
        assert labels.merge(got, None, bad) == got  # all six dropped, the good ones kept
        assert labels.dropped == 8
        assert labels.merge((), None, "not a dict") == () and labels.dropped == 9
    assert len([w for w in caught if "request label was dropped" in str(w.message)]) == 1
    # inner labels merge over outer ones, a request's over its context's; numbers become text
    outer = labels.merge((), "a", {"template": "v2", "tier": "gold"})
    assert labels.merge(outer, "b", {"template": "v3", "n": 3}) == (
        ("variant", "b"), ("template", "v3"), ("tier", "gold"), ("n", "3"),
    )  # fmt: skip
    assert labels.parse_header("template=v3, tier = gold,,bad") == {
        "template": "v3",
        "tier": "gold",
        "bad": "",
    }


def _serve_one(writer, rid: str, prompt: list[int]) -> None:
    pub = ServingPublisher("served-model", writer=writer)
    with llmobs.context(variant="lora", labels={"template": "v1"}, intent_text="Translate this to French."):
        pub.request_arrived(rid, prompt)  # the client's context, not the engine thread's
    p = pub.pass_begin([Row(rid, len(prompt), 0, True)])
    pub.pass_logits(torch.randn(1, 11))
    pub.pass_end(p, [7])
    pub.request_finished(rid, "stop")


def _store(shm_dir, db) -> dict:
    with DuckDBStore(db) as store:
        summary = Pipeline(
            store, os.getpid(), snapshot=False, shm=ShmSource(os.getpid(), str(shm_dir))
        ).close()
        assert summary.store_error is None and summary.failed_rows == 0
        rows = {
            t: store.query(f"SELECT * EXCLUDE (ts_ns) FROM {t} ORDER BY ALL").to_pylist()
            for t in ("request_labels", "model_factors", "request_intents")
        }
        rows["steps"] = store.query("SELECT request_seq, shadow FROM token_steps ORDER BY ALL").to_pylist()
        ends = store.query("SELECT request_seq, trace_id FROM request_events WHERE kind = 'end'").to_pylist()
        rows["traces"] = {r["request_seq"]: r["trace_id"] for r in ends}
        return rows


def test_labels_factors_and_intents_reach_the_store_once(shm, tmp_path, capsys, fresh_counter):
    model = tiny_gpt2()
    tokenizer = ByteTokenizer()
    llmobs.instrument(model, tokenizer, intent=True, factors={"quant": "int4-pc", "template_set": "a"})
    ids = tokenizer(["Summarize this article in 3 bullet points."])
    with llmobs.context(variant="qlora-r8", labels={"template": "v3"}):
        model.generate(**ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # request_seq 1
        tokens = torch.tensor([[3, 4, 5, 6]])
        model(input_ids=tokens, labels=tokens)  # a labelled forward with labels: request_seq 2, 3 steps
        # llmobs.request: the context's labels and its own; a shadow-flagged step (llmobs.shadow's form)
        with llmobs.request(torch.tensor([[1, 2, 3]]), model_id="shadow-model", labels={"shadow_of": "1"},
                            intent_text="Give me a three-bullet summary of this.") as req:  # fmt: skip
            req.step(torch.randn(1, 11), [4], flags=layout.FLAG_SHADOW | layout.FLAG_TEACHER_FORCED)
    writer = writer_module.get_writer()
    _serve_one(writer, "r-1", [5, 6, 7])  # request_seq 4
    pid = os.getpid()
    db = tmp_path / "s.duckdb"
    rows = _store(shm, db)
    traces = rows["traces"]
    assert sorted(traces) == [1, 2, 3, 4]  # every labelled request has its REQUEST_END
    context = {"variant": "qlora-r8", "template": "v3"}
    expected = {
        1: context,
        2: context,
        3: context | {"shadow_of": "1"},
        4: {"variant": "lora", "template": "v1"},
    }
    assert rows["request_labels"] == sorted(
        ({"pid": pid, "request_seq": s, "trace_id": traces[s], "key": k, "value": v}
         for s, kv in expected.items() for k, v in kv.items()),
        key=lambda r: (r["request_seq"], r["key"]),
    )  # fmt: skip
    intents = {
        r["request_seq"]: (r["action"], r["output_format"], r["constraints"]) for r in rows["request_intents"]
    }
    assert intents == {
        1: ("summarize", "list", "items=3"),  # decoded from the prompt's tokens (intent=True)
        3: ("summarize", "list", "items=3"),  # llmobs.request(intent_text=...)
        4: ("translate", "none", "language=fr"),  # the served client's llmobs.context(intent_text=...)
    }
    assert all(r["trace_id"] == traces[r["request_seq"]] for r in rows["request_intents"])
    assert all(len(r["minhash"]) == 144 and len(r["template_id"]) == 16 for r in rows["request_intents"])
    factors = {"adapters": "none", "dtype": "float32", "quant": "int4-pc", "template_set": "a",
               "tokenizer": "byte-tokenizer", "vocab": "256"}  # fmt: skip
    assert rows["model_factors"] == [
        {"pid": pid, "model_id": "byte-tokenizer", "key": k, "value": v} for k, v in sorted(factors.items())
    ]
    assert rows["steps"] == [{"request_seq": s, "shadow": s == 3} for s in (1, 1, 2, 2, 2, 3, 4)]
    # a second agent reading the same live map from its start hands the same rows again: kept once
    assert _store(shm, db) | {"steps": None} == rows | {"steps": None}
    assert labels.dropped == 0

    assert main(["query", "--by-intent", "--db", str(db), "--format", "json"]) == 0
    clusters = json.loads(capsys.readouterr().out)
    assert [(c["requests"], c["action"], c["output_format"], c["constraints"]) for c in clusters] == [
        (2, "summarize", "list", "items=3"), (1, "translate", "none", "language=fr"),
    ]  # fmt: skip
    assert sorted(clusters[0]["members"]) == [f"{pid}:1", f"{pid}:3"] and len(clusters[0]["templates"]) == 2
    assert main(["query", "--by-intent", "--db", str(db)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["cluster", "requests", "action", "output_format", "constraints", "templates",
                                "members"] and table[-1] == "(2 rows)"  # fmt: skip
    assert main(["query", "--by-intent", "--tenant", "acme", "--db", str(db)]) == 2  # never ignored silently
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --tenant filters only") and err[1].startswith("hint: ")


def test_labels_the_names_ring_overwrote_are_published_again_at_the_end(tmp_path):
    w = writer_module.ShmWriter(shm_dir=str(tmp_path), names_capacity=8, steps_capacity=64)
    try:
        pub = ServingPublisher("m", writer=w)
        with llmobs.context(variant="v", labels={"a": "1", "b": "2"}):
            pub.request_arrived("r", [1, 2])
        for i in range(10):  # other names lap the ring: the request's label records are gone
            w.name(layout.NAME_OTHER, f"other-{i}")
        with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as reader:
            reader.read_names()
            assert reader.request_labels == {}
            pub.request_finished("r", "stop")
            facts = reader.read_request_events().facts["request_labels"]
        assert sorted(zip(facts["key"], facts["value"], strict=True)) == [
            ("a", "1"),
            ("b", "2"),
            ("variant", "v"),
        ]
    finally:
        w.close()


def test_quantization_configs_are_summarised_by_method_bits_and_kind():
    from llmobs.publisher.factors import quant_summary
    from transformers import BitsAndBytesConfig, GPT2Config, GPTQConfig

    config = GPT2Config()
    assert quant_summary(config) == "none"
    for q, want in [
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"), "bitsandbytes-4bit-nf4"),
        (BitsAndBytesConfig(load_in_8bit=True), "bitsandbytes-8bit"),
        (GPTQConfig(bits=4), "gptq-4bit"),
        ({"quant_method": "awq", "bits": 4}, "awq-4bit"),  # as a config.json holds it
    ]:
        config.quantization_config = q
        assert quant_summary(config) == want
