"""workloads.variants: the fake quantization is what it says, on a small real Llama (the SmolLM2 layout)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmobs.workloads import variants  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in variants.decoder_linears(model)}


def test_every_decoder_linear_is_quantized_per_channel_within_half_a_step(llama):
    before = _weights(llama)
    assert len(before) == 2 * 7  # q, k, v, o, gate, up, down per layer
    quant = variants.fake_quantize(llama, bits=4)
    after = _weights(quant)
    assert after.keys() == before.keys()
    for name, w in before.items():
        wq = after[name]
        scale = w.abs().amax(dim=1, keepdim=True) / 7
        levels = torch.round(wq / scale)
        # each channel's values are integer multiples of its own scale, in [-7, 7]: <= 2**4 levels
        assert torch.allclose(wq, levels * scale, atol=1e-6), name
        assert levels.abs().max() <= 7
        for row in levels:
            assert row.unique().numel() <= 2**4
        # round-to-nearest: the error of each weight is at most half its channel's step
        assert ((w - wq).abs() <= scale / 2 + 1e-7).all(), name
        assert not torch.equal(w, wq), name  # a real change (random init weights are not on the grid)
    # the original is untouched; the embeddings and the (tied) head are kept as they are
    assert all(torch.equal(w, _weights(llama)[n]) for n, w in before.items())
    assert torch.equal(quant.get_input_embeddings().weight, llama.get_input_embeddings().weight)
    assert quant.get_output_embeddings().weight is quant.get_input_embeddings().weight


def test_jitter_scales_each_channel_within_its_bound_and_is_seeded(llama):
    plain = _weights(variants.fake_quantize(llama, bits=4))
    jittered = _weights(variants.fake_quantize(llama, bits=4, scale_jitter=0.03, seed=1))
    again = _weights(variants.fake_quantize(llama, bits=4, scale_jitter=0.03, seed=1))
    other = _weights(variants.fake_quantize(llama, bits=4, scale_jitter=0.03, seed=2))
    w0 = _weights(llama)
    ratios = []
    for name, wq in plain.items():
        assert torch.equal(jittered[name], again[name])
        assert not torch.equal(jittered[name], other[name])
        scale = w0[name].abs().amax(dim=1, keepdim=True) / 7
        q = torch.round(wq / scale)
        # the same integer levels, each channel's scale multiplied by one factor in [0.97, 1.03]
        nz = q != 0
        ratio = torch.where(nz, jittered[name] / torch.where(nz, wq, 1.0), float("nan"))
        per_row = torch.nanmean(ratio, dim=1)
        assert torch.allclose(ratio[nz], per_row[:, None].expand_as(ratio)[nz], atol=1e-5)
        ratios.append(per_row)
        bound = scale / 2 + q.abs().amax(dim=1, keepdim=True) * scale * 0.03
        assert ((w0[name] - jittered[name]).abs() <= bound + 1e-7).all()
    ratios = torch.cat(ratios)
    assert ratios.min() >= 0.97 - 1e-6 and ratios.max() <= 1.03 + 1e-6
    assert ratios.max() - ratios.min() > 0.04  # drawn across the range, not one constant


def test_per_tensor_and_bad_arguments(llama):
    quant = variants.fake_quantize(llama, bits=3, per_channel=False)
    for name, w in _weights(llama).items():
        scale = w.abs().max() / 3
        assert (torch.round(_weights(quant)[name] / scale).unique().numel()) <= 2**3
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        variants.fake_quantize(llama, bits=1)
    with pytest.raises(ValueError, match="jitter must be in"):
        variants.fake_quantize(llama, scale_jitter=1.5)
    assert variants.describe(4, True, 0.03) == "int4-pc-j0.03"
    assert variants.describe(4) == "int4-pc"
