"""The publisher's CUDA path on a real GPU: device-side metrics, non_blocking copies into the pinned
map, records committed only after their CUDA event, and no host sync added per step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shm(tmp_path):
    from llmobs.shm import writer as writer_module

    writer_module.reset_writer()
    writer_module.configure(shm_dir=str(tmp_path))
    yield tmp_path
    writer_module.reset_writer()
    writer_module._writer_options.clear()


def test_cuda_steps_commit_after_their_copy_and_match_cross_entropy(shm):
    import llmobs
    from llmobs.shm import layout
    from llmobs.shm.reader import ShmReader
    from llmobs.shm.writer import get_writer

    torch.manual_seed(0)
    logits = [torch.randn(2, 32000, device="cuda") for _ in range(50)]
    targets = [torch.randint(0, 32000, (2,), device="cuda") for _ in range(50)]
    with llmobs.request([[1, 2, 3], [4, 5, 6]]) as req:
        for lg, tg in zip(logits, targets, strict=True):
            req.begin_step()
            req.step(lg, tg)
    w = get_writer()
    assert w._cuda_registered
    torch.cuda.synchronize()
    w.poll_pending()
    assert not w._pending
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        b = r.read_steps(0)
    assert (len(b), b.lost, b.corrupt) == (100, 0, 0)
    expect = torch.cat(
        [F.cross_entropy(lg, tg, reduction="none") for lg, tg in zip(logits, targets, strict=True)]
    )
    assert (abs(b.columns["loss"] - expect.cpu().numpy()) <= 1e-5).all()
    assert (b.raw["flags"] & layout.FLAG_DEVICE_CUDA).all()


def test_no_host_sync_per_step(shm):
    import llmobs
    from llmobs.shm import layout
    from llmobs.shm.reader import ShmReader

    lg = torch.randn(1, 32000, device="cuda")
    tg = torch.randint(0, 32000, (1,), device="cuda")
    with llmobs.request([1, 2, 3]) as req:
        req.begin_step()
        req.step(lg, tg)  # warm-up: pins the map, creates views
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call in the step raises
        try:
            for _ in range(10):
                req.begin_step()
                req.step(lg, tg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert llmobs.publisher.request.errors == 0
    # ... and the steps were published: the warm-up and all 10, committed from the device (the request's
    # end waits once for the newest copy), each with the loss of its logits
    with ShmReader(os.getpid(), shm_dir=str(shm)) as r:
        b = r.read_steps(0)
    assert (len(b), b.lost, b.corrupt) == (11, 0, 0)
    assert list(b.columns["step"]) == list(range(11))
    assert (b.raw["flags"] & layout.FLAG_DEVICE_CUDA).all()
    expect = F.cross_entropy(lg, tg, reduction="none").item()
    assert (abs(b.columns["loss"] - expect) <= 1e-5).all()


def test_a_labelled_pass_on_cuda_shares_its_log_softmax_with_the_models_loss_to_the_bit(shm):
    """publisher/shared_loss.py on the device: the model's loss under instrument is its own loss's bits
    without autograd and with it (its gradients too), the sharing was used (not turned off by either
    way's first check), every target published."""
    import llmobs
    from llmobs.publisher import shared_loss
    from llmobs.shm.reader import ShmReader
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=32000, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval().to("cuda")
    ids = torch.randint(0, 32000, (2, 40), device="cuda")
    labels = ids.clone()
    labels[0, :5] = -100
    with torch.no_grad():
        own = model(input_ids=ids, labels=labels).loss
    trained = model(input_ids=ids, labels=labels).loss
    trained.backward()
    own_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    inst = llmobs.instrument(model, model_id="tiny-gpt2-cuda")
    try:
        with torch.no_grad():
            shared = model(input_ids=ids, labels=labels).loss
        shared_trained = model(input_ids=ids, labels=labels).loss
        shared_trained.backward()
        calls = inst._shared_loss[0].calls
    finally:
        inst.remove()
    from llmobs.shm.writer import get_writer

    torch.cuda.synchronize()
    get_writer().poll_pending()  # the records wait for their copy's CUDA event
    assert calls == 2 and torch.equal(shared, own), shared_loss.status()
    assert torch.equal(shared_trained.detach(), trained.detach())
    for p, grad in zip(model.parameters(), own_grads, strict=True):
        assert torch.equal(p.grad, grad)
    with ShmReader(os.getpid(), shm_dir=str(shm)) as reader:
        batch = reader.read_steps(0)
    assert len(batch) == 2 * 2 * 39 and batch.corrupt == 0
