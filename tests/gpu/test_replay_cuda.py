"""A flight-recorder replay on a real GPU (scripts/gpu_check.sh runs this tier): the tiny Llama on CUDA,
a greedy llmobs.request loop under instrument(recorder=...), CMD_REPLAY through the real control block.
The replay runs on its own CUDA stream and collects CUPTI activity for its passes with the real
cupti-python (llmobs.cupti.replay_activity): every replayed pass ran kernels, none of the live loop's
is counted as the replay's, and the replayed loss equals the live one."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def shm(tmp_path):
    from tests.unit.publisher_fixtures import isolated_writer

    yield from isolated_writer(tmp_path)


def test_a_replay_on_cuda_collects_its_passes_kernels_with_cupti_and_reproduces_the_loss(shm):
    pytest.importorskip("cupti")
    import llmobs
    from llmobs.publisher import replay
    from llmobs.shm import layout
    from llmobs.shm.control import ControlClient
    from llmobs.shm.reader import ShmReader

    from tests.unit.continuous_batching import tiny_llama
    from tests.unit.publisher_fixtures import GreedyLoop

    model = tiny_llama().to("cuda")
    inst = llmobs.instrument(model, model_id="tiny-llama-cuda", recorder=llmobs.Recorder(every=4, repeats=2))
    rec = inst.recorder
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7]], device="cuda")
    try:
        with ControlClient(os.getpid(), str(shm)) as client, llmobs.request(ids) as req:
            loop = GreedyLoop(model, req, ids)
            for _ in range(8):
                loop.step()
            target = int(req._recording.step_seq[5])
            seq = client.post(layout.CMD_REPLAY, layout.replay_arg(target, 0, 2))
            loop.step()  # the boundary where the workload answers
            ack = client.wait_ack(seq, timeout=10.0)
            assert ack["ack_status"] == layout.ACK_OK
            for _ in range(4):
                loop.step()  # the live loop goes on (its kernels are not the replay's)
        assert rec.wait_idle(120)
        with np.load(rec.last_result) as z:
            result = replay.ReplayResult.from_arrays({k: z[k] for k in z.files})
        with ShmReader(os.getpid(), shm_dir=str(shm)) as reader:
            steps = reader.read_steps(0)
    finally:
        inst.remove()
    assert result.status == "ok", result.meta.get("reason")
    cupti = result.meta["cupti"]
    assert cupti["status"] == "collected", cupti
    passes = result.loss.size
    assert len(cupti["kernels"]) == passes and all(k > 0 for k in cupti["kernels"]), cupti
    assert all(ns > 0 for ns in cupti["kernel_ns"]) and cupti["top_kernels"], cupti
    # both repeats ran the same kernels: the same count per pass
    per_repeat = np.asarray(cupti["kernels"]).reshape(result.loss.shape)
    assert (per_repeat[0] == per_repeat[1]).all(), per_repeat
    seqs, losses = np.asarray(steps.columns["step_seq"]), np.asarray(steps.columns["loss"])
    live = dict(zip(seqs.tolist(), losses.tolist(), strict=True))
    np.testing.assert_allclose(result.loss[:, 2], live[target], atol=1e-4)
