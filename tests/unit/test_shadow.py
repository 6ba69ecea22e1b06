"""llmobs.shadow: a second model scores the primary's tokens teacher-forced, on its own thread.

A model shadowing itself must give back the primary's own live losses on every token (that proves the
pairing: trace id, step and position, target = the primary's token); a full queue drops and counts; a
shadow that raises never reaches the workload; the detectors never see shadow rows."""

from __future__ import annotations

import os
import threading

import llmobs
import numpy as np
import pytest
import torch
from llmobs.diagnostics.detectors import DetectorConfig, live_traffic
from llmobs.publisher import request as publisher
from llmobs.publisher import shadow as shadow_module
from llmobs.shm import layout
from llmobs.shm.reader import ShmReader
from publisher_fixtures import isolated_writer, tiny_gpt2


@pytest.fixture
def shm(tmp_path):
    yield from isolated_writer(tmp_path)


@pytest.fixture(autouse=True)
def fresh_scorer():
    """Each test gets the process's shadow scorer anew (its queue size is the first call's)."""
    shadow_module._scorer = None
    yield
    scorer = shadow_module._scorer
    if scorer is not None:
        scorer.shadows = []
        scorer.wait_idle(30)
    shadow_module._scorer = None
    publisher.shadow_hook = None


def _read(shm):
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        steps = r.read_steps(0)
        requests = r.read_request_events(0)
        flags = steps.raw["flags"]
    assert (steps.lost, steps.corrupt) == (0, 0)
    return steps, flags, requests


def _generate(model, enc, tokens: int, pad: int):
    with torch.no_grad():
        return model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=pad)  # fmt: skip


def test_a_model_shadowing_itself_gives_back_its_live_losses(shm, smollm2):
    model, tokenizer, model_id = smollm2
    inst = llmobs.instrument(model, tokenizer, model_id=model_id)
    try:
        handle = llmobs.shadow(model, model, variant="self", labels={"quant": "none"})
        enc = tokenizer(
            ["What is the capital of France?", "Name a colour."], return_tensors="pt", padding=True
        )
        with llmobs.context(tenant="t1", variant="live", labels={"template": "v1"}):
            _generate(model, enc, 4, tokenizer.pad_token_id)
        assert handle.wait_idle(60)
        # the flight recorder's token buffer is used where it records the request
        inst.remove()
        inst = llmobs.instrument(model, tokenizer, model_id=model_id, recorder=llmobs.Recorder(budget_mb=0))
        one = tokenizer(["The quick brown fox"], return_tensors="pt")
        _generate(model, one, 4, tokenizer.pad_token_id)
        assert handle.wait_idle(60)
    finally:
        inst.remove()
    steps, flags, requests = _read(shm)
    cols = steps.columns
    shadow = (flags & layout.FLAG_SHADOW) != 0
    assert shadow.sum() == (~shadow).sum() == 2 * 4 + 4
    assert np.array_equal(cols["shadow"], shadow)
    assert (flags[shadow] == layout.FLAG_SHADOW | layout.FLAG_TEACHER_FORCED | layout.FLAG_HAS_TARGET).all()
    live = {}
    for i in np.flatnonzero(~shadow):
        live[(cols["trace_id"][i], int(cols["step"][i]), int(cols["position"][i]))] = i
    for i in np.flatnonzero(shadow):
        j = live.pop((cols["trace_id"][i], int(cols["step"][i]), int(cols["position"][i])))
        assert int(cols["target_id"][i]) == int(cols["token_id"][j]) == int(cols["target_id"][j])
        for metric in ("loss", "entropy", "target_prob", "top1_prob"):
            assert abs(float(cols[metric][i]) - float(cols[metric][j])) <= 1e-4, (metric, i, j)
        assert int(cols["target_rank"][i]) == int(cols["target_rank"][j])
        assert cols["model_id"][i] == f"{model_id}@self" and cols["model_id"][j] == model_id
        assert cols["tenant"][i] == cols["tenant"][j]
        assert cols["request_seq"][i] not in (0, cols["request_seq"][j])
        assert int(cols["batch_row"][i]) == int(cols["batch_row"][j])
    assert not live  # every live token step has its shadow
    # one step_seq per shadow pass (per request), not a live one
    assert len(set(cols["step_seq"][shadow].tolist())) == 2
    assert not set(cols["step_seq"][shadow].tolist()) & set(cols["step_seq"][~shadow].tolist())
    # labels: the primary's, the shadow's variant and labels over them, shadow_of = the primary's seq
    ends = requests.columns
    assert sorted(ends["model_id"]) == sorted([model_id] * 3 + [f"{model_id}@self"] * 3)
    labels = requests.facts["request_labels"]
    by_seq: dict[int, dict] = {}
    for seq, key, value in zip(labels["request_seq"], labels["key"], labels["value"], strict=True):
        by_seq.setdefault(int(seq), {})[key] = value
    primary_seqs = {int(s) for s in cols["request_seq"][~shadow][:8]}
    for i in np.flatnonzero(shadow)[:8]:
        got = by_seq[int(cols["request_seq"][i])]
        assert got["variant"] == "self" and got["quant"] == "none" and got["template"] == "v1"
        assert int(got["shadow_of"]) in primary_seqs
    assert by_seq[next(iter(primary_seqs))] == {"variant": "live", "template": "v1"}
    assert handle.dropped == handle.failed == 0 and handle.requests == 2
    handle.remove()  # the last shadow gone: requests no longer call into the scorer
    assert publisher.shadow_hook is None


