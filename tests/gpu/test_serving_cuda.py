"""Continuous batching on a real GPU (scripts/gpu_check.sh runs this tier): transformers'
ContinuousBatchingManager with the model on CUDA publishes every token of every request through the
publisher's CUDA path (device-side metrics, non_blocking copies into the pinned map, records committed
after their CUDA event), with losses equal to a teacher-forced recomputation on the same device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shm(tmp_path):
    from tests.unit.publisher_fixtures import isolated_writer

    yield from isolated_writer(tmp_path)


def test_generate_batch_on_cuda_publishes_every_token_with_device_metrics(shm):
    import llmobs
    from llmobs.publisher import request as publisher

    from tests.unit.continuous_batching import (
        cb_configs,
        read_map,
        rows_by_request,
        teacher_forced_losses,
        tiny_llama,
    )

    reference = tiny_llama()  # the same seeded weights, recomputed on the CPU
    model = tiny_llama().to("cuda")
    llmobs.instrument(model, model_id="tiny-llama-cuda")
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], list(range(20, 40))]
    gen, cb = cb_configs(8, use_cuda_graph=False)  # graphs replay without forward hooks: NaN metrics
    errors = publisher.errors
    with llmobs.context(tenant="gpu-tenant"):
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    assert publisher.errors == errors
    rows, _ = read_map(shm)
    assert len(rows) == sum(len(o.generated_tokens) for o in out.values())
    by_request = rows_by_request(rows)
    for request_id, result in out.items():
        steps = sorted(by_request[request_id], key=lambda r: r["step"])
        assert [r["step"] for r in steps] == list(range(len(result.generated_tokens)))
        assert [r["token_id"] for r in steps] == list(result.generated_tokens)
        expected = teacher_forced_losses(reference, result.prompt_ids, result.generated_tokens)
        np.testing.assert_allclose([r["loss"] for r in steps], expected, atol=1e-3, rtol=0)
