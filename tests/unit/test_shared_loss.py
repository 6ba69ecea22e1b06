"""A labelled pass's loss from the publisher's own log-softmax (llmobs.publisher.shared_loss): the model's
loss to the bit (and with autograd its gradients), the same published metrics as the unshared path, and
the model's own loss function wherever sharing does not apply (a failure, a difference, another loss,
after remove())."""

from __future__ import annotations

import os

import llmobs
import numpy as np
import pytest
import torch
from llmobs.publisher import device_math, shared_loss
from llmobs.shm import writer as writer_module
from llmobs.shm.reader import ShmReader

from tests.unit.publisher_fixtures import isolated_writer, tiny_gpt2

METRICS = ("loss", "entropy", "target_prob", "top1_prob", "target_rank", "token_id", "target_id", "position")


@pytest.fixture
def shm(tmp_path):
    writer_module.configure(shm_dir=str(tmp_path), steps_capacity=4096)
    yield from isolated_writer(tmp_path)


@pytest.fixture
def model():
    return tiny_gpt2()


@pytest.fixture
def fresh(monkeypatch):
    """Each test starts with sharing unchecked and on, as a new process does."""
    monkeypatch.setattr(shared_loss, "_checked", set())
    monkeypatch.setattr(shared_loss, "_why_off", None)


@pytest.fixture(params=["chunked", "whole"])
def layout(request, monkeypatch):
    """The CPU chunk loop (a few rows a chunk, the log-softmax lent from the pool) or one pass."""
    if request.param == "chunked":
        monkeypatch.setattr(device_math, "CPU_CHUNK_BYTES", 3 * 256 * 4)  # 3 rows of the 256 vocabulary
        monkeypatch.setattr(device_math, "CPU_CHUNK_THREADS", 1)
    return request.param


BATCH = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])


def _labels():
    labels = BATCH.clone()
    labels[0, :3] = -100  # a prompt whose tokens are not scored
    return labels


def _own_then_instrumented(model, passes: int):
    """The model's own loss of BATCH without autograd, then `passes` losses of it under instrument, and
    how many of those came from the shared log-softmax."""
    with torch.no_grad():
        own = model(input_ids=BATCH, labels=_labels()).loss
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        with torch.no_grad():
            losses = [model(input_ids=BATCH, labels=_labels()).loss for _ in range(passes)]
        return own, losses, inst._shared_loss[0].calls
    finally:
        inst.remove()


def _published(tmp_path) -> dict[str, np.ndarray]:
    with ShmReader(os.getpid(), shm_dir=str(tmp_path)) as reader:
        batch = reader.read_steps(0)
    return {name: np.asarray(batch.columns[name]) for name in (*METRICS, "step_seq")}


def test_the_loss_is_the_models_to_the_bit_and_the_metrics_are_the_unshared_ones(
    shm, model, fresh, layout, monkeypatch
):
    labels = _labels()
    with torch.no_grad():
        own = model(input_ids=BATCH, labels=labels).loss
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        wrapper = inst._shared_loss[0]
        with torch.no_grad():
            shared = model(input_ids=BATCH, labels=labels).loss
        assert (
            wrapper.calls == 1
            and shared_loss.status() == "on (checked against the model's own loss: no_grad)"
        )
        monkeypatch.setattr(shared_loss, "_why_off", "off for the comparison")
        with torch.no_grad():
            unshared = model(input_ids=BATCH, labels=labels).loss  # the model's own, the post-hook's metrics
        assert wrapper.calls == 1
    finally:
        inst.remove()
    assert torch.equal(shared, own) and torch.equal(unshared, own)
    steps = _published(shm)
    first, second = (steps["step_seq"] == s for s in sorted(set(steps["step_seq"])))
    assert first.sum() == second.sum() == 2 * 7  # every target position of both rows, twice
    for name in METRICS:  # the same bits, NaN where there is no target
        np.testing.assert_array_equal(steps[name][first], steps[name][second], err_msg=name)
    assert np.isnan(steps["loss"][first]).sum() == 2  # row 0's first two targets are ignored labels
    valid = ~np.isnan(steps["loss"][first])
    assert np.float32(steps["loss"][first][valid].mean()) == pytest.approx(own.item(), abs=1e-6)