class _Gated(torch.nn.Module):
    """A real model whose forward waits for `release` (and says it `entered`): the shadow thread busy."""

    def __init__(self, inner, fail: bool = False):
        super().__init__()
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def forward(self, input_ids, attention_mask=None, **kwargs):
        self.entered.set()
        if self.fail:
            raise RuntimeError("the shadow model is broken")
        assert self.release.wait(30)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


def test_a_full_queue_drops_and_counts_never_waits(shm):
    model = tiny_gpt2()
    inst = llmobs.instrument(model, model_id="tiny")
    gated = _Gated(tiny_gpt2())
    try:
        handle = llmobs.shadow(model, gated, variant="gated", queue=1)
        ids = torch.tensor([[5, 6, 7]])
        _generate(model, {"input_ids": ids}, 3, 0)
        assert gated.entered.wait(30)  # the thread holds request 1: the queue is empty again
        _generate(model, {"input_ids": ids + 1}, 3, 0)  # queued
        _generate(model, {"input_ids": ids + 2}, 3, 0)  # the queue is full: dropped, the workload goes on
        assert (handle.dropped, handle.scorer.enqueued) == (1, 2)
        gated.release.set()
        assert handle.wait_idle(30)
    finally:
        gated.release.set()
        inst.remove()
    steps, flags, _ = _read(shm)
    assert ((flags & layout.FLAG_SHADOW) != 0).sum() == 2 * 3 and handle.requests == 2
    assert (~((flags & layout.FLAG_SHADOW) != 0)).sum() == 3 * 3


def test_a_raising_shadow_never_reaches_the_workload(shm):
    model = tiny_gpt2()
    inst = llmobs.instrument(model, model_id="tiny")
    broken = _Gated(tiny_gpt2(), fail=True)
    ids = torch.tensor([[9, 8, 7, 6]])
    try:
        expect = _generate(model, {"input_ids": ids}, 5, 0)
        errors = publisher.errors
        handle = llmobs.shadow(model, broken, variant="broken")
        with pytest.warns(UserWarning, match="a shadow score failed"):
            for _ in range(2):
                got = _generate(model, {"input_ids": ids}, 5, 0)
                assert torch.equal(got, expect)
            assert handle.wait_idle(30)
    finally:
        inst.remove()
    assert handle.failed == 2 and "the shadow model is broken" in handle.scorer.last_error
    assert publisher.errors == errors  # nothing counted against the live path either
    steps, flags, _ = _read(shm)
    assert len(steps) == 3 * 5 and not (flags & layout.FLAG_SHADOW).any()


def _steps(losses, first: int, shadow: bool) -> dict:
    n = len(losses)
    step = np.arange(n)
    return {
        "pid": np.full(n, 7), "step_seq": first + step, "trace_id": ["d" * 32] * n, "step": step,
        "position": 10 + step, "token_id": step + 1000, "target_id": step + 1000,
        "loss": np.asarray(losses, np.float32), "batch_row": np.zeros(n, np.int32),
        "t_start_ns": (first + step) * 1_000_000, "t_end_ns": (first + step) * 1_000_000 + 500_000,
        "shadow": np.full(n, shadow),
    }  # fmt: skip