def test_with_autograd_the_loss_and_every_gradient_are_the_models_to_the_bit(shm, model, fresh, layout):
    """A training pass: the loss keeps the graph cross_entropy would have built, so backward() gives every
    parameter the same gradient bits; the metrics are the no-autograd pass's."""
    labels = _labels()
    own = model(input_ids=BATCH, labels=labels).loss
    own.backward()
    own_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        shared = model(input_ids=BATCH, labels=labels).loss
        assert shared.requires_grad and inst._shared_loss[0].calls == 1
        shared.backward()
        with torch.no_grad():
            model(input_ids=BATCH, labels=labels)  # the same pass without autograd, for its metrics
        assert shared_loss.status() == "on (checked against the model's own loss: autograd, no_grad)"
    finally:
        inst.remove()
    assert torch.equal(shared.detach(), own.detach())
    for (name, p), grad in zip(model.named_parameters(), own_grads, strict=True):
        assert torch.equal(p.grad, grad), name
    steps = _published(shm)
    first, second = (steps["step_seq"] == s for s in sorted(set(steps["step_seq"])))
    for name in METRICS:
        np.testing.assert_array_equal(steps[name][first], steps[name][second], err_msg=name)


def test_a_sum_over_num_items_in_batch_is_the_models_too(model, fresh, shm):
    """ForCausalLMLoss sums and divides when given num_items_in_batch (gradient accumulation)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    labels = _labels()
    with torch.no_grad():
        logits = model(input_ids=BATCH).logits
        own = ForCausalLMLoss(logits, labels, vocab_size=256, num_items_in_batch=torch.tensor(40))
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        with torch.no_grad():
            shared = model(input_ids=BATCH, labels=labels, num_items_in_batch=torch.tensor(40)).loss
        assert inst._shared_loss[0].calls == 1
    finally:
        inst.remove()
    assert torch.equal(shared, own)


def test_a_difference_at_the_first_check_turns_sharing_off(monkeypatch, model, fresh, shm):
    computed = shared_loss._loss_and_block

    def off_by_a_little(*args, **kwargs):
        loss, block = computed(*args, **kwargs)
        return loss + 1e-3, block

    monkeypatch.setattr(shared_loss, "_loss_and_block", off_by_a_little)
    own, (first, second), calls = _own_then_instrumented(model, passes=2)
    assert calls == 0 and torch.equal(first, own) and torch.equal(second, own)
    said = shared_loss.status()
    assert said.startswith("off: the shared loss") and "differs from the model's" in said
    assert len(_published(shm)["loss"]) == 2 * 2 * 7  # both passes still published


def test_a_failure_turns_sharing_off_and_the_model_gets_its_own_loss(monkeypatch, model, fresh, shm):
    def broken(*_args, **_kwargs):
        raise RuntimeError("no buffer")

    monkeypatch.setattr(device_math, "labelled_block", broken)
    own, (got,), calls = _own_then_instrumented(model, passes=1)
    assert calls == 0 and torch.equal(got, own)
    assert shared_loss.status() == "off: the shared loss failed: RuntimeError('no buffer')"
    assert len(_published(shm)["loss"]) == 2 * 7  # published all the same, by the post-hook


def test_remove_restores_the_loss_function_and_a_users_own_is_left_alone(model, fresh, shm):
    from transformers.loss.loss_utils import ForCausalLMLoss

    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    assert isinstance(model.loss_function, shared_loss.SharedLoss)
    inst.remove()
    assert "_loss_function" not in model.__dict__ and model.loss_function is ForCausalLMLoss

    def mine(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs) * 2

    model.loss_function = mine
    inst = llmobs.instrument(model, model_id="tiny-gpt2")
    try:
        assert inst._shared_loss is None and model.loss_function is mine
        with torch.no_grad():
            doubled = model(input_ids=BATCH, labels=_labels()).loss
    finally:
        inst.remove()
    assert model.loss_function is mine
    model.__dict__.pop("_loss_function")
    with torch.no_grad():
        assert torch.equal(doubled, 2 * model(input_ids=BATCH, labels=_labels()).loss)