def test_the_anomaly_lane_never_scores_shadow_rows(tmp_path):
    from llmobs.diagnostics.live import LiveAnomalies
    from llmobs.store.sink import DuckDBStore

    losses = np.random.default_rng(2).normal(2.0, 0.2, 40)
    losses[35] = 6.0  # a spike both detectors flag (tests/unit/test_diag_detect.py)
    live_rows = _steps(losses, 300, shadow=False)
    shadow_rows = _steps(losses, 300, shadow=True)
    mixed = {k: np.concatenate([np.asarray(shadow_rows[k]), np.asarray(live_rows[k])]) for k in live_rows}
    mixed["trace_id"] = list(mixed["trace_id"])
    kept = live_traffic(mixed)
    assert len(kept["trace_id"]) == 40 and not kept["shadow"].any() and live_traffic(kept) is kept
    with DuckDBStore(tmp_path / "s.duckdb") as store:
        lane = LiveAnomalies(store, DetectorConfig(detector="both"))
        assert lane.add(shadow_rows) == 0  # the same losses as shadow scores: nothing
        assert lane.detector.counters.tested == 0
        assert lane.add(live_rows) == 2  # as live traffic: the spike, by both detectors
        assert lane.close()
        assert lane.counters.committed == 2


def test_a_pass_of_more_than_8_rows_keeps_every_trace_id_exact(shm):
    """The writer's numpy path (more than SMALL_BATCH records, as a shadow pass is): trace words above
    and below 2**63 in one list once became float64 and lost their low bits."""
    model = tiny_gpt2()
    ids = torch.arange(9 * 4).reshape(9, 4) % 250 + 1
    with torch.no_grad(), llmobs.request(ids) as req:
        req.step(model(input_ids=ids).logits[:, -1], ids[:, 0])
        traces = list(req.trace_ids)
    assert {int(t[:16], 16) >> 63 for t in traces} == {0, 1}  # both halves of the range, in one pass
    steps, _, _ = _read(shm)
    assert list(steps.columns["trace_id"]) == traces


def test_a_served_request_is_shadowed_on_its_own_tokens(shm):
    """The continuous-batching publisher (engine-neutral calls, a real model's logits): the shadow of
    the served model scores each committed token, paired on (trace_id, step, position)."""
    from llmobs.publisher.serving import Row, ServingPublisher

    model = tiny_gpt2()
    inst = llmobs.instrument(model, model_id="tiny")
    handle = llmobs.shadow(model, model, variant="self")
    pub = ServingPublisher(model_id="tiny")
    ids = [5, 6, 7, 8]
    try:
        with llmobs.context(labels={"template": "v2"}):
            pub.request_arrived("r1", ids)
        seq = list(ids)
        for k in range(3):
            rows = [Row("r1", tokens=len(ids) if k == 0 else 1, past=0 if k == 0 else len(seq) - 1,
                        produces_token=True)]  # fmt: skip
            p = pub.pass_begin(rows)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq])).logits[:, -1]
            pub.pass_logits(logits)
            token = int(logits.argmax(-1))
            pub.pass_end(p, [token])
            seq.append(token)
        pub.request_finished("r1", "length")
        assert handle.wait_idle(30)
    finally:
        inst.remove()
    steps, flags, requests = _read(shm)
    cols = steps.columns
    shadow = (flags & layout.FLAG_SHADOW) != 0
    assert shadow.sum() == (~shadow).sum() == 3 and handle.requests == 1
    live = {
        (cols["trace_id"][i], int(cols["step"][i]), int(cols["position"][i])): i
        for i in np.flatnonzero(~shadow)
    }
    for i in np.flatnonzero(shadow):
        j = live.pop((cols["trace_id"][i], int(cols["step"][i]), int(cols["position"][i])))
        assert int(cols["target_id"][i]) == int(cols["token_id"][j])
        assert abs(float(cols["loss"][i]) - float(cols["loss"][j])) <= 1e-5
    labels = requests.facts["request_labels"]
    shadow_seq = int(cols["request_seq"][np.flatnonzero(shadow)[0]])
    got = {k: v for s, k, v in zip(labels["request_seq"], labels["key"], labels["value"], strict=True)
           if int(s) == shadow_seq}  # fmt: skip
    assert got == {"variant": "self", "template": "v2", "shadow_of": str(int(cols["request_seq"][0]))}


def test_a_shadow_removed_during_a_request_still_scores_it_and_counts_no_error(shm):
    model = tiny_gpt2()
    handle = llmobs.shadow(model, tiny_gpt2(), variant="gone")
    errors = publisher.errors
    ids = torch.tensor([[3, 4, 5]])
    try:
        with torch.no_grad(), llmobs.request(ids) as req:  # a loop that names no model: every shadow
            logits = model(input_ids=ids).logits[:, -1]
            handle.remove()  # the last one: new requests cost nothing, this one is still scored
            assert publisher.shadow_hook is None
            req.step(logits, logits.argmax(-1))
        assert handle.wait_idle(30)
    finally:
        model._llmobs_instrumented.remove()
    assert publisher.errors == errors and handle.requests == 1 and handle.steps == 1
